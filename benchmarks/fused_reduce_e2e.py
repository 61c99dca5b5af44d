"""End-to-end effect of the fused bucket passes (deepspeed_multi.zero.FUSED): ZeRO-2 and ZeRO-3 training steps with the fused passes on vs off.

Per stage, three engines are built side by side in the same processes (identical models; one with
``{"deepspeed_multi": {"fused_reduce": true}}``, one with false, and upstream ``deepspeed.initialize``
stepped with ``engine.backward(loss)``, the baseline users have) and stepped interleaved
(forward + backward + step, gradient_accumulation_steps micro-steps per sample), so both see
the same machine state. The model has many small parameters (default 200 Linear(32, 32), the many-small-parameters model),
where per-parameter tensor ops dominate the bucket passes. Medians over the timed samples.

    python benchmarks/fused_reduce_e2e.py [--layers 200] [--dim 64] [--steps 20] [--gas 2]

2 processes (torch.multiprocessing spawn, gloo on CPU; NCCL with one GPU per rank if available).
Prints a table, writes benchmarks/results/fused_reduce_e2e.json (per-step times kept) and ``RESULT e2e_z2=<off/on> e2e_z3=<off/on> vs_upstream_z2=<upstream/on> ..`` (speedups:
> 1 means fused is faster; the ratios are medians of per-step paired ratios).
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "multi_gpu"))  # rank_launcher

import _bench as B  # noqa: E402  (meta, save: the JSON beside the other benchmarks')


def _config(stage, fused, gas, bucket):
    return {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": gas,
        "steps_per_print": 10**9,
        "zero_allow_untested_optimizer": True,
        "optimizer": {"type": "SGD", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                              "reduce_bucket_size": bucket, "allgather_bucket_size": bucket,
                              "stage3_prefetch_bucket_size": bucket},
        "deepspeed_multi": {"fused_reduce": fused},
    }


def _worker(args):
    """One rank (started by rank_launcher.run_ranks): time both engines per stage."""
    os.environ.pop("DSM_FUSED_ZERO", None)
    torch.set_num_threads(args.threads)
    import deepspeed.comm as dist

    import deepspeed_multi
    from deepspeed_multi import compat, ops
    from deepspeed_multi.zero import FUSED
    rank = dist.get_rank()
    gpu = torch.cuda.is_available() and torch.cuda.device_count() >= dist.get_world_size()
    device = torch.device("cuda", rank) if gpu else torch.device("cpu")
    sync = torch.cuda.synchronize if gpu else (lambda: None)

    results = {}
    for stage in args.stages:
        engines = {}
        for fused in (False, True, "upstream"):
            torch.manual_seed(0)
            model = torch.nn.Sequential(*[torch.nn.Linear(args.dim, args.dim) for _ in range(args.layers)])
            config = _config(stage, fused is True, args.gas, args.bucket)
            if fused == "upstream":
                import deepspeed
                del config["deepspeed_multi"]
                eng, opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
            else:
                eng, opt, _, _ = deepspeed_multi.initialize(model=model, model_parameters=model.parameters(),
                                                            config=config)
                installed = any(compat.installed(opt, m.FEATURE) for m in FUSED)
                assert installed == fused, f"stage {stage}: fused={fused} but installed={installed}"
            engines[fused] = eng
        names = list(engines)
        times = {k: [] for k in names}
        x = torch.randn(8, args.dim, device=device)
        for it in range(args.warmup + args.steps):
            k = it % len(names)
            for fused in names[k:] + names[:k]:
                eng = engines[fused]
                dist.barrier()
                sync()
                t0 = time.perf_counter()
                for _ in range(args.gas):
                    loss = eng(x).pow(2).mean()
                    eng.backward(loss) if fused == "upstream" else loss.backward()
                eng.step()
                sync()
                dt = time.perf_counter() - t0
                if it >= args.warmup:
                    times[fused].append(dt)
        # The two engines must have followed the same trajectory.
        p_off = torch.cat([p.ds_tensor.flatten() if hasattr(p, "ds_tensor") else p.flatten()
                           for p in engines[False].module.parameters()])
        p_on = torch.cat([p.ds_tensor.flatten() if hasattr(p, "ds_tensor") else p.flatten()
                          for p in engines[True].module.parameters()])
        max_diff = (p_off.float() - p_on.float()).abs().max().item()
        # The slowest rank sets each step's time; ratios are medians of per-step paired ratios.
        t = torch.tensor([times[k] for k in names], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        per = dict(zip(names, t.tolist()))
        med = {k: statistics.median(v) for k, v in per.items()}
        paired = lambda a, b: statistics.median(x / y for x, y in zip(per[a], per[b]))  # noqa: E731
        results[stage] = (med[False], med[True], max_diff, med["upstream"], paired(False, True),
                          paired("upstream", True), paired("upstream", False),
                          {"off": [x * 1e3 for x in per[False]], "on": [x * 1e3 for x in per[True]],
                           "upstream": [x * 1e3 for x in per["upstream"]]})
        for eng in engines.values():
            eng.destroy()
        del engines
    return results, ops.active_backend(), "cuda" if gpu else "cpu"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=200)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--gas", type=int, default=2, help="micro-steps per optimizer step")
    ap.add_argument("--bucket", type=int, default=int(5e8), help="reduce/allgather/prefetch bucket size")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3])
    args = ap.parse_args()

    from rank_launcher import run_ranks
    results, backend, device = run_ranks(_worker, args, world_size=args.world, timeout_s=900, quiet_rank0=False)[0]

    print(f"\nfused_zero end to end: {args.layers} x Linear({args.dim}, {args.dim}), {args.world} ranks on {device}, "
          f"gas={args.gas}, bucket={args.bucket}, backend={backend}, median of {args.steps} steps")
    print("| stage | upstream ms | off ms | on ms | off/on | upstream/on | upstream/off | max abs(w_on - w_off) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows = []
    for stage, (off, on, diff, up, r_off_on, r_up_on, r_up_off, raw) in sorted(results.items()):
        rows.append({"stage": stage, "upstream_ms": up * 1e3, "off_ms": off * 1e3, "on_ms": on * 1e3,
                     "off_over_on": r_off_on, "upstream_over_on": r_up_on, "upstream_over_off": r_up_off,
                     "max_abs_diff": diff, "raw_ms": raw})
        print(f"| ZeRO-{stage} | {up * 1e3:.2f} | {off * 1e3:.2f} | {on * 1e3:.2f} | {r_off_on:.3f} | {r_up_on:.3f} | "
              f"{r_up_off:.3f} | {diff:.1e} |")
    fields = " ".join(f"e2e_z{stage}={r[4]:.3f} vs_upstream_z{stage}={r[5]:.3f}" for stage, r in sorted(results.items()))
    print(f"RESULT {fields}")
    B.save("fused_reduce_e2e", {"meta": B.meta(layers=args.layers, dim=args.dim, gas=args.gas, world=args.world,
                                               steps=args.steps, warmup=args.warmup, backend=backend),
                                "rows": rows, "result": f"RESULT {fields}"})


if __name__ == "__main__":
    main()
