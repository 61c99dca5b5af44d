"""One model, several ZeRO stages (deepspeed_multi/parts): exact against plain PyTorch."""
import parts_checks as checks
from harness import run_distributed


def test_multimodal_model_in_parts_exact():
    run_distributed(checks.run_all, timeout_s=600)
