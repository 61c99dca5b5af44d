"""Run a function on N local ranks, collect what each returns, and fail fast.

Shared by the multi-process tests (tests/multi_gpu/harness.py) and the benchmarks (which put
tests/multi_gpu on sys.path); test and benchmark code only, so it lives outside the package.

[Note: no hangs]
A collective that one rank skips blocks the others forever, so every run has a deadline.
Each rank arms ``faulthandler.dump_traceback_later`` a little before the deadline, so a hung
rank writes its own stack to its log before the parent kills it. The first rank that raises
ends the run at once: the parent terminates the others and raises with that rank's traceback
(and the tail of every rank's log).

Backend: NCCL with one GPU per rank where ``torch.cuda.device_count() >= world_size``, else
gloo on CPU (``DS_ACCELERATOR=cpu``). The function must be importable (module level) because
ranks are started with the ``spawn`` method, or forked from a server (see the Note below).

[Note: ranks forked from a preloaded server]
A spawned rank imports torch, DeepSpeed and Transformers before it runs anything: several seconds
of CPU per rank, paid again by every test that needs fresh ranks (the watchdog's and the killed
saves' runs end their ranks on purpose). CPU ranks are forked from multiprocessing's forkserver
instead, which imports those once (``_PRELOAD``) and forks each rank from that clean,
single-threaded state (not from pytest's process). DeepSpeed picks its accelerator at import, so
the server serves CPU ranks only (it starts with this process's ``DS_ACCELERATOR=cpu``); GPU ranks
are spawned. A forked rank would inherit the server's environment, from when it started: each rank
takes this process's environment of the moment it is created (``_own_environment``), as a spawned
one does.

[Note: a collection scans only what the tests made]
DeepSpeed runs ``gc.collect()`` in every ZeRO-3 engine's construction (its defragment), and a pool
rank collects after every function: with torch, DeepSpeed and Transformers imported, each collection
walks some 400,000 objects (about 0.2 s on the CI machine), over a thousand times in ``make test``.
Every rank moves what exists once its process group is up (the imports) into the collector's
permanent generation (``gc.freeze``), and a pool rank does so again after each function's
collection (what survived it: modules and caches the function imported). Objects a test makes are
made after that and are collected as before, cycles and ``__del__`` included.
"""
import faulthandler
import os
import queue
import shutil
import socket
import tempfile
import time
import traceback

import torch
import torch.multiprocessing as mp


class RanksFailed(RuntimeError):
    """A rank raised, died, or the run passed its deadline."""


_PRELOAD = ["torch", "torch.distributed", "deepspeed", "deepspeed.comm", "deepspeed_multi", "transformers"]


def _context(gpu: bool):
    """How ranks are started: [Note: ranks forked from a preloaded server]."""
    if gpu or os.environ.get("DS_ACCELERATOR", "cpu") != "cpu":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # (read when the server starts: the first CPU ranks)
    return ctx


def _own_environment(env):
    """In a rank: the starting process's environment (a forked rank has the fork server's)."""
    os.environ.clear()
    os.environ.update(env)


def use_gpu(world_size: int) -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() >= world_size


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (another process may take it before the caller binds it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(env, rank, world_size, port, gpu, log_dir, timeout_s, quiet_rank0, rank_setup, results, fn, args,
               kwargs):
    _own_environment(env)
    log = None
    if rank != 0 or quiet_rank0:
        log = open(os.path.join(log_dir, f"rank{rank}.log"), "w", buffering=1)
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    faulthandler.dump_traceback_later(max(timeout_s - 10, 5), exit=False, file=log)
    try:
        dist = _join_process_group(rank, world_size, port, gpu, rank_setup)
        out = fn(*args, **kwargs)
        dist.barrier()
        results.put((0, rank, out, None))
        _destroy_process_groups()
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((0, rank, None, traceback.format_exc()))
    finally:
        faulthandler.cancel_dump_traceback_later()


def _start(procs, gpu):
    """Start ``procs`` with DeepSpeed's accelerator named in the environment they inherit: DeepSpeed
    picks its accelerator when it is first imported, which a spawned rank does while unpickling its
    arguments, before ``_join_process_group`` runs (the parent's value is ``cpu``, see conftest.py)."""
    kept = os.environ.get("DS_ACCELERATOR")
    os.environ["DS_ACCELERATOR"] = "cuda" if gpu else "cpu"
    try:
        for p in procs:
            p.start()
    finally:
        if kept is None:
            del os.environ["DS_ACCELERATOR"]
        else:
            os.environ["DS_ACCELERATOR"] = kept


def _join_process_group(rank, world_size, port, gpu, rank_setup):
    """This process becomes ``rank``: its environment, one thread, its GPU, the process group."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
                      DS_ACCELERATOR="cuda" if gpu else "cpu")
    torch.set_num_threads(1)
    import deepspeed
    import deepspeed.comm as dist
    if gpu:
        torch.cuda.set_device(rank)
    if rank_setup is not None:
        rank_setup(gpu)
    deepspeed.init_distributed(dist_backend="nccl" if gpu else "gloo", verbose=False)
    _freeze_survivors()
    return dist


def _freeze_survivors():
    """[Note: a collection scans only what the tests made]."""
    import gc
    gc.collect()
    gc.freeze()


def _forget_torch_autocast():
    """DeepSpeed records torch_autocast process-wide once an engine uses it, and upstream engines built
    later take it as theirs ([Note: torch_autocast is per engine] in deepspeed_multi): a pool function
    that built one must not change the next function's upstream engines."""
    import deepspeed.runtime.torch_autocast as ds_autocast
    ds_autocast.TORCH_AUTOCAST_INITIALIZED, ds_autocast.TORCH_AUTOCAST_DTYPE = False, None


def _destroy_process_groups():
    """A process that exits with gloo groups alive can die in std::terminate while the
    interpreter finalizes (pytorch/pytorch#190489): destroy them while Python is whole."""
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _rank_main_to_exit(env, rank, world_size, port, log_dir, rank_setup, fn, args, kwargs):
    """Like _rank_main, but nothing is caught: the rank's exit code is the result."""
    _own_environment(env)
    log = open(os.path.join(log_dir, f"rank{rank}.log"), "w", buffering=1)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size), DS_ACCELERATOR="cpu")
    torch.set_num_threads(1)
    import deepspeed
    if rank_setup is not None:
        rank_setup(False)
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    _freeze_survivors()
    fn(*args, **kwargs)
    # A program's end: its atexit handlers run, as at a real process's exit (multiprocessing's children skip them).
    import atexit
    atexit._run_exitfuncs()
    _destroy_process_groups()


def run_ranks_to_exit(fn, *args, world_size: int = 2, timeout_s: float = 120, rank_setup=None, agent_store=False,
                      **kwargs) -> list:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` CPU ranks until every rank has exited.

    For tests of runs that must fail (the watchdog, a killed checkpoint save): returns, by rank,
    ``{"exitcode": int or None (still running at the deadline, then killed), "exited_at": time.time()
    when the parent saw it exit, "log": the rank's whole stdout+stderr}``. An exception in ``fn``
    is not caught: it ends the rank with a non-zero exit code and its traceback in the log.
    ``agent_store``: the rendezvous store is hosted here, as torchrun's agent hosts it, so it outlives
    every rank (else rank 0 hosts it, as a plain env:// launch does).
    """
    ctx = _context(gpu=False)
    port = free_port()
    store = None
    if agent_store:
        store = torch.distributed.TCPStore("127.0.0.1", port, world_size, is_master=True, wait_for_workers=False)
        kwargs_env = {"TORCHELASTIC_USE_AGENT_STORE": "True"}
    else:
        kwargs_env = {}
    log_dir = tempfile.mkdtemp(prefix="dsm_ranks_")
    procs = [ctx.Process(target=_rank_main_to_exit,
                         args=(dict(os.environ, **kwargs_env), r, world_size, port, log_dir, rank_setup, fn, args,
                               kwargs), daemon=True) for r in range(world_size)]
    _start(procs, gpu=False)
    deadline = time.monotonic() + timeout_s
    exited_at = {}
    while len(exited_at) < world_size and time.monotonic() < deadline:
        for r, p in enumerate(procs):
            if r not in exited_at and p.exitcode is not None:
                exited_at[r] = time.time()
        time.sleep(0.05)
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(timeout=10)
    out = [{"exitcode": procs[r].exitcode if r in exited_at else None, "exited_at": exited_at.get(r),
            "log": _tail(os.path.join(log_dir, f"rank{r}.log"), n=10**6)} for r in range(world_size)]
    shutil.rmtree(log_dir, ignore_errors=True)
    del store  # (the agent's store goes once every rank has gone)
    return out


def _tail(path, n=4000):
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:]
    except OSError:
        return "<no log>"


def run_ranks(fn, *args, world_size: int = 2, timeout_s: float = 240, quiet_rank0: bool = True, rank_setup=None,
              **kwargs) -> list:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return the ranks' return values, by rank.

    ``quiet_rank0=False`` leaves rank 0's output on this terminal (the others always go to logs);
    ``rank_setup(gpu)``, if given, runs in each rank before the process group is created.
    Raises :class:`RanksFailed` with the failing rank's traceback and every rank's log tail.
    """
    gpu = use_gpu(world_size)
    ctx = _context(gpu)
    results = ctx.Queue()
    port = free_port()
    log_dir = tempfile.mkdtemp(prefix="dsm_ranks_")
    procs = [
        ctx.Process(target=_rank_main,
                    args=(dict(os.environ), r, world_size, port, gpu, log_dir, timeout_s, quiet_rank0, rank_setup,
                          results, fn, args, kwargs),
                    daemon=True) for r in range(world_size)
    ]
    _start(procs, gpu)
    try:
        outs, failure = _collect(results, procs, 0, timeout_s, pooled=False)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    logs = _logs(log_dir, world_size)
    shutil.rmtree(log_dir, ignore_errors=True)
    if failure is not None or len(outs) < world_size:
        _raise_failed(fn, world_size, timeout_s, outs, failure, logs)
    return [outs[r] for r in range(world_size)]


def _collect(results, procs, seq, timeout_s, pooled):
    """Read ``(seq, rank, out, traceback)`` results of run ``seq`` until every rank has answered, one
    failed or died, or ``timeout_s`` passed: returns ({rank: out}, None or (rank, traceback)). A
    one-off rank exits 0 once it has answered; a pooled rank never exits while the pool lives."""
    deadline = time.monotonic() + timeout_s
    outs, failure = {}, None
    while len(outs) < len(procs) and failure is None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            got_seq, rank, out, tb = results.get(timeout=min(remaining, 1.0))
        except queue.Empty:
            dead = [r for r, p in enumerate(procs)
                    if p.exitcode is not None and (pooled or (r not in outs and p.exitcode != 0))]
            if dead:
                failure = (dead[0], f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}")
            continue
        if got_seq != seq:
            continue  # a late answer of an earlier run
        if tb is not None:
            failure = (rank, tb)
        else:
            outs[rank] = out
    return outs, failure


def _logs(log_dir, world_size) -> str:
    return "\n".join(f"----- rank {r} log (tail) -----\n{_tail(os.path.join(log_dir, f'rank{r}.log'))}"
                     for r in range(world_size))


def _raise_failed(fn, world_size, timeout_s, outs, failure, logs):
    if failure is not None:
        rank, tb = failure
        raise RanksFailed(f"{fn.__name__} failed on rank {rank} of {world_size}:\n{tb}\n{logs}")
    missing = sorted(set(range(world_size)) - set(outs))
    raise RanksFailed(f"{fn.__name__} timed out after {timeout_s:.0f}s; ranks {missing} did not finish "
                      f"(a collective that another rank skipped?). Their stacks are in the logs:\n{logs}")


# ------------------------------------------------------------------------------ a pool of ranks
class RankPool:
    """``world_size`` ranks that run many functions, one after another, in one process group.

    [Note: a pool of ranks]
    Starting ranks costs about 4 s per test on the CI machine (spawn, imports, the process group,
    DeepSpeed's first engine), more than many tests' own work. A pool starts them once; each
    ``run`` sends one function to every rank and waits as :func:`run_ranks` does (deadline,
    traceback dump before it, first failing rank ends the run). A run that fails or passes its
    deadline may leave a rank inside a collective, so it closes the pool: the next run starts a
    fresh one. Each rank collects garbage between functions, so engines of one test do not
    outlive it; a test that changes process-wide state it cannot undo asks for fresh ranks.
    """

    def __init__(self, world_size, rank_setup=None):
        gpu, port = use_gpu(world_size), free_port()
        ctx = _context(gpu)
        self.world_size = world_size
        self.rank_setup = rank_setup
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._log_dir = tempfile.mkdtemp(prefix="dsm_pool_")
        self._seq = 0
        self._procs = [ctx.Process(target=_pool_rank_main,
                                   args=(dict(os.environ), r, world_size, port, gpu, self._log_dir, rank_setup,
                                         self._tasks[r], self._results), daemon=True)
                       for r in range(world_size)]
        _start(self._procs, gpu)

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self._procs)

    def run(self, fn, *args, timeout_s: float = 240, **kwargs) -> list:
        self._seq += 1
        seq = self._seq
        for q in self._tasks:
            q.put((seq, fn, args, kwargs, timeout_s))
        outs, failure = _collect(self._results, self._procs, seq, timeout_s, pooled=True)
        if failure is None and len(outs) == self.world_size:
            return [outs[r] for r in range(self.world_size)]
        time.sleep(0.5)  # let the other ranks' logs catch up
        logs = _logs(self._log_dir, self.world_size)
        self.close()
        _raise_failed(fn, self.world_size, timeout_s, outs, failure, logs)

    def close(self) -> None:
        for q, p in zip(self._tasks, self._procs):
            if p.is_alive():
                try:
                    q.put(None)
                except (OSError, ValueError):
                    pass
        end = time.monotonic() + 10
        for p in self._procs:
            p.join(timeout=max(0.1, end - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        shutil.rmtree(self._log_dir, ignore_errors=True)


def _pool_rank_main(env, rank, world_size, port, gpu, log_dir, rank_setup, tasks, results):
    _own_environment(env)
    log = open(os.path.join(log_dir, f"rank{rank}.log"), "w", buffering=1)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    dist = _join_process_group(rank, world_size, port, gpu, rank_setup)
    while True:
        item = tasks.get()
        if item is None:
            break
        seq, fn, args, kwargs, timeout_s = item
        print(f"===== {fn.__module__}.{fn.__name__} =====", flush=True)
        faulthandler.dump_traceback_later(max(timeout_s - 10, 5), exit=False, file=log)
        try:
            out = fn(*args, **kwargs)
            dist.barrier()
            results.put((seq, rank, out, None))
        except BaseException:  # noqa: BLE001 - every failure must reach the parent
            results.put((seq, rank, None, traceback.format_exc()))
        finally:
            faulthandler.cancel_dump_traceback_later()
            _forget_torch_autocast()
            _freeze_survivors()  # (collects first)
    _destroy_process_groups()
