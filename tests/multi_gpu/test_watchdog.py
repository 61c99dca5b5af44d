"""The watchdog: one rank skips an engine; every rank must exit non-zero within
watchdog_timeout_s + 10 s with a message naming the engine (see deepspeed_multi/watchdog.py)."""
import re

import pytest

import watchdog_checks as checks
from rank_launcher import run_ranks_to_exit

TIMEOUT_S = 4.0
SLACK_S = 10.0
REGION = {0: "step()", 1: "step()", 2: "backward", 3: "forward"}


@pytest.mark.parametrize("stage,skip", [(0, "update"), (1, "update"), (2, "update"), (3, "update"), (2, "step")])
def test_one_rank_skips_engine(stage, skip):
    """skip="update": rank 1 skips a Critic-only forward, backward and step; "step": only the step()."""
    stale = stage == 2 and skip == "update"
    region = "step()" if skip == "step" else REGION[stage]
    ranks = run_ranks_to_exit(checks.one_rank_skips_critic, stage, TIMEOUT_S, stale, skip, world_size=2,
                              timeout_s=150)
    logs = "\n".join(f"----- rank {r} (exit {x['exitcode']}) -----\n{x['log'][-3000:]}" for r, x in enumerate(ranks))
    diverged = [float(t) for t in re.findall(r"^DIVERGE ([0-9.]+)$", logs, re.M)]
    assert len(diverged) == 2, f"both ranks must reach the divergence:\n{logs}"
    start = min(diverged)
    for r, x in enumerate(ranks):
        assert x["exitcode"] not in (None, 0), f"rank {r} exit code {x['exitcode']} (None: still running):\n{logs}"
        took = x["exited_at"] - start
        print(f"stage {stage} skip {skip} rank {r}: exit {x['exitcode']} {took:.1f} s after the divergence")
        assert took <= TIMEOUT_S + SLACK_S, f"rank {r} took {took:.1f} s to exit:\n{logs}"
        msg = re.search(r"^deepspeed_multi watchdog \(rank %d\): MultiEngine \(Critic, ZeRO stage %d\) spent [0-9.]+ s "
                        r"in its %s" % (r, stage, re.escape(region)), x["log"], re.M)
        assert msg, f"rank {r}: no watchdog message naming Critic's {region}:\n{logs}"
        assert "backward passes through Critic since its last update, by rank: rank 0: " in x["log"], logs
        assert "Fix: " in x["log"] and "watchdog_timeout_s" in x["log"], logs
        assert took >= TIMEOUT_S, f"rank {r} exited {took:.1f} s after the divergence, before the timeout:\n{logs}"


@pytest.mark.parametrize("stage,steps", [(0, 2), (1, 2), (2, 2), (3, 2), (2, 8), (3, 8)])
def test_rank_skips_into_another_engines_collective(stage, steps):
    """Rank 1 skips Critic's update and enters Actor's, whose collectives differ in size: every rank
    exits within the timeout, rank 0 naming Critic and rank 1 naming Actor, before gloo's size check
    can abort a process (issue 24's third reproduction: SIGABRT at ZeRO-1/2, naming nothing). After
    2 steps both ranks meet at the divergence; after 8 the rank still on the loop's path skips its
    meeting (the loop's recent regions predict its region) and waits in the region's collective."""
    region = {2: "backward", 3: "forward"}.get(stage)
    ranks = run_ranks_to_exit(checks.one_rank_skips_into_another_engine, stage, TIMEOUT_S, steps=steps,
                              world_size=2, timeout_s=150)
    logs = "\n".join(f"----- rank {r} (exit {x['exitcode']}) -----\n{x['log'][-3000:]}" for r, x in enumerate(ranks))
    diverged = [float(t) for x in ranks for t in re.findall(r"^DIVERGE ([0-9.]+)$", x["log"], re.M)]
    assert len(diverged) == 2, f"both ranks must reach the divergence:\n{logs}"
    assert "Received data size" not in logs, f"gloo aborted on mismatched sizes:\n{logs}"
    start = min(diverged)
    for r, (x, name) in enumerate(zip(ranks, ("Critic", "Actor"))):
        assert x["exitcode"] not in (None, 0), f"rank {r} exit code {x['exitcode']} (None: still running):\n{logs}"
        took = x["exited_at"] - start
        print(f"stage {stage} rank {r}: exit {x['exitcode']} {took:.1f} s after the divergence")
        assert took <= TIMEOUT_S + SLACK_S, f"rank {r} took {took:.1f} s to exit:\n{logs}"
        if stage < 2:  # the update's rank agreement compares the engines: both ranks raise at once
            other = "Actor" if name == "Critic" else "Critic"
            assert re.search(r"MultiEngine \(%s, engine #\d+\): the ranks are not in the same engine's update: .*"
                             r"another in engine #\d+'s \(%s\)" % (name, other), x["log"]), logs
            continue
        # The first failure published names the engine it is about (rank 0's Critic or rank 1's Actor,
        # whichever timed out first); every rank's line says where each rank waits, and the meeting counts.
        msg = re.search(r"^deepspeed_multi watchdog \(rank %d\): MultiEngine \((Critic|Actor), ZeRO stage %d\) spent "
                        r"[0-9.]+ s in its %s" % (r, stage, re.escape(region)), x["log"], re.M)
        assert msg, f"rank {r}: no watchdog message naming Critic's or Actor's {region}:\n{logs}"
        mark = region.rstrip("()")
        assert re.search(r"^  rank 0 \(.*\): in Critic %s for" % mark, x["log"], re.M), logs
        assert re.search(r"^  rank 1 \(.*\): in Actor %s for" % mark, x["log"], re.M), logs
        counts = re.search(r"reached %s's %s collectives: rank 0: (\d+), rank 1: (\d+) \(meetings held there, "
                           r".*: rank 0: (\d+), rank 1: (\d+)\)$" % (msg.group(1), mark), x["log"], re.M)
        assert counts, logs
        reached, held = [int(n) for n in counts.groups()[:2]], [int(n) for n in counts.groups()[2:]]
        ahead = 0 if msg.group(1) == "Critic" else 1  # the rank that reached the named engine's region once more
        assert reached[ahead] == steps + 1 and reached[1 - ahead] == steps, logs
        if steps == 2:  # no run of regions has repeated yet: every meeting was held
            assert held == reached, logs
        else:  # the loop's meetings were skipped once its regions repeated; the rank that left the path met
            assert held[1 - ahead] < steps, logs
            met_at_divergence = (ahead == 0) == (stage == 3)  # ZeRO-3: rank 0's Critic forward left the path
            assert held[ahead] == held[1 - ahead] + int(met_at_divergence), logs


@pytest.mark.parametrize("stage", [1, 3])
def test_rank_runs_a_collective_outside_the_engines(stage):
    """After 8 steps, rank 0 alone all-reduces a metric through deepspeed.comm while rank 1 goes on
    training: every rank exits within the timeout, rank 0 named waiting before or in its all_reduce,
    and gloo never pairs the metric with an engine's collective."""
    ranks = run_ranks_to_exit(checks.one_rank_runs_a_collective_of_its_own, stage, TIMEOUT_S, world_size=2,
                              timeout_s=150)
    logs = "\n".join(f"----- rank {r} (exit {x['exitcode']}) -----\n{x['log'][-3000:]}" for r, x in enumerate(ranks))
    diverged = [float(t) for x in ranks for t in re.findall(r"^DIVERGE ([0-9.]+)$", x["log"], re.M)]
    assert len(diverged) == 2, f"both ranks must reach the divergence:\n{logs}"
    assert "Received data size" not in logs, f"gloo aborted on mismatched sizes:\n{logs}"
    start = min(diverged)
    for r, x in enumerate(ranks):
        assert x["exitcode"] not in (None, 0), f"rank {r} exit code {x['exitcode']} (None: still running):\n{logs}"
        took = x["exited_at"] - start
        assert TIMEOUT_S <= took <= TIMEOUT_S + SLACK_S, f"rank {r} took {took:.1f} s to exit:\n{logs}"
        assert re.search(r"^deepspeed_multi watchdog \(rank %d\): " % r, x["log"], re.M), logs
        # Rank 0 waits at its meeting (its group predicted another region), or, where nothing was predicted
        # yet (ZeRO-1's two updates a step take 8 steps to fill the window), in the all-reduce itself while
        # rank 1 waits at its update's meeting.
        assert re.search(r"^  rank 0 \(.*\): (in deepspeed.comm all_reduce for|in no engine's collective region; "
                         r"main thread at \S+ all_reduce)", x["log"], re.M), logs
        assert re.search(r"^  rank 1 \(.*\): in (Actor|Critic) (forward|step) for", x["log"], re.M), logs


@pytest.mark.parametrize("then", ["exit", "train"])
def test_rank_dependent_calls_fail_within_seconds(then):
    """A ZeRO-3 engine called twice on rank 0 and five times on rank 1 (a generation loop of one's own), then
    the program ends or a ZeRO-2 update follows: every rank exits within seconds, long before the 120 s
    timeout, the message naming the engine rank 1 waits in and where rank 0 went."""
    timeout_s = 120.0
    ranks = run_ranks_to_exit(checks.rank_dependent_calls, timeout_s, then, world_size=2, timeout_s=150,
                              agent_store=True)  # (as under torchrun: the store outlives rank 0)
    logs = "\n".join(f"----- rank {r} (exit {x['exitcode']}) -----\n{x['log'][-3000:]}" for r, x in enumerate(ranks))
    start = min(float(t) for x in ranks for t in re.findall(r"^DIVERGE ([0-9.]+)$", x["log"], re.M))
    for r, x in enumerate(ranks):
        took = x["exited_at"] - start
        print(f"{then} rank {r}: exit {x['exitcode']} {took:.1f} s after the divergence")
        if then == "exit" and r == 0:  # rank 0 finished its program; it is rank 1's partner that it left
            assert "DONE" in x["log"], logs
            continue
        assert x["exitcode"] not in (None, 0), f"rank {r} exit code {x['exitcode']}:\n{logs}"
        assert took <= 20, f"rank {r} took {took:.1f} s to exit:\n{logs}"
        if then == "exit":  # gloo sees rank 0's connections close, or rank 1 waits for it at a meeting
            assert re.search(r"ranks 0 finished the program while rank 1 was still in a collective|rank 1 has waited "
                             r"[0-9.]+ s (in|at the store before) MultiEngine \(Critic, ZeRO stage 3\)'s forward .*and "
                             r"rank 0 has finished the program", x["log"]), logs
        else:  # whichever rank's watchdog looks first names the other: each waits where the other never comes
            assert re.search(r"rank (0|1) has waited [0-9.]+ s (in|at the store before) MultiEngine \((Critic, ZeRO stage 3"
                             r"\)'s forward|Actor, ZeRO stage 2\)'s backward).*and rank (0|1) waits at the store before "
                             r"MultiEngine \((Actor|Critic)", x["log"]), logs
        assert "engine.generation_mode()" in x["log"], logs
