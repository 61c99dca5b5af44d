"""Runs of tensors that lie one after another in one storage: where a flatten needs no copy.

The fused bucket passes and the gradient views of the update (stage12/, stage3/) ask these
whether a list of gradient views is one run, and take a 1-D view over it instead of a copy.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from torch import Tensor

from ..ops.reference import SUPPORTED as SUPPORTED_DTYPES  # what the fused ops take


def consecutive_runs(tensors: Sequence[Tensor]) -> Optional[List[Tuple[int, int]]]:
    """Split ``tensors`` into maximal runs of views that follow each other in one storage.

    Returns ``[(start, stop), ...]`` (index ranges into ``tensors``) such that within a run
    every tensor is contiguous, has the run's dtype, device and untyped storage, and begins
    exactly where the previous one ends; or ``None`` if some tensor can never be part of a flat
    source (non-contiguous, or of a dtype the fused ops do not take). Empty tensors join the
    current run (they occupy no memory).
    """
    runs: List[Tuple[int, int]] = []
    start = 0
    prev = None  # (dtype, device, storage ptr, end data_ptr) of the current run
    for i, t in enumerate(tensors):
        if t.dtype not in SUPPORTED_DTYPES or not t.is_contiguous():
            return None
        if t.numel() == 0 and prev is not None:
            continue
        key = (t.dtype, t.device, t.untyped_storage().data_ptr())
        if prev is None or prev[:3] != key or prev[3] != t.data_ptr():
            if i > start:
                runs.append((start, i))
            start = i
        prev = key + (t.data_ptr() + t.numel() * t.element_size(), )
    if len(tensors) > start:
        runs.append((start, len(tensors)))
    return runs


def flat_run(tensors: Sequence[Tensor]) -> Tensor:
    """One 1-D view over ``tensors``, which :func:`consecutive_runs` put into one run."""
    first = next((t for t in tensors if t.numel() > 0), tensors[0])
    total = sum(t.numel() for t in tensors)
    return first.as_strided((total, ), (1, ), first.storage_offset())


def one_run(tensors: Sequence[Tensor]) -> Optional[Tensor]:
    """A 1-D view covering ``tensors`` if they are one run (:func:`consecutive_runs`), else ``None``
    (also when every one is empty): what a flatten of them would hold, without the copy."""
    filled = [t for t in tensors if t.numel() > 0]  # an empty tensor adds nothing to a flatten either
    if not filled or consecutive_runs(filled) != [(0, len(filled))]:
        return None
    return flat_run(filled)


def scales_exactly(world: int) -> bool:
    """Whether ``x * (1 / world)`` rounds as ``x / world``: ``1 / world`` is a power of two. The
    ZeRO-3 flushes multiply where it does and divide elsewhere, so each element is rounded as
    DeepSpeed's division rounds it."""
    return world & (world - 1) == 0


def run_view(tensors: Sequence[Tensor], numel: int) -> Optional[Tensor]:
    """:func:`one_run`, if it holds ``numel`` elements in all, else ``None``."""
    view = one_run(tensors)
    return view if view is not None and view.numel() == numel else None
