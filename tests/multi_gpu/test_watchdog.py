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
