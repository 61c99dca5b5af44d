"""Programs run on simulated nodes (tests/multi_gpu/nodes.py; test_nodes.py starts them).

Each program is one launch of every node and runs several checks in sequence (a launch costs
imports and a rendezvous); each takes the ``disk`` keyword: the path where every node sees its
own disk (or the one shared disk).
"""
import os

import torch

import deepspeed.comm as dist
from common import compare, run_engines, run_reference
import scenarios


def local_world():
    return int(os.environ["LOCAL_WORLD_SIZE"])


def _zero(scenario, name, **zero):
    scenario.members[name].config["zero_optimization"].update(zero)
    return scenario


def _hpz_beside_zero2():
    """A ZeRO-3 engine whose secondary partition (hpZ) spans one node's ranks, after a ZeRO-2 engine in one loss."""
    return _zero(scenarios._chain(2, 3, 2, 2), "b", zero_hpz_partition_size=local_world())


def _mics_beside_zero2():
    """A MiCS engine (ZeRO-3 sharded within each node, replicated across nodes) after a ZeRO-2 engine in one loss."""
    return _zero(scenarios._chain(2, 3, 2, 2), "b", mics_shard_size=local_world())


ROWS = {
    "chain-z2z3-gas22": lambda: scenarios.SCENARIOS["chain-z2z3-gas22"](),
    "chain-z3z1-gas31": lambda: scenarios.SCENARIOS["chain-z3z1-gas31"](),
    "rlhf-4-engines": lambda: scenarios.SCENARIOS["rlhf-4-engines"](),
    "hpz-z3-beside-z2-gas22": _hpz_beside_zero2,
}


def _took_effect(name, engines):
    b = engines.get("b")
    if name.startswith("hpz"):
        assert b.zero_hpz_partition_size() == local_world(), b.zero_hpz_partition_size()


def mics_refused():
    """MiCS is refused at initialize with a clear error (see _refuse_mics in deepspeed_multi/initialize.py)."""
    import deepspeed_multi
    from common import build_engine, expect_error
    scenario = _mics_beside_zero2()
    member = scenario.members["b"]
    return expect_error(NotImplementedError, lambda: build_engine(member, member.build(), deepspeed_multi.initialize),
                        "does not support MiCS", "mics_shard_size=2", "zero_hpz_partition_size")


def two_nodes_shared_disk(names, disk):
    """Where nodes cannot have disks of their own: the first job's rows, MiCS refusal and shared-disk
    checkpoint in a launch of their own (test_nodes.py)."""
    return {"rows": exact_rows(names), "mics": mics_refused(), "shared": set_checkpoint_on_nodes(False, disk)}


def exact_rows(names, disk=None):
    """Each row through engines on every rank and through plain PyTorch on the same global batch:
    returns {row: {engine: max abs error}} (fp32; compare() raises above 1e-5)."""
    import deepspeed_multi
    out = {}
    for name in names:
        scenario = ROWS[name]()
        assert scenario.world_size == dist.get_world_size(), (name, scenario.world_size)
        try:
            engines = run_engines(scenario, deepspeed_multi.initialize)
            _took_effect(name, engines)
            out[name] = compare(engines, run_reference(scenario), scenario.members, scenario.dtype)
        except Exception as e:
            raise AssertionError(f"row {name!r} on {dist.get_world_size()} ranks: {type(e).__name__}: {e}") from e
        for e in engines.values():
            e.destroy()
        del engines
        import gc
        gc.collect()
    return out


# ------------------------------------------------------------------ set checkpoints on several nodes
def _node():
    return int(os.environ["GROUP_RANK"]), int(os.environ["LOCAL_RANK"]) == 0


def _expect_load_fails(root, engines, *texts):
    """load_checkpoint must fail on every rank, naming ``texts``, and leave every engine as it was."""
    import deepspeed_multi
    from checkpoint_checks import _assert_identical, _params
    before = _params(engines)
    try:
        deepspeed_multi.load_checkpoint(root, engines)
    except FileNotFoundError as e:
        for text in texts:
            assert text in str(e), f"{text!r} not in: {e}"
        message = str(e)
    else:
        raise AssertionError(f"load_checkpoint must fail naming {texts}")
    _assert_identical(_params(engines), before, "after a refused load")
    return message


def set_checkpoint_on_nodes(node_local, disk):
    """The five-engine set of test_checkpoint.py (ZeRO 0-3, a frozen ZeRO-3, gas 1 and 2, Adam) saved on
    every node, each node's copy holding what its ranks need; a resume on the same nodes is
    bit-identical to the uninterrupted run. With ``node_local`` (each node its own disk): a node
    whose copy holds only an older tag, or nothing, fails load on every rank naming it and the tag,
    nothing loaded; a save that ended between the disks' renames leaves the previous tag loadable."""
    import json
    import shutil
    import deepspeed_multi
    from checkpoint_checks import SETS, _assert_identical, _params, _reseed, build, train
    rank, world = dist.get_rank(), dist.get_world_size()
    node, first = _node()
    root = os.path.join(disk, "run")
    out = {}
    _reseed(0)
    engines = build(SETS["mixed"])
    train(engines, 0, 2)
    path = deepspeed_multi.save_checkpoint(root, engines, client_state={"step": 2})
    at_save = _params(engines)
    train(engines, 2, 4)
    final = _params(engines)

    # What this node's copy holds: every common file, and the per-rank files of its own ranks only.
    with open(os.path.join(path, "manifest.json")) as f:
        manifest = json.load(f)
    storage = manifest["storage"]
    assert storage["node_local"] == node_local, storage
    from deepspeed_multi.checkpoint.disks import _owner
    owners = {_owner(f) for f in manifest["files"]} - {None}
    local = int(os.environ["LOCAL_WORLD_SIZE"])
    mine = set(range(node * local, (node + 1) * local)) if node_local else set(range(world))
    assert owners == mine, (node, sorted(owners), sorted(mine))
    for must in ("client_state.pt", "zero_to_fp32.py", "head/mp_rank_00_model_states.pt", f"rng/rank{rank}.pt"):
        assert must in manifest["files"], (must, sorted(manifest["files"]))
    out["files_on_my_disk"] = len(manifest["files"])

    _reseed(12345)
    fresh = build(SETS["mixed"], seed_offset=50)
    state = deepspeed_multi.load_checkpoint(root, fresh)
    assert state == {"step": 2}, state
    _assert_identical(_params(fresh), at_save, "just after loading on the same nodes")
    train(fresh, 2, 4)
    _assert_identical(_params(fresh), final, "resumed on the same nodes")
    out["resume"] = "bit-identical"
    if not node_local:
        return out

    later = deepspeed_multi.save_checkpoint(root, fresh, client_state={"step": 4}, tag="later")
    tag1 = os.path.basename(path)

    def on_node(n, fn):
        dist.barrier()
        if node == n and first:
            fn()
        dist.barrier()

    def point_latest(tag):
        with open(os.path.join(root, "latest"), "w") as f:
            f.write(tag)

    # A save that ended between the disks' renames: node 0 published "later", node 1 still has it
    # staged, and no `latest` names it yet: every node loads the previous tag.
    on_node(1, lambda: os.rename(later, os.path.join(root, ".later.staging")))
    on_node(1, lambda: point_latest(tag1))
    on_node(0, lambda: point_latest(tag1))
    _reseed(12345)
    again = build(SETS["mixed"], seed_offset=60)
    assert deepspeed_multi.load_checkpoint(root, again) == {"step": 2}
    _assert_identical(_params(again), at_save, "the previous tag after a save that ended between the renames")
    out["interrupted_save"] = f"loaded {tag1} on every node"

    # Node 0's `latest` names "later", which node 1's copy lacks (it holds only the older tag).
    on_node(0, lambda: point_latest("later"))
    out["older_tag_error"] = _expect_load_fails(root, again, "node 1 (ranks 2-3) has no complete checkpoint 'later'",
                                               f"holds ['{tag1}']", f"node 0 (ranks 0-1) holds ['{tag1}', 'later']")
    # ... and node 1's whole copy is gone.
    on_node(1, lambda: shutil.rmtree(root))
    out["lost_copy_error"] = _expect_load_fails(root, again, "node 1 (ranks 2-3) has no complete checkpoint 'later'",
                                               "holds no complete checkpoint")
    return out


# ------------------------------------------------------------------ a lost node
LOST_SET = [("enc", 2, 1, True), ("dec", 3, 1, True)]
LOST_SAVE_AT, LOST_KILL_FROM, LOST_TOTAL = 2, 4, 8  # steps: the last complete save, where the kill may land, the end
LOST_TIMEOUT_S = 6  # watchdog_timeout_s of the lost-node run
LOST_KILLED_SAVE_AT = 6  # the first restart saves here, and node 1's ranks die inside that save


def _slow_train(engines, start, stop, logs, attempt):
    """checkpoint_checks.train one step at a time, saving at LOST_SAVE_AT; in the first job, from
    LOST_KILL_FROM on, each forward sleeps a little (so that the kill lands inside a step) and rank 0
    tells the harness to kill."""
    import time
    import deepspeed_multi
    from checkpoint_checks import train
    for step in range(start, stop):
        if attempt == 0 and step == LOST_KILL_FROM:
            for e in engines.values():
                e.module.register_forward_hook(lambda *a: time.sleep(0.2))
            if dist.get_rank() == 0:
                open(os.path.join(logs, "kill_now"), "w").close()
        train(engines, step, step + 1)
        print(f"STEP {step} done", flush=True)
        if step + 1 == LOST_SAVE_AT:
            deepspeed_multi.save_checkpoint(os.environ["DSM_LOST_ROOT"], engines, client_state={"step": step + 1})
        if attempt == 1 and step + 1 == LOST_KILLED_SAVE_AT:
            # Node 1's ranks die inside this save, after node 0's disk published it and before node 1's
            # did: the restarted job must load the previous tag on every node.
            from checkpoint_checks import _kill_at_phase
            if _node()[0] == 1:
                _kill_at_phase("before_rename")
            print(f"SAVING killed-save at step {step + 1}", flush=True)
            deepspeed_multi.save_checkpoint(os.environ["DSM_LOST_ROOT"], engines, client_state={"step": step + 1},
                                            tag="killed-save")
            raise AssertionError("node 1 was to die inside the save")


def _attempt():
    """Which start of the job this is: torchrun counts restarts per agent, and a replacement node's
    agent starts again from 0, so the job's count is the largest of its ranks'."""
    counts = [None] * dist.get_world_size()
    dist.all_gather_object(counts, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
    return max(counts)


def lost_node_run(disk):
    """One job of the lost-node test: resume from the newest complete checkpoint (if any), train to
    LOST_TOTAL, and compare with the uninterrupted run (computed here too) bit for bit."""
    import deepspeed_multi
    from checkpoint_checks import _assert_identical, _params, _reseed, build
    from deepspeed_multi import checkpoint
    attempt = _attempt()
    logs = os.environ["DSM_NODES_LOG"]
    root = os.path.join(disk, "lost")
    os.environ["DSM_LOST_ROOT"] = root
    config = {"deepspeed_multi": {"watchdog_timeout_s": LOST_TIMEOUT_S}}
    _reseed(0)
    engines = build_with(LOST_SET, config)
    start = 0
    views = [None] * dist.get_world_size()
    dist.all_gather_object(views, bool(checkpoint.tags.complete_tags(root)[0]))
    if all(views):
        _reseed(999)
        engines = build_with(LOST_SET, config, seed_offset=50)
        start = deepspeed_multi.load_checkpoint(root, engines)["step"]
        print(f"RESUMED at step {start} (attempt {attempt})", flush=True)
    _slow_train(engines, start, LOST_TOTAL, logs, attempt)
    got = _params(engines)
    _reseed(0)
    ref = build_with(LOST_SET, config)
    from checkpoint_checks import train
    train(ref, 0, LOST_TOTAL)
    _assert_identical(got, _params(ref), f"resumed at step {start} after a lost node")
    return {"attempt": attempt, "resumed_at": start}


def build_with(chain, extra, seed_offset=0):
    """checkpoint_checks.build with ``extra`` merged into every engine's config."""
    import deepspeed_multi
    from common import MLP, ds_config
    engines = {}
    for i, (name, stage, gas, trainable) in enumerate(chain):
        model = MLP(seed=i + 1 + seed_offset)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        engines[name] = deepspeed_multi.initialize(model=model, optimizer=opt, config=ds_config(stage, gas=gas, **extra))[0]
    return engines


# ------------------------------------------------------------------ fewer nodes (resize.py)
def _copy_missing(src, dst):
    """Copy the files of ``src`` that ``dst`` lacks (another node's copy of a checkpoint: its own
    manifest stays, the other node's per-rank files join it)."""
    import shutil
    for d, _, fs in os.walk(src):
        for f in fs:
            target = os.path.join(dst, os.path.relpath(os.path.join(d, f), src))
            if not os.path.exists(target):
                os.makedirs(os.path.dirname(target), exist_ok=True)
                shutil.copy2(os.path.join(d, f), target)


def resize_resume(saved_world, copy_from, save_after, disk):
    """Resume the resize set saved by ``saved_world`` ranks on this job's ranks (checkpoint_checks.
    resume_resized: bit-identical at the load, 1e-5 of the uninterrupted run after four steps).
    ``copy_from``: where (a host path this node can read) another node's copy of the save lies; the
    resume must first fail naming the files this node's copy lacks, then each node's first rank copies
    them in. ``save_after``: then save the same set on this job's ranks for the reverse direction."""
    import checkpoint_checks
    import deepspeed_multi
    root = os.path.join(disk, "resize")
    name = f"from{saved_world}"
    _, first = _node()
    out = {}
    if copy_from:
        have = os.path.isdir(os.path.join(root, name))
        flags = [None] * dist.get_world_size()
        dist.all_gather_object(flags, have)
        if all(flags):
            probe = checkpoint_checks._build_resized(seed_offset=50)
            try:
                deepspeed_multi.load_checkpoint(os.path.join(root, name), probe)
            except RuntimeError as e:
                assert "lacks" in str(e) and "zero_pp_rank_" in str(e) and ".frozen/" in str(e) and "Copy the whole" in str(e), str(e)
                out["missing_error"] = str(e)[:400]
            else:
                raise AssertionError("a resize from node-local copies that lack other nodes' slices must fail")
            del probe
        if first:
            _copy_missing(os.path.join(copy_from, name), os.path.join(root, name))
            ref = os.path.join(root, f"{name}.ref.pt")  # the uninterrupted run's parameters (test data)
            if not os.path.exists(ref):
                __import__("shutil").copy2(os.path.join(copy_from, f"{name}.ref.pt"), ref)
        dist.barrier()
    checkpoint_checks.resume_resized(root, saved_world)
    out["resumed"] = f"{saved_world} -> {dist.get_world_size()} ranks"
    if save_after:
        checkpoint_checks.save_for_resize(root)
    return out


def node_local_program(disk):
    """The job on node-local disks, under torchrun --max-restarts 1: the exact rows, the MiCS refusal, a set
    checkpoint on a directory both nodes share (outside the node-local mount) and the set checkpoint checks
    on the node-local disks, and the save for the resize; then the lost-node run, whose node 1 is killed
    part way (the checks' results are in the log); the restarted job resumes the lost-node run."""
    import json
    import checkpoint_checks
    if _attempt() == 0:
        shared = os.path.join(os.path.dirname(disk), "shared")  # (nodes.py mounts each node's own dir at disk)
        out = dict(two_nodes_shared_disk(sorted(ROWS), shared), checkpoint=set_checkpoint_on_nodes(True, disk))
        checkpoint_checks.save_for_resize(os.path.join(disk, "resize"))
        print("CHECKS " + json.dumps(out), flush=True)
    return lost_node_run(disk)
