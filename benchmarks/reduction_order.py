"""Why gradient reductions of several engines cannot share one collective and keep their bits.

All-reduce: each of ``world`` gloo ranks all-reduces two fp32 tensors (1,000 and 3,000 elements, as
two engines' gradient buckets would be) three ways: one ``all_reduce`` per tensor (each engine on
its own), one ``all_reduce`` of the two joined, and ``all_reduce_coalesced``. It prints how many
elements of the joined results differ in their bits from the per-tensor ones. At two ranks an
element's sum is a + b either way; from three ranks on the ring algorithm adds the ranks'
contributions in an order that depends on where the element falls in the buffer, so joining
buffers (as a larger bucket does, too) changes the rounding of some elements.

Reduce-scatter (``--engines N``, ZeRO-3's collective): N engines' gradients of the growth
benchmark's towers (one block, d = 128) through DeepSpeed's ``reduce_scatter_coalesced``, which
lays each gradient out rank by rank: once per engine, and once for all N joined (each rank's block
then holds every engine's slice of that rank). Prints the elements whose bits differ (summed over
ranks) and, at each world size, the median time of the N separate calls and of the one joined call,
interleaved in the same ranks (``--reps`` each).

Usage: python benchmarks/reduction_order.py [--worlds 2 3 4] [--engines 8] [--reps 40]
"""
import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import _bench as B
from rank_launcher import free_port  # noqa: E402 (on the path _bench sets)


def _rank(rank, world, port, out, engines, reps):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    torch.set_num_threads(1)  # as every benchmark's ranks (benchmarks/_bench.py)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    g = torch.Generator().manual_seed(rank)
    a, b = torch.randn(1000, generator=g) * 1e3, torch.randn(3000, generator=g) * 1e-2
    alone = [a.clone(), b.clone()]
    for t in alone:
        dist.all_reduce(t)
    joined = torch.cat([a, b])
    dist.all_reduce(joined)
    coalesced = [a.clone(), b.clone()]
    dist.all_reduce_coalesced(coalesced)
    differ = lambda got: sum(int((x != y).sum()) for x, y in zip(got, alone))  # noqa: E731
    scatter = _reduce_scatter(rank, world, engines, reps)
    if rank == 0:
        out.put((world, differ(joined.split([1000, 3000])), differ(coalesced), *scatter))
    dist.barrier()
    dist.destroy_process_group()


def _reduce_scatter(rank, world, engines, reps):
    """(elements whose bits differ, summed over ranks; elements reduced; ms separate; ms joined)."""
    import deepspeed
    from deepspeed.runtime.comm.coalesced_collectives import reduce_scatter_coalesced
    deepspeed.init_distributed("gloo", verbose=False)
    shapes = [p.shape for p in B.Tower(128, 128, 1, 128).parameters()]
    g = torch.Generator().manual_seed(100 + rank)
    grads = [[torch.randn(s, generator=g) * 10**(k % 5 - 2) for s in shapes] for k in range(engines)]
    alone = [t for e in grads for t in reduce_scatter_coalesced([x.clone() for x in e])]
    joined = reduce_scatter_coalesced([x.clone() for e in grads for x in e])
    differ = torch.tensor([sum(int((x.view(torch.int32) != y.view(torch.int32)).sum()) for x, y in zip(alone, joined))])
    dist.all_reduce(differ)
    times = {"separate": [], "joined": []}
    for i in range(reps + 5):
        for variant in (("separate", "joined") if i % 2 else ("joined", "separate")):
            dist.barrier()
            t0 = time.perf_counter()
            if variant == "separate":
                for e in grads:
                    reduce_scatter_coalesced(e)
            else:
                reduce_scatter_coalesced([x for e in grads for x in e])
            took = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            if i >= 5:
                times[variant].append(float(took) * 1e3)
    return (int(differ), sum(x.numel() for e in grads for x in e), statistics.median(times["separate"]),
            statistics.median(times["joined"]))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", nargs="+", type=int, default=[2, 3, 4])
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--reps", type=int, default=40)
    args = ap.parse_args()
    rows = []
    for world in args.worlds:
        out = mp.get_context("spawn").SimpleQueue()
        mp.spawn(_rank, args=(world, free_port(), out, args.engines, args.reps), nprocs=world)
        rows.append(out.get())
    print("| ranks | elements of 4,000 whose bits differ: one joined all_reduce | all_reduce_coalesced |")
    print("|---:|---:|---:|")
    for world, joined, coalesced, *_ in rows:
        print(f"| {world} | {joined} | {coalesced} |")
    print(f"\n{args.engines} engines' gradients through reduce_scatter_coalesced, one call each / one joined call:\n")
    print("| ranks | elements whose bits differ (all ranks) | of | separate ms | joined ms | joined / separate |")
    print("|---:|---:|---:|---:|---:|---:|")
    for world, _, _, differ, numel, separate, joined in rows:
        print(f"| {world} | {differ} | {numel:,} | {separate:.2f} | {joined:.2f} | {joined / separate:.2f} |")


if __name__ == "__main__":
    main()
