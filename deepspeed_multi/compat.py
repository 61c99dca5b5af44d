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
``clear_backward_seen_flag``, ``_epilogue_ran_this_backward``); :data:`SUPPORTED` is the first
release that has all of it through the newest we test. :func:`check_deepspeed` runs at
``initialize``: inside the window it passes; outside it raises, naming the installed and the
supported versions and :data:`ALLOW_ENV`, which runs anyway with every fast path off after
checking that each correctness-critical touch point is present.

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
from typing import Callable, Dict, Iterable, List, Optional, Tuple

from .switches import ALLOW_UNSUPPORTED_DEEPSPEED, switch_on

logger = logging.getLogger(__name__)

# First and last DeepSpeed release the package runs on (see [Note: the supported DeepSpeed window]).
SUPPORTED = ("0.19.2", "0.19.8")
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


def _rows(owner, how, by, critical, names):
    return [TouchPoint(owner, n, how, by, critical) for n in names.split()]


TOUCH_POINTS: Tuple[TouchPoint, ...] = tuple(
    # The engine: MultiEngine subclasses DeepSpeedEngine.
    _rows(_ENGINE, "overridden", "engine", True, "forward _backward_prologue _backward_prologue_per_tensor backward "
          "allreduce_gradients no_sync step zero_grad")
    + _rows(_ENGINE, "called", "engine", True, "_backward_prologue _backward_epilogue managed_gradient_accumulation "
            "gradient_accumulation_steps zero_optimization_stage zero_optimization_partition_gradients fp16_enabled "
            "_get_optimizer_loss_scale empty_partition_cache train_batch_size")
    + _rows(_ENGINE, "written", "engine", True, "_support_torch_style_backward _unmanaged_backward_count "
            "_running_engine_step micro_steps global_steps global_samples skipped_steps _step_applied")
    + _rows(_ENGINE, "read", "engine", True, "timers engine_timers optimizer lr_scheduler module device")
    + _rows(_ENGINE, "read", "dp_groups", True, "seq_data_parallel_group data_parallel_group")
    + _rows(_ENGINE, "called", "checkpoint", True, "save_checkpoint load_checkpoint")
    + _rows(_ENGINE, "called", "accelerate", True, "get_global_grad_norm gradient_clipping")
    + _rows("deepspeed.zero", "called", "checkpoint, zero_init", True, "GatheredParameters Init")
    + _rows("deepspeed.comm", "called", "reliability, checkpoint", True, "all_reduce all_gather_object "
            "barrier broadcast_object_list get_rank get_world_size")
    + _rows("deepspeed", "swapped", "initialize", True, "DeepSpeedEngine")
    + _rows("deepspeed", "swapped", "accelerate._routing", True, "initialize")
    + _rows("deepspeed.utils.groups", "swapped", "dp_groups", True, "mpu")
    + _rows("deepspeed.runtime.constants", "read", "config", True, "MANAGED_GRADIENT_ACCUMULATION")
    # Every ZeRO optimizer (ZeROOptimizer) and ZeRO-3's parameter manager (DeepSpeedZeRoOffload).
    + _rows("ZeROOptimizer", "called", "engine", True, "unregister_grad_acc_post_hooks clear_backward_seen_flag")
    + _rows("DeepSpeedZeRoOffload", "called", "engine", True, "get_param_coordinator release_backward_leftovers")
    # ZeRO-1/2.
    + _rows(_Z12, "wrapped", "outside_use", True, "process_gradients")
    + _rows(_Z12, "written", "buffers", True, "averaged_gradients all_grad_tensors _epilogue_ran_this_backward "
            "_backward_active_depth params_already_reduced ipg_buckets")
    + _rows(_Z12, "replaced", "stage12_reduce", False, "allreduce_and_copy_with_multiple_ranks")
    + _rows(_Z12, "relied on", "stage12_reduce", False, "_add_to_grad_partition_buffer")
    + _rows(_Z12, "called", "stage12_reduce", False, "allreduce_bucket")
    + _rows(_Z12, "replaced", "stage12_bucket_pack", False, "reduce_independent_p_g_buckets_and_remove_grads "
            "reduce_ipg_grads")
    + _rows(_Z12, "replaced", "stage12_grad_view", False, "copy_grads_in_partition _get_preflattened_grad_partition "
            "has_overflow_partitioned_grads_serial")
    + _rows(_Z12, "relied on", "stage12_grad_view", False, "_has_inf_or_nan")
    + _rows(_Z3, "read", "skip_group", True, "grad_partitions_flat_buffer")
    + _rows(_Z12, "replaced", "stage12_overflow", False, "step check_overflow")
    + _rows(_Z12, "relied on", "stage12_overflow", False, "_check_overflow has_overflow scaled_global_norm "
            "get_grad_norm_direct")
    + _rows(_Z12, "relied on", "stage12_hook_count", False, "create_gradient_handling_hooks "
            "should_refresh_expected_hook_count reenter_backward_if_needed update_hook_state_and_maybe_run_epilogue")
    + _rows(_Z12, "read", "stage12_*", False, "_grad_acc_hooks bit16_groups params_in_partition partition_size "
            "grads_in_partition cpu_offload contiguous_gradients zenflow overlap_comm reduction_stream "
            "dp_process_group gradient_average sequence_parallel_size compute_grad_norm check_grad_overflow "
            "groups_lacking_loss_scale has_moe_layers model_parallel_group autoep_folding_tp_group "
            "_offload_gradient_safety_enabled _max_expected_hooks_seen")
    + _rows(_Z12, "written", "stage12_*", False, "grads_in_partition_offset overflow")
    + _rows("deepspeed.runtime.zero.stage_1_and_2", "read", "stage12_reduce", False, "pg_correctness_test")
    # ZeRO-3.
    + _rows(_Z3, "wrapped", "outside_use", True, "reduce_ready_partitions_and_remove_grads")
    + _rows(_Z3, "written", "buffers", True, "micro_step_id grad_partitions_flat_buffer _epilogue_ran_this_backward "
            "_backward_active_depth params_already_reduced ipg_buckets")
    + _rows(_Z3, "replaced", "stage3_partition", False, "partition_grads")
    + _rows(_Z3, "replaced", "stage3_scatter", False, _MANGLED + "avg_scatter_grads")
    + _rows(_Z3, "replaced", "stage3_grad_view", False, "_prepare_fp32_grad_for_sub_group")
    + _rows(_Z3, "read", "stage3_*", False, _MANGLED + "param_id_to_grad_partition fp32_partitioned_groups_flat "
            "averaged_gradients offload_optimizer _offload_boundary_param_ids all2all_process_group "
            "postscale_gradients gradient_predivide_factor dtype gradient_accumulation_dtype "
            "_get_param_partition_rank _get_param_partition_group _assert_same_partition_group "
            "_autoep_expert_parallel_group")
    + _rows("ZeRO-3 module", "read", "stage3_counters", True, "pre_bwd_fn applied_pre_backward_ref_cnt "
            "ds_grads_remaining"))

# The ZeRO-optimizer methods each fast path replaces or relies on, by feature.
FAST_PATH_METHODS: Dict[str, Tuple[str, Tuple[str, ...]]] = {
    "stage12_reduce": (_Z12, ("allreduce_and_copy_with_multiple_ranks", "_add_to_grad_partition_buffer")),
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
}

# sha256[:16] of each fast-path method's dedented source, in every supported DeepSpeed release
# (``python -m deepspeed_multi.compat --sources`` prints the installed release's).
CHECKED_SOURCES: Dict[str, frozenset] = {}  # filled below


# ------------------------------------------------------------------------ the version gate
class UnsupportedDeepSpeed(RuntimeError):
    """The installed DeepSpeed is outside :data:`SUPPORTED` (and :data:`ALLOW_ENV` is not set)."""


def _version_tuple(text: str) -> Tuple[int, ...]:
    from packaging.version import Version
    return Version(text).release


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


def fast_paths_allowed() -> bool:
    """False outside the supported window (only reachable with :data:`ALLOW_ENV`)."""
    return in_window()


# ------------------------------------------------------------------ the exact-method check
def _sources(func: Callable) -> List[str]:
    """The source of ``func`` and of the functions a decorator closed over (DeepSpeed's
    ``instrument_w_nvtx`` wraps without ``functools.wraps``)."""
    func = inspect.unwrap(getattr(func, "__func__", func))
    try:
        found = [textwrap.dedent(inspect.getsource(func))]
    except (OSError, TypeError):
        return ["<no source>"]
    for cell in getattr(func, "__closure__", None) or ():
        try:
            inner = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if inspect.isfunction(inner):
            found.extend(_sources(inner))
    return found


def source_hash(func: Callable) -> str:
    return hashlib.sha256("\n".join(_sources(func)).encode()).hexdigest()[:16]


def _unchanged(cls, name: str) -> bool:
    return _checked(f"{cls.__name__}.{name}", getattr(cls, name))


@functools.lru_cache(maxsize=None)
def _checked(key: str, func: Callable) -> bool:  # keyed by the function: a swapped method is hashed anew
    return source_hash(func) in CHECKED_SOURCES.get(key, ())


_warned: set = set()


def exact(obj, cls, names: Iterable[str], feature: str) -> bool:
    """True if ``obj`` runs DeepSpeed's own, checked ``cls.<name>`` for every name (see the Note).

    Overridden (instance attribute or subclass): False, silently. DeepSpeed's method differs
    from every checked source, or DeepSpeed is outside the supported window: False, and one
    warning per feature and method names it.
    """
    names = tuple(names)
    for name in names:
        if name in vars(obj) or getattr(type(obj), name, None) is not getattr(cls, name, None):
            return False
    if not fast_paths_allowed():
        return False
    for name in names:
        if not _unchanged(cls, name):
            key = (feature, cls.__name__, name)
            if key not in _warned:
                _warned.add(key)
                logger.warning("deepspeed_multi: fast path %s off: DeepSpeed %s's %s.%s differs from the source it "
                               "was checked against; DeepSpeed's own method runs instead.", feature,
                               installed_version(), cls.__name__, name)
            return False
    return True


def fast_path_exact(obj, feature: str) -> bool:
    """:func:`exact` for the methods :data:`FAST_PATH_METHODS` lists under ``feature``."""
    owner, names = FAST_PATH_METHODS[feature]
    return exact(obj, _class(owner), names, feature)


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
            found[f"{owner}.{name}"] = source_hash(getattr(cls, name))
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


# Hashes of each fast-path method's source in the supported releases (SUPPORTED[0] .. SUPPORTED[1]).
_SOURCES = """
[2026-11-25
03:23:42,122]
[WARNING]
[real_accelerator.py:213:get_accelerator]
Setting
accelerator
to
CPU.
If
you
have
GPU
or
other
accelerator,
we
were
unable
to
detect
it.
DeepSpeedZeroOptimizer.allreduce_and_copy_with_multiple_ranks=66e843aaa4d73a7e
DeepSpeedZeroOptimizer._add_to_grad_partition_buffer=123259edc06387b8
DeepSpeedZeroOptimizer.reduce_independent_p_g_buckets_and_remove_grads=16168d030dd484b2
DeepSpeedZeroOptimizer.reduce_ipg_grads=2d681fbe1aa9d760
DeepSpeedZeroOptimizer.copy_grads_in_partition=b733740191ae5aaf
DeepSpeedZeroOptimizer._get_preflattened_grad_partition=75f8c8cb089bda89
DeepSpeedZeroOptimizer.has_overflow_partitioned_grads_serial=6141630b8b450d74
DeepSpeedZeroOptimizer._has_inf_or_nan=2e8af6dff1ba4732
DeepSpeedZeroOptimizer.step=279ae7c6a4e87667
DeepSpeedZeroOptimizer.check_overflow=f968102a73733534
DeepSpeedZeroOptimizer._check_overflow=92e4d1664aacd1ac
DeepSpeedZeroOptimizer.has_overflow=53a5fc9ff81a8853
DeepSpeedZeroOptimizer.scaled_global_norm=2aa9e1d2b4a14133
DeepSpeedZeroOptimizer.get_grad_norm_direct=8e1ffafc3841f46a
DeepSpeedZeroOptimizer.create_gradient_handling_hooks=889a2e66c36cee2b
DeepSpeedZeroOptimizer.should_refresh_expected_hook_count=c461b97dfb0b27e0
DeepSpeedZeroOptimizer.reenter_backward_if_needed=6d631392103cefa9
DeepSpeedZeroOptimizer.update_hook_state_and_maybe_run_epilogue=c6593fbb178290b6
DeepSpeedZeroOptimizer_Stage3.partition_grads=f0eb8f336d6b607f
DeepSpeedZeroOptimizer_Stage3._DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads=68a732e031ce8bd1
DeepSpeedZeroOptimizer_Stage3._prepare_fp32_grad_for_sub_group=4fdd58fb87e90466
"""
for _line in _SOURCES.split():
    _key, _, _hash = _line.partition("=")
    CHECKED_SOURCES[_key] = CHECKED_SOURCES.get(_key, frozenset()) | {_hash}

if __name__ == "__main__":  # pragma: no cover - a maintenance command
    import sys
    if "--sources" in sys.argv:
        for key, value in checked_sources_of_installed().items():
            print(f"{key}={value}")
    else:
        print(markdown_table())
