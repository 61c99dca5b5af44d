"""Ulysses sequence parallelism (DeepSpeed's ALST) against the full sequence in plain PyTorch.

A tiny Llama with DeepSpeed's Ulysses attention (``UlyssesSPAttentionHF.register_with_transformers``,
its mpu), ALST's token-weighted loss, 3 SGD steps, fp32: every parameter within 1e-5 of plain
PyTorch on the replicas' full sequences, at ZeRO 1, 2 and 3 (upstream ZeRO-1/2: every update 2x
too large, [Note: averaging over the sequence-data-parallel group]), and in a program of two
engines on the same mpu (a ZeRO-2 encoder MLP feeding the Llama's ``inputs_embeds``, one
``loss.backward()``). TiledMLP is exact; TiledFusedLogitsLoss is refused by name ([Note:
TiledFusedLogitsLoss under sequence parallelism]). Each world size runs all its cases in one call
on the same ranks (sp_checks.py).
"""
import os

import pytest

import sp_checks
import sp_trainer_checks
from common import FP32_TOL
from harness import run_distributed

SP2 = {  # 2 ranks: sequence_parallel_size 2, one data-parallel replica
    "z1": {"stage": 1},
    "z2": {"stage": 2},
    "z3": {"stage": 3},
    "z3-no-reduce-scatter": {"stage": 3, "zero": {"reduce_scatter": False}},
    "encoder-z2-llm-z1": {"stage": 1, "encoder": 2},
    "encoder-z2-llm-z2": {"stage": 2, "encoder": 2},
    "encoder-z2-llm-z3": {"stage": 3, "encoder": 2},
    "tiled-mlp-z2": {"stage": 2, "tiled_mlp": True},
    "tiled-mlp-z3": {"stage": 3, "tiled_mlp": True},
    "tiled-loss-z2": {"stage": 2, "tiled_loss": True},
}
SP2_DP2 = {  # 4 ranks: sequence_parallel_size 2 x two data-parallel replicas
    "z1": {"stage": 1},
    "z2": {"stage": 2},
    "z3": {"stage": 3},
    "encoder-z2-llm-z2": {"stage": 2, "encoder": 2},
}


def _check(results, name):
    for rank, out in enumerate(results):
        got = out[name]
        if "refused" in got:
            assert name.startswith("tiled-loss"), f"rank {rank}: {got['refused']}"
            for text in ("TiledFusedLogitsLoss", "sequence parallelism", "lm_head's gradient inside its forward",
                         "fixed incoming gradient", "TiledMLP"):
                assert text in got["refused"], (text, got["refused"])
            continue
        assert not name.startswith("tiled-loss"), f"rank {rank}: TiledFusedLogitsLoss under SP was not refused"
        assert got["err"] <= FP32_TOL, (f"{name}, rank {rank}: max abs error {got['err']:.3e} vs the full sequence "
                                        f"in plain PyTorch (update norm {got['ratio']:.3f}x)")


@pytest.fixture(scope="module")
def sp2():
    return run_distributed(sp_checks.run_cases, SP2, 2, world_size=2)


@pytest.fixture(scope="module")
def sp2_dp2():
    if os.environ.get("DSM_TEST_SP_WORLD4") != "1":
        pytest.skip("4 ranks (about 80 s on 2 CPU cores, most of it starting them): DSM_TEST_SP_WORLD4=1 runs it")
    return run_distributed(sp_checks.run_cases, SP2_DP2, 2, world_size=4)


@pytest.mark.parametrize("name", list(SP2))
def test_sp2(sp2, name):
    _check(sp2, name)


def test_untouched_without_sp(sp2):
    run_distributed(sp_checks.untouched_without_sp, world_size=2)


def test_zero0_under_sp_refused(sp2):
    run_distributed(sp_checks.zero0_refused, 2, world_size=2)


@pytest.mark.parametrize("name", list(SP2_DP2))
def test_sp2_dp2(sp2_dp2, name):
    _check(sp2_dp2, name)


def test_trainer_on_sp():
    """transformers.Trainer and TRL's SFTTrainer with ParallelismConfig(sp_backend="deepspeed") on our
    engines, ZeRO 1-3, gas 1/2, against DDP on the full sequences (1e-5); TRL's DPO (a second model)
    on SP refused by name."""
    pytest.importorskip("trl")
    run_distributed(sp_trainer_checks.trainer_on_sp, world_size=2, timeout_s=300)


@pytest.mark.parametrize("stages", [(3, 3, 2), (1, 0, 2), (2, 3, 1)])
def test_accelerate_several_models_on_sp(stages):
    """A sequence-parallel policy, its frozen reference and a value model prepared one by one through
    deepspeed_multi's Accelerator with ParallelismConfig(sp_backend="deepspeed"): exact (1e-5)."""
    pytest.importorskip("accelerate")
    run_distributed(sp_trainer_checks.accelerate_several_models_on_sp, stages, world_size=2, timeout_s=180)
