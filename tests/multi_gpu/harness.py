"""Run a test function in N real processes and fail fast (see [Note: no hangs] in
rank_launcher.py, which this wraps for pytest)."""
import os

import atexit

from common import WORLD_SIZE
from rank_launcher import RankPool, RanksFailed, run_ranks

DEFAULT_TIMEOUT_S = float(os.environ.get("DSM_TEST_TIMEOUT", "240"))


def _allow_fp16_on_cpu(gpu):
    if gpu and os.environ.get("DSM_TEST_DETERMINISTIC") == "1":
        # Bit-identical resume checks on a GPU need kernels that sum in a fixed order (CUDA's atomics do
        # not); CUBLAS_WORKSPACE_CONFIG=:4096:8 must be set as well (benchmarks/run_gpu.sh sets both).
        import torch
        torch.use_deterministic_algorithms(True, warn_only=True)
    if not gpu:
        # DeepSpeed's CPU accelerator refuses fp16 unless oneDNN has fp16 kernels for this CPU,
        # yet torch computes fp16 on any CPU; the fp16 tests need it (test-only).
        from deepspeed.accelerator import get_accelerator
        type(get_accelerator()).is_fp16_supported = lambda self: True


_POOL = []  # the one RankPool of this test session (see [Note: a pool of ranks] in rank_launcher.py)


def _pool(world_size):
    if _POOL and (_POOL[0].world_size != world_size or not _POOL[0].alive):
        _POOL.pop().close()
    if not _POOL:
        _POOL.append(RankPool(world_size, rank_setup=_allow_fp16_on_cpu))
    return _POOL[0]


@atexit.register
def _close_pool():
    while _POOL:
        _POOL.pop().close()


def run_distributed(fn, *args, world_size: int = None, timeout_s: float = DEFAULT_TIMEOUT_S, fresh: bool = False,
                    **kwargs):
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; fail with the failing rank's traceback;
    return what each rank returned, by rank.

    The ranks are the session's pool, reused from test to test; ``fresh=True`` starts new ranks for
    this run alone (a test that changes process-wide state it cannot undo). ``world_size``
    defaults to common.WORLD_SIZE (2, or DSM_TEST_WORLD_SIZE)."""
    world_size = world_size or WORLD_SIZE
    try:
        if fresh:
            return run_ranks(fn, *args, world_size=world_size, timeout_s=timeout_s, rank_setup=_allow_fp16_on_cpu,
                             **kwargs)
        return _pool(world_size).run(fn, *args, timeout_s=timeout_s, **kwargs)
    except RanksFailed as e:
        raise AssertionError(str(e)) from None
