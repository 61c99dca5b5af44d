"""Two simulated nodes of two ranks each (tests/multi_gpu/nodes.py, [Note: simulated nodes]):
torchrun agents joined by c10d rendezvous on 127.0.0.1, optionally each node its own disk at the
same path. Each test is one launch running several checks (node_checks.py)."""
import time

import node_checks
from nodes import require_node_disks, run_nodes

ROWS = sorted(node_checks.ROWS)


def _report(what, started, results):
    print(f"{what}: {time.monotonic() - started:.1f} s; rank 0: {results[0]}")


def test_two_nodes_exact_and_shared_checkpoint():
    """fp32 1e-5 against plain PyTorch on the same global batch at world size 4 over two nodes:
    ZeRO-2 + ZeRO-3 and ZeRO-3 + ZeRO-1 chains with accumulation, the four-engine RLHF step, an hpZ
    ZeRO-3 engine (secondary partition = one node's ranks) beside a ZeRO-2 engine; MiCS refused at
    initialize; a set checkpoint on a disk both nodes share resumes bit-identical."""
    started = time.monotonic()
    results, _ = run_nodes("node_checks:two_nodes_shared_disk", ROWS, timeout_s=240)
    assert results[0]["checkpoint"]["resume"] == "bit-identical"
    _report("two nodes, shared disk", started, results)


def test_set_checkpoint_on_node_local_disks():
    """Each node its own disk at the same path: every node's copy holds the common files and its own
    ranks' files, the resume is bit-identical; a node whose copy is older or lost fails load on every
    rank naming it and the tag, nothing loaded; a save that ended between the disks' renames leaves
    the previous tag loadable on every node."""
    require_node_disks()
    started = time.monotonic()
    results, _ = run_nodes("node_checks:set_checkpoint_on_nodes", True, node_disks=True, timeout_s=240)
    for r, out in results.items():
        assert out["resume"] == "bit-identical" and "node 1 (ranks 2-3)" in out["older_tag_error"], (r, out)
    _report("two nodes, node-local disks", started, results)
