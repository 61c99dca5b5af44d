"""Which rank meetings can be skipped: those at a region the group's recent regions predict.

[Note: a meeting only where the sequence departs from its past]
A meeting (watchdog.py, [Note: ranks meet before an engine's collectives]) is a barrier, and a
barrier costs more than its messages: the first rank can no longer start the region's first
collective, and push its data, while the last one is still computing (2-3% of a ZeRO-3 step on 2
CPU ranks, whatever the meeting place or way of waiting; benchmarks/PERFORMANCE.md). A training
loop enters the same regions in the same order step after step, and a meeting that only confirms
that order buys nothing. So each group of ranks keeps the sequence of the regions with collectives
it entered (engine, region) and, for every run of its last ``WINDOW`` regions, the region that came
next the last time that run occurred. Entering the region that the run predicts, a rank skips the
meeting; entering any other, it meets.

Why that is still safe: every rank of the group has entered the same regions in the same order up to
the first rank that goes elsewhere (the group's collectives are matched in order, so it must), so
at that point all ranks hold the same table and the same recent run, and make the same prediction.
The rank that goes elsewhere enters a region other than the predicted one, so it meets, and waits
there, inside its marked region: it issues no collective. The ranks that entered the predicted
region skip the meeting and wait in its first collective, which nobody else joins. Nothing pairs
two different regions' collectives, and the watchdog ends every rank naming both regions, as
before. Two ranks that both go elsewhere both meet, in different rows. A sequence that changes on
every rank alike (an engine every rank skips this step, a new engine, a longer accumulation
window) misses the prediction on every rank, and they all meet, as they did before.

A rank can also leave the path for a collective of no engine's region; those issued through
``deepspeed.comm`` are entries too (outside.py). What a skipped meeting no longer covers: a rank
whose partner runs a collective of its own through ``torch.distributed`` directly instead of the
predicted region pairs that collective with the region's first one, as it would without meetings.
A user collective must be reached by every rank.

``WINDOW`` covers the period of a training loop that steps several engines with gradient
accumulation (each micro-step's forward and backward of each engine is one entry or two); a
longer period only makes the ranks meet where the window cannot tell two places apart. The table
is bounded: past ``CAPACITY`` runs it starts again, on every rank at the same entry.
"""
from __future__ import annotations

import hashlib

WINDOW = 16
CAPACITY = 4096


class RegionSequence:
    """One group's regions with collectives, in the order entered, and what followed each recent run."""

    def __init__(self, window: int = WINDOW, capacity: int = CAPACITY):
        self.window, self.capacity = window, capacity
        self.recent = ()
        self.next_of = {}

    def expected(self):
        """The entry the recent run predicts next, or None where it has not been seen."""
        return self.next_of.get(self.recent)

    def predicted(self, region) -> bool:
        """Record that this rank entered ``region``; return whether its recent regions predicted it."""
        recent = self.recent
        hit = self.next_of.get(recent) == region
        if not hit:
            if len(self.next_of) >= self.capacity:
                self.next_of.clear()
            self.next_of[recent] = region
        self.recent = (recent + (region, ))[-self.window:]
        return hit


def group_key(ranks) -> str:
    """A short name of a group of ranks for store keys (two groups may share their first rank)."""
    return hashlib.sha1(",".join(map(str, ranks)).encode()).hexdigest()[:12]
