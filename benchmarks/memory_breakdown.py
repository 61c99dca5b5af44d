"""Where a rank's memory goes, by buffer: ours, the super-module and FSDP2 on encoder -> LLM.

The workload is peers.py's (encoder ZeRO-2 -> LLM ZeRO-3 for ours, with the sizes left unset as users
leave them, so each engine works per block, small blocks grouped up to min_block_elements ([Note: sizes
from the model's block]); the same with no floor (peers.PER_BLOCK); the same with DeepSpeed's default sizes written out
(peers.DEEPSPEED_SIZES: what those defaults cost); the encoder at ZeRO-3 too (peers.BOTH_ZERO3: the sharding FSDP2 applies), and that per block
(peers.BOTH_ZERO3_PER_BLOCK: FSDP2's sharding and granularity); one upstream ZeRO-3
engine for the super-module; ``fully_shard`` per block for FSDP2; AdamW, both models trained), in fp32 and in
bf16 (DeepSpeed's ``bf16`` section; FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)``). Each variant runs alone in fresh processes, 3 steps, then:

* state: every tensor alive after the last ``backward`` (before ``step()``: parameters, gradients
  and optimizer states are all alive then, as at a GPU's usual peak), counted once per storage and put in one
  bucket by the attribute that holds it (walked from the engines' modules and ZeRO optimizers, or
  FSDP2's modules and optimizer):

  - parameters: what the model computes with (ZeRO-3: the partitions and what stays gathered;
    ZeRO-1/2: the full flat buffer; FSDP2: the sharded parameters);
  - fp32 master: the optimizer's own fp32 partition where it is a separate buffer;
  - gradients: gradient partitions / flat buffers (FSDP2: its sharded ``.grad``, None after
    ``zero_grad()``);
  - buckets: reduction / all-gather buckets;
  - optimizer states: AdamW's ``exp_avg`` and ``exp_avg_sq`` (and ``step``);
  - other: everything else alive that the walk does not name (reported by attribute name);

* activations: the tensors the autograd graph of the last forward saved for backward (walked
  from the loss before ``backward``), not counted above;
* peak live: every tensor alive when the last step starts (counted as above, plus every other
  live tensor) and the largest net growth of allocated bytes during the step (torch.profiler's
  allocation events: activations, gathered ZeRO-3 blocks, buckets, the optimizer's temporaries),
  with the phase (forward, backward, step) where it peaks; without the scratch buffers gloo
  allocates inside a collective (see ``_allocations``). A free of a tensor from before the step
  is not in the profiler's record, so this is an upper bound. On a GPU it is what
  ``max_memory_allocated`` measures;
* peak RSS: the process's resident high-water mark above its resident set before the build (what
  peers.py reports), over the steps before the profiled one (the profiler's records are resident
  too): peak live plus the CPU allocator's slack, minus buffers never touched (not resident on a
  CPU; a GPU allocates them in full);
* resident memory by phase (CPU): the build's high-water mark, what stays resident after the build
  and after each step, beside the live tensors: the difference is free memory the C allocator keeps
  in its heap for reuse (see the table's caption).

Counted bytes are exact and hardware-independent; RSS is this machine's. Max over ranks.

Prints a table; writes benchmarks/results/memory_breakdown.json and .png.

Usage: python benchmarks/memory_breakdown.py [--sizes small large] [--dtypes fp32 bf16] [--repeat K] [--at-peak]
"""
from __future__ import annotations

import gc

import _bench as B
import peers

CATEGORIES = ("parameters", "fp32 master", "gradients", "buckets", "optimizer states", "other")
# ZeRO optimizer attributes (DeepSpeed 0.19) -> bucket; anything else holding a tensor is "other: <name>".
_ATTRS = {
    "bit16_groups_flat": "parameters", "parallel_partitioned_bit16_groups": "parameters",
    "bit16_groups": "parameters", "fp16_partitioned_groups_flat": "parameters",
    "fp16_partitioned_groups": "parameters", "fp16_groups": "parameters",
    "single_partition_of_fp32_groups": "fp32 master", "fp32_partitioned_groups_flat": "fp32 master",
    "grads_in_partition": "gradients", "averaged_gradients": "gradients", "all_grad_tensors": "gradients",
    "grad_partitions_flat_buffer": "gradients",
    "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition": "gradients",
    "ipg_buckets": "buckets", "_DeepSpeedZeroOptimizer_Stage3__ipg_bucket_flat_buffer": "buckets",
}


class _Ledger:
    """Storages seen so far (by data pointer) and the bucket each one was first put in."""

    def __init__(self):
        self.owner = {}  # data_ptr -> (category, detail)
        self.nbytes = {}

    def add(self, t, category, detail=""):
        import torch
        if not isinstance(t, torch.Tensor):
            return
        local = getattr(t, "_local_tensor", None)  # a DTensor: its shard
        t = t if local is None else local
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        ptr = storage.data_ptr()
        if storage.nbytes() == 0 or ptr in self.owner:
            return
        self.owner[ptr] = (category, detail)
        self.nbytes[ptr] = storage.nbytes()

    def walk(self, obj, category, detail="", depth=0):
        import torch

        from deepspeed_multi.zero.stage3.lazy_grads import LazyGradPartitions
        if isinstance(obj, torch.Tensor):
            self.add(obj, category, detail)
            ds = getattr(obj, "ds_tensor", None)
            if ds is not None:
                self.add(ds, category, detail)
            if obj.grad is not None:
                self.add(obj.grad, "gradients", detail)
        elif depth < 4 and isinstance(obj, LazyGradPartitions):  # a lookup would allocate: the allocated ones
            self.walk(obj.buffers, category, detail, depth + 1)
        elif depth < 4 and isinstance(obj, dict):
            for v in obj.values():
                self.walk(v, category, detail, depth + 1)
        elif depth < 4 and isinstance(obj, (list, tuple, set)):
            for v in obj:
                self.walk(v, category, detail, depth + 1)
        elif depth < 4 and hasattr(obj, "buffer") and hasattr(obj, "elements"):  # an IPG bucket
            self.walk(obj.buffer, category, detail, depth + 1)

    def totals(self):
        out = {}
        for ptr, (category, detail) in self.owner.items():
            key = category if category != "other" else f"other: {detail}"
            out[key] = out.get(key, 0) + self.nbytes[ptr]
        return out


def _walk_zero_optimizer(ledger, opt):
    inner = getattr(opt, "optimizer", None)
    if inner is not None and hasattr(inner, "state"):
        for state in inner.state.values():
            ledger.walk(state, "optimizer states", "AdamW")
    for name, value in vars(opt).items():
        category = _ATTRS.get(name)
        if category is not None:
            ledger.walk(value, category, name)
    for name, value in vars(opt).items():  # what the names above do not cover, by attribute
        if name not in _ATTRS and name != "optimizer":
            ledger.walk(value, "other", f"{type(opt).__name__}.{name}")


def persistent(variant, unnamed=True) -> "_Ledger":
    """Tensors alive now, by bucket (see the module doc); ``unnamed``: also every other live tensor
    (tensors that autograd saved and Python also holds are among them while a graph is alive)."""
    import torch
    gc.collect()
    ledger = _Ledger()
    for holder in variant.holders:
        if isinstance(holder, torch.optim.Optimizer):  # FSDP2's
            for state in holder.state.values():
                ledger.walk(state, "optimizer states", "AdamW")
            continue
        module = getattr(holder, "module", holder)
        for p in module.parameters():
            ledger.walk(p, "parameters", "module parameters")
        opt = getattr(holder, "optimizer", None)
        if opt is not None:
            _walk_zero_optimizer(ledger, opt)
    for obj in gc.get_objects() if unnamed else ():  # every other live tensor
        if isinstance(obj, torch.Tensor):
            ledger.add(obj, "other", "unnamed tensors")
    return ledger


def activations(loss, known) -> int:
    """Bytes of the tensors saved for backward in ``loss``'s graph, not already in ``known``."""
    import torch
    seen, stack, total, counted = set(), [loss.grad_fn], 0, set(known.owner)
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for name in dir(node):
            if name.startswith("_saved_"):
                try:
                    value = getattr(node, name)
                except RuntimeError:  # freed
                    continue
                for t in value if isinstance(value, (list, tuple)) else (value, ):
                    if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
                        ptr = t.untyped_storage().data_ptr()
                        if ptr not in counted:
                            counted.add(ptr)
                            total += t.untyped_storage().nbytes()
        stack.extend(n for n, _ in node.next_functions)
    return total


def _phase_of(prof, t_us):
    """The ``phase:*`` record_function range holding ``t_us`` (profiler-relative microseconds)."""
    for ev in prof.events():
        if ev.name.startswith("phase:") and ev.time_range.start <= t_us <= ev.time_range.end:
            return ev.name.split(":", 1)[1]
    return "between phases"


def _allocations(prof):
    """The profiler's allocation events (bytes: + allocated, - freed), in time order, each with the
    three innermost operators that made it, without what a collective allocates for itself: gloo
    copies a reduce-scatter's input and gathers into a scratch buffer (inside the ``c10d::`` op or
    its worker's ``gloo:`` range) and frees them on its worker thread whenever that thread gets to
    it (FSDP2's backward peak moved by 28 MiB between runs with them, on a 264 MiB peak), and NCCL,
    which the CPU stand-in is for, works in place."""
    from torch._C._profiler import _EventType

    def walk(nodes, ops=()):
        for node in nodes:
            if node.tag == _EventType.Allocation:
                yield node, ops
            else:
                yield from walk(node.children, ops + (node.name, ))

    events = sorted(walk(prof.profiler.kineto_results.experimental_event_tree()), key=lambda e: e[0].start_time_ns)
    backend, kept = set(), []
    for event, ops in events:
        ptr, size = event.extra_fields.ptr, event.extra_fields.alloc_size
        if size > 0 and any(op.startswith(("c10d::", "gloo:")) for op in ops):
            backend.add(ptr)
        elif size < 0 and ptr in backend:
            backend.discard(ptr)  # its free; the address may be reused by a counted tensor later
        else:
            kept.append((event, " < ".join(reversed([op for op in ops if not op.startswith("phase:")][-3:]))))
    return kept


def _at_peak(events, upto, top=12):
    """The allocations made in the step and still alive at event ``upto`` (the peak), grouped by the
    three innermost operators that made them: [(MiB, count, operators)], largest first."""
    live = {}
    for event, who in events[:upto + 1]:
        f = event.extra_fields
        if f.alloc_size > 0:
            live[f.ptr] = (f.alloc_size, who)
        else:
            live.pop(f.ptr, None)
    groups = {}
    for size, who in live.values():
        total, count = groups.get(who, (0, 0))
        groups[who] = (total + size, count + 1)
    return sorted(((b / B.MB, n, who) for who, (b, n) in groups.items()), reverse=True)[:top]


def profiled_step(variant, i):
    """Step ``i`` with the profiler recording every allocation and free: the state and activations
    (see the module doc), and the largest net growth of allocated bytes over the step, with the
    phase it falls in. A free of a tensor from before the step is not recorded (the profiler does
    not know its size), so the growth is an upper bound."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function
    out = {}
    cuda = B.device().type == "cuda"
    if cuda:  # the allocator's own count, which "peak live" stands in for on CPU
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        out["cuda_start"] = torch.cuda.memory_allocated()
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])],
                 profile_memory=True) as prof:
        with record_function("phase:forward"):
            loss = variant.loss(i)
        out["activations"] = activations(loss, persistent(variant, unnamed=False))
        with record_function("phase:backward"):
            variant.backward(loss)
        del loss
        out["state"] = persistent(variant).totals()  # gradients, parameters and optimizer states all alive
        with record_function("phase:step"):
            variant.update()
    if cuda:
        torch.cuda.synchronize()
        out["cuda_peak"] = torch.cuda.max_memory_allocated()
    net = peak = 0
    at = upto = None
    events = [(e, who) for e, who in _allocations(prof) if e.extra_fields.device.type == B.device().type]
    for k, (e, _) in enumerate(events):
        net += e.extra_fields.alloc_size
        if net > peak:
            peak, at, upto = net, e.start_time_ns, k
    out["growth"] = peak
    out["at_peak"] = [] if upto is None else _at_peak(events, upto)
    start_ns = prof.profiler.kineto_results.trace_start_ns()
    out["peak_phase"] = "-" if at is None else _phase_of(prof, (at - start_ns) / 1000)
    return out


def breakdown(size, variant_name, dtype, steps=3) -> dict:
    import deepspeed.comm as dist
    mem = B.PeakMemory()
    variant = peers.build_variant(variant_name, size, *peers._models(size), dtype)  # the originals are dropped
    gc.collect()
    rss = {} if mem.gpu else {"build peak": mem.resident_mb("VmHWM"), "after build": mem.resident_mb()}
    for i in range(steps - 1):
        variant.step(i)
        if not mem.gpu:
            rss[f"after step {i + 1}"] = mem.resident_mb()
    peak = mem.peak_mb()  # before the profiled step: the profiler's own records are resident memory too
    gc.collect()
    live = sum(persistent(variant).totals().values())
    if rss:
        rss["live tensors"] = live / B.MB
    step = profiled_step(variant, steps - 1)
    row = {"size": size, "variant": variant_name, "dtype": dtype, "device": B.device().type, "peak_rss_mb": peak,
           "activations_mb": step["activations"] / B.MB,
           "by_buffer_mb": {k: v / B.MB for k, v in step["state"].items()},
           "live_at_step_start_mb": live / B.MB, "step_growth_mb": step["growth"] / B.MB,
           "peak_live_mb": (live + step["growth"]) / B.MB, "peak_phase": step["peak_phase"], "at_peak": step["at_peak"],
           "rss_phases_mb": rss}
    if "cuda_peak" in step:
        row["cuda_at_step_start_mb"] = step["cuda_start"] / B.MB
        row["cuda_step_peak_mb"] = step["cuda_peak"] / B.MB
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    highest = max(rows, key=lambda r: r["peak_live_mb"])  # the rank whose peak is reported: its phase, its tensors
    row["peak_phase"], row["at_peak"] = highest["peak_phase"], highest["at_peak"]
    row["rss_phases_mb"] = {k: max(r["rss_phases_mb"][k] for r in rows) for k in rss}
    keys = set().union(*(r["by_buffer_mb"] for r in rows))
    row["by_buffer_mb"] = {k: max(r["by_buffer_mb"].get(k, 0.0) for r in rows) for k in keys}
    for key in ("activations_mb", "live_at_step_start_mb", "step_growth_mb", "peak_live_mb", "cuda_at_step_start_mb",
                "cuda_step_peak_mb"):
        if key in row:
            row[key] = max(r[key] for r in rows)
    return row


def _median_of_runs(runs):
    """One row per (size, dtype, variant): the first run's buffers (counted bytes do not change between
    runs) with the median of the runs' peaks, each run's peak live and peak RSS / FSDP2's from the same
    run, and each run's peak RSS (RSS moves between runs by more than live tensors do: see RSS_CAPTION)."""
    rows = []
    for i, first in enumerate(runs[0]):
        same = [run[i] for run in runs]
        row = dict(first)
        for key in ("peak_live_mb", "peak_rss_mb", "cuda_step_peak_mb"):
            if key in row:
                row[key] = B.median([r[key] for r in same])
        fsdp = [next(x for x in run if x["size"] == first["size"] and x["dtype"] == first["dtype"]
                     and x["variant"] == "FSDP2") for run in runs]
        row["live_ratio_runs"] = [r["peak_live_mb"] / f["peak_live_mb"] for r, f in zip(same, fsdp)]
        row["live_ratio"] = B.median(row["live_ratio_runs"])  # paired: each run against FSDP2's of that run
        if "peak_rss_mb" in row:
            row["peak_rss_runs_mb"] = [r["peak_rss_mb"] for r in same]
            row["rss_ratio_runs"] = [r["peak_rss_mb"] / f["peak_rss_mb"] for r, f in zip(same, fsdp)]
            row["rss_ratio"] = B.median(row["rss_ratio_runs"])
        row["rss_phases_mb"] = {k: B.median([r["rss_phases_mb"][k] for r in same]) for k in first.get("rss_phases_mb", {})}
        rows.append(row)
    return rows


RSS_CAPTION = ("Resident memory by phase (CPU; MiB above the resident set before the build, median over repeats): "
               "the build's high-water mark (the user's model, its copy and the engines' construction copies), what "
               "stays resident after the build and after each step, and the live tensors at the start of the last "
               "step; resident - live is the C allocator's free memory kept in the heap (glibc reuses it for the next "
               "allocations instead of returning it) and what the walk does not see. Which heap a thread's allocations "
               "land in, and so how much of it stays resident, changes from run to run: read peak RSS / FSDP2 with the "
               "range of its runs.")


def rss_table(rows) -> str:
    """The resident set by phase (CPU runs only; "" on a GPU)."""
    keys = list(next((r["rss_phases_mb"] for r in rows if r.get("rss_phases_mb")), {}))
    if not keys:
        return ""
    steps = [k for k in keys if k.startswith("after step")]
    return B.fmt_table(["size", "dtype", "variant", "build peak", "after build", *steps, "peak RSS",
                        "peak RSS / FSDP2 (runs)", "live tensors", "resident - live"],
                       [[r["size"], r["dtype"], r["variant"]] + [f"{r['rss_phases_mb'][k]:.1f}"
                                                                for k in ("build peak", "after build", *steps)]
                        + [f"{r['peak_rss_mb']:.1f}", _ratio_runs(r, "rss"), f"{r['rss_phases_mb']['live tensors']:.1f}",
                           f"{r['rss_phases_mb'][steps[-1]] - r['rss_phases_mb']['live tensors']:.1f}"]
                        for r in rows])


def _ratio_runs(row, key):
    """``row``'s median ``key`` ratio to FSDP2's with the runs' range where there are several."""
    runs = row[f"{key}_ratio_runs"]
    return f"{row[key + '_ratio']:.2f}" + (f" ({min(runs):.2f}-{max(runs):.2f})" if len(runs) > 1 else "")


def _column(row, category):
    return sum(v for k, v in row["by_buffer_mb"].items() if k == category or (category == "other" and
                                                                             k.startswith("other")))


_SUFFIX = {peers.DEEPSPEED_SIZES: "_deepspeed_sizes", peers.PER_BLOCK: "_per_block", peers.BOTH_ZERO3: "_z3z3",
           peers.BOTH_ZERO3_PER_BLOCK: "_z3z3_per_block"}  # of the RESULT keys


def plotter(rows):
    """The plot of ``rows``: each variant's buffers stacked, its peak live tensors and peak RSS marked;
    the axis stops above the largest peak, so the super-module's 5e8-element bucket is cut (labelled)."""

    def plot(plt):
        import numpy as np
        fig, ax = plt.subplots(figsize=(12, 4.2))
        short = {peers.VARIANTS[0]: "ours", peers.DEEPSPEED_SIZES: "ours,\nDS sizes", peers.PER_BLOCK: "ours,\nper block", peers.BOTH_ZERO3: "ours\nZ3+Z3",
                 peers.BOTH_ZERO3_PER_BLOCK: "ours Z3+Z3,\nper block",
                 peers.VARIANTS[1]: "super", peers.VARIANTS[2]: "FSDP2"}
        x = np.arange(len(rows))
        bottom = np.zeros(len(rows))
        for c in CATEGORIES:
            vals = np.array([_column(r, c) for r in rows])
            ax.bar(x, vals, bottom=bottom, label=c)
            bottom += vals
        acts = np.array([r["activations_mb"] for r in rows])
        ax.bar(x, acts, bottom=bottom, label="activations")
        top = 1.15 * max(max(r["peak_rss_mb"], r["peak_live_mb"]) for r in rows if r["variant"] != peers.VARIANTS[1])
        for i, total in enumerate(bottom + acts):
            if total > top:
                ax.text(i, top * 0.97, f"{total:.0f}", ha="center", va="top", fontsize=7, rotation=90)
        ax.scatter(x, [r["peak_live_mb"] for r in rows], color="k", marker="_", s=250, label="peak live", zorder=3)
        ax.scatter(x, [r["peak_rss_mb"] for r in rows], color="grey", marker="x", s=25, label="peak RSS", zorder=3)
        ax.set_ylim(0, top)
        ax.set_xticks(x)
        ax.set_xticklabels([f"{r['size']} {r['dtype']}\n{short[r['variant']]}" for r in rows], fontsize=7)
        ax.set_ylabel("MiB per rank")
        ax.set_title("Encoder -> LLM: what each rank holds after the backward, by buffer; peak live and peak RSS")
        ax.legend(fontsize=7, ncol=3)
        return fig

    return plot


def main():
    ap = B.arg_parser(__doc__)
    ap.add_argument("--sizes", nargs="+", default=list(peers.SIZES), choices=list(peers.SIZES))
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    variants = (peers.VARIANTS[:1] + [peers.PER_BLOCK, peers.DEEPSPEED_SIZES, peers.BOTH_ZERO3, peers.BOTH_ZERO3_PER_BLOCK]
                + peers.VARIANTS[1:])
    ap.add_argument("--variants", nargs="+", default=variants, choices=variants,
                    help="FSDP2 is always run (the baseline)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run every variant this many times (fresh processes each) and report the median peak; "
                         "peak live moves by a few MiB between runs (when the ranks' collectives free buffers)")
    ap.add_argument("--at-peak", action="store_true",
                    help="also list what each variant allocated in the step and still held at its peak, by operator")
    args = ap.parse_args()
    args.dtypes = B.dtypes_here(args.dtypes)
    variants = [v for v in variants if v in args.variants or v == "FSDP2"]
    runs = [[B.launch(breakdown, s, v, dt)[0] for s in args.sizes for dt in args.dtypes for v in variants]
            for _ in range(args.repeat)]
    rows = _median_of_runs(runs)
    table_rows = []
    cuda = all("cuda_step_peak_mb" in r for r in rows)
    for r in rows:
        state = sum(r["by_buffer_mb"].values())
        fsdp = next(x for x in rows if x["size"] == r["size"] and x["dtype"] == r["dtype"] and x["variant"] == "FSDP2")
        fsdp_state = sum(fsdp["by_buffer_mb"].values())
        r["state_mb"] = state
        table_rows.append([r["size"], r["dtype"], r["variant"]] + [f"{_column(r, c):.1f}" for c in CATEGORIES]
                          + [f"{state:.1f}", f"{state / fsdp_state:.2f}", f"{r['activations_mb']:.1f}",
                             f"{r['peak_live_mb']:.1f} ({r['peak_phase']})",
                             _ratio_runs(r, "live"), f"{r['peak_rss_mb']:.1f}", _ratio_runs(r, "rss")]
                          + ([f"{r['cuda_step_peak_mb']:.1f}", f"{r['cuda_step_peak_mb'] / fsdp['cuda_step_peak_mb']:.2f}"]
                             if cuda else []))
    table = B.fmt_table(["size", "dtype", "variant"] + [f"{c} MiB" for c in CATEGORIES]
                        + ["state MiB", "state / FSDP2", "activations MiB", "peak live MiB (phase)",
                           "peak live / FSDP2" + (f" (median of {args.repeat}, range)" if args.repeat > 1 else ""),
                           *(["allocated peak, build + steps 1-2 MiB", "/ FSDP2"] if cuda
                                                  else ["peak RSS MiB", "peak RSS / FSDP2"
                                                        + (f" (median of {args.repeat}, range)" if args.repeat > 1 else "")])]
                        + (["cuda max allocated in step MiB", "/ FSDP2"] if cuda else []), table_rows)
    others = sorted({k for r in rows for k in r["by_buffer_mb"] if k.startswith("other")})
    detail = B.fmt_table(["size", "dtype", "variant"] + others,
                         [[r["size"], r["dtype"], r["variant"]]
                          + [f"{r['by_buffer_mb'].get(k, 0.0):.1f}" for k in others]
                          for r in rows]) if others else ""
    print(f"\nPer rank, step 3 (max over {B.WORLD_SIZE} ranks on {rows[0]['device']}); state = the buffers' sum "
          f"after the last backward; peak RSS = {B.memory_kind()}\n")
    print(table)
    phases = rss_table(rows)
    if phases:
        print(f"\n{RSS_CAPTION}\n")
        print(phases)
    if detail:
        print("\n'other', by the attribute that holds it:\n")
        print(detail)
    if args.at_peak:
        for r in runs[0]:
            print(f"\nAt the peak of {r['size']} {r['dtype']} {r['variant']} ({r['peak_live_mb']:.1f} MiB, "
                  f"{r['peak_phase']}): allocated in the step and alive, by the operators that made it\n")
            print(B.fmt_table(["MiB", "tensors", "operators (innermost first)"],
                              [[f"{mb:.2f}", n, who] for mb, n, who in r["at_peak"]]))
    result = "RESULT " + " ".join(
        f"{key}_vs_fsdp2_{r['size']}_{r['dtype']}{_SUFFIX.get(r['variant'], '')}="
        f"{r[key + '_ratio'] if key in ('live', 'rss') else r[field] / f[field]:.2f}"
        for r in rows if r["variant"].startswith("ours")
        for f in rows if f["variant"] == "FSDP2" and f["size"] == r["size"] and f["dtype"] == r["dtype"]
        for key, field in (("state", "state_mb"), ("live", "peak_live_mb"), ("rss", "peak_rss_mb"))
        + ((("cuda", "cuda_step_peak_mb"), ) if cuda else ()))
    print(result)

    shown = (table + (f"\n\n'other', by the attribute that holds it:\n\n{detail}" if detail else "")
             + (f"\n\n{RSS_CAPTION}\n\n{phases}" if phases else ""))
    B.save("memory_breakdown", {"meta": B.meta(), "rows": rows, "table": shown, "result": result}, plotter(rows))


if __name__ == "__main__":
    main()
