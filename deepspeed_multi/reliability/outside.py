"""Collectives issued through ``deepspeed.comm`` outside every engine's regions: entries of the
group's region sequence too, met where the sequence does not predict them.

[Note: collectives outside the engines' regions]
A skipped meeting (region_sequence.py) is safe because the rank that leaves the loop's path meets
before it issues a collective. A rank can leave it for a collective of no engine's region: a
``save_checkpoint`` or a metric ``all_reduce`` on some ranks only. DeepSpeed and this package issue
every collective through DeepSpeed's communication backend, ``deepspeed.comm.comm.cdb``, whose
collective methods are replaced here by ones that call them after this: a collective issued while
no engine of this process is inside a region it entered as a sequence entry is itself an entry,
``("outside", method name)``, of its group's sequence. Predicted, it runs at once. Where the
group's recent regions predict nothing, it runs at once too: every rank of the group has the same
past, so none predicts anything either and none can be skipping a meeting (the many collectives
of building an engine, unseen before, cost nothing). Where they predict something else, the ranks
of the group meet first (keyed by the method), marked for the watchdog like an engine's region. A
loop that issues the same collective every step (a logged loss) learns it like any region.
Collectives issued through ``torch.distributed`` directly are not seen: the gap
region_sequence.py describes.
"""
from __future__ import annotations

import inspect
import time

import torch

from .. import compat
from .region_sequence import group_key

# deepspeed.comm's backend methods that communicate (a name a release lacks is skipped).
_COLLECTIVES = ("all_reduce", "all_reduce_coalesced", "inference_all_reduce", "reduce", "reduce_scatter",
                "reduce_scatter_tensor", "all_gather", "all_gather_into_tensor", "all_gather_coalesced",
                "all_gather_object", "broadcast", "broadcast_object_list", "all_to_all", "all_to_all_single",
                "gather", "scatter", "barrier", "monitored_barrier")
NAME = "deepspeed.comm"  # how the watchdog names these regions
FEATURE = "outside_collectives"


class OutsideWatch:
    """The one watch of a process's collectives outside engine regions (see the Note)."""
    enabled = True
    index = -1
    name = NAME
    stage = None

    def __init__(self, monitor):
        self.monitor = monitor
        self.marks = {}
        self.met, self.held = {}, {}
        self.timeout_s = float("inf")

    def engine(self):
        return self  # alive as long as the monitor

    def meet_before(self, name, group):
        """Count this collective in its group's sequence; meet the group first where it was not predicted."""
        ranks = _ranks(group, self.monitor.world)
        if len(ranks) < 2:
            return
        self.met[name] = self.met.get(name, 0) + 1
        sequence = self.monitor.sequence(ranks)
        expected = sequence.expected()
        sequence.predicted(("outside", name))
        if expected is None or expected == ("outside", name):
            return  # predicted; or nothing is, so no rank of the group can be skipping a meeting now
        key = (ranks, name)
        n = self.held[key] = self.held.get(key, 0) + 1
        self.marks[name] = time.monotonic()
        try:
            self.monitor.meet(f"meet/outside/{name}/{group_key(ranks)}", len(ranks) * n)
        finally:
            self.marks.pop(name, None)

    def report(self):
        now = time.monotonic()
        return {"index": self.index, "name": self.name, "stage": None, "backwards": None, "micro_steps": None,
                "met": dict(self.met), "held": {}, "in": {what: round(now - t0, 1) for what, t0 in list(self.marks.items())}}


def _ranks(group, world):
    if group is None:
        return tuple(range(world))
    try:
        return tuple(torch.distributed.get_process_group_ranks(group))
    except Exception:  # noqa: BLE001 - not a torch process group: DeepSpeed's world
        return tuple(range(world))


def install(watch) -> None:
    """Count the collective methods of DeepSpeed's current communication backend in their groups'
    sequences (once per backend object: a process that initializes DeepSpeed's communication again
    gets a new one)."""
    import deepspeed.comm.comm as ds_comm
    backend = ds_comm.cdb
    if backend is None or compat.installed(backend, FEATURE):
        return
    for name in _COLLECTIVES:
        method = getattr(type(backend), name, None)
        # A method whose group cannot be found is left alone: keyed by the world, a subgroup's ranks would
        # wait for ranks that never come.
        if callable(method) and group_position(method) is not None:
            compat.replace_method(backend, name, _entered_first(watch, name, method), FEATURE)


def group_position(method):
    """Where ``group`` comes among the positional arguments after ``self``, looked up in the function a
    decorator closed over where it kept no ``functools.wraps`` (DeepSpeed's ``stage_on_cpu``); None
    where no function takes a ``group``."""
    seen, todo = set(), [inspect.unwrap(method)]
    while todo:
        func = todo.pop(0)
        if id(func) in seen:
            continue
        seen.add(id(func))
        try:
            params = list(inspect.signature(func).parameters)
        except (TypeError, ValueError):
            params = []
        if "group" in params:
            return params.index("group") - 1
        todo.extend(inspect.unwrap(inner) for inner in compat.closed_over(func))
    return None


def _entered_first(watch, name, method):
    position = group_position(method)  # group is positional there, or a keyword

    def collective(self, *args, **kwargs):
        if not watch.monitor.in_engine_region():
            group = kwargs["group"] if "group" in kwargs else args[position] if position < len(args) else None
            watch.meet_before(name, group)
        return compat.original(self, name)(*args, **kwargs)

    return collective
