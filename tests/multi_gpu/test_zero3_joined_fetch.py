"""Several ZeRO-3 engines' first forward fetches as one all-gather (zero/stage3/joined_fetch.py), and
what an engine keeps gathered after its forward released while the others run (stage3/release_between.py).

Each program trains its engines twice on the same batches in the same ranks: with the joined
fetch and with each engine fetching its own (``DSM_ZERO3_JOINED_FETCH=0`` at construction).
After every step every parameter (the fp32 masters of bf16 engines) must be bit-equal between
the two, the joins must have happened where the engines' shares fit one prefetch bucket, and
none where they do not. The programs reach what the join has to get right: chained and parallel
wiring, a ZeRO-2 engine between ZeRO-3 ones, bf16 beside fp32 (one collective per dtype), an
inference-only engine, gradient accumulation, prefetch buckets too small to join, a predicted
engine not called in a round (its share released, then called again), parameters read with
``GatheredParameters`` between two engines' forwards of a round, and an engine destroyed while
the others go on.

The same programs with a reuse distance shorter than each engine (so that another engine's forward
releases what an engine keeps for its backward) train once with the release and once without
(``DSM_ZERO3_RELEASE_BETWEEN=0``): bit-equal parameters after every step, releases counted with
it and none without; and a forward inside a ``GatheredParameters`` context over another engine's
parameters leaves that context's parameters gathered.
"""
import copy
import os
from unittest import mock

import pytest
import torch

import deepspeed
import deepspeed.comm as dist
import deepspeed_multi
from deepspeed_multi import compat
from deepspeed_multi.zero.stage3 import joined_fetch as stage3_joined_fetch
from deepspeed_multi.zero.stage3 import release_between as stage3_release_between
from common import MLP, ds_config, full_params
from harness import run_distributed

BIG = {"stage3_prefetch_bucket_size": 100_000, "stage3_max_live_parameters": 10**9}  # room for every engine's share
SMALL = {}  # common.ds_config's 64 elements: less than one engine's share, so nothing joins

# name: (engines as (stage, dtype, trains, zero options), wiring, gas, steps, joins expected)
PROGRAMS = {
    "chained-fp32": ([(3, "fp32", True, BIG), (2, "fp32", True, {}), (3, "fp32", True, BIG), (3, "fp32", True, BIG)],
                     "chained", 1, 5, True),
    "parallel-fp32-bf16-gas2": ([(3, "fp32", True, BIG), (3, "bf16", True, BIG), (3, "bf16", True, BIG)],
                                "parallel", 2, 6, True),
    "frozen-teacher": ([(3, "fp32", False, BIG), (3, "fp32", True, BIG), (3, "fp32", True, BIG)],
                       "chained", 1, 5, True),
    "buckets-too-small": ([(3, "fp32", True, SMALL), (3, "fp32", True, SMALL)], "chained", 1, 4, False),
}
SKIPPED_AT, READ_AT, DESTROYED_AT = 2, 3, 4  # steps of the twists (chained programs)
# Programs rerun with the release on and off: a reuse distance below every engine's size (552 elements)
RELEASED = ("chained-fp32", "parallel-fp32-bf16-gas2", "frozen-teacher")
SHORT_REUSE = {"stage3_max_reuse_distance": 100}


def _engines(specs, gas, joined, released=True):
    engines = []
    for k, (stage, dtype, trains, zero) in enumerate(specs):
        model = MLP(d_in=8, d_hidden=32, d_out=8, seed=k)
        cfg = ds_config(stage, dtype, gas=gas, zero_optimization=zero)
        switches = {"DSM_ZERO3_JOINED_FETCH": "1" if joined else "0", "DSM_ZERO3_RELEASE_BETWEEN": "1" if released else "0"}
        with mock.patch.dict(os.environ, switches):
            if trains:
                opt = torch.optim.AdamW(model.parameters(), lr=0.02)
                engines.append(deepspeed_multi.initialize(model=model, optimizer=opt, config=cfg)[0])
            else:
                model.requires_grad_(False)
                engines.append(deepspeed_multi.initialize(model=model, config=cfg)[0])
        if stage == 3:
            coordinator = stage3_joined_fetch.coordinator_of(engines[-1].optimizer)
            assert compat.installed(coordinator, stage3_joined_fetch.FEATURE) == joined
    return engines


def _batch(step):
    g = torch.Generator().manual_seed(31 * step + dist.get_rank())
    return torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)


def _run(specs, wiring, gas, steps, joined, released=True):
    """Train; return before each step and at the end the parameters of every live engine, and what
    GatheredParameters read between two forwards of a round."""
    engines = _engines(specs, gas, joined, released)
    live = list(range(len(engines)))
    target = [k for k in live if specs[k][0] == 3][1]  # the twists' engine: a ZeRO-3 engine that is not first
    seen = []
    for step in range(steps):
        # Reading the skipped engine's parameters would release (partition) what the last round gathered
        # for it: that share is left for the next round's start to release.
        unread = target if step == SKIPPED_AT + 1 else None
        seen.append(({k: full_params(engines[k]) for k in live if k != unread}, None))
        x, y = _batch(step)
        called = [k for k in live if not (wiring == "chained" and step == SKIPPED_AT and k == target)]
        outs = []
        for k in called:
            if wiring == "chained" and step == READ_AT and k == target:
                with deepspeed.zero.GatheredParameters(list(engines[k].module.parameters())):
                    seen[-1] = (seen[-1][0], [p.detach().clone() for p in engines[k].module.parameters()])
            outs.append(engines[k](x if wiring == "parallel" or not outs else outs[-1]))
        loss = ((outs[-1] - y)**2).mean() if wiring == "chained" else sum(((o - y)**2).mean() for o in outs)
        loss.backward()
        for k in called:
            if specs[k][2] and (step + 1) % gas == 0:
                engines[k].step()
        if wiring == "chained" and step == DESTROYED_AT - 1 and target in live:
            engines[target].destroy()
            live.remove(target)
    seen.append(({k: full_params(engines[k]) for k in live}, None))
    for k in live:
        engines[k].destroy()
    return seen


def _check(name):
    specs, wiring, gas, steps, expect_joins = PROGRAMS[name]
    before = dict(stage3_joined_fetch.STATS)
    ours = _run(specs, wiring, gas, steps, joined=True)
    joins, released = (stage3_joined_fetch.STATS[k] - before.get(k, 0) for k in ("joins", "released"))
    theirs = _run(specs, wiring, gas, steps, joined=False)
    assert stage3_joined_fetch.STATS["joins"] - before.get("joins", 0) == joins, \
        "an engine built with the switch off joined"
    assert (joins > 0) == expect_joins, f"{name}: {joins} joined fetches"
    if expect_joins and wiring == "chained":  # the skipped engine's share was gathered, then released
        assert released > 0, f"{name}: nothing gathered for the skipped engine was released"
    _same(name, ours, theirs, "its own fetches'")


def _check_release(name):
    specs, wiring, gas, steps, _ = PROGRAMS[name]
    specs = [(stage, dtype, trains, {**zero, **SHORT_REUSE}) for stage, dtype, trains, zero in specs]

    def run(released):  # (what _run returns, parameters released in it)
        before = stage3_release_between.STATS["released"]
        seen = _run(specs, wiring, gas, steps, joined=True, released=released)
        return seen, stage3_release_between.STATS["released"] - before

    (ours, on), (theirs, off) = run(True), run(False)
    assert on > 0 and off == 0, f"{name}: {on} parameters released with the release on, {off} with it off"
    _same(name + " (short reuse)", ours, theirs, "the run keeping them gathered")


def _gathered_context_is_left_alone():
    """Another engine's forward inside a GatheredParameters context over an engine's parameters leaves
    them gathered for the context (the release skips what a user holds)."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    a, b = _engines([(3, "fp32", True, SHORT_REUSE), (3, "fp32", True, SHORT_REUSE)], gas=1, joined=True)
    for step in range(4):
        x, y = _batch(step)
        before = stage3_release_between.STATS["released"]
        hidden = a(x)
        if step < 2:  # b's forward releases what a keeps for its backward (once a's trace is recorded)
            out = b(hidden)
            assert step == 0 or stage3_release_between.STATS["released"] > before, f"step {step}: nothing released"
        else:
            with deepspeed.zero.GatheredParameters(list(a.module.parameters())):
                out = b(hidden)
                held = [p.ds_status == ZeroParamStatus.AVAILABLE for p in a.module.parameters()]
                assert all(held), f"step {step}: {held.count(False)} parameters released inside GatheredParameters"
        ((out - y)**2).mean().backward()
        a.step()
        b.step()
    a.destroy()
    b.destroy()


def _same(name, ours, theirs, what):
    for step, ((a, read_a), (b, read_b)) in enumerate(zip(ours, theirs)):
        assert a.keys() == b.keys()
        for k in a:
            for n in a[k]:
                assert torch.equal(a[k][n], b[k][n]), f"{name}: step {step}, engine {k}'s {n} differs from {what}"
        assert (read_a is None) == (read_b is None)
        for u, v in zip(read_a or (), read_b or ()):
            assert torch.equal(u, v), f"{name}: step {step}: GatheredParameters between two forwards read other values"


def _all():
    for name in PROGRAMS:
        _check(name)
    for name in RELEASED:
        _check_release(name)
    _gathered_context_is_left_alone()


def test_joined_fetch_and_release_give_each_engines_own_bits():
    run_distributed(_all)
