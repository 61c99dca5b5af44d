"""One loss through two engines versus the super-module workaround (the RFC's seed shape).

A small encoder feeds an "LLM" (a stack of transformer blocks) under ONE loss:

* two engines (ours):  encoder = ``deepspeed_multi`` ZeRO-2 engine, LLM = ``deepspeed_multi``
  ZeRO-3 engine; ``loss.backward()``, then ``step()`` on each trainable engine.
* super-module (upstream workaround): encoder and LLM wrapped in one ``nn.Module`` and one
  upstream ``deepspeed.initialize`` engine at ZeRO-3; ``engine.backward(loss)``, ``engine.step()``.

both with the LLM trained and with the LLM frozen (ours: an engine built without optimizer;
super-module: ``requires_grad_(False)`` on the LLM part). Step time interleaved in one pair of
processes; peak memory per rank in fresh processes per variant (see _bench's Note).

Prints a table and ``RESULT two_engine_vs_supermodule=<time ratio, trained LLM>
two_engine_vs_supermodule_frozen=<..> mem_two_engine_vs_supermodule=<..>``; writes
benchmarks/results/two_engines.json and .png.

Usage: python benchmarks/two_engines.py [--steps 15] [--warmup 3] [--no-memory]
"""
from __future__ import annotations

import copy

import _bench as B

D_IN, D, ENC_LAYERS, LLM_LAYERS, SEQ, MICRO_BS = 64, 256, 1, 4, 32, 8
VARIANTS = ["two engines", "super-module", "two engines (frozen LLM)", "super-module (frozen LLM)"]


def _models():
    return B.Tower(D_IN, D, ENC_LAYERS, D, seed=1), B.Tower(D, D, LLM_LAYERS, D, seed=2)


def _batch(i, dev):
    import torch
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(MICRO_BS, SEQ, D_IN, generator=g).to(dev), torch.randn(MICRO_BS, SEQ, D, generator=g).to(dev)


def _build(variant, encoder, llm):
    """Return a step callable for ``variant`` built from (copies of) ``encoder`` and ``llm``."""
    import deepspeed
    import deepspeed_multi
    frozen = "frozen" in variant
    dev = B.device()
    encoder, llm = copy.deepcopy(encoder), copy.deepcopy(llm)
    if variant.startswith("two engines"):
        enc = B.build_engine(deepspeed_multi.initialize, encoder, B.ds_config(2, micro_bs=MICRO_BS))
        big = B.build_engine(deepspeed_multi.initialize, llm, B.ds_config(3, micro_bs=MICRO_BS), trainable=not frozen)
        trained = [enc] if frozen else [enc, big]

        def step(i):
            x, y = _batch(i, dev)
            loss = ((big(enc(x)) - y)**2).mean()
            loss.backward()
            for e in trained:
                e.step()
        return step

    if frozen:
        llm.requires_grad_(False)
    engine = B.build_engine(deepspeed.initialize, B.Chain(encoder, llm), B.ds_config(3, micro_bs=MICRO_BS))

    def step(i):
        x, y = _batch(i, dev)
        loss = ((engine(x) - y)**2).mean()
        engine.backward(loss)
        engine.step()
    return step


def timing(warmup, steps):
    enc, llm = _models()
    t = B.interleave({v: _build(v, enc, llm) for v in VARIANTS}, warmup, steps)
    return {k: v["total"] for k, v in t.items()}


def memory(variant, steps):
    enc, llm = _models()
    return B.peak_memory_of_steps(lambda: _build(variant, enc, llm), steps)


def main():
    ap = B.arg_parser(__doc__)
    args = ap.parse_args()
    t = B.launch(timing, args.warmup, args.steps)[0]
    med = {v: B.median(t[v]) for v in VARIANTS}
    mem = {} if args.no_memory else {v: B.launch(memory, v, 2)[0] for v in VARIANTS}
    rows, data = [], []
    for v in VARIANTS:
        base = "super-module (frozen LLM)" if "frozen" in v else "super-module"
        rec = {"variant": v, "ms": med[v], "iqr_ms": B.iqr(t[v]), "time_vs_supermodule": B.paired_ratio(t[v], t[base]),
               "peak_mb": mem.get(v), "raw_ms": t[v]}
        if mem:
            rec["mem_vs_supermodule"] = mem[v] / mem[base]
        data.append(rec)
        rows.append([v, "enc Z2 + LLM Z3" if v.startswith("two") else "one engine Z3",
                     f"{med[v]:.1f} ±{rec['iqr_ms']:.1f}", f"{rec['time_vs_supermodule']:.3f}",
                     f"{mem[v]:.1f}" if mem else "-", f"{rec['mem_vs_supermodule']:.3f}" if mem else "-"])
    table = B.fmt_table(["variant", "layout", "ms/step (IQR)", "time vs super-module (paired)", "peak MiB/rank",
                         "mem vs super-module"], rows)
    enc, llm = _models()
    print(f"\nTwo engines under one loss vs super-module: encoder {B.n_params(enc) / 1e6:.2f}M params, LLM "
          f"{B.n_params(llm) / 1e6:.2f}M params ({LLM_LAYERS} blocks d={D}), micro-batch {MICRO_BS}x{SEQ}, 2 ranks, "
          f"median of {args.steps} steps after {args.warmup} warm-up; memory = {B.memory_kind()}\n")
    print(table)
    by = {r["variant"]: r for r in data}
    result = (f"RESULT two_engine_vs_supermodule={by['two engines']['time_vs_supermodule']:.3f} "
              f"two_engine_vs_supermodule_frozen={by['two engines (frozen LLM)']['time_vs_supermodule']:.3f}")
    if mem:
        result += (f" mem_two_engine_vs_supermodule={by['two engines']['mem_vs_supermodule']:.3f}"
                   f" mem_two_engine_vs_supermodule_frozen={by['two engines (frozen LLM)']['mem_vs_supermodule']:.3f}")

    def plot(plt):
        groups = ["LLM trained", "LLM frozen"]
        series = {"two engines (ours)": [med["two engines"], med["two engines (frozen LLM)"]],
                  "super-module (upstream)": [med["super-module"], med["super-module (frozen LLM)"]]}
        return B.bar_plot(plt, "Encoder -> ZeRO-3 LLM, one loss", groups, series, "ms / step (median)")

    B.save("two_engines", {"meta": B.meta(steps=args.steps, warmup=args.warmup), "rows": data, "table": table,
                           "result": result}, plot)
    print(result)


if __name__ == "__main__":
    main()
