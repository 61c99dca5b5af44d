"""Microbenchmark: fused gradient-bucket ops vs the unfused torch sequence ZeRO-2/3 runs today.

For each bucket (N gradient tensors of random sizes, T bytes of bucket in total) it times one
bucket round trip, without the collective itself:

* unfused:   per-tensor ``bucket.narrow(...).copy_(g.view(-1))``, ``bucket.div_(world_size)``,
             ``isinf(b).any() | isnan(b).any()``, then per tensor
             ``p.add_(bucket.narrow(...).view_as(p).float().mul_(1 / loss_scale))``;
* reference: ``deepspeed_multi.ops.reference`` pack + unpack_accumulate (pure PyTorch);
* fused:     the C++ extension's pack + unpack_accumulate (flags included);
* fused-mem: (CUDA) the same with every tensor table through device memory, none in the launch's
             arguments (the baseline of the small-table path; those tables are cached as fused's are);
* fused-nocache: (CUDA) fused with the table cache off: every call writes its tensor table to pinned
             memory and copies it to the device (the baseline of the cache: fused reuses the device
             table of a call on the same tensors, as a training step's second and later calls are);
* copy:      ``dst.copy_(src)`` moving the same number of bytes (the memory-bandwidth limit).

Then ZeRO-3's reduce-scatter input: DeepSpeed's per-tensor slicing, interleaved ``cat`` and
``div_`` against one ``pack_partitions`` call building the same buffer.

Bytes counted = read + written by the ideal fused round trip: grads read, bucket written, bucket
read, fp32 partitions read and written. Reports the median of several repetitions after
warm-up, prints a table, writes benchmarks/results/fused_reduce.json (+ .png if matplotlib is
installed) and ends with ``RESULT fused_vs_unfused=<x> fused_vs_copy=<y> scatter_input_vs_deepspeed=<z>``
for the largest bucket with at least 1000 tensors (and the 1000-tensor scatter input); on CUDA also
``fused_vs_nocache=<wall ms with the table cache off / on>`` for the 4,096-tensor 16 MB bucket.

Usage: python benchmarks/fused_reduce.py [--quick] [--dtype bf16|fp16|fp32] [--world-size 8] [--device cuda]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from deepspeed_multi.ops import builder, reference  # noqa: E402

RESULTS = Path(os.environ.get("BENCH_RESULTS", ROOT / "benchmarks" / "results"))
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MB = 1 << 20
# (number of tensors, bucket bytes)
FULL = [(16, 1 * MB), (32, 1 * MB), (64, 16 * MB), (1024, 16 * MB), (4096, 16 * MB), (1024, 64 * MB),
        (4096, 256 * MB), (16, 256 * MB)]
QUICK = [(16, 1 * MB), (1024, 16 * MB), (4096, 64 * MB)]


DEVICE = torch.device("cpu")  # main() sets it from --device


def make_bucket(n_tensors, nbytes, dtype, seed=0):
    """Gradients (model dtype), the flat bucket, and fp32 gradient partitions of the same sizes, on DEVICE."""
    gen = torch.Generator().manual_seed(seed)
    numel = nbytes // torch.empty((), dtype=dtype).element_size()
    weights = torch.rand(n_tensors, generator=gen) + 0.5
    sizes = (weights / weights.sum() * numel).long().clamp(min=1)
    sizes[-1] += numel - int(sizes.sum())
    grads = [torch.randn(int(n), generator=gen).to(DEVICE, dtype) for n in sizes]
    parts = [torch.zeros(int(n), device=DEVICE) for n in sizes]
    return grads, torch.empty(numel, dtype=dtype, device=DEVICE), parts


def unfused(grads, bucket, parts, world_size, inv_loss_scale):
    offset = 0
    for g in grads:
        bucket.narrow(0, offset, g.numel()).copy_(g.view(-1))
        offset += g.numel()
    bucket.div_(world_size)
    flag = torch.isinf(bucket).any() | torch.isnan(bucket).any()
    offset = 0
    for p in parts:
        p.add_(bucket.narrow(0, offset, p.numel()).view_as(p).float().mul_(inv_loss_scale))
        offset += p.numel()
    return flag


def fused_with(impl):
    def run(grads, bucket, parts, world_size, inv_loss_scale):
        flag = impl.pack(grads, bucket, 1.0 / world_size)
        return flag + impl.unpack_accumulate(bucket, parts, inv_loss_scale, True)

    return run


def fused_with_switch(ext, switch, value):
    """The fused op with one of the extension's CUDA switches (``switch(value) -> previous``) set for each call:
    ``set_cuda_inline_tensors(0)`` sends every table through device memory (fused-mem),
    ``set_cuda_table_cache(0)`` builds and copies the table at every call (fused-nocache)."""
    fused = fused_with(ext)

    def run(*args):
        previous = switch(value)
        try:
            return fused(*args)
        finally:
            switch(previous)

    return run


def _sync():
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def median_time(fn, reps, warmup=2):
    """Median wall time of ``fn`` from an idle device to its last kernel's end (launches included)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        _sync()
        start = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


SPIN_CYCLES = 20_000_000  # about 10 ms of an H100's clock: longer than the host takes to enqueue a fused op


def device_time(fn, reps, warmup=2):
    """GPU time alone (CUDA): the op's launches are queued behind a spin kernel, so the host work
    of building them is hidden, as it is in a training step where the host runs ahead of the GPU.
    Where the host takes longer than the spin (the unfused sequence of 4,096 tensors), its gaps count."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        torch.cuda._sleep(SPIN_CYCLES)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def bench_bucket(n_tensors, nbytes, dtype, methods, world_size, reps):
    grads, bucket, parts = make_bucket(n_tensors, nbytes, dtype)
    numel = bucket.numel()
    traffic = 2 * numel * bucket.element_size() + numel * bucket.element_size() + 2 * numel * 4
    copy_src = torch.ones(traffic // 8, device=DEVICE)  # float32: traffic/2 bytes read, traffic/2 written
    copy_dst = torch.empty_like(copy_src)
    ops = {"copy": lambda: copy_dst.copy_(copy_src)}
    ops.update({name: (lambda fn=fn: fn(grads, bucket, parts, world_size, 1 / 1024.0)) for name, fn in methods.items()})
    times = {name: median_time(op, reps) for name, op in ops.items()}
    gpu = {name: device_time(op, reps) for name, op in ops.items()} if DEVICE.type == "cuda" else {}
    rows = []
    for name, seconds in times.items():
        rows.append({
            "tensors": n_tensors, "bucket_mb": nbytes / MB, "method": name, "ms": seconds * 1e3,
            "gb_per_s": traffic / seconds / 1e9, "speedup_vs_unfused": times["unfused"] / seconds,
            "fraction_of_copy": times["copy"] / seconds,
        })
        if gpu:
            rows[-1].update(device_ms=gpu[name] * 1e3, device_fraction_of_copy=gpu["copy"] / gpu[name])
    return rows


def print_table(rows):
    gpu = "device_ms" in rows[0]
    header = f"{'tensors':>7} {'bucket MB':>9} {'method':>13} {'ms':>9} {'GB/s':>7} {'x unfused':>9} {'of copy':>7}"
    header += f" {'GPU ms':>9} {'GPU of copy':>11}" if gpu else ""
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['tensors']:>7} {r['bucket_mb']:>9.0f} {r['method']:>13} {r['ms']:>9.3f} {r['gb_per_s']:>7.2f} "
              f"{r['speedup_vs_unfused']:>9.2f} {r['fraction_of_copy']:>7.2f}" +
              (f" {r['device_ms']:>9.3f} {r['device_fraction_of_copy']:>11.2f}" if gpu else ""))
    if gpu:
        print("ms: host and GPU, from an idle GPU to the op's end; GPU ms: the GPU alone (launches queued "
              "behind a spin kernel, see device_time)")


def plot(rows, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed; skipping the PNG (pip install matplotlib)")
        return
    buckets = sorted({(r["tensors"], r["bucket_mb"]) for r in rows}, key=lambda b: (b[1], b[0]))
    labels = [f"{n}x / {mb:.0f} MB" for n, mb in buckets]
    methods = ["copy", "fused", "reference", "unfused"]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(methods)
    for i, m in enumerate(methods):
        values = [next((r["gb_per_s"] for r in rows if (r["tensors"], r["bucket_mb"]) == b and r["method"] == m), 0)
                  for b in buckets]
        ax.bar([x + i * width for x in range(len(buckets))], values, width, label=m)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(buckets))], labels, rotation=20)
    ax.set_ylabel("GB/s (bytes read + written)")
    where = torch.cuda.get_device_name() if DEVICE.type == "cuda" else f"{torch.get_num_threads()} CPU threads"
    ax.set_title(f"Gradient bucket round trip, {where}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def deepspeed_scatter_input(grads, world_size):
    """What DeepSpeed's reduce_scatter_coalesced does before its collective (ZeRO-3): slice each
    gradient into world_size chunks, interleave them rank by rank with padding, cat, pre-divide."""
    chunks = [-(-g.numel() // world_size) for g in grads]
    parts = []
    for r in range(world_size):
        for g, c in zip(grads, chunks):
            chunk = g.view(-1)[r * c:r * c + c]
            parts.append(chunk)
            if chunk.numel() < c:
                parts.append(torch.empty(c - chunk.numel(), dtype=g.dtype, device=g.device))
    return torch.cat(parts).div_(world_size)


def bench_scatter_input(ext, dtype, world_size, quick):
    """pack_partitions (one call) vs DeepSpeed's sequence, both producing the same buffer."""
    rows = []
    for n_tensors, nbytes in [(400, 1 * MB), (1000, 16 * MB)] + ([] if quick else [(4000, 64 * MB)]):
        grads, _, _ = make_bucket(n_tensors, nbytes, dtype)
        total = world_size * sum(-(-g.numel() // world_size) for g in grads)
        out = torch.zeros(total, dtype=dtype, device=DEVICE)
        fused = median_time(lambda: ext.pack_partitions(grads, out, world_size, 1.0 / world_size), 15)
        base = median_time(lambda: deepspeed_scatter_input(grads, world_size), 15)
        rows.append({"tensors": n_tensors, "bucket_mb": nbytes / MB, "deepspeed_ms": base * 1e3,
                     "fused_ms": fused * 1e3, "speedup": base / fused})
    print(f"\nZeRO-3 reduce-scatter input ({world_size} ranks, {dtype}): DeepSpeed's slice + cat + div vs "
          "pack_partitions")
    print("| tensors | bucket MB | DeepSpeed ms | pack_partitions ms | speedup |\n|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['tensors']} | {r['bucket_mb']:.0f} | {r['deepspeed_ms']:.3f} | {r['fused_ms']:.3f} | "
              f"{r['speedup']:.2f} |")
    return rows


def main():
    parser = argparse.ArgumentParser(description="fused gradient-bucket ops microbenchmark")
    parser.add_argument("--quick", action="store_true", help="fewer, smaller buckets and repetitions")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="gradient and bucket dtype")
    parser.add_argument("--world-size", type=int, default=8, help="pre-divide factor")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="where the buckets live (cuda: the CUDA kernels, timed to the device's idle)")
    args = parser.parse_args()
    dtype = DTYPES[args.dtype]
    global DEVICE
    DEVICE = torch.device(args.device)
    ext = builder.load()
    if DEVICE.type == "cuda" and not ext.has_cuda:
        sys.exit("--device cuda: the extension was built without its CUDA kernels (nvcc not found?)")
    methods = {"unfused": unfused, "reference": fused_with(reference), "fused": fused_with(ext)}
    if DEVICE.type == "cuda":
        methods["fused-mem"] = fused_with_switch(ext, ext.set_cuda_inline_tensors, 0)
        methods["fused-nocache"] = fused_with_switch(ext, ext.set_cuda_table_cache, 0)
    rows = []
    for n_tensors, nbytes in QUICK if args.quick else FULL:
        reps = 3 if args.quick else (5 if nbytes >= 64 * MB else 15)
        rows += bench_bucket(n_tensors, nbytes, dtype, methods, args.world_size, reps)
    where = torch.cuda.get_device_name() if DEVICE.type == "cuda" else platform.processor() or platform.machine()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, grads/bucket {dtype}, fp32 partitions, "
          f"{where}")
    print_table(rows)
    RESULTS.mkdir(parents=True, exist_ok=True)
    import _bench
    meta = {**_bench.meta(), "threads": torch.get_num_threads(), "dtype": args.dtype,
            "world_size": args.world_size, "quick": args.quick, "device": where if DEVICE.type == "cuda" else "cpu"}
    scatter = bench_scatter_input(ext, dtype, args.world_size, args.quick)
    (RESULTS / "fused_reduce.json").write_text(json.dumps({"meta": meta, "rows": rows, "scatter_input": scatter},
                                                          indent=1) + "\n")
    print(f"wrote {RESULTS / 'fused_reduce.json'}")
    plot(rows, RESULTS / "fused_reduce.png")
    many = [r for r in rows if r["tensors"] >= 1000 and r["method"] == "fused"]
    key = max(many, key=lambda r: (r["bucket_mb"], r["tensors"]))
    device = f" fused_vs_copy_gpu={key['device_fraction_of_copy']:.2f}" if "device_ms" in key else ""
    by = {r["method"]: r for r in rows if (r["tensors"], r["bucket_mb"]) == (4096, 16)}
    if "fused-nocache" in by:
        device += f" fused_vs_nocache={by['fused-nocache']['ms'] / by['fused']['ms']:.2f}"
    print(f"RESULT fused_vs_unfused={key['speedup_vs_unfused']:.2f} fused_vs_copy={key['fraction_of_copy']:.2f}{device} "
          f"scatter_input_vs_deepspeed={scatter[1]['speedup']:.2f}")


if __name__ == "__main__":
    main()
