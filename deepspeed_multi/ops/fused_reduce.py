"""Fused gradient-bucket ops with a choice between the compiled extension and the reference.

API (stable; identical in the extension and in :mod:`deepspeed_multi.ops.reference`):

``pack(tensors, out, scale) -> flag``
    Writes ``cat([t.reshape(-1) for t in tensors]).float() * scale``, cast to ``out.dtype``,
    into ``out[:total_numel]``. ``out`` is 1-D and contiguous and may be longer than the total.
    Inputs may be non-contiguous (they are copied) and of mixed dtypes.

``unpack_accumulate(src, outs, scale, accumulate) -> flag``
    For each ``outs[i]`` at flat offset ``o_i`` (sum of the previous numels):
    ``outs[i] = src[o_i:o_i+n_i].view_as(outs[i]).float() * scale`` (``accumulate=False``) or
    ``outs[i] += ...`` (``accumulate=True``), computed in float32 and cast once. ``src`` is 1-D
    and contiguous; ``outs`` must be contiguous.

``pack_partitions(tensors, out, world, scale) -> flag``
    ZeRO-3's reduce-scatter input (``reduce_scatter_coalesced``'s interleaved cat) in one pass:
    with ``c_i = ceil(n_i / world)`` and ``P = sum(c_i)``, rank ``r``'s block ``out[r*P:(r+1)*P]``
    holds each tensor's ``r``-th chunk ``t.reshape(-1)[r*c_i:(r+1)*c_i]`` at offset
    ``sum(c_j for j < i)``, ``* scale`` and cast. A chunk shorter than ``c_i`` leaves its padding
    untouched. ``out`` needs at least ``world * P`` elements.

All three return a 0-dim float32 tensor on the data's device: 1.0 if any input or written value is
inf/nan, else 0.0 (computed in the same pass; on CUDA it is not synchronized). Supported
dtypes: float32, bfloat16, float16, any pair. Bad arguments raise ValueError naming the tensor.

Backend: env ``DSM_FUSED_REDUCE`` = ``auto`` (default: the extension if it builds, else the
reference), ``ext`` (the extension; raise BuildError if it cannot be built) or ``ref`` (the
reference). The choice is made on first use, logged once per process, and reported by
``active_backend()``.
"""
from __future__ import annotations

import logging
from typing import Sequence

from torch import Tensor

from ..switches import FUSED_REDUCE_BACKEND as ENV
from ..switches import value as _switch_value
from . import builder, reference

logger = logging.getLogger(__name__)

MODES = ("auto", "ext", "ref")

_impl = None
_backend: str | None = None


def _select():
    """Pick the implementation according to $DSM_FUSED_REDUCE, log the choice once."""
    global _impl, _backend
    mode = _switch_value(ENV, "auto").lower()
    if mode not in MODES:
        raise ValueError(f"{ENV}={mode!r} is not a valid mode; expected one of {', '.join(MODES)}")
    if mode == "ref":
        impl, backend, why = reference, "ref", f"{ENV}=ref"
    else:
        try:
            impl, backend, why = builder.load(), "ext", f"{ENV}={mode}, extension built"
        except builder.BuildError as exc:
            if mode == "ext":
                raise
            impl, backend, why = reference, "ref", f"{ENV}=auto and the extension is unavailable: {exc}"
    logger.info("deepspeed_multi fused_reduce: using the %s backend (%s)", backend, why)
    _impl, _backend = impl, backend
    return impl


def active_backend() -> str:
    """'ext' (compiled extension) or 'ref' (pure PyTorch); selects the backend if not done yet."""
    if _backend is None:
        _select()
    return _backend


def pack(tensors: Sequence[Tensor], out: Tensor, scale: float) -> Tensor:
    """Flatten ``tensors`` into ``out`` scaled by ``scale``; return the non-finite flag."""
    return (_impl or _select()).pack(tensors, out, scale)


def unpack_accumulate(src: Tensor, outs: Sequence[Tensor], scale: float, accumulate: bool) -> Tensor:
    """Scatter ``src`` into ``outs`` scaled by ``scale`` (assign or add); return the flag."""
    return (_impl or _select()).unpack_accumulate(src, outs, scale, accumulate)


def pack_partitions(tensors: Sequence[Tensor], out: Tensor, world: int, scale: float) -> Tensor:
    """Write the rank-interleaved chunks of ``tensors`` into ``out`` scaled by ``scale``; return the flag."""
    return (_impl or _select()).pack_partitions(tensors, out, world, scale)


def _reset_for_tests() -> None:
    """Forget the selected backend so that the next call reads $DSM_FUSED_REDUCE again."""
    global _impl, _backend
    _impl, _backend = None, None
