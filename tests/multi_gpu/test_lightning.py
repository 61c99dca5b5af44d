"""deepspeed_multi.lightning: Fabric programs written for DDP, run unchanged but for the strategy,
against the same programs under Lightning's DDP strategy (exact, fp32, rank by rank)."""
import pytest

pytest.importorskip("lightning")

import lightning_checks as checks  # noqa: E402
from harness import run_distributed  # noqa: E402


def test_fabric_programs_against_ddp():
    run_distributed(checks.fabric_programs)


def test_fabric_save_load_resume(tmp_path):
    run_distributed(checks.fabric_resume, str(tmp_path))


def test_fabric_bad_input():
    run_distributed(checks.fabric_bad_input)


def test_trainer_gan_against_ddp_and_resume(tmp_path):
    run_distributed(checks.trainer_gan, str(tmp_path))


def test_trainer_ema_teacher_resume(tmp_path):
    run_distributed(checks.trainer_ema_distillation_resume, str(tmp_path))


def test_trainer_distillation_and_bad_input():
    run_distributed(checks.trainer_distillation_and_bad_input)
