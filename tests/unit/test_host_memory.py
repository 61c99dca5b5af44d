"""What building an engine leaves resident (deepspeed_multi/host_memory.py). What it saves is measured
by benchmarks/memory_breakdown.py (resident memory by phase); here: that the free heap goes back and
nothing live does, that DeepSpeed's Muon kernels are compiled at their first call, once, and that
building an engine no longer imports what torch.compile needs; each can be switched off."""
import ctypes.util
import os
import subprocess
import sys
import textwrap
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


def test_muon_kernel_compiled_at_its_first_call_once():
    compiled = []

    def fake_compile(fn):
        compiled.append(fn)
        return lambda *a, **k: ("compiled", fn(*a, **k))

    def kernel(x, scale=1):
        return x * scale

    deferred = host_memory.compiled_at_first_call(kernel, compile_fn=fake_compile)
    assert compiled == [] and deferred.__wrapped__ is kernel and deferred.compiled_at_first_call
    assert deferred(2, scale=3) == ("compiled", 6) and deferred(1) == ("compiled", 1)
    assert compiled == [kernel], "compiled again at the second call"
    with mock.patch.object(torch.compiler, "is_compiling", return_value=True):
        assert deferred(4) == 4, "inside a compiled region the kernel itself must run (dynamo inlines it)"
    assert compiled == [kernel]


_BUILD = textwrap.dedent("""
    import sys
    import torch
    import deepspeed_multi
    from deepspeed_multi import host_memory
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    engine, *_ = deepspeed_multi.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()),
                                            config={"train_micro_batch_size_per_gpu": 2,
                                                    "zero_optimization": {"stage": 2}})
    kernels = sys.modules[host_memory.MUON_KERNELS]  # DeepSpeed imported it to ask whether AdamW is Muon
    print("torch.compile imports:", "torch._inductor.compiler_bisector" in sys.modules)
    print("at first call:", getattr(kernels.muon_update, "compiled_at_first_call", False))
""")


def test_building_an_engine_does_not_import_what_torch_compile_needs():
    """One rank, a ZeRO-2 AdamW engine: DeepSpeed imports its Muon module, whose kernels torch.compile wraps
    at import; with the kernels compiled at their first call Inductor's imports are not made (about 43 MiB
    resident, seconds of construction). Switched off, DeepSpeed's import makes them: the check can fail."""
    procs = {}
    for on in ("1", "0"):  # one rank: its store binds any free port (MASTER_PORT 0), nobody connects to it
        env = dict(os.environ, DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT="0",
                   RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", DSM_MUON_COMPILE_AT_FIRST_CALL=on)
        procs[on] = subprocess.Popen([sys.executable, "-c", _BUILD], env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
    out = {}
    try:
        for on, proc in procs.items():
            stdout, stderr = proc.communicate(timeout=240)
            assert proc.returncode == 0, stderr[-3000:]
            out[on] = [line for line in stdout.splitlines() if line.startswith(("torch.compile", "at first"))]
    finally:
        for proc in procs.values():
            proc.kill()
    assert out["1"] == ["torch.compile imports: False", "at first call: True"], out["1"]
    assert out["0"] == ["torch.compile imports: True", "at first call: False"], out["0"]
