"""DeepSpeed API uses found by DeepSpeed's own unit tests (docs/deepspeed_suite.md), in one group of ranks."""
import deepspeed_api_checks as checks
from harness import run_distributed


def test_deepspeed_api_uses():
    """FusedAdam-style zero_grad(), requires_grad off at ZeRO-1/2/3, set_gradient_accumulation_boundary,
    an assigned ZeRO-3 partition, offloaded ZeRO-3 local gradients between backward and step."""
    run_distributed(checks.all_deepspeed_api, timeout_s=600)
