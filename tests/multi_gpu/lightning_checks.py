"""Rank functions for test_lightning.py: each Fabric program under DDP and under
MultiDeepSpeedStrategy in the same ranks, compared rank by rank (see lightning_loops.py)."""
import contextlib
import copy

import torch

import lightning_loops as loops
from common import WORLD_SIZE, expect_error, scale_in_place
from lightning_loops import BASE, zero


def fabric_for(strategy):
    from lightning.fabric import Fabric
    fabric = Fabric(accelerator="cpu", devices=WORLD_SIZE, strategy=strategy, precision="32-true")
    fabric.launch()
    return fabric


def ddp():
    return fabric_for("ddp")


def multi(configs=None, config=None):
    from deepspeed_multi.lightning import MultiDeepSpeedStrategy
    return fabric_for(MultiDeepSpeedStrategy(config=copy.deepcopy(config or BASE), configs=configs))


def done(fabric):
    fabric.strategy.teardown()   # destroys MultiDeepSpeedStrategy's engines, so the next case builds afresh


def engines_built(fabric):
    """(model class, ZeRO stage, trained) of every engine the strategy built."""
    return [(type(e.module).__name__, e.zero_optimization_stage(), e.has_optimizer) for e in fabric.strategy.engines]


def against_ddp(program, configs, what, expect, **kwargs):
    ref_fabric = ddp()
    ref = program(ref_fabric, **kwargs)
    ours_fabric = multi(configs)
    ours = program(ours_fabric, **kwargs)
    assert engines_built(ours_fabric) == expect, (what, engines_built(ours_fabric))
    assert ref["losses"] and all(ref["weights"].values()), what
    loops.compare(ours, ref, what)
    done(ours_fabric)
    return ours


GAN = {"Generator": zero(2), "Discriminator": zero(1)}
GAN_CLIPPED = {"Generator": zero(2, clip=0.1), "Discriminator": zero(1, clip=0.1)}


def fabric_programs():
    """GAN (G ZeRO-2, D ZeRO-1), with and without clipping, and both at ZeRO-2 cleared by
    model.zero_grad(); distillation (student ZeRO-2, frozen teacher ZeRO-3) with fabric.backward, with
    loss.backward() and with the teacher partitioned at construction; text encoder (ZeRO-3, frozen)
    + VAE (ZeRO-0, frozen) + UNet (ZeRO-2) at accumulation 2."""
    gan = [("Generator", 2, True), ("Discriminator", 1, True)]
    against_ddp(loops.gan, GAN, "GAN", gan)
    ours = against_ddp(loops.gan, GAN_CLIPPED, "GAN clipped", gan, clip=0.1)
    assert len(ours["norms"]) == 6 and max(ours["norms"]) > 0.1, ours["norms"]   # some updates were clipped
    # Fabric's DCGAN clears gradients with netD.zero_grad(): D at ZeRO-2 holds G's-loss gradients in its partitions
    against_ddp(loops.gan, {"Generator": zero(2), "Discriminator": zero(2)}, "GAN, model.zero_grad()",
                [("Generator", 2, True), ("Discriminator", 2, True)], module_zero_grad=True)
    distill = {"Student": zero(2), "Teacher": zero(3)}
    built = [("Student", 2, True), ("Teacher", 3, False)]
    against_ddp(loops.distillation, distill, "distillation", built)
    against_ddp(loops.distillation, distill, "distillation, loss.backward()", built, plain_backward=True)
    ours = against_ddp(loops.distillation, distill, "distillation, teacher partitioned at construction", built,
                       teacher_init=lambda f: f.strategy.init_module("Teacher") if hasattr(f.strategy, "init_module")
                       else contextlib.nullcontext())
    assert ours["partitioned_at_construction"], "init_module('Teacher') did not partition at construction"
    against_ddp(loops.text_to_image, {"TextEncoder": zero(3), "VAE": zero(0), "UNet": zero(2)}, "text-to-image",
                [("TextEncoder", 3, False), ("VAE", 0, False), ("UNet", 2, True)])


def fabric_resume(tmp):
    """fabric.save -> a new Fabric, models built from other weights -> fabric.load -> continue equals the
    uninterrupted run: two trained engines (ZeRO-2, ZeRO-1, Adam state), a frozen ZeRO-3 teacher that
    changes in place before the save (as an EMA teacher or a synced reference does) and is built from
    other weights for the resume, a step counter, a tensor and the RNG (the GAN's noise) in one set
    checkpoint."""
    import os
    configs = dict(GAN, Teacher=zero(3))

    def build(seed):
        fabric = multi(configs)
        s = loops.gan_setup(fabric, seed=seed)
        torch.manual_seed(7 + seed)
        s["teacher"] = fabric.setup(loops.Teacher())
        torch.manual_seed(11)
        return fabric, s

    def change_teacher(s):
        scale_in_place(s["teacher"], 0.5)

    def weights(s):
        return loops.trained_weights({"g": s["g"], "d": s["d"], "t": s["teacher"]})

    fabric, s = build(0)
    full = loops.gan_steps(fabric, s, 0, 1)
    change_teacher(s)
    loops.gan_steps(fabric, s, 1, 4, out=full)
    full_w = weights(s)
    done(fabric)

    fabric, s = build(0)
    first = loops.gan_steps(fabric, s, 0, 1)
    change_teacher(s)
    loops.gan_steps(fabric, s, 1, 2, out=first)
    path = os.path.join(tmp, "fabric_ckpt")
    # D still holds the gradients of G's loss, which a checkpoint cannot hold: the save refuses
    # until they are dropped (the loop drops them anyway before D's next backward).
    expect_error(RuntimeError, lambda: fabric.save(path, s), "engine 'd' (Discriminator) holds the gradients")
    s["opt_d"].zero_grad()
    fabric.save(path, dict(s, extra=torch.arange(3.0) * s["step"]))
    done(fabric)

    fabric, s = build(5)                  # other weights for G, D and the teacher: the load must replace them
    state = dict(s, step=0, extra=torch.zeros(3))
    fabric.load(path, state)
    assert state["step"] == 2 and torch.equal(state["extra"], torch.arange(3.0) * 2), state
    rest = loops.gan_steps(fabric, s, state["step"], 4)
    loops.compare({"losses": first["losses"] + rest["losses"], "norms": [], "weights": weights(s)},
                  {"losses": full["losses"], "norms": [], "weights": full_w}, "resumed GAN vs uninterrupted", tol=0)
    done(fabric)


def fabric_bad_input():
    """Each refused at setup, before any step, with what to do."""
    from deepspeed_multi.lightning import with_config
    fabric = multi(GAN)
    g, d = loops.Generator(), loops.Discriminator()
    fabric.setup(d, torch.optim.SGD(d.parameters(), lr=0.1))
    expect_error(ValueError, lambda: fabric.setup(d, torch.optim.SGD(d.parameters(), lr=0.1)),
                 "Discriminator was already set up", "Set each model up once")
    both = torch.optim.SGD(list(g.parameters()) + list(d.parameters()), lr=0.1)
    expect_error(ValueError, lambda: fabric.setup(g, both), "holds 6 parameter(s) that are not Generator's",
                 "Discriminator (parameter 'main.0.weight')", "one optimizer per model")
    g2 = loops.Generator()
    expect_error(ValueError, lambda: fabric.setup(g2, torch.optim.SGD(list(g2.parameters()) + list(g.parameters()),
                                                                    lr=0.1)), "no model given to fabric.setup")
    for own, texts in (({"gradient_accumulation_steps": 2}, ("gradient_accumulation_steps=2", "the loop owns")),
                       ({"train_micro_batch_size_per_gpu": 8}, ("train_micro_batch_size_per_gpu=8",
                                                                "strategy's config 4")),
                       ({"bf16": {"enabled": True}}, ("enables bf16", "precision='32-true'")),
                       ({"optimizer": {"type": "Adam"}}, ("\"optimizer\" section",))):
        m = with_config(loops.Generator(), own)
        expect_error(ValueError, lambda: fabric.setup(m, torch.optim.SGD(m.parameters(), lr=0.1)),
                     "the DeepSpeed config of Generator", *texts)
    g4 = loops.Generator()
    g4, opt4 = fabric.setup(g4, torch.optim.SGD(g4.parameters(), lr=0.1))
    expect_error(ValueError, lambda: fabric.clip_gradients(g4, opt4, max_norm=1.0), "gradient_clipping, which is 0.0",
                 "Set \"gradient_clipping\": 1.0")
    assert engines_built(fabric) == [("Discriminator", 1, True), ("Generator", 2, True)], engines_built(fabric)
    done(fabric)
    fabric, g5 = multi(config=dict(BASE, gradient_accumulation_steps=4)), loops.Generator()
    expect_error(ValueError, lambda: fabric.setup(g5, torch.optim.SGD(g5.parameters(), lr=0.1)),
                 "the strategy's DeepSpeed config sets gradient_accumulation_steps=4")


def trainer_gan(tmp):
    """A LightningModule GAN (generator ZeRO-2, discriminator ZeRO-1, manual optimization) under the
    Trainer against DDP; then saved by ModelCheckpoint after epoch 1 and resumed with ckpt_path= to
    epoch 2, equal to the uninterrupted run."""
    import os
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import DDPStrategy
    import lightning_trainer_loops as tl
    from deepspeed_multi.lightning import MultiDeepSpeedTrainerStrategy

    def ours():
        return MultiDeepSpeedTrainerStrategy(config=copy.deepcopy(BASE),
                                             configs={"generator": zero(2), "discriminator": zero(1)})

    ref, _ = tl.fit(DDPStrategy(find_unused_parameters=True), epochs=2)
    full, trainer = tl.fit(ours(), epochs=2)
    assert ref.losses and len(full.losses) == len(ref.losses) == 12, (len(ref.losses), len(full.losses))
    loops.compare({"losses": full.losses, "norms": [], "weights": tl.weights(full)},
                  {"losses": ref.losses, "norms": [], "weights": tl.weights(ref)}, "Trainer GAN")
    assert full.seen == {("generator", "MultiEngine", 2), ("discriminator", "MultiEngine", 1)}, full.seen
    assert ref.seen == {("generator", "Generator", None), ("discriminator", "Discriminator", None)}, ref.seen
    assert not trainer.strategy.engines   # handed back at teardown

    ckpt_dir = os.path.join(tmp, "trainer_ckpt")
    first, _ = tl.fit(ours(), epochs=1, callbacks=[ModelCheckpoint(dirpath=ckpt_dir, save_top_k=-1)])
    saved = sorted(os.listdir(ckpt_dir))
    assert len(saved) == 1 and os.path.isdir(os.path.join(ckpt_dir, saved[0])), saved
    resumed, trainer = tl.fit(ours(), epochs=2, module=tl.GAN(seed=5), ckpt_path=os.path.join(ckpt_dir, saved[0]))
    assert trainer.current_epoch == 2 and len(resumed.losses) == 6, (trainer.current_epoch, len(resumed.losses))
    loops.compare({"losses": first.losses + resumed.losses, "norms": [], "weights": tl.weights(resumed)},
                  {"losses": full.losses, "norms": [], "weights": tl.weights(full)}, "resumed Trainer GAN", tol=0)


def trainer_ema_distillation_resume(tmp):
    """A frozen ZeRO-3 teacher that changes every step (beside a ZeRO-2 student) against DDP, then saved
    by ModelCheckpoint after epoch 1 and resumed with ckpt_path= into a module whose student and
    teacher are built from other weights: bit-identical to the uninterrupted run."""
    import os
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import DDPStrategy
    import lightning_trainer_loops as tl
    from deepspeed_multi.lightning import MultiDeepSpeedTrainerStrategy

    def ours():
        return MultiDeepSpeedTrainerStrategy(config=copy.deepcopy(BASE), configs={"student": zero(2),
                                                                                  "teacher": zero(3)})

    ref, _ = tl.fit(DDPStrategy(find_unused_parameters=True), epochs=2, module=tl.EmaDistillation())
    full, _ = tl.fit(ours(), epochs=2, module=tl.EmaDistillation())
    loops.compare({"losses": full.losses, "norms": [], "weights": full.final},
                  {"losses": ref.losses, "norms": [], "weights": ref.final}, "Trainer EMA distillation")
    ckpt_dir = os.path.join(tmp, "ema_ckpt")
    first, _ = tl.fit(ours(), epochs=1, module=tl.EmaDistillation(), callbacks=[ModelCheckpoint(dirpath=ckpt_dir,
                                                                                               save_top_k=-1)])
    saved = sorted(os.listdir(ckpt_dir))
    resumed, trainer = tl.fit(ours(), epochs=2, module=tl.EmaDistillation(seed=5),
                              ckpt_path=os.path.join(ckpt_dir, saved[0]))
    assert trainer.current_epoch == 2, trainer.current_epoch
    loops.compare({"losses": first.losses + resumed.losses, "norms": [], "weights": resumed.final},
                  {"losses": full.losses, "norms": [], "weights": full.final}, "resumed Trainer EMA distillation",
                  tol=0)


def trainer_distillation_and_bad_input():
    """A frozen teacher attribute at ZeRO-3 beside a ZeRO-2 student, against DDP; a LightningModule
    with automatic optimization, or one optimizer over two models, is refused before any step."""
    from lightning.pytorch.strategies import DDPStrategy
    import lightning_trainer_loops as tl
    from deepspeed_multi.lightning import MultiDeepSpeedTrainerStrategy

    def ours(**configs):
        return MultiDeepSpeedTrainerStrategy(config=copy.deepcopy(BASE), configs=configs)

    ref, _ = tl.fit(DDPStrategy(find_unused_parameters=True), epochs=1, module=tl.Distillation())
    mine, _ = tl.fit(ours(student=zero(2), teacher=zero(3)), epochs=1, module=tl.Distillation())
    assert mine.seen == {("student", "MultiEngine"), ("teacher", "MultiEngine")}, mine.seen
    loops.compare({"losses": mine.losses, "norms": [], "weights": {"student": dict(mine.student.named_parameters())}},
                  {"losses": ref.losses, "norms": [],
                   "weights": {"student": dict(ref.student.named_parameters())}}, "Trainer distillation")
    expect_error(ValueError, lambda: tl.fit(ours(), epochs=1, module=tl.Automatic()), "automatic optimization",
                 "self.automatic_optimization = False")
    expect_error(ValueError, lambda: tl.fit(ours(), epochs=1, module=tl.OneOptimizer()),
                 "by model: generator (6), discriminator (6)", "one optimizer per model")
    expect_error(ValueError, lambda: tl.fit(ours(critic=zero(3)), epochs=1), "configs names ['critic']")
