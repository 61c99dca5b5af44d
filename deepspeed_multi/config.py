"""Reading a DeepSpeed config the way deepspeed.initialize does, and our own keys."""
import copy
import logging
from dataclasses import dataclass, field, fields
from typing import Optional

from deepspeed.runtime.constants import MANAGED_GRADIENT_ACCUMULATION

from . import compat

logger = logging.getLogger(__name__)

def load_config(config):
    """A fresh dict from a dict or a path (JSON/HJSON, as DeepSpeed accepts), its ``zero_optimization`` section
    read as DeepSpeed reads it (:func:`checked_zero_section`)."""
    if isinstance(config, dict):
        config = copy.deepcopy(config)
    else:
        from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config
        config = load_ds_config(config)
    checked_zero_section(config)
    _check_steps_per_print(config)
    return config


def _check_steps_per_print(config: dict) -> None:
    """``steps_per_print: 0``: DeepSpeed's ``step()`` divides by it on rank 0 only, whose ZeroDivisionError leaves the
    other ranks waiting in the next collective (upstream hangs): refused before any engine is built."""
    value = config.get("steps_per_print") if isinstance(config, dict) else None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value <= 0:
        raise ValueError(f"DeepSpeed config: \"steps_per_print\" is {value!r}; DeepSpeed's step() divides by it (on rank "
                         "0 only, which then fails while the other ranks wait). Set a positive number, e.g. 10**9 to "
                         "print never.")


_ZERO_SUBSECTIONS = ("offload_optimizer", "offload_param")


def checked_zero_section(config: dict) -> None:
    """``config["zero_optimization"]`` as DeepSpeed reads it, in place, or a clear error naming the key.

    DeepSpeed's deprecated ``true``/``false`` form becomes the section DeepSpeed makes of it (``true`` is
    stage 1), a stage DeepSpeed coerces (``"2"``, ``2.0``) an int; what DeepSpeed refuses (a section that is
    not a dict, a stage outside 0-3, an offload section that is not a dict) is refused here, naming the
    key and the value, where it would otherwise fail inside this package's own code."""
    if not isinstance(config, dict) or "zero_optimization" not in config:
        return
    zero = config["zero_optimization"]
    if isinstance(zero, bool):
        from deepspeed.runtime.zero.config import read_zero_config_deprecated
        zero = config["zero_optimization"] = read_zero_config_deprecated(config)
    if not isinstance(zero, dict):
        raise ValueError(f"DeepSpeed config: \"zero_optimization\" is {zero!r} ({type(zero).__name__}); expected a "
                         "section such as {\"stage\": 2} (or true/false, DeepSpeed's deprecated form). Fix that "
                         "entry of the config.")
    if "stage" in zero:
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
        try:
            zero["stage"] = int(DeepSpeedZeroConfig(stage=zero["stage"]).stage)
        except Exception:  # (pydantic's ValidationError: DeepSpeed refuses the value too)
            raise ValueError(f"DeepSpeed config: \"zero_optimization.stage\" is {zero['stage']!r}; expected 0, 1, 2 or 3 "
                             "(DeepSpeed refuses anything else). Fix that entry of the config.") from None
    for key in _ZERO_SUBSECTIONS:
        if zero.get(key) is not None and not isinstance(zero[key], dict):
            raise ValueError(f"DeepSpeed config: \"zero_optimization.{key}\" is {zero[key]!r}; expected a section such "
                             f"as {{\"device\": \"cpu\"}} (DeepSpeed refuses anything else). Fix that entry of the config.")


def merged(base: dict, override: dict) -> dict:
    """``base`` with ``override`` over it, section by section (a fresh dict)."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def enabled(section) -> bool:
    """An ``fp16``/``bf16``-style section that is on."""
    return isinstance(section, dict) and section.get("enabled") is True


def zero_stage(config: dict) -> int:
    return int(config.get("zero_optimization", {}).get("stage", 0))


def prepare_engine_config(config: dict):
    """Return (config for DeepSpeed, whether the user owns the accumulation boundary, our options).

    [Note: who owns the gradient-accumulation boundary]
    MultiEngine runs DeepSpeed with ``managed_gradient_accumulation=false``: every backward
    only accumulates, and DeepSpeed finalizes and updates when asked. That gives PyTorch's
    meaning to several backward calls before a step, to zero_grad(), and to engines of
    different gradient_accumulation_steps in one graph. MultiEngine.step() then applies the
    update at the end of each window of gradient_accumulation_steps step() calls, as DeepSpeed
    does by default, unless the user set managed_gradient_accumulation=false themselves, in
    which case every step() updates.
    """
    options = MultiOptions.from_config(config)
    user_managed = config.get(MANAGED_GRADIENT_ACCUMULATION, True) is False
    config[MANAGED_GRADIENT_ACCUMULATION] = False
    stage = zero_stage(config)
    options.zero1_overlap_comm = _drop_overlap_below_stage2(config, stage) and stage == 1
    noncontiguous = config.get("zero_optimization", {}).get("contiguous_gradients") is False
    if stage in (1, 2) and noncontiguous and not compat.noncontiguous_zero12_ok():
        raise ValueError(f"deepspeed_multi: zero_optimization.contiguous_gradients=false at ZeRO stage {stage} gives "
                         f"wrong gradients with DeepSpeed {compat.installed_version()} (measured on 0.19.4-0.19.7, "
                         "upstream too; right on 0.19.8). Leave contiguous_gradients true, or install deepspeed==0.19.8.")
    offloaded = [k for k in ("offload_optimizer", "offload_param")
                 if ((config.get("zero_optimization", {}).get(k) or {}).get("device") or "none") != "none"]
    if offloaded and stage >= 1 and not compat.offload_ok():
        raise ValueError(f"deepspeed_multi: zero_optimization.{offloaded[0]} (CPU/NVMe offload) needs DeepSpeed 0.19.8 "
                         f"here, found {compat.installed_version()}: deepspeed_multi runs DeepSpeed with unmanaged "
                         "gradient accumulation, which 0.19.4 refuses with offload and 0.19.5-0.19.7 get wrong with "
                         "bf16 and fp32 gradient accumulation. Install deepspeed==0.19.8, or remove the offload.")
    return config, user_managed, options


def _drop_overlap_below_stage2(config: dict, stage: int) -> bool:
    """[Note: overlap_comm below ZeRO-2]
    At ZeRO-0 DeepSpeed ignores ``overlap_comm`` (nothing of its reduction reads it). At ZeRO-1 it
    only moves the boundary's reduction into the boundary micro-step's backward: each gradient,
    accumulated over the window, goes into a bucket as its hook fires instead of after the pass, so
    the same sums of the same gradients are reduced, on a side stream where there is one. With
    unmanaged accumulation DeepSpeed refuses it below stage 2, because then no backward knows it is
    the boundary's; a MultiEngine reduces at ``step()``, the one moment it knows. So the key is
    dropped below stage 2 and the engine keeps upstream's updates (the drop-in rows of
    tests/multi_gpu/drop_in_checks.py compare them bit for bit), reducing in the order upstream's
    hooks would (zero/stage12/overlap_order.py); what is lost is the overlap of that one reduction with
    the last backward. DeepSpeed-Chat and axolotl ship the key at every stage. Returns whether the
    config asked for it."""
    zero = config.get("zero_optimization")
    if stage < 2 and isinstance(zero, dict) and zero.pop("overlap_comm", None):
        logger.info("deepspeed_multi: zero_optimization.overlap_comm has no effect at ZeRO stage %d here: the "
                    "reduction runs at the update's step() (see [Note: overlap_comm below ZeRO-2]).", stage)
        return True
    return False


OPTIONS_KEY = "deepspeed_multi"


@dataclass
class MultiOptions:
    """Our own options, under the config key ``"deepspeed_multi"`` (removed before DeepSpeed sees it).

    docs/options.md's table of config keys is generated from these attributes (their types, defaults and
    the descriptions below: tools/docs/reference.py), in Markdown, as that page shows them.

    Attributes:
        fused_reduce: fused ops in the ZeRO-1/2/3 reduction path, each bit-identical to DeepSpeed's own:
            the pack of a bucket's gradients before the reduction (ZeRO-1/2, `zero/stage12/bucket_pack.py`),
            the interleaved reduce-scatter input with its pre-divide (ZeRO-3, `zero/stage3/scatter.py`) and
            the copy-back after the reduction (ZeRO-1/2 `zero/stage12/reduce.py`, ZeRO-3
            `zero/stage3/partition.py`); the pure-PyTorch reference runs where no compiler is available.
        skip_group: engines with the same name skip their update together when any of them has inf/nan
            gradients (RLHF actor + critic); fp16 members lower their loss scale as on an overflow.
        watchdog_timeout_s: a rank stuck longer than this many seconds in one of the engine's collective
            regions (ZeRO-3 forward, backward, `step()`) fails every rank with an error naming the engine; 0
            turns it off. The budget covers the region's compute too.
        agree_before_collectives: before the collectives of a ZeRO-3 forward, a ZeRO-2/3 backward and an
            update, the ranks of the engine's data-parallel group meet at the rendezvous store wherever the
            loop's recent regions do not predict the region (a loop stops meeting once its regions repeat), so
            a rank that left the loop's path (skipped an engine, entered another engine's collective, ran a
            collective of its own through `deepspeed.comm`) waits where the watchdog names it instead of
            entering another engine's collective (gloo aborts on mismatched sizes, naming nothing). Null (the
            default): on with gloo, off with NCCL. Needs the watchdog on. Cost: within noise (on/off 1.006 and
            0.997 at ZeRO-2/3 on 2 CPU ranks, inside their interquartile ranges, on/upstream 0.946 and 0.977;
            `overhead.py --meet`, [PERFORMANCE.md](../benchmarks/PERFORMANCE.md#watchdog-and-rank-meeting-cost)).
            The ZeRO-0/1 updates of a group share one meeting row, so their rank agreement names both engines
            at once ([Note: ranks meet before an engine's collectives] in watchdog.py).
        direct_use_check_updates: during the engine's first N updates, a backward in which a parameter gets
            gradient both through the engine and from a direct use outside it raises when the engine's
            gradient scale is not 1 (see [Limits](limits.md)); -1 checks always, 0 never.
        min_block_elements: the bucket, prefetch and sub-group sizes a config leaves unset are the model's
            block's, smaller blocks grouped into as many whole blocks as fit in this many elements (16 MiB in
            fp32), and this many for a model no larger; ZeRO-3's live parameters are one of the model's own
            blocks (one element more for a block that is one layer, so the next is prefetched beside it), at
            least one grouped size: each bucket is a collective, whose fixed cost a smaller one does not
            amortize; 0 sizes by the block alone (as FSDP2's per-block sharding does); see `DSM_BLOCK_SIZES`
            and `zero/block_sizes.py` ([Note: sizes from the model's block]).
        generation_gather_bytes: the most bytes of whole parameters a ZeRO-3 engine's `generate()` gathers
            at once to run without per-module gathers (`engine.generation_mode()`,
            [Generation](generation.md)); null (the default): no bound, the whole model, as TRL gathers it; 0:
            never, each forward gathers module by module with `synced_gpus` on.
        allow_mixed_dp_groups: true on every engine of a loss lets one backward reach engines on different
            data-parallel groups (different `mpu`); right only when the data is replicated across each
            model-parallel group, so that every engine's data-parallel average is the same average (see
            [Misuse](limits.md#misuse)). Not needed beside an AutoTP engine (`tensor_parallel.autotp_size`),
            whose groups DeepSpeed builds ([Note: AutoTP engines beside engines without tensor parallelism]).
    """
    fused_reduce: bool = True
    skip_group: Optional[str] = None
    watchdog_timeout_s: float = 300.0
    allow_mixed_dp_groups: bool = False
    direct_use_check_updates: int = 1
    agree_before_collectives: Optional[bool] = None
    min_block_elements: int = 1 << 22
    generation_gather_bytes: Optional[int] = None
    # Set by prepare_engine_config, not a user option: the config asked for overlap_comm at ZeRO-1, which
    # DeepSpeed does not see; the update reduces in upstream's order (zero/stage12/overlap_order.py).
    zero1_overlap_comm: bool = field(default=False, init=False, repr=False)

    @classmethod
    def from_config(cls, config: dict) -> "MultiOptions":
        given = config.pop(OPTIONS_KEY, None) or {}
        known = {f.name for f in fields(cls) if f.init}
        unknown = sorted(set(given) - known)
        if unknown:
            raise ValueError(f"deepspeed_multi: unknown option(s) {unknown} under config key {OPTIONS_KEY!r}; "
                             f"known options: {sorted(known)}.")
        options = cls(**given)
        timeout = options.watchdog_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0:
            raise ValueError(f"deepspeed_multi: watchdog_timeout_s must be a number of seconds >= 0 (0 turns the "
                             f"watchdog off); got {timeout!r}.")
        updates = options.direct_use_check_updates
        if isinstance(updates, bool) or not isinstance(updates, int) or updates < -1:
            raise ValueError(f"deepspeed_multi: direct_use_check_updates must be an integer >= -1 (the number of "
                             f"updates during which direct parameter uses are checked; -1 always, 0 never); got "
                             f"{updates!r}.")
        if options.agree_before_collectives not in (None, True, False):
            raise ValueError(f"deepspeed_multi: agree_before_collectives must be true, false or null (on with gloo, "
                             f"off with NCCL); got {options.agree_before_collectives!r}.")
        floor = options.min_block_elements
        if isinstance(floor, bool) or not isinstance(floor, int) or floor < 0:
            raise ValueError(f"deepspeed_multi: min_block_elements must be an integer >= 0 (the fewest elements a "
                             f"bucket or prefetch sized from the model's block holds); got {floor!r}.")
        bound = options.generation_gather_bytes
        if bound is not None and (isinstance(bound, bool) or not isinstance(bound, int) or bound < 0):
            raise ValueError(f"deepspeed_multi: generation_gather_bytes must be a number of bytes >= 0 (0: generate() "
                             f"never gathers the whole model) or null (no bound); got {bound!r}.")
        if not isinstance(options.allow_mixed_dp_groups, bool):
            raise ValueError(f"deepspeed_multi: allow_mixed_dp_groups must be true or false; got "
                             f"{options.allow_mixed_dp_groups!r}.")
        return options
