"""Bucket and prefetch sizes a config leaves unset (or ``"auto"``), taken from the model's block.

[Note: sizes from the model's block]
DeepSpeed's size defaults are fixed element counts chosen for billion-parameter models:
``reduce_bucket_size`` and ``allgather_bucket_size`` 5e8, ZeRO-3's ``stage3_prefetch_bucket_size``
5e7, ``stage3_max_live_parameters`` and ``stage3_max_reuse_distance`` 1e9. On the models several
engines are made of (an encoder, a reward head, a 100M-1B LLM) they mean "everything at once":
ZeRO-3 keeps the whole unpartitioned gradient of the model in its bucket until the backward ends
and every gathered block alive from its forward to its backward, ZeRO-1/2 all-gather the whole
updated model in one piece. FSDP2 works one block at a time (``fully_shard`` per block), which is
why DeepSpeed at its defaults peaks above it (benchmarks/memory_breakdown.py).

So a size the config does not set, or sets to ``"auto"``, becomes the size of the model's block,
never more than DeepSpeed's default: the largest element of its ``nn.ModuleList`` containers (a
Transformers model's decoder layers, a vision tower's blocks) or, where it has none, its largest
module holding parameters itself. Reduction and all-gather buckets and the prefetch hold one block,
ZeRO-3 keeps about one block's parameters gathered as it moves through the model (see below) and
releases a parameter unless it is reused within one block, and, for an optimizer that updates element
by element (SGD, Adam, AdamW), ZeRO-3 updates in sub-groups of one block's partition, so that its
gradient partitions are allocated a block at a time during the backward instead of all at once at its
first gradient.

Blocks smaller than ``min_block_elements`` (an option under ``"deepspeed_multi"``, 4,194,304
elements by default: 16 MiB in fp32) are grouped: a size counts as many whole blocks as fit in that
many elements, at least one, and a model no larger than that has that many (one bucket, gathered
whole). Each bucket, prefetch and sub-group is one more collective with a fixed cost (milliseconds
on gloo, tens of microseconds on NCCL) that a small block does not amortize, and a small model's
whole gradient is a few MiB: per block, small models step slower for no memory worth having
(``overhead.py --block-floor``, benchmarks/PERFORMANCE.md: on gloo a ZeRO-3 engine over three blocks of
width 256 steps slower per block than grouped, by more than a tenth). Whole blocks rather than the floor
itself, because a bucket is allocated at its full size at the first gradient of the backward,
when every activation is alive: a block of 3/4 of the floor padded to the floor is a third of a
block held for nothing, while a block above half the floor already amortizes its collective. The
live parameters are not a collective: they are one of the model's own blocks, never fewer than the
grouped size (so a model under the floor stays gathered whole). DeepSpeed's prefetch is a window that
slides by module: at each module's fetch it adds the next parameters of the trace, whole, while fewer
elements than its room (``stage3_max_live_parameters`` less what is gathered or in flight) are in
flight, and each module's release makes room. With one block of room, the next block's first parameter
is gathered as soon as the running block releases its first piece (a module holding parameters
itself), so every parameter is gathered about one block's compute before its use, as FSDP2's
prefetch of the next block gathers it, while at most a block and a parameter are held, not two
blocks. A block of one piece is released all at once, so for it the room is one element more: the
next block's first parameter is then gathered beside it. A bucket's size is rounded up
to an even count: ZeRO-1/2 asserts that of its all-gather bucket, and an odd block is common in a
small model. A value the config sets is always kept (Transformers' and Accelerate's fill of ``"auto"``
from ``hidden_size`` arrives as a value and is kept too).

The sizes decide when a bucket is flushed and when a parameter is gathered or released, never
which elements are summed: every gradient element is the same sum over the ranks in whichever
bucket it travels (bit for bit on 2 ranks; with more ranks gloo's ring may add the ranks' values
in another order for an element at another offset, a rounding of fp32's last bit, as any change of
bucket size upstream does). ``sub_group_size`` groups the update: an element-wise optimizer gives
the same elements in any grouping, but ZeRO-3's gradient norm is the norm of the sub-groups' norms,
so under ``gradient_clipping`` the clip factor may differ from the one-group run in fp32's last bit
(as with any ``sub_group_size`` upstream); an optimizer that looks at a whole tensor (LAMB,
Adafactor) sees DeepSpeed's flat sub-group as its tensor, so for it (and for a
client optimizer of another class) ``sub_group_size`` keeps DeepSpeed's default. Several sub-groups
meet a DeepSpeed bug at a resize, which the set checkpoint corrects ([Note: one step counter per
sub-group] in checkpoint/resize.py).
``DSM_BLOCK_SIZES=0`` keeps DeepSpeed's defaults (for A/B runs).
"""
from __future__ import annotations

import logging

import torch

from ..switches import BLOCK_SIZES, switch_on

logger = logging.getLogger(__name__)

# The DeepSpeedZeroConfig fields sized to one block, by stage. Each field's default and the name a
# config file spells it with (its alias) are DeepSpeed's own (_field), so "never above DeepSpeed's
# default" follows a DeepSpeed that changes them.
_ZERO12 = ("reduce_bucket_size", "allgather_bucket_size")
_ZERO3 = ("reduce_bucket_size", "prefetch_bucket_size", "max_live_parameters", "max_reuse_distance")
# Names DeepSpeed reads outside the config model: get_zero_config copies "allgather_size" into
# allgather_bucket_size.
_LEGACY = {"allgather_bucket_size": ("allgather_size", )}


def _field(name: str):
    """(the key a config file writes, every name DeepSpeed reads the size under, DeepSpeed's default);
    None where this DeepSpeed has no such field (the size is then left to it)."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    field = DeepSpeedZeroConfig.model_fields.get(name)
    if field is None or not isinstance(field.default, int):
        return None
    key = field.alias or name
    return key, (key, *((name, ) if key != name else ()), *_LEGACY.get(name, ())), int(field.default)


_ELEMENTWISE = {"sgd", "adam", "adamw"}  # optimizer classes / config types whose update is per element


def _elementwise(config: dict, optimizer) -> bool:
    if optimizer is not None:
        return type(optimizer) in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)
    return str((config.get("optimizer") or {}).get("type", "")).lower() in _ELEMENTWISE


def _numel(p) -> int:
    """A parameter's elements, at its full size under ZeRO-3."""
    return getattr(p, "ds_numel", p.numel())


def elements(module: torch.nn.Module, recurse=True) -> int:
    """Elements of the module's parameters, trained or frozen (ZeRO-3 gathers both), at their full
    size under ZeRO-3; ``recurse=False``: its own parameters only."""
    return sum(_numel(p) for p in module.parameters(recurse=recurse))


def _block(model: torch.nn.Module):
    """(the model's block, whether its parameters are counted recursively) (see the Note); (None, False) for a
    model without parameters."""
    repeated = [m for lst in model.modules() if isinstance(lst, torch.nn.ModuleList) for m in lst if elements(m)]
    if repeated:
        return max(repeated, key=elements), True
    own = [m for m in model.modules() if elements(m, recurse=False)]
    return (max(own, key=lambda m: elements(m, recurse=False)), False) if own else (None, False)


def block_elements(model: torch.nn.Module) -> int:
    """Elements of the model's block (see the Note), 0 for a model without parameters."""
    return _block_sizes(model)[0]


def block_pieces(model: torch.nn.Module) -> int:
    """How many modules of the model's block hold parameters themselves: the pieces ZeRO-3 fetches and
    releases one at a time (see the Note); 0 for a model without parameters."""
    return _block_sizes(model)[1]


def _block_sizes(model: torch.nn.Module):
    """(elements of the model's block, its pieces); (0, 0) for a model without parameters."""
    block, recurse = _block(model)
    if block is None:
        return 0, 0
    pieces = sum(1 for m in block.modules() if elements(m, recurse=False)) if recurse else 1
    return elements(block, recurse), pieces


def _ranks() -> int:
    """The ranks a ZeRO-3 partition is cut for, before the engine exists: the world (under model
    parallelism the data-parallel group is smaller and the sub-groups a few blocks' share)."""
    import os
    dist = torch.distributed
    return max(1, dist.get_world_size() if dist.is_available() and dist.is_initialized()
               else int(os.environ.get("WORLD_SIZE", "1")))


def _unset(zero: dict, names) -> bool:
    return all(zero.get(name, "auto") == "auto" for name in names)


def fill(config: dict, model, optimizer=None, min_block=0) -> dict:
    """``config`` with the unset (or ``"auto"``) sizes of its ZeRO stage set from ``model``'s block,
    grouped into as many whole blocks as fit in ``min_block`` elements (at least one); returns
    ``{key: value}`` of what it set. ``optimizer``: the client optimizer, if any."""
    zero = config.get("zero_optimization")
    stage = int((zero or {}).get("stage", 0))
    if stage == 0 or not isinstance(model, torch.nn.Module) or not switch_on(BLOCK_SIZES):
        return {}
    own, pieces = _block_sizes(model)
    if own <= 0:
        return {}
    floor = int(min_block)
    if elements(model) <= floor:
        grouped = floor  # the whole model fits: one bucket, gathered whole
    else:
        grouped = own * max(1, floor // own)  # whole blocks: as many as fit in the floor, at least one
    filled = {}
    for field in _ZERO3 if stage == 3 else _ZERO12:
        found = _field(field)
        if found is None:
            continue
        key, names, default = found
        if _unset(zero, names):
            for name in names:
                zero.pop(name, None)
            if field == "max_live_parameters":  # the prefetch's window: a block, and an element for a one-piece block
                size = max(own + (pieces == 1), grouped)
            else:
                size = max(own, grouped)
                size += size % 2  # even: ZeRO-1/2 asserts it of its all-gather bucket
            zero[key] = filled[key] = min(default, size)
    found = _field("sub_group_size") if stage == 3 else None
    if found is not None and _unset(zero, found[1]) and _elementwise(config, optimizer):
        key, _, default = found
        share = -(-grouped // _ranks())  # a sub-group counts this rank's partition elements: its share
        zero[key] = filled[key] = min(default, share)
    if filled:
        logger.info("deepspeed_multi: %s at ZeRO stage %d: sizes the config leaves to DeepSpeed's defaults set from "
                    "its block of %d elements (%d per size): %s", type(model).__name__, stage, own, grouped, filled)
    return filled
