"""zero2_pack: the deferred, fused copy into the IPG bucket of ZeRO-1 and ZeRO-2 against DeepSpeed's own
per-parameter method, on a fake optimizer (single process, no process group).

Both paths get the same stream of gradients (sizes drawn around the bucket size, dtypes mixed
with the bucket's); the bucket's consumer (``reduce_ipg_grads``) is a recorder, so every
flush is compared bit for bit: the buffer contents, the params list, and afterwards every
gradient must be a view of its slice of the bucket, as DeepSpeed leaves it.
"""
import pytest
import torch
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer, IPGBucket
from hypothesis import given, settings
from hypothesis import strategies as st

from deepspeed_multi import compat
from deepspeed_multi.zero.stage12 import bucket_pack as zero2_pack
from fake_zero import fake


class FakeParam(torch.nn.Parameter):
    pass


def fake_z2(bucket_size, overlap, comm_dtype, stage=2, cls=DeepSpeedZeroOptimizer):
    opt = fake(cls, contiguous_gradients=True, cpu_offload=False, zenflow=False, autoep_folding_tp_group=None,
               _offload_gradient_safety_enabled=False, overlap_comm=overlap, reduce_bucket_size=bucket_size,
               params_already_reduced=[],
               oracle=dict(partition_gradients=stage == 2, use_grad_accum_attribute=False,
                           communication_data_type=comm_dtype, param_id={}, extra_large_param_to_reduce={}))
    opt.ipg_buckets = {comm_dtype: IPGBucket(buffer=[torch.full((bucket_size, ), float("nan"), dtype=comm_dtype)
                                                     for _ in range(2)])}
    return opt


def record_flushes(opt, flushes):

    def reduce_ipg_grads(comm_dtype=None):
        for dtype, bucket in opt.ipg_buckets.items():
            if dtype in opt.extra_large_param_to_reduce:   # DeepSpeed reduces the param's own grad
                big = opt.extra_large_param_to_reduce.pop(dtype)
                flushes.append(("large", big.grad.clone(), list(bucket.params)))
            else:
                flushes.append(("bucket", bucket.buffer[bucket.index][:bucket.elements].clone(), list(bucket.params)))
            bucket.clear()

    return reduce_ipg_grads


def run(opt, params, grads, deferred):
    flushes = []
    for i, p in enumerate(params):
        opt.param_id[id(p)] = i
        opt.params_already_reduced.append(False)
        p.param_idx_in_group = i
    if deferred:
        assert zero2_pack.install(opt)
        compat.set_original(opt, "reduce_ipg_grads", record_flushes(opt, flushes))
    else:
        opt.reduce_ipg_grads = record_flushes(opt, flushes)
    for p, g in zip(params, grads):
        p.grad = g.clone()
        opt.reduce_independent_p_g_buckets_and_remove_grads(p, 0)
    opt.reduce_ipg_grads()  # the backward epilogue's flush
    return flushes


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 40), min_size=1, max_size=24), bucket=st.integers(8, 48),
       overlap=st.booleans(), dtypes=st.sampled_from([(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                      (torch.float32, torch.bfloat16), (torch.float16, torch.float32)]),
       seed=st.integers(0, 2**16), stage=st.sampled_from([1, 2]))
def test_deferred_pack_matches_deepspeed(sizes, bucket, overlap, dtypes, seed, stage):
    grad_dtype, comm_dtype = dtypes
    gen = torch.Generator().manual_seed(seed)
    grads = [torch.randn(n, generator=gen).to(grad_dtype).reshape(-1, 1) if n % 2 else
             torch.randn(n, generator=gen).to(grad_dtype) for n in sizes]
    results = []
    for deferred in (False, True):
        params = [FakeParam(torch.zeros(g.shape, dtype=grad_dtype)) for g in grads]
        opt = fake_z2(bucket, overlap, comm_dtype, stage)
        flushes = run(opt, params, grads, deferred)
        results.append((flushes, params, opt))
    (want, p_want, opt_want), (got, p_got, opt) = results
    assert len(got) == len(want)
    for (kind_w, buf_w, params_w), (kind_g, buf_g, params_g) in zip(want, got):
        assert kind_g == kind_w and params_g == params_w
        assert buf_g.dtype == buf_w.dtype and torch.equal(buf_g, buf_w), (buf_g, buf_w)

    def in_bucket(p, o):
        return any(p.grad.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
                   for bucket in o.ipg_buckets.values() for buf in bucket.buffer)

    for a, b in zip(p_want, p_got):
        assert b.grad.shape == a.grad.shape and b.grad.dtype == a.grad.dtype
        assert torch.equal(a.grad, b.grad) or (a.grad.isnan().any() and torch.equal(a.grad.isnan(), b.grad.isnan()))
        # Where DeepSpeed points the gradient into the bucket, the deferred path does too.
        assert in_bucket(b, opt) == in_bucket(a, opt_want)
    assert not compat.state(opt, zero2_pack.FEATURE)["pending"]


def test_install_refuses_what_it_does_not_cover():
    for change in [dict(contiguous_gradients=False), dict(cpu_offload=True),
                   dict(zenflow=True), dict(_offload_gradient_safety_enabled=True)]:
        opt = fake_z2(16, False, torch.float32)
        vars(opt).update(change)
        assert zero2_pack.install(opt) is False, change
        assert "reduce_ipg_grads" not in vars(opt)


def test_install_refuses_subclass_override():

    class Custom(DeepSpeedZeroOptimizer):

        def reduce_ipg_grads(self, comm_dtype=None):
            pass

    opt = fake_z2(16, False, torch.float32, cls=Custom)
    assert zero2_pack.install(opt) is False


@pytest.mark.parametrize("twice", [False, True])
def test_install_is_idempotent(twice):
    opt = fake_z2(16, False, torch.float32)
    assert zero2_pack.install(opt) is True
    if twice:
        assert zero2_pack.install(opt) is False
    assert opt.reduce_ipg_grads.__func__ is zero2_pack.reduce_ipg_grads
