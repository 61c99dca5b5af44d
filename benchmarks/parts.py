"""One model, several ZeRO stages: encoder -> projector -> LLM as ONE nn.Module, against the alternatives.

The model is one object (``MM``: ``vision`` tower, ``projector``, ``language_model`` tower), trained
under one loss with ``torch.optim.AdamW(lr=1e-4)``. Per size and dtype, three variants are built
side by side in the same 2 ranks and stepped interleaved:

The vision tower is two blocks of half the LLM's width (1/8 of the LLM's parameters at the small
size, 1/16 at the large).

* ours:         ``deepspeed_multi.initialize`` with ``"deepspeed_multi": {"submodules":
                {"language_model": {"zero_optimization": {"stage": 3}}}}``: the LLM at ZeRO-3, the rest
                of the model at ZeRO-2 (the top-level config); ``loss.backward()``, ``engine.step()``;
* whole ZeRO-3: upstream ``deepspeed.initialize`` of the whole model at ZeRO-3 (DeepSpeed's only way
                to put the LLM at ZeRO-3 without splitting the model); ``engine.backward``, ``step``;
* FSDP2 (LLM):  PyTorch ``fully_shard`` on every LLM block and the LLM root (bf16: its
                ``MixedPrecisionPolicy(param_dtype=bf16)``), the rest replicated in fp32 with its
                gradients all-reduced in one flat buffer (what DDP does for a small module); one AdamW.

Step time: median over the timed steps, and the paired per-step ratio against each baseline.
Peak memory per rank (each variant alone in fresh processes, see _bench's Note): of the steps, and
of construction: the model built plainly (every rank holds all of it), inside
``deepspeed_multi.zero_init(config)`` with the parted config (only the LLM is partitioned as it is
built), and inside ``deepspeed.zero.Init`` for the whole model.

Prints tables and ``RESULT parts_vs_wholez3_<size>_<dtype>=<ours/whole Z3 time> ...`` (< 1: ours is
faster); writes benchmarks/results/parts.json and .png.

Usage: python benchmarks/parts.py [--steps 10] [--warmup 3] [--no-memory] [--sizes small large]
       [--dtypes fp32 bf16]
"""
from __future__ import annotations

import copy

import torch.nn as nn

import _bench as B

# name -> (LLM width, LLM blocks); the vision tower is two blocks of half the LLM's width fed 64
# features: 1/8 of the LLM's parameters at the small size, 1/16 at the large (CLIP ViT-L beside a
# 7B LLM is 1/23; SigLIP beside a 2B LLM about 1/5).
SIZES = {"small": (256, 4), "large": (512, 8)}
D_IN, VISION_BLOCKS, SEQ, MICRO_BS = 64, 2, 32, 8
VARIANTS = ["ours (LLM Z3, rest Z2)", "whole model Z3", "FSDP2 (LLM)"]
BUILDS = ["plain", "ours: zero_init (parted)", "whole model: zero.Init"]


class MM(nn.Module):
    """Vision tower -> projector -> language model, one module (the multimodal user's model)."""

    def __init__(self, d, layers, seed=0):
        super().__init__()
        import torch
        torch.manual_seed(seed)
        self.vision = B.Tower(D_IN, d // 2, VISION_BLOCKS, d // 2, seed=seed + 1)
        self.projector = nn.Sequential(nn.Linear(d // 2, d), nn.GELU(), nn.Linear(d, d))
        self.language_model = B.Tower(d, d, layers, d, seed=seed + 2)

    def forward(self, x):
        h = self.projector(self.vision(x).to(self.projector[0].weight.dtype))
        return self.language_model(h)


def parted_config(dtype):
    cfg = B.ds_config(2, dtype, micro_bs=MICRO_BS)
    cfg["deepspeed_multi"] = {"submodules": {"language_model": {"zero_optimization": {
        "stage": 3, "stage3_param_persistence_threshold": 0}}}}
    return cfg


def _batch(i, d, dev):
    import torch
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(MICRO_BS, SEQ, D_IN, generator=g).to(dev), torch.randn(MICRO_BS, SEQ, d, generator=g).to(dev)


def _fsdp2(model, dtype):
    """fully_shard per LLM block and the LLM root; the rest stays a replica (its grads all-reduced by hand)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mesh = init_device_mesh("cuda" if torch.cuda.is_available() else "cpu", (dist.get_world_size(), ))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if dtype == "bf16" else MixedPrecisionPolicy()
    for block in model.language_model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model.language_model, mesh=mesh, mp_policy=mp)
    rest = [p for n, p in model.named_parameters() if not n.startswith("language_model.")]

    def all_reduce_rest():
        flat = torch._utils._flatten_dense_tensors([p.grad for p in rest])
        dist.all_reduce(flat)
        flat /= dist.get_world_size()
        for p, g in zip(rest, torch._utils._unflatten_dense_tensors(flat, [p.grad for p in rest])):
            p.grad.copy_(g)
    return torch.optim.AdamW(model.parameters(), lr=1e-4), all_reduce_rest


def _build(variant, size, dtype, model):
    """A step callable for ``variant`` built from a copy of ``model``."""
    import torch
    import deepspeed
    import deepspeed_multi
    dev = B.device()
    d = SIZES[size][0]
    model = copy.deepcopy(model).to(dev)
    if variant.startswith("ours"):
        engine, *_ = deepspeed_multi.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4),
                                                config=parted_config(dtype))

        def step(i):
            x, y = _batch(i, d, dev)
            ((engine(x) - y)**2).mean().backward()
            engine.step()
        return step
    if variant.startswith("whole"):
        engine = B.build_engine(deepspeed.initialize, model, B.ds_config(3, dtype, micro_bs=MICRO_BS))

        def step(i):
            x, y = _batch(i, d, dev)
            engine.backward(((engine(x) - y)**2).mean())
            engine.step()
        return step
    opt, all_reduce_rest = _fsdp2(model, dtype)

    def step(i):
        x, y = _batch(i, d, dev)
        ((model(x) - y)**2).mean().backward()
        all_reduce_rest()
        opt.step()
        opt.zero_grad()
    return step


def timing(sizes, dtypes, warmup, steps):
    out = {}
    for size in sizes:
        model = MM(*SIZES[size])
        for dtype in dtypes:
            t = B.interleave({v: _build(v, size, dtype, model) for v in VARIANTS}, warmup, steps)
            out[(size, dtype)] = {k: v["total"] for k, v in t.items()}
    return out


def memory(size, dtype, variant, steps):
    model = MM(*SIZES[size])
    return B.peak_memory_of_steps(lambda: _build(variant, size, dtype, model), steps)


def construction(size, dtype, build):
    """Peak memory per rank (MiB) of building the model, and whether any ZeRO-3 parameter is whole on a rank."""
    import deepspeed
    import torch._dynamo  # noqa: F401 - imports zero_init makes before its block: not the model's memory
    import deepspeed_multi
    from deepspeed_multi.integrations.hf_config import _hf_integration
    _hf_integration()
    mem = B.PeakMemory()
    if build == "plain":
        model = MM(*SIZES[size])
    elif build.startswith("ours"):
        with deepspeed_multi.zero_init(parted_config(dtype)):
            model = MM(*SIZES[size])
    else:
        with deepspeed.zero.Init(config_dict_or_path=B.ds_config(3, dtype, micro_bs=MICRO_BS)):
            model = MM(*SIZES[size])
    peak = mem.peak_mb()
    llm_local = sum(p.ds_tensor.numel() if hasattr(p, "ds_id") else p.numel()
                    for p in model.language_model.parameters())
    return peak, llm_local


def main():
    ap = B.arg_parser(__doc__)
    ap.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    ap.set_defaults(steps=10)
    args = ap.parse_args()
    args.dtypes = B.dtypes_here(args.dtypes)
    t = B.launch(timing, args.sizes, args.dtypes, args.warmup, args.steps)[0]
    cases = [(s, dt) for s in args.sizes for dt in args.dtypes]
    mem = {} if args.no_memory else {(s, dt, v): B.launch(memory, s, dt, v, 2)[0] for s, dt in cases
                                     for v in VARIANTS}
    built = {} if args.no_memory else {(s, dt, b): B.launch(construction, s, dt, b)[0] for s, dt in cases
                                       for b in BUILDS}
    rows, data, result = [], [], []
    for size, dtype in cases:
        model = MM(*SIZES[size])
        params, llm = B.n_params(model), B.n_params(model.language_model)
        ours = t[(size, dtype)][VARIANTS[0]]
        for v in VARIANTS:
            times = t[(size, dtype)][v]
            rec = {"size": size, "dtype": dtype, "params": params, "llm_params": llm, "variant": v,
                   "ms": B.median(times), "iqr_ms": B.iqr(times), "raw_ms": times,
                   "peak_mb": mem.get((size, dtype, v)), "ours_time_ratio": B.paired_ratio(ours, times)}
            if mem:
                rec["ours_mem_ratio"] = mem[(size, dtype, VARIANTS[0])] / mem[(size, dtype, v)]
            data.append(rec)
            rows.append([f"{size} ({params / 1e6:.1f}M, LLM {llm / 1e6:.1f}M)", dtype, v,
                         f"{rec['ms']:.1f} ±{rec['iqr_ms']:.1f}",
                         "-" if v == VARIANTS[0] else f"{rec['ours_time_ratio']:.3f}",
                         f"{rec['peak_mb']:.1f}" if mem else "-",
                         "-" if v == VARIANTS[0] or not mem else f"{rec['ours_mem_ratio']:.3f}"])
        by = {r["variant"]: r for r in data if r["size"] == size and r["dtype"] == dtype}
        result.append(f"parts_vs_wholez3_{size}_{dtype}={by[VARIANTS[1]]['ours_time_ratio']:.3f} "
                      f"parts_vs_fsdp2_{size}_{dtype}={by[VARIANTS[2]]['ours_time_ratio']:.3f}")
    table = B.fmt_table(["size (params)", "dtype", "variant", "ms/step (IQR)", "ours / this (time, paired)",
                         "peak MiB/rank", "ours / this (memory)"], rows)
    print(f"\nOne model: vision tower -> projector -> LLM, all trained, one loss, AdamW, micro-batch {MICRO_BS}x{SEQ}, "
          f"2 ranks on {B.device().type}, median of {args.steps} steps after {args.warmup} warm-up; "
          f"memory = {B.memory_kind()}\n")
    print(table)
    build_rows, build_data = [], []
    for (size, dtype, b), (peak, llm_local) in built.items():
        llm = B.n_params(MM(*SIZES[size]).language_model)
        build_data.append({"size": size, "dtype": dtype, "build": b, "peak_mb": peak, "llm_params_on_rank": llm_local,
                           "llm_params": llm})
        build_rows.append([size, dtype, b, f"{peak:.1f}", f"{llm_local / llm:.2f}"])
    build_table = ""
    if built:
        build_table = B.fmt_table(["size", "dtype", "construction", "peak MiB/rank", "LLM held per rank (share)"],
                                  build_rows)
        print("\nConstruction (each alone in fresh processes):\n")
        print(build_table)
        for size, dtype in cases:
            by = {r["build"]: r for r in build_data if r["size"] == size and r["dtype"] == dtype}
            result.append(f"parts_build_vs_plain_{size}_{dtype}={by[BUILDS[1]]['peak_mb'] / by[BUILDS[0]]['peak_mb']:.3f}")
    result = "RESULT " + " ".join(result)

    def plot(plt):
        groups = [f"{s} {dt}" for s, dt in cases]
        series = {v: [r["ms"] for r in data if r["variant"] == v] for v in VARIANTS}
        return B.bar_plot(plt, "One model, LLM at ZeRO-3: step time", groups, series, "ms / step (median)")

    B.save("parts", {"meta": B.meta(steps=args.steps, warmup=args.warmup), "rows": data, "construction": build_data,
                     "table": table + ("\n\nConstruction:\n\n" + build_table if build_table else ""),
                     "result": result}, plot)
    print(result)


if __name__ == "__main__":
    main()
