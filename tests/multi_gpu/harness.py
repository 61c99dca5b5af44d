"""Run a test function in N real processes and fail fast (see [Note: no hangs] in
rank_launcher.py, which this wraps for pytest)."""
import os

from rank_launcher import RanksFailed, run_ranks

DEFAULT_TIMEOUT_S = float(os.environ.get("DSM_TEST_TIMEOUT", "240"))


def _allow_fp16_on_cpu(gpu):
    if not gpu:
        # DeepSpeed's CPU accelerator refuses fp16 unless oneDNN has fp16 kernels for this CPU,
        # yet torch computes fp16 on any CPU; the fp16 tests need it (test-only).
        from deepspeed.accelerator import get_accelerator
        type(get_accelerator()).is_fp16_supported = lambda self: True


def run_distributed(fn, *args, world_size: int = 2, timeout_s: float = DEFAULT_TIMEOUT_S, **kwargs):
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; fail with the failing rank's traceback."""
    try:
        run_ranks(fn, *args, world_size=world_size, timeout_s=timeout_s, rank_setup=_allow_fp16_on_cpu, **kwargs)
    except RanksFailed as e:
        raise AssertionError(str(e)) from None
