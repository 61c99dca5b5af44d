"""Rank functions: the Accelerator API around the loops (checkpoints, state dicts, clipping,
accumulate, launch-time config file, mixed precision, errors) and Transformers models as engines."""
import copy
import json
import logging
import os

import torch

import deepspeed.comm as dist

import hf_models as hm
from common import FP32_TOL, MLP, Records, expect_error, full_params
from hf_common import LR, lr_lambda, reset_accelerate
from hf_loops import cfg


def _accelerator(**plugin_configs):
    from accelerate.utils import DeepSpeedPlugin

    from deepspeed_multi.accelerate import Accelerator
    reset_accelerate()
    return Accelerator(deepspeed_plugins={n: DeepSpeedPlugin(hf_ds_config=copy.deepcopy(c))
                                          for n, c in plugin_configs.items()})


def _expect(exc_type, text, fn, *args, **kwargs):
    return expect_error(exc_type, lambda: fn(*args, **kwargs), text)


def _batch(step):
    g = torch.Generator().manual_seed(100 * step + dist.get_rank())
    return torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)


def _train_chain(acc, a, b, opts, scheds, steps, start):
    for step in range(start, start + steps):
        x, y = _batch(step)
        acc.backward(((b(a(x)) - y)**2).mean())
        for opt, sched in zip(opts, scheds):
            opt.step()
            sched.step()
            opt.zero_grad()


def _prepare_chain(acc, names=("a", "b")):
    out = []
    for i, name in enumerate(names):
        acc.state.select_deepspeed_plugin(name)
        model = MLP(seed=i + 1)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        out.append(acc.prepare(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)))
    (a, oa, sa), (b, ob, sb) = out
    return a, b, [oa, ob], [sa, sb]


def save_load_state(path):
    """save_state / load_state round trip: two trained engines (ZeRO-2, ZeRO-3) with schedulers and
    frozen engines whose state changes after every step: a ZeRO-3 EMA of engine a, and a ZeRO-0 one
    with BatchNorm in train mode (its running statistics differ rank by rank). After load_state,
    training continues exactly as it did after save_state, for every model and buffer."""
    from frozen_state_checks import Prior, _update_teacher
    acc = _accelerator(a=cfg(2), b=cfg(3), ema=cfg(3), prior=cfg(0))
    a, b, opts, scheds = _prepare_chain(acc)
    acc.state.select_deepspeed_plugin("ema")
    ema = acc.prepare(MLP(seed=9).requires_grad_(False))
    acc.state.select_deepspeed_plugin("prior")
    prior = acc.prepare(Prior(seed=7, bn_train=True))

    def train(start):
        for step in range(start, start + 2):
            x, y = _batch(step)
            acc.backward(((b(prior(a(x))) - y)**2).mean())
            for opt, sched in zip(opts, scheds):
                opt.step()
                sched.step()
                opt.zero_grad()
            _update_teacher(ema.module, a.module, step, "ema")

    def state():
        return ({n: full_params(m) for n, m in (("a", a), ("b", b), ("ema", ema), ("prior", prior))},
                {k: v.clone() for k, v in prior.module.named_buffers()}, [s.get_last_lr() for s in scheds])

    train(0)
    acc.save_state(path)
    train(2)
    want = state()
    acc.load_state(path)
    train(2)
    got = state()
    for name in want[0]:
        err = max((got[0][name][k] - want[0][name][k]).abs().max().item() for k in want[0][name])
        assert err <= FP32_TOL, f"load_state then training: engine {name} off by {err:.3e}"
    for k in want[1]:
        assert torch.equal(got[1][k], want[1][k]), f"load_state then training: prior buffer {k} on rank " \
            f"{dist.get_rank()}: {got[1][k]} != {want[1][k]}"
    assert got[2] == want[2], f"learning rates after load_state {got[2]} != {want[2]}"
    assert acc.unwrap_model(ema) is ema.module
    return {"save_load_state": "exact"}


def api_surface(config_path):
    """unwrap_model, get_state_dict (per engine's own stage), clip_grad_norm_, accumulate, bad input."""
    report = {}
    acc = _accelerator(a=cfg(2, gradient_clipping=1.0), b=cfg(3), c=cfg(3, gas=2))
    a, b, opts, scheds = _prepare_chain(acc)
    _train_chain(acc, a, b, opts, scheds, 1, 0)
    assert acc.unwrap_model(a) is a.module and acc.unwrap_model(b) is b.module
    sd = acc.get_state_dict(a)
    assert set(sd) == set(a.module.state_dict()) and sd["fc1.weight"].shape == (16, 8)
    report["get_state_dict_z3"] = _expect(ValueError, "stage3_gather_16bit_weights_on_model_save", acc.get_state_dict, b)
    norm = acc.clip_grad_norm_(a.parameters(), 1.0)
    assert norm is not None and float(norm) > 0, norm
    report["clip_grad_norm_mismatch"] = _expect(ValueError, "gradient_clipping", acc.clip_grad_norm_, b.parameters(), 1.0)
    acc.state.select_deepspeed_plugin("c")
    model = MLP(seed=5)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    c, _ = acc.prepare(model, opt)
    assert c.gradient_accumulation_steps() == 2 and acc.gradient_accumulation_steps == 2
    late = acc.prepare(torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda))   # prepared after its model
    from deepspeed_multi.accelerate import UpdateScheduler
    assert isinstance(late, UpdateScheduler) and late.engine_optimizer.engine is c, type(late)
    with acc.accumulate(c):           # same accumulation as the Accelerator's: allowed
        pass
    report["accumulate_mismatch"] = _expect(ValueError, "accumulates over 1 steps", acc.accumulate(a).__enter__)
    report["bad_plugin"] = _expect(TypeError, "expected a plugin name", acc.prepare, MLP(), deepspeed_plugin=3)
    report["bad_plugin_path"] = _expect(ValueError, "reading it as a config failed", acc.prepare, MLP(),
                                        deepspeed_plugin="no/such/config.json")
    report["two_models"] = _expect(ValueError, "one model per call", acc.prepare, MLP(), MLP())
    report["closure"] = _expect(ValueError, "closure", opts[0].step, lambda: 0.0)
    return report


def launch_config_file(config_path):
    """What `accelerate launch --use_deepspeed --deepspeed_config_file F` sets up: the file's config is the
    default plugin; a per-call config builds a second engine beside it; the default comes back after."""
    from deepspeed_multi.accelerate import Accelerator
    if dist.get_rank() == 0:
        with open(config_path, "w") as f:
            json.dump(cfg(2), f)
    dist.barrier()
    reset_accelerate()
    env = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": config_path}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        acc = Accelerator()
        model = MLP(seed=1)
        a, _ = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=LR))
        model = MLP(seed=2)
        b, _ = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=LR), deepspeed_plugin=cfg(3))
        frozen = acc.prepare(MLP(seed=3), deepspeed_plugin=cfg(3))
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    assert (a.zero_optimization_stage(), b.zero_optimization_stage(), frozen.zero_optimization_stage()) == (2, 3, 3)
    assert acc.state.deepspeed_plugin is acc.state.deepspeed_plugins["default"], "the default plugin must come back"
    return {"launch_config_file": "stages 2, 3, 3"}


def mixed_precision():
    """Accelerator(mixed_precision="bf16"): plugins without a dtype section get bf16, explicit ones keep theirs."""
    from accelerate.utils import DeepSpeedPlugin

    from deepspeed_multi.accelerate import Accelerator
    reset_accelerate()
    acc = Accelerator(mixed_precision="bf16",
                      deepspeed_plugins={"plain": DeepSpeedPlugin(hf_ds_config=cfg(2)),
                                         "fp32": DeepSpeedPlugin(hf_ds_config=cfg(2, bf16={"enabled": False}))})
    engines = {}
    for name in ("plain", "fp32"):
        acc.state.select_deepspeed_plugin(name)
        model = MLP(seed=1)
        engines[name], _ = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=LR))
    model = MLP(seed=1)
    engines["per_call"], _ = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=LR), deepspeed_plugin=cfg(3))
    got = {n: e.bfloat16_enabled() for n, e in engines.items()}
    assert got == {"plain": True, "fp32": False, "per_call": True}, got
    return {"mixed_precision": got}


def zero_init_transformers():
    """zero_init(stage-3) partitions from_config models; zero_init(stage-2) right after does not; the
    same through the Accelerator's select_deepspeed_plugin; HF's global config is restored each time."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    import deepspeed
    import deepspeed_multi
    reset_accelerate()
    with deepspeed_multi.zero_init(cfg(3)):
        teacher = hm.causal_lm()
    with deepspeed_multi.zero_init(cfg(2)):
        student = hm.causal_lm()
    assert hm.is_partitioned(teacher), "stage-3 zero_init must partition a from_config model"
    assert not any(hasattr(p, "ds_id") for p in student.parameters()), "stage-2 zero_init must build a plain model"
    assert not is_deepspeed_zero3_enabled(), "zero_init must restore Transformers' global config"
    # Transformers initialised the partitioned model on gathered parameters (its init, not torch's default).
    w = teacher.model.layers[0].self_attn.q_proj.weight
    with deepspeed.zero.GatheredParameters([w]):
        std = w.std().item()
    assert std < 0.05, f"q_proj std {std:.3f}: expected Transformers' init (0.02), not torch's default"

    acc = _accelerator(student=cfg(2), teacher=cfg(3))
    acc.state.select_deepspeed_plugin("teacher")
    teacher = hm.causal_lm(num_hidden_layers=2)
    with deepspeed_multi.zero_init(cfg(2)):   # overrides the selected stage-3 plugin for its block
        plain = hm.causal_lm()
    assert is_deepspeed_zero3_enabled(), "the selected plugin's config must come back after zero_init"
    acc.state.select_deepspeed_plugin("student")
    student = hm.causal_lm()
    assert hm.is_partitioned(teacher), "select_deepspeed_plugin(<stage 3>) then from_config must partition"
    assert not any(hasattr(p, "ds_id") for p in list(student.parameters()) + list(plain.parameters()))
    student, opt = acc.prepare(student, torch.optim.SGD(student.parameters(), lr=LR))
    acc.state.select_deepspeed_plugin("teacher")
    teacher = acc.prepare(teacher.requires_grad_(False))
    assert (student.zero_optimization_stage(), teacher.zero_optimization_stage()) == (2, 3)
    g = torch.Generator().manual_seed(dist.get_rank())
    ids = hm.tokens(g, 4, 6)
    before = full_params(student)
    with torch.no_grad():
        t = teacher(input_ids=ids)
    s = student(input_ids=ids, labels=ids)
    acc.backward(s.loss + ((s.logits - t.logits)**2).mean())
    opt.step()
    moved = max((full_params(student)[k] - before[k]).abs().max().item() for k in before)
    assert moved > 0
    return {"zero_init_transformers": "partitioned at stage 3 only, plain and through the Accelerator"}


def hf_engine_features():
    """ModelOutput and labels= through engines; generate() on a ZeRO-3 engine equals the plain model's."""
    from transformers.utils import ModelOutput

    from deepspeed_multi.integrations.hf_config import hf_deepspeed_config
    acc = _accelerator(llm=cfg(3))
    model = hm.causal_lm()          # the stage-3 plugin is selected: partitioned at construction
    assert hm.is_partitioned(model)
    with hf_deepspeed_config(None):
        reference = hm.causal_lm()
    engine = acc.prepare(model.requires_grad_(False))
    reference.load_state_dict(full_params(engine), strict=False)
    g = torch.Generator().manual_seed(dist.get_rank())
    prompts = hm.tokens(g, 2, 4)
    out = engine(input_ids=prompts, labels=prompts)
    assert isinstance(out, ModelOutput) and out.loss is not None and out.logits.shape == (2, 4, hm.VOCAB)
    torch.testing.assert_close(out.loss, reference(input_ids=prompts, labels=prompts).loss, atol=FP32_TOL, rtol=0)
    kw = dict(attention_mask=torch.ones_like(prompts), max_new_tokens=3, min_new_tokens=3, do_sample=False,
              pad_token_id=0)
    got = engine.generate(prompts, synced_gpus=True, **kw)
    want = reference.generate(prompts, **kw)
    assert torch.equal(got, want), f"generate on the ZeRO-3 engine {got.tolist()} != plain model {want.tolist()}"
    return {"generate_z3": "same tokens as the plain model"}


def dataloader_and_world():
    """A DataLoader prepared with a model is sharded over the real world size, also on CPU (see
    [Note: Accelerate's DeepSpeed mode on CPU]); reduce(mean) averages over ranks."""
    from torch.utils.data import DataLoader, TensorDataset
    acc = _accelerator(a=cfg(2))
    model = MLP(seed=1)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    loader = DataLoader(TensorDataset(torch.arange(16.0)), batch_size=4)
    _, _, loader = acc.prepare(model, opt, loader)
    world, rank = dist.get_world_size(), dist.get_rank()
    assert (acc.num_processes, acc.process_index) == (world, rank)
    seen = torch.cat([b[0] for b in loader])
    assert len(seen) == 16 // world, f"rank {rank} saw {len(seen)} of 16 samples: the loader is not sharded"
    everything = acc.gather(seen)
    assert sorted(everything.tolist()) == list(range(16)), everything
    mean = acc.reduce(torch.tensor([float(rank)]), reduction="mean").item()
    assert mean == sum(range(world)) / world, mean
    return {"dataloader": f"{len(seen)} of 16 samples per rank"}


def fp16_skip_does_not_advance_schedule():
    """An fp16 overflow skips the update: step_was_skipped is True and the schedule does not move;
    the next clean update advances it as Accelerate does (num_processes steps)."""
    fp16 = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1, "loss_scale_window": 1000}
    acc = _accelerator(a=cfg(2, fp16=fp16))
    model = MLP(seed=1)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    a, opt, sched = acc.prepare(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda))
    lrs = [sched.get_last_lr()]
    for step, poison in enumerate((True, False)):
        x, y = _batch(step)
        out = a(x)
        bad = torch.zeros_like(out)
        if poison:
            bad[0, 0] = float("inf")
        acc.backward(((out - y)**2).mean() + (out * bad).sum())
        opt.step()
        sched.step()
        opt.zero_grad()
        assert opt.step_was_skipped == poison, (step, opt.step_was_skipped)
        lrs.append(sched.get_last_lr())
    assert lrs[1] == lrs[0] and lrs[2] != lrs[1], f"LR must stay on the skipped update, then move once: {lrs}"
    assert sched.scheduler.last_epoch == acc.num_processes, (sched.scheduler.last_epoch, acc.num_processes)
    return {"fp16_skip": "schedule held on the skipped update"}


def _scheduled_run(accelerator_cls, config, steps=6):
    """One engine, gas from ``config``, a client LambdaLR, the guide's loop under ``accumulate``: (LRs, weights)."""
    from accelerate.utils import DeepSpeedPlugin

    from deepspeed_multi.accelerate.cpu_world import sync_world_size
    reset_accelerate()
    acc = accelerator_cls(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=copy.deepcopy(config)))
    sync_world_size(acc.state)  # (plain Accelerate on CPU counts one process: the shim both sides need)
    model = MLP(seed=1)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    model, opt, sched = acc.prepare(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda))
    lrs = []
    for step in range(steps):
        with acc.accumulate(model):
            x, y = _batch(step)
            acc.backward(((model(x) - y)**2).mean())
            opt.step()
            sched.step()
            opt.zero_grad()
        lrs.append(sched.get_last_lr())
    weights = full_params(model)
    model.destroy()
    return lrs, weights


def schedule_as_upstream():
    """A client scheduler under our Accelerator steps as under Accelerate's (num_processes steps an update, none
    inside a window): the same learning rates at every step, ZeRO-2 and ZeRO-3, gas 2."""
    from accelerate import Accelerator as Upstream

    from deepspeed_multi.accelerate import Accelerator
    for stage in (2, 3):
        config = cfg(stage, gas=2)
        want, got = _scheduled_run(Upstream, config), _scheduled_run(Accelerator, config)
        assert got[0] == want[0], f"ZeRO-{stage}: learning rates {got[0]}, Accelerate's {want[0]}"
        err = max((got[1][k] - want[1][k]).abs().max().item() for k in want[1])
        assert err <= FP32_TOL, f"ZeRO-{stage}: weights {err:.3e} off Accelerate's"
    return {"schedule_as_upstream": "the same learning rates as Accelerate's"}


def two_accelerators_as_the_guide(steps=4):
    """The guide's pattern (Accelerate's multi-model script): a ZeRO-2 model prepared by one Accelerator, a ZeRO-3
    model by a second one sharing its state, ``first.accumulate(both)``, each loss through its own Accelerator's
    backward, schedulers stepped: exact against plain PyTorch; each Accelerator's ``deepspeed_engine_wrapped`` is
    its first model's engine, and a second model prepared by the first logs Accelerate's warning."""
    from accelerate.utils import DeepSpeedPlugin

    from deepspeed_multi.accelerate import Accelerator
    reset_accelerate()
    first = Accelerator(deepspeed_plugins={"zero2": DeepSpeedPlugin(hf_ds_config=cfg(2)),
                                           "zero3": DeepSpeedPlugin(hf_ds_config=cfg(3))})
    second = Accelerator()  # Accelerate's state is shared: the same plugins
    plain = {name: MLP(seed=seed) for name, seed in (("zero2", 1), ("zero3", 2))}
    ref_opts = {n: torch.optim.SGD(m.parameters(), lr=LR) for n, m in plain.items()}
    ref_scheds = {n: torch.optim.lr_scheduler.LambdaLR(o, lr_lambda) for n, o in ref_opts.items()}
    prepared = {}
    for name, acc in (("zero2", first), ("zero3", second)):
        acc.state.select_deepspeed_plugin(name)
        model = MLP(seed=1 if name == "zero2" else 2)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        prepared[name] = acc.prepare(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda))
        assert acc.deepspeed_engine_wrapped.engine is prepared[name][0], name
    first.state.select_deepspeed_plugin("zero2")
    world = first.num_processes
    for step in range(steps):
        with first.accumulate(prepared["zero2"][0], prepared["zero3"][0]):
            for name, acc in (("zero2", first), ("zero3", second)):
                model, opt, sched = prepared[name]
                x, y = _batch(step)
                acc.backward(((model(x) - y)**2).mean())
                opt.step()
                sched.step()
                opt.zero_grad()
        for name in plain:  # every rank's batch, averaged; Accelerate's num_processes scheduler steps an update
            for r in range(world):
                g = torch.Generator().manual_seed(100 * step + r)
                x, y = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)
                (((plain[name](x) - y)**2).mean() / world).backward()
            ref_opts[name].step()
            ref_opts[name].zero_grad()
            for _ in range(world):
                ref_scheds[name].step()
    for name, (model, _, sched) in prepared.items():
        got, want = full_params(model), {k: v.detach() for k, v in plain[name].named_parameters()}
        err = max((got[k] - want[k]).abs().max().item() for k in want)
        assert err <= FP32_TOL, f"{name}: {err:.3e} off plain PyTorch"
        assert sched.get_last_lr() == ref_scheds[name].get_last_lr(), (name, sched.get_last_lr())
    records = Records()
    logging.getLogger("accelerate.accelerator").addHandler(records)
    try:
        third = MLP(seed=3)
        extra = first.prepare(third, torch.optim.SGD(third.parameters(), lr=LR))[0]
    finally:
        logging.getLogger("accelerate.accelerator").removeHandler(records)
    assert first.deepspeed_engine_wrapped.engine is prepared["zero2"][0]
    warned = any("A wrapped DeepSpeed engine reference is currently tied" in m for m in records.messages)
    assert warned == first.is_main_process, records.messages  # (Accelerate logs on the main process only)
    for engine in (extra, prepared["zero2"][0], prepared["zero3"][0]):
        engine.destroy()
    reset_accelerate()
    return {"two_accelerators": "exact against plain PyTorch; deepspeed_engine_wrapped as upstream's"}


def free_memory_then_prepare_again():
    """free_memory() destroys the engines it drops (Accelerate destroys its one): the same modules
    prepared again (new optimizers and schedulers) train bit-equal to fresh modules holding the
    same values (a ZeRO-2 -> ZeRO-3 chain); the destroyed engines refuse use."""
    acc = _accelerator(a=cfg(2), b=cfg(3))
    a, b, opts, scheds = _prepare_chain(acc)
    _train_chain(acc, a, b, opts, scheds, 2, 0)
    modules = [a.module, b.module]
    acc.free_memory()
    assert acc.engines() == []
    _expect(RuntimeError, "after engine.destroy()", a.step)
    values = [{k: v.clone() for k, v in full_params(m).items()} for m in modules]
    fresh = [MLP(seed=5), MLP(seed=6)]
    for model, state in zip(fresh, values):
        model.load_state_dict(state)
    chains = []
    for models in (modules, fresh):
        prepared = []
        for name, model in zip("ab", models):
            acc.state.select_deepspeed_plugin(name)
            opt = torch.optim.SGD(model.parameters(), lr=LR)
            prepared.append(acc.prepare(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)))
        chains.append(prepared)
    for chain in chains:
        (a, oa, sa), (b, ob, sb) = chain
        _train_chain(acc, a, b, [oa, ob], [sa, sb], 2, 2)
    for (again, _, _), (fresh, _, _) in zip(*chains):
        got, want = full_params(again), full_params(fresh)
        assert all(torch.equal(got[k], want[k]) for k in want), "prepared again differs from fresh modules"
    acc.free_memory()
    return {"free_memory_then_prepare_again": "bit-equal"}


def features(tmp):
    report = {}
    report.update(save_load_state(os.path.join(tmp, "state")))
    report.update(api_surface(os.path.join(tmp, "unused.json")))
    report.update(launch_config_file(os.path.join(tmp, "ds_config.json")))
    report.update(mixed_precision())
    report.update(dataloader_and_world())
    report.update(fp16_skip_does_not_advance_schedule())
    report.update(schedule_as_upstream())
    report.update(two_accelerators_as_the_guide())
    report.update(zero_init_transformers())
    report.update(hf_engine_features())
    report.update(free_memory_then_prepare_again())
    reset_accelerate()
    return report
