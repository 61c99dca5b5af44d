"""The stock Trainer and TRL's trainers with ``deepspeed.initialize`` swapped for ours: upstream's bits, checkpoint
files included (trainer_drop_in_checks.py). One process group runs every case of a test."""
import pytest

pytest.importorskip("transformers")

import trainer_drop_in_checks as checks  # noqa: E402
from harness import run_distributed  # noqa: E402


def test_stock_trainer_as_upstream():
    """transformers.Trainer unchanged at ZeRO 1-3, fp32 and bf16, gas 2 (and 3 at ZeRO-2)."""
    run_distributed(checks.stock_trainer_as_upstream, [(1, False, 2), (2, True, 2), (3, False, 2), (3, True, 2),
                                                       (1, True, 2), (2, False, 3)], timeout_s=600)


def test_trl_trainers_as_upstream():
    """TRL's trainers unchanged, their reference, reward and teacher models prepared by TRL: each at stages of its
    own, ZeRO 1-3 covered, bf16 (as TRL's launcher configs run them) and fp32, gas 1 and 2; the distillation trainer
    (its loss over both models' lm_head.weight) at every stage."""
    pytest.importorskip("trl")
    run_distributed(checks.trl_trainers_as_upstream, [
        ("SFT", 1, 2, "bf16"), ("SFT", 3, 2, "fp32"), ("DPO", 2, 2, "bf16"), ("DPO", 3, 1, "fp32"),
        ("DPO", 1, 2, "bf16"), ("Distillation", 1, 2, "bf16"), ("Distillation", 2, 1, "fp32"),
        ("Distillation", 3, 2, "bf16"), ("GRPO", 3, 2, "bf16"), ("GRPO", 1, 1, "fp32"), ("RLOO", 2, 2, "bf16"),
        ("OnlineDPO", 1, 1, "bf16"), ("GKD", 2, 2, "bf16")], timeout_s=600)


def test_saved_models_as_upstream():
    """save_model of a tied-embedding model: our Trainer, a TRL trainer with a role at ZeRO-3, and the stock Trainer
    through ours save upstream's keys (ZeRO-2; ZeRO-3 gathered on save) and read back tied."""
    pytest.importorskip("trl")
    run_distributed(checks.saved_models_as_upstream, timeout_s=400)


def test_trl_roles_under_accelerate_launch():
    """Per-role stages (multi_engine_trainer + deepspeed_roles) under the variables accelerate launch exports for
    TRL's shipped DeepSpeed yaml, against DDP."""
    pytest.importorskip("trl")
    run_distributed(checks.roles_under_accelerate_launch, timeout_s=300)
