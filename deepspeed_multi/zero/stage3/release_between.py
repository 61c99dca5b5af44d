"""ZeRO-3: what an engine keeps gathered after its forward is released when another engine's forward runs.

[Note: an engine's parameters while other engines run]
At the end of a forward ZeRO-3 keeps a parameter gathered when its trace says it is used again
within ``stage3_max_reuse_distance`` elements of fetches: the last blocks of a forward are the
first of its backward, so they stay gathered (up to ``stage3_max_live_parameters``). Each engine
keeps its own trace, which holds only its own modules; so an engine whose forward is followed by
other engines' forwards and backwards before its own backward (an encoder feeding an LLM, an
actor beside a critic) keeps those parameters gathered through all of the others' work. One
engine over the same modules (the super-module) sees the other models' fetches in its trace
between the two uses and releases them: several engines would hold more than one.

So when an engine's forward starts, every other ZeRO-3 engine that ran a forward since it was last
released here, whose gathered parameters are not in use (not inside its forward or its backward;
never inside any backward; not held by a ``GatheredParameters`` context), and whose
``stage3_max_reuse_distance`` is smaller than the starting engine's parameter count (the
super-module would count at least those fetches in between) has
its in-flight prefetches waited for and every gathered parameter that is not persistent
(``stage3_param_persistence_threshold``) released, as its own coordinator releases them. Its
backward gathers them again where it needs them, as the super-module's does: one all-gather more
per engine and step, the price FSDP2 pays by default (``reshard_after_forward``). An all-gather moves
data, so the parameters and every gradient are bitwise what they were.

Applies to ZeRO-3 engines whose parameters are gathered by DeepSpeed's coordinator and not swapped
to NVMe (its prefetch of swapped partitions follows the trace, which a release would leave).
``DSM_ZERO3_RELEASE_BETWEEN=0`` keeps them gathered (for A/B runs).
"""
from __future__ import annotations

import collections
import weakref

from ... import compat
from ...autograd import graph
from ...state import TrainingState
from ...switches import ZERO3_RELEASE_BETWEEN, switch_on
from .. import block_sizes
from . import joined_fetch as stage3_joined_fetch, prefetch as stage3_prefetch

FEATURE = "stage3_release_between"
_RELEASE = stage3_joined_fetch._MANGLED + "release_param"
_REUSE = stage3_joined_fetch._MANGLED + "max_reuse_dist_in_numel"
_RELIED_ON = ("_fetch_sub_module_impl", "release_sub_module", _RELEASE)
STATS = collections.Counter()  # "released": parameters released here (for tests)
_ENGINES: "weakref.WeakSet" = weakref.WeakSet()  # engines with this feature that ran a forward
_ELEMENTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # engine -> its parameters' full element count


def install(optimizer) -> bool:
    """Let ``optimizer``'s gathered parameters be released while other engines run; return whether it does."""
    coordinator = stage3_joined_fetch.coordinator_of(optimizer)
    if coordinator is None or not switch_on(ZERO3_RELEASE_BETWEEN) or not hasattr(coordinator, _REUSE):
        return False
    # the release, and the fetch that gathers a released parameter again: checked for stage3_joined_fetch
    if not compat.fast_path_exact(coordinator, stage3_joined_fetch.FEATURE, warn=False, only=_RELIED_ON):
        return False
    from deepspeed.runtime.zero import partition_parameters
    held_by_user = getattr(partition_parameters, "DS_Z3_GATHERED_PARAM_CONTEXT_DEPTH_ATTR", None)
    if held_by_user is None:  # a GatheredParameters context could not be told apart from a kept parameter
        return False
    params = [p for p in optimizer.module.parameters() if hasattr(p, "ds_status")]  # (ZeRO-3 and its offload: .module)
    if not params or any(stage3_joined_fetch.swapped_to_nvme(p) for p in params):
        return False
    compat.state(optimizer, FEATURE, {"coordinator": coordinator, "params": params, "held": False,
                                      "held_by_user": held_by_user})
    return True


def _elements(engine) -> int:
    found = _ELEMENTS.get(engine)
    if found is None:
        found = _ELEMENTS[engine] = block_sizes.elements(engine.module)
    return found


def forward_starts(engine) -> None:
    """``engine``'s forward starts: release what the other engines keep gathered (see the Note)."""
    if graph.in_backward():  # a forward recomputed inside a backward: the others may be mid-backward
        return
    if compat.installed(engine.optimizer, FEATURE):
        compat.state(engine.optimizer, FEATURE)["held"] = True
        _ENGINES.add(engine)
    for other in list(_ENGINES):
        if other is engine:
            continue
        if not compat.installed(other.optimizer, FEATURE):  # destroyed
            _ENGINES.discard(other)
            continue
        state = compat.state(other.optimizer, FEATURE)
        if (not state["held"] or other._region.depth or other._state is TrainingState.IN_BACKWARD
                or _elements(engine) <= getattr(state["coordinator"], _REUSE)):
            continue
        state["held"] = False
        release(other, state)


def release(engine, state) -> int:
    """Release ``engine``'s gathered parameters that no module of it is using; return how many."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    stage3_prefetch.drain(engine)  # waits for and releases what is in flight
    release_param, held_by_user = getattr(state["coordinator"], _RELEASE), state["held_by_user"]
    released = 0
    for p in state["params"]:
        if (p.ds_status == ZeroParamStatus.AVAILABLE and not p.ds_persist and not p.ds_active_sub_modules
                and not getattr(p, "is_external_param", False) and not getattr(p, held_by_user, 0)):
            release_param(p)
            released += p.ds_status == ZeroParamStatus.NOT_AVAILABLE
    STATS["released"] += released
    return released


def forget(optimizer) -> None:
    """``destroy()``: this engine's parameters are handed back."""
    compat.restore(optimizer, FEATURE)
