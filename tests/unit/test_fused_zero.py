"""zero.install_fused: which optimizers it changes, the consecutive-view detection, and the fused
ZeRO-3/ZeRO-2 passes against DeepSpeed's own methods (single process, no distributed init).

The optimizers are fakes (fake_zero.py) with only the attributes the methods read, so
no process group is needed; the originals run on the same fakes as the oracle.
"""
import math
import types

import pytest
import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

from deepspeed_multi import compat, switches
from deepspeed_multi.zero import install_fused
from deepspeed_multi.zero.stage12 import reduce as stage12_reduce
from deepspeed_multi.zero.stage3 import partition as stage3_partition
from deepspeed_multi.zero.runs import consecutive_runs, flat_run
from fake_zero import fake

Z3_BUFFERS = "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition"

needs_sync_device = pytest.mark.skipif(not get_accelerator().is_synchronized_device(),
                                       reason="the fakes hold CPU tensors; needs the CPU accelerator")


@pytest.fixture(autouse=True)
def _fused_on(monkeypatch):
    monkeypatch.delenv(switches.FUSED_ZERO, raising=False)


def install(opt) -> bool:
    return any(install_fused(opt).values())


# ------------------------------------------------------------------------------ fake optimizers
def fake_z3(offload=False, zenflow=False, cls=DeepSpeedZeroOptimizer_Stage3):
    return fake(cls, offload_optimizer=offload, zenflow=zenflow, micro_step_id=0,
                gradient_accumulation_dtype=torch.float32, _offload_boundary_param_ids=set(),
                oracle={"swap_optimizer": False}, **{Z3_BUFFERS: {}})


def fake_z2(partition_gradients=True, cpu_offload=False, zenflow=False):
    return fake(DeepSpeedZeroOptimizer, cpu_offload=cpu_offload, zenflow=zenflow, overlap_comm=False,
                dp_process_group=None, sequence_parallel_size=1, gradient_average=True,
                oracle={"partition_gradients": partition_gradients})


class FakeParam:
    """What partition_grads reads of a ZeRO-3 parameter: ds_id, ds_numel, partition_numel(), grad."""

    def __init__(self, ds_id, numel, world, rank):
        self.ds_id, self.ds_numel, self._world, self._rank = ds_id, numel, world, rank
        self.grad = torch.zeros(numel)

    def partition_numel(self):
        return math.ceil(self.ds_numel / self._world)


def z3_case(numels, world, rank, dtype=torch.float32, gen=None):
    """Params, their reduced partitions laid out as reduce_scatter_coalesced returns them
    (narrow views of one flat buffer, padded per tensor), and a grad-partition buffer each."""
    params = [FakeParam(i, n, world, rank) for i, n in enumerate(numels)]
    padded = [p.partition_numel() for p in params]
    flat = torch.randn(sum(padded), generator=gen).to(dtype)
    parts, off = [], 0
    for p, pad in zip(params, padded):
        real = max(0, min(pad, p.ds_numel - rank * pad))
        parts.append(flat.narrow(0, off, real))
        off += pad
    return params, parts


def run_partition_grads(opt, params, parts, bufs, micro_step_id, method):
    opt.micro_step_id = micro_step_id
    opt._offload_boundary_param_ids = set()
    setattr(opt, Z3_BUFFERS, bufs)
    opt.gradient_accumulation_dtype = next(iter(bufs.values())).dtype
    opt._get_param_partition_rank = lambda p: p._rank
    for p in params:
        p.grad = torch.zeros(p.ds_numel)
    out = method(params, parts)
    return out, set(opt._offload_boundary_param_ids), [p.grad for p in params]


# ------------------------------------------------------------------------------------- install
def test_install_z3_binds_partition_grads_only():
    opt = fake_z3()
    assert install(opt) is True
    assert isinstance(opt.partition_grads, types.MethodType)
    assert opt.partition_grads.__func__ is stage3_partition.partition_grads
    assert "partition_grads" in vars(opt) and compat.installed(opt, stage3_partition.FEATURE)
    assert "allreduce_and_copy_with_multiple_ranks" not in vars(opt)
    assert install(opt) is False  # idempotent: a second call changes nothing


@pytest.mark.parametrize("partition_gradients", [True, False], ids=["stage2", "stage1"])
def test_install_z12_binds_allreduce_and_copy_only(partition_gradients):
    opt = fake_z2(partition_gradients=partition_gradients)
    assert install(opt) is True
    assert opt.allreduce_and_copy_with_multiple_ranks.__func__ is stage12_reduce.allreduce_and_copy_with_multiple_ranks
    assert "partition_grads" not in vars(opt)


@pytest.mark.parametrize("make", [
    lambda: fake_z3(offload=True),
    lambda: fake_z3(zenflow=True),
    lambda: fake_z2(cpu_offload=True),
    lambda: fake_z2(zenflow=True),
    lambda: torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1),
    lambda: object(),
],
                         ids=["z3-offload", "z3-zenflow", "z2-offload", "z2-zenflow", "torch-sgd", "object"])
def test_install_refuses_unsupported(make):
    opt = make()
    before = dict(vars(opt)) if hasattr(opt, "__dict__") else None
    assert install(opt) is False
    if before is not None:
        assert dict(vars(opt)) == before


def test_install_refuses_subclass_override():

    class Custom(DeepSpeedZeroOptimizer_Stage3):

        def partition_grads(self, params_to_release, grad_partitions):
            return []

    opt = fake_z3(cls=Custom)
    assert install(opt) is False
    assert "partition_grads" not in vars(opt)


def test_env_switch_disables(monkeypatch):
    monkeypatch.setenv(switches.FUSED_ZERO, "0")
    opt = fake_z3()
    assert install(opt) is False
    assert "partition_grads" not in vars(opt)


# --------------------------------------------------------------------------- consecutive_runs
def test_runs_of_consecutive_views():
    flat = torch.arange(20.)
    views = [flat[0:3], flat[3:7], flat[7:7], flat[7:12]]
    assert consecutive_runs(views) == [(0, 4)]
    run = flat_run(views)
    assert run.data_ptr() == flat.data_ptr() and run.numel() == 12 and run.is_contiguous()
    torch.testing.assert_close(run, flat[:12])


def test_runs_split_on_gap_storage_and_dtype():
    flat = torch.arange(20.)
    other = torch.arange(20.)
    views = [flat[0:3], flat[4:6], flat[6:8], other[8:10], other[10:12].to(torch.bfloat16), flat[12:13]]
    assert consecutive_runs(views) == [(0, 1), (1, 3), (3, 4), (4, 5), (5, 6)]
    torch.testing.assert_close(flat_run(views[1:3]), flat[4:8])


def test_runs_separate_tensors_and_refusals():
    assert consecutive_runs([torch.zeros(3), torch.zeros(3)]) == [(0, 1), (1, 2)]
    assert consecutive_runs([]) == []
    assert consecutive_runs([torch.zeros(4, 4).t()]) is None  # non-contiguous
    assert consecutive_runs([torch.zeros(3, dtype=torch.float64)]) is None  # dtype the ops do not take


def test_runs_views_of_2d_rows():
    m = torch.zeros(4, 5)
    assert consecutive_runs([m[0], m[1], m[3]]) == [(0, 2), (2, 3)]


# ---------------------------------------------------------------- ZeRO-3 fused vs the original
@needs_sync_device
@pytest.mark.parametrize("world,rank", [(2, 0), (2, 1), (4, 3)])
@pytest.mark.parametrize("dtype,buf_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                             (torch.bfloat16, torch.float32)])
def test_z3_partition_grads_matches_original(world, rank, dtype, buf_dtype):
    gen = torch.Generator().manual_seed(world * 10 + rank)
    numels = [8, 7, 3, 64, 1, 10, 2, 33]  # odd sizes leave padding gaps and empty last partitions
    params, parts = z3_case(numels, world, rank, dtype, gen)
    init = {p.ds_id: torch.randn(p.partition_numel(), generator=gen).to(buf_dtype) for p in params}

    fused = fake_z3()
    assert install(fused)
    fell_back = []
    compat.set_original(fused, "partition_grads", lambda *a: fell_back.append(a))  # must not be reached
    plain = fake_z3()
    for step in (0, 1, 2):
        bufs_f = {k: v.clone() for k, v in init.items()}
        bufs_o = {k: v.clone() for k, v in init.items()}
        out_f, ids_f, grads_f = run_partition_grads(fused, params, parts, bufs_f, step, fused.partition_grads)
        out_o, ids_o, grads_o = run_partition_grads(plain, params, parts, bufs_o, step,
                                                    types.MethodType(DeepSpeedZeroOptimizer_Stage3.partition_grads,
                                                                     plain))
        assert ids_f == ids_o
        assert all(g is None for g in grads_f) and all(g is None for g in grads_o)
        assert len(out_f) == len(out_o)
        for a, b in zip(out_f, out_o):
            assert a.shape == b.shape
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        for k in init:
            torch.testing.assert_close(bufs_f[k], bufs_o[k], rtol=0, atol=0)
    assert not fell_back


@needs_sync_device
def test_z3_falls_back_for_separate_partitions():
    params, _ = z3_case([4, 6, 8], 2, 0)
    parts = [torch.randn(p.partition_numel()) for p in params]  # separate tensors: no run to fuse
    opt = fake_z3()
    assert install(opt)
    calls = []
    original = compat.original(opt, "partition_grads")
    compat.set_original(opt, "partition_grads", lambda *a: calls.append(a) or original(*a))
    bufs = {p.ds_id: torch.zeros(p.partition_numel()) for p in params}
    run_partition_grads(opt, params, parts, bufs, 0, opt.partition_grads)
    assert len(calls) == 1
    for p, g in zip(params, parts):
        torch.testing.assert_close(bufs[p.ds_id], g)


# ---------------------------------------------------------------- ZeRO-2 fused vs the original
@needs_sync_device
@pytest.mark.parametrize("with_outputs", [False, True])
def test_z2_allreduce_and_copy_matches_original(monkeypatch, with_outputs):
    import deepspeed.comm as dist
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    gen = torch.Generator().manual_seed(0)
    ipg = torch.randn(40, generator=gen).to(torch.bfloat16)
    sizes = [5, 3, 8, 4, 6, 2, 12]
    ranks = [0, 1, 1, 0, 1, frozenset({0, 1}), 1]
    offs = [sum(sizes[:i]) for i in range(len(sizes))]

    def run(method_of):
        bucket_buf = ipg.clone()
        small = [bucket_buf.narrow(0, o, n) for o, n in zip(offs, sizes)]
        flat_part = torch.randn(80, generator=torch.Generator().manual_seed(1))
        outputs = [flat_part.narrow(0, 2 * o, n) if with_outputs and i != 2 else None
                   for i, (o, n) in enumerate(zip(offs, sizes))] if with_outputs else None
        opt = fake_z2()
        # Stands in for the collective: "reduce" = times 3, in the communication dtype.
        opt.allreduce_bucket = lambda bucket, dt, log=None, divide=True, process_group=None: (
            torch.cat([t.reshape(-1) for t in bucket]).to(dt) * 3)
        opt.unflatten = lambda flat, tensors: [t for t in flat.split([x.numel() for x in tensors])]
        method = method_of(opt)
        method(small, torch.float32, divide=False, bucket_ranks=ranks, output_bucket=outputs)
        return bucket_buf, flat_part

    def fused(opt):
        assert install(opt)
        return opt.allreduce_and_copy_with_multiple_ranks

    got = run(fused)
    want = run(lambda opt: types.MethodType(DeepSpeedZeroOptimizer.allreduce_and_copy_with_multiple_ranks, opt))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@needs_sync_device
@pytest.mark.parametrize("with_outputs", [False, True])
def test_z12_bucket_of_one_run_is_reduced_in_place(monkeypatch, with_outputs):
    """Same dtype, consecutive slices: one all-reduce of the bucket itself, no flatten, no copy-back.
    This rank's slices and the adds into the fp32 partition equal DeepSpeed's; the other ranks'
    slices hold the reduced values where DeepSpeed leaves them unreduced (see the Note)."""
    import deepspeed.comm as dist
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_reduce", lambda t, group=None: t.mul_(3))  # stands in for the collective
    gen = torch.Generator().manual_seed(0)
    ipg = torch.randn(40, generator=gen)
    sizes = [5, 3, 8, 4, 6, 2, 12]
    ranks = [0, 1, 1, 0, 1, frozenset({0, 1}), 1]
    offs = [sum(sizes[:i]) for i in range(len(sizes))]

    def run(method_of, divide):
        bucket_buf = ipg.clone()
        small = [bucket_buf.narrow(0, o, n) for o, n in zip(offs, sizes)]
        flat_part = torch.randn(80, generator=torch.Generator().manual_seed(1))
        outputs = [flat_part.narrow(0, 2 * o, n) if i != 2 else None
                   for i, (o, n) in enumerate(zip(offs, sizes))] if with_outputs else None
        opt = fake_z2()
        flattened = []

        def allreduce_bucket(bucket, dt, log=None, divide=True, process_group=None):
            flat = torch.cat([t.reshape(-1) for t in bucket]).to(dt)
            flattened.append(flat)
            return (flat / 2 if divide else flat) * 3

        opt.allreduce_bucket = allreduce_bucket
        opt.unflatten = lambda flat, tensors: [t for t in flat.split([x.numel() for x in tensors])]
        method_of(opt)(small, torch.float32, divide=divide, bucket_ranks=ranks, output_bucket=outputs)
        return bucket_buf, flat_part, flattened

    def fused(opt):
        assert install(opt)
        return opt.allreduce_and_copy_with_multiple_ranks

    for divide in (False, True):
        got_buf, got_part, got_flat = run(fused, divide)
        want_buf, want_part, _ = run(
            lambda opt: types.MethodType(DeepSpeedZeroOptimizer.allreduce_and_copy_with_multiple_ranks, opt), divide)
        assert not got_flat, "the in-place path flattened the bucket"
        reduced = (ipg / 2 if divide else ipg) * 3
        for o, n, r in zip(offs, sizes, ranks):
            mine = r == 1 or (isinstance(r, frozenset) and 1 in r)
            want = want_buf[o:o + n] if mine else reduced[o:o + n]
            torch.testing.assert_close(got_buf[o:o + n], want, rtol=0, atol=0)
        torch.testing.assert_close(got_part, want_part, rtol=0, atol=0)
