"""Shared pieces of the benchmarks: process launch, models, configs, timing, memory, output.

Every benchmark script starts its own ranks (``torch.multiprocessing`` spawn, 2 by default),
so ``python benchmarks/<name>.py`` is the whole command. Backend: NCCL with one GPU per rank
when enough GPUs are visible, else gloo on CPU (``DS_ACCELERATOR=cpu``, 1 thread per rank).

[Note: how time and memory are measured]
* Time: every variant of a benchmark is built side by side in ONE pair of processes and the
  variants are stepped interleaved (the order rotates every step), so machine noise hits all of
  them alike. A step is timed from a barrier to the end of ``step()``; the per-step time is the
  max over ranks; tables report the median over the timed steps (after warm-up), and ratios
  are the median of per-step paired ratios (``paired_ratio``).
* Memory: each variant runs alone in a FRESH pair of processes (peaks of variants sharing a
  process cannot be separated). On GPU: ``torch.cuda.max_memory_allocated`` (live tensors,
  model states included). On CPU there are no allocator statistics, so it is the process's
  resident-set high-water mark (VmHWM) minus its resident set just before the models are built
  (VmRSS): model + optimizer states + activations + allocator slack. Max over ranks.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
# BENCH_RESULTS sends the results elsewhere (a GPU run writes them to benchmarks/results/gpu/).
RESULTS = Path(os.environ.get("BENCH_RESULTS", ROOT / "benchmarks" / "results")).resolve()
# Ranks per benchmark. BENCH_WORLD_SIZE=1 runs one rank, on NCCL where one GPU is visible: the
# launcher uses NCCL only when every rank gets its own GPU.
WORLD_SIZE = int(os.environ.get("BENCH_WORLD_SIZE", "2"))
for _path in (ROOT, ROOT / "tests" / "multi_gpu"):  # the package; rank_launcher (shared with the tests)
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

MB = float(1 << 20)


# ----------------------------------------------------------------------------- launching
from rank_launcher import run_ranks, use_gpu  # noqa: E402


def launch(fn, *args, world_size: int = None, timeout_s: float = 900):
    """Run ``fn(*args)`` on ``world_size`` ranks (default ``WORLD_SIZE``); return the per-rank return values.

    Rank 0 prints to this terminal when ``BENCH_QUIET=0``; DeepSpeed's construction logs go to files otherwise.
    """
    return run_ranks(fn, *args, world_size=world_size or WORLD_SIZE, timeout_s=timeout_s,
                     quiet_rank0=os.environ.get("BENCH_QUIET", "1") == "1")


def device():
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def sync():
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------- models
class Block(nn.Module):
    """A pre-LN transformer block: causal self-attention and a 4x MLP."""

    def __init__(self, d: int, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Tower(nn.Module):
    """``d_in -> n_layers blocks of width d -> d_out``; casts its input to its own dtype, returns fp32.

    The casts let engines of different dtypes feed each other (a bf16 engine and an fp32 loss).
    """

    def __init__(self, d_in: int, d: int, n_layers: int, d_out: int, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(d_in, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n_layers))
        self.out = nn.Linear(d, d_out)

    def forward(self, x):
        x = self.inp(x.to(self.inp.weight.dtype))
        for blk in self.blocks:
            x = blk(x)
        return self.out(x).float()


class Chain(nn.Module):
    """The super-module workaround: modules one after another in one module (one engine, one stage)."""

    def __init__(self, *modules):
        super().__init__()
        self.parts = nn.ModuleList(modules)

    def forward(self, x):
        for part in self.parts:
            x = part(x)
        return x


class Scalar(nn.Module):
    """A critic / reward head: a tower and a mean over features -> one value per token."""

    def __init__(self, *args, **kw):
        super().__init__()
        self.body = Tower(*args, **kw)

    def forward(self, x):
        return self.body(x).mean(-1)


def n_params(module) -> int:
    return sum(getattr(p, "ds_numel", p.numel()) for p in module.parameters())


# ----------------------------------------------------------------------------- configs
def ds_config(stage: int, dtype: str = "fp32", micro_bs: int = 8, gas: int = 1, **extra) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": micro_bs,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    cfg.update(extra)
    return cfg


def build_engine(initialize, model, config, trainable=True, lr=1e-4):
    """``initialize`` is ``deepspeed.initialize`` or ``deepspeed_multi.initialize``."""
    if trainable:
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
        engine, *_ = initialize(model=model, optimizer=opt, config=config)
    else:
        model.requires_grad_(False)
        engine, *_ = initialize(model=model, config=config)
    return engine


# ----------------------------------------------------------------------------- timing
def interleave(variants: dict, warmup: int, steps: int):
    """Step every variant ``warmup + steps`` times, interleaved, rotating the order every step.

    ``variants``: name -> callable(i) that runs one full training step and returns either None
    or a dict phase -> seconds (phase timings measured inside the step).
    Returns name -> {"total": [ms per timed step], phase: [ms], ...}, max over ranks.
    """
    import deepspeed.comm as dist
    names = list(variants)
    times = {n: {} for n in names}
    for i in range(warmup + steps):
        k = i % len(names)
        order = names[k:] + names[:k]
        for n in order:
            dist.barrier()
            sync()
            t0 = time.perf_counter()
            phases = variants[n](i) or {}
            sync()
            total = time.perf_counter() - t0
            if i >= warmup:
                times[n].setdefault("total", []).append(total * 1e3)
                for p, s in phases.items():
                    times[n].setdefault(p, []).append(s * 1e3)
    # max over ranks, step by step
    for n in names:
        for p, vals in times[n].items():
            t = torch.tensor(vals, dtype=torch.float64, device=device())  # NCCL reduces device tensors only
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            times[n][p] = t.tolist()
    return times


class PhaseTimer:
    """``with timer("forward"): ...`` accumulates seconds per phase within one step."""

    def __init__(self):
        self.phases = {}

    def __call__(self, name):
        timer = self

        class _Ctx:
            def __enter__(self):
                sync()
                self.t0 = time.perf_counter()

            def __exit__(self, *exc):
                sync()
                timer.phases[name] = timer.phases.get(name, 0.0) + time.perf_counter() - self.t0

        return _Ctx()


def median(xs):
    return statistics.median(xs)


def paired_ratio(ours, base):
    """Median over steps of ours[i] / base[i]: the two ran back to back in iteration i, so slow
    drifts of a shared machine cancel. This is the ratio the tables and RESULT lines report."""
    return statistics.median(a / b for a, b in zip(ours, base))


def iqr(xs):
    if len(xs) < 4:
        return 0.0
    q = statistics.quantiles(xs, n=4)
    return q[2] - q[0]


# ----------------------------------------------------------------------------- memory
def _proc_status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


class PeakMemory:
    """Peak memory of this process from construction to ``peak_mb()`` (see the module Note)."""

    def __init__(self):
        self.gpu = torch.cuda.is_available() and torch.cuda.is_initialized()
        if self.gpu:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            self.base = _proc_status_kb("VmRSS") * 1024

    def resident_mb(self, field: str = "VmRSS") -> float:
        """This rank's CPU resident set (``VmHWM``: its high-water mark) above the starting point, in MiB."""
        return (_proc_status_kb(field) * 1024 - self.base) / MB

    def peak_mb(self) -> float:
        """Max over ranks of the peak above the starting point, in MiB."""
        import deepspeed.comm as dist
        if self.gpu:
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - self.base
        else:
            peak = _proc_status_kb("VmHWM") * 1024 - self.base
        t = torch.tensor([peak / MB], dtype=torch.float64, device=device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()


def memory_kind() -> str:
    return "cuda max_memory_allocated" if use_gpu(1) else "CPU RSS high-water (VmHWM - VmRSS before build)"


# ----------------------------------------------------------------------------- output
def fmt_table(headers, rows) -> str:
    cells = [[str(h) for h in headers]] + [[c if isinstance(c, str) else f"{c:.3f}" if isinstance(c, float)
                                            else str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = lambda r: "| " + " | ".join(c.rjust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|"
    return "\n".join([line(cells[0]), sep] + [line(r) for r in cells[1:]])


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), for the report's machine line."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def bf16_kernels() -> bool:
    """Whether bf16 matmuls have kernels here: a GPU, or a CPU that oneDNN serves in bf16 (AVX512 and newer).
    On an AVX2-only CPU PyTorch falls back to a scalar loop, tens of times an fp32 matmul (``matmul_ms``
    measures it), so a bf16 step would time that loop, not the engines, and the full run would take hours."""
    return bool(use_gpu(1) or torch.ops.mkldnn._is_mkldnn_bf16_supported())


def bf16_left_out() -> bool:
    """Whether the benchmarks leave bf16 out here: it has no kernels, and ``BENCH_BF16=1`` does not keep it."""
    return not bf16_kernels() and os.environ.get("BENCH_BF16") != "1"


def dtypes_here(dtypes) -> list:
    """``dtypes`` less bf16 where ``bf16_left_out()``; says what it left out."""
    if "bf16" in dtypes and bf16_left_out():
        print("bf16 left out: this CPU has no bf16 matmul kernels (BENCH_BF16=1 runs it anyway)", flush=True)
        return [d for d in dtypes if d != "bf16"]
    return list(dtypes)


def matmul_ms(n: int = 512, reps: int = 3) -> dict:
    """One thread's n x n matmul in fp32 and bf16 (ms, best of ``reps``): what bf16 costs on this machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = {"n": n}
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
            best = float("inf")
            for _ in range(reps + 1):  # the first warms up
                t0 = time.perf_counter()
                a @ b
                best = min(best, (time.perf_counter() - t0) * 1e3)
            out[name] = best
        return out
    finally:
        torch.set_num_threads(threads)


def meta(**extra) -> dict:
    import deepspeed
    return {"torch": torch.__version__, "deepspeed": deepspeed.__version__, "python": platform.python_version(),
            "machine": platform.machine(), "cpu": cpu_model(), "cpus": os.cpu_count(), "gpu": use_gpu(1) and torch.cuda.get_device_name(0),
            "memory": memory_kind(), "time": time.strftime("%Y-%m-%d %H:%M:%S"), **extra}


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def save(name: str, payload: dict, plot=None) -> None:
    """Write benchmarks/results/<name>.json and, when matplotlib is importable, <name>.png."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=1, default=str) + "\n")
    print(f"wrote {_shown(path)}")
    if plot is None:
        return
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not importable, no plot written (pip install -r requirements-bench.txt)")
        return
    fig = plot(plt)
    png = RESULTS / f"{name}.png"
    fig.savefig(png, dpi=110, bbox_inches="tight")
    plt.close(fig)
    print(f"wrote {_shown(png)}")


def bar_plot(plt, title, groups, series, ylabel):
    """``groups``: x labels; ``series``: label -> list of values (one per group)."""
    import numpy as np
    fig, ax = plt.subplots(figsize=(max(5, 1.3 * len(groups) * len(series) / 2 + 3), 3.6))
    x = np.arange(len(groups))
    w = 0.8 / len(series)
    for i, (label, vals) in enumerate(series.items()):
        ax.bar(x + (i - (len(series) - 1) / 2) * w, vals, w, label=label)
    ax.set_xticks(x)
    ax.set_xticklabels(groups)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    return fig


def peak_memory_of_steps(build_step, steps) -> float:
    """Peak memory (MiB, max over ranks) of building a variant with ``build_step()`` and running its steps."""
    mem = PeakMemory()
    step = build_step()
    for i in range(steps):
        step(i)
    return mem.peak_mb()


def arg_parser(doc):
    """The options every multi-engine benchmark takes: --steps, --warmup, --no-memory."""
    import argparse
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--no-memory", action="store_true")
    return ap


def write_bench_time(path: str, total_s: str, quick: str, *timings: str) -> None:
    """``_bench.py --write-time PATH TOTAL_S QUICK NAME=S...``: run_all.sh's record of how long it took, with
    the machine line, for the report's "Machines and files" section."""
    payload = {"meta": meta(quick=quick == "1"), "total_s": int(total_s), "bf16_kernels": bf16_kernels(),
               "bf16_left_out": bf16_left_out(), "matmul_ms": matmul_ms(),
               "benchmarks": {name: int(s) for name, s in (t.split("=", 1) for t in timings)}}
    Path(path).write_text(json.dumps(payload, indent=1) + "\n")
    print(f"wrote {_shown(Path(path).resolve())}: {int(total_s) / 60:.1f} min")


if __name__ == "__main__":
    if len(sys.argv) >= 4 and sys.argv[1] == "--write-time":
        write_bench_time(*sys.argv[2:])
    else:
        raise SystemExit("usage: python benchmarks/_bench.py --write-time PATH TOTAL_S QUICK [NAME=SECONDS ...]")
