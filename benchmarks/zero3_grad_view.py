"""ZeRO-3's update with the gradient buffer as a view (zero/stage3/grad_view.py) against DeepSpeed's flattened copy.

One ZeRO-3 model (the LLM of peers.py at its large size: 8 blocks of width 512, 25M parameters),
fp32, AdamW, built three times side by side in the same 2 ranks and stepped interleaved:

* view:     ``deepspeed_multi`` as shipped (the update reads ``grad_partitions_flat_buffer``);
* copy:     ``deepspeed_multi`` with ``DSM_ZERO3_GRAD_VIEW=0`` at construction (DeepSpeed's
            ``_prepare_fp32_grad_for_sub_group`` flattens the partitions into a new tensor);
* upstream: ``deepspeed.initialize`` + ``engine.backward(loss)`` + ``engine.step()``.

Times the ``step()`` call alone and the whole iteration (median over the timed steps, paired
ratios against each baseline); peak memory of each variant alone in fresh processes.
After the timed steps every rank checks that view and copy hold bit-identical weights.

Prints a table and ``RESULT zero3_view_vs_copy_step=.. zero3_view_vs_copy_total=..
zero3_view_vs_upstream_total=..``; writes benchmarks/results/zero3_grad_view.json.

Usage: python benchmarks/zero3_grad_view.py [--steps 15] [--warmup 3] [--no-memory]
"""
from __future__ import annotations

import copy
import os
from unittest import mock

import _bench as B

D, LAYERS, SEQ, MICRO_BS = 512, 8, 32, 8
VARIANTS = ["view", "copy", "upstream"]


def _build(variant, model):
    import deepspeed
    import deepspeed_multi
    init = deepspeed.initialize if variant == "upstream" else deepspeed_multi.initialize
    with mock.patch.dict(os.environ, {"DSM_ZERO3_GRAD_VIEW": "0" if variant == "copy" else "1"}):
        return B.build_engine(init, copy.deepcopy(model), B.ds_config(3, micro_bs=MICRO_BS))


def _step_fn(variant, engine):
    import torch
    dev = B.device()

    def step(i):
        timer = B.PhaseTimer()
        g = torch.Generator().manual_seed(1000 + i)
        x, y = torch.randn(MICRO_BS, SEQ, D, generator=g).to(dev), torch.randn(MICRO_BS, SEQ, D, generator=g).to(dev)
        loss = ((engine(x) - y)**2).mean()
        engine.backward(loss) if variant == "upstream" else loss.backward()
        with timer("step"):
            engine.step()
        return timer.phases

    return step


def _equal_weights(a, b) -> bool:
    """Every full (gathered) parameter of engines ``a`` and ``b`` is bit-identical, on every rank."""
    import deepspeed
    import deepspeed.comm as dist
    import torch
    pa, pb = list(a.module.parameters()), list(b.module.parameters())
    with deepspeed.zero.GatheredParameters(pa + pb, modifier_rank=None):
        same = all(torch.equal(x, y) for x, y in zip(pa, pb))
    flag = torch.tensor([0 if same else 1], device=B.device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag.item() == 0


def timing(warmup, steps):
    model = B.Tower(D, D, LAYERS, D, seed=2)
    engines = {v: _build(v, model) for v in VARIANTS}
    t = B.interleave({v: _step_fn(v, e) for v, e in engines.items()}, warmup, steps)
    same = _equal_weights(engines["view"], engines["copy"])
    return {"times": t, "bit_identical": same, "params": B.n_params(model)}


def memory(variant, steps):
    model = B.Tower(D, D, LAYERS, D, seed=2)
    return B.peak_memory_of_steps(lambda: _step_fn(variant, _build(variant, model)), steps)


def main():
    args = B.arg_parser(__doc__).parse_args()
    res = B.launch(timing, args.warmup, args.steps)[0]
    t = res["times"]
    assert res["bit_identical"], "view and copy trained different weights"
    mem = {} if args.no_memory else {v: B.launch(memory, v, 2)[0] for v in VARIANTS}
    rows, data = [], {}
    for v in VARIANTS:
        rec = {"step_ms": B.median(t[v]["step"]), "total_ms": B.median(t[v]["total"]),
               "total_iqr_ms": B.iqr(t[v]["total"]), "peak_mb": mem.get(v)}
        if v != "view":
            rec["view_over_this_step"] = B.paired_ratio(t["view"]["step"], t[v]["step"])
            rec["view_over_this_total"] = B.paired_ratio(t["view"]["total"], t[v]["total"])
            rec["view_over_this_mem"] = mem["view"] / mem[v] if mem else None
        data[v] = rec
        rows.append([v, f"{rec['step_ms']:.1f}", f"{rec['total_ms']:.1f} ±{rec['total_iqr_ms']:.1f}",
                     "-" if v == "view" else f"{rec['view_over_this_step']:.3f}",
                     "-" if v == "view" else f"{rec['view_over_this_total']:.3f}",
                     "-" if not mem else f"{rec['peak_mb']:.0f}",
                     "-" if not mem or v == "view" else f"{rec['view_over_this_mem']:.3f}"])
    headers = ["variant", "step() ms", "iteration ms (IQR)", "view / this (step)", "view / this (iteration)",
               "peak MiB/rank", "view / this (memory)"]
    print(f"\nZeRO-3, {res['params'] / 1e6:.1f}M params, fp32 AdamW, micro-batch {MICRO_BS}x{SEQ}, 2 ranks on "
          f"{B.device().type}, median of {args.steps} steps after {args.warmup} warm-up; view and copy weights "
          f"bit-identical: {res['bit_identical']}\n")
    table = B.fmt_table(headers, rows)
    print(table)
    result = (f"RESULT zero3_view_vs_copy_step={data['copy']['view_over_this_step']:.3f} "
              f"zero3_view_vs_copy_total={data['copy']['view_over_this_total']:.3f} "
              f"zero3_view_vs_upstream_total={data['upstream']['view_over_this_total']:.3f}")
    B.save("zero3_grad_view", {"meta": B.meta(steps=args.steps, warmup=args.warmup), "results": data,
                               "bit_identical": res["bit_identical"], "table": table, "result": result})
    print(result)


if __name__ == "__main__":
    main()
