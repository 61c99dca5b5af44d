"""Pure-PyTorch reference of the fused gradient-bucket ops.

Same signatures, semantics, argument checks (ValueError naming the offending tensor) and
rounding as the C++/CUDA extension: every value is loaded, converted to float32, multiplied
by ``scale`` in float32 (and, when accumulating, added to the float32 value of the output),
then cast once to the output dtype. It is the fallback when the extension cannot be built and
the oracle of the tests. See :mod:`deepspeed_multi.ops.fused_reduce` for the API contract.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

SUPPORTED = (torch.float32, torch.bfloat16, torch.float16)


def _describe(name: str, t: Tensor) -> str:
    return f"{name} (shape {list(t.shape)}, dtype {t.dtype}, device {t.device})"


def _check_dtype(op: str, name: str, t: Tensor) -> None:
    if t.dtype not in SUPPORTED:
        raise ValueError(
            f"{op}: {_describe(name, t)} has an unsupported dtype; expected torch.float32, "
            f"torch.bfloat16 or torch.float16; cast it first (e.g. t.float())"
        )


def _check_device(op: str, name: str, t: Tensor, ref_name: str, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(
            f"{op}: {_describe(name, t)} is on {t.device} but {ref_name} is on {device}; "
            f"move all tensors to one device first"
        )


def _check_flat(op: str, name: str, t: Tensor) -> None:
    if t.dim() != 1 or not t.is_contiguous():
        raise ValueError(
            f"{op}: {_describe(name, t)} must be a 1-D contiguous tensor; pass a flat buffer "
            f"(e.g. buf.view(-1) of a contiguous tensor)"
        )
    _check_dtype(op, name, t)


def _check_fits(op: str, name: str, t: Tensor, offset: int, buf: str, capacity: int) -> None:
    if offset + t.numel() > capacity:
        raise ValueError(
            f"{op}: {_describe(name, t)} needs {buf} elements [{offset}, {offset + t.numel()}) but "
            f"{buf} has {capacity}; pass a {buf} with at least the total numel of all tensors"
        )


def _check_parts(op: str, label: str, tensors: Sequence[Tensor], buf: str, flat: Tensor, written: bool) -> int:
    """Check each of ``tensors`` against the flat buffer ``flat`` they are packed into or unpacked
    from (dtype, device, room; contiguity where they are ``written`` in place); return their numel."""
    offset = 0
    for i, t in enumerate(tensors):
        name = f"{label}[{i}]"
        _check_dtype(op, name, t)
        _check_device(op, name, t, buf, flat.device)
        if written and not t.is_contiguous():
            raise ValueError(
                f"{op}: {_describe(name, t)} is not contiguous (strides {list(t.stride())}); it is "
                f"written in place, so pass a contiguous tensor (e.g. make the gradient partition "
                f"contiguous, or unpack into a contiguous buffer and copy_ it back)"
            )
        _check_fits(op, name, t, offset, buf, flat.numel())
        offset += t.numel()
    return offset


def _nonfinite_flag(tensors: Sequence[Tensor], device: torch.device) -> Tensor:
    """0-dim float32: 1.0 if any element of ``tensors`` is inf/nan (max-abs propagates both)."""
    tensors = [t for t in tensors if t.numel() > 0]
    if not tensors:
        return torch.zeros((), dtype=torch.float32, device=device)
    amax = torch.stack(torch._foreach_norm(tensors, ord=float("inf"))).float()
    return (~torch.isfinite(amax)).any().float()


def pack(tensors: Sequence[Tensor], out: Tensor, scale: float) -> Tensor:
    """Reference of :func:`deepspeed_multi.ops.pack`."""
    op = "pack"
    _check_flat(op, "out", out)
    offset = _check_parts(op, "tensors", tensors, "out", out, written=False)
    flat_out = out[:offset]
    if offset == 0:
        return _nonfinite_flag([], out.device)
    views = list(flat_out.split([t.numel() for t in tensors]))
    scaled = torch._foreach_mul([t.reshape(-1).float() for t in tensors], scale)
    torch._foreach_copy_(views, scaled)
    return _nonfinite_flag([flat_out], out.device)


def unpack_accumulate(src: Tensor, outs: Sequence[Tensor], scale: float, accumulate: bool) -> Tensor:
    """Reference of :func:`deepspeed_multi.ops.unpack_accumulate`."""
    op = "unpack_accumulate"
    _check_flat(op, "src", src)
    offset = _check_parts(op, "outs", outs, "src", src, written=True)
    outs = [t for t in outs if t.numel() > 0]
    if not outs:
        return _nonfinite_flag([], src.device)
    slices = src[:offset].split([t.numel() for t in outs])
    scaled = torch._foreach_mul([s.view_as(t).float() for s, t in zip(slices, outs)], scale)
    if accumulate:
        # Add in float32, then cast once: a float32 out is updated in place; a half out is
        # computed as out.float() + scaled and copied back.
        fp32 = [t for t in outs if t.dtype == torch.float32]
        if len(fp32) == len(outs):
            torch._foreach_add_(outs, scaled)
        else:
            scaled = torch._foreach_add([t.float() for t in outs], scaled)
            torch._foreach_copy_(outs, scaled)
    else:
        torch._foreach_copy_(outs, scaled)
    return _nonfinite_flag(outs, src.device)


def pack_partitions(tensors: Sequence[Tensor], out: Tensor, world: int, scale: float) -> Tensor:
    """Reference of :func:`deepspeed_multi.ops.pack_partitions`."""
    op = "pack_partitions"
    _check_flat(op, "out", out)
    if world < 1:
        raise ValueError(f"{op}: world must be >= 1 (the number of ranks the tensors are partitioned over), "
                         f"got {world}")
    chunks = [-(-t.numel() // world) for t in tensors]
    block = sum(chunks)
    if block * world > out.numel():
        raise ValueError(f"{op}: {_describe('out', out)} has {out.numel()} elements but world * "
                         f"sum(ceil(numel / world)) = {block * world} are needed; allocate out with that many "
                         "elements")
    srcs, dsts = [], []
    for i, t in enumerate(tensors):
        _check_dtype(op, f"tensors[{i}]", t)
        _check_device(op, f"tensors[{i}]", t, "out", out.device)
    for r in range(world):
        offset = r * block
        for t, c in zip(tensors, chunks):
            part = t.reshape(-1)[r * c:r * c + c]
            if part.numel():
                srcs.append(part)
                dsts.append(out[offset:offset + part.numel()])
            offset += c
    if not srcs:
        return _nonfinite_flag([], out.device)
    scaled = torch._foreach_mul([s.float() for s in srcs], scale)
    torch._foreach_copy_(dsts, scaled)
    return _nonfinite_flag(dsts, out.device)
