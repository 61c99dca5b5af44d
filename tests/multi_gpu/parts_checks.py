"""One model, several ZeRO stages (deepspeed_multi/parts): a tiny multimodal model (ViT encoder ->
projector -> Llama through inputs_embeds) trained as parts, against the same model in plain PyTorch
on the same global batch (one AdamW with a no-decay group, one LambdaLR, clip on the whole norm)."""
import copy
import os
import tempfile

import torch
import torch.nn as nn

import deepspeed.comm as dist
import hf_models as hm
from common import FP32_TOL, ds_config, expect_error, full_params

import deepspeed_multi

IMAGE_TOKENS = 5  # (8 / 4) ** 2 patches + CLS


class MM(nn.Module):
    """The LLaVA layout: vision_tower -> projector -> language_model(inputs_embeds=...)."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.vision_tower = hm.vit_encoder()
        self.projector = nn.Sequential(nn.Linear(hm.HIDDEN, hm.HIDDEN), nn.GELU(), nn.Linear(hm.HIDDEN, hm.HIDDEN))
        self.language_model = hm.causal_lm()

    def forward(self, pixel_values, input_ids, labels):
        image = self.vision_tower(pixel_values=pixel_values.to(self.projector[0].weight.dtype)).last_hidden_state
        image = self.projector(image)
        text = self.language_model.get_input_embeddings()(input_ids)
        embeds = torch.cat([image.to(text.dtype), text], dim=1)
        ignore = torch.full((labels.shape[0], image.shape[1]), -100, dtype=labels.dtype, device=labels.device)
        return self.language_model(inputs_embeds=embeds, labels=torch.cat([ignore, labels], dim=1)).loss


def batch(step, rank, n=2, length=6):
    g = torch.Generator().manual_seed(7919 * step + rank)
    ids = hm.tokens(g, n, length)
    return {"pixel_values": torch.randn(n, 3, 8, 8, generator=g), "input_ids": ids, "labels": ids.clone()}


def on_device(engine, b):
    """The batch on the engine's device (a GPU rank's engine holds its model there; the references run on CPU)."""
    return {k: v.to(engine.device) for k, v in b.items()}


def groups(model, weight_decay=0.1):
    trainable = [p for p in model.parameters() if p.requires_grad]
    # A parameter partitioned by zero.Init holds an empty tensor: its shape is ds_shape.
    decay = [p for p in trainable if len(getattr(p, "ds_shape", p.shape)) >= 2]
    no_decay = [p for p in trainable if len(getattr(p, "ds_shape", p.shape)) < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def schedule(step):
    return 1.0 / (1.0 + step)  # a learning rate that changes at every update


def case_config(top_stage, submodules, gas, clip, dtype="fp32"):
    cfg = ds_config(stage=top_stage, dtype=dtype, gas=gas, micro_bs=2, gradient_clipping=clip)
    cfg["deepspeed_multi"] = {"submodules": {name: {"zero_optimization": {"stage": s}}
                                             for name, s in submodules.items()}}
    return cfg


def make_model(prepare=None):
    model = MM()
    return prepare(model) or model if prepare is not None else model


def reference(windows, gas, clip, lr, world, prepare=None):
    model = make_model(prepare)
    opt = torch.optim.AdamW(groups(model), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    norms = []
    for step in range(windows * gas):
        for r in range(world):
            (model(**batch(step, r)) / (world * gas)).backward()
        if (step + 1) % gas == 0:
            trainable = [p for p in model.parameters() if p.requires_grad]
            norms.append(float(torch.nn.utils.clip_grad_norm_(trainable, clip if clip > 0 else float("inf"))))
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
    return model, norms


def train(engine, windows, gas, start=0):
    rank = dist.get_rank()
    norms = []
    for step in range(start, windows * gas):
        loss = engine(**on_device(engine, batch(step, rank)))
        loss.backward()
        engine.step()
        if (step + 1) % gas == 0:
            norms.append(engine.get_global_grad_norm())
    return norms


def build(top_stage, submodules, gas, clip, lr, dtype="fp32", prepare=None, scheduler_on_returned=False):
    """``scheduler_on_returned``: the scheduler is built over the optimizer initialize returns (DeepSpeed's
    callable form; Trainer's scheduler is built over it too) instead of over the client optimizer."""
    model = make_model(prepare)
    opt = torch.optim.AdamW(groups(model), lr=lr)
    if scheduler_on_returned:
        sched = lambda returned: torch.optim.lr_scheduler.LambdaLR(returned, schedule)  # noqa: E731
    else:
        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    engine, optimizer, _, scheduler = deepspeed_multi.initialize(
        model=model, optimizer=opt, lr_scheduler=sched, config=case_config(top_stage, submodules, gas, clip, dtype))
    return engine, optimizer, scheduler


def check_exact(top_stage, submodules, gas, clip=0.5, windows=3, lr=1e-2, prepare=None, label="", generate=False):
    """fp32: every parameter, the logged norms and the learning rate equal plain PyTorch's (1e-5).
    ``prepare(model)`` (gradient checkpointing, adapters, frozen parts) runs on both models."""
    what = f"top ZeRO-{top_stage}, parts {submodules}, gas {gas}, clip {clip} {label}"
    engine, optimizer, scheduler = build(top_stage, submodules, gas, clip, lr, prepare=prepare)
    stages = engine.zero_optimization_stages()
    for name, stage in submodules.items():
        assert stages[name] == stage, (what, stages)
    if len(stages) > len(submodules):
        assert stages["_rest"] == top_stage, (what, stages)
    assert isinstance(engine.module, MM) and engine.module.language_model is not None
    got_norms = train(engine, windows, gas)
    ref, want_norms = reference(windows, gas, clip, lr, dist.get_world_size(), prepare)
    assert set(engine.module.state_dict()) == set(ref.state_dict()), what
    for got, want in zip(got_norms, want_norms):
        assert abs(got - want) <= 1e-5 * max(1.0, want), (what, got_norms, want_norms)
    if clip > 0:
        assert max(want_norms) > clip, f"{what}: the clip never engaged (norms {want_norms}); the case tests nothing"
    assert abs(engine.get_lr()[0] - scheduler.get_last_lr()[0]) < 1e-12 and abs(
        scheduler.get_last_lr()[0] - lr * schedule(windows)) < 1e-12, (what, engine.get_lr(), scheduler.get_last_lr())
    assert optimizer.param_groups[0]["lr"] == scheduler.get_last_lr()[0]
    got = full_params(engine.module)
    want = {n: p.detach().float() for n, p in ref.named_parameters()}
    err = max((got[n] - want[n]).abs().max().item() for n in want)
    moved = max((want[n] - p.detach().float()).abs().max().item() for n, p in make_model(prepare).named_parameters())
    assert moved > 1e-3, f"{what}: the reference did not move"
    assert err <= FP32_TOL, f"{what}: max abs error {err:.3e} vs plain PyTorch"
    if generate:  # the ZeRO-3 part called on its own, through Transformers' generate()
        prompt = batch(0, 0)["input_ids"][:1, :4]
        with torch.no_grad():
            got = engine.module.language_model.generate(prompt.to(engine.device), max_new_tokens=4,
                                                        do_sample=False).cpu()
            want = ref.language_model.generate(prompt, max_new_tokens=4, do_sample=False)
        assert torch.equal(got, want), (what, got, want)
    return err


def check_resume(top_stage, submodules, gas, clip=0.5, windows=4, lr=1e-2, via_set=False, scheduler_on_returned=False):
    """Save after two windows, resume in freshly built engines and train two more: the same weights as an
    uninterrupted run (two updates after the resume, so a learning rate that the resume fails to hand on
    from the scheduler to the parts shows). ``via_set``: through deepspeed_multi.save_checkpoint /
    load_checkpoint of a set holding the model. ``scheduler_on_returned``: see build()."""
    rank = dist.get_rank()
    engine, _, _ = build(top_stage, submodules, gas, clip, lr, scheduler_on_returned=scheduler_on_returned)
    train(engine, 2, gas)
    root = [tempfile.mkdtemp(prefix="dsm_parts_") if rank == 0 else None]
    dist.broadcast_object_list(root, src=0)
    if via_set:
        deepspeed_multi.save_checkpoint(root[0], {"mm": engine}, client_state={"windows": 2})
    else:
        engine.save_checkpoint(root[0], client_state={"windows": 2})
    resumed, _, _ = build(top_stage, submodules, gas, clip, lr, scheduler_on_returned=scheduler_on_returned)
    if via_set:
        client_state = deepspeed_multi.load_checkpoint(root[0], {"mm": resumed})
    else:
        _, client_state = resumed.load_checkpoint(root[0])
    assert client_state == {"windows": 2}, client_state
    train(resumed, windows, gas, start=2 * gas)
    ref, _ = reference(windows, gas, clip, lr, dist.get_world_size())
    got = full_params(resumed.module)
    err = max((got[n] - p.detach().float()).abs().max().item() for n, p in ref.named_parameters())
    assert err <= FP32_TOL, f"resume {top_stage} {submodules}: max abs error {err:.3e}"
    dist.barrier()
    if rank == 0:
        import shutil
        shutil.rmtree(root[0], ignore_errors=True)




def freeze_vision(model):
    model.vision_tower.requires_grad_(False)


def checkpointing(reentrant):
    def prepare(model):
        model.language_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    return prepare


def lora(model):
    from peft import LoraConfig, get_peft_model
    model.language_model = get_peft_model(model.language_model, LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]))


def lora_checkpointed(model):
    lora(model)
    model.language_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})


def part_params(engine):
    """Model parameter name -> full fp32 value, read part by part (the fp32 master weights of a 16-bit part)."""
    out = {}
    for name, part in engine.parts.items():
        prefix = "" if name == "_rest" else name + "."
        for n, v in full_params(part).items():
            out[prefix + n.replace("/", ".")] = v
    return out


def _cosine_and_ratio(got, want, initial):
    dg = torch.cat([(got[n] - initial[n]).flatten() for n in sorted(want)])
    dw = torch.cat([(want[n] - initial[n]).flatten() for n in sorted(want)])
    return float(torch.nn.functional.cosine_similarity(dg, dw, dim=0)), float(dg.norm() / dw.norm())


def check_16bit(dtype, gas=2, windows=3, poisoned=1, clip=0.5, lr=1e-2):
    """bf16/fp16 parts (encoder side ZeRO-2, LLM ZeRO-3): the update's cosine with plain fp32 PyTorch
    > 0.99 and its norm within 5%. fp16: an overflow in the encoder's gradients only (window
    ``poisoned``) skips the whole model's update (every part unchanged, the schedule held), as a
    GradScaler skips the whole optimizer step."""
    what = f"{dtype} parts, gas {gas}"
    rank, world = dist.get_rank(), dist.get_world_size()
    engine, _, scheduler = build(2, {"language_model": 3}, gas, clip, lr, dtype=dtype)
    assert engine.zero_optimization_stages() == {"language_model": 3, "_rest": 2}
    poison = {"on": False}

    def poison_output(module, args, output):
        if poison["on"]:
            output.last_hidden_state.register_hook(lambda g: g * float("inf"))

    engine.module.vision_tower.register_forward_hook(poison_output)
    initial = part_params(engine)
    for step in range(windows * gas):
        window = step // gas
        poison["on"] = dtype == "fp16" and window == poisoned and step % gas == 0
        if dtype == "fp16" and window == poisoned and step % gas == 0:
            before = part_params(engine)
        engine(**on_device(engine, batch(step, rank))).backward()
        engine.step()
        if dtype == "fp16" and window == poisoned and (step + 1) % gas == 0:
            after = part_params(engine)
            moved = {n: (after[n] - before[n]).abs().max().item() for n in before}
            assert max(moved.values()) == 0, f"{what}: the overflowing window moved {max(moved, key=moved.get)}"
            assert engine.skipped_steps == 1 and all(p.skipped_steps == 1 for p in engine.parts.values()), what
    assert engine.skipped_steps == (1 if dtype == "fp16" else 0), what
    assert scheduler.last_epoch == windows - engine.skipped_steps, (what, scheduler.last_epoch)
    # The reference: fp32, the poisoned window's update skipped (its gradients dropped, the schedule held).
    model = MM()
    opt = torch.optim.AdamW(groups(model), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    for step in range(windows * gas):
        for r in range(world):
            (model(**batch(step, r)) / (world * gas)).backward()
        if (step + 1) % gas == 0:
            if dtype == "fp16" and step // gas == poisoned:
                opt.zero_grad(set_to_none=True)
                continue
            if clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
    want = {n: p.detach().float() for n, p in model.named_parameters()}
    cosine, ratio = _cosine_and_ratio(part_params(engine), want, initial)
    assert cosine > 0.99 and abs(ratio - 1) < 0.05, f"{what}: update cosine {cosine:.4f}, norm ratio {ratio:.4f}"
    return cosine, ratio


def check_zero_init(top_stage, submodules, gas, clip=0.5, windows=2, lr=1e-2):
    """Built inside deepspeed_multi.zero_init(config): the ZeRO-3 parts are partitioned at construction,
    the others are plain parameters; training from those weights equals plain PyTorch from the same ones."""
    what = f"zero_init: top ZeRO-{top_stage}, parts {submodules}, gas {gas}"
    config = case_config(top_stage, submodules, gas, clip)
    with deepspeed_multi.zero_init(config):
        model = MM()
    _freeze_key_biases(model)
    zero3 = [n for n, s in submodules.items() if s == 3] + (["_rest"] if top_stage == 3 else [])
    for name, p in model.named_parameters():
        in_zero3 = any(name.startswith(part + ".") for part in zero3) or (
            "_rest" in zero3 and not any(name.startswith(part + ".") for part in submodules))
        assert hasattr(p, "ds_id") == in_zero3, (what, name, "partitioned" if hasattr(p, "ds_id") else "plain")
        if in_zero3 and p.ds_numel >= 2 * dist.get_world_size():
            assert p.ds_tensor.numel() < p.ds_numel, (what, name, "not partitioned")
    initial = full_params(model)
    for t in initial.values():  # every rank starts from the same weights (zero.Init broadcasts rank 0's)
        other = t.clone()
        dist.broadcast(other, src=0)
        assert torch.equal(other, t), what
    _train_from_built(model, initial, config, windows, gas, clip, lr, what)


def check_built_whole_at_zero3(windows=2, gas=2, clip=0.5, lr=1e-2):
    """The model built partitioned as a whole (Transformers under TrainingArguments with a top-level
    stage 3: zero.Init with that config), the optimizer built before initialize (as Trainer does), the
    vision tower declared ZeRO-1: initialize makes its parameters plain again, and training is exact."""
    import deepspeed

    from deepspeed_multi.integrations.hf_config import hf_deepspeed_config
    config = case_config(3, {"vision_tower": 1}, gas, clip)
    whole = {k: v for k, v in config.items() if k != "deepspeed_multi"}
    with hf_deepspeed_config(whole), deepspeed.zero.Init(config_dict_or_path=whole):
        model = MM()
    _freeze_key_biases(model)
    assert all(hasattr(p, "ds_id") for p in model.parameters())
    initial = full_params(model)
    engine = _train_from_built(model, initial, config, windows, gas, clip, lr, "built whole at ZeRO-3")
    for name, p in engine.module.named_parameters():
        assert hasattr(p, "ds_id") == (not name.startswith("vision_tower.")), name


def _train_from_built(model, initial, config, windows, gas, clip, lr, what):
    """Train ``model`` (weights ``initial``) as parts, the optimizer built before initialize as Trainer
    does; every weight equals plain PyTorch's from the same weights (1e-5). Returns the engine."""
    opt = torch.optim.AdamW(groups(model), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    engine, _, _, _ = deepspeed_multi.initialize(model=model, optimizer=opt, lr_scheduler=sched, config=config)
    train(engine, windows, gas)
    ref, _ = reference(windows, gas, clip, lr, dist.get_world_size(), prepare=_loads(initial))
    got = full_params(engine.module)
    errs = {n: (got[n] - p.detach().float()).abs().max().item() for n, p in ref.named_parameters()}
    worst = max(errs, key=errs.get)
    assert errs[worst] <= FP32_TOL, f"{what}: max abs error {errs[worst]:.3e} at {worst}"
    return engine


def _freeze_key_biases(model):
    """A key bias shifts every score of a query equally, which softmax ignores: its true gradient is 0 and
    what arrives is rounding noise, which Adam turns into steps of +-lr that no two summation orders share
    (the reference matched by chance on plainly built weights, not on those zero.Init builds)."""
    for name, p in model.named_parameters():
        if name.endswith("k_proj.bias") or name.endswith("attention.key.bias"):
            p.requires_grad_(False)


def _loads(params):
    def prepare(model):
        _freeze_key_biases(model)
        missing, unexpected = model.load_state_dict(params, strict=False)
        assert not unexpected and set(missing) <= {n for n, _ in model.named_buffers()}, (missing, unexpected)
    return prepare


def run_stages():
    """The encoder side at ZeRO 0, 1 and 2 beside the LLM at ZeRO-3, gas 1 and 2, clip on."""
    for enc in (0, 1, 2):
        for gas in (1, 2):
            check_exact(enc, {"language_model": 3}, gas, generate=(enc, gas) == (2, 2))
    check_exact(1, {"vision_tower": 2, "language_model": 3}, 2)  # three parts: projector is the rest
    check_exact(3, {"vision_tower": 2}, 2, clip=0.0)  # the rest (projector + LLM) at ZeRO-3
    check_exact(2, {"vision_tower": 3, "language_model": 3}, 2, prepare=freeze_vision, label="frozen ZeRO-3 vision")


def run_features():
    """Checkpointing and LoRA inside the ZeRO-3 part; 16-bit with an overflow in one part; resume."""
    check_exact(2, {"language_model": 3}, 2, prepare=checkpointing(False), label="non-reentrant checkpointing")
    check_exact(2, {"language_model": 3}, 2, prepare=checkpointing(True), label="reentrant checkpointing")
    check_exact(2, {"language_model": 3}, 2, prepare=lora, clip=0.1, label="LoRA")
    check_exact(1, {"language_model": 3}, 1, prepare=lora_checkpointed, clip=0.1, label="LoRA + reentrant")
    check_16bit("bf16")
    check_16bit("fp16", clip=0.0)  # the skip group alone keeps the parts together
    check_16bit("fp16")  # and with the clip's whole-model norm (inf when any part overflows)
    check_resume(2, {"language_model": 3}, 2)
    check_resume(1, {"vision_tower": 2, "language_model": 3}, 2, via_set=True)
    check_resume(2, {"language_model": 3}, 1, scheduler_on_returned=True)


def check_destroy_and_rebuild(windows=2, gas=2, clip=0.5, lr=1e-2):
    """A parted engine's destroy() hands the model back: parts built again over it train bit-equal to
    parts built over a fresh model holding the same values; the destroyed engine refuses use."""
    engine, _, _ = build(2, {"language_model": 3}, gas, clip, lr)
    train(engine, windows, gas)
    engine.destroy()
    expect_error(RuntimeError, lambda: engine(**batch(0, 0)), "after engine.destroy()")
    model, fresh = engine.module, make_model()
    fresh.load_state_dict(full_params(model))
    built = []
    for m in (model, fresh):
        opt = torch.optim.AdamW(groups(m), lr=lr)
        built.append(deepspeed_multi.initialize(model=m, optimizer=opt, config=case_config(2, {"language_model": 3},
                                                                                            gas, clip))[0])
    norms = [train(e, 2 * windows, gas, start=windows * gas) for e in built]
    assert norms[0] == norms[1], norms
    got, want = (full_params(e.module) for e in built)
    assert all(torch.equal(got[n], want[n]) for n in want), "parts over the handed-back model differ from a fresh one's"
    for e in built:
        e.destroy()


def run_construction():
    """deepspeed_multi.zero_init with declared submodules: only the ZeRO-3 parts partitioned at construction;
    destroy() and parts built again over the same model."""
    check_destroy_and_rebuild()
    check_zero_init(2, {"language_model": 3}, 2)
    check_zero_init(3, {"vision_tower": 1}, 1)  # the rest (projector + LLM) is the ZeRO-3 part
    check_from_pretrained_in_zero_init()
    check_built_whole_at_zero3()


# ------------------------------------------------------------------------------ Trainer
IMAGE_TOKEN = hm.VOCAB - 1


def llava():
    """A tiny LlavaForConditionalGeneration (CLIP vision tower, projector, Llama) from configs."""
    from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration
    vision = CLIPVisionConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=hm.HIDDEN, intermediate_size=32,
                              num_hidden_layers=1, num_attention_heads=2, projection_dim=hm.HIDDEN)
    config = LlavaConfig(vision_config=vision, text_config=hm.llama_config(), image_token_index=IMAGE_TOKEN,
                         vision_feature_layer=-1, vision_feature_select_strategy="full", projector_hidden_act="gelu")
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config)
    for name, p in model.named_parameters():
        if name.endswith("k_proj.bias"):
            # A key bias shifts every score of a query equally, which softmax ignores: its true gradient
            # is 0 and what arrives is rounding noise, which Adam turns into steps of +-lr in any two runs.
            p.requires_grad_(False)
    return model


class ImageTextData(torch.utils.data.Dataset):
    """Five image tokens (4 patches + CLS) then text; the labels ignore the image positions."""

    def __init__(self, n=24, length=6, seed=11):
        g = torch.Generator().manual_seed(seed)
        text = torch.randint(3, hm.VOCAB - 1, (n, length), generator=g)
        self.ids = torch.cat([torch.full((n, IMAGE_TOKENS), IMAGE_TOKEN), text], dim=1)
        self.pixels = torch.randn(n, 3, 8, 8, generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        labels = self.ids[i].clone()
        labels[:IMAGE_TOKENS] = -100
        return {"input_ids": self.ids[i], "pixel_values": self.pixels[i], "labels": labels}


def parts_trainer_config(encoder_stage=1, rest_stage=2):
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto", "zero_allow_untested_optimizer": True,
            "zero_optimization": {"stage": rest_stage},
            "deepspeed_multi": {"submodules": {
                "model.language_model": {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                                               "stage3_gather_16bit_weights_on_model_save": True}},
                "model.vision_tower": {"zero_optimization": {"stage": encoder_stage}}}}}


def check_from_pretrained_in_zero_init():
    """LLaVA's from_pretrained inside zero_init with the LLM declared ZeRO-3: the LLM is partitioned and
    loaded, the vision tower and projector are plain parameters, and every weight is the saved one."""
    from transformers import LlavaForConditionalGeneration

    import trainer_checks as tc
    saved = llava()
    out = tc._shared_tmp()
    if dist.get_rank() == 0:
        saved.save_pretrained(out)
    dist.barrier()
    config = parts_trainer_config()
    config.update(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=1, gradient_clipping=0.0)
    with deepspeed_multi.zero_init(config):
        model = LlavaForConditionalGeneration.from_pretrained(out)
    for name, p in model.named_parameters():
        assert hasattr(p, "ds_id") == name.startswith("model.language_model."), name
    got, want = full_params(model), dict(saved.named_parameters())
    assert set(got) == set(want), set(got) ^ set(want)
    diff = {n: (got[n] - want[n].float()).abs().max().item() for n in want}
    worst = max(diff, key=diff.get)
    assert diff[worst] == 0, f"from_pretrained in zero_init: {worst} differs from the saved weight by {diff[worst]:.3e}"


def run_llava_trainer(trainer_cls, gas, deepspeed=None, out=None, resume=None, evaluate_first=False, **kw):
    import trainer_checks as tc
    tc._fresh_process_state()
    out = out or tc._shared_tmp()
    trainer = trainer_cls(model=llava(), args=tc._args(out, gas, 0.5, copy.deepcopy(deepspeed), **kw),
                          train_dataset=ImageTextData(), eval_dataset=ImageTextData(8, seed=5))
    if evaluate_first:  # (a ZeRO-3 config: evaluate() builds an inference engine, train() lets go of it)
        trainer.evaluate()
        from deepspeed_multi.parts.engine import PartedEngine
        assert isinstance(trainer.model_wrapped, PartedEngine) and not trainer.model_wrapped.has_optimizer
    return tc._train(trainer, resume)


def trainer_parts_vs_ddp(gas=2):
    """TrainingArguments(deepspeed=<config with submodules>) on LLaVA: the LLM at ZeRO-3, the vision
    tower at ZeRO-1, the projector and lm_head at ZeRO-2; losses, grad_norm, learning rate,
    evaluation losses every 2 steps and weights equal a DDP Trainer's, with gradient checkpointing
    too, and after an evaluate() before train() (ZeRO-3 rest); save_model -> from_pretrained gives
    the trained weights; a resume from the step-2 checkpoint equals the uninterrupted run."""
    from transformers import LlavaForConditionalGeneration, Trainer

    import trainer_checks as tc
    from deepspeed_multi.transformers import Trainer as MultiTrainer
    want_logs, want_weights, ddp = run_llava_trainer(Trainer, gas, **tc.EVAL_EVERY_2)
    cfg = parts_trainer_config()
    out = tc._shared_tmp()
    logs, weights, trainer = run_llava_trainer(MultiTrainer, gas, deepspeed=cfg, out=out, save_strategy="steps",
                                               save_steps=2, **tc.EVAL_EVERY_2)
    (engine, ) = trainer.accelerator.engines()
    assert engine.zero_optimization_stages() == {"model.language_model": 3, "model.vision_tower": 1, "_rest": 2}
    assert set(weights) == set(want_weights)
    tc.compare((logs, weights), (want_logs, want_weights), f"LLaVA in parts, gas {gas}")
    tc.compare_evals(trainer, ddp, "LLaVA in parts")
    # TrainingArguments(gradient_checkpointing=True), which the DDP Trainer cannot run on this model
    # (DDP: "Expected to have finished reduction in the prior iteration"), against DDP without it.
    checkpointed = run_llava_trainer(MultiTrainer, gas, deepspeed=cfg, gradient_checkpointing=True)
    tc.compare(checkpointed[:2], (want_logs, want_weights), f"LLaVA in parts, gas {gas}, gradient checkpointing")
    after_eval = run_llava_trainer(MultiTrainer, gas, deepspeed=parts_trainer_config(rest_stage=3),
                                   evaluate_first=True, per_device_eval_batch_size=2)
    tc.compare(after_eval[:2], (want_logs, want_weights), "LLaVA in parts (ZeRO-3 rest), evaluate() then train()")
    trainer.save_model(os.path.join(out, "final"))
    dist.barrier()
    loaded = LlavaForConditionalGeneration.from_pretrained(os.path.join(out, "final"))
    err = max((p.float() - weights[n].cpu()).abs().max().item() for n, p in loaded.named_parameters())  # loaded on CPU
    assert err == 0, f"save_model -> from_pretrained differs from the trained weights by {err:.3e}"
    resumed, rweights, _ = run_llava_trainer(MultiTrainer, gas, deepspeed=cfg, out=out,
                                             resume=os.path.join(out, "checkpoint-2"))
    assert [h["step"] for h in resumed] == [h["step"] for h in logs], (resumed, logs)
    tc.compare((resumed, rweights), (logs, weights), "LLaVA in parts resumed at step 2")


def trainer_parts_resume_across_epochs(gas=2):
    """LLaVA in parts under Trainer for 8 updates, 3 an epoch, with a cosine schedule after 2 warm-up
    steps and weight decay, a checkpoint at every step: equal to a DDP Trainer (1e-5); resumed from the
    checkpoint inside the first epoch (step 2), at its end (3) and at the end of the second (6), each
    run ends bit-identical to the uninterrupted one, its logged steps too. Every resume runs at least
    two updates and crosses an epoch boundary or starts one. (Trainer saves only at the end of an
    accumulation window, so no checkpoint lies inside one.)"""
    from transformers import Trainer

    import trainer_checks as tc
    from deepspeed_multi.transformers import Trainer as MultiTrainer
    job = tc.ACROSS_EPOCHS
    cfg = parts_trainer_config()
    out = tc._shared_tmp()
    logs, weights, _ = run_llava_trainer(MultiTrainer, gas, deepspeed=cfg, out=out, **job)
    tc.compare((logs, weights), run_llava_trainer(Trainer, gas, **job)[:2], "LLaVA in parts, 8 updates")
    for step in (2, 3, 6):
        # (A resume writes its later checkpoints elsewhere: a set checkpoint's tag is never overwritten.)
        resumed = run_llava_trainer(MultiTrainer, gas, deepspeed=cfg, out=tc._shared_tmp(),
                                    resume=os.path.join(out, f"checkpoint-{step}"), **job)
        tc.compare_bitwise(resumed[:2], (logs, weights), f"LLaVA in parts resumed at step {step}")
