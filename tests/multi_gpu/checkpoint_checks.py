"""Rank functions for test_checkpoint.py (importable by the spawned ranks).

A "set" is a chain of engines trained under one loss with Adam; the loss draws noise from the
global torch RNG and python's random, so a resume is bit-identical only when the RNG states
are restored too.
"""
import os
import random

import deepspeed.comm as dist
import torch

import deepspeed_multi
from deepspeed_multi import checkpoint
from common import FP32_TOL, MLP, ds_config, full_params
from frozen_state_checks import _update_teacher

# set name -> chain of (engine name, ZeRO stage, gradient_accumulation_steps, trainable[, dtype])
SETS = {
    "z0": [("a", 0, 1, True)],
    "z1": [("a", 1, 1, True)],
    "z2": [("a", 2, 1, True)],
    "z3": [("a", 3, 1, True)],
    "mixed": [("enc", 2, 2, True), ("frozen", 3, 1, False), ("mid", 0, 1, True), ("head", 1, 1, True),
              ("top", 3, 2, True)],
}
SAVE_AT, TOTAL = 2, 4  # steps; every engine's window ends at SAVE_AT

# fp16 with dynamic loss scaling (initial scale 2**8, hysteresis 2, loss_scale_window 1: the
# scale doubles at every clean step but the first after an overflow): steps 1 and 2 overflow, so
# at the save (step 3) the scale has dropped (ZeRO-0's unfused optimizer has no hysteresis: it
# halves at each overflow), the hysteresis is spent and 2 steps were skipped; the first step
# after the resume overflows again (its outcome depends on the restored hysteresis), then the
# scale grows back (it depends on the restored overflow iteration).
FP16_SETS = {f"fp16_z{stage}": [("a", stage, 1, True, "fp16")] for stage in (0, 1, 2, 3)}
FP16_SETS["fp16_z2"].append(("frozen", 3, 1, False, "fp16"))  # an inference-only fp16 engine has no loss scale
FP16_SAVE_AT, FP16_TOTAL, FP16_OVERFLOW_STEPS = 3, 6, (1, 2, 3)
FP16_INITIAL_SCALE = 2.0**8
FP16_CONFIG = {"fp16": {"loss_scale_window": 1}}


def plan(set_name):
    """(save at, total steps, steps whose batch overflows in fp16) of a set."""
    if set_name in FP16_SETS:
        return FP16_SAVE_AT, FP16_TOTAL, FP16_OVERFLOW_STEPS
    return SAVE_AT, TOTAL, ()


def _chain(set_name):
    return SETS.get(set_name) or FP16_SETS[set_name]


def build(chain, seed_offset=0, frozen_offset=0, micro_bs=4, zero3_sub_group_size=None):
    """Trainable engines start from weights of ``seed_offset``, engines without an optimizer from
    ``frozen_offset``: a resume must overwrite both. ``zero3_sub_group_size``: the trained ZeRO-3
    engines' ``sub_group_size``."""
    engines = {}
    for i, (name, stage, gas, trainable, *dtype) in enumerate(chain):
        model = MLP(seed=i + 1 + (seed_offset if trainable else frozen_offset))
        cfg = ds_config(stage, gas=gas, micro_bs=micro_bs, **(dict(dtype=dtype[0], **FP16_CONFIG) if dtype == ["fp16"] else {}))
        if trainable and stage == 3 and zero3_sub_group_size is not None:
            cfg["zero_optimization"]["sub_group_size"] = zero3_sub_group_size
        if trainable:
            opt = torch.optim.Adam(model.parameters(), lr=1e-2)
            engines[name] = deepspeed_multi.initialize(model=model, optimizer=opt, config=cfg)[0]
        else:
            model.requires_grad_(False)
            engines[name] = deepspeed_multi.initialize(model=model, config=cfg)[0]
    return engines


def train(engines, start, stop, overflow_steps=()):
    """``overflow_steps``: steps whose input is scaled past the fp16 range (an inf/nan gradient)."""
    for step in range(start, stop):
        g = torch.Generator().manual_seed(100 * step + dist.get_rank())
        h, y = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)
        h = h + 0.1 * torch.randn(4, 8)  # global RNG
        if step in overflow_steps:
            h = h * 1e6
        device = next(iter(engines.values())).device
        h, y = h.to(device), y.to(device)
        for engine in engines.values():
            h = engine(h)
        (((h - y)**2).mean() * (1 + 0.1 * random.random())).backward()
        for engine in engines.values():
            if engine.trains:
                engine.step()


# Resume on another number of ranks (deepspeed_multi/checkpoint/resize.py): ZeRO 0-3 and a frozen
# ZeRO-3 engine updated as an EMA of another in one set, gas 1 and 2; every step is one global batch
# of RESIZE_BATCH rows, cut into equal slices, one per rank, so the runs on 2 and on 4 ranks train on
# the same data (equal up to the order of float sums: compared at FP32_TOL). No global RNG: a resized resume does not restore it.
RESIZE_SET = SETS["mixed"]
RESIZE_BATCH, RESIZE_SAVE_AT, RESIZE_TOTAL = 8, 2, 6


def _build_resized(seed_offset=0):
    return build(RESIZE_SET, seed_offset=seed_offset, frozen_offset=seed_offset, micro_bs=RESIZE_BATCH // dist.get_world_size(),
                 zero3_sub_group_size=64)  # several sub-groups: [Note: one step counter per sub-group]


def train_global_batch(engines, start, stop):
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = slice(rank * RESIZE_BATCH // world, (rank + 1) * RESIZE_BATCH // world)
    for step in range(start, stop):
        g = torch.Generator().manual_seed(1000 + step)
        h, y = torch.randn(RESIZE_BATCH, 8, generator=g)[rows], torch.randn(RESIZE_BATCH, 8, generator=g)[rows]
        device = next(iter(engines.values())).device
        h, y = h.to(device), y.to(device)
        for engine in engines.values():
            h = engine(h)
        ((h - y)**2).mean().backward()
        for engine in engines.values():
            if engine.trains:
                engine.step()
        # The frozen ZeRO-3 engine changes too (an EMA of the head): a resize reassembles its partitions.
        _update_teacher(engines["frozen"].module, engines["head"].module, step, "ema")


def save_for_resize(root):
    """The uninterrupted run on this number of ranks, saved at RESIZE_SAVE_AT on the way."""
    world = dist.get_world_size()
    engines = _build_resized()
    train_global_batch(engines, 0, RESIZE_SAVE_AT)
    deepspeed_multi.save_checkpoint(os.path.join(root, f"from{world}"), engines, client_state={"step": RESIZE_SAVE_AT})
    at_save = _params(engines)
    train_global_batch(engines, RESIZE_SAVE_AT, RESIZE_TOTAL)
    _save_rank0({"at_save": at_save, "final": _params(engines)}, os.path.join(root, f"from{world}.ref.pt"))


def resume_resized(root, saved_world):
    """Fresh engines (other weights) on this number of ranks resume the save of ``saved_world``
    ranks: bit-identical at the load, equal to the uninterrupted run at the end."""
    world = dist.get_world_size()
    assert world != saved_world, (world, saved_world)
    engines = _build_resized(seed_offset=50)
    # ZeRO-3 in several sub-groups (its block's share each): [Note: one step counter per sub-group]
    assert any(e.zero_optimization_stage() == 3 and e.trains and len(e.optimizer.fp16_groups) > 1
               for e in engines.values()), "no trained ZeRO-3 engine of the resize set has several sub-groups"
    state = deepspeed_multi.load_checkpoint(os.path.join(root, f"from{saved_world}"), engines)
    assert state == {"step": RESIZE_SAVE_AT}, state
    ref = torch.load(os.path.join(root, f"from{saved_world}.ref.pt"))
    what = f"saved on {saved_world} ranks, resumed on {world}"
    _assert_identical(_params(engines), ref["at_save"], f"{what}, just after loading step {RESIZE_SAVE_AT}")
    for name, e in engines.items():
        steps = RESIZE_SAVE_AT // e.gradient_accumulation_steps() if e.trains else 0
        assert e.global_steps == steps, f"{what}: engine {name!r} global_steps {e.global_steps}, saved at {steps}"
    train_global_batch(engines, RESIZE_SAVE_AT, RESIZE_TOTAL)
    got = _params(engines)
    for name in ref["final"]:
        for p, want in ref["final"][name].items():
            err = (got[name][p] - want).abs().max().item()
            assert err <= FP32_TOL, (f"{what}: engine {name!r} parameter {p} differs from the uninterrupted run by "
                                     f"{err:.3e} after step {RESIZE_TOTAL} (tolerance {FP32_TOL})")


def _reseed(seed):
    torch.manual_seed(seed)
    random.seed(seed)


def _params(engines):
    """Every engine's parameters (fp32 master weights for fp16), and for fp16 engines the loss
    scaler's state and the update counters, as one-element tensors."""
    out = {name: full_params(e) for name, e in engines.items()}
    for name, e in engines.items():
        if e.fp16_enabled() and e.trains:
            state = {"loss_scale": e._get_optimizer_loss_scale(), "skipped_steps": e.skipped_steps,
                     "global_steps": e.global_steps, **_scaler_state(e)}
            out[name].update({f"<{k}>": torch.tensor([float(v)], dtype=torch.float64) for k, v in state.items()})
    return out


def _scaler_state(engine):
    """The dynamic loss scaler's hidden state: ZeRO's DynamicLossScaler, or ZeRO-0's loss_scale_config."""
    opt = engine.optimizer
    scaler = getattr(opt, "loss_scaler", None) or getattr(opt, "loss_scale_config", None)
    keys = ("cur_iter", "last_overflow_iter", "cur_hysteresis")
    return {k: getattr(scaler, k) for k in keys if getattr(scaler, k, None) is not None}


def _save_rank0(obj, path):
    if dist.get_rank() == 0:
        torch.save(obj, path)
    dist.barrier()


def save_then_continue(root, sets):
    """The uninterrupted run of each set, with a set checkpoint taken at SAVE_AT on the way."""
    for set_name in sets:
        save_at, total, overflow = plan(set_name)
        _reseed(0)
        engines = build(_chain(set_name))
        train(engines, 0, save_at, overflow)
        for name, e in engines.items():
            if overflow and e.trains:  # the save must hold a loss scale and skip count that the overflows changed
                skipped, scale = len([s for s in overflow if s < save_at]), e._get_optimizer_loss_scale()
                assert e.skipped_steps == skipped and scale < FP16_INITIAL_SCALE, (
                    f"set {set_name} engine {name!r} before the save: {e.skipped_steps} skipped steps, loss scale "
                    f"{scale}; expected {skipped} and below the initial {FP16_INITIAL_SCALE}")
        path = deepspeed_multi.save_checkpoint(os.path.join(root, set_name), engines,
                                               client_state={"step": save_at, "set": set_name})
        steps = max(e.global_steps for e in engines.values())
        assert path == os.path.join(root, set_name, f"global_step{steps}"), path
        at_save = _params(engines)
        train(engines, save_at, total, overflow)
        _save_rank0({"at_save": at_save, "final": _params(engines)}, os.path.join(root, f"{set_name}.ref.pt"))


def resume_and_compare(root, sets):
    """Fresh engines (other initial weights, other RNG seed) resume each set: bit-identical at the end."""
    for set_name in sets:
        save_at, total, overflow = plan(set_name)
        _reseed(12345)
        engines = build(_chain(set_name), seed_offset=50, frozen_offset=50)
        state = deepspeed_multi.load_checkpoint(os.path.join(root, set_name), engines)
        assert state == {"step": save_at, "set": set_name}, state
        ref = torch.load(os.path.join(root, f"{set_name}.ref.pt"))
        _assert_identical(_params(engines), ref["at_save"], f"set {set_name} just after loading step {save_at}")
        train(engines, state["step"], total, overflow)
        _assert_identical(_params(engines), ref["final"], f"set {set_name} resumed at step {save_at}")
        _deepspeed_tools_read_it(os.path.join(root, set_name), engines, ref["at_save"])


def _assert_identical(got, want, what):
    for name in want:
        for p in want[name]:
            if not torch.equal(got[name][p], want[name][p]):
                err = (got[name][p] - want[name][p]).abs().max().item()
                kind = "state" if p.startswith("<") else "parameter"
                raise AssertionError(f"{what}: engine {name!r} {kind} {p} differs by up to {err:.3e} (want "
                                     "bit-identical)")


def _deepspeed_tools_read_it(set_dir, engines, at_save):
    """zero_to_fp32 reads every ZeRO engine of a set checkpoint; rank 0 checks."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    tag_dir = os.path.join(set_dir, open(os.path.join(set_dir, "latest")).read().strip())
    if dist.get_rank() == 0:
        for name, e in engines.items():
            if e.zero_optimization_stage() in (1, 2, 3) and e.trains:
                sd = get_fp32_state_dict_from_zero_checkpoint(tag_dir, tag=name)
                weights = {k: v for k, v in at_save[name].items() if not k.startswith("<")}
                _assert_identical({name: {k: v.float() for k, v in sd.items()}}, {name: weights},
                                  f"zero_to_fp32 on engine {name!r}")
    dist.barrier()


WINDOW_SET = [("w", 2, 2, True), ("f", 3, 1, False)]


def save_refused_mid_window(root):
    """A gas-2 engine after one backward holds gradients: save refuses; after zero_grad it saves
    its window position, and a resume continues the window exactly, also into engines (the frozen
    one too) built from other weights."""
    _reseed(0)
    engines = build(WINDOW_SET)
    train(engines, 0, 1)  # one micro-step of a 2-step window
    try:
        deepspeed_multi.save_checkpoint(os.path.join(root, "window"), engines)
    except RuntimeError as e:
        assert "holds the gradients of 1 backward pass(es)" in str(e) and "zero_grad" in str(e), str(e)
    else:
        raise AssertionError("save inside an accumulation window must be refused")
    engines["w"].zero_grad()
    deepspeed_multi.save_checkpoint(os.path.join(root, "window"), engines, client_state={}, tag="mid-window")
    train(engines, 1, 4)
    want = _params(engines)
    _reseed(7)
    fresh = build(WINDOW_SET, seed_offset=9)
    deepspeed_multi.load_checkpoint(os.path.join(root, "window"), fresh)
    assert fresh["w"]._window_micro_steps == 1 and fresh["w"].is_update_boundary()
    train(fresh, 1, 4)
    _assert_identical(_params(fresh), want, "resume inside a window emptied by zero_grad")
    other = build(WINDOW_SET, seed_offset=4, frozen_offset=3)  # the frozen engine too, from other weights
    deepspeed_multi.load_checkpoint(os.path.join(root, "window"), other)
    train(other, 1, 4)
    _assert_identical(_params(other), want, "resume with a frozen engine built from other weights")
    _damaged_is_refused(os.path.join(root, "window"), fresh)
    try:
        deepspeed_multi.load_checkpoint(os.path.join(root, "window"), {"w": other["w"]})
    except ValueError as e:
        assert "holds engines ['f', 'w'], given ['w']" in str(e), str(e)
    else:
        raise AssertionError("a set with other engine names must be refused")


def _damaged_is_refused(set_dir, engines):
    """A byte changed in a file of a complete tag: load (by explicit tag) refuses, naming the file."""
    tag_dir = os.path.join(set_dir, "mid-window")
    victim = os.path.join("w", "mp_rank_00_model_states.pt")
    if dist.get_rank() == 0:
        with open(os.path.join(tag_dir, victim), "r+b") as f:
            f.seek(100)
            byte = f.read(1)
            f.seek(100)
            f.write(bytes([byte[0] ^ 0xFF]))
    dist.barrier()
    try:
        deepspeed_multi.load_checkpoint(set_dir, engines, tag="mid-window")
    except RuntimeError as e:
        assert f"{tag_dir} is damaged: ['{victim} (checksum differs)']" in str(e), str(e)
    else:
        raise AssertionError("a damaged checkpoint must be refused")


# ------------------------------------------------------------------------------- the kill test
KILL_SET = [("enc", 2, 1, True), ("dec", 3, 1, True)]
KILL_FIRST, KILL_TOTAL = 1, 3  # steps: the first complete save; the end, where the killed saves happen


def _kill_at_phase(name):
    """SIGKILL this rank when save_checkpoint logs reaching phase ``name`` (one of checkpoint.PHASES)."""
    import logging
    import signal
    assert name in checkpoint.PHASES, name

    class Kill(logging.Handler):

        def emit(self, record):
            if record.getMessage() == f"save_checkpoint phase: {name}":
                os.kill(os.getpid(), signal.SIGKILL)

    log = logging.getLogger(checkpoint.__name__)
    log.setLevel(logging.DEBUG)
    log.addHandler(Kill())


def kill_round(root, expect_tag, kill_at, next_tag):
    """One job of the kill test.

    The first job (``expect_tag`` None) is the uninterrupted run: it saves a first complete
    checkpoint at KILL_FIRST on the way and records its parameters at the end. Every later job
    resumes fresh engines (other initial weights, other RNG seed) from the newest complete
    checkpoint, which must be ``expect_tag``, trains to the end and must match the uninterrupted
    run bit for bit. Then, with ``kill_at``, the job saves ``next_tag``, and every rank that
    reaches ``kill_at`` inside save_checkpoint SIGKILLs itself.
    """
    ref_path = os.path.join(os.path.dirname(root), "kill_ref.pt")
    if expect_tag is None:
        _reseed(0)
        engines = build(KILL_SET)
        train(engines, 0, KILL_FIRST)
        deepspeed_multi.save_checkpoint(root, engines, client_state={"step": KILL_FIRST}, tag="first")
        train(engines, KILL_FIRST, KILL_TOTAL)
        _save_rank0(_params(engines), ref_path)
    else:
        _reseed(777)
        engines = build(KILL_SET, seed_offset=50)
        chosen = [checkpoint.tags.choose(root, None)["tag"] if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(chosen, src=0)
        assert chosen[0] == expect_tag, f"resumed from {chosen[0]!r}, expected {expect_tag!r}"
        start = deepspeed_multi.load_checkpoint(root, engines)["step"]
        train(engines, start, KILL_TOTAL)
        _assert_identical(_params(engines), torch.load(ref_path), f"resume from {expect_tag!r}")
        print(f"RESUMED {expect_tag} from step {start}: bit-identical", flush=True)
    if kill_at is None:
        return
    _kill_at_phase(kill_at)
    print(f"SAVING {next_tag}", flush=True)
    deepspeed_multi.save_checkpoint(root, engines, client_state={"step": KILL_TOTAL}, tag=next_tag)
    raise AssertionError(f"kill point {kill_at!r} was never reached")


def last_round(root, expect_tag, expect_incomplete):
    """The job after the last kill: resume check, then the incomplete saves are reported and removed."""
    import logging
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logging.getLogger("deepspeed_multi.checkpoint").addHandler(handler)
    kill_round(root, expect_tag, None, None)
    if dist.get_rank() == 0:
        incomplete = sorted(os.path.basename(p) for p, _ in checkpoint.tags.complete_tags(root)[1])
        assert incomplete == sorted(expect_incomplete), (incomplete, expect_incomplete)
        for name in expect_incomplete:
            assert any("ignoring incomplete checkpoint" in m and name in m for m in seen), (name, seen)
        removed = checkpoint.remove_incomplete(root)
        assert sorted(os.path.basename(p) for p in removed) == sorted(expect_incomplete), removed
        assert checkpoint.tags.complete_tags(root)[1] == []
    dist.barrier()
