"""Overhead of deepspeed_multi on the single-engine path it replaces.

The same model (a few transformer blocks) is trained twice, side by side in the same ranks:

* upstream: ``deepspeed.initialize`` + ``engine.backward(loss)`` + ``engine.step()``
* ours:     ``deepspeed_multi.initialize`` + plain ``loss.backward()`` + ``engine.step()``

for ZeRO stages 1/2/3 in fp32 and bf16. Steps are interleaved (the order alternates every
step), timed as fwd+bwd+step, median over the timed steps. Peak memory of each variant is
measured alone in fresh processes (see [Note: how time and memory are measured] in _bench).

Prints a table and ``RESULT overhead_ratio_z1=.. overhead_ratio_z2=.. overhead_ratio_z3=..``
(ours / upstream step time, fp32; goal <= 1.00 within noise), writes
benchmarks/results/overhead.json and overhead.png.

``--watchdog``, ``--rank-agreement``, ``--meet``, ``--bucket-size``, ``--lazy-grads``, ``--cast-on-gather``,
``--block-sizes``, ``--block-floor``, ``--rank-order`` and ``--overflow-by-norm`` measure one feature instead: a
third variant, ours with that feature off (``watchdog_timeout_s=0``, ``DSM_CHECK_RANK_AGREEMENT=0``,
``agree_before_collectives=false``, ``DSM_BUCKET_SIZE=0``, ``DSM_ZERO3_LAZY_GRADS=0``, ``DSM_ZERO3_CAST_ON_GATHER=0``,
``DSM_BLOCK_SIZES=0``, ``min_block_elements=0``, ``DSM_ZERO3_RANK_ORDER=0`` or ``DSM_ZERO12_OVERFLOW_BY_NORM=0``),
runs interleaved with the other two; the table gives ours (feature on, the default) / ours (off) as a paired
ratio beside the upstream baseline of the same run, prints ``RESULT watchdog_ratio_z1=.. ..`` (``rank_agreement_ratio_..``,
``overflow_by_norm_ratio_..``) and writes results/overhead_watchdog.json (and so on). ``--dtypes``
picks the dtypes of that mode (default fp32; the overflow flag exists only in bf16/fp16, so at
fp32, and at ZeRO-3 for ``--overflow-by-norm``, on and off are the same code: an A/A control).

Usage: python benchmarks/overhead.py [--steps 15] [--warmup 4] [--no-memory] [--quick]
                                     [--watchdog | --rank-agreement | --meet | --overflow-by-norm [--dtypes fp32 bf16]]
"""
from __future__ import annotations

import copy
import os
from unittest import mock

import _bench as B

# BENCH_OVERHEAD_DIM / BENCH_OVERHEAD_LAYERS size the model (the spawned ranks read them too): the
# default is small enough for 2 CPU ranks; a GPU needs a large one to be busy (e.g. 2048 and 8).
D = int(os.environ.get("BENCH_OVERHEAD_DIM", "256"))
LAYERS = int(os.environ.get("BENCH_OVERHEAD_LAYERS", "3"))
SEQ, MICRO_BS = 32, 8

# --watchdog / --rank-agreement / --overflow-by-norm: what turns the feature off in the third variant.
FEATURES = {"watchdog": {"config": {"watchdog_timeout_s": 0}, "env": {}},
            "rank_agreement": {"config": {}, "env": {"DSM_CHECK_RANK_AGREEMENT": "0"}},
            "overflow_by_norm": {"config": {}, "env": {"DSM_ZERO12_OVERFLOW_BY_NORM": "0"}},
            "meet": {"config": {"agree_before_collectives": False}, "env": {}},
            "bucket_size": {"config": {}, "env": {"DSM_BUCKET_SIZE": "0"}},
            "lazy_grads": {"config": {}, "env": {"DSM_ZERO3_LAZY_GRADS": "0"}},
            "cast_on_gather": {"config": {}, "env": {"DSM_ZERO3_CAST_ON_GATHER": "0"}},
            "block_sizes": {"config": {}, "env": {"DSM_BLOCK_SIZES": "0"}},
            # Off: the block's sizes however small the block (no floor), FSDP2's per-block granularity; on this
            # model (under the floor) the default is one bucket, gathered whole, so this is what the floor saves.
            "block_floor": {"config": {"min_block_elements": 0}, "env": {}},
            "rank_order": {"config": {}, "env": {"DSM_ZERO3_RANK_ORDER": "0"}}}


# The interleaved timing run's deadline: with bf16 run on a CPU without bf16 kernels (BENCH_BF16=1), a feature
# run (three variants interleaved, fp32 and bf16, 60 steps) takes over 15 minutes on 2 cores, past the
# launcher's default (900 s); a hang still ends at this one.
TIMING_DEADLINE_S = 3600


def _make(initialize, stage, dtype, model, **extra):
    return B.build_engine(initialize, model, B.ds_config(stage, dtype, micro_bs=MICRO_BS, **extra))


def _batch(i, dev):
    import torch
    g = torch.Generator().manual_seed(1000 + i)
    x = torch.randn(MICRO_BS, SEQ, D, generator=g)
    return x.to(dev), torch.randn(MICRO_BS, SEQ, D, generator=g).to(dev)


def _step_fn(kind, engine):
    dev = B.device()

    def step(i):
        x, y = _batch(i, dev)
        loss = ((engine(x) - y)**2).mean()
        if kind == "upstream":
            engine.backward(loss)
        else:
            loss.backward()
        engine.step()

    return step


def timing(configs, warmup, steps, feature_off=None):
    """All (stage, dtype) configs in one pair of processes, one config at a time; with
    ``feature_off`` (a FEATURES key) a third variant, ours with that feature off."""
    import gc

    import deepspeed
    import deepspeed_multi
    out = {}
    for stage, dtype in configs:
        model = B.Tower(D, D, LAYERS, D, seed=1)
        engines = {"upstream": _make(deepspeed.initialize, stage, dtype, copy.deepcopy(model)),
                   "ours": _make(deepspeed_multi.initialize, stage, dtype, copy.deepcopy(model))}
        if feature_off is not None:
            off = FEATURES[feature_off]
            with mock.patch.dict(os.environ, off["env"]):
                engines["ours_off"] = _make(deepspeed_multi.initialize, stage, dtype, copy.deepcopy(model),
                                            deepspeed_multi=off["config"])
        t = B.interleave({k: _step_fn(k, e) for k, e in engines.items()}, warmup, steps)
        out[(stage, dtype)] = {k: v["total"] for k, v in t.items()}
        engines.clear()
        gc.collect()
    return out


def memory(kind, stage, dtype, steps):
    import deepspeed
    import deepspeed_multi
    init = deepspeed.initialize if kind == "upstream" else deepspeed_multi.initialize
    return B.peak_memory_of_steps(
        lambda: _step_fn(kind, _make(init, stage, dtype, B.Tower(D, D, LAYERS, D, seed=1))), steps)


def main():
    ap = B.arg_parser(__doc__)
    ap.add_argument("--memory-bf16", action="store_true", help="also measure bf16 memory (6 more launches)")
    ap.add_argument("--quick", action="store_true", help="fp32 only, fewer steps")
    ap.add_argument("--watchdog", action="store_true", help="ours with the watchdog on vs off (see above)")
    ap.add_argument("--rank-agreement", action="store_true",
                    help="ours with the ZeRO-0/1 rank-agreement check on vs off (see above)")
    ap.add_argument("--meet", action="store_true",
                    help="ours with the ranks meeting at the store before collectives (agree_before_collectives) on vs off")
    ap.add_argument("--bucket-size", action="store_true",
                    help="ours with the bucket buffers sized for the engine (zero/bucket_size.py) on vs off")
    ap.add_argument("--lazy-grads", action="store_true",
                    help="ours with ZeRO-3's gradient partitions allocated per window (zero/stage3/lazy_grads.py) on vs off")
    ap.add_argument("--cast-on-gather", action="store_true",
                    help="ours with bf16 ZeRO-3's partition cast from the master at each gather "
                    "(zero/stage3/cast_on_gather.py) on vs off (use --dtypes bf16)")
    ap.add_argument("--block-sizes", action="store_true",
                    help="ours with the sizes a config leaves unset taken from the model's block (zero/block_sizes.py) "
                    "on vs off (DeepSpeed's defaults)")
    ap.add_argument("--block-floor", action="store_true",
                    help="ours with small blocks grouped up to min_block_elements (the default) vs per block "
                    "(min_block_elements=0, FSDP2's granularity)")
    ap.add_argument("--rank-order", action="store_true",
                    help="ours with ZeRO-3's bucket laid out in the reduce-scatter's rank order (zero/stage3/rank_order.py) "
                    "on vs off (packed at each flush)")
    ap.add_argument("--overflow-by-norm", action="store_true",
                    help="ours with the ZeRO-1/2 norm deciding overflow vs DeepSpeed's flag collective (see above)")
    ap.add_argument("--dtypes", nargs="+", default=["fp32"], choices=["fp32", "bf16"],
                    help="dtypes of --watchdog / --rank-agreement / --overflow-by-norm")
    args = ap.parse_args()
    for feature in FEATURES:  # each has its flag: --watchdog, --rank-agreement, --overflow-by-norm
        if getattr(args, feature):
            return feature_main(args, feature)
    if args.quick:
        args.steps, args.warmup = 6, 2
    dtypes = B.dtypes_here(["fp32"] if args.quick else ["fp32", "bf16"])
    rows, data = [], []
    configs = [(stage, dtype) for dtype in dtypes for stage in (1, 2, 3)]
    timings = B.launch(timing, configs, args.warmup, args.steps, timeout_s=TIMING_DEADLINE_S)[0]
    for stage, dtype in configs:
            t = timings[(stage, dtype)]
            up, ours = B.median(t["upstream"]), B.median(t["ours"])
            rec = {"stage": stage, "dtype": dtype, "upstream_ms": up, "ours_ms": ours,
                   "ratio": B.paired_ratio(t["ours"], t["upstream"]),
                   "upstream_iqr_ms": B.iqr(t["upstream"]), "ours_iqr_ms": B.iqr(t["ours"]), "raw_ms": t}
            if not args.no_memory and (dtype == "fp32" or args.memory_bf16):
                rec["upstream_mem_mb"] = B.launch(memory, "upstream", stage, dtype, 2)[0]
                rec["ours_mem_mb"] = B.launch(memory, "ours", stage, dtype, 2)[0]
                rec["mem_ratio"] = rec["ours_mem_mb"] / rec["upstream_mem_mb"]
            data.append(rec)
            mem = ([f"{rec['upstream_mem_mb']:.1f}", f"{rec['ours_mem_mb']:.1f}", f"{rec['mem_ratio']:.3f}"]
                   if "mem_ratio" in rec else ["-", "-", "-"])
            rows.append([f"ZeRO-{stage}", dtype, f"{up:.1f} ±{rec['upstream_iqr_ms']:.1f}",
                         f"{ours:.1f} ±{rec['ours_iqr_ms']:.1f}", f"{rec['ratio']:.3f}", *mem])
            print(f"  done ZeRO-{stage} {dtype}: upstream {up:.1f} ms, ours {ours:.1f} ms", flush=True)
    headers = ["stage", "dtype", "upstream ms (IQR)", "ours ms (IQR)", "time ours/up (paired)", "upstream peak MiB",
               "ours peak MiB", "mem ours/up"]
    table = B.fmt_table(headers, rows)
    model = B.Tower(D, D, LAYERS, D)
    print(f"\nOverhead: one engine, {LAYERS} blocks d={D} ({B.n_params(model) / 1e6:.2f}M params), micro-batch "
          f"{MICRO_BS}x{SEQ}, {B.WORLD_SIZE} rank(s), median of {args.steps} steps after {args.warmup} warm-up; "
          f"memory = {B.memory_kind()}\n")
    print(table)
    fp32 = {r["stage"]: r["ratio"] for r in data if r["dtype"] == "fp32"}
    result = "RESULT " + " ".join(f"overhead_ratio_z{s}={fp32[s]:.3f}" for s in (1, 2, 3))
    if "bf16" in dtypes:
        bf = {r["stage"]: r["ratio"] for r in data if r["dtype"] == "bf16"}
        result += " " + " ".join(f"overhead_ratio_z{s}_bf16={bf[s]:.3f}" for s in (1, 2, 3))

    def plot(plt):
        groups = [f"Z{r['stage']} {r['dtype']}" for r in data]
        return B.bar_plot(plt, "Step time: upstream engine.backward vs deepspeed_multi loss.backward", groups,
                          {"upstream": [r["upstream_ms"] for r in data], "ours": [r["ours_ms"] for r in data]},
                          "ms / step (median)")

    B.save("overhead", {"meta": B.meta(model_params=B.n_params(model), steps=args.steps, warmup=args.warmup),
                        "rows": data, "table": table, "result": result}, plot)
    print(result)


def feature_main(args, feature):
    """Ours with ``feature`` on (the default) vs off, ZeRO 1-3, beside the upstream baseline of the same run."""
    dtypes = B.dtypes_here(args.dtypes)
    if not dtypes:
        print(f"nothing to measure for the {feature.replace('_', ' ')}: no dtype of {args.dtypes} runs here")
        return
    configs = [(stage, dtype) for dtype in dtypes for stage in (1, 2, 3)]
    timings = B.launch(timing, configs, args.warmup, args.steps, feature, timeout_s=TIMING_DEADLINE_S)[0]
    rows, data = [], []
    for stage, dtype in configs:
        t = timings[(stage, dtype)]
        rec = {"stage": stage, "dtype": dtype, **{f"{k}_ms": B.median(v) for k, v in t.items()},
               "ratio_on_off": B.paired_ratio(t["ours"], t["ours_off"]),
               "ratio_on_upstream": B.paired_ratio(t["ours"], t["upstream"]),
               "ratio_off_upstream": B.paired_ratio(t["ours_off"], t["upstream"]), "raw_ms": t}
        data.append(rec)
        rows.append([f"ZeRO-{stage}", dtype, f"{rec['upstream_ms']:.1f}", f"{rec['ours_ms']:.1f}",
                     f"{rec['ours_off_ms']:.1f}", f"{rec['ratio_on_off']:.3f}",
                     f"{rec['ratio_on_upstream']:.3f}", f"{rec['ratio_off_upstream']:.3f}"])
    what = feature.replace("_", " ")
    headers = ["stage", "dtype", "upstream ms", f"ours, {what} on ms", f"ours, {what} off ms",
               "on/off (paired)", "on/upstream (paired)", "off/upstream (paired)"]
    table = B.fmt_table(headers, rows)
    print(f"\nCost of the {what}: one engine, {LAYERS} blocks d={D}, micro-batch {MICRO_BS}x{SEQ}, {B.WORLD_SIZE} rank(s), "
          f"median of {args.steps} interleaved steps after {args.warmup} warm-up\n")
    print(table)
    result = "RESULT " + " ".join(
        f"{feature}_ratio_z{r['stage']}{'' if r['dtype'] == 'fp32' else '_' + r['dtype']}={r['ratio_on_off']:.3f}"
        for r in data)
    B.save(f"overhead_{feature}", {"meta": B.meta(steps=args.steps, warmup=args.warmup, dim=D, layers=LAYERS), "rows": data,
                                   "table": table, "result": result})
    print(result)


if __name__ == "__main__":
    main()
