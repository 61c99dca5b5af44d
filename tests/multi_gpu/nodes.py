"""Simulated nodes: N torchrun agents on this machine, joined by c10d rendezvous on 127.0.0.1.

[Note: simulated nodes]
Every other multi-process test runs one node: one process group whose ranks share a disk and a
rendezvous store. Several things in the package meet the node count (the set checkpoint's staging
directory and manifest, the universal conversion on rank 0, the watchdog and the rank meetings at
the rendezvous store, a lost node being a lost agent), so these tests start what a real
multi-node job starts: one ``torchrun`` agent per node (``--nnodes N --nproc_per_node P
--rdzv_backend c10d``), each starting its own ranks with the environment torchrun gives real
nodes (RANK, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, ...). Agent 0 hosts the rendezvous store
(``is_host=1``), as the node named by ``--rdzv_endpoint`` does.

Node-local disks: with ``node_disks=True`` each agent runs in its own mount namespace
(``unshare -m``) with a per-node directory bind-mounted onto the same path (``disk``), so each
node's ranks see only their node's files there, as on machines with local SSDs. That needs root
(CAP_SYS_ADMIN); elsewhere those tests skip, saying why, unless DSM_REQUIRE_NODE_DISKS=1 (set by
.ci/run, which runs as root) turns the skip into a failure.

One launch runs one *program*: a module-level function of a module in tests/multi_gpu, called on
every rank by ``node_main.py`` (launches cost seconds of imports and rendezvous each, so a
program runs many checks in sequence). Each run has a deadline; a rank that raises ends the run
with its traceback; on a deadline every process of every node (agents and ranks: torchrun puts
each rank in its own session) is killed by pid, found by walking /proc from the agents.
"""
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from rank_launcher import free_port

HERE = os.path.dirname(os.path.abspath(__file__))
NODE_MAIN = os.path.join(HERE, "node_main.py")


class NodesFailed(AssertionError):
    """A rank raised or died, an agent failed, or the run passed its deadline."""


def node_disks_available():
    """(True, "") where each simulated node can get its own disk, else (False, why)."""
    if shutil.which("unshare") is None:
        return False, "no unshare(1) on this machine"
    if os.geteuid() != 0:
        return False, "per-node disks need a mount namespace and a bind mount (root); not root here"
    probe = tempfile.mkdtemp(prefix="dsm_unshare_")
    try:
        r = subprocess.run(["unshare", "-m", "--propagation", "private", "mount", "--bind", probe, probe],
                           capture_output=True, text=True, timeout=30)
    finally:
        os.rmdir(probe)
    if r.returncode != 0:
        return False, f"unshare -m + mount --bind failed: {r.stderr.strip()}"
    return True, ""


def require_node_disks():
    """Skip the calling test when node disks are unavailable, or fail under DSM_REQUIRE_NODE_DISKS=1."""
    import pytest
    ok, why = node_disks_available()
    if ok:
        return
    if os.environ.get("DSM_REQUIRE_NODE_DISKS") == "1":
        pytest.fail(f"DSM_REQUIRE_NODE_DISKS=1, but {why}")
    print(f"skipping: {why}")
    pytest.skip(why)


def _children():
    """{pid: [child pids]} of every process on this machine."""
    kids = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        kids.setdefault(ppid, []).append(int(entry))
    return kids


def _tree(pid):
    kids, out, todo = _children(), [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _read(path, n=None):
    try:
        with open(path, errors="replace") as f:
            text = f.read()
    except OSError:
        return "<no log>"
    return text if n is None else text[-n:]


class SimulatedNodes:
    """``nnodes`` torchrun agents of ``nproc_per_node`` ranks each, running ``program`` on every rank.

    ``program``: "module:function" (a module in tests/multi_gpu); ``args``: JSON-able arguments.
    ``disk``: the path every node sees (its own directory under ``node_disks``, or one shared
    directory); passed to the program as its ``disk`` keyword. ``max_restarts``: torchrun's
    ``--max-restarts``. ``env``: extra environment for every rank.
    """

    def __init__(self, program, *args, nnodes=2, nproc_per_node=2, node_disks=False, max_restarts=0, env=None,
                 base=None):
        self.program, self.args = program, list(args)
        self.nnodes, self.nproc = nnodes, nproc_per_node
        self.node_disks, self.max_restarts = node_disks, max_restarts
        self.base = base or tempfile.mkdtemp(prefix="dsm_nodes_")
        self.disk = os.path.join(self.base, "disk")
        self.logs = os.path.join(self.base, "logs")
        os.makedirs(self.disk, exist_ok=True)
        os.makedirs(self.logs, exist_ok=True)
        self.extra_env = dict(env or {})
        self.port = free_port()
        self.rdzv_id = f"dsm{os.getpid()}x{self.port}"
        self.agents = [None] * nnodes
        self.started_at = None

    def node_dir(self, i):
        """Where node ``i``'s disk lives on this machine (its ``disk`` path inside its namespace)."""
        return os.path.join(self.base, f"node{i}") if self.node_disks else self.disk

    # ------------------------------------------------------------------ agents
    def _command(self, i):
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(self.nnodes), "--nproc_per_node",
                    str(self.nproc), "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{self.port}",
                    "--rdzv_id", self.rdzv_id, "--rdzv_conf", f"is_host={1 if i == 0 else 0},join_timeout=120",
                    # The rendezvous numbers nodes in the order of (address, agent pid): on one machine the pids
                    # decide, and a replacement agent whose pid wrapped around (pid_max 32768) became node 0, its
                    # ranks 0-1 on node 1's disk. A loopback address per node keeps node i at group rank i.
                    "--local_addr", f"127.0.0.{i + 1}",
                    "--max_restarts", str(self.max_restarts), "--monitor_interval", "0.2", NODE_MAIN, self.program,
                    json.dumps({"args": self.args, "disk": self.disk})]
        if not self.node_disks:
            return torchrun
        script = f"mount --bind {shlex.quote(self.node_dir(i))} {shlex.quote(self.disk)} && exec {shlex.join(torchrun)}"
        return ["unshare", "-m", "--propagation", "private", "sh", "-c", script]

    def start_node(self, i):
        if self.node_disks:
            os.makedirs(self.node_dir(i), exist_ok=True)
        env = dict(os.environ, **self.extra_env)
        # torch 2.13's elastic agent shares its rendezvous TCP store with the ranks; a surviving rank-0
        # agent then publishes MASTER_ADDR for the first round only, and a replacement node's new agent
        # waits for it in the next round until the store times out (dynamic_rendezvous.py,
        # next_rendezvous): a job under --max-restarts never comes back after losing a node. Not sharing
        # it publishes the address every round.
        env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
        env.update(DS_ACCELERATOR="cpu", DSM_SIM_NODE=str(i), DSM_NODES_LOG=self.logs, OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([HERE] + [p for p in (env.get("PYTHONPATH") or "").split(os.pathsep)
                                                         if p]))
        out = open(os.path.join(self.logs, f"agent{i}.log"), "a")
        self.agents[i] = subprocess.Popen(self._command(i), env=env, stdout=out, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True)
        out.close()

    def start(self):
        self.started_at = time.monotonic()
        for name in os.listdir(self.logs):  # a job before this one on the same disks
            if name.startswith(("result.", "pid.", "kill_now")):
                os.remove(os.path.join(self.logs, name))
        for i in range(self.nnodes):
            self.start_node(i)
            if i == 0:
                time.sleep(0.3)  # agent 0 binds the rendezvous port first
        return self

    def kill_node(self, i, sig=signal.SIGKILL):
        """SIGKILL node ``i``: its agent and every rank it started, at once (a machine that died)."""
        pids = _tree(self.agents[i].pid)
        for p in pids:
            try:
                os.kill(p, sig)
            except ProcessLookupError:
                pass
        self.agents[i].wait(timeout=30)
        return pids

    def rank_pids(self):
        """{rank: pid} of the ranks of the newest attempt (each rank writes its pid file at start)."""
        out = {}
        for name in os.listdir(self.logs):
            if name.startswith("pid.rank"):
                out[int(name[len("pid.rank"):])] = int(_read(os.path.join(self.logs, name)))
        return out

    def wait_for_file(self, path, timeout_s):
        """Wait for ``path`` (on this machine) to exist, or for every agent to have ended; True if it exists."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if os.path.exists(path):
                return True
            if all(a is None or a.poll() is not None for a in self.agents):
                return os.path.exists(path)
            time.sleep(0.05)
        return False

    def wait(self, timeout_s):
        """Wait for every agent; kill everything at the deadline. Returns each agent's exit code (None: killed)."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end and any(a.poll() is None for a in self.agents if a is not None):
            time.sleep(0.1)
        codes = [a.poll() if a is not None else None for a in self.agents]
        if None in codes:
            self.dump_stacks()
        self.close()
        return codes

    def dump_stacks(self):
        """Every live rank writes its threads' stacks to its log (node_main.py registers SIGUSR1)."""
        for p in self.rank_pids().values():
            if _alive(p):
                try:
                    os.kill(p, signal.SIGUSR1)
                except ProcessLookupError:
                    pass
        time.sleep(1.0)

    def close(self):
        """Kill every process of every node still alive (agents and their ranks, by pid)."""
        pids = [p for a in self.agents if a is not None for p in _tree(a.pid)]
        pids += [p for p in self.rank_pids().values() if _alive(p)]
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for a in self.agents:
            if a is not None:
                try:
                    a.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    pass

    # ------------------------------------------------------------------ results
    def results(self):
        """{rank: result record} written by node_main.py (the newest attempt's)."""
        out = {}
        for name in os.listdir(self.logs):
            if name.startswith("result.rank"):
                with open(os.path.join(self.logs, name)) as f:
                    out[int(name[len("result.rank"):-len(".json")])] = json.load(f)
        return out

    def rank_log(self, rank):
        return "".join(_read(os.path.join(self.logs, name))
                       for name in sorted(os.listdir(self.logs)) if name.startswith(f"rank{rank}.attempt"))

    def all_logs(self, n=3000):
        parts = []
        for name in sorted(os.listdir(self.logs)):
            if name.endswith(".log"):
                parts.append(f"----- {name} (tail) -----\n{_read(os.path.join(self.logs, name), n)}")
        return "\n".join(parts)

    def cleanup(self):
        if self.node_disks:
            for i in range(self.nnodes):
                subprocess.run(["umount", self.disk], capture_output=True)  # none: each mount died with its namespace
        shutil.rmtree(self.base, ignore_errors=True)


def run_nodes(program, *args, nnodes=2, nproc_per_node=2, node_disks=False, timeout_s=240, env=None, keep=False,
              base=None):
    """Run ``program`` on ``nnodes`` x ``nproc_per_node`` ranks; return {rank: its return value}.

    Raises NodesFailed with the failing rank's traceback and every log's tail when a rank raised or
    died, an agent failed, or the run passed ``timeout_s`` (everything is killed then)."""
    nodes = SimulatedNodes(program, *args, nnodes=nnodes, nproc_per_node=nproc_per_node, node_disks=node_disks,
                           env=env, base=base).start()
    try:
        codes = nodes.wait(timeout_s)
        results, world = nodes.results(), nnodes * nproc_per_node
        failed = sorted(r for r, x in results.items() if x.get("error"))
        if failed:
            raise NodesFailed(f"{program} failed on rank {failed[0]} of {world} (node "
                              f"{results[failed[0]]['group_rank']}):\n{results[failed[0]]['error']}\n{nodes.all_logs()}")
        if None in codes:
            raise NodesFailed(f"{program} passed its deadline of {timeout_s:.0f}s; everything was killed. Ranks "
                              f"that finished: {sorted(results)}\n{nodes.all_logs()}")
        if any(codes) or len(results) != world:
            raise NodesFailed(f"{program}: agents exited with {codes}, ranks that finished: {sorted(results)}\n"
                              f"{nodes.all_logs()}")
        return {r: results[r]["result"] for r in sorted(results)}, nodes
    finally:
        nodes.close()
        if not keep:
            nodes.cleanup()
