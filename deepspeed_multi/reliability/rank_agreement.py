"""ZeRO-0/1: every rank must have run as many backward passes through an engine as the others.

[Note: the rank-agreement check, off the critical path]
ZeRO-0/1 reduce gradients at the update, so a backward pass that reached an engine on some ranks
only is not caught during backward: at ``step()`` a rank that accumulated nothing would take the
no-gradient path (no collectives) while the others enter the gradient reduction and wait for it
forever. Every rank therefore compares its backward count with the others' before its first
gradient collective, and all of them refuse the step together.

The comparison is one all-reduce of two int64. Run synchronously at the top of ``step()`` it is
one more synchronization point per update, which costs far more than its bytes (measured in
docs/design.md, Decisions; ``overhead.py --rank-agreement``). So :meth:`RankAgreement.start` launches it
asynchronously when ``step()`` begins, and :meth:`RankAgreement.finish` waits for it as late as
is safe: where the rank has nothing accumulated, at once (it must decide its path together with
the others); otherwise right before the first gradient collective, after the rank-local work of
the reduction (DeepSpeed's per-parameter loop and our bucket pack, ``zero2_pack``), which hides
the wait. A disagreement raises on every rank before any gradient collective, as before.

The comparison also carries the engine's serial number (engines are built in the same order on
every rank): a rank that skipped engine A and went on to engine B's update pairs B's comparison
with A's on the other ranks (the tensors have one size), which would otherwise pass and let A's
and B's gradient reductions meet, which gloo aborts on (mismatched sizes) and NCCL mixes. The
serials differ, so every rank raises, naming both engines.
"""
from __future__ import annotations

import itertools
import weakref

import deepspeed.comm as dist
import torch


_SERIALS = itertools.count()
_NAMES = weakref.WeakValueDictionary()  # serial -> engine, for naming the other rank's engine


class RankAgreement:
    """One engine's pending comparison of per-window backward counts across ranks."""

    def __init__(self, engine):
        self._engine = engine
        self._work = None
        self._counts = None
        self._mine = 0
        self._serial = next(_SERIALS)
        _NAMES[self._serial] = engine

    def start(self, backwards: int) -> None:
        """Launch the comparison of ``backwards`` (this rank's count for the window) across ranks."""
        self._mine = backwards
        self._counts = torch.tensor([backwards, -backwards, self._serial, -self._serial], dtype=torch.int64,
                                    device=self._engine.device)
        self._work = dist.all_reduce(self._counts, op=dist.ReduceOp.MAX, async_op=True)

    def finish(self) -> None:
        """Wait for the comparison started by :meth:`start` (no-op if none); raise if ranks disagree."""
        work, self._work = self._work, None
        if work is None:
            return
        work.wait()
        high, low, top, bottom = self._counts[0].item(), -self._counts[1].item(), self._counts[2].item(), \
            -self._counts[3].item()
        if top != bottom:
            other = top if top != self._serial else bottom
            engine = _NAMES.get(other)
            name = engine._engine_name() if engine is not None else "?"
            raise RuntimeError(
                f"MultiEngine ({self._engine._engine_name()}, engine #{self._serial}): the ranks are not in the same "
                f"engine's update: this rank is in this engine's step(), another in engine #{other}'s ({name}). A "
                "rank skipped an engine's backward and step() that the others ran; every rank must call each "
                "engine, use its outputs in the loss it backpropagates (multiply by 0 to keep an output in the "
                "graph on ranks that do not need it), and call step() on every rank.")
        if high != low:
            raise RuntimeError(
                f"MultiEngine ({self._engine._engine_name()}): ranks disagree on how many backward passes reached "
                f"this engine since its last update (between {low} and {high}; this rank: {self._mine}). Every "
                "rank must use the engine's outputs in the loss it backpropagates (multiply by 0 to keep an "
                "output in the graph on ranks that do not need it).")

    def discard(self) -> None:
        """Forget a pending comparison (the step raised): wait for it so that no collective is left open."""
        work, self._work = self._work, None
        if work is not None:
            work.wait()
