"""Two simulated nodes of two ranks each (tests/multi_gpu/nodes.py, [Note: simulated nodes]):
torchrun agents joined by c10d rendezvous on 127.0.0.1, optionally each node its own disk at the
same path. Each test is one launch running several checks (node_checks.py)."""
import json
import time

import node_checks
from nodes import require_node_disks, run_nodes

ROWS = sorted(node_checks.ROWS)


def _exit_times(nodes, ranks, since, limit_s, pids):
    """{rank: seconds after ``since`` at which it exited} for ``ranks`` ({rank: pid}), waiting up to ``limit_s``."""
    from nodes import _alive
    pids = {r: p for r, p in pids.items() if r in ranks}
    exited = {}
    while len(exited) < len(pids) and time.monotonic() - since < limit_s:
        for r, p in pids.items():
            if r not in exited and not _alive(p):
                exited[r] = round(time.monotonic() - since, 2)
        time.sleep(0.05)
    return exited


def test_two_nodes_exact_node_local_disks_lost_node_and_fewer_nodes():
    """Each node its own disk at the same path, three jobs:

    1. 2 nodes under torchrun --max-restarts 1: fp32 1e-5 against plain PyTorch on the same global batch at
       world size 4 over two nodes (ZeRO-2 + ZeRO-3 and ZeRO-3 + ZeRO-1 chains with accumulation, the
       four-engine RLHF step, an hpZ ZeRO-3 engine, its secondary partition one node's ranks, beside a
       ZeRO-2 engine); MiCS refused at initialize; a set checkpoint on a directory both nodes share
       resumes bit-identical; the set checkpoint checks on node-local disks (every
       node's copy holds the common files and its own ranks' files; resume bit-identical; a node whose
       copy is older or lost fails load on every rank naming it and the tag, nothing loaded; a save
       that ended between the disks' renames leaves the previous tag loadable), the five-engine resize
       set saved on 4 ranks, then a ZeRO-2 + ZeRO-3 Adam run whose node 1 (agent and ranks) is SIGKILLed
       inside a step: both ranks of node 0 exit within the watchdog time (6 s, plus 4 s for the
       reports) naming ranks 2, 3 of node 1; a replacement node 1 starts, torchrun restarts node 0's
       ranks, and the job resumes from its last complete set checkpoint; in its next save node 1's ranks
       SIGKILL themselves after node 0's disk published the tag and before node 1's did; the second
       restart loads the previous tag on both nodes and ends bit-identical to the uninterrupted run.
    2. 1 node (node 0's disk): the 4-rank save resumes on 2 ranks after the load first failed naming the
       optimizer slices only node 1's disk holds and they were copied in; then saved on 2 ranks.
    3. 2 nodes: the 2-rank save, copied to node 1's disk, resumes on 4 ranks.
    """
    from nodes import SimulatedNodes, node_disks_available
    if not node_disks_available()[0]:  # the rows and the shared-disk checkpoint still run, on one shared disk
        results, _ = run_nodes("node_checks:two_nodes_shared_disk", ROWS, timeout_s=240)
        assert sorted(results[0]["rows"]) == ROWS and results[0]["shared"]["resume"] == "bit-identical", results[0]
    require_node_disks()
    started = time.monotonic()
    first = SimulatedNodes("node_checks:node_local_program", node_disks=True, max_restarts=2).start()
    try:
        assert first.wait_for_file(f"{first.logs}/kill_now", 200), first.all_logs()
        time.sleep(0.5)  # into the slow step
        killed_at = time.monotonic()
        old = first.rank_pids()
        first.kill_node(1)
        exits = _exit_times(first, (0, 1), killed_at, 60, old)
        # The replacement node (with node 1's disk) joins once node 0's ranks have exited by themselves: an agent
        # that sees a node waiting at the rendezvous restarts its healthy ranks at once, as a membership change
        # that torchrun does not count as a restart, so they would neither name the lost ranks nor resume.
        first.start_node(1)
        codes = first.wait(240)
        logs = {r: first.rank_log(r) for r in (0, 1)}
        checks = [line for line in logs[0].splitlines() if line.startswith("CHECKS ")]
        assert checks, first.all_logs()
        done = json.loads(checks[0][len("CHECKS "):])
        assert sorted(done["rows"]) == ROWS and done["shared"]["resume"] == "bit-identical", done
        limit = node_checks.LOST_TIMEOUT_S * 1.2 + 4 + 2  # timeout, its poll (timeout/5), the reports, slack
        for r in (0, 1):
            assert r in exits and exits[r] <= limit, (exits, first.all_logs())
            assert "lost ranks 2, 3 of 4: ranks 2, 3 (node 1" in logs[r], first.all_logs()
        results = first.results()
        assert codes == [0, 0] and sorted(results) == [0, 1, 2, 3], (codes, first.all_logs())
        for r, x in results.items():
            assert x["result"]["resumed_at"] == node_checks.LOST_SAVE_AT and x["result"]["attempt"] == 2, (r, x)
        assert "'killed-save' is complete on some nodes' disks only" in first.rank_log(0), first.all_logs()
        print(f"job 1: {time.monotonic() - started:.1f} s; node 0's ranks exited {exits} s after node 1 was killed;"
              f" restarted: {results[0]['result']}; {checks[0][:300]}")

        base = first.base
        t = time.monotonic()
        results, _ = run_nodes("node_checks:resize_resume", 4, f"{base}/node1/resize", True, nnodes=1,
                               node_disks=True, base=base, keep=True, timeout_s=180)
        assert "missing_error" in results[0], results[0]
        print(f"job 2 (1 node): {time.monotonic() - t:.1f} s; {results[0]}")

        t = time.monotonic()
        results, _ = run_nodes("node_checks:resize_resume", 2, f"{base}/node0/resize", False, node_disks=True,
                               base=base, keep=True, timeout_s=180)
        print(f"job 3 (2 nodes): {time.monotonic() - t:.1f} s; {results[0]}")
    finally:
        first.close()
        first.cleanup()
