"""The watchdog: a rank stuck in an engine's collective fails every rank, naming the engine.

[Note: a lost node]
A node that dies (its torchrun agent and ranks gone at once) leaves the other ranks either waiting
(at the store meeting before an engine's collectives, or in a collective that waits) or, where
gloo/NCCL notices the closed connections, with an exception from the collective. Either way the
watchdog ends the rank: a wait past ``watchdog_timeout_s`` as below, an uncaught collective
exception through ``sys.excepthook``. Every rank registers its host, node index and pid at the
store when its watchdog starts; the ranks that send no report within the grace time are named as
lost, with their node, before the usual report. (The store is the rendezvous store, hosted by
the node of ``--rdzv_endpoint``: when that node is the lost one, the ranks can only report what
they know themselves.)

[Note: why collectives hang and how the watchdog sees it]
A backward that reaches an engine on some ranks only (a branch taken on one rank, an engine
skipped on one batch), or a step() reached on some ranks only, leaves the engine's collectives
unmatched: ZeRO-2/3 reduce (and ZeRO-3 gathers parameters) during forward and backward, every
stage has collectives in the update. The ranks that entered block until the process group's
own timeout (30 minutes by default) and then fail deep inside DeepSpeed, naming nothing.

Each engine marks the regions where it runs collectives: its forward at ZeRO-3 (module hooks
installed here), its backward from the first gradient that reaches it to the end of its
epilogue (``MultiEngine._pre_backward`` / ``_post_backward``), and ``step()``. A mark is a
time stamp in a dict on this process: the common path gets no collective and no store access.
One daemon thread per process (the main thread is blocked inside gloo/NCCL, so only another
thread can act) looks at the marks every ``poll`` seconds and at one key of the rendezvous
store (torch.distributed's default store). When a mark is older than the engine's
``watchdog_timeout_s``, or another rank has published a failure, the thread:

1. publishes this rank's failure (if it is the one that timed out) and its report: for every
   engine, its name, stage, backward passes this window and the regions it is in;
2. waits (a few seconds at most) for every rank's report, prints one message with all of them
   to stderr, and waits for every rank to have printed;
3. ends the process with ``os._exit(1)``. The rank hosting the store (rank 0 under the env://
   rendezvous) leaves last, so the others can still read it.

So every rank exits non-zero within about ``watchdog_timeout_s`` + 2 * poll + a few seconds.

[Note: a rank that left the others' path]
A loop of one's own that calls an engine a rank-dependent number of times (a generation loop over a
ZeRO-3 engine, whose every forward gathers parameters) leaves one rank in a collective that the others
will never enter: they have finished the program, or wait at the store before another engine's
collectives. The timeout would name it only after ``watchdog_timeout_s``. So a rank says at the store
when it is done (at exit) and, while it has to wait at a meeting, where; and the loop, when this rank's
main thread has sat in a collective for ``_STALLED_S`` inside a marked region, looks for such a rank
among the engine's group and fails, naming both. A rank seen at another meeting must still be there
``_CONFIRM_S`` later, with this rank still in the same place: a partner that has just left the meeting
this rank polls (the count is complete; this rank's next poll will see it) may already wait at its next
one, which is no divergence. It costs nothing on the common path: two store writes per meeting that
waits, one at exit, and store reads only while a rank is stalled.

[Note: the thread stops before the interpreter finalizes]
Store calls release the GIL. A daemon thread that returns from one while Python is
finalizing is ended with ``pthread_exit``, whose forced unwinding through pybind11's
``noexcept`` GIL guard calls ``std::terminate`` ("terminate called without an active
exception", SIGABRT) in a job that had finished cleanly. An ``atexit`` hook (atexit runs
before finalization) therefore stops the thread and joins it: it never calls the store again.
The budget covers the whole region, compute included: a forward, backward or update that
legitimately takes longer than ``watchdog_timeout_s`` must get a larger value.

[Note: ranks meet before an engine's collectives]
The watchdog sees a rank waiting in a collective only if the collective waits. gloo checks the
sizes of what it receives: when one rank skipped engine A and entered engine B's reduction
while another entered A's, the sizes differ and gloo aborts the process (SIGABRT, "Received
data size doesn't match expected size", uncatchable) seconds in, naming nothing. So, where the
option ``agree_before_collectives`` is on (the default with gloo), the ranks of an engine's
data-parallel group meet at the rendezvous store, a TCP key-value server apart from the process
group, before the collectives of the regions that have them: a ZeRO-3 forward, a ZeRO-2/3
backward (ZeRO-3 gathers, ZeRO-2 reduces in every one), an update. Each rank adds 1 to the
engine's counter for that region and polls it until every rank of the group has added its n-th
1. A rank whose partner went elsewhere waits there, inside the marked region, so the watchdog
ends every rank naming the engine and the backward counts. Polling, not the store's blocking
``wait``: the watchdog thread shares the store client and must still reach it.

A meeting is held only where the group's recent regions do not predict the region entered
(region_sequence.py, [Note: a meeting only where the sequence departs from its past]): a loop stops
meeting once its regions repeat, and the rank that leaves the loop's path still meets before its
first collective. Collectives of deepspeed.comm issued outside every engine's region are entries of
the same sequence (outside.py). The ZeRO-0/1 updates of a group (a boundary step() of a trained
engine) are entries too, and share one meeting row: each starts with its rank agreement, one
all-reduce of one size that carries the engine's serial number (rank_agreement.py), so two ranks in
different engines' updates pass the meeting and both raise there at once, naming both engines. A
region where the engine has no collective (a ZeRO-0/1 backward, a frozen ZeRO-0/1/2 engine, a step
inside the accumulation window) is no entry and does not meet: ranks may legitimately differ there.
"""
import atexit
import functools
import json
import logging
import os
import socket
import sys
import threading
import time
import traceback
import weakref

import torch

from ..autograd import graph
from . import outside
from .region_sequence import RegionSequence, group_key

logger = logging.getLogger(__name__)

_PREFIX = "dsm_watchdog/"
_REPORT_GRACE_S = 4.0  # how long a failing rank waits for the other ranks' reports
_STALLED_S = 5.0  # how long a rank waits in a collective before it asks where the others are
_CONFIRM_S = 2.0  # how long a partner must be seen away (at another meeting) before this rank fails
_EXIT_GRACE_S = 3.0  # how long it waits for every rank to have printed, and rank 0 for the exits

_REGIONS = {
    "forward": "forward (ZeRO-3 parameter all-gather)",
    "backward": "backward (gradient reduction; ZeRO-3 parameter gather)",
    "step": "step() (the update's collectives)",
}


class _Off:
    """The watch of an engine whose watchdog is off: every call does nothing."""
    enabled = False
    hooks = ()

    def enter(self, what):
        pass

    def leave(self, what):
        pass

    def backward_reached(self):
        pass

    def meet(self, what):
        pass


class EngineWatch:
    """The regions one engine is in on this rank, as ``what -> time.monotonic() at entry``."""
    enabled = True
    hooks = ()  # its forward hooks on the engine's module (attach), removed by detach

    def __init__(self, engine, timeout_s, index, monitor=None, agree=False):
        self.engine = weakref.ref(engine)
        self.name = type(engine.module).__name__
        self.stage = engine.zero_optimization_stage()
        self.timeout_s = float(timeout_s)
        self.index = index  # engines are built in the same order on every rank
        self.marks = {}
        self.monitor, self.agree = monitor, agree
        self.met = {}  # region -> how many times this rank reached it (a meeting there held or skipped)
        self.held = {}  # region -> how many meetings this rank held there

    def enter(self, what):
        self.marks[what] = time.monotonic()

    def leave(self, what):
        self.marks.pop(what, None)
        self.monitor.entered.discard((self.index, what))

    def backward_reached(self):
        """A gradient reached the engine: mark "backward" once per backward pass.

        The mark ends with the autograd graph task (a final callback), or, for an engine whose
        epilogue is still queued then, when ``_post_backward`` leaves it after the epilogue.
        """
        if "backward" in self.marks:
            return
        self.marks["backward"] = time.monotonic()
        graph.at_end_of_backward(self._end_of_graph_task)
        if self.stage >= 2:
            engine = self.engine()
            if engine is not None and (engine.trains or self.stage == 3):
                self.meet("backward")

    def meet(self, what):
        """Record ``what`` in the group's sequence and, where the sequence did not predict it, wait at the
        store until every rank of the group reached it as often (see [Note: ranks meet before an engine's
        collectives])."""
        if not self.agree:
            return
        engine = self.engine()
        if what == "step" and (engine is None or not engine.trains or not engine.is_update_boundary()):
            return  # no collective in this step()
        ranks = getattr(engine, "_dsm_dp_ranks", None) or tuple(range(self.monitor.world))
        if len(ranks) < 2:
            return
        self.monitor.entered.add((self.index, what))  # its collectives are the region's, not entries (outside.py)
        self.met[what] = self.met.get(what, 0) + 1
        if self.monitor.sequence(ranks).predicted((self.index, what)):
            return  # the group's recent regions predicted this one (region_sequence.py)
        n = self.held[what] = self.held.get(what, 0) + 1
        if self.stage < 2:  # ZeRO-0/1 updates all start with one same-sized rank agreement, which names both
            # engines (rank_agreement.py): their meetings share one row, so two ranks in different engines'
            # updates pass it and raise there at once instead of waiting for the watchdog.
            n = self.monitor.count_shared_meeting(ranks)
            self.monitor.meet(f"meet/zero01-step/{group_key(ranks)}", len(ranks) * n, self.label(what))
            return
        self.monitor.meet(f"meet/{self.index}/{what}/{ranks[0]}", len(ranks) * n, self.label(what))

    def label(self, what):
        return f"MultiEngine ({self.name}, ZeRO stage {self.stage})'s {_REGIONS.get(what, what)}"

    def _end_of_graph_task(self):
        engine = self.engine()
        if engine is None or engine._state.name != "IN_BACKWARD":
            self.leave("backward")

    def report(self):
        engine = self.engine()
        now = time.monotonic()
        return {"index": self.index, "name": self.name, "stage": self.stage,
                "backwards": getattr(engine, "_window_backwards", None),
                "micro_steps": getattr(engine, "_window_micro_steps", None), "met": dict(self.met),
                "held": dict(self.held),
                "in": {what: round(now - t0, 1) for what, t0 in list(self.marks.items())}}


def watched(what):
    """Decorator for an engine method that runs collectives (``step``): mark it while it runs."""

    def deco(fn):

        @functools.wraps(fn)
        def wrapper(engine, *args, **kwargs):
            watch = engine.watchdog
            watch.enter(what)
            try:
                watch.meet(what)
                return fn(engine, *args, **kwargs)
            finally:
                watch.leave(what)

        return wrapper

    return deco


def attach(engine):
    """The engine's watch: an :class:`EngineWatch` registered with this process's monitor, or
    a no-op when ``watchdog_timeout_s`` is 0 or there is a single rank."""
    timeout = engine.options.watchdog_timeout_s
    if not timeout or not torch.distributed.is_initialized() or torch.distributed.get_world_size() < 2:
        return _Off()
    agree = engine.options.agree_before_collectives
    if agree is None:
        agree = torch.distributed.get_backend() == "gloo"
    watch = _Monitor.get().add(engine, timeout, agree)
    watch.hooks = _install_forward_hooks(engine, watch)
    return watch


def detach(engine) -> None:
    """``engine.destroy()``: its watch leaves the monitor and the module; the engine's is off from now."""
    watch = engine.watchdog
    for handle in watch.hooks:
        handle.remove()
    if watch.enabled:
        watch.marks.clear()
        watch.monitor.remove(watch)
    engine.watchdog = _Off()


def _install_forward_hooks(engine, watch) -> list:
    """ZeRO-3 gathers parameters in forward: mark it. Every stage: a forward that starts outside
    a backward ends any "backward" mark a failed backward left behind (its final callbacks never run)."""
    zero3 = watch.stage == 3

    def pre(module, args):
        if not graph.in_backward():
            watch.leave("backward")
        if zero3:
            watch.enter("forward")
            watch.meet("forward")

    hooks = [engine.module.register_forward_pre_hook(pre, prepend=True)]
    if zero3:
        hooks.append(engine.module.register_forward_hook(lambda module, args, out: watch.leave("forward"),
                                                         always_call=True))
    return hooks


def _backward_running() -> bool:
    """Is some thread inside autograd's backward (``loss.backward()``, ``autograd.grad``)?"""
    for frame in sys._current_frames().values():
        while frame is not None:
            if frame.f_code.co_name == "_engine_run_backward":
                return True
            frame = frame.f_back
    return False


def _main_thread_in_collective() -> bool:
    """Is the main thread blocked inside a collective: its innermost Python frames in torch.distributed or
    deepspeed.comm, or in a ``wait`` of a collective's handle?"""
    frame = sys._current_frames().get(threading.main_thread().ident)
    for _ in range(4):
        if frame is None:
            return False
        name = frame.f_code.co_filename.replace(os.sep, "/")
        if "/torch/distributed/" in name or "/deepspeed/comm/" in name or frame.f_code.co_name == "wait":
            return True
        frame = frame.f_back
    return False


def _main_thread_location():
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return "?"
    where = traceback.extract_stack(frame)[-3:]
    return " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(where))


class _Monitor(threading.Thread):
    """One per process: polls every engine's marks and the store's failure flag."""
    _instance = None
    _lock = threading.Lock()

    @classmethod
    def get(cls):
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls()
                cls._instance.start()
                atexit.register(cls._instance.stop)
                _install_excepthook()
            return cls._instance

    def __init__(self):
        super().__init__(name="deepspeed_multi-watchdog", daemon=True)
        self.watches = []
        self.added = 0
        self.rank = torch.distributed.get_rank()
        self.world = torch.distributed.get_world_size()
        self.poll_s = 1.0
        self.store = None
        self.store_ok = True
        self._stopping = threading.Event()
        self._failing = False
        self._fail_lock = threading.Lock()
        self.sequences = {}  # a group's ranks -> its RegionSequence
        self.outside = None  # the OutsideWatch, once an engine's ranks meet
        self.shared_meetings = {}  # a group's ranks -> meetings held at its ZeRO-0/1 updates' shared row
        self.entered = set()  # (engine index, region): regions engines are in that were sequence entries
        self.waiting = None  # the region whose meeting this rank waits at, while it waits
        self.suspects = {}  # (where this rank waits, the partner, where it is) -> first seen: see _fail_if_peer_left

    def add(self, engine, timeout_s, agree=False):
        watch = EngineWatch(engine, timeout_s, self.added, self, agree)
        self.added += 1  # (not len(watches): an index stays the same engine's after another leaves)
        self.watches.append(watch)
        self.poll_s = min(self.poll_s, max(0.1, timeout_s / 5))
        if agree:
            if self.outside is None:
                self.outside = outside.OutsideWatch(self)
                self.watches.append(self.outside)
            self.outside.timeout_s = min(self.outside.timeout_s, float(timeout_s))
            outside.install(self.outside)
        return watch

    def count_shared_meeting(self, ranks) -> int:
        self.shared_meetings[ranks] = self.shared_meetings.get(ranks, 0) + 1
        return self.shared_meetings[ranks]

    def in_engine_region(self) -> bool:
        """Is an engine of this process inside a region it entered as a sequence entry (see outside.py)?"""
        return bool(self.entered)

    def remove(self, watch):
        self.watches = [w for w in self.watches if w is not watch]  # (a new list: _check may be walking one)
        self.entered -= {entry for entry in self.entered if entry[0] == watch.index}

    # ------------------------------------------------------------ the loop
    def run(self):
        try:  # who this rank is, for naming it if it is lost (one store write per process)
            self._store_set(f"member/{self.rank}", _whoami())
        except Exception:  # noqa: BLE001
            pass
        while not self._stopping.wait(self.poll_s):
            try:
                self._check()
            except Exception:  # noqa: BLE001 - the watchdog must never take a healthy job down
                logger.warning("deepspeed_multi watchdog: check failed:\n%s", traceback.format_exc())

    def stop(self, join_s=10.0):
        """End the loop and wait for it: see [Note: the thread stops before the interpreter finalizes].
        Then let go of the store, so that it is not destroyed during finalization either. First, say at the
        store that this rank is done ([Note: a rank that left the others' path])."""
        try:
            if self.store_ok and not self._stopping.is_set():
                self._store_set(f"done/{self.rank}", 1)
        except Exception:  # noqa: BLE001 - the store's host may have exited already
            pass
        self._stopping.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(join_s)
        if not self.is_alive():
            self.store = None

    def _live(self):
        return [w for w in self.watches if w.engine() is not None]

    def _check(self):
        now = time.monotonic()
        seen = self.suspects
        self.suspects = {}  # kept only while seen at every check ([Note: a rank that left the others' path])
        for watch in self._live():
            for what, t0 in list(watch.marks.items()):
                if _STALLED_S < now - t0 <= watch.timeout_s and (self.waiting or _main_thread_in_collective()):
                    self._fail_if_peer_left(watch, what, t0, now, seen)
                if now - t0 > watch.timeout_s:
                    if what == "backward" and not _backward_running():
                        # A backward that raised never runs its final callbacks: the mark is stale.
                        watch.leave("backward")
                        continue
                    self._fail({"rank": self.rank, "index": watch.index, "name": watch.name, "stage": watch.stage,
                                "what": what, "waited_s": round(now - t0, 1), "timeout_s": watch.timeout_s})
        if self._store_check("failed"):
            self._fail(None)

    def _fail_if_peer_left(self, watch, what, t0, now, seen):
        """This rank has waited in a collective of ``watch``'s engine (or at a meeting) since ``t0``: fail if a
        rank of the engine's group is done with the program, or has waited at the store before another region
        since an earlier check (``seen``) at least ``_CONFIRM_S`` ago, this rank unmoved (see the Note)."""
        engine = watch.engine()
        ranks = getattr(engine, "_dsm_dp_ranks", None) or range(self.world)
        for r in ranks:
            if r == self.rank:
                continue
            if self._store_check(f"done/{r}"):
                where = "has finished the program"
            elif self._store_check(f"waiting/{r}") and self._store_get(f"waiting/{r}") not in (None, self.waiting):
                where = f"waits at the store before {self._store_get(f'waiting/{r}')}"
                key = (watch.index, what, t0, self.waiting, r, where)
                self.suspects[key] = first = seen.get(key, now)
                if now - first < _CONFIRM_S:
                    continue
            else:
                continue
            self._fail({"rank": self.rank, "index": watch.index, "name": watch.name, "stage": watch.stage,
                        "what": what, "waited_s": round(now - t0, 1), "timeout_s": watch.timeout_s,
                        "peer": {"rank": r, "where": where}, "at_meeting": self.waiting is not None})

    # ------------------------------------------------------------ the store
    def _get_store(self):
        if self.store is None:
            from torch.distributed.distributed_c10d import _get_default_store
            self.store = _get_default_store()
        return self.store

    def _store_check(self, key):
        if not self.store_ok:
            return False
        try:
            return self._get_store().check([_PREFIX + key])
        except Exception:  # noqa: BLE001 - store gone (its host exited): nothing more to learn there
            self.store_ok = False
            return False

    def _store_get(self, key):
        return json.loads(self._get_store().get(_PREFIX + key).decode())

    def _store_set(self, key, value):
        self._get_store().set(_PREFIX + key, json.dumps(value))

    def _store_add(self, key, n):
        return self._get_store().add(_PREFIX + key, n)

    def sequence(self, ranks):
        ranks = tuple(ranks)
        if ranks not in self.sequences:
            self.sequences[ranks] = RegionSequence()
        return self.sequences[ranks]

    def meet(self, key, target, label=None):
        """Count this rank in at ``key`` and poll until the count reaches ``target`` (no deadline: the
        caller is inside a marked region, which the loop above ends when it goes stale). A rank that has to
        wait says where at the store while it waits ([Note: a rank that left the others' path])."""
        try:
            got, delay = self._store_add(key, 1), 1e-4
            if got >= target:
                return
            self._store_set(f"waiting/{self.rank}", label)
            self.waiting = label
            try:
                while got < target:
                    time.sleep(delay)
                    delay = min(2 * delay, 0.01)
                    got = self._store_add(key, 0)
            finally:
                self.waiting = None
                self._store_set(f"waiting/{self.rank}", None)
        except torch.distributed.DistError as e:
            raise RuntimeError(
                f"deepspeed_multi watchdog (rank {self.rank}): this rank waits at the rendezvous store to enter "
                f"{label}, but the store is gone ({e}): the process that hosts it (rank 0 under a plain env:// launch, "
                "torchrun's agent otherwise) has exited, having finished the program or died, while this rank still "
                "runs the engine. A rank-dependent number of calls of the engine? See the watchdog's message on the "
                "other ranks.") from e

    def _wait_count(self, key, target, grace_s):
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            if self._store_add(key, 0) >= target:
                return
            time.sleep(0.02)

    # ------------------------------------------------------------ failing every rank
    def _fail(self, failure, cause=None):
        """Publish, collect every rank's report, print, exit. Never returns. ``cause``: the
        exception a collective raised in this rank (see [Note: a lost node])."""
        with self._fail_lock:
            if self._failing:  # the other thread is already on it, and will end the process
                while True:
                    time.sleep(60)
            self._failing = True
        reports = {}
        try:
            if failure is not None:
                self._store_set(f"failure/{self.rank}", failure)
            if failure is not None or cause is not None:
                self._store_set("failed", 1)
            self._store_set(f"report/{self.rank}", self._report())
            deadline = time.monotonic() + _REPORT_GRACE_S
            while len(reports) < self.world and time.monotonic() < deadline:
                for r in range(self.world):
                    if r not in reports and self._store_check(f"report/{r}"):
                        reports[r] = self._store_get(f"report/{r}")
                time.sleep(0.05)
            failures = [self._store_get(f"failure/{r}") for r in range(self.world) if self._store_check(f"failure/{r}")]
        except Exception:  # noqa: BLE001 - the store is gone: report what this rank knows
            failures = [failure] if failure is not None else []
            reports.setdefault(self.rank, self._report())
        members, done = {}, set()
        try:
            for r in range(self.world):
                if r not in reports and self._store_check(f"member/{r}"):
                    members[r] = self._store_get(f"member/{r}")
                if r not in reports and self._store_check(f"done/{r}"):
                    done.add(r)
        except Exception:  # noqa: BLE001
            pass
        message = format_message(failures, reports, self.world, self.rank, members, cause, done)
        os.write(2, (message + "\n").encode(errors="replace"))
        answering = max(len(reports), 1)  # lost ranks will neither print nor exit here: not waited for
        try:
            self._store_add("printed", 1)
            self._wait_count("printed", answering, _EXIT_GRACE_S)
            if self.rank == 0:
                self._wait_count("exited", answering - 1, _EXIT_GRACE_S)
            else:
                self._store_add("exited", 1)
        except Exception:  # noqa: BLE001
            pass
        os._exit(1)

    def _report(self):
        return {"rank": self.rank, "host": socket.gethostname(), "pid": os.getpid(),
                "engines": [w.report() for w in self._live()], "at": _main_thread_location()}


def _is_collective_error(exc):
    """An exception from a collective whose peer went away (gloo/NCCL/c10d), as opposed to a bug."""
    dist_error = getattr(torch.distributed, "DistError", ())
    text = str(exc)
    return isinstance(exc, dist_error) or (isinstance(exc, RuntimeError) and any(
        t in text for t in ("Connection closed by peer", "Connection reset by peer", "gloo", "NCCL", "c10d")))


def _install_excepthook():
    """An uncaught exception from a collective (the peer's node is gone, see [Note: a lost node]) ends
    this rank through the watchdog's report, which names the ranks that no longer answer."""
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        monitor = _Monitor._instance
        if monitor is not None and monitor.is_alive() and _is_collective_error(exc):
            traceback.print_exception(exc_type, exc, tb)
            first = (str(exc).strip().splitlines() or [""])[0][:300]
            monitor._fail(None, cause=f"{exc_type.__name__}: {first}")
        previous(exc_type, exc, tb)

    sys.excepthook = hook


def node_index():
    """This rank's node index where the launcher sets one (torchrun's GROUP_RANK, the DeepSpeed
    launcher's CROSS_RANK, SLURM_NODEID), else None."""
    return next((os.environ[k] for k in ("GROUP_RANK", "CROSS_RANK", "SLURM_NODEID") if k in os.environ), None)


def _whoami():
    return {"host": socket.gethostname(), "pid": os.getpid(), "node": node_index()}


def _where(failure):
    if failure["index"] < 0:
        return f"a {outside.NAME} {failure['what']} outside every engine's regions"
    return f"MultiEngine ({failure['name']}, ZeRO stage {failure['stage']})'s {_REGIONS.get(failure['what'], failure['what'])}"


def _span(ranks):
    return ", ".join(str(r) for r in ranks)


def format_message(failures, reports, world, rank, members=None, cause=None, done=()):
    """The error every rank prints: which ranks are lost, which engine, where each rank is, what to do.
    ``done``: ranks that said at the store they finished the program (not lost: see [Note: a rank that left
    the others' path])."""
    lines = []
    if done and not failures:
        waiting = [f"{e['name']} {what}" for rep in reports.values() for e in rep.get("engines", []) for what in e["in"]]
        lines.append(
            f"deepspeed_multi watchdog (rank {rank}): ranks {_span(sorted(done))} finished the program while rank "
            f"{rank} was still in a collective with them" + (f" ({', '.join(waiting)})" if waiting else "")
            + (f": {cause}" if cause else "") + ". They left the engine's path: a rank-dependent number of calls of "
            "the engine (a generation loop of your own over a ZeRO-3 engine)? Give every rank the same number of "
            "calls, or generate inside engine.generation_mode(), or through Transformers' generate(), which a ZeRO-3 "
            "MultiEngine keeps in step. Stopping every rank.")
        return "\n".join(lines)
    lost = [r for r in range(world) if r not in reports and r not in done]
    some_lost = bool(lost) and len(lost) < world
    if some_lost:
        members = members or {}
        by_node = {}
        for r in lost:
            m = members.get(r, {})
            by_node.setdefault((m.get("node"), m.get("host")), []).append(r)
        where = "; ".join(f"ranks {_span(rs)}" + (f" (node {n}, host {h})" if n is not None else
                                                  f" (host {h})" if h else "") for (n, h), rs in by_node.items())
        lines.append(
            f"deepspeed_multi watchdog (rank {rank}): lost ranks {_span(lost)} of {world}: {where}. They did not "
            f"answer within {_REPORT_GRACE_S:g} s while the other ranks waited in a collective with them: their "
            "processes or their node are gone (a lost node is a lost torchrun agent). Stopping every rank. Under "
            "torchrun --max-restarts, the restarted job resumes from the last complete set checkpoint with "
            "deepspeed_multi.load_checkpoint.")
        if cause:
            lines.append(f"  the collective failed on rank {rank} with: {cause}")
    if failures and some_lost:
        f = failures[0]
        lines.append(f"  rank {f['rank']} waited {f['waited_s']} s in {_where(f)}")
    elif failures and failures[0]["index"] < 0:
        f = failures[0]
        lines.append(
            f"deepspeed_multi watchdog (rank {rank}): rank {f['rank']} waited {f['waited_s']} s to run {_where(f)}, "
            f"more than watchdog_timeout_s={f['timeout_s']:g}: the other ranks of its group went elsewhere. "
            "Stopping every rank.")
    elif failures and "peer" in failures[0]:
        f, peer = failures[0], failures[0]["peer"]
        lines.append(
            f"deepspeed_multi watchdog (rank {rank}): rank {f['rank']} has waited {f['waited_s']} s "
            f"{'at the store before' if f.get('at_meeting') else 'in'} {_where(f)}, "
            f"and rank {peer['rank']} {peer['where']}: it left this engine's path, so the collective can never "
            "complete. A rank-dependent number of calls of the engine (a generation loop of your own over a ZeRO-3 "
            "engine, whose every forward gathers parameters)? Give every rank the same number of calls, or generate "
            "inside engine.generation_mode() (no collective until it ends), or through Transformers' generate(), "
            "which a ZeRO-3 MultiEngine keeps in step. Stopping every rank.")
    elif failures:
        f = failures[0]
        lines.append(
            f"deepspeed_multi watchdog (rank {rank}): MultiEngine ({f['name']}, ZeRO stage {f['stage']}) spent "
            f"{f['waited_s']} s in its {_REGIONS.get(f['what'], f['what'])} on rank {f['rank']}, more than its "
            f"watchdog_timeout_s={f['timeout_s']:g}: a collective another rank never entered. Stopping every rank.")
        for other in failures[1:]:
            lines.append(f"  also rank {other['rank']}: {other['name']} in its {other['what']} for "
                         f"{other['waited_s']} s")
    elif not lines:
        lines.append(f"deepspeed_multi watchdog (rank {rank}): another rank reported a stuck collective but its "
                     "report could not be read.")
    suspects = [failures[0]["index"]] if failures and failures[0]["index"] >= 0 else []
    for index in suspects:
        counts = []
        for r in range(world):
            engines = {e["index"]: e for e in reports.get(r, {}).get("engines", [])}
            e = engines.get(index)
            counts.append(f"rank {r}: {e['backwards']}" if e is not None else f"rank {r}: no report")
        name, what = failures[0]["name"], failures[0]["what"]
        lines.append(f"  backward passes through {name} since its last update, by rank: " + ", ".join(counts))
        met = [(r, e.get("met", {}).get(what), e.get("held", {}).get(what)) for r in range(world)
               for e in reports.get(r, {}).get("engines", []) if e["index"] == index]
        if any(n is not None for _, n, _ in met):
            lines.append(f"  times each rank reached {name}'s {what} collectives: "
                         + ", ".join(f"rank {r}: {n or 0}" for r, n, _ in met)
                         + " (meetings held there, where the loop's recent regions did not predict it: "
                         + ", ".join(f"rank {r}: {h or 0}" for r, _, h in met) + ")")
    for r in range(world):
        rep = reports.get(r)
        if rep is None:
            lines.append(f"  rank {r}: no report within {_REPORT_GRACE_S:g} s (stuck without releasing the "
                         "interpreter, or already gone)")
            continue
        inside = [f"{e['name']} {what} for {s} s" for e in rep["engines"] for what, s in e["in"].items()]
        lines.append(f"  rank {r} ({rep['host']} pid {rep['pid']}): "
                     + ("in " + "; ".join(inside) if inside else "in no engine's collective region")
                     + f"; main thread at {rep['at']}")
    if some_lost:
        return "\n".join(lines)
    lines.append(
        "  Fix: a forward, backward or step() that reaches an engine on some ranks only leaves its collectives "
        "unmatched. Every rank must call the engine and use its outputs in the loss it backpropagates (multiply "
        "an output by 0 to keep it in the graph on ranks that do not need it), and call step() on every rank. "
        "If the engine's forward, backward or step legitimately takes longer, raise "
        "{\"deepspeed_multi\": {\"watchdog_timeout_s\": N}} in its config (0 turns the watchdog off).")
    return "\n".join(lines)
