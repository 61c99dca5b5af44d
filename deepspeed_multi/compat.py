"""The one place that names what deepspeed_multi changes in DeepSpeed, and what it reads there.

Every DeepSpeed class, method and attribute the package overrides, replaces, wraps, swaps,
calls or reads is a row of :data:`TOUCH_POINTS` (docs/design.md prints the table, generated
from it). Every per-instance method replacement goes through :func:`replace_method`, and every
fast path asks :func:`exact` first. Nothing else in the package binds a method on a DeepSpeed
object.

[Note: the supported DeepSpeed window]
The design needs DeepSpeed's unmanaged gradient accumulation (``managed_gradient_accumulation``
and the torch-style backward it comes with: ``_backward_prologue``/``_backward_epilogue`` that
can run outside ``engine.backward``, ``unregister_grad_acc_post_hooks``,
``clear_backward_seen_flag``, ``_epilogue_ran_this_backward``), first released in 0.19.4, so
:data:`SUPPORTED` is 0.19.4-0.19.8 (``make test`` runs the core rows on both ends). A supported
release with a DeepSpeed bug that our engines expose gets a fix here (see [Note: fixes for
supported releases]); the fast paths run only on the releases they were checked on (see
:func:`fast_paths_allowed`). :func:`check_deepspeed` runs at
``initialize``: inside the window it passes; outside it raises, naming the installed and the
supported versions and :data:`ALLOW_ENV`, which runs anyway with every fast path off after
checking that each correctness-critical touch point is present.

[Note: fixes for supported releases]
``Init._allgather_params_coalesced`` (the synchronous gather of several ZeRO-3 parameters:
``GatheredParameters``, our ``save_16bit_model`` path, every test's comparison) launches one
async all-gather per parameter and, before 0.19.8, waits on the last one only. Gloo runs a
process group's collectives on several threads, so the earlier ones may not have landed when
the parameters are read: partitions of garbage, differing between runs (0.19.8 waits on each).
On those releases :func:`apply_fixes` wraps the method so that each of its all-gathers is
waited on as it is launched. Nothing else changes; on 0.19.8 nothing is installed.

[Note: one exact-method check]
A fast path replaces a DeepSpeed method with one that gives the same bits faster. It is right
only for the method it was written against, so :func:`exact` asks two things of each method it
relies on: that nothing overrides it (a subclass, or an instance attribute: then the fast path
is silently not taken, the subclass's method is the definition), and that DeepSpeed's own
method is one whose source was checked (:data:`CHECKED_SOURCES`, hashes of the method's source
in every supported release). A method whose source differs turns that fast path off with a
one-line warning naming it; results stay exact because DeepSpeed's own method runs.

[Note: why per-instance replacement]
Each fast path applies per optimizer instance, decided once from its configuration (offload,
``contiguous_gradients``, ZenFlow, MoE, ...); a class swap (FSDP2's ``FSDP<cls>``) would need
the same per-instance tests inside every method. So replacements are bound on the instance,
but only here: :func:`replace_method` records the original under the feature's name (a second
replacement of one name is an error, not a silent no-op), :func:`original` returns it, and
:func:`restore` undoes a feature. The order in which features are installed is written down
once, in ``deepspeed_multi.zero.install``.
"""
from __future__ import annotations

import functools
import hashlib
import inspect
import logging
import textwrap
import types
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Tuple

from .switches import ALLOW_UNSUPPORTED_DEEPSPEED, switch_on

logger = logging.getLogger(__name__)

# First and last DeepSpeed release the package runs on (see [Note: the supported DeepSpeed window]).
SUPPORTED = ("0.19.4", "0.19.8")
ALLOW_ENV = ALLOW_UNSUPPORTED_DEEPSPEED


# ------------------------------------------------------------------------------ the list
@dataclass(frozen=True)
class TouchPoint:
    owner: str  # the DeepSpeed class (or module) it belongs to
    name: str
    how: str  # overridden | called | replaced | wrapped | swapped | read | written | relied on
    by: str  # our module that touches it
    critical: bool  # correctness depends on it (else: a fast path that turns off without it)


_ENGINE, _Z12, _Z3 = "DeepSpeedEngine", "DeepSpeedZeroOptimizer", "DeepSpeedZeroOptimizer_Stage3"
_MANGLED = "_DeepSpeedZeroOptimizer_Stage3__"


def _load_touch_points() -> Tuple[TouchPoint, ...]:
    """The rows of touch_points.tsv (beside this file): owner, how, our module, need, names."""
    text = (Path(__file__).with_name("touch_points.tsv")).read_text()
    rows = []
    for line in text.splitlines():
        if line.strip() and not line.startswith("#"):
            owner, how, by, need, names = line.split("\t")
            rows.extend(TouchPoint(owner, name, how, by, need == "correctness") for name in names.split())
    return tuple(rows)


TOUCH_POINTS: Tuple[TouchPoint, ...] = _load_touch_points()

# The ZeRO-optimizer methods each fast path replaces or relies on, by feature.
FAST_PATH_METHODS: Dict[str, Tuple[str, Tuple[str, ...]]] = {
    "stage12_reduce": (_Z12, ("allreduce_and_copy_with_multiple_ranks", "_add_to_grad_partition_buffer")),
    "stage1_overlap_order": (_Z12, ("reduce_gradients", )),
    "stage12_bucket_pack": (_Z12, ("reduce_independent_p_g_buckets_and_remove_grads", "reduce_ipg_grads")),
    "stage12_grad_view": (_Z12, ("copy_grads_in_partition", "_get_preflattened_grad_partition")),
    "stage12_overflow_view": (_Z12, ("has_overflow_partitioned_grads_serial", "_has_inf_or_nan")),
    "stage12_overflow": (_Z12, ("step", "check_overflow", "_check_overflow", "has_overflow", "scaled_global_norm",
                                "get_grad_norm_direct")),
    "stage12_hook_count": (_Z12, ("create_gradient_handling_hooks", "should_refresh_expected_hook_count",
                                  "reenter_backward_if_needed", "update_hook_state_and_maybe_run_epilogue")),
    "stage3_partition": (_Z3, ("partition_grads", )),
    "stage3_scatter": (_Z3, (_MANGLED + "avg_scatter_grads", )),
    "stage3_grad_view": (_Z3, ("_prepare_fp32_grad_for_sub_group", )),
    "stage12_bucket_size": (_Z12, ("setup_buckets", )),  # and stage12_bucket_pack's flush method, unchanged
    "stage3_bucket_size": (_Z3, ("reduce_independent_p_g_buckets_and_remove_grads", _MANGLED + "add_grad_to_ipg_bucket",
                                 _MANGLED + "reduce_and_partition_ipg_grads")),  # and stage3_lazy_grads' epilogue
    "stage12_master_alias": (_Z12, ("initialize_optimizer_states", "_link_all_hp_params", "state_dict",
                                    "_restore_from_bit16_weights", "update_lp_params")),
    "stage3_master_alias": (_Z3, ("_create_fp32_partitions", "initialize_optimizer_states", "_optimizer_step",
                                  "_reassign_or_swap_out_partitioned_parameters")),
    # and partition_grads, checked by stage3_partition
    "stage3_lazy_grads": (_Z3, ("independent_gradient_partition_epilogue", "offload_states", "reload_states",
                                "has_overflow")),
    "stage3_cast_on_gather": (_Z3, ("_create_fp16_partitions_with_defragmentation", "_set_fp16_partitioned_groups_flat",
                                    "_reassign_or_swap_out_partitioned_parameters",
                                    "_unflatten_partitioned_parameters", "set_full_hp_param", "set_local_hp_param",
                                    "_restore_from_bit16_weights", "_rigid_load_state_dict",
                                    "load_hp_checkpoint_state_from_checkpoint_dir_stage3",
                                    "load_module_checkpoint_state_from_checkpoint_dir_stage3")),
    # the start of forward it extends, and the fetch and release that take its gathered parameters as their own
    "stage3_joined_fetch": ("PartitionedParameterCoordinator",
                            ("reset_step", "_fetch_sub_module_impl", "release_sub_module",
                             "_PartitionedParameterCoordinator__release_param",
                             "_PartitionedParameterCoordinator__all_gather_params_")),
    # its gathers and writes: every reader and writer of ds_tensor in deepspeed.zero.Init
    "stage3_cast_on_gather_init": ("Init", ("_convert_to_deepspeed_param", "_all_gather", "_partition",
                                            "_partition_param", "_allgather_param", "_allgather_params_coalesced",
                                            "_allgather_params_sequential")),
}



def _load_checked_sources() -> Dict[str, frozenset]:
    """``{"Class.method": {hash, ...}}`` from checked_sources.tsv: the DeepSpeed release each
    fast-path method's source was checked in, and the sha256[:16] of that source."""
    found: Dict[str, set] = {}
    for line in Path(__file__).with_name("checked_sources.tsv").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            version, key, digest = line.split("\t")
            found.setdefault(key, set()).add(digest)
            CHECKED_RELEASES.add(version)
    return {key: frozenset(v) for key, v in found.items()}


CHECKED_RELEASES: set = set()  # the DeepSpeed releases whose sources were checked
CHECKED_SOURCES: Dict[str, frozenset] = _load_checked_sources()


# ------------------------------------------------------------------------ the version gate
class UnsupportedDeepSpeed(RuntimeError):
    """The installed DeepSpeed is outside :data:`SUPPORTED` (and :data:`ALLOW_ENV` is not set)."""


def _version_tuple(text: str) -> Tuple[int, ...]:
    from packaging.version import Version
    return Version(text).release


def check_tested_release(integration: str, package: str, installed: str, tested, extra: str, switch: str,
                         anyway: str) -> None:
    """Refuse ``package`` ``installed`` unless its major.minor is one of ``tested`` (or ``switch`` is on):
    an integration relies on that package's code paths as they were measured."""
    from .switches import switch_on
    if _version_tuple(installed)[:2] in [_version_tuple(t) for t in tested] or switch_on(switch, False):
        return
    listed = " and ".join(f"{t}.x" for t in tested)
    raise RuntimeError(f"{integration} was tested with {package} {listed}; this environment has {package} "
                       f"{installed}. Install {package}=={tested[-1]}.* (pip install 'deepspeed_multi[{extra}]'), "
                       f"or set {switch}=1 to run {anyway}.")


def installed_version() -> str:
    import deepspeed
    return deepspeed.__version__


def in_window(version: Optional[str] = None) -> bool:
    version = installed_version() if version is None else version
    lo, hi = (_version_tuple(v) for v in SUPPORTED)
    return lo <= _version_tuple(version)[:3] <= hi


def _class(owner: str):
    if owner == _ENGINE:
        from deepspeed.runtime.engine import DeepSpeedEngine
        return DeepSpeedEngine
    if owner == _Z12:
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
        return DeepSpeedZeroOptimizer
    if owner == _Z3:
        from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
        return DeepSpeedZeroOptimizer_Stage3
    if owner == "ZeROOptimizer":
        from deepspeed.runtime.base_optimizer import ZeROOptimizer
        return ZeROOptimizer
    if owner == "PartitionedParameterCoordinator":
        from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator
        return PartitionedParameterCoordinator
    if owner == "GatheredParameters":
        from deepspeed.runtime.zero.partition_parameters import GatheredParameters
        return GatheredParameters
    if owner == "Init":
        from deepspeed.runtime.zero.partition_parameters import Init
        return Init
    if owner == "FP16_UnfusedOptimizer":
        from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
        return FP16_UnfusedOptimizer
    if owner == "BF16_Optimizer":
        from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
        return BF16_Optimizer
    if owner == "DeepSpeedZeRoOffload":
        from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
        return DeepSpeedZeRoOffload
    return None


def missing_critical() -> List[str]:
    """The correctness-critical methods (overridden, called or wrapped) that DeepSpeed lacks."""
    missing = []
    for tp in TOUCH_POINTS:
        if tp.critical and tp.how in ("overridden", "called", "wrapped"):
            cls = _class(tp.owner)
            if cls is not None and not callable(getattr(cls, tp.name, None)):
                missing.append(f"{tp.owner}.{tp.name}")
    return missing


@functools.lru_cache(maxsize=None)
def check_deepspeed() -> None:
    """At initialize: run inside the supported window; outside it, raise unless :data:`ALLOW_ENV` is set."""
    version = installed_version()
    apply_fixes(version)
    if in_window(version):
        return
    window = f"{SUPPORTED[0]} to {SUPPORTED[1]}"
    if not switch_on(ALLOW_ENV, default=False):
        raise UnsupportedDeepSpeed(
            f"deepspeed_multi supports DeepSpeed {window}; this environment has DeepSpeed {version}. Install a "
            f"supported release (pip install 'deepspeed>={SUPPORTED[0]},<={SUPPORTED[1]}'), or set {ALLOW_ENV}=1 to "
            "run anyway with every fast path off (results are then checked only as far as the correctness-critical "
            "DeepSpeed methods are present; see docs/design.md, 'DeepSpeed touch points').")
    missing = missing_critical()
    if missing:
        raise UnsupportedDeepSpeed(
            f"deepspeed_multi cannot run on DeepSpeed {version} (supported: {window}), even with {ALLOW_ENV}=1: it "
            f"lacks {', '.join(missing)}, which deepspeed_multi needs for correct gradients. Install DeepSpeed "
            f"{window}.")
    logger.warning("deepspeed_multi: DeepSpeed %s is outside the supported window (%s); running because %s=1, "
                   "with every fast path off.", version, window, ALLOW_ENV)


# Releases before this one wait on the last of _allgather_params_coalesced's handles only.
_WAITS_EACH_GATHER = (0, 19, 8)


class _WaitEachGather:
    """``deepspeed.comm`` whose async all-gathers are waited on at launch; all else delegates."""

    def __init__(self, comm):
        self._comm = comm

    def __getattr__(self, name):
        return getattr(self._comm, name)

    def _waited(self, fn, *args, **kwargs):
        work = fn(*args, **kwargs)
        if work is not None:
            work.wait()
        return work

    def all_gather_into_tensor(self, *args, **kwargs):
        return self._waited(self._comm.all_gather_into_tensor, *args, **kwargs)

    def all_gather(self, *args, **kwargs):
        return self._waited(self._comm.all_gather, *args, **kwargs)


def _gather_waiting_each(original):
    @functools.wraps(original)
    def gather(self, *args, **kwargs):
        from deepspeed.runtime.zero import partition_parameters as pp
        with swapped(pp, "dist", _WaitEachGather(pp.dist)):
            return original(self, *args, **kwargs)
    gather._dsm_fix = True
    return gather


# ZeRO-1/2 with contiguous_gradients=false gives wrong gradients on 0.19.4-0.19.7 (measured, upstream
# too: max error 4e-2 against plain PyTorch, single engine, gas 1 and 2, at both stages; the
# knob-noncontiguous matrix rows on each release); right on 0.19.8. Refused below this release
# (config.prepare_engine_config).
NONCONTIGUOUS_ZERO12_FROM = (0, 19, 8)


def noncontiguous_zero12_ok(version: Optional[str] = None) -> bool:
    return _version_tuple(version or installed_version())[:3] >= NONCONTIGUOUS_ZERO12_FROM


# A universal checkpoint (resize.py: a resume at another world size) loaded into a bf16/fp16 engine
# below ZeRO-3 gives it wrong parameters on 0.19.4-0.19.6 (measured at ZeRO-1/2, with and without
# round_robin_gradients: up to 0.98 from the saved values; fp32 and ZeRO-3 are right there); right on
# 0.19.7 and 0.19.8 (bf16 and fp16, ZeRO-1/2, bit-equal, round robin too). Refused below this release
# (resize.load_universal).
UNIVERSAL_16BIT_BELOW_ZERO3_FROM = (0, 19, 7)


def universal_16bit_below_zero3_ok(version: Optional[str] = None) -> bool:
    return _version_tuple(version or installed_version())[:3] >= UNIVERSAL_16BIT_BELOW_ZERO3_FROM


# CPU offload (offload_optimizer / offload_param) under unmanaged accumulation, which every
# MultiEngine uses: DeepSpeed 0.19.4 refuses it ("managed_gradient_accumulation=False is not
# supported with ZeRO optimizer state offload"); 0.19.5-0.19.7 accept it and pass the knob-offload-*
# matrix rows, but give a bf16 ZeRO-1 engine with fp32 gradient accumulation and gas 2 a wrong update
# (cosine 0.94 with plain PyTorch, fuzz seed 906350, knobs; 0.19.8 exact on it with every fast path
# off too); 0.19.8 is measured exact (the knob-offload-* rows, the fuzzer, with
# zero/offload_grads.py). Refused below this release (config.prepare_engine_config).
OFFLOAD_FROM = (0, 19, 8)


def offload_ok(version: Optional[str] = None) -> bool:
    return _version_tuple(version or installed_version())[:3] >= OFFLOAD_FROM


def combine_grad_norm_groups(norm_groups):
    """ZeRO-3's norm from its group norms, combined as the installed release's stage 3 does:
    ``deepspeed.runtime.utils.combine_grad_norm_groups`` where it exists (0.19.8: an invalid -1
    group stays invalid), else the plain 2-norm of the stacked group norms (0.19.4)."""
    from deepspeed.runtime import utils
    combine = getattr(utils, "combine_grad_norm_groups", None)
    if combine is not None:
        return combine(norm_groups)
    import torch
    return torch.linalg.vector_norm(torch.stack(list(norm_groups)))


def apply_fixes(version: Optional[str] = None) -> List[str]:
    """Install the fixes the installed release needs (see the Note); return their names. Idempotent."""
    applied = []
    if _version_tuple(version or installed_version())[:3] < _WAITS_EACH_GATHER:
        from deepspeed.runtime.zero.partition_parameters import Init
        if not getattr(Init._allgather_params_coalesced, "_dsm_fix", False):
            Init._allgather_params_coalesced = _gather_waiting_each(Init._allgather_params_coalesced)
        applied.append("Init._allgather_params_coalesced waits on each all-gather")
    return applied


def fast_paths_allowed() -> bool:
    """True only on a DeepSpeed release the fast paths were checked on (checked_sources.tsv).

    A fast path's bits depend on more than the method it replaces (the buffers DeepSpeed lays
    out around it, the state it keeps between calls), so a release inside the window that was
    not checked runs DeepSpeed's own methods. One warning says so.
    """
    version = installed_version()
    allowed = in_window(version) and _release(version) in CHECKED_RELEASES
    if not allowed and in_window(version) and "release" not in _warned:
        _warned.add("release")
        logger.warning("deepspeed_multi: DeepSpeed %s is supported, but the fast paths were checked on %s only; they "
                       "are off (results are exact, some steps slower).", version, ", ".join(sorted(CHECKED_RELEASES)))
    return allowed


def _release(version: str) -> str:
    return ".".join(str(x) for x in _version_tuple(version)[:3])


# ------------------------------------------------------------------ the exact-method check
def _sources(func: Callable) -> List[str]:
    """The source of ``func`` and of the functions a decorator closed over (DeepSpeed's
    ``instrument_w_nvtx`` wraps without ``functools.wraps``)."""
    func = inspect.unwrap(getattr(func, "__func__", func))
    try:
        found = [textwrap.dedent(inspect.getsource(func))]
    except (OSError, TypeError):
        return ["<no source>"]
    for inner in closed_over(func):
        found.extend(_sources(inner))
    return found


def closed_over(func: Callable):
    """The functions ``func``'s closure holds: what a decorator that kept no ``functools.wraps`` wraps."""
    for cell in getattr(func, "__closure__", None) or ():
        try:
            inner = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if inspect.isfunction(inner):
            yield inner


def source_hash(func: Callable) -> str:
    return hashlib.sha256("\n".join(_sources(func)).encode()).hexdigest()[:16]


def _unchanged(cls, name: str) -> bool:
    func = getattr(cls, name, None)
    return func is not None and _checked(f"{cls.__name__}.{name}", func)


@functools.lru_cache(maxsize=None)
def _checked(key: str, func: Callable) -> bool:  # keyed by the function: a swapped method is hashed anew
    return source_hash(func) in CHECKED_SOURCES.get(key, ())


_warned: set = set()


def exact(obj, cls, names: Iterable[str], feature: str, warn: bool = True) -> bool:
    """True if ``obj`` runs DeepSpeed's own, checked ``cls.<name>`` for every name (see the Note).

    Overridden (instance attribute or subclass): False, silently. DeepSpeed's method differs
    from every checked source, or DeepSpeed is outside the supported window: False, and (``warn``)
    one warning per feature and method names it.
    """
    names = tuple(names)
    for name in names:
        if name in vars(obj) or getattr(type(obj), name, None) is not getattr(cls, name, None):
            return False
    return _sources_checked(cls, names, feature, warn)


def _sources_checked(cls, names: Tuple[str, ...], feature: str, warn: bool) -> bool:
    if not fast_paths_allowed():
        return False
    for name in names:
        if not _unchanged(cls, name):
            key = (feature, cls.__name__, name)
            if warn and key not in _warned:
                _warned.add(key)
                logger.warning("deepspeed_multi: fast path %s off: DeepSpeed %s's %s.%s differs from the source it "
                               "was checked against; DeepSpeed's own method runs instead.", feature,
                               installed_version(), cls.__name__, name)
            return False
    return True


def class_exact(feature: str, warn: bool = True) -> bool:
    """:func:`exact` for a class whose methods a fast path wraps class-wide: the sources only."""
    owner, names = FAST_PATH_METHODS[feature]
    return _sources_checked(_class(owner), tuple(names), feature, warn)


def fast_path_exact(obj, feature: str, warn: bool = True, only: Optional[Iterable[str]] = None) -> bool:
    """:func:`exact` for the methods :data:`FAST_PATH_METHODS` lists under ``feature`` (``only``: those of
    them). ``warn=False`` for a fast path that relies on another feature's methods (that feature warns
    when they changed)."""
    owner, names = FAST_PATH_METHODS[feature]
    if only is not None:
        assert set(only) <= set(names), (feature, only)
        names = tuple(only)
    return exact(obj, _class(owner), names, feature, warn)


# ------------------------------------------------------------------ per-instance replacement
@dataclass
class _Patch:
    feature: str
    original: Callable


def replace_method(obj, name: str, replacement: Callable, feature: str) -> None:
    """Bind ``replacement`` as ``obj.<name>``; :func:`original` returns what it replaced."""
    patches = obj.__dict__.setdefault("_dsm_patches", {})
    if name in patches:
        raise RuntimeError(f"deepspeed_multi: {type(obj).__name__}.{name} is already replaced by "
                           f"{patches[name].feature}; {feature} cannot replace it too (see deepspeed_multi.zero.install "
                           "for the order of features).")
    patches[name] = _Patch(feature, getattr(obj, name))
    setattr(obj, name, types.MethodType(replacement, obj))


def original(obj, name: str) -> Callable:
    """The method :func:`replace_method` replaced (DeepSpeed's, bound to ``obj``)."""
    return obj.__dict__["_dsm_patches"][name].original


def run_before(obj, name: str, before: Callable, feature: str) -> None:
    """Call ``before(obj)`` ahead of ``obj.<name>``: as ``feature``'s replacement of it, or, where
    another feature replaced ``name`` already, ahead of the method that replacement falls back to
    (both run, the other feature's first)."""
    patches = obj.__dict__.get("_dsm_patches", {})
    if name in patches:
        inner = patches[name].original

        def then_inner(*args, **kwargs):
            before(obj)
            return inner(*args, **kwargs)

        patches[name].original = then_inner
        return

    def then_original(self, *args, **kwargs):
        before(self)
        return original(self, name)(*args, **kwargs)

    replace_method(obj, name, then_original, feature)


def set_original(obj, name: str, fn: Callable) -> None:
    """Point a replacement's fallback at ``fn`` (tests spy on the fallback this way)."""
    obj.__dict__["_dsm_patches"][name].original = fn


def state(obj, feature: str, initial: Optional[dict] = None) -> dict:
    """The per-instance state of ``feature`` (created from ``initial`` on the first call)."""
    states = obj.__dict__.setdefault("_dsm_state", {})
    if feature not in states:
        if initial is None:
            raise KeyError(f"deepspeed_multi: {feature} is not installed on this {type(obj).__name__}")
        states[feature] = initial
    return states[feature]


def installed(obj, feature: str) -> bool:
    """Whether ``feature`` replaced a method of, or keeps state on, ``obj`` (any object, or None)."""
    found = getattr(obj, "__dict__", {})
    return feature in found.get("_dsm_state", {}) or any(
        p.feature == feature for p in found.get("_dsm_patches", {}).values())


def restore(obj, feature: str) -> None:
    """Undo every replacement ``feature`` made on ``obj`` and drop its state."""
    patches = obj.__dict__.get("_dsm_patches", {})
    for name in [n for n, p in patches.items() if p.feature == feature]:
        del patches[name]
        del obj.__dict__[name]  # DeepSpeed's class method shows through again
    obj.__dict__.get("_dsm_state", {}).pop(feature, None)


@contextmanager
def swapped(owner, name: str, value):
    """Point ``owner.<name>`` (a DeepSpeed module global) at ``value`` for the ``with`` block.

    ``deepspeed.initialize`` looks up ``DeepSpeedEngine`` in its module globals, Accelerate looks
    up ``deepspeed.initialize`` at call time, ZeRO-0 looks up ``groups.mpu``: pointing one at ours
    for one call reuses DeepSpeed's own code without copying it. Callers hold their own lock.
    """
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield saved
    finally:
        setattr(owner, name, saved)


# ------------------------------------------------------------------------------ reports
def checked_sources_of_installed() -> Dict[str, str]:
    """``{"Class.method": hash}`` for every fast-path method in the installed DeepSpeed."""
    found = {}
    for owner, names in FAST_PATH_METHODS.values():
        cls = _class(owner)
        for name in names:
            func = getattr(cls, name, None)
            found[f"{owner}.{name}"] = "<missing>" if func is None else source_hash(func)
    return found


def markdown_table() -> str:
    """The touch points as a Markdown table (docs/design.md holds this text; a test compares)."""
    lines = ["| DeepSpeed owner | names | how | our module | needed for |", "| --- | --- | --- | --- | --- |"]
    groups: Dict[tuple, List[str]] = {}
    for tp in TOUCH_POINTS:
        groups.setdefault((tp.owner, tp.how, tp.by, tp.critical), []).append(tp.name)
    for (owner, how, by, critical), names in groups.items():
        lines.append(f"| {owner} | {', '.join('`%s`' % n for n in names)} | {how} | {by} | "
                     f"{'correctness' if critical else 'fast path'} |")
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover - a maintenance command
    import sys
    if "--sources" in sys.argv:  # lines for checked_sources.tsv, once each source is checked by hand
        for key, value in checked_sources_of_installed().items():
            print(f"{installed_version()}\t{key}\t{value}")
    else:
        print(markdown_table())
