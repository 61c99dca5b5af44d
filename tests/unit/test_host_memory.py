"""The construction's free heap handed back (deepspeed_multi/host_memory.py). What it saves is measured
by benchmarks/memory_breakdown.py (resident memory by phase); here: that it runs, frees nothing live,
and can be switched off."""
import ctypes.util
import os
from unittest import mock

import pytest
import torch

from deepspeed_multi import host_memory


def _resident_kib():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))


@pytest.mark.skipif(not (ctypes.util.find_library("c") and os.path.exists("/proc/self/status")),
                    reason="needs glibc and /proc (Linux)")
def test_free_heap_goes_back_and_live_tensors_stay():
    kept = torch.arange(1 << 16, dtype=torch.float32)
    chunks = [torch.ones(1 << 14) for _ in range(2000)]  # 128 MiB in 64 KiB chunks: heap, not mmap
    del chunks[::2]
    before = _resident_kib()
    assert host_memory.release_free_heap()
    assert _resident_kib() < before - 32 * 1024, "half of 128 MiB of freed heap chunks is still resident"
    assert torch.equal(kept, torch.arange(1 << 16, dtype=torch.float32)) and all(c.sum() == 1 << 14 for c in chunks)


def test_switched_off():
    with mock.patch.dict(os.environ, {"DSM_TRIM_AFTER_BUILD": "0"}):
        assert not host_memory.release_free_heap()
