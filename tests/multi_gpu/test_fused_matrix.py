"""The ZeRO-1/2/3 scenarios of the matrix again, with buckets large enough for the fused passes.

The matrix's configs use 64-element buckets (to exercise bucketing), so most buckets hold one
parameter and the fused pass falls back to DeepSpeed's method (nothing to fuse). Here the same
scenarios run with 4096-element buckets, where every bucket holds several parameters, and
each rank asserts that the fused ops actually ran (unless DSM_FUSED_ZERO=0). The "fp32acc"
variant adds ``data_types.grad_accum_dtype = fp32`` so that 16-bit ZeRO-2 goes through the
compact fp32 partition (the add pass of allreduce_and_copy_with_multiple_ranks). The "world3"
variant runs on 3 ranks, where 1/world is not a power of two, so ZeRO-3's reduce-scatter input
is packed unscaled and divided as DeepSpeed divides it (zero3_scatter.py), and most gradients
leave a padded tail on the last rank.
"""
import os
import re

import pytest

import scenarios
from common import WORLD_SIZE
from harness import run_distributed

NAMES = [
    "single-z1", "single-z1-bf16", "single-z1-gas2", "chain-z1z3-gas22", "single-z2", "single-z2-bf16", "single-z2-fp16", "single-z2-gas2", "single-z3", "single-z3-bf16",
    "single-z3-gas2", "single-z3-fp16", "chain-z2z3-gas22", "chain-z3z3-gas31", "chain-z2z3-bf16", "two-backward-z2-gas2",
    "two-backward-z3", "zero-grad-discards-z3"
]
BUCKET = 4096


def check_with_large_buckets(names, bucket, fp32_accum, world):
    """Runs in every rank: patch the scenarios' config builder, count fused calls, check."""
    from deepspeed_multi import ops

    base, factories = scenarios.ds_config, dict(scenarios.SCENARIOS)

    def ds_config(*args, **kwargs):
        cfg = base(*args, **kwargs)
        cfg["zero_optimization"].update(reduce_bucket_size=bucket, allgather_bucket_size=bucket,
                                        stage3_prefetch_bucket_size=bucket)
        if fp32_accum and ("bf16" in cfg or "fp16" in cfg):
            cfg["data_types"] = {"grad_accum_dtype": "fp32"}
        return cfg

    def on_world(factory):

        def build():
            scenario = factory()
            scenario.world_size = world
            return scenario

        return build

    calls = dict.fromkeys(("pack", "pack_partitions", "unpack_accumulate"), 0)
    originals = {name: getattr(ops, name) for name in calls}
    from deepspeed_multi.zero.stage12 import reduce as fused_zero
    from deepspeed_multi.zero.stage3 import rank_order
    as_run, laid_out = fused_zero._bucket_as_run, rank_order.scatter

    def counting_laid_out(*args):  # ZeRO-3: the bucket reduce-scattered where its regions lie
        calls["rank_order"] = calls.get("rank_order", 0) + 1
        return laid_out(*args)

    def counting_in_place(*args):  # ZeRO-1/2: the bucket all-reduced where it lies
        run = as_run(*args)
        calls["in_place"] = calls.get("in_place", 0) + (run is not None)
        return run

    def counting(name):

        def op(*args, **kwargs):
            calls[name] += 1
            return originals[name](*args, **kwargs)

        return op

    scenarios.ds_config = ds_config
    scenarios.SCENARIOS.update({n: on_world(factories[n]) for n in names})
    for name in originals:
        setattr(ops, name, counting(name))
    fused_zero._bucket_as_run = counting_in_place
    rank_order.scatter = counting_laid_out
    try:
        scenarios.check_many(names)
    finally:
        scenarios.ds_config = base
        scenarios.SCENARIOS.update(factories)
        for name, op in originals.items():
            setattr(ops, name, op)
        fused_zero._bucket_as_run = as_run
        rank_order.scatter = laid_out
    if os.environ.get("DSM_FUSED_ZERO", "1") == "0":
        assert not any(calls.values()), f"DSM_FUSED_ZERO=0 but the fused ops ran: {calls}"
        return
    # Which fused passes the scenarios must reach: z1/z2 the bucket pack, z1/z2/z3 a fused pass
    # after the reduction (z1/z2 the in-place all-reduce or the copy-back, z3 the copy-back), z3
    # the reduce-scatter input laid out as gradients arrive (stage3_rank_order), or packed at the
    # flush where that is switched off.
    stages = {int(z) for n in names for z in re.findall(r"z(\d)", n)}
    calls["after_reduction"] = calls["unpack_accumulate"] + calls.get("in_place", 0)
    z3_input = "rank_order" if os.environ.get("DSM_ZERO3_RANK_ORDER", "1") != "0" else "pack_partitions"
    calls.setdefault("rank_order", 0)
    expected = {"pack": bool(stages & {1, 2}), "after_reduction": bool(stages), z3_input: 3 in stages}
    for name, needed in expected.items():
        if needed:
            assert calls[name] > 0, f"the fused ZeRO pass {name} never ran: every bucket fell back ({calls})"


@pytest.mark.parametrize("variant", ["default", "fp32acc", "world3"])
def test_fused_matrix(variant):
    names = [n for n in NAMES if n in scenarios.SCENARIOS]
    assert len(names) == len(NAMES), sorted(set(NAMES) - set(scenarios.SCENARIOS))
    world = 3 if variant == "world3" else WORLD_SIZE
    if variant == "fp32acc":
        names = [n for n in names if "bf16" in n or "fp16" in n]
    if variant == "world3":
        names = ["single-z1", "single-z2-gas2", "single-z3-gas2", "chain-z2z3-gas22", "single-z3-bf16"]
    run_distributed(check_with_large_buckets, names, BUCKET, variant == "fp32acc", world, world_size=world,
                    timeout_s=90 + 20 * len(names))
