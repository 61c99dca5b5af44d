"""One model, several ZeRO stages (deepspeed_multi/parts): the multimodal model against plain
PyTorch on the same global batch (parts_checks.py). One process group per test runs many cases."""
import pytest

import parts_checks as checks
from harness import run_distributed


@pytest.mark.parametrize("cases", ["run_stages", "run_features", "run_construction", "trainer_parts_vs_ddp",
                                   "trainer_parts_resume_across_epochs"])
def test_multimodal_model_in_parts(cases):
    run_distributed(getattr(checks, cases), timeout_s=600)
