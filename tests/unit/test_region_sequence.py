"""The prediction that lets ranks skip a meeting (deepspeed_multi/reliability/region_sequence.py).

Safety rests on one property: ranks with the same past make the same prediction, so where two ranks
enter different regions, at most one of them finds its region predicted and the other meets. The
multi-process side (the rank that meets waits, the other waits in its collective, the watchdog names
both) is tests/multi_gpu/test_watchdog.py.
"""
from hypothesis import given, settings
from hypothesis import strategies as st

from deepspeed_multi.reliability.region_sequence import WINDOW, RegionSequence

# A region: (engine index, what). Few engines, so that sequences repeat and predictions happen.
regions = st.tuples(st.integers(0, 3), st.sampled_from(["forward", "backward", "step"]))


def _decisions(sequence, entries):
    return [sequence.predicted(r) for r in entries]


@settings(max_examples=300, deadline=None)
@given(past=st.lists(regions, max_size=120), mine=regions, theirs=regions, capacity=st.integers(1, 64))
def test_where_two_ranks_part_at_most_one_skips_its_meeting(past, mine, theirs, capacity):
    a, b = RegionSequence(capacity=capacity), RegionSequence(capacity=capacity)
    assert _decisions(a, past) == _decisions(b, past)  # the same past: the same meetings held and skipped
    skipped = a.predicted(mine), b.predicted(theirs)
    if mine != theirs:
        assert not all(skipped), "two ranks in different regions both skipped their meeting"
    else:
        assert skipped[0] == skipped[1]


@settings(max_examples=300, deadline=None)
@given(past=st.lists(regions, max_size=120), outside=st.sampled_from(["all_reduce", "barrier"]), theirs=regions)
def test_a_collective_outside_the_engines_runs_at_once_only_where_no_partner_can_skip(past, outside, theirs):
    """outside.py: a rank runs a collective of no engine's region without meeting where its sequence
    predicts nothing or predicts that collective; a partner with the same past that enters an engine
    region there instead must then meet."""
    a, b = RegionSequence(), RegionSequence()
    _decisions(a, past)
    _decisions(b, past)
    expected = a.expected()
    a.predicted(("outside", outside))
    if expected is None or expected == ("outside", outside):
        assert not b.predicted(theirs)


@settings(max_examples=100, deadline=None)
@given(period=st.lists(regions, min_size=1, max_size=WINDOW, unique=True), repeats=st.integers(3, 6))
def test_a_loop_stops_meeting_once_its_regions_repeat(period, repeats):
    seq = RegionSequence()
    decisions = _decisions(seq, period * repeats)
    learned = WINDOW + len(period)  # one full window of history, then one period to learn what follows
    assert all(decisions[learned:]), decisions
    assert not any(decisions[:len(period)])  # nothing is predicted before anything has repeated


def test_a_changed_step_meets_on_every_rank_then_is_learned():
    loop = [(0, "forward"), (0, "backward"), (0, "step")]
    ranks = [RegionSequence(), RegionSequence()]
    for seq in ranks:
        _decisions(seq, loop * 10)
    extra = [(1, "forward"), (1, "backward"), (1, "step")]  # every rank adds an engine this step
    assert [_decisions(seq, extra[:1]) for seq in ranks] == [[False], [False]]


def test_the_table_is_bounded():
    seq = RegionSequence(capacity=8)
    for i in range(100):
        seq.predicted((i, "forward"))
    assert len(seq.next_of) <= 8


def test_the_group_argument_is_found_through_deepspeeds_decorators():
    """outside.py keys a collective by its group: DeepSpeed's backend methods hide their signatures behind
    decorators without functools.wraps (``stage_on_cpu``), so the position is read from the function inside."""
    from deepspeed.comm.torch import TorchBackend

    from deepspeed_multi.reliability.outside import _COLLECTIVES, group_position

    expected = {"all_reduce": 2, "reduce_scatter_tensor": 3, "all_gather_into_tensor": 2, "broadcast": 2, "barrier": 0}
    for name, position in expected.items():
        assert group_position(getattr(TorchBackend, name)) == position, name
    for name in _COLLECTIVES:
        method = getattr(TorchBackend, name, None)
        if method is not None:
            assert group_position(method) is not None, f"TorchBackend.{name}: no group argument found"
