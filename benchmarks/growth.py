"""How the step time grows with the number of engines in one loss and with the parameter count.

Engines (``--engines 1 2 4 8 16``): N small towers (one transformer block each, d=128), each its own
``deepspeed_multi`` engine (``--stages``: ``alt`` alternating 2, 3, 2, 3, ..., ``2`` all ZeRO-2, ``3``
all ZeRO-3), under one ``loss.backward()``, wired two ways:

* chained:  ``x -> E_1 -> E_2 -> ... -> E_N -> loss``
* parallel: ``loss = sum_i loss(E_i(x))``

against the same N towers as one ``nn.Module`` in one upstream ZeRO-3 engine
(``engine.backward(loss)``), the workaround whose cost does not grow with N engines.

Parameters (``--dims``): one encoder (ZeRO-2) feeding one LLM (ZeRO-3) of 4 blocks, width d, from
about 1e5 to 1e8 parameters, against the super-module at ZeRO-3; micro-batch 2 x 16 so that the
largest size fits a 2-core CPU box in minutes.

Per point the variants are built in the same 2 ranks and stepped interleaved (AdamW, fp32);
the figure is the median step time and the paired per-step ratio ours / super-module.
Prints three tables (the step times, their phases, the parameter sweep) and
``RESULT growth_chain_16=.. growth_parallel_16=.. growth_chain_16_z2=.. .. growth_params_max=..``;
writes benchmarks/results/growth.json and .png (two panels).

Usage: python benchmarks/growth.py [--steps 6] [--warmup 2] [--engines 1 2 4 8 16] [--stages alt 2 3]
                                  [--dims 40 128 400 1248] [--upstream]

``--upstream`` adds a third variant, N ``deepspeed.initialize`` engines under one ``loss.backward()``
wired as ours, and a table of ours / upstream: what N engines cost in DeepSpeed itself.
"""
from __future__ import annotations

import copy
import gc

import torch.nn as nn

import _bench as B

D_ENGINE, SEQ, MICRO_BS = 128, 32, 8
P_LAYERS, P_SEQ, P_MICRO_BS = 4, 16, 2


class Parallel(nn.Module):
    """The parallel wiring as one module: returns every tower's output."""

    def __init__(self, *towers):
        super().__init__()
        self.towers = nn.ModuleList(towers)

    def forward(self, x):
        return [t(x) for t in self.towers]


def _loss(outs, y):
    outs = outs if isinstance(outs, list) else [outs]
    return sum(((o - y)**2).mean() for o in outs)


def _batch(i, shape, dev):
    import torch
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(*shape, generator=g).to(dev), torch.randn(*shape, generator=g).to(dev)


PHASES = ("forward", "backward", "step")
STAGES = {"alt": lambda k: 2 + k % 2, "2": lambda k: 2, "3": lambda k: 3}  # --stages: tower k's ZeRO stage


def _engine_count_variants(n, wiring, stages="alt", upstream_engines=False):
    import deepspeed
    import deepspeed_multi
    dev = B.device()
    towers = [B.Tower(D_ENGINE, D_ENGINE, 1, D_ENGINE, seed=k) for k in range(n)]
    engines = [B.build_engine(deepspeed_multi.initialize, copy.deepcopy(t), B.ds_config(STAGES[stages](k)))
               for k, t in enumerate(towers)]
    shape = (MICRO_BS, SEQ, D_ENGINE)
    extra = {}
    if upstream_engines:  # --upstream: DeepSpeed's own N engines wired as ours (0.19.8 takes loss.backward())
        extra["upstream"] = towers_step([B.build_engine(deepspeed.initialize, copy.deepcopy(t),
                                                        B.ds_config(STAGES[stages](k))) for k, t in enumerate(towers)],
                                        wiring, shape)
    whole = (B.Chain if wiring == "chained" else Parallel)(*copy.deepcopy(towers))
    upstream = B.build_engine(deepspeed.initialize, whole, B.ds_config(3))

    def super_module(i):
        x, y = _batch(i, shape, dev)
        timer = B.PhaseTimer()
        with timer("forward"):
            loss = _loss(upstream(x), y)
        with timer("backward"):
            upstream.backward(loss)
        with timer("step"):
            upstream.step()
        return timer.phases

    return ({"ours": towers_step(engines, wiring, shape), "super-module": super_module, **extra},
            sum(B.n_params(t) for t in towers))


def towers_step(engines, wiring, shape):
    """One training step of ``engines`` wired ``chained`` or ``parallel`` under one ``loss.backward()``."""
    dev = B.device()

    def step(i):
        """One step; returns the seconds spent in forward, backward and the engines' step() calls."""
        x, y = _batch(i, shape, dev)
        timer = B.PhaseTimer()
        with timer("forward"):
            if wiring == "chained":
                for e in engines:
                    x = e(x)
                outs = x
            else:
                outs = [e(x) for e in engines]
            loss = _loss(outs, y)
        with timer("backward"):
            loss.backward()
        with timer("step"):
            for e in engines:
                e.step()
        return timer.phases
    return step


def _param_count_variants(d):
    import deepspeed
    import deepspeed_multi
    dev = B.device()
    enc, llm = B.Tower(d, d, 1, d, seed=1), B.Tower(d, d, P_LAYERS, d, seed=2)
    e_enc = B.build_engine(deepspeed_multi.initialize, copy.deepcopy(enc), B.ds_config(2, micro_bs=P_MICRO_BS))
    e_llm = B.build_engine(deepspeed_multi.initialize, copy.deepcopy(llm), B.ds_config(3, micro_bs=P_MICRO_BS))
    upstream = B.build_engine(deepspeed.initialize, B.Chain(enc, llm), B.ds_config(3, micro_bs=P_MICRO_BS))
    shape = (P_MICRO_BS, P_SEQ, d)

    def ours(i):
        x, y = _batch(i, shape, dev)
        _loss(e_llm(e_enc(x)), y).backward()
        e_enc.step()
        e_llm.step()

    def super_module(i):
        x, y = _batch(i, shape, dev)
        upstream.backward(_loss(upstream(x), y))
        upstream.step()

    return {"ours": ours, "super-module": super_module}, B.n_params(enc) + B.n_params(llm)


def timing(engine_counts, stage_sets, dims, warmup, steps, upstream_engines=False):
    out = {"engines": [], "params": []}
    for stages in stage_sets:
        for wiring in ("chained", "parallel"):
            for n in engine_counts:
                variants, params = _engine_count_variants(n, wiring, stages, upstream_engines)
                t = B.interleave(variants, warmup, steps)
                out["engines"].append({"stages": stages, "wiring": wiring, "n": n, "params": params,
                                       **{k: v["total"] for k, v in t.items()},
                                       "phases": {k: {p: v[p] for p in PHASES} for k, v in t.items()}})
                del variants
                gc.collect()
    for d in dims:
        variants, params = _param_count_variants(d)
        t = B.interleave(variants, warmup, steps)
        out["params"].append({"d": d, "params": params, **{k: v["total"] for k, v in t.items()}})
        del variants
        gc.collect()
    return out


def main():
    ap = B.arg_parser(__doc__)
    ap.add_argument("--engines", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--stages", nargs="+", default=["alt", "2", "3"], choices=list(STAGES),
                    help="the towers' ZeRO stages: alt (2, 3, 2, ...), 2 or 3; the super-module is ZeRO-3 in all")
    ap.add_argument("--dims", type=int, nargs="*", default=[40, 128, 400, 1248], help="none: skip the parameter sweep")
    ap.add_argument("--upstream", action="store_true",
                    help="also step N upstream deepspeed.initialize engines under one loss.backward(), interleaved, "
                         "and print ours / upstream (the cost of N engines as DeepSpeed has it)")
    ap.set_defaults(steps=6, warmup=2)
    args = ap.parse_args()
    t = B.launch(timing, args.engines, args.stages, args.dims, args.warmup, args.steps, args.upstream,
                 timeout_s=5400)[0]
    rows_e, rows_p = [], []
    for r in t["engines"]:
        r.update(ours_ms=B.median(r["ours"]), super_ms=B.median(r["super-module"]),
                 ratio=B.paired_ratio(r["ours"], r["super-module"]))
        rows_e.append([r["stages"], r["wiring"], r["n"], f"{r['params'] / 1e6:.2f}M", f"{r['ours_ms']:.1f}", f"{r['super_ms']:.1f}",
                       f"{r['ratio']:.3f}"])
    for r in t["params"]:
        r.update(ours_ms=B.median(r["ours"]), super_ms=B.median(r["super-module"]),
                 ratio=B.paired_ratio(r["ours"], r["super-module"]))
        rows_p.append([r["d"], f"{r['params']:.3g}", f"{r['ours_ms']:.1f}", f"{r['super_ms']:.1f}", f"{r['ratio']:.3f}"])
    table_e = B.fmt_table(["stages", "wiring", "engines", "params", "ours ms", "super-module ms", "ours / super-module (paired)"],
                          rows_e)
    rows_ph = [[r["stages"], r["wiring"], r["n"]] + [f"{B.median(r['phases'][v][p]):.1f}" for p in PHASES
                                                    for v in ("ours", "super-module")]
               for r in t["engines"]]
    table_ph = B.fmt_table(["stages", "wiring", "engines"] + [f"{p} {v} ms" for p in PHASES
                                                              for v in ("ours", "super-module")], rows_ph)
    table_p = B.fmt_table(["width d", "params", "ours ms", "super-module ms", "ours / super-module (paired)"], rows_p)
    print(f"\nEngines in one loss: N towers (1 block, d={D_ENGINE}), stages alternating 2,3,2,.. (alt), all 2 or all 3, "
          f"micro-batch {MICRO_BS}x{SEQ}, {B.WORLD_SIZE} ranks on {B.device().type}, median of {args.steps} steps after {args.warmup} warm-up; baseline: the N "
          "towers as one module in one upstream ZeRO-3 engine\n")
    print(table_e)
    print("\nWhere the time goes: the median of each phase (forward incl. the loss, backward, the step() calls)\n")
    print(table_ph)
    if args.upstream:
        rows_u = [[r["stages"], r["wiring"], r["n"], f"{B.median(r['ours']):.1f}", f"{B.median(r['upstream']):.1f}",
                   f"{B.paired_ratio(r['ours'], r['upstream']):.3f}"]
                  + [f"{B.median(r['phases'][v][p]):.1f}" for p in PHASES for v in ("ours", "upstream")]
                  for r in t["engines"]]
        print("\nThe same engines as DeepSpeed's own: N deepspeed.initialize engines under one loss.backward(), "
              "interleaved with the above in the same ranks\n")
        print(B.fmt_table(["stages", "wiring", "engines", "ours ms", "upstream ms", "ours / upstream (paired)"]
                          + [f"{p} {v} ms" for p in PHASES for v in ("ours", "upstream")], rows_u))
    print(f"\nParameters: encoder (ZeRO-2, 1 block) -> LLM (ZeRO-3, {P_LAYERS} blocks), width d, micro-batch "
          f"{P_MICRO_BS}x{P_SEQ}; baseline: one upstream ZeRO-3 engine over both\n")
    print(table_p)
    last = {(st, w): next(r for r in reversed(t["engines"]) if r["wiring"] == w and r["stages"] == st)
            for st in args.stages for w in ("chained", "parallel")}
    result = "RESULT " + " ".join(
        f"growth_{'chain' if w == 'chained' else w}_{r['n']}{'' if st == 'alt' else '_z' + st}={r['ratio']:.3f}"
        for (st, w), r in last.items())
    if t["params"]:
        result += f" growth_params_max={t['params'][-1]['ratio']:.3f}"

    def plot(plt):
        fig, (a, c, b) = plt.subplots(1, 3, figsize=(15, 3.8))
        first = args.stages[0]
        for wiring, marker in (("chained", "o"), ("parallel", "s")):
            rs = [r for r in t["engines"] if r["wiring"] == wiring and r["stages"] == first]
            a.plot([r["n"] for r in rs], [r["ours_ms"] for r in rs], marker=marker, label=f"ours, {wiring}")
            a.plot([r["n"] for r in rs], [r["super_ms"] for r in rs], marker=marker, linestyle="--",
                   label=f"super-module, {wiring}")
        a.set_xscale("log", base=2)
        a.set_xlabel("engines in one loss")
        a.set_ylabel("ms / step (median)")
        a.set_title(f"Step time vs number of engines (stages {first})")
        a.legend(fontsize=7)
        for st in args.stages:
            for wiring, marker in (("chained", "o"), ("parallel", "s")):
                rs = [r for r in t["engines"] if r["wiring"] == wiring and r["stages"] == st]
                c.plot([r["n"] for r in rs], [r["ratio"] for r in rs], marker=marker, label=f"stages {st}, {wiring}")
        c.axhline(1.0, color="gray", linewidth=0.8)
        c.set_xscale("log", base=2)
        c.set_xlabel("engines in one loss")
        c.set_ylabel("ours / super-module (paired)")
        c.set_title("Ratio vs number of engines")
        c.legend(fontsize=7)
        ps = t["params"]
        if not ps:  # --dims with no value: no parameter sweep
            b.set_axis_off()
            return fig
        b.plot([r["params"] for r in ps], [r["ours_ms"] for r in ps], marker="o", label="ours (Z2 + Z3)")
        b.plot([r["params"] for r in ps], [r["super_ms"] for r in ps], marker="o", linestyle="--",
               label="super-module (Z3)")
        b.set_xscale("log")
        b.set_yscale("log")
        b.set_xlabel("parameters")
        b.set_title("Step time vs parameter count")
        b.legend(fontsize=7)
        return fig

    B.save("growth", {"meta": B.meta(steps=args.steps, warmup=args.warmup), "engines": t["engines"],
                      "params": t["params"], "table": "\n\n".join((table_e, table_ph, table_p)), "result": result},
           plot)
    print(result)


if __name__ == "__main__":
    main()
