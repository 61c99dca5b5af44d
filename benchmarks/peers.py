"""Encoder -> LLM, both trained under one loss: deepspeed_multi against what people pick instead.

Per size, four variants are built side by side in the same 2 ranks and stepped interleaved:

* ours:          encoder = ``deepspeed_multi`` ZeRO-2 engine, LLM = ``deepspeed_multi`` ZeRO-3
                 engine; ``loss.backward()``, ``step()`` on each;
* ours per block: the same with ``min_block_elements: 0``: sizes from one block however small
                 (FSDP2's granularity), what a small model's memory at FSDP2's level costs in time;
* super-module:  encoder and LLM in one ``nn.Module``, one upstream ``deepspeed.initialize``
                 engine at ZeRO-3; ``engine.backward(loss)``, ``engine.step()`` (the workaround);
* FSDP2:         PyTorch's ``fully_shard`` on every transformer block and on each model's root
                 (the PyTorch-native choice), one AdamW; ``loss.backward()``, ``opt.step()``.

Every variant trains the same weights with ``torch.optim.AdamW(lr=1e-4)`` in fp32 on the same
batches. Step time: median over the timed steps, and the paired per-step ratio against each
baseline. Peak memory per rank: each variant alone in fresh processes (see _bench's Note).

Prints a table and ``RESULT peers_vs_fsdp2_<size>=<ours/FSDP2 time> peers_vs_supermodule_<size>=..
peers_per_block_vs_fsdp2_<size>=..`` (< 1: ours is faster); writes benchmarks/results/peers.json and .png.

Usage: python benchmarks/peers.py [--steps 10] [--warmup 3] [--no-memory] [--sizes small large]
"""
from __future__ import annotations

import copy

import _bench as B

# name -> (LLM width, LLM blocks); the encoder is one block of the same width fed 64 features.
SIZES = {"small": (256, 4), "large": (512, 8)}
D_IN, ENC_LAYERS, SEQ, MICRO_BS = 64, 1, 32, 8
VARIANTS = ["ours (Z2 + Z3)", "super-module (Z3)", "FSDP2"]
# Ours at the settings users write leaves the bucket and prefetch sizes unset, so each engine takes
# its model's block ([Note: sizes from the model's block], deepspeed_multi/zero/block_sizes.py).
# This variant writes DeepSpeed's defaults out instead (kept as written): 5e8-element buckets, a 5e7
# prefetch, 1e9 live parameters, reuse distance and sub-group, i.e. what DeepSpeed's defaults cost.
DEEPSPEED_SIZES = "ours, DeepSpeed's default sizes"
_DEEPSPEED_DEFAULTS = {2: dict(reduce_bucket_size=5 * 10**8, allgather_bucket_size=5 * 10**8),
                       3: dict(reduce_bucket_size=5 * 10**8, stage3_prefetch_bucket_size=5 * 10**7,
                               stage3_max_live_parameters=10**9, stage3_max_reuse_distance=10**9,
                               sub_group_size=10**9)}
# Ours with the block's sizes however small the block (option min_block_elements 0): FSDP2's per-block
# granularity, at the cost of more collectives.
PER_BLOCK = "ours, per block, no floor"
# What this script times: ours at the default and per block beside the others.
TIMED = [VARIANTS[0], PER_BLOCK, *VARIANTS[1:]]
# The encoder at ZeRO-3 too: the sharding FSDP2 applies to both models. ZeRO-2 keeps a whole copy of
# the encoder's parameters on every rank; this variant shows what that costs.
BOTH_ZERO3 = "ours (Z3 + Z3)"
# Both at ZeRO-3 and per block: FSDP2's sharding and granularity together, the like-for-like comparison.
BOTH_ZERO3_PER_BLOCK = "ours (Z3 + Z3), per block"


def _models(size):
    d, layers = SIZES[size]
    return B.Tower(D_IN, d, ENC_LAYERS, d, seed=1), B.Tower(d, d, layers, d, seed=2)


def _batch(i, d, dev):
    import torch
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(MICRO_BS, SEQ, D_IN, generator=g).to(dev), torch.randn(MICRO_BS, SEQ, d, generator=g).to(dev)


def _fsdp2(encoder, llm, dtype="fp32"):
    """fully_shard per block, then per model root, on a 1-D mesh of every rank; in bf16 with FSDP2's
    ``MixedPrecisionPolicy`` (bf16 compute, fp32 sharded parameters and gradient reduction)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mesh = init_device_mesh("cuda" if torch.cuda.is_available() else "cpu", (dist.get_world_size(), ))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if dtype == "bf16" else None
    kwargs = {"mesh": mesh} if mp is None else {"mesh": mesh, "mp_policy": mp}
    for model in (encoder, llm):
        for block in model.blocks:
            fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)
    return torch.optim.AdamW(list(encoder.parameters()) + list(llm.parameters()), lr=1e-4)


class Variant:
    """One variant's pieces: ``loss(i)``, ``backward(loss)``, ``update()``; ``holders`` are the
    engines (or, for FSDP2, the models and the optimizer) that own its tensors."""

    def __init__(self, loss, backward, update, holders):
        self.loss, self.backward, self.update, self.holders = loss, backward, update, holders

    def step(self, i):
        self.backward(self.loss(i))
        self.update()


def build_variant(variant, size, encoder, llm, dtype="fp32") -> Variant:
    """``variant`` built from copies of ``encoder`` and ``llm``, trained in ``dtype`` (fp32 or bf16)."""
    import deepspeed
    import deepspeed_multi
    dev = B.device()
    d = SIZES[size][0]
    encoder, llm = copy.deepcopy(encoder).to(dev), copy.deepcopy(llm).to(dev)
    mse = lambda out, y: ((out.float() - y)**2).mean()  # noqa: E731
    if variant.startswith("ours"):
        cfg = B.ds_config(3, dtype, micro_bs=MICRO_BS)
        both3 = variant in (BOTH_ZERO3, BOTH_ZERO3_PER_BLOCK)
        enc_cfg = copy.deepcopy(cfg) if both3 else B.ds_config(2, dtype, micro_bs=MICRO_BS)
        if variant in (PER_BLOCK, BOTH_ZERO3_PER_BLOCK):
            cfg["deepspeed_multi"] = {"min_block_elements": 0}
            enc_cfg["deepspeed_multi"] = {"min_block_elements": 0}
        if variant == DEEPSPEED_SIZES:
            cfg["zero_optimization"].update(_DEEPSPEED_DEFAULTS[3])
            enc_cfg["zero_optimization"].update(_DEEPSPEED_DEFAULTS[2])
        enc = B.build_engine(deepspeed_multi.initialize, encoder, enc_cfg)
        big = B.build_engine(deepspeed_multi.initialize, llm, cfg)

        def loss(i):
            x, y = _batch(i, d, dev)
            return mse(big(enc(x)), y)
        return Variant(loss, lambda l: l.backward(), lambda: (enc.step(), big.step()), [enc, big])
    if variant.startswith("super"):
        engine = B.build_engine(deepspeed.initialize, B.Chain(encoder, llm), B.ds_config(3, dtype, micro_bs=MICRO_BS))

        def loss(i):
            x, y = _batch(i, d, dev)
            return mse(engine(x), y)
        return Variant(loss, engine.backward, engine.step, [engine])
    opt = _fsdp2(encoder, llm, dtype)

    def loss(i):
        x, y = _batch(i, d, dev)
        return mse(llm(encoder(x)), y)

    def update():
        opt.step()
        opt.zero_grad()
    return Variant(loss, lambda l: l.backward(), update, [encoder, llm, opt])


def _build(variant, size, encoder, llm, dtype="fp32"):
    """A step callable for ``variant`` (see :func:`build_variant`)."""
    return build_variant(variant, size, encoder, llm, dtype).step


def timing(sizes, warmup, steps):
    out = {}
    for size in sizes:
        enc, llm = _models(size)
        t = B.interleave({v: _build(v, size, enc, llm) for v in TIMED}, warmup, steps)
        out[size] = {k: v["total"] for k, v in t.items()}
    return out


def memory(size, variant, steps):
    enc, llm = _models(size)
    return B.peak_memory_of_steps(lambda: _build(variant, size, enc, llm), steps)


def main():
    ap = B.arg_parser(__doc__)
    ap.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    ap.set_defaults(steps=10)
    args = ap.parse_args()
    t = B.launch(timing, args.sizes, args.warmup, args.steps)[0]
    mem = {} if args.no_memory else {(s, v): B.launch(memory, s, v, 2)[0] for s in args.sizes for v in TIMED}
    rows, data, result = [], [], []
    for size in args.sizes:
        enc, llm = _models(size)
        params = B.n_params(enc) + B.n_params(llm)
        ours = t[size][VARIANTS[0]]
        for v in TIMED:
            rec = {"size": size, "params": params, "variant": v, "ms": B.median(t[size][v]),
                   "iqr_ms": B.iqr(t[size][v]), "raw_ms": t[size][v], "peak_mb": mem.get((size, v)),
                   "ours_time_ratio": B.paired_ratio(ours, t[size][v])}
            if mem:
                rec["ours_mem_ratio"] = mem[(size, VARIANTS[0])] / mem[(size, v)]
            data.append(rec)
            rows.append([f"{size} ({params / 1e6:.1f}M)", v, f"{rec['ms']:.1f} ±{rec['iqr_ms']:.1f}",
                         "-" if v == VARIANTS[0] else f"{rec['ours_time_ratio']:.3f}",
                         f"{rec['peak_mb']:.1f}" if mem else "-",
                         "-" if v == VARIANTS[0] or not mem else f"{rec['ours_mem_ratio']:.3f}"])
        by = {r["variant"]: r for r in data if r["size"] == size}
        result.append(f"peers_vs_fsdp2_{size}={by['FSDP2']['ours_time_ratio']:.3f} "
                      f"peers_vs_supermodule_{size}={by['super-module (Z3)']['ours_time_ratio']:.3f} "
                      f"peers_per_block_vs_fsdp2_{size}="
                      f"{B.paired_ratio(t[size][PER_BLOCK], t[size]['FSDP2']):.3f}")
    table = B.fmt_table(["size (params)", "variant", "ms/step (IQR)", "ours / this (time, paired)", "peak MiB/rank",
                         "ours / this (memory)"], rows)
    print(f"\nEncoder ({ENC_LAYERS} block) -> LLM, both trained, one loss, AdamW fp32, micro-batch {MICRO_BS}x{SEQ}, "
          f"2 ranks on {B.device().type}, median of {args.steps} steps after {args.warmup} warm-up; "
          f"memory = {B.memory_kind()}\n")
    print(table)
    result = "RESULT " + " ".join(result)

    def plot(plt):
        series = {v: [r["ms"] for r in data if r["variant"] == v] for v in TIMED}
        return B.bar_plot(plt, "Encoder -> LLM, both trained, one loss", args.sizes, series, "ms / step (median)")

    B.save("peers", {"meta": B.meta(steps=args.steps, warmup=args.warmup), "rows": data, "table": table,
                     "result": result}, plot)
    print(result)


if __name__ == "__main__":
    main()
