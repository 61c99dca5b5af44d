"""Why gradient reductions of several engines cannot share one collective and keep their bits.

Each of ``world`` gloo ranks all-reduces two fp32 tensors (1,000 and 3,000 elements, as two
engines' gradient buckets would be) three ways: one ``all_reduce`` per tensor (each engine on its
own), one ``all_reduce`` of the two joined, and ``all_reduce_coalesced``. It prints how many
elements of the joined results differ in their bits from the per-tensor ones. At two ranks an
element's sum is a + b either way; from three ranks on the ring algorithm adds the ranks'
contributions in an order that depends on where the element falls in the buffer, so joining
buffers (as a larger bucket does, too) changes the rounding of some elements.

Usage: python benchmarks/reduction_order.py [--worlds 2 3 4]
"""
import argparse
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank, world, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
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
    if rank == 0:
        out.put((world, differ(joined.split([1000, 3000])), differ(coalesced)))
    dist.barrier()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", nargs="+", type=int, default=[2, 3, 4])
    args = ap.parse_args()
    print("| ranks | elements of 4,000 whose bits differ: one joined all_reduce | all_reduce_coalesced |")
    print("|---:|---:|---:|")
    for world in args.worlds:
        out = mp.get_context("spawn").SimpleQueue()
        mp.spawn(_rank, args=(world, _free_port(), out), nprocs=world)
        print("| %d | %d | %d |" % out.get())


if __name__ == "__main__":
    main()
