"""Distillation: a trained student and a frozen teacher, the teacher's forward under no_grad.

Variants (all in one pair of processes, interleaved; memory per variant in fresh processes):

* upstream Z2+Z3: ``deepspeed.initialize`` student at ZeRO-2, frozen teacher at ZeRO-3 (no
  optimizer), ``student.backward(loss)`` - the baseline for this layout;
* ours Z2+Z3:     the same layout with ``deepspeed_multi.initialize`` and ``loss.backward()``;
* upstream Z3+Z3 / ours Z3+Z3: the student at ZeRO-3 too (what a single global ZeRO stage
  forces on you when both models share one ``zero.Init`` / one config).

Prints a table and ``RESULT distill_ours_vs_upstream=<time, Z2+Z3> distill_z2z3_vs_z3z3=<time,
ours> mem_distill_z2z3_vs_z3z3=<memory, ours>``; writes benchmarks/results/distillation.json/.png.

Usage: python benchmarks/distillation.py [--steps 15] [--warmup 3] [--no-memory]
"""
from __future__ import annotations

import copy

import _bench as B

D, STUDENT_LAYERS, TEACHER_LAYERS, VOCAB, SEQ, MICRO_BS = 256, 2, 4, 512, 32, 8
VARIANTS = ["upstream Z2+Z3", "ours Z2+Z3", "upstream Z3+Z3", "ours Z3+Z3"]


def _models():
    return B.Tower(D, D, STUDENT_LAYERS, VOCAB, seed=1), B.Tower(D, D, TEACHER_LAYERS, VOCAB, seed=2)


def _batch(i, dev):
    import torch
    g = torch.Generator().manual_seed(1000 + i)
    return (torch.randn(MICRO_BS, SEQ, D, generator=g).to(dev),
            torch.randint(0, VOCAB, (MICRO_BS, SEQ), generator=g).to(dev))


def _build(variant, student, teacher):
    import torch
    import torch.nn.functional as F

    import deepspeed
    import deepspeed_multi
    ours = variant.startswith("ours")
    init = deepspeed_multi.initialize if ours else deepspeed.initialize
    s_stage = 2 if "Z2+" in variant else 3
    s = B.build_engine(init, copy.deepcopy(student), B.ds_config(s_stage, micro_bs=MICRO_BS))
    t = B.build_engine(init, copy.deepcopy(teacher), B.ds_config(3, micro_bs=MICRO_BS), trainable=False)
    dev = B.device()

    def step(i):
        x, labels = _batch(i, dev)
        with torch.no_grad():
            t_logits = t(x)
        s_logits = s(x)
        kd = F.kl_div(F.log_softmax(s_logits, -1), F.log_softmax(t_logits, -1), log_target=True,
                      reduction="batchmean")
        loss = kd + F.cross_entropy(s_logits.flatten(0, 1), labels.flatten())
        if ours:
            loss.backward()
        else:
            s.backward(loss)
        s.step()
    return step


def timing(warmup, steps):
    st, te = _models()
    t = B.interleave({v: _build(v, st, te) for v in VARIANTS}, warmup, steps)
    return {k: v["total"] for k, v in t.items()}


def memory(variant, steps):
    st, te = _models()
    return B.peak_memory_of_steps(lambda: _build(variant, st, te), steps)


def main():
    ap = B.arg_parser(__doc__)
    args = ap.parse_args()
    t = B.launch(timing, args.warmup, args.steps)[0]
    med = {v: B.median(t[v]) for v in VARIANTS}
    mem = {} if args.no_memory else {v: B.launch(memory, v, 2)[0] for v in VARIANTS}
    rows, data = [], []
    for v in VARIANTS:
        base = "upstream " + v.split()[1]
        rec = {"variant": v, "ms": med[v], "iqr_ms": B.iqr(t[v]), "time_vs_upstream": B.paired_ratio(t[v], t[base]),
               "peak_mb": mem.get(v), "raw_ms": t[v]}
        data.append(rec)
        rows.append([v, f"{med[v]:.1f} ±{rec['iqr_ms']:.1f}", f"{rec['time_vs_upstream']:.3f}",
                     f"{mem[v]:.1f}" if mem else "-"])
    table = B.fmt_table(["variant (student+teacher stages)", "ms/step (IQR)", "time vs upstream same layout (paired)",
                         "peak MiB/rank"], rows)
    st, te = _models()
    print(f"\nDistillation: student {B.n_params(st) / 1e6:.2f}M params ({STUDENT_LAYERS} blocks), frozen teacher "
          f"{B.n_params(te) / 1e6:.2f}M params ({TEACHER_LAYERS} blocks) under no_grad, d={D}, vocab {VOCAB}, "
          f"micro-batch {MICRO_BS}x{SEQ}, {B.WORLD_SIZE} rank(s), median of {args.steps} steps after {args.warmup} warm-up; "
          f"memory = {B.memory_kind()}\n")
    print(table)
    result = (f"RESULT distill_ours_vs_upstream={med['ours Z2+Z3'] / med['upstream Z2+Z3']:.3f} "
              f"distill_z2z3_vs_z3z3={B.paired_ratio(t['ours Z2+Z3'], t['ours Z3+Z3']):.3f}")
    if mem:
        result += f" mem_distill_z2z3_vs_z3z3={mem['ours Z2+Z3'] / mem['ours Z3+Z3']:.3f}"

    def plot(plt):
        groups = ["student Z2 + teacher Z3", "both Z3"]
        series = {"upstream": [med["upstream Z2+Z3"], med["upstream Z3+Z3"]],
                  "ours": [med["ours Z2+Z3"], med["ours Z3+Z3"]]}
        return B.bar_plot(plt, "Distillation step time", groups, series, "ms / step (median)")

    B.save("distillation", {"meta": B.meta(steps=args.steps, warmup=args.warmup), "rows": data, "table": table,
                            "result": result}, plot)
    print(result)


if __name__ == "__main__":
    main()
