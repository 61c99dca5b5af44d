"""The compat layer end to end: a DeepSpeed whose fast-path methods differ, and one outside the window.

One spawned group of 2 ranks runs three phases on the same program (a ZeRO-1 engine, then a
ZeRO-2 engine, then a ZeRO-3 engine in one chain under one loss, gas 2, clipping, AdamW, fp32)
against plain PyTorch on the same global batch:

* as installed: every fast path that applies is on;
* for each fast path in turn, its methods swapped at class level for a wrapper (the stand-in
  for a DeepSpeed release that edited them): that fast path (and only it, with what is
  installed only together with it) is off, with one warning naming it, and the result is
  bit-identical to the first phase (the fast paths give DeepSpeed's bits);
* the fast paths of 16-bit ZeRO-3 only (``BF16_ONLY``, the 16-bit partition cast at gather) the same
  way on a bf16 ZeRO-3 engine of their own, bit-identical to that engine with them on;
* a DeepSpeed version outside the supported window with ``DSM_ALLOW_UNSUPPORTED_DEEPSPEED=1``:
  every fast path off, one warning, same bits; without the switch, initialize refuses.
"""
import copy
import inspect
import logging
import os
from unittest import mock

import torch

import deepspeed.comm as dist
import deepspeed_multi
from common import FP32_TOL, MLP, Records, ds_config, full_params
from deepspeed_multi import compat
from harness import run_distributed

STAGES = (1, 2, 3)
# Features installed only together with another, or relying on another's checked method: off with it.
DEPENDS_ON = {"stage3_partition": {"stage3_scatter"}, "stage12_reduce": {"stage12_bucket_pack"},
              "stage12_grad_view": {"stage12_overflow_view"}, "stage12_bucket_pack": {"stage12_bucket_size"},
              "stage3_lazy_grads": {"stage3_bucket_size"}}  # (the ZeRO-3 epilogue, which bucket_size wraps)
# Buckets larger than the models (416 elements), so that the bucket buffers are sized for them
# (zero/bucket_size.py) and the fused bucket passes see several parameters per bucket.
BUCKET = 1000
GAS, UPDATES = 2, 3
# Fast paths of 16-bit ZeRO-3 only: checked on a bf16 ZeRO-3 engine of their own (bits against itself).
BF16_ONLY = {"stage3_cast_on_gather", "stage3_cast_on_gather_init"}
# Fast paths this program's configs never install (ZeRO-1 with overlap_comm): nothing to switch off here.
ONLY_WITH_OTHER_CONFIGS = {"stage1_overlap_order"}


def _batch(step, rank):
    g = torch.Generator().manual_seed(11 * step + rank)
    return torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)


def _models():
    return [MLP(d_in=8, d_hidden=24, d_out=8, seed=s) for s in range(len(STAGES))]


def _train():
    """The chain through our engines; returns (final parameters, features installed per engine)."""
    engines, installed = [], []
    for stage, model in zip(STAGES, _models()):
        cfg = ds_config(stage, gas=GAS, gradient_clipping=0.5)
        cfg["zero_optimization"]["reduce_bucket_size"] = BUCKET
        opt = torch.optim.AdamW(model.parameters(), lr=0.02)
        engine, *_ = deepspeed_multi.initialize(model=model, optimizer=opt, config=copy.deepcopy(cfg))
        engines.append(engine)
        installed.append(sorted(f for f in compat.FAST_PATH_METHODS if compat.installed(engine.optimizer, f)))
    for step in range(UPDATES * GAS):
        x, y = _batch(step, dist.get_rank())
        for e in engines:
            x = e(x)
        ((x - y)**2).mean().backward()
        for e in engines:
            e.step()
    return [full_params(e) for e in engines], installed


def _train_bf16():
    """A bf16 ZeRO-3 engine; returns (final fp32 masters, features installed)."""
    model = MLP(d_in=8, d_hidden=24, d_out=8, seed=3)
    cfg = ds_config(3, "bf16", gas=GAS, gradient_clipping=0.5)
    engine, *_ = deepspeed_multi.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.02),
                                            config=cfg)
    for step in range(UPDATES * GAS):
        x, y = _batch(step, dist.get_rank())
        ((engine(x) - y)**2).mean().backward()
        engine.step()
    return [full_params(engine)], sorted(f for f in compat.FAST_PATH_METHODS if compat.installed(engine.optimizer, f))


def _reference():
    models, world = _models(), dist.get_world_size()
    opts = [torch.optim.AdamW(m.parameters(), lr=0.02) for m in models]
    for step in range(UPDATES * GAS):
        for r in range(world):
            x, y = _batch(step, r)
            for m in models:
                x = m(x)
            (((x - y)**2).mean() / (world * GAS)).backward()
        if (step + 1) % GAS == 0:
            for m, o in zip(models, opts):  # each engine clips on its own norm
                torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
                o.step()
                o.zero_grad(set_to_none=True)
    return [{n: p.detach().clone() for n, p in m.named_parameters()} for m in models]


def _changed(cls, name):
    """``cls.<name>`` as a DeepSpeed release that edited it (same behaviour, other source)."""
    static = isinstance(inspect.getattr_static(cls, name), staticmethod)
    fn = getattr(cls, name)

    def changed_upstream(*args, **kwargs):
        return fn(*args, **kwargs)

    return staticmethod(changed_upstream) if static else changed_upstream


def _assert_same(got, want, what, exact):
    for i, (g, w) in enumerate(zip(got, want)):
        for n in w:
            err = (g[n] - w[n]).abs().max().item()
            assert (err == 0.0) if exact else (err <= FP32_TOL), f"{what}: engine {i} {n}: max abs error {err:.3e}"


def _check():
    records = Records()
    logging.getLogger("deepspeed_multi.compat").addHandler(records)
    reference = _reference()

    base, installed = _train()
    _assert_same(base, reference, "as installed vs PyTorch", exact=False)
    if compat.fast_paths_allowed():  # a DeepSpeed release the fast paths were checked on
        assert "stage12_reduce" in installed[0] and "stage12_bucket_pack" in installed[1], installed
        assert {"stage3_partition", "stage3_grad_view", "stage3_bucket_size", "stage3_lazy_grads"} <= set(installed[2]), \
            installed
        assert "stage12_bucket_size" in installed[0] and "stage12_bucket_size" in installed[1], installed
        # fp32 AdamW engines: the master is the parameter partition (zero/master_alias.py)
        assert all("stage12_master_alias" in i for i in installed[:2]) and "stage3_master_alias" in installed[2], \
            installed
        assert not records.messages, records.messages
    else:  # an older supported release: every fast path off, said once
        assert installed == [[], [], []], installed
        assert len(records.messages) == 1 and "were checked on" in records.messages[0], records.messages

    on = set().union(*installed)
    base_bf16, on_bf16 = _train_bf16()
    if on:
        assert BF16_ONLY <= set(on_bf16), on_bf16
    for feature, (owner, names) in compat.FAST_PATH_METHODS.items():
        if not on:
            break
        if feature in ONLY_WITH_OTHER_CONFIGS:
            assert feature not in on, (feature, installed)
            continue
        cls = compat._class(owner)
        saved = {name: vars(cls).get(name) for name in names}
        records.messages.clear()
        for name in names:
            setattr(cls, name, _changed(cls, name))
        try:
            got, now = _train_bf16() if feature in BF16_ONLY else _train()
        finally:
            for name, fn in saved.items():
                setattr(cls, name, fn) if fn is not None else delattr(cls, name)
        if feature in BF16_ONLY:
            assert set(on_bf16) - set(now) == BF16_ONLY, (feature, on_bf16, now)  # (one feature, two owners)
            # (stage3_master_alias checks one of the same methods, and says so too, though off in bf16 anyway)
            assert any(f"fast path {feature} off" in m for m in records.messages) and all(
                "differs from the source" in m for m in records.messages), records.messages
            _assert_same(got, base_bf16, f"{feature} off (its method changed) vs on", exact=True)
            continue
        off = on - set().union(*now)
        assert off == {feature} | DEPENDS_ON.get(feature, set()) & on, (feature, off)
        assert [m for m in records.messages if "differs from the source" in m] == [
            m for m in records.messages if f"fast path {feature} off" in m] and len(records.messages) == 1, (
                feature, records.messages)
        _assert_same(got, base, f"{feature} off (its method changed) vs on", exact=True)

    records.messages.clear()
    compat.check_deepspeed.cache_clear()
    with mock.patch.object(compat, "installed_version", lambda: "0.18.0"):
        try:
            deepspeed_multi.initialize(model=MLP(), optimizer=None, config=ds_config(2))
        except compat.UnsupportedDeepSpeed as e:
            assert "0.18.0" in str(e) and compat.ALLOW_ENV in str(e) and compat.SUPPORTED[0] in str(e), str(e)
        else:
            raise AssertionError("a DeepSpeed outside the window was not refused")
        compat.check_deepspeed.cache_clear()
        with mock.patch.dict(os.environ, {compat.ALLOW_ENV: "1"}):
            got, installed = _train()
    compat.check_deepspeed.cache_clear()
    assert installed == [[], [], []], installed
    assert sum("outside the supported window" in m for m in records.messages) == 1, records.messages
    _assert_same(got, base, "outside the window (fast paths off) vs as installed", exact=True)


def test_changed_methods_and_versions_turn_fast_paths_off_exactly():
    run_distributed(_check, timeout_s=180, fresh=True)  # it swaps DeepSpeed methods and versions process-wide
