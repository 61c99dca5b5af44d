"""The node-aware decisions that need no processes: which tag each node's disk loads (checkpoint/disks.py,
[Note: node-local storage]), which files are a rank's own, and the watchdog's lost-rank message."""
import pytest

from deepspeed_multi.checkpoint import disks as checkpoint_disks
from deepspeed_multi.reliability import watchdog


def _disks():
    return checkpoint_disks._Disks([[0, 1], [2, 3]], [[0], [1]], 4)


def _view(tags, latest):
    return {"complete": {t: {"tag": t, "serial": s, "save_id": f"id{s}"} for t, s in tags.items()},
            "latest": latest, "incomplete": []}


def test_newest_tag_on_every_disk():
    views = [_view({"a": 1, "b": 2}, "b"), _view({"a": 1, "b": 2}, "b")]
    assert [m["tag"] for m in checkpoint_disks._choose_on_every_disk("/ckpt", None, views, _disks())] == ["b", "b"]


def test_save_ended_between_the_renames_loads_the_previous_tag():
    views = [_view({"a": 1, "b": 2}, "a"), _view({"a": 1}, "a")]
    assert [m["tag"] for m in checkpoint_disks._choose_on_every_disk("/ckpt", None, views, _disks())] == ["a", "a"]


@pytest.mark.parametrize("node1", [{"a": 1}, {}])
def test_a_node_without_the_published_tag_fails_naming_it(node1):
    views = [_view({"a": 1, "b": 2}, "b"), _view(node1, "a" if node1 else None)]
    with pytest.raises(FileNotFoundError, match=r"node 1 \(ranks 2-3\) has no complete checkpoint 'b' in /ckpt"):
        checkpoint_disks._choose_on_every_disk("/ckpt", None, views, _disks())


def test_an_explicit_tag_must_be_on_every_disk():
    views = [_view({"a": 1, "b": 2}, "b"), _view({"b": 2}, "b")]
    with pytest.raises(FileNotFoundError, match=r"node 1 \(ranks 2-3\) has no complete checkpoint 'a'"):
        checkpoint_disks._choose_on_every_disk("/ckpt", "a", views, _disks())


def test_copies_of_different_saves_are_refused():
    views = [_view({"a": 1}, "a"), _view({"a": 1}, "a")]
    views[1]["complete"]["a"]["save_id"] = "other"
    with pytest.raises(ValueError, match="different saves"):
        checkpoint_disks._choose_on_every_disk("/ckpt", None, views, _disks())


def test_per_rank_files():
    assert checkpoint_disks._owner("rng/rank3.pt") == 3
    assert checkpoint_disks._owner("buffers/rank2.pt") == 2
    assert checkpoint_disks._owner("enc/zero_pp_rank_2_mp_rank_00_optim_states.pt") == 2
    assert checkpoint_disks._owner("enc/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt") == 1
    assert checkpoint_disks._owner("dec/zero_pp_rank_0_mp_rank_00_model_states.pt") == 0
    for common in ("enc/mp_rank_00_model_states.pt", "client_state.pt", "zero_to_fp32.py", "manifest.json"):
        assert checkpoint_disks._owner(common) is None, common


def test_watchdog_names_lost_ranks_and_their_node():
    reports = {r: {"rank": r, "host": "h0", "pid": 10 + r, "engines": [], "at": "x"} for r in (0, 1)}
    members = {r: {"host": "h1", "pid": 20 + r, "node": "1"} for r in (2, 3)}
    message = watchdog.format_message([], reports, 4, 0, members, cause="RuntimeError: Connection reset by peer")
    assert message.startswith("deepspeed_multi watchdog (rank 0): lost ranks 2, 3 of 4: ranks 2, 3 (node 1, host h1)")
    assert "Connection reset by peer" in message and "Fix:" not in message
    # Every rank answered: the stuck-collective message, as before.
    failure = {"rank": 0, "index": 0, "name": "Critic", "stage": 2, "what": "backward", "waited_s": 4.1, "timeout_s": 4}
    full = {r: {"rank": r, "host": "h", "pid": r, "engines": [], "at": "x"} for r in range(2)}
    assert "lost ranks" not in watchdog.format_message([failure], full, 2, 1) and "Fix:" in watchdog.format_message(
        [failure], full, 2, 1)


def test_node_disks_skip_where_not_root_unless_required(monkeypatch):
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "multi_gpu"))
    import nodes
    monkeypatch.setattr(nodes.os, "geteuid", lambda: 1000)
    ok, why = nodes.node_disks_available()
    assert not ok and "not root" in why
    monkeypatch.delenv("DSM_REQUIRE_NODE_DISKS", raising=False)
    with pytest.raises(pytest.skip.Exception, match="not root"):
        nodes.require_node_disks()
    monkeypatch.setenv("DSM_REQUIRE_NODE_DISKS", "1")
    with pytest.raises(pytest.fail.Exception, match="DSM_REQUIRE_NODE_DISKS=1, but .*not root"):
        nodes.require_node_disks()
