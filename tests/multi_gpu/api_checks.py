"""Rank functions for test_api.py (importable by the spawned ranks)."""
import copy
import functools

import deepspeed
import deepspeed.comm as dist
import torch
import torch.nn as nn

import deepspeed_multi
from common import FP32_TOL, MLP, Member, compare, ds_config, expect_error, full_params


def _engine(stage, gas=1, trainable=True, seed=1, **extra):
    model = MLP(seed=seed)
    cfg = ds_config(stage, gas=gas, **extra)
    if not trainable:
        model.requires_grad_(False)
        return deepspeed_multi.initialize(model=model, config=cfg)[0]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return deepspeed_multi.initialize(model=model, optimizer=opt, config=cfg)[0]


def _batch(step, rank=None):
    """This rank's batch on the engines' device (rank None), or rank ``rank``'s on the CPU for the reference."""
    own = rank is None
    rank = dist.get_rank() if own else rank
    g = torch.Generator().manual_seed(100 * step + rank)
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)
    if own:
        from deepspeed.accelerator import get_accelerator
        device = get_accelerator().current_device_name()
        x, y = x.to(device), y.to(device)
    return x, y


def _reference_micro_step(ref, opt, step, gas=1, clip=0.0):
    """Plain PyTorch on every rank's batch of ``step`` (data parallelism averages over ranks),
    updating at the end of each window of ``gas`` micro-steps (gradients clipped to norm ``clip``)."""
    world = dist.get_world_size()
    for r in range(world):
        xr, yr = _batch(step, r)
        (((ref(xr) - yr)**2).mean() / (gas * world)).backward()
    if step % gas == gas - 1:
        if clip:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        opt.step()
        opt.zero_grad()


def _adamw_engine(cfg):
    """An MLP engine with AdamW(lr=0.05) under ``cfg``."""
    model = MLP(seed=1)
    return deepspeed_multi.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.05),
                                      config=cfg)[0]


def _switched_off(build, switch):
    """``build()`` with the fast-path switch ``switch`` set to 0 (DeepSpeed's own method)."""
    import os
    from unittest import mock
    with mock.patch.dict(os.environ, {switch: "0"}):
        return build()


def _train(engine, steps, start=0):
    for step in range(start, start + steps):
        x, y = _batch(step)
        ((engine(x) - y)**2).mean().backward()
        engine.step()


def _assert_close(a, b, what):
    err = max((a[n] - b[n]).abs().max().item() for n in a)
    assert err <= FP32_TOL, f"{what}: max abs error {err:.3e}"


def checkpoint_roundtrip(stage, path):
    engine = _engine(stage)
    _train(engine, 2)
    engine.save_checkpoint(path, tag="t")
    _train(engine, 2, start=2)
    expected = full_params(engine)
    other = _engine(stage, seed=7)
    other.load_checkpoint(path, tag="t")
    _train(other, 2, start=2)
    _assert_close(full_params(other), expected, f"stage {stage} checkpoint round trip")


def gathered_parameters_full_shape():
    engine = _engine(3)
    assert all(p.numel() == 0 or p.ds_tensor.numel() < p.ds_numel for p in engine.module.parameters())
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        shapes = [tuple(p.shape) for p in engine.module.parameters()]
    assert shapes == [(16, 8), (16, ), (8, 16), (8, )], shapes


def zero_init_mixed_stages():
    cfg3, cfg2 = ds_config(3), ds_config(2)
    with deepspeed_multi.zero_init(cfg3):
        teacher = nn.Linear(8, 8)
    with deepspeed_multi.zero_init(cfg2):
        student = nn.Linear(8, 8)
    assert hasattr(teacher.weight, "ds_id"), "stage-3 config must partition at construction"
    assert not hasattr(student.weight, "ds_id"), "stage-2 config must build a plain module"
    teacher.requires_grad_(False)
    t_engine = deepspeed_multi.initialize(model=teacher, config=cfg3)[0]
    s_engine = deepspeed_multi.initialize(model=student, optimizer=torch.optim.SGD(student.parameters(), lr=0.1),
                                          config=cfg2)[0]
    x, _ = _batch(0)
    with torch.no_grad():
        target = t_engine(x)
    ((s_engine(x) - target)**2).mean().backward()
    s_engine.step()


def inference_only_input_grad(stage):
    """A frozen engine (no optimizer) passes exact gradients to its inputs at every stage."""
    engine = _engine(stage, trainable=False)
    x, y = _batch(0)
    ref = MLP(seed=1).to(x.device)
    x1, x2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ((engine(x1) - y)**2).mean().backward()
    ((ref(x2) - y)**2).mean().backward()
    torch.testing.assert_close(x1.grad, x2.grad, atol=FP32_TOL, rtol=0)
    with torch.no_grad():
        torch.testing.assert_close(engine(x), ref(x), atol=FP32_TOL, rtol=0)
    try:
        engine.step()
    except RuntimeError as e:
        assert "inference-only" in str(e), str(e)
    else:
        raise AssertionError("step() on an engine without optimizer must refuse")


def old_backward_api(stage):
    """engine.backward(loss) keeps working and returns loss / gas, like DeepSpeed's."""
    gas = 2
    engine = _engine(stage, gas=gas)
    ref = MLP(seed=1)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(4):
        x, y = _batch(step)
        loss = ((engine(x) - y)**2).mean()
        returned = engine.backward(loss)
        torch.testing.assert_close(returned, loss / gas)
        assert engine.is_update_boundary() == (step % gas == gas - 1)
        engine.step()
        _reference_micro_step(ref, opt, step, gas)
    _assert_close(full_params(engine), dict(ref.named_parameters()), f"stage {stage} engine.backward")


def no_sync_accumulates(stage):
    engine = _engine(stage)
    ref = MLP(seed=1)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    world = dist.get_world_size()
    for step in range(2):
        x, y = _batch(step)
        with engine.no_sync():
            ((engine(x) - y)**2).mean().backward()
        ((engine(2 * x) - y)**2).mean().backward()
        engine.step()
        for r in range(world):
            xr, yr = _batch(step, r)
            ((((ref(xr) - yr)**2).mean() + ((ref(2 * xr) - yr)**2).mean()) / world).backward()
        opt.step()
        opt.zero_grad()
    _assert_close(full_params(engine), dict(ref.named_parameters()), f"stage {stage} no_sync")


def step_inside_backward_refused(stage):
    """step() from a hook that runs while the engine's own backward is under way is refused."""
    engine = _engine(stage)
    x, y = _batch(0)
    seen = []
    handle = engine.module.fc1.weight.register_hook(lambda g: (_try_step(engine, seen), g)[1])
    ((torch.tanh(engine(x)) - y)**2).mean().backward()
    handle.remove()
    assert seen and "while a backward pass is still producing" in seen[0], seen
    engine.step()  # after backward returns, stepping is fine


def _try_step(engine, seen):
    try:
        engine.step()
    except RuntimeError as e:
        seen.append(str(e))


def ranks_disagree_refused(stage, extra_backwards_on_rank0=1, shared_backwards=0):
    """Rank 0 runs ``extra`` more backward passes than the others (who run ``shared``): every rank
    refuses the step before any gradient collective, whether it accumulated or not."""
    engine = _engine(stage)
    x, y = _batch(0)
    backwards = shared_backwards + (extra_backwards_on_rank0 if dist.get_rank() == 0 else 0)
    for _ in range(backwards):
        ((engine(x) - y)**2).mean().backward()
    try:
        engine.step()
    except RuntimeError as e:
        assert "ranks disagree" in str(e), str(e)
    else:
        raise AssertionError("step() after a backward on some ranks only must refuse")


def bad_config_refused():
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for cfg, text in [({**ds_config(2), "deepspeed_multi": {"fused": True}}, "unknown option")]:
        try:
            deepspeed_multi.initialize(model=model, optimizer=opt, config=cfg)
        except ValueError as e:
            assert text in str(e), str(e)
        else:
            raise AssertionError(f"config with {text} must be refused")


def fp16_overflow_skips_only_that_engine():
    """An inf in fp16 engine A's gradients skips A's step (and halves its scale); B still steps."""
    a = _engine(2, fp16={"enabled": True, "initial_scale_power": 8, "hysteresis": 1})
    b = _engine(2, seed=2)
    before_a, before_b = full_params(a), full_params(b)
    scale = a._get_optimizer_loss_scale()
    x, y = _batch(0)
    h = a(x)
    poison = torch.zeros_like(h)
    poison[0, 0] = float("inf")
    loss = ((b(h.detach()) - y)**2).mean() + (h * poison).sum()
    loss.backward()
    a.step()
    b.step()
    assert a.skipped_steps == 1 and a._get_optimizer_loss_scale() == scale / 2
    _assert_close(full_params(a), before_a, "overflowed fp16 engine must not move")
    moved = max((full_params(b)[n] - before_b[n]).abs().max().item() for n in before_b)
    assert moved > 0, "the other engine must still step"


def skip_group_skips_together(stage_a, stage_b):
    """fp16 engine A feeds fp32 engine B in one skip group: an inf in A's gradients on one rank only
    makes both skip (A's loss scale halves); the next clean round updates both."""
    group = {"deepspeed_multi": {"skip_group": f"ppo-{stage_a}{stage_b}"}}
    a = _engine(stage_a, fp16={"enabled": True, "initial_scale_power": 8, "hysteresis": 1}, **group)
    b = _engine(stage_b, seed=2, **group)
    start_a, start_b = full_params(a), full_params(b)
    scale = a._get_optimizer_loss_scale()
    for step in range(2):
        x, y = _batch(step)
        h = a(x)
        poison = torch.zeros_like(h)
        if step == 0 and dist.get_rank() == 0:
            poison[0, 0] = float("inf")
        (((b(h) - y)**2).mean() + (h * poison).sum()).backward()
        a.step()
        b.step()
        if step == 0:
            assert (a.skipped_steps, b.skipped_steps) == (1, 1), (a.skipped_steps, b.skipped_steps)
            assert a._get_optimizer_loss_scale() == scale / 2
            _assert_close(full_params(a), start_a, "skipped engine A must not move")
            _assert_close(full_params(b), start_b, "skipped engine B must not move")
    assert (a.skipped_steps, b.skipped_steps) == (1, 1)
    for engine, start in ((a, start_a), (b, start_b)):
        moved = max((full_params(engine)[n] - start[n]).abs().max().item() for n in start)
        assert moved > 0, "a clean round must update every member"


def recovers_after_failed_backward(stage):
    """A backward that raises part way (here: a user hook) leaves nothing behind: the next
    iterations train exactly like plain PyTorch from the same parameters."""
    engine = _engine(stage)
    x, y = _batch(99)

    def boom(grad):
        raise ValueError("user hook failed")

    handle = engine.module.fc2.weight.register_hook(boom)  # fires inside the engine's backward
    try:
        ((engine(x) - y)**2).mean().backward()
    except ValueError:
        pass
    else:
        raise AssertionError("the hook must have raised")
    handle.remove()
    try:
        engine.step()
    except RuntimeError as e:
        assert "failed part way" in str(e), str(e)
    else:
        raise AssertionError("step() after a failed backward must refuse")
    engine.zero_grad()  # as the error says
    ref = MLP(seed=1)
    ref.load_state_dict({n: p for n, p in full_params(engine).items()})
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(2):
        x, y = _batch(step)
        ((engine(x) - y)**2).mean().backward()
        engine.step()
        _reference_micro_step(ref, opt, step)
    _assert_close(full_params(engine), dict(ref.named_parameters()), f"stage {stage} after a failed backward")


def bucket_buffers_sized(stage, dtype, overlap):
    """DeepSpeed's default reduce_bucket_size (5e8) on a small model: the bucket buffers hold the
    engine's trainable elements, buckets flush where DeepSpeed's do, results are plain PyTorch's."""
    from deepspeed_multi import compat
    from deepspeed_multi.zero import bucket_size
    from deepspeed_multi.zero.stage3 import rank_order as stage3_rank_order
    gas, big = 2, 5 * 10**8
    model = MLP(seed=1)
    cfg = ds_config(stage, dtype, gas=gas)
    cfg["zero_optimization"].update(reduce_bucket_size=big, allgather_bucket_size=big, stage3_prefetch_bucket_size=big,
                                    overlap_comm=overlap)
    engine = deepspeed_multi.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                        config=cfg)[0]
    opt = engine.optimizer
    elements = sum(p.numel() for p in MLP(seed=1).parameters())
    where = f"ZeRO-{stage} {dtype} overlap_comm={overlap}"
    assert bucket_size.sized_elements(opt) == elements, f"{where}: buckets not sized ({bucket_size.sized_elements(opt)})"
    assert opt.reduce_bucket_size == big, f"{where}: the flush rule's reduce_bucket_size changed"
    allocated = []  # the buffers' sizes: ZeRO-1/2 allocate them per window (and may release them in backward)
    if stage == 3:  # allocated by a backward's first gradient, released by its epilogue (bucket_size.py)
        assert all(b.buffer is None for b in opt.ipg_buckets.values()), f"{where}: a bucket buffer before any backward"
        add = opt._DeepSpeedZeroOptimizer_Stage3__add_grad_to_ipg_bucket

        def spy(param):
            add(param)
            allocated.extend(b.buffer.numel() for b in opt.ipg_buckets.values() if b.buffer is not None)

        opt._DeepSpeedZeroOptimizer_Stage3__add_grad_to_ipg_bucket = spy
    else:
        setup = opt.setup_buckets

        def spy():
            setup()
            allocated.extend(b.numel() for bucket in opt.ipg_buckets.values() for b in bucket.buffer)

        opt.setup_buckets = spy
    ref = MLP(seed=1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(4):
        x, y = _batch(step)
        ((engine(x) - y)**2).mean().backward()
        if stage == 3:
            assert all(b.buffer is None for b in opt.ipg_buckets.values()), f"{where}: bucket buffer kept after backward"
        engine.step()
        _reference_micro_step(ref, ref_opt, step, gas)
    # fp32 to 1e-5, bf16 by the update's cosine and norm, as the correctness matrix compares
    compare({where: engine}, {where: {n: p.detach() for n, p in ref.named_parameters()}},
            {where: Member(lambda: MLP(seed=1), cfg)}, dtype)
    if compat.installed(opt, stage3_rank_order.FEATURE):  # the bucket's regions, padding included
        world, params = dist.get_world_size(), len(list(engine.module.parameters()))
        elements = world * stage3_rank_order.region_elements(elements, world, params)
    assert allocated and all(n == elements for n in allocated), \
        f"{where}: bucket buffers of {sorted(set(allocated))} elements, want {elements}"
    assert compat.installed(opt, bucket_size.FEATURE_Z3 if stage == 3 else bucket_size.FEATURE_Z12)


def master_aliased(stage, sub_group_size, path):
    """fp32 ZeRO-1/2/3 (deepspeed_multi/zero/master_alias.py): each master partition is this rank's
    parameter partition; AdamW updates are plain PyTorch's and the same bits as DeepSpeed's clone
    (DSM_MASTER_ALIAS=0); a parameter written outside the optimizer keeps the write, as in PyTorch;
    a checkpoint saves this rank's master slice, not the flat buffer behind it."""
    import os

    from deepspeed_multi import compat
    from deepspeed_multi.zero import master_alias
    gas = 2
    cfg = ds_config(stage, gas=gas)
    cfg["zero_optimization"]["sub_group_size"] = sub_group_size

    build = functools.partial(_adamw_engine, cfg)
    engine, clone = build(), _switched_off(build, "DSM_MASTER_ALIAS")
    opt, where = engine.optimizer, f"ZeRO-{stage} fp32 sub_group_size={sub_group_size}"
    feature = master_alias.FEATURE if stage == 3 else master_alias.FEATURE_Z12
    assert compat.installed(opt, feature) and not compat.installed(clone.optimizer, feature), where

    def pairs(o):  # (master, parameter partition) per group
        if stage == 3:
            return list(zip(o.fp32_partitioned_groups_flat, o.fp16_partitioned_groups_flat))
        rank = dist.get_rank()
        return [(m, flat[rank]) for m, flat in zip(o.single_partition_of_fp32_groups, o.parallel_partitioned_bit16_groups)]

    assert len(pairs(opt)) == 1 if stage < 3 or sub_group_size > 280 else len(pairs(opt)) > 1, where
    assert all(m.data_ptr() == p.data_ptr() for m, p in pairs(opt)), f"{where}: the master is not the partition"
    assert not any(m.data_ptr() == p.data_ptr() for m, p in pairs(clone.optimizer)), "the switch must keep the clone"
    ref = MLP(seed=1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05)
    for step in range(6):
        if step == 4:  # a write outside the optimizer, on every rank's copy and on the reference
            for e in (engine, clone):
                with deepspeed.zero.GatheredParameters([e.module.fc1.bias], modifier_rank=0):
                    if dist.get_rank() == 0 or stage < 3:
                        e.module.fc1.bias.data.fill_(0.5)
            with torch.no_grad():
                ref.fc1.bias.fill_(0.5)
        x, y = _batch(step)
        for e in (engine, clone):
            ((e(x) - y)**2).mean().backward()
            e.step()
        _reference_micro_step(ref, ref_opt, step, gas)
        if step == 3:  # DeepSpeed's bits until the write
            ours, theirs = full_params(engine), full_params(clone)
            assert all(torch.equal(ours[n], theirs[n]) for n in ours), f"{where}: not DeepSpeed's bits"
    _assert_close(full_params(engine), dict(ref.named_parameters()), where)
    # DeepSpeed's clone overwrote the write with its master at the next update; ours kept it.
    assert not torch.allclose(full_params(clone)["fc1.bias"], ref.fc1.bias.detach(), atol=1e-3), where
    if stage < 3:
        engine.save_checkpoint(path, tag="alias")
        dist.barrier()
        saved = torch.load(os.path.join(path, "alias", f"zero_pp_rank_{dist.get_rank()}_mp_rank_00_optim_states.pt"),
                           weights_only=False)["optimizer_state_dict"][master_alias._SD_KEY]
        assert all(t.untyped_storage().nbytes() == t.numel() * 4 for t in saved), \
            f"{where}: the checkpoint holds {[t.untyped_storage().nbytes() for t in saved]} bytes for the master"
        restored = build()
        restored.load_checkpoint(path, tag="alias")
        ours, back = full_params(engine), full_params(restored)
        assert all(torch.equal(ours[n], back[n]) for n in ours), f"{where}: checkpoint round trip"
        assert compat.installed(restored.optimizer, feature)


def lazy_grad_partitions(dtype):
    """ZeRO-3 (deepspeed_multi/zero/stage3/lazy_grads.py): a sub-group's gradient partition is
    allocated when its first gradient is reduced and dropped after the update; the updates are
    DeepSpeed's bits (DSM_ZERO3_LAZY_GRADS=0) and, in fp32, plain PyTorch's; in fp16 an inf on one
    rank skips the same update; what runs before offload_states puts DeepSpeed's flat buffer back,
    holding the same gradients."""
    from deepspeed_multi import compat
    from deepspeed_multi.zero.stage3 import lazy_grads as lazy
    gas = 2
    cfg = ds_config(3, dtype, gas=gas, gradient_clipping=1.0, zero_optimization={"sub_group_size": 100})

    engine, flat = _adamw_engine(cfg), _switched_off(functools.partial(_adamw_engine, cfg), "DSM_ZERO3_LAZY_GRADS")
    where = f"ZeRO-3 {dtype}"
    parts = lazy.lazy(engine.optimizer)
    assert compat.installed(engine.optimizer, lazy.FEATURE) and parts is not None, where
    assert not compat.installed(flat.optimizer, lazy.FEATURE) and flat.optimizer.grad_partitions_flat_buffer is not None
    assert engine.optimizer.grad_partitions_flat_buffer is None and len(parts.sizes) > 1, (where, parts.sizes)
    # (after the flat buffer is restored at step 2: the whole partition, as DeepSpeed's)
    allocated = lambda: (sum(b is not None for b in parts.buffers) if lazy.lazy(engine.optimizer) is parts  # noqa: E731
                         else len(parts.sizes))
    seen = []

    def probe(module, inputs, out):  # runs in the backward between fc2's reduction and fc1's
        out.register_hook(lambda grad: seen.append(allocated()))

    engine.module.fc1.register_forward_hook(probe)

    ref = MLP(seed=1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05)
    for step in range(6):
        x, y = _batch(step)
        expected = 0 if step % gas == 0 and step < 4 else len(parts.sizes)  # a window's start: nothing yet
        assert allocated() == expected, f"{where}: step {step} starts with {allocated()} sub-groups allocated"
        poison = torch.zeros_like(y)
        if dtype == "fp16" and step == 1 and dist.get_rank() == 0:
            poison[0, 0] = float("inf")  # the first window overflows on one rank: both skip its update
        out = engine(x)
        loss = ((out - y)**2).mean() + (out * poison).sum()
        assert allocated() == expected, f"{where}: step {step}: the forward allocated"
        loss.backward()
        assert allocated() == len(parts.sizes), f"{where}: after the backward {allocated()} of {len(parts.sizes)}"
        if dtype == "fp16" and step < 2:  # DeepSpeed's check, over the sub-group buffers (its norm decides too)
            assert engine.optimizer.has_overflow() == (step == 1), f"{where}: step {step}: has_overflow"
        if step == 2:  # before offload_states (FusedAdam only, so not callable here): DeepSpeed's flat buffer
            held = torch.cat([b for b in parts.buffers])
            lazy._restore_flat_buffer(engine.optimizer)
            assert lazy.lazy(engine.optimizer) is None, where
            assert torch.equal(engine.optimizer.grad_partitions_flat_buffer, held), f"{where}: restored buffer"
        engine.step()
        out = flat(x)
        (((out - y)**2).mean() + (out * poison).sum()).backward()
        flat.step()
        _reference_micro_step(ref, ref_opt, step, gas, clip=1.0)
        ours, theirs = full_params(engine), full_params(flat)
        assert all(torch.equal(ours[n], theirs[n]) for n in ours), f"{where}: step {step}: not DeepSpeed's bits"
    # The first backward's probe, between fc2's reduction and fc1's: some sub-groups, not all.
    assert 0 < seen[0] < len(parts.sizes), f"{where}: mid-backward {seen[0]} of {len(parts.sizes)} allocated"
    if dtype == "fp16":
        assert engine.skipped_steps == flat.skipped_steps == 1, (where, engine.skipped_steps, flat.skipped_steps)
    if dtype == "fp32":
        _assert_close(full_params(engine), dict(ref.named_parameters()), where)


def _gathered(module):
    """Every parameter's gathered 16-bit (or fp32) value, as the forward sees it."""
    params = list(module.parameters())
    with deepspeed.zero.GatheredParameters(params):
        return {n: p.detach().clone() for n, p in module.named_parameters()}


def _assert_deepspeeds_bits(engine, theirs, what, values=True):
    """``engine``'s fp32 masters (and, with ``values``, its gathered 16-bit values) bit-equal to ``theirs``."""
    ours, deepspeeds = full_params(engine), full_params(theirs)
    assert all(torch.equal(ours[n], deepspeeds[n]) for n in ours), f"{what}: masters"
    if values:
        ours, deepspeeds = _gathered(engine.module), _gathered(theirs.module)
        assert all(torch.equal(ours[n], deepspeeds[n]) for n in ours), f"{what}: 16-bit values"


def cast_on_gather(dtype, path, persistence=0):
    """bf16/fp16 ZeRO-3 (deepspeed_multi/zero/stage3/cast_on_gather.py): no 16-bit partition is
    held between gathers; the forward's values, the losses and the updates are DeepSpeed's bits
    (DSM_ZERO3_CAST_ON_GATHER=0) through a write under GatheredParameters (kept until the next
    update, then overwritten by the master, as DeepSpeed does), a master write with
    safe_set_full_fp32_param (not seen until the next update), a gather mixing another engine's
    parameters, an fp16 overflow that skips an update, DeepSpeed's layout put back, and checkpoints
    (full and module-only, which refreshes the masters from the 16-bit values)."""
    import os

    from deepspeed.utils import safe_set_full_fp32_param

    from deepspeed_multi import compat
    from deepspeed_multi.zero.stage3 import cast_on_gather as cog
    gas = 2
    cfg = ds_config(3, dtype, gas=gas, gradient_clipping=1.0,
                    zero_optimization={"sub_group_size": 100, "stage3_param_persistence_threshold": persistence})
    build = functools.partial(_adamw_engine, cfg)
    engine, theirs = build(), _switched_off(build, "DSM_ZERO3_CAST_ON_GATHER")
    where = f"ZeRO-3 {dtype} persistence threshold {persistence}"
    # (persistent parameters stay gathered between steps: re-gathered after each update)
    assert (persistence > 0) == any(p.ds_persist for p in engine.module.parameters()), where
    assert compat.installed(engine.optimizer, cog.FEATURE), where
    assert not compat.installed(theirs.optimizer, cog.FEATURE), where
    assert len(engine.optimizer.fp16_groups) > 1, (where, "want several sub-groups")
    one = torch.empty(0, dtype=engine.optimizer.lp_param_buffer.dtype).element_size()

    def held(e):  # bytes behind the 16-bit partitions
        o = e.optimizer
        return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in [o.lp_param_buffer, *cog.placeholders_of(o)]}

    assert sum(held(engine).values()) == one, (where, held(engine))
    assert sum(held(theirs).values()) == theirs.optimizer.lp_param_buffer.numel() * one, where

    def same(step, what):
        _assert_deepspeeds_bits(engine, theirs, f"{where}: step {step}: {what}")

    write = torch.linspace(-1, 1, engine.module.fc2.weight.ds_numel).view(engine.module.fc2.weight.ds_shape)
    for step in range(8):
        x, y = _batch(step)
        poison = torch.zeros_like(y)
        if dtype == "fp16" and step == 1 and dist.get_rank() == 0:
            poison[0, 0] = float("inf")  # the first window overflows on one rank: both skip its update
        for e in (engine, theirs):
            if step == 3:  # mid-window: a write of the gathered 16-bit value, DeepSpeed's until the update
                with deepspeed.zero.GatheredParameters([e.module.fc1.bias], modifier_rank=0):
                    if dist.get_rank() == 0:
                        e.module.fc1.bias.data.fill_(0.5)
            if step == 5:  # a master write: the 16-bit value is DeepSpeed's old one until the update
                safe_set_full_fp32_param(e.module.fc2.weight, write)
        if step in (3, 5):
            same(step, "after the write")
        losses = []
        for e in (engine, theirs):
            out = e(x)
            loss = ((out - y)**2).mean() + (out * poison).sum()
            loss.backward()
            losses.append(loss.detach())
            e.step()
        assert torch.equal(losses[0], losses[1]), f"{where}: step {step}: loss {losses[0]} vs {losses[1]}"
        same(step, "after the step")
        assert sum(held(engine).values()) == one or step >= 6, (where, step, held(engine))
        if step == 6:  # DeepSpeed's layout back for good (what offload_states runs first)
            cog.restore(engine.optimizer)
            assert sum(held(engine).values()) == sum(held(theirs).values()), where
            same(step, "layout restored")
    if dtype == "fp16":
        assert theirs.skipped_steps == 1, (where, theirs.skipped_steps)
    # a gather mixing an engine without this feature (first) and one with it
    mixed = [theirs.module.fc1.weight, engine.module.fc1.weight]
    with deepspeed.zero.GatheredParameters(mixed):
        assert torch.isfinite(engine.module.fc1.weight).all(), where
        assert engine.module.fc1.weight.shape == theirs.module.fc1.weight.shape, where

    # checkpoints: full, then module-only (16-bit values -> masters)
    theirs.save_checkpoint(path, tag="c")
    dist.barrier()
    for module_only in (False, True):
        ours, again = build(), _switched_off(build, "DSM_ZERO3_CAST_ON_GATHER")
        for e in (ours, again):
            e.load_checkpoint(path, tag="c", load_module_only=module_only, load_optimizer_states=not module_only)
        engine, theirs = ours, again
        assert sum(held(engine).values()) == one, (where, module_only, held(engine))
        same(-1, f"loaded (module only: {module_only})")
        for step in (8, 9):
            x, y = _batch(step)
            for e in (engine, theirs):
                ((e(x) - y)**2).mean().backward()
                e.step()
            same(step, f"after loading (module only: {module_only})")
    assert os.path.isdir(path)


def cast_on_gather_hf():
    """The 16-bit partition cast at gather on a Transformers model built partitioned
    (``zero_init``), with tied input and output embeddings (one parameter used by two modules), its
    norms' weights persistent and the rest partitioned: the losses, the masters and the
    consolidated 16-bit state dict (``save_16bit_model``'s) are DeepSpeed's bits."""
    from hf_models import causal_lm, tokens

    from deepspeed_multi import compat
    from deepspeed_multi.zero.stage3 import cast_on_gather as cog
    cfg = ds_config(3, "bf16", gas=1, gradient_clipping=1.0)
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 100  # the norms' 16 elements persist

    def build():
        torch.manual_seed(0)  # the same random weights on every rank and for both engines
        with deepspeed_multi.zero_init(cfg):
            model = causal_lm(tie_word_embeddings=True)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        return deepspeed_multi.initialize(model=model, optimizer=opt, config=cfg)[0]

    engine, theirs = build(), _switched_off(build, "DSM_ZERO3_CAST_ON_GATHER")
    assert compat.installed(engine.optimizer, cog.FEATURE) and not compat.installed(theirs.optimizer, cog.FEATURE)
    assert engine.module.lm_head.weight is engine.module.model.embed_tokens.weight
    persist = {n for n, p in engine.module.named_parameters() if p.ds_persist}
    assert persist and len(persist) < len(list(engine.module.parameters())), persist
    g = torch.Generator().manual_seed(5 + dist.get_rank())
    for step in range(4):
        ids = tokens(g, 2, 12)
        losses = []
        for e in (engine, theirs):
            loss = e(input_ids=ids, labels=ids).loss
            loss.backward()
            e.step()
            losses.append(loss.detach())
        assert torch.equal(losses[0], losses[1]), f"step {step}: loss {losses[0]} vs {losses[1]}"
    _assert_deepspeeds_bits(engine, theirs, "after four updates", values=False)
    ours, deepspeeds = engine._zero3_consolidated_16bit_state_dict(), theirs._zero3_consolidated_16bit_state_dict()
    if dist.get_rank() == 0:
        assert ours.keys() == deepspeeds.keys() and all(torch.equal(ours[k], deepspeeds[k]) for k in ours), \
            "the consolidated 16-bit state dict"
        assert all(torch.isfinite(v).all() for v in ours.values())


def cast_on_gather_universal(path):
    """The 16-bit partition cast at gather through DeepSpeed's universal-checkpoint load (what a
    resume at another world size runs, deepspeed_multi/resize.py): the saved values, DeepSpeed's
    bits (DSM_ZERO3_CAST_ON_GATHER=0) after the load and after two more updates."""
    import os

    from deepspeed_multi import compat
    from deepspeed_multi.checkpoint import resize
    from deepspeed_multi.zero.stage3 import cast_on_gather as cog
    build = functools.partial(_adamw_engine, ds_config(3, "bf16", zero_optimization={"sub_group_size": 100}))
    saved_engine = build()
    _train(saved_engine, 3)
    saved = full_params(saved_engine)
    saved_engine.save_checkpoint(os.path.join(path, "set"), tag="t")
    dist.barrier()
    if dist.get_rank() == 0:
        why = resize.convert(os.path.join(path, "set"), ["t"], os.path.join(path, "universal"))
        assert why is None, why
    dist.barrier()
    engine, theirs = build(), _switched_off(build, "DSM_ZERO3_CAST_ON_GATHER")
    assert compat.installed(engine.optimizer, cog.FEATURE) and not compat.installed(theirs.optimizer, cog.FEATURE)
    for e in (engine, theirs):
        resize.load_universal(e, os.path.join(path, "universal"), "t")
    ours = full_params(engine)
    assert all(torch.equal(ours[n], saved[n]) for n in ours), "not the saved values"
    _assert_deepspeeds_bits(engine, theirs, "after the load")
    for e in (engine, theirs):
        _train(e, 2, start=3)
    _assert_deepspeeds_bits(engine, theirs, "two updates after the load", values=False)


def destroy_then_rebuild(stage):
    """``engine.destroy()`` hands the module back ([Note: destroy() hands the module back]), fp32 and
    bf16: nothing of ours is left on it, the destroyed engine refuses use, and a new engine over the
    module trains bit-equal to a new engine over a fresh module holding the same values (fp32: and
    equal to plain PyTorch across both engines, 1e-5). A trainable engine over the parameters of a
    ZeRO-2/3 engine not destroyed is refused at initialize; over a ZeRO-1 engine's it is not (exact),
    nor over a deepcopy of a live ZeRO-2 engine's module. Any engine over a module an inference-only
    ZeRO-3 engine still hooks is refused until that one's destroy()."""
    for dtype in ("fp32", "bf16"):
        what = f"ZeRO-{stage} {dtype}"
        model, ref = MLP(seed=1), MLP(seed=1)
        adamw = functools.partial(torch.optim.AdamW, lr=0.05)
        cfg = ds_config(stage, dtype=dtype)
        if dtype == "bf16":
            cfg["deepspeed_multi"] = {"skip_group": f"destroyed-{stage}"}
        first = deepspeed_multi.initialize(model=model, optimizer=adamw(model.parameters()), config=cfg)[0]
        _train(first, 3)
        first.destroy()
        first.destroy()  # (a second call does nothing)
        assert first.skip_group is None or first not in first.skip_group.members(), what
        _assert_nothing_of_ours(model, what)
        for use in (lambda: first(_batch(0)[0]), first.step, first.zero_grad):
            expect_error(RuntimeError, use, "after engine.destroy()")
        fresh = MLP(seed=2)
        fresh.load_state_dict({n: v.float() for n, v in _gathered(model).items()})
        again, other = (deepspeed_multi.initialize(model=m, optimizer=adamw(m.parameters()), config=cfg)[0]
                        for m in (model, fresh))
        for step in range(3, 6):
            losses = []
            for e in (again, other):
                x, y = _batch(step)
                loss = ((e(x) - y)**2).mean()
                loss.backward()
                if step == 3:  # read between backward and step: nothing the destroyed engine armed is left active
                    _gathered(e.module)
                e.step()
                losses.append(loss.detach())
            assert torch.equal(*losses), f"{what}: step {step} loss {losses[0]} vs fresh module's {losses[1]}"
        _assert_deepspeeds_bits(again, other, f"{what}: the new engine over the handed-back module")
        if dtype == "fp32":
            opt = adamw(ref.parameters())
            for step in range(6):
                if step == 3:
                    opt = adamw(ref.parameters())
                _reference_micro_step(ref, opt, step)
            _assert_close(full_params(again), {n: p.detach() for n, p in ref.named_parameters()}, what)
        for e in (again, other):
            e.destroy()
    for old_stage in (1, 2, 3):
        model = MLP(seed=1)
        old = deepspeed_multi.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                         config=ds_config(old_stage))[0]
        build = functools.partial(deepspeed_multi.initialize, model=model, config=ds_config(stage),
                                  optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        if old_stage == 1:
            ref, opt = MLP(seed=1), None
            new = build()[0]
            for step in range(2):
                _train(new, 1, start=step)
                opt = opt or torch.optim.SGD(ref.parameters(), lr=0.1)
                _reference_micro_step(ref, opt, step)
            _assert_close(full_params(new), {n: p.detach() for n, p in ref.named_parameters()},
                          f"ZeRO-{stage} over a live ZeRO-1 engine's module")
            new.destroy()
        else:
            expect_error(RuntimeError, build, f"ZeRO stage {old_stage}, trained) that was not destroyed")
        if old_stage == 2:  # a copy of the module is not the live engine's: built
            twin = copy.deepcopy(model)
            deepspeed_multi.initialize(model=twin, optimizer=torch.optim.SGD(twin.parameters(), lr=0.1),
                                       config=ds_config(stage))[0].destroy()
        old.destroy()
    model = MLP(seed=1)  # an inference-only ZeRO-3 engine hooks the module: any engine over it waits for destroy()
    frozen = deepspeed_multi.initialize(model=model, config=ds_config(3))[0]
    frozen(_batch(0)[0])
    for trains in (False, True):
        opt = torch.optim.SGD(model.parameters(), lr=0.1) if trains else None
        build = functools.partial(deepspeed_multi.initialize, model=model, optimizer=opt, config=ds_config(stage))
        expect_error(RuntimeError, build, "ZeRO stage 3, inference-only) that was not destroyed")
    frozen.destroy()
    deepspeed_multi.initialize(model=model, config=ds_config(stage))[0].destroy()


def _assert_nothing_of_ours(module, what):
    """No hook or attribute of deepspeed_multi's on ``module``, its submodules or its parameters."""
    for name, m in module.named_modules():
        for kind in ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks", "_backward_pre_hooks"):
            ours = [h for h in getattr(m, kind).values() if getattr(h, "__module__", "").startswith("deepspeed_multi")]
            assert not ours, f"{what}: {name or 'the module'} keeps {kind} {ours}"
        zero3 = [a for a in ("pre_bwd_fn", "post_bwd_fn") if a in vars(m)]
        assert not zero3, f"{what}: {name or 'the module'} keeps ZeRO-3's {zero3}, bound to the destroyed engine"
    for name, p in module.named_parameters():
        left = [a for a in vars(p) if a.startswith("_dsm")] + list((p._post_accumulate_grad_hooks or {}).values())
        assert not left, f"{what}: parameter {name} keeps {left}"


def round_robin_fp32_links(path):
    """zero/stage12/round_robin.py: [Note: round-robin fp32 links]. ZeRO-1/2, fp32/bf16/fp16, with
    ``round_robin_gradients``: every parameter's fp32 master as DeepSpeed's API reads it
    (``safe_get_full_fp32_param``) is its own (the 16-bit parameter is that master rounded), its AdamW
    state and master equal to an engine without round robin, trained on the same batches (bit-equal:
    two ranks sum in any order exactly); and a universal checkpoint of it, loaded into an engine without
    round robin, gives that engine its parameters. Upstream: another parameter's values, up to 1.9 off."""
    import os

    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    from deepspeed_multi import compat
    from deepspeed_multi.checkpoint import resize
    for stage in (1, 2):
        for dtype in ("fp32", "bf16", "fp16"):
            what = f"ZeRO-{stage} {dtype} round_robin_gradients"
            rr, plain = (_adamw_engine(ds_config(stage, dtype, zero_optimization={"round_robin_gradients": on}))
                         for on in (True, False))
            assert rr.optimizer.round_robin_gradients, what
            _train(rr, 2)
            _train(plain, 2)
            if rr.skipped_steps or plain.skipped_steps:  # fp16: the first scales may overflow, alike in both
                assert rr.skipped_steps == plain.skipped_steps, f"{what}: skipped steps differ"
            for (n, p), q in zip(rr.module.named_parameters(), plain.module.parameters()):
                master, want = safe_get_full_fp32_param(p), safe_get_full_fp32_param(q)
                assert torch.equal(master.to(p.dtype), p.detach()), f"{what}: {n}'s fp32 master is not its own"
                assert torch.equal(master, want), f"{what}: {n}'s fp32 master is not the one without round robin"
                for key in ("exp_avg", "exp_avg_sq"):
                    got, ref = safe_get_full_optimizer_state(p, key), safe_get_full_optimizer_state(q, key)
                    assert torch.equal(got, ref), f"{what}: {n}'s {key} differs from the engine without round robin"
            if dtype != "bf16":
                continue
            rr.save_checkpoint(os.path.join(path, f"rr{stage}"), tag="t")
            dist.barrier()
            if dist.get_rank() == 0:
                why = resize.convert(os.path.join(path, f"rr{stage}"), ["t"], os.path.join(path, f"universal{stage}"))
                assert why is None, why
            dist.barrier()
            loaded = _adamw_engine(ds_config(stage, dtype))
            load = functools.partial(resize.load_universal, loaded, os.path.join(path, f"universal{stage}"), "t")
            if not compat.universal_16bit_below_zero3_ok():  # wrong there, round robin or not: refused
                expect_error(RuntimeError, load, "gives it wrong parameters")
                continue
            load()
            got, want = full_params(loaded), full_params(rr)
            assert all(torch.equal(got[n], want[n]) for n in want), f"{what}: the universal checkpoint's values"


class _Blocks(nn.Module):
    """Three blocks in a ModuleList and a head: the model whose block sizes the defaults (72 elements)."""

    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(8, 8)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


_SIZE_KEYS = ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size")


def block_sizes_bitwise(stage, clip):
    """[Note: sizes from the model's block]: a config that leaves the sizes unset gets the block's (72
    elements: four reduction buckets, per-block prefetch and sub-groups at ZeRO-3); its AdamW updates
    are plain PyTorch's and, on 2 ranks, the same bits as the same engine with DeepSpeed's defaults
    written out (which are kept), with gradient clipping too."""
    gas, block, world = 2, 72, dist.get_world_size()
    unset = ds_config(stage, gas=gas, gradient_clipping=clip, deepspeed_multi={"min_block_elements": 0})
    for key in _SIZE_KEYS:
        unset["zero_optimization"].pop(key)
    written = ds_config(stage, gas=gas, gradient_clipping=clip)
    written["zero_optimization"].update(reduce_bucket_size=5 * 10**8, allgather_bucket_size=5 * 10**8,
                                        stage3_prefetch_bucket_size=5 * 10**7, stage3_max_live_parameters=10**9,
                                        stage3_max_reuse_distance=10**9, sub_group_size=10**9)

    def build(cfg):
        model = _Blocks(seed=1)
        return deepspeed_multi.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.05),
                                          config=cfg)[0]

    sized, kept = build(unset), build(written)
    zero = sized._config.zero_config
    want = {"reduce_bucket_size": block}
    # The live limit: a block and one element, the block being one piece (its Linear).
    want.update({"prefetch_bucket_size": block, "max_live_parameters": block + 1, "max_reuse_distance": block,
                 "sub_group_size": -(-block // world)} if stage == 3 else {"allgather_bucket_size": block})
    got = {k: getattr(zero, k) for k in want}
    assert got == want, f"ZeRO-{stage}: sizes from the block {got}, want {want}"
    assert kept._config.zero_config.reduce_bucket_size == 5 * 10**8, f"ZeRO-{stage}: a written size was replaced"
    if stage == 3:
        assert len(sized.optimizer.fp16_groups) > 1, "ZeRO-3: one sub-group, want one per block"
    ref = _Blocks(seed=1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05)
    for step in range(4):
        x, y = _batch(step)
        for engine in (sized, kept):
            ((engine(x) - y)**2).mean().backward()
            engine.step()
        _reference_micro_step(ref, ref_opt, step, gas, clip)
    a, b = full_params(sized), full_params(kept)
    worst = max((a[n] - b[n]).abs().max().item() for n in a)
    assert worst == 0 or world > 2, f"ZeRO-{stage} clip={clip}: block sizes moved the weights by {worst:.3e}"
    _assert_close(a, {n: p.detach() for n, p in ref.named_parameters()}, f"ZeRO-{stage} clip={clip} block sizes")
    for engine in (sized, kept):
        engine.destroy()


class _OddBlocks(nn.Module):
    """Blocks whose parameters (35, 5, 35, 7 elements) leave a padded chunk on the last rank."""

    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 7), nn.Tanh(), nn.Linear(7, 5), nn.Tanh(),
                                                  nn.Linear(5, 8)) for _ in range(3))

    def forward(self, x):
        x = x.to(self.blocks[0][0].weight.dtype)
        for block in self.blocks:
            x = x + block(x)
        return x.float()


def rank_order_bitwise(dtype):
    """deepspeed_multi/zero/stage3/rank_order.py: [Note: a bucket laid out for the reduce-scatter]. ZeRO-3
    buckets of 100 elements flush part full; the regions are reduce-scattered as a list (gloo) and,
    forced, moved together first (the path of other backends). AdamW updates with gradient clipping
    are plain PyTorch's in fp32 and, on 2 ranks, DeepSpeed's bits (DSM_ZERO3_RANK_ORDER=0) in fp32 and
    bf16; each bucket buffer is the regions' size and the stand-in gradients are gone after backward."""
    from deepspeed_multi import compat
    from deepspeed_multi.zero.stage3 import rank_order
    gas, world = 2, dist.get_world_size()
    cfg = ds_config(3, dtype, gas=gas, gradient_clipping=0.5, zero_optimization={"reduce_bucket_size": 100})

    def build():
        model = _OddBlocks(seed=1)
        return deepspeed_multi.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.05),
                                          config=cfg)[0]

    listed, moved, packed = build(), build(), _switched_off(build, "DSM_ZERO3_RANK_ORDER")
    where = f"ZeRO-3 {dtype} rank order"
    assert compat.installed(listed.optimizer, rank_order.FEATURE) and compat.installed(moved.optimizer, rank_order.FEATURE)
    assert not compat.installed(packed.optimizer, rank_order.FEATURE), where
    compat.state(moved.optimizer, rank_order.FEATURE)["gloo"] = False  # the contiguous reduce-scatter of NCCL and others
    params = list(listed.module.parameters())
    state = compat.state(listed.optimizer, rank_order.FEATURE)
    trainable = sum(p.ds_numel for p in params)
    assert state["stride"] == -(-min(100, trainable) // world) + len(params), (where, state["stride"])
    flushes = []
    scatter = rank_order.scatter

    def counting(self, *args):
        flushes.append(compat.state(self, rank_order.FEATURE)["layouts"][torch.float32 if dtype == "fp32" else
                                                                          torch.bfloat16].fill)
        return scatter(self, *args)

    rank_order.scatter = counting
    ref = _OddBlocks(seed=1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05)
    try:
        for step in range(4):
            x, y = _batch(step)
            for engine in (listed, moved, packed):
                ((engine(x) - y)**2).mean().backward()
                assert all(p.grad is None for p in engine.module.parameters()), f"{where}: a gradient stand-in kept"
                engine.step()
            _reference_micro_step(ref, ref_opt, step, gas, 0.5)
    finally:
        rank_order.scatter = scatter
    stride = state["stride"]
    assert len(set(flushes)) > 1 and all(0 < f < stride for f in flushes), f"{where}: region fills {flushes} of {stride}"
    a, b, c = full_params(listed), full_params(moved), full_params(packed)
    for name in a:
        assert torch.equal(a[name], b[name]), f"{where}: list and moved regions differ at {name}"
        assert world > 2 or torch.equal(a[name], c[name]), \
            f"{where}: differs from DeepSpeed's bits at {name} by {(a[name] - c[name]).abs().max().item():.3e}"
    if dtype == "fp32":
        _assert_close(a, {n: p.detach() for n, p in ref.named_parameters()}, where)
