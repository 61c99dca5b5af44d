"""Generation from ZeRO-3 engines inside training loops: uneven lengths never hang and give the unsharded
model's outputs; the generation mode leaves the next update bit-identical (generation_checks.py)."""
import pytest

import generation_checks as checks
from harness import run_distributed


def test_uneven_lengths_in_own_loop():
    run_distributed(checks.uneven_lengths_own_loop, timeout_s=300)
    run_distributed(checks.generation_gather_bytes_bounds_the_mode, timeout_s=120)


def test_update_after_generation_is_bit_identical():
    run_distributed(checks.update_after_generation_is_unchanged, timeout_s=300)


def test_uneven_lengths_through_accelerate_and_lightning():
    pytest.importorskip("accelerate")
    run_distributed(checks.accelerate_with_another_plugin_selected, timeout_s=300)
    pytest.importorskip("lightning")
    run_distributed(checks.lightning_fabric_loop, timeout_s=300)


def test_uneven_lengths_in_a_trl_trainer():
    pytest.importorskip("trl")
    run_distributed(checks.trl_grpo_uneven_lengths, timeout_s=400)
