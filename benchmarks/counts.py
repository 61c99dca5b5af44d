"""The hardware-independent cost of one training step: collectives, operators, host syncs.

On a GPU every collective and every kernel launch is a fixed latency, and every host sync stalls
the launch queue, so these counts predict what the CPU box cannot time. One step is counted after
eight warm-up steps (ZeRO-3 records its trace in the first two; the third is the first joined
fetch's, whose parameter set the ranks compare once: zero/stage3/joined_fetch.py; the ranks stop
meeting at the store once the loop's regions repeat, after 16 regions and one step: reliability/
region_sequence.py), on every rank,
by a ``TorchDispatchMode`` that sees every operator below autograd (forward, backward and the
optimizer), including ``c10d`` collectives:

* collectives: ``c10d`` operators, by kind, and the bytes of each one's whole buffer (the
  all-reduced tensor, the gathered output, the reduce-scattered input);
* operators: every other operator dispatched (``aten``, ``prims``, ...);
* host syncs: operators that hand a device value to Python (``_local_scalar_dense``: ``.item()``,
  ``bool(t)``; ``is_nonzero``; ``equal``), each a stall on a GPU;
* store meetings: our ranks' rendezvous-store meetings before an engine's collectives
  (``agree_before_collectives``, on by default with gloo; off with NCCL; held only where the loop's
  recent regions do not predict the region), round trips to the store that the dispatcher does not see;
* allocated MiB: the bytes of the tensors the step's factory operators create (``empty``,
  ``zeros``, ``*_like``, ...), touched or not: what a GPU's allocator is asked for (ZeRO-1/2's
  bucket buffers, allocated every window, are the large part at DeepSpeed's default bucket size).

Variants, in the same 2 ranks (AdamW, fp32, DeepSpeed's default bucket sizes):

* ours: N ``deepspeed_multi`` engines under one ``loss.backward()``;
* upstream: N ``deepspeed.initialize`` engines under one ``loss.backward()`` (DeepSpeed 0.19.8
  runs its ZeRO-1-3 hooks for a direct backward); in the RLHF step, ``actor.backward`` then
  ``critic.backward`` and the reward model called as ``reward.module`` (as in rlhf_step.py);
* super-module: the N towers as one module in one upstream ZeRO-3 engine (``engine.backward``).

Workloads: growth.py's towers (one block, d=128), N = 1, 2, 4, 8, 16, chained and parallel, the
engines all ZeRO-2, all ZeRO-3 or alternating; and rlhf_step.py's four-engine step.

Prints a table; writes benchmarks/results/counts.json and .png.

Usage: python benchmarks/counts.py [--engines 1 2 4 8 16] [--stages alt 2 3] [--no-rlhf]
"""
from __future__ import annotations

import collections
import copy
import gc

import _bench as B
import growth

SYNC_OPS = ("aten._local_scalar_dense", "aten.is_nonzero", "aten.equal")
# Operators that make a new tensor of a size they are given: what a step asks the allocator for
# (the bucket buffers, flat copies), whether or not it is touched (a GPU allocates it all).
FACTORY_OPS = ("aten.empty", "aten.empty_strided", "aten.zeros", "aten.ones", "aten.full", "aten.empty_like",
               "aten.zeros_like", "aten.ones_like", "aten.full_like", "aten.new_empty", "aten.new_zeros",
               "aten.new_full", "aten.new_empty_strided")


def _dispatch_mode_class():
    from torch.utils._python_dispatch import TorchDispatchMode

    class StepCounter(TorchDispatchMode):
        """Counts the operators dispatched while it is entered (see the module docstring)."""

        def __init__(self):
            super().__init__()
            self.collectives = collections.Counter()
            self.collective_bytes = collections.Counter()
            self.ops = 0
            self.syncs = 0
            self.factory_bytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func.overloadpacket) if hasattr(func, "overloadpacket") else str(func)
            if name.startswith("c10d."):
                kind = name.split(".", 1)[1].rstrip("_")
                self.collectives[kind] += 1
                self.collective_bytes[kind] += _largest_tensor_bytes(args)
            else:
                self.ops += 1
                self.syncs += name in SYNC_OPS
            out = func(*args, **(kwargs or {}))
            if name in FACTORY_OPS:
                self.factory_bytes += _largest_tensor_bytes(out)
            return out

    return StepCounter


def _largest_tensor_bytes(args) -> int:
    import torch
    sizes = [0]

    def visit(a):
        if isinstance(a, torch.Tensor):
            sizes.append(a.numel() * a.element_size())
        elif isinstance(a, (list, tuple)):
            for b in a:
                visit(b)
    visit(args)
    return max(sizes)


class _StoreMeetings:
    """Counts our watchdog's store meetings (deepspeed_multi/reliability/watchdog.py) while entered."""

    def __enter__(self):
        from deepspeed_multi.reliability import watchdog
        self.cls, self.count = watchdog._Monitor, 0
        self.original = self.cls.meet
        counter = self

        def meet(monitor, key, target):
            counter.count += 1
            return counter.original(monitor, key, target)
        self.cls.meet = meet
        return self

    def __exit__(self, *exc):
        self.cls.meet = self.original


def count_step(step, warmup=8) -> dict:
    """Run ``step(i)`` ``warmup`` times, then count one step; the counts of this rank."""
    for i in range(warmup):
        step(i)
    with _StoreMeetings() as meetings, _dispatch_mode_class()() as counter:
        step(warmup)
    return {"collectives": sum(counter.collectives.values()), "by_kind": dict(counter.collectives),
            "collective_mb": sum(counter.collective_bytes.values()) / B.MB, "ops": counter.ops,
            "host_syncs": counter.syncs, "store_meetings": meetings.count,
            "allocated_mb": counter.factory_bytes / B.MB}


def _tower_variants(n, wiring, stages):
    import deepspeed
    import deepspeed_multi
    dev = B.device()
    towers = [B.Tower(growth.D_ENGINE, growth.D_ENGINE, 1, growth.D_ENGINE, seed=k) for k in range(n)]
    shape = (growth.MICRO_BS, growth.SEQ, growth.D_ENGINE)

    def engines_step(init):
        engines = [B.build_engine(init, copy.deepcopy(t), B.ds_config(growth.STAGES[stages](k)))
                   for k, t in enumerate(towers)]
        return growth.towers_step(engines, wiring, shape)

    def super_step():
        whole = B.build_engine(deepspeed.initialize, (B.Chain if wiring == "chained" else growth.Parallel)(
            *copy.deepcopy(towers)), B.ds_config(3))

        def step(i):
            x, y = growth._batch(i, shape, dev)
            whole.backward(growth._loss(whole(x), y))
            whole.step()
        return step

    return {"ours": lambda: engines_step(deepspeed_multi.initialize),
            "upstream": lambda: engines_step(deepspeed.initialize), "super-module": super_step}


def counts(engine_counts, stage_sets, rlhf):
    import deepspeed.comm as dist
    rows = []
    for stages in stage_sets:
        for wiring in ("chained", "parallel"):
            for n in engine_counts:
                for variant, build in _tower_variants(n, wiring, stages).items():
                    if variant == "super-module" and stages != stage_sets[0]:
                        continue  # the same single ZeRO-3 engine whatever the towers' stages
                    rows.append({"workload": f"towers {wiring}", "stages": stages, "n": n, "variant": variant,
                                 **count_step(build())})
                    gc.collect()
    if rlhf:
        import rlhf_step
        models = rlhf_step._models()
        for variant in rlhf_step.VARIANTS:
            rows.append({"workload": "rlhf step", "stages": "2,3,3,3", "n": 4, "variant": variant,
                         **count_step(rlhf_step._build(variant, models))})
            gc.collect()
    # every rank counts its own step; report the max over ranks of each figure
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, rows)
    for k, row in enumerate(rows):
        for key in ("collectives", "collective_mb", "ops", "host_syncs", "store_meetings"):
            row[key] = max(r[k][key] for r in gathered)
    return rows


def main():
    ap = B.arg_parser(__doc__)
    ap.add_argument("--engines", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--stages", nargs="+", default=["alt", "2", "3"], choices=list(growth.STAGES))
    ap.add_argument("--no-rlhf", action="store_true")
    args = ap.parse_args()
    rows = B.launch(counts, args.engines, args.stages, not args.no_rlhf, timeout_s=3000)[0]
    table = B.fmt_table(
        ["workload", "stages", "N", "variant", "collectives", "by kind", "MiB", "operators", "host syncs",
         "store meetings", "allocated MiB"],
        [[r["workload"], r["stages"], r["n"], r["variant"], r["collectives"],
          " ".join(f"{k}:{v}" for k, v in sorted(r["by_kind"].items())), f"{r['collective_mb']:.2f}", r["ops"],
          r["host_syncs"], r["store_meetings"], f"{r['allocated_mb']:.1f}"] for r in rows])
    print(f"\nOne training step after 3 warm-up steps, 2 ranks on {B.device().type}, max over ranks\n")
    print(table)
    eight = {r["variant"]: r["collectives"] for r in rows
             if r["workload"] == "towers chained" and r["n"] == 8 and r["stages"] == "alt"}
    result = "RESULT " + " ".join(f"collectives_chain8_{k.replace('-', '_')}={v}" for k, v in eight.items())
    alloc = {r["variant"]: r["allocated_mb"] for r in rows
             if r["workload"] == "towers chained" and r["n"] == 8 and r["stages"] == "alt"}
    result += " " + " ".join(f"allocated_mb_chain8_{k.replace('-', '_')}={v:.1f}" for k, v in alloc.items())
    print(result)

    def plot(plt):
        fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
        for ax, key, label in zip(axes, ("collectives", "ops", "host_syncs"),
                                  ("collectives per step", "operators per step", "host syncs per step")):
            for variant, style in (("ours", "-"), ("upstream", ":"), ("super-module", "--")):
                for wiring, marker in (("chained", "o"), ("parallel", "s")):
                    rs = [r for r in rows if r["workload"] == f"towers {wiring}" and r["variant"] == variant
                          and r["stages"] == "alt"]
                    if rs:
                        ax.plot([r["n"] for r in rs], [r[key] for r in rs], linestyle=style, marker=marker,
                                label=f"{variant}, {wiring}")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("engines (towers)")
            ax.set_ylabel(label)
            ax.set_title(f"{label} (ZeRO-2/3 alternating)")
        axes[0].legend(fontsize=7)
        return fig

    B.save("counts", {"meta": B.meta(), "rows": rows, "table": table, "result": result}, plot)


if __name__ == "__main__":
    main()
