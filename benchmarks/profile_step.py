"""Where a training step's CPU time goes: ours vs upstream, per ZeRO stage (cProfile on rank 0).

The same model is built twice in the same 2 ranks: upstream ``deepspeed.initialize`` +
``engine.backward(loss)`` and ``deepspeed_multi.initialize`` + ``loss.backward()``; each runs
``--steps`` steps (gas micro-steps + step()) under cProfile on rank 0 (rank 1 runs unprofiled,
so collectives stay matched). cProfile's own cost inflates Python-heavy code, so the absolute
times are larger than unprofiled ones; the split between buckets is what this is for.

Every function's *self* time is put in one bucket, by the file it is defined in:

* ``ours``: deepspeed_multi (boundary nodes, checks, region hooks, fused ops' Python side)
* ``ds-zero``: DeepSpeed's ZeRO optimizer (per-parameter hooks, bucket passes, step)
* ``ds-engine``: the rest of DeepSpeed (engine forward/backward/step, comm wrappers, timers)
* ``torch-ops``: torch built-ins (tensor ops called from Python: copy_, narrow, view, cat, ...)
* ``autograd``: the C++ backward pass itself (``run_backward``), which includes the kernels
* ``collectives``: torch.distributed calls (gloo/NCCL), mostly waiting
* ``torch-py``: torch's Python (nn.Module call machinery, hooks dispatch)
* ``other``

    python benchmarks/profile_step.py [--model mlp|transformer] [--stages 1 2 3] [--steps 10] [--top 25]
"""
from __future__ import annotations

import argparse
import copy
import cProfile
import pstats

import _bench as B

BUCKETS = ("ours", "ds-zero", "ds-engine", "torch-ops", "autograd", "collectives", "torch-py", "other")


def _bucket(filename: str, name: str) -> str:
    if "deepspeed_multi" in filename:
        return "ours"
    if "/deepspeed/runtime/zero/" in filename:
        return "ds-zero"
    if "/deepspeed/" in filename:
        return "ds-engine"
    if "run_backward" in name or "_engine_run_backward" in name:
        return "autograd"
    if "torch/distributed" in filename or "ProcessGroup" in name or "all_reduce" in name or "reduce_scatter" in name \
            or "all_gather" in name or "barrier" in name or "broadcast" in name:
        return "collectives"
    if filename == "~" or "built-in" in name or "method '" in name:
        return "torch-ops"
    if "/torch/" in filename:
        return "torch-py"
    return "other"


def _model(kind, layers, dim):
    import torch
    torch.manual_seed(0)
    if kind == "mlp":
        return torch.nn.Sequential(*[torch.nn.Linear(dim, dim) for _ in range(layers)])
    return B.TinyLM(d=dim, layers=layers) if hasattr(B, "TinyLM") else torch.nn.Sequential(
        *[B.Block(dim) for _ in range(layers)])


def _worker(args):
    import deepspeed
    import deepspeed.comm as dist
    import torch

    import deepspeed_multi
    rank = dist.get_rank()
    out = {}
    for stage in args.stages:
        base = _model(args.model, args.layers, args.dim)
        cfg = B.ds_config(stage, args.dtype, micro_bs=8, gas=args.gas)
        engines = {"upstream": B.build_engine(deepspeed.initialize, copy.deepcopy(base), cfg),
                   "ours": B.build_engine(deepspeed_multi.initialize, copy.deepcopy(base), cfg)}
        shape = (8, args.dim) if args.model == "mlp" else (8, 32, args.dim)
        x = torch.randn(*shape).to(B.device())
        dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32

        def step(kind):
            eng = engines[kind]
            for _ in range(args.gas):
                loss = eng(x.to(dtype)).float().pow(2).mean()
                if kind == "upstream":
                    eng.backward(loss)
                else:
                    loss.backward()
            eng.step()

        for kind in engines:
            for _ in range(args.warmup):
                step(kind)
        out[stage] = {}
        for kind in engines:
            dist.barrier()
            prof = cProfile.Profile() if rank == 0 else None
            if prof:
                prof.enable()
            for _ in range(args.steps):
                step(kind)
            if prof:
                prof.disable()
                stats = pstats.Stats(prof)
                buckets = dict.fromkeys(BUCKETS, 0.0)
                rows = []
                for (filename, _line, name), (_cc, _nc, tt, _ct, _callers) in stats.stats.items():
                    buckets[_bucket(filename, name)] += tt
                    rows.append((tt, _nc, f"{filename.split('site-packages/')[-1].split('/work/main/')[-1]}:{name}"))
                rows.sort(reverse=True)
                out[stage][kind] = {"buckets": {k: v * 1e3 / args.steps for k, v in buckets.items()},
                                    "top": [(tt * 1e3 / args.steps, nc // args.steps, where)
                                            for tt, nc, where in rows[:args.top]]}
        for eng in engines.values():
            eng.destroy()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["mlp", "transformer"], default="mlp")
    ap.add_argument("--layers", type=int, default=None, help="default: 200 (mlp), 3 (transformer)")
    ap.add_argument("--dim", type=int, default=None, help="default: 32 (mlp), 256 (transformer)")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--gas", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    args.layers = args.layers or (200 if args.model == "mlp" else 3)
    args.dim = args.dim or (32 if args.model == "mlp" else 256)
    out = B.launch(_worker, args)[0]
    print(f"\nprofile: {args.model} {args.layers} x d={args.dim}, {args.dtype}, gas {args.gas}, 2 ranks, "
          f"rank 0 self time per step (ms) under cProfile, mean of {args.steps} steps")
    rows = []
    for stage, kinds in out.items():
        for kind, res in kinds.items():
            b = res["buckets"]
            rows.append([f"ZeRO-{stage}", kind] + [f"{b[k]:.1f}" for k in BUCKETS] + [f"{sum(b.values()):.1f}"])
    print(B.fmt_table(["stage", "variant", *BUCKETS, "total"], rows))
    for stage, kinds in out.items():
        for kind, res in kinds.items():
            print(f"\nZeRO-{stage} {kind}: top {args.top} functions by self time (ms/step, calls/step)")
            for tt, nc, where in res["top"]:
                print(f"  {tt:8.2f} {nc:7d}  {where}")


if __name__ == "__main__":
    main()
