"""ZeRO-1/2/3 with CPU offload: a parameter without a gradient in a window gets none at the update.

[Note: stale offloaded gradients]
With ``offload_optimizer``, DeepSpeed keeps the update's fp32 gradient partition in CPU buffers
allocated once and reused: one per group at ZeRO-1/2 (``single_partition_of_fp32_groups[i].grad``,
plus one per parameter for accumulation, ``accumulated_grads_in_cpu``), one per sub-group at
ZeRO-3 (``fp32_partitioned_groups_flat[i].grad``). At the boundary it copies in the gradient of
each parameter that got one this window; a parameter that got none (a branch not taken, a
submodule used on some steps only) keeps whatever its slot held: the gradient of the last window
that reached it. The update then applies that stale gradient again, where PyTorch (and DeepSpeed
without offload) applies none. Upstream too (0.19.8: one ZeRO-2 engine, an input submodule used
on odd steps only, error 6.3e-2 against plain PyTorch; found by the fuzzer's offload draws, seeds
800183, 800190, 800388 at ZeRO-1/2, 810098 at ZeRO-3).

After DeepSpeed's end-of-step buffer reset (``reset_cpu_buffers``, run by a completed and by an
overflow-skipped ``step()`` alike, at ZeRO-1/2 after it has waited for the pending copies), the
buffers are zeroed, so the next window starts from zeros as the non-offload path does. Buffers
swapped out to NVMe are not DeepSpeed's reused CPU buffers and are left alone. A slot that gets a
gradient is overwritten by DeepSpeed's copy as before: results are DeepSpeed's bits wherever
DeepSpeed is right. A correctness fix, installed on every supported release.

[Note: offloaded ZeRO-3 gradients read between backward and step]
At ZeRO-3 with ``offload_optimizer`` the copy into the CPU buffers is the boundary's work
(``finalize_gradient_accumulation_boundary``): DeepSpeed's managed accumulation runs it in the
last backward of a window, so ``safe_get_local_grad``/``safe_set_local_grad`` (and their full
versions) and ``_get_norm_groups`` called between that backward and ``step()`` see the window's
gradients. MultiEngine runs it in ``step()``, so they read the previous window's (zeros: see the
Note above) and a write is overwritten by the copy. Here each of them first runs the pending
boundary copy (once per window: ``step()`` skips it then), and a backward after it makes the copy
pending again (its gradients accumulate in the device partitions the copy reads).
"""
from __future__ import annotations

from .. import compat

FEATURE = "offload_grads"
_RESET = "reset_cpu_buffers"


def reset_cpu_buffers_zero12(self):
    """DeepSpeed's reset, then ZeRO-1/2's offloaded gradient buffers zeroed (see the Note)."""
    compat.original(self, _RESET)()
    _zero_grads(self.single_partition_of_fp32_groups)
    for buffer in self.accumulated_grads_in_cpu.values():
        buffer.zero_()


def reset_cpu_buffers_zero3(self):
    """DeepSpeed's reset, then ZeRO-3's offloaded gradient buffers zeroed (see the Note)."""
    compat.original(self, _RESET)()
    _zero_grads(self.fp32_partitioned_groups_flat)


def _zero_grads(flat_groups):
    for group in flat_groups:
        if group.grad is not None:  # None: swapped out to NVMe
            group.grad.zero_()


def _replacement(optimizer):
    """The reset for ``optimizer``'s stage when it offloads its optimizer states, else None."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    if isinstance(optimizer, DeepSpeedZeroOptimizer) and optimizer.cpu_offload:
        return reset_cpu_buffers_zero12
    if isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3) and optimizer.offload_optimizer:
        return reset_cpu_buffers_zero3
    return None


# ZeRO-3 methods that read or write the offloaded gradient buffers (second Note).
_READERS = ("get_local_fp32_grad_for_param", "set_local_grad_for_param", "get_fp32_grad_for_param",
            "set_fp32_grad_for_param", "_get_norm_groups")
_FINALIZE = "finalize_gradient_accumulation_boundary"


def _mark_pending(optimizer) -> None:
    compat.state(optimizer, FEATURE)["pending"] = True


def _finalize_once(self):
    """The boundary copy into the CPU buffers, unless it ran since the last backward (second Note)."""
    state = compat.state(self, FEATURE)
    if state.get("pending", True):
        state["pending"] = False
        return compat.original(self, _FINALIZE)()
    # The copy ran already; the rest of DeepSpeed's finalize still applies: it marks the boundary for
    # the readers step() calls (the same first statement as the original's).
    self.set_gradient_accumulation_boundary(True)


def _after_boundary_copy(name):

    def read_after_copy(self, *args, **kwargs):
        if compat.state(self, FEATURE).get("pending"):
            _finalize_once(self)
        return compat.original(self, name)(*args, **kwargs)

    read_after_copy.__name__ = name
    return read_after_copy


def install(optimizer) -> bool:
    """Zero the offloaded gradient buffers after every step, and at ZeRO-3 run the boundary copy
    before a gradient read (see the Notes); return whether needed."""
    replacement = _replacement(optimizer)
    if replacement is None:
        return False
    compat.replace_method(optimizer, _RESET, replacement, FEATURE)
    if replacement is reset_cpu_buffers_zero3:
        compat.state(optimizer, FEATURE, {"pending": False})
        compat.replace_method(optimizer, _FINALIZE, _finalize_once, FEATURE)
        for name in _READERS:
            compat.replace_method(optimizer, name, _after_boundary_copy(name), FEATURE)
        compat.run_before(optimizer, "backward_prologue", _mark_pending, FEATURE)
    return True
