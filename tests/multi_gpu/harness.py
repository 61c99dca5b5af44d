"""Run a test function in N real processes and fail fast.

[Note: no hangs]
A collective that one rank skips blocks the others forever, so every run has a deadline.
Each rank arms ``faulthandler.dump_traceback_later`` a little before the deadline, so a hung
rank writes its own stack to its log before the parent kills it. The first rank that raises
ends the run at once: the parent terminates the others and fails the test with that rank's
traceback (and the tail of every rank's log).

Backend: NCCL with one GPU per rank where ``torch.cuda.device_count() >= world_size``, else
gloo on CPU (``DS_ACCELERATOR=cpu``). The function must be importable (module level) because
ranks are started with the ``spawn`` method.
"""
import faulthandler
import os
import queue
import socket
import tempfile
import time
import traceback

import torch
import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = float(os.environ.get("DSM_TEST_TIMEOUT", "240"))


def use_gpu(world_size: int) -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() >= world_size


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank, world_size, port, gpu, log_dir, timeout_s, results, fn, args, kwargs):
    log = open(os.path.join(log_dir, f"rank{rank}.log"), "w", buffering=1)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    faulthandler.dump_traceback_later(max(timeout_s - 10, 5), exit=False, file=log)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
                      DS_ACCELERATOR="cuda" if gpu else "cpu")
    try:
        torch.set_num_threads(1)
        import deepspeed
        import deepspeed.comm as dist
        if gpu:
            torch.cuda.set_device(rank)
        else:
            # DeepSpeed's CPU accelerator refuses fp16 unless oneDNN has fp16 kernels for this CPU,
            # yet torch computes fp16 on any CPU; the fp16 tests need it (test-only).
            from deepspeed.accelerator import get_accelerator
            type(get_accelerator()).is_fp16_supported = lambda self: True
        deepspeed.init_distributed(dist_backend="nccl" if gpu else "gloo", verbose=False)
        fn(*args, **kwargs)
        dist.barrier()
        results.put((rank, None))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, traceback.format_exc()))
    finally:
        faulthandler.cancel_dump_traceback_later()


def _tail(path, n=4000):
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:]
    except OSError:
        return "<no log>"


def run_distributed(fn, *args, world_size: int = 2, timeout_s: float = DEFAULT_TIMEOUT_S, **kwargs):
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; raise with the failing rank's traceback."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    gpu = use_gpu(world_size)
    port = _free_port()
    log_dir = tempfile.mkdtemp(prefix="dsm_ranks_")
    procs = [
        ctx.Process(target=_rank_main,
                    args=(r, world_size, port, gpu, log_dir, timeout_s, results, fn, args, kwargs),
                    daemon=True) for r in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    done, failure = set(), None
    try:
        while len(done) < world_size and failure is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, tb = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in done and p.exitcode not in (None, 0)]
                if dead:
                    failure = (dead[0], f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}")
                continue
            done.add(rank)
            if tb is not None:
                failure = (rank, tb)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    logs = "\n".join(f"----- rank {r} log (tail) -----\n{_tail(os.path.join(log_dir, f'rank{r}.log'))}"
                     for r in range(world_size))
    if failure is not None:
        rank, tb = failure
        raise AssertionError(f"{fn.__name__} failed on rank {rank} of {world_size}:\n{tb}\n{logs}")
    if len(done) < world_size:
        missing = sorted(set(range(world_size)) - done)
        raise AssertionError(f"{fn.__name__} timed out after {timeout_s:.0f}s; ranks {missing} did not finish "
                             f"(a collective that another rank skipped?). Their stacks are in the logs:\n{logs}")
