"""What every peer-program harness shares: launching a program's ranks on one side, checking that
the drop-in swap reached every process that built an engine, and comparing the two sides' results.

A side is "upstream" (the program as written, DeepSpeed's ``deepspeed.initialize``) or "ours" (the
same program, ``deepspeed.initialize`` replaced by ``deepspeed_multi.initialize`` in every process
by tools/drop_in/sitecustomize.py). Nothing of a peer program lives in this repository: a harness
takes its checkout (or installed package) and runs it from there.
"""
import os
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
DROP_IN = os.path.join(REPO, "tools", "drop_in")
SIDES = ("upstream", "ours")

sys.path.insert(0, DROP_IN)
from sitecustomize import read_log  # noqa: E402  (the swap hook's log, read back)

sys.path.pop(0)


def side_env(side, log, python_path=(), extra=None):
    """The environment of one side's run: the swap hook first on PYTHONPATH, then ``python_path``
    (shims, the program's own checkout), the CPU accelerator, and ``extra``."""
    if side not in SIDES:
        raise ValueError(f"side must be one of {SIDES}, got {side!r}")
    env = dict(os.environ)
    env.update(DS_ACCELERATOR="cpu", DSM_DROP_IN_SIDE=side, DSM_DROP_IN_LOG=log, PYTHONHASHSEED="0",
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([DROP_IN, *python_path, REPO] + ([env["PYTHONPATH"]] if env.get(
        "PYTHONPATH") else []))
    env.update(extra or {})
    return env


def torchrun(args, nproc, env, cwd, out_path, timeout_s, python=sys.executable):
    """Run ``python -m torch.distributed.run --standalone --nproc_per_node=nproc *args``; its output
    goes to ``out_path``. At ``timeout_s`` every process of the run is killed. Returns (rc, seconds);
    rc is None on a timeout."""
    cmd = [python, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    start = time.time()
    with open(out_path, "w") as out:
        out.write("$ " + " ".join(cmd) + f"\n(cwd {cwd})\n")
        out.flush()
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
    return rc, time.time() - start


def swap_problems(log_path, side, ranks):
    """What is wrong with the swap on one side: on "ours" every engine must be deepspeed_multi's and every
    one of the ``ranks`` processes must have built one through the swap; no process may have imported
    deepspeed unpatched. An empty list when all is well."""
    log = read_log(log_path)
    problems = []
    if log["missed"]:
        problems.append(f"{len(log['missed'])} process(es) imported deepspeed without the swap")
    if len(log["built_by"]) < ranks:
        problems.append(f"{len(log['built_by'])} of {ranks} ranks built an engine through deepspeed.initialize")
    if side == "ours":
        foreign = {c: n for c, n in log["engines"].items() if not c.startswith("deepspeed_multi.")}
        if foreign:
            problems.append(f"engines that are not deepspeed_multi's: {foreign}")
    return problems


def engine_counts(log_path):
    return dict(read_log(log_path)["engines"])


def tensor_differences(a, b):
    """Two ``{name: tensor}`` dicts -> ``[(name, what)]`` for every name whose tensors are not
    ``torch.equal`` (with the largest absolute difference), or that one side lacks."""
    import torch
    found = []
    for name in sorted(set(a) | set(b)):
        if name not in a or name not in b:
            found.append((name, "only upstream" if name in a else "only ours"))
            continue
        x, y = a[name], b[name]
        if x.shape != y.shape or x.dtype != y.dtype:
            found.append((name, f"{tuple(x.shape)} {x.dtype} vs {tuple(y.shape)} {y.dtype}"))
        elif not torch.equal(x, y):
            found.append((name, f"max |diff| {(x.double() - y.double()).abs().max().item():.3e}"))
    return found


def value_differences(a, b):
    """Two lists of logged records (dicts of numbers) -> ``[(index, key, upstream, ours)]`` where they
    differ at all (bit-identical floats compare equal), or one side has more records."""
    found = []
    for i in range(max(len(a), len(b))):
        if i >= len(a) or i >= len(b):
            found.append((i, "record", a[i] if i < len(a) else None, b[i] if i < len(b) else None))
            continue
        for key in sorted(set(a[i]) | set(b[i])):
            if a[i].get(key) != b[i].get(key):
                found.append((i, key, a[i].get(key), b[i].get(key)))
    return found


def error_tail(log, lines=40):
    """The traceback that ended a failed run (the first rank's), else the log's last lines."""
    with open(log, errors="replace") as f:
        text = f.read().splitlines()
    for i, line in enumerate(text):
        if "Traceback (most recent call last)" in line:
            end = i + 1
            while end < len(text) and (text[end].startswith((" ", "\t", "[rank")) or "Error" not in text[end - 1]):
                end += 1
            return "\n".join(text[i:min(end + 1, i + 80)])
    return "\n".join(text[-lines:])
