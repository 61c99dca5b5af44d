"""The ZeRO-1/2 bucket all-reduced where it lies (zero/stage12/reduce.py, [Note: the ZeRO-1/2 bucket reduced
where it lies]) is bit-identical to DeepSpeed's flatten, all-reduce and copy-back.

Per config two engines train on the same batches, one with the fused passes and one with
``"deepspeed_multi": {"fused_reduce": false}`` (DeepSpeed's own methods); their weights must be
equal bit for bit after every step, and the in-place path must have run on every rank. The
configs cover both stages, the three dtypes, gradient accumulation, clipping, several buckets per
backward, overlap_comm, the fp32 accumulation buffer of 16-bit weights (the add into it), 3 ranks,
and fp16 overflows on one rank only: ZeRO-1's overflow check reads the other ranks' slices of the
bucket, which the in-place reduction leaves reduced where DeepSpeed leaves them unreduced, and
both engines must skip the same steps.
"""
import copy

import pytest
import torch

import deepspeed.comm as dist
import deepspeed_multi
from common import MLP, ds_config, full_params, record_found
from harness import run_distributed

# name: (stage, dtype, gas, gradient_clipping, world, extra zero_optimization, fp32 accumulation)
CONFIGS = {
    "z1-fp32-gas2-clip": (1, "fp32", 2, 0.05, 2, {}, False),
    "z2-fp32-overlap": (2, "fp32", 1, 0.0, 2, {"overlap_comm": True}, False),
    "z1-bf16": (1, "bf16", 1, 0.05, 2, {}, False),
    "z2-bf16-fp32acc-gas2": (2, "bf16", 2, 0.0, 2, {}, True),
    "z1-fp16-overflow": (1, "fp16", 1, 0.05, 2, {}, False),
    "z2-fp16-overflow-gas2": (2, "fp16", 2, 0.0, 2, {}, False),
    "z1-fp32-world3": (1, "fp32", 1, 0.0, 3, {}, False),
    "z2-fp32-world3-gas2": (2, "fp32", 2, 0.05, 3, {}, False),
}
STEPS = 6
OVERFLOW_STEPS = (1, 4)  # micro-steps at which rank 0 alone feeds an input that overflows fp16


def _batch(step, rank, dtype):
    g = torch.Generator().manual_seed(11 * step + rank)
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)
    if dtype == "fp16" and rank == 0 and step in OVERFLOW_STEPS:
        x = x * 6e4
    return x, y


def _check(name):
    from deepspeed_multi.zero.stage12 import reduce as fused_zero
    stage, dtype, gas, clip, _, zero_extra, fp32_accum = CONFIGS[name]
    rank = dist.get_rank()
    # 256-element buckets: the 552 parameters of the model reduce in several buckets per backward.
    zero = {"reduce_bucket_size": 256, "allgather_bucket_size": 256, **zero_extra}
    cfg = ds_config(stage, dtype, gas=gas, gradient_clipping=clip, zero_optimization=zero)
    if fp32_accum:
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    engines = {}
    for fused in (True, False):
        model = MLP(d_in=8, d_hidden=32, d_out=8, seed=5)
        opt = torch.optim.AdamW(model.parameters(), lr=0.02)
        engines[fused], *_ = deepspeed_multi.initialize(
            model=model, optimizer=opt, config={**copy.deepcopy(cfg), "deepspeed_multi": {"fused_reduce": fused}})

    with record_found(fused_zero, "_bucket_as_run") as in_place:
        for step in range(STEPS * gas):
            for engine in engines.values():
                x, y = _batch(step, rank, dtype)
                ((engine(x) - y)**2).mean().backward()
                engine.step()
            got = {k: full_params(e) for k, e in engines.items()}
            for n in got[True]:
                assert torch.equal(got[True][n], got[False][n]), (
                    f"{name}: {n} differs between the in-place reduction and DeepSpeed's after micro-step {step}: "
                    f"max {(got[True][n] - got[False][n]).abs().max().item():.3e}")
    assert in_place and all(in_place), f"{name} rank {rank}: a bucket fell back to DeepSpeed's flatten ({in_place})"
    if dtype == "fp16":
        skipped = [e.skipped_steps for e in engines.values()]
        assert skipped[0] == skipped[1] > 0, f"{name}: skipped steps differ or none overflowed: {skipped}"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_zero12_bucket_reduced_in_place(name):
    run_distributed(_check, name, world_size=CONFIGS[name][4], timeout_s=150)
