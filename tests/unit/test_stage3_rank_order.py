"""ZeRO-3's bucket laid out in the reduce-scatter's rank order (deepspeed_multi/zero/stage3/rank_order.py).

What the flush reduce-scatters must be, element for element, the buffer stage3_scatter packs at the
flush (``ops.pack_partitions``, itself checked against DeepSpeed's interleave in test_fused_reduce.py):
the same chunks, padding and rounding of the average. The multi-process side (gloo's list path, the
moved regions, DeepSpeed's bits and plain PyTorch's updates) is tests/multi_gpu/test_api.py.
"""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepspeed_multi import compat
from deepspeed_multi.ops import reference
from deepspeed_multi.zero.stage3 import rank_order


class _Param:

    def __init__(self, ds_id, grad):
        self.ds_id, self.ds_numel, self.grad = ds_id, grad.numel(), grad

    def ds_summary(self):
        return {"id": self.ds_id}


class _Bucket:

    def __init__(self, elements, dtype):
        self.params, self.elements, self.process_group = [], 0, None
        self.buffer = torch.full((elements, ), float("nan"), dtype=dtype)  # unwritten memory shows as NaN


class _Optimizer:
    """What ``place`` reads of DeepSpeed's ZeRO-3 optimizer."""

    def __init__(self, bucket_size, world, params):
        self.reduce_bucket_size = bucket_size
        self.reduce_and_partition_stream = None
        stride = rank_order.region_elements(bucket_size, world, params)
        compat.state(self, rank_order.FEATURE, {"world": world, "stride": stride, "layouts": {}, "stand_in": {},
                                                "gloo": True})

    def _get_param_partition_group(self, param):
        return None


def _packed(grads, world):
    """stage3_scatter's buffer of the same gradients: interleaved, padded, averaged."""
    block = sum(-(-g.numel() // world) for g in grads)
    out = torch.zeros(world * block, dtype=grads[0].dtype)
    exact = world & (world - 1) == 0
    reference.pack_partitions(grads, out, world, 1.0 / world if exact else 1.0)
    if not exact:
        out.div_(world)
    return out, block


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(1, 40), min_size=1, max_size=8), world=st.integers(1, 4),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), spare=st.integers(0, 60), seed=st.integers(0, 2**16))
def test_the_flushed_regions_are_the_packed_buffer(sizes, world, dtype, spare, seed):
    g = torch.Generator().manual_seed(seed)
    grads = [(torch.randn(n, generator=g) * 10).to(dtype) for n in sizes]
    opt = _Optimizer(sum(sizes) + spare, world, len(sizes))
    stride = compat.state(opt, rank_order.FEATURE)["stride"]
    bucket = _Bucket(world * stride, dtype)
    params = [_Param(i, grad.clone()) for i, grad in enumerate(grads)]
    for p in params:
        assert rank_order.place(opt, p, bucket)
        assert p.grad.shape == (p.ds_numel, ) and p.grad.untyped_storage().nbytes() == p.grad.element_size()
    assert bucket.params == params and bucket.elements == sum(sizes)
    layout = compat.state(opt, rank_order.FEATURE)["layouts"][dtype]
    want, block = _packed(grads, world)
    assert layout.fill == block <= stride
    flat, got_block = rank_order.contiguous(bucket.buffer, world, stride, layout.fill)
    for r in range(world):  # each rank's block: the moved regions, or the regions sent whole
        got = flat.narrow(0, r * got_block, block)
        assert torch.equal(got, want.narrow(0, r * block, block)), (r, got, want.narrow(0, r * block, block))


def test_a_gradient_larger_than_the_rest_of_the_bucket_is_left_to_deepspeed():
    opt = _Optimizer(10, 2, 2)
    bucket = _Bucket(2 * compat.state(opt, rank_order.FEATURE)["stride"], torch.float32)
    assert rank_order.place(opt, _Param(0, torch.ones(6)), bucket)
    big = _Param(1, torch.ones(5))
    assert not rank_order.place(opt, big, bucket)
    assert bucket.params == [bucket.params[0]] and big.grad.numel() == 5 and big.grad.stride() == (1, )


@settings(max_examples=300, deadline=None)
@given(world=st.integers(1, 5), stride=st.integers(1, 64), data=st.data())
def test_moving_the_regions_together_keeps_every_element(world, stride, data):
    fill = data.draw(st.integers(1, stride))  # a flushed bucket holds something
    buffer = torch.arange(world * stride, dtype=torch.float32)
    regions = [buffer[r * stride:r * stride + fill].clone() for r in range(world)]
    flat, block = rank_order.contiguous(buffer, world, stride, fill)
    assert block in (fill, stride) and flat.data_ptr() == buffer.data_ptr()
    if block == stride:  # left in place: the bucket nearly full, or already contiguous
        assert fill == stride or world == 1 or fill > (stride - fill) * rank_order._MAX_PIECES
    for r in range(world):
        assert torch.equal(flat[r * block:r * block + fill], regions[r]), r
