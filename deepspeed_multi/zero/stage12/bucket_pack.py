"""ZeRO-1/2: gradients enter the reduction bucket in one fused pack per flush, not one copy each.

[Note: deferring the copy into the bucket]
DeepSpeed's per-parameter hook, ``DeepSpeedZeroOptimizer.reduce_independent_p_g_buckets_and_
remove_grads``, copies each parameter's gradient into the IPG bucket at the bucket's fill
offset and points the gradient at that slice (``grad.data = slice.view_as(grad)``): one copy,
one narrow and one view per parameter, in Python, during backward. :func:`reserve` keeps the
hook's bookkeeping exactly (the bucket-full flush, ``bucket.elements``, ``bucket.params``,
``bucket.grads``, the MoE flag, the "reduced twice" assertion) but only *reserves* the slice
and remembers ``(grad, offset)``. The copies run as one :func:`deepspeed_multi.ops.pack` per
bucket, with the gradients re-pointed at their slices from one ``split``, right before the
bucket is consumed: ``reduce_ipg_grads`` (bucket full, or the backward epilogue) is wrapped to
pack first, and nothing else reads the bucket or those gradients in between. A copy is a copy,
so the reduced values are bit-identical to DeepSpeed's path (asserted in tests/unit and the
multi-process tests against fused off).

ZeRO-1 reaches the same method once per parameter at the update (``reduce_gradients``, the
boundary's loop over every parameter, instead of the hooks during backward), so the same pack
applies there. Applies at ZeRO-1 and ZeRO-2 with ``contiguous_gradients``, without CPU offload
(its stream/event bookkeeping), ZenFlow or AutoEP folding, and only where DeepSpeed's methods
are not overridden. Per call, a parameter larger than the bucket or not yet ready
(``ds_grad_is_ready``) or without a gradient packs what is pending and runs DeepSpeed's method.
With ``overlap_comm`` on an accelerator whose streams must be ordered, the pack's stream is
recorded as the bucket's producer, as DeepSpeed records each copy's.
"""
from __future__ import annotations

from ... import compat, ops

FEATURE = "stage12_bucket_pack"


class _Pending:
    """Reserved, not yet copied slices of one bucket buffer: grads in offset order."""
    __slots__ = ("bucket", "index", "start", "grads", "numels")

    def __init__(self, bucket, index, start):
        self.bucket, self.index, self.start = bucket, index, start
        self.grads, self.numels = [], []


def pack_pending(optimizer) -> None:
    """Copy every reserved gradient into its bucket slice (one pack per bucket buffer)."""
    state = compat.state(optimizer, FEATURE)
    pending = state["pending"]
    if not pending:
        return
    state["pending"] = {}
    for p in pending.values():
        total = sum(p.numels)
        dst = p.bucket.buffer[p.index].narrow(0, p.start, total)
        ops.pack(p.grads, dst, 1.0)
        for grad, view in zip(p.grads, dst.split(p.numels)):
            grad.data = view.view_as(grad)
        if state["record_stream"]:
            from deepspeed.accelerator import get_accelerator
            p.bucket.copy_streams.add(get_accelerator().current_stream())


def drop_pending(optimizer) -> None:
    """Forget reserved slices that will never be packed (a backward that raised part way).

    Their buckets are cleared by :func:`deepspeed_multi.zero.buffers.abort_backward`; a reservation
    kept past that would pack a dead gradient at a stale offset in the next backward.
    """
    if compat.installed(optimizer, FEATURE):
        compat.state(optimizer, FEATURE)["pending"] = {}


def reserve(self, param, i):
    """Replacement of ``reduce_independent_p_g_buckets_and_remove_grads`` (see the Note)."""
    numel = param.numel()
    if numel == 0:
        return
    state = compat.state(self, FEATURE)
    grad = self.get_gradient_for_reduction(param)
    if numel > self.reduce_bucket_size or grad is None or not getattr(param, "ds_grad_is_ready", True):
        pack_pending(self)
        return compat.original(self, "reduce_independent_p_g_buckets_and_remove_grads")(param, i)
    comm_dtype = self.get_param_comm_dtype(param)
    bucket = self.ipg_buckets[comm_dtype]
    if bucket.elements + numel > self.reduce_bucket_size:
        self.reduce_ipg_grads(comm_dtype=comm_dtype)  # packs first: see install()
        if self.overlap_comm:
            bucket.index = 1 - bucket.index
    param_id = self.get_param_id(param)
    assert not self.params_already_reduced[param_id], (
        f"The parameter {param_id} has already been reduced. Gradient computed twice for this partition. "
        "Multiple gradient reductions are currently not supported")
    pending = state["pending"].get(comm_dtype)
    if pending is None or pending.index != bucket.index:
        pending = state["pending"][comm_dtype] = _Pending(bucket, bucket.index, bucket.elements)
    pending.grads.append(grad)
    pending.numels.append(numel)
    bucket.elements += numel
    bucket.grads.append(grad)
    bucket.params.append((i, param.param_idx_in_group, param_id))
    if state["is_moe"](param):
        bucket.has_moe_params = True


def reduce_ipg_grads(self, *args, **kwargs):
    """Replacement of ``reduce_ipg_grads``: pack what is reserved, then DeepSpeed's flush."""
    pack_pending(self)
    state = compat.state(self, FEATURE)
    if state["before_reduction"] is not None:
        state["before_reduction"]()
    return compat.original(self, "reduce_ipg_grads")(*args, **kwargs)


def run_before_reduction(optimizer, fn) -> bool:
    """Call ``fn()`` after each pack, right before the bucket's collective; False if not installed.

    The engine's rank-agreement wait goes here, so that the rank-local pass before it (DeepSpeed's
    per-parameter loop and the pack) hides its latency (see rank_agreement.py).
    """
    if not compat.installed(optimizer, FEATURE):
        return False
    compat.state(optimizer, FEATURE)["before_reduction"] = fn
    return True


def applies(optimizer) -> bool:
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    if not isinstance(optimizer, DeepSpeedZeroOptimizer):
        return False
    return (compat.fast_path_exact(optimizer, FEATURE) and getattr(optimizer, "contiguous_gradients", False) and not getattr(optimizer, "cpu_offload", True)
            and not getattr(optimizer, "zenflow", False) and getattr(optimizer, "autoep_folding_tp_group", None) is None
            and not getattr(optimizer, "_offload_gradient_safety_enabled", True) and hasattr(optimizer, "ipg_buckets"))


def install(optimizer) -> bool:
    """Defer ``optimizer``'s per-parameter bucket copies to one pack per flush; return whether it did."""
    if not applies(optimizer):
        return False
    from deepspeed.accelerator import get_accelerator
    from deepspeed.moe.utils import is_moe_param
    compat.state(optimizer, FEATURE, {
        "pending": {},
        "record_stream": optimizer.overlap_comm and not get_accelerator().resolves_data_dependency(),
        "is_moe": is_moe_param,
        "before_reduction": None,
    })
    compat.replace_method(optimizer, "reduce_independent_p_g_buckets_and_remove_grads", reserve, FEATURE)
    compat.replace_method(optimizer, "reduce_ipg_grads", reduce_ipg_grads, FEATURE)
    return True
