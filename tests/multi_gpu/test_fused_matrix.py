"""The ZeRO-2/3 scenarios of the matrix again, with buckets large enough for the fused passes.

The matrix's configs use 64-element buckets (to exercise bucketing), so most buckets hold one
parameter and fused_zero falls back to DeepSpeed's method (nothing to fuse). Here the same
scenarios run with 4096-element buckets, where every bucket holds several parameters, and
each rank asserts that the fused ops actually ran (unless DSM_FUSED_ZERO=0). The "fp32acc"
variant adds ``data_types.grad_accum_dtype = fp32`` so that 16-bit ZeRO-2 goes through the
compact fp32 partition (the add pass of allreduce_and_copy_with_multiple_ranks).
"""
import os

import pytest

import scenarios
from harness import run_distributed

NAMES = [
    "single-z2", "single-z2-bf16", "single-z2-fp16", "single-z2-gas2", "single-z3", "single-z3-bf16",
    "single-z3-gas2", "chain-z2z3-gas22", "chain-z3z3-gas31", "chain-z2z3-bf16", "two-backward-z2-gas2",
    "two-backward-z3", "zero-grad-discards-z3"
]
BUCKET = 4096


def check_with_large_buckets(names, bucket, fp32_accum):
    """Runs in every rank: patch the scenarios' config builder, count fused calls, check."""
    from deepspeed_multi import ops
    from deepspeed_multi import fused_zero

    base = scenarios.ds_config

    def ds_config(*args, **kwargs):
        cfg = base(*args, **kwargs)
        cfg["zero_optimization"].update(reduce_bucket_size=bucket, allgather_bucket_size=bucket,
                                        stage3_prefetch_bucket_size=bucket)
        if fp32_accum and ("bf16" in cfg or "fp16" in cfg):
            cfg["data_types"] = {"grad_accum_dtype": "fp32"}
        return cfg

    calls = [0]
    unpack = ops.unpack_accumulate

    def counting_unpack(*args, **kwargs):
        calls[0] += 1
        return unpack(*args, **kwargs)

    scenarios.ds_config = ds_config
    fused_zero.ops.unpack_accumulate = counting_unpack
    try:
        scenarios.check_many(names)
    finally:
        scenarios.ds_config = base
        fused_zero.ops.unpack_accumulate = unpack
    if os.environ.get(fused_zero.ENV, "1") == "0":
        assert calls[0] == 0, "DSM_FUSED_ZERO=0 but the fused ops ran"
    else:
        assert calls[0] > 0, "the fused ZeRO passes never ran: every bucket fell back"


@pytest.mark.parametrize("fp32_accum", [False, True], ids=["default", "fp32acc"])
def test_fused_matrix(fp32_accum):
    names = [n for n in NAMES if n in scenarios.SCENARIOS]
    assert len(names) == len(NAMES), sorted(set(NAMES) - set(scenarios.SCENARIOS))
    if fp32_accum:
        names = [n for n in names if "bf16" in n or "fp16" in n]
    run_distributed(check_with_large_buckets, names, BUCKET, fp32_accum, world_size=2, timeout_s=90 + 20 * len(names))
