"""ZeRO-1/2, bf16/fp16: the gradient norm's all-reduce also decides overflow; the flag's is not run.

[Note: one collective for the overflow flag and the norm]
Before every 16-bit update ``DeepSpeedZeroOptimizer.step`` runs two small collectives over the
data-parallel group, one after the other:

1. ``check_overflow``: an inf/nan test of this rank's gradient partition, all-reduced (MAX) into
   ``self.overflow`` and read back on the host;
2. unless that set ``self.overflow``, ``scaled_global_norm``: the partition's squared norm
   (``get_grad_norm_direct``, per tensor in fp64), all-reduced (SUM); ``step()`` then sets
   ``self.overflow`` itself when the norm is not finite (``is_invalid_grad_norm``).

With ``compute_grad_norm`` on, the second verdict contains the first. An inf or nan anywhere in a
rank's partition makes that tensor's norm, and so the rank's sum, inf or nan; the all-reduced sum
is then non-finite on every rank, and step() skips the update. (The converse was already
DeepSpeed's: finite gradients whose norm overflows fp32 skip the update through 2.) So the flag's
collective decides nothing that the norm's does not, and inside ``step()``
:func:`check_overflow_by_norm` leaves ``self.overflow`` False and lets the norm decide. The
updates, skipped steps, loss-scale changes and the norm itself are DeepSpeed's, computed by
DeepSpeed's code; what goes is one collective, one host synchronization and the local inf/nan
pass per update (why: docs/design.md, Decisions; ``overhead.py --overflow-by-norm``).

Installed only where the containment holds as stated: ``check_grad_overflow`` and
``compute_grad_norm`` on (read at every call), no CPU offload (its norm and flag are computed
elsewhere), no MoE (expert norms are averaged separately), no model parallelism and no
pipeline-replicated parameters (the norm skips some gradients that the flag tests), no Muon group
scaled back (``groups_lacking_loss_scale``, read at every call), and DeepSpeed's own ``step``,
``check_overflow``, ``has_overflow``, ``scaled_global_norm`` and ``get_grad_norm_direct``.
Only ``step()``'s own call is answered this way; any other caller of ``check_overflow`` gets
DeepSpeed's. ``DSM_ZERO12_OVERFLOW_BY_NORM=0`` keeps both collectives (for A/B benchmarks).
"""
from __future__ import annotations

from ... import compat
from ...switches import ZERO12_OVERFLOW_BY_NORM as ENV
from ...switches import switch_on

FEATURE = "stage12_overflow"


def norm_decides(optimizer) -> bool:
    """Whether this update's norm, which step() is about to compute, settles overflow by itself."""
    return (optimizer.compute_grad_norm and optimizer.check_grad_overflow
            and not getattr(optimizer, "groups_lacking_loss_scale", None))


def step_marking_norm_decides(self, *args, **kwargs):
    """Replacement for ``step``: DeepSpeed's, with :func:`check_overflow_by_norm` answering its check."""
    state = compat.state(self, FEATURE)
    state["in_step"] = True
    try:
        return compat.original(self, "step")(*args, **kwargs)
    finally:
        state["in_step"] = False


def check_overflow_by_norm(self, partition_gradients=True):
    """Replacement for ``check_overflow``: inside step(), where the norm decides, no collective."""
    state = compat.state(self, FEATURE)
    if state["in_step"] and norm_decides(self):
        self.overflow = False  # step() sets it from the norm (see the Note above)
        state["deferred"] += 1
        return
    compat.original(self, "check_overflow")(partition_gradients)


def applies(optimizer) -> bool:
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    if not isinstance(optimizer, DeepSpeedZeroOptimizer):
        return False
    params = (p for group in optimizer.bit16_groups for p in group)
    if (getattr(optimizer, "cpu_offload", True) or getattr(optimizer, "has_moe_layers", True)
            or any(getattr(p, "ds_pipe_replicated", False) for p in params)
            or not compat.fast_path_exact(optimizer, FEATURE)):
        return False
    from deepspeed.comm import pg_utils  # reached only on the DeepSpeed whose step() was checked
    return not pg_utils.is_parallel(getattr(optimizer, "model_parallel_group", None))


def install(optimizer) -> bool:
    """Let ``optimizer``'s gradient norm decide overflow inside step(); return whether it did."""
    if not switch_on(ENV) or not applies(optimizer):
        return False
    compat.state(optimizer, FEATURE, {"in_step": False, "deferred": 0})
    compat.replace_method(optimizer, "step", step_marking_norm_decides, FEATURE)
    compat.replace_method(optimizer, "check_overflow", check_overflow_by_norm, FEATURE)
    return True
