"""DeepSpeed API uses found by DeepSpeed's own unit tests (docs/deepspeed_suite.md), in one group of ranks."""
import deepspeed_api_checks as checks
import feature_checks
from harness import run_distributed


def test_deepspeed_api_uses():
    """FusedAdam-style zero_grad(), requires_grad off at ZeRO-1/2/3, set_gradient_accumulation_boundary,
    an assigned ZeRO-3 partition, offloaded ZeRO-3 local gradients between backward and step."""
    run_distributed(checks.all_deepspeed_api, timeout_s=600)


def test_autotp_and_z3_leaves_beside_other_engines():
    """An AutoTP Llama (autotp_size 2, ZeRO 0-3) fed by a ZeRO-2/3 encoder with no opt-in, exact; engines
    without tensor parallelism on different groups still refused beside it; ZeRO-3 LlamaMLP leaves
    fed by an encoder, exact."""
    run_distributed(checks.all_autotp_and_leaves, timeout_s=300)


def test_newer_training_features():
    """DeepSpeed's torch_autocast in fp16 at ZeRO 0-3: one rank's overflow skips the update on every rank
    and backs the GradScaler off, as DDP's."""
    run_distributed(feature_checks.all_features, timeout_s=300)
