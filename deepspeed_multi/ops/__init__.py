"""Fused gradient-reduction ops for the ZeRO bucket path.

``pack``/``pack_partitions``/``unpack_accumulate`` and the backend switch are documented in
:mod:`deepspeed_multi.ops.fused_reduce`; the JIT loader is :mod:`deepspeed_multi.ops.builder`
(prebuild with ``python -m deepspeed_multi.ops.build``); the pure-PyTorch oracle is
:mod:`deepspeed_multi.ops.reference`.
"""
from .fused_reduce import active_backend, pack, pack_partitions, unpack_accumulate

__all__ = ["pack", "pack_partitions", "unpack_accumulate", "active_backend"]
