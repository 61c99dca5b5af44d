"""Fused-reduce extension vs the pure-PyTorch reference (bit-exact), flags and refusals."""
import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepspeed_multi.ops import builder
from deepspeed_multi.ops import reference as ref
from _toolchain import skip_unless_toolchain_missing

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
PAIRS = list(itertools.product(DTYPES, DTYPES))
CHUNK = 16384  # CUDA chunk size (kCudaChunk in fused_reduce.cpp); CPU threads split at 1 << 15
SIZES = [0, 1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 256, 257,
         (1 << 15) - 1, 1 << 15, (1 << 15) + 1, CHUNK - 1, CHUNK, CHUNK + 1, 65535, 65536, 65537]
SCALE = 0.3


@pytest.fixture(scope="module")
def ext():
    try:
        return builder.load()
    except builder.BuildError as exc:
        skip_unless_toolchain_missing(exc)


def same(a, b):
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def randn(n, dtype, device="cpu", gen=None):
    return (torch.randn(n, generator=gen) * 10).to(dtype).to(device)


def check_pack(impl, tensors, out_dtype, scale=SCALE, spare=3):
    total = sum(t.numel() for t in tensors)
    device = tensors[0].device if tensors else "cpu"
    out = torch.full((total + spare,), 7.0, dtype=out_dtype, device=device)
    expected = out.clone()
    flag = impl.pack(tensors, out, scale)
    expected_flag = ref.pack(tensors, expected, scale)
    same(out, expected)  # the spare tail stays untouched
    assert flag.dtype == torch.float32 and flag.dim() == 0 and flag.device == out.device
    assert flag.item() == expected_flag.item()
    return out, flag


def check_unpack(impl, src, shapes, out_dtype, accumulate, scale=SCALE):
    outs = [randn(s, out_dtype, src.device).reshape(s) for s in shapes]
    expected = [o.clone() for o in outs]
    flag = impl.unpack_accumulate(src, outs, scale, accumulate)
    expected_flag = ref.unpack_accumulate(src, expected, scale, accumulate)
    for o, e in zip(outs, expected):
        same(o, e)
    assert flag.item() == expected_flag.item()
    return outs, flag


@pytest.mark.parametrize("in_dtype,out_dtype", PAIRS, ids=lambda d: str(d).replace("torch.", ""))
def test_pack_and_unpack_match_reference_for_every_size(ext, in_dtype, out_dtype):
    gen = torch.Generator().manual_seed(0)
    tensors = [randn(n, in_dtype, gen=gen) for n in SIZES]
    out, flag = check_pack(ext, tensors, out_dtype)
    assert flag.item() == 0.0
    # the packed values, per tensor, equal the reference formula applied to that tensor alone
    first = tensors[9]
    offset = sum(SIZES[:9])
    same(out[offset:offset + first.numel()], (first.float() * SCALE).to(out_dtype))
    for accumulate in (False, True):
        _, flag = check_unpack(ext, out, [(n,) for n in SIZES], in_dtype, accumulate)
        assert flag.item() == 0.0


def test_reference_is_exact_for_fp32():
    t = [torch.randn(5, 3), torch.randn(4)]
    out = torch.empty(19)
    ref.pack(t, out, 0.5)
    same(out, torch.cat([x.reshape(-1) for x in t]) * 0.5)


def test_many_tiny_tensors_and_empties(ext):
    gen = torch.Generator().manual_seed(1)
    sizes = torch.randint(0, 6, (2000,), generator=gen).tolist()
    for in_dtype, out_dtype in [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                (torch.float16, torch.bfloat16)]:
        tensors = [randn(n, in_dtype, gen=gen) for n in sizes]
        out, _ = check_pack(ext, tensors, out_dtype)
        check_unpack(ext, out, [(n,) for n in sizes], torch.float32, accumulate=True)


def test_empty_lists_and_empty_tensors(ext):
    out, flag = check_pack(ext, [], torch.float32)
    assert flag.item() == 0.0
    check_pack(ext, [torch.empty(0), torch.empty(0, 3)], torch.bfloat16)
    src = torch.randn(4)
    _, flag = check_unpack(ext, src, [], torch.float32, accumulate=True)
    assert flag.item() == 0.0
    check_unpack(ext, src, [(0,), (2, 2), (0, 5)], torch.float32, accumulate=False)


def test_mixed_input_dtypes(ext):
    tensors = [randn(n, d) for n, d in zip([5, 40000, 9], DTYPES)]
    check_pack(ext, tensors, torch.float16)


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("where", ["first", "last"])
@pytest.mark.parametrize("in_dtype", DTYPES, ids=str)
def test_nonfinite_flag_at_edges(ext, bad, where, in_dtype):
    tensors = [randn(n, in_dtype) for n in (33, 1000, 70001)]
    target, index = (tensors[0], 0) if where == "first" else (tensors[-1], -1)
    target[index] = bad
    for out_dtype in DTYPES:
        out, flag = check_pack(ext, tensors, out_dtype)
        assert flag.item() == 1.0
        for accumulate in (False, True):
            _, flag = check_unpack(ext, out, [t.shape for t in tensors], torch.float32, accumulate)
            assert flag.item() == 1.0


def test_flag_set_by_overflow_on_cast(ext):
    big = torch.full((100,), 1e6)  # finite in fp32, inf in fp16
    _, flag = check_pack(ext, [big], torch.float16)
    assert flag.item() == 1.0
    _, flag = check_pack(ext, [big], torch.float32)
    assert flag.item() == 0.0
    _, flag = check_unpack(ext, big, [(100,)], torch.float32, accumulate=False, scale=1e38)
    assert flag.item() == 1.0


def test_misaligned_and_noncontiguous_inputs(ext):
    storage = randn(10_001, torch.float32)
    misaligned = [storage[1:1 + 4097], storage[4099:4099 + 333].view(9, 37)]  # odd element offsets
    transposed = [randn(300 * 7, torch.bfloat16).view(300, 7).t(), torch.randn(64, 65)[:, ::2]]
    assert not transposed[0].is_contiguous() and not transposed[1].is_contiguous()
    for out_dtype in DTYPES:
        out, _ = check_pack(ext, misaligned + transposed, out_dtype)
    # misaligned src and outs for unpack (outs are contiguous views at odd offsets)
    src = randn(5000, torch.float16)[3:]
    base = torch.randn(6001)
    outs = [base[1:2001], base[2001:2001 + 1500].view(30, 50)]
    expected = [o.clone() for o in outs]
    ext.unpack_accumulate(src, outs, 2.0, True)
    ref.unpack_accumulate(src, expected, 2.0, True)
    for o, e in zip(outs, expected):
        same(o, e)


@pytest.mark.parametrize("impl_name", ["ext", "ref"])
def test_refusals_name_the_tensor(ext, impl_name):
    impl = ext if impl_name == "ext" else ref
    ok = torch.randn(4)
    with pytest.raises(ValueError, match=r"tensors\[1\].*int64.*expected torch.float32"):
        impl.pack([ok, torch.ones(3, dtype=torch.int64)], torch.empty(10), 1.0)
    with pytest.raises(ValueError, match=r"tensors\[2\].*\[3, 2\].*needs out elements \[8, 14\).*out has 10"):
        impl.pack([ok, ok, torch.randn(3, 2)], torch.empty(10), 1.0)
    with pytest.raises(ValueError, match=r"out .*1-D contiguous"):
        impl.pack([ok], torch.empty(4, 2), 1.0)
    with pytest.raises(ValueError, match=r"outs\[1\] \(shape \[3, 4\].*not contiguous.*contiguous tensor"):
        impl.unpack_accumulate(torch.randn(20), [ok, torch.randn(4, 3).t()], 1.0, True)
    with pytest.raises(ValueError, match=r"outs\[0\].*needs src elements \[0, 30\).*src has 20"):
        impl.unpack_accumulate(torch.randn(20), [torch.randn(30)], 1.0, False)
    with pytest.raises(ValueError, match=r"outs\[0\].*float64.*expected"):
        impl.unpack_accumulate(torch.randn(20), [torch.randn(3, dtype=torch.float64)], 1.0, False)
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"tensors\[1\].*is on cuda.*out is on cpu"):
            impl.pack([ok, ok.cuda()], torch.empty(10), 1.0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("in_dtype,out_dtype", PAIRS, ids=lambda d: str(d).replace("torch.", ""))
def test_cuda_matches_reference(ext, in_dtype, out_dtype):
    assert ext.has_cuda, "extension was built without CUDA kernels"
    gen = torch.Generator().manual_seed(2)
    sizes = SIZES + [3 * CHUNK + 5] + [1, 2, 3] * 1500  # a 4,600-entry tensor table, most entries misaligned
    tensors = [randn(n, in_dtype, gen=gen).cuda() for n in sizes]
    tensors.append(randn(777, in_dtype).cuda()[1:])  # misaligned
    out, flag = check_pack(ext, tensors, out_dtype)
    assert flag.item() == 0.0
    for accumulate in (False, True):
        check_unpack(ext, out, [t.shape for t in tensors], in_dtype, accumulate)
    tensors[-2][0] = float("nan")
    _, flag = check_pack(ext, tensors, out_dtype)
    assert flag.item() == 1.0



@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_mixed_dtypes_share_one_flag(ext):
    """Three input dtypes in one call: a tensor table and a launch per dtype pair, one flag."""
    gen = torch.Generator().manual_seed(4)
    tensors = [randn(n, DTYPES[i % 3], gen=gen).cuda() for i, n in enumerate([5, 40000, 9, CHUNK + 3, 1, 77])]
    _, flag = check_pack(ext, tensors, torch.float16)
    assert flag.item() == 0.0
    for i in range(3):
        bad = [t.clone() for t in tensors]
        bad[3 + i][-1] = float("inf")
        _, flag = check_pack(ext, bad, torch.float16)
        assert flag.item() == 1.0, f"an inf in the {bad[3 + i].dtype} launch was not flagged"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("extra", [-31, -1, 0, 1], ids=lambda e: f"inline{e:+d}")
def test_cuda_tables_by_value_and_in_memory(ext, extra):
    """Tables of up to cuda_inline_tensors tensors go in the launch's arguments, larger ones through
    device memory: both sides of the boundary, sizes around the chunk, misaligned, the flag."""
    count = ext.cuda_inline_tensors + extra
    gen = torch.Generator().manual_seed(100 + count)
    sizes = [SIZES[(7 * i + 3) % len(SIZES)] or 1 for i in range(count - 1)]
    cases = [(torch.bfloat16, torch.float32, ext.cuda_inline_tensors), (torch.float32, torch.float16, 0)]
    for in_dtype, out_dtype, inline in cases:  # inline 0: the same table through device memory
        previous = ext.set_cuda_inline_tensors(inline)
        try:
            tensors = [randn(n, in_dtype, gen=gen).cuda() for n in sizes]
            tensors.append(randn(CHUNK + 2, in_dtype, gen=gen).cuda()[1:])  # misaligned, over a chunk
            out, flag = check_pack(ext, tensors, out_dtype)
            assert flag.item() == 0.0
            for accumulate in (False, True):
                check_unpack(ext, out, [t.shape for t in tensors], in_dtype, accumulate)
            tensors[0][-1] = float("inf")
            _, flag = check_pack(ext, tensors, out_dtype)
            assert flag.item() == 1.0, f"an inf in a table of {count} tensors was not flagged"
        finally:
            assert ext.set_cuda_inline_tensors(previous) == inline


def test_tensor_lists_accept_lists_and_tuples_and_refuse_other_things(ext):
    """The lists are read from the Python sequence directly (not through pybind's caster): a tuple
    works as a list does, a non-tensor element or a non-sequence is a TypeError that names it."""
    tensors = [torch.randn(5), torch.randn(3)]
    out, expected = torch.zeros(8), torch.zeros(8)
    ext.pack(tuple(tensors), out, SCALE)
    ref.pack(tensors, expected, SCALE)
    same(out, expected)
    outs = (torch.zeros(5), torch.zeros(3))
    ext.unpack_accumulate(out, outs, 2.0, False)
    same(torch.cat(outs), out * 2.0)
    with pytest.raises(TypeError, match=r"pack: tensors\[1\] is a int, not a torch.Tensor"):
        ext.pack([tensors[0], 3], out, 1.0)
    with pytest.raises(TypeError, match=r"unpack_accumulate: outs\[0\] is a NoneType, not a torch.Tensor"):
        ext.unpack_accumulate(out, [None], 1.0, True)
    with pytest.raises(TypeError, match=r"pack_partitions: tensors must be a list or tuple of tensors, got str"):
        ext.pack_partitions("ab", out, 2, 1.0)
    with pytest.raises(TypeError, match=r"pack: tensors must be a list or tuple of tensors, got Tensor"):
        ext.pack(torch.randn(2), out, 1.0)  # a tensor is not a sequence to pybind either


# ------------------------------------------------------------------ the CUDA table cache
def cache_counts(ext):
    stats = ext.cuda_table_cache_stats()
    return stats["hits"], stats["misses"]


def counted(ext, fn):
    """(hits, misses) of the table cache during fn()."""
    hits, misses = cache_counts(ext)
    fn()
    torch.cuda.synchronize()
    after = cache_counts(ext)
    return after[0] - hits, after[1] - misses


@pytest.fixture
def table_cache(ext):
    """The CUDA table cache on (16 tables), restored afterwards."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    assert ext.has_cuda, "extension was built without CUDA kernels"
    previous = ext.set_cuda_table_cache(0)  # empty: no table of an earlier test can hit
    ext.set_cuda_table_cache(16)
    yield ext
    ext.set_cuda_table_cache(previous)


def cache_bucket(ext, count, dtype=torch.bfloat16, seed=7):
    gen = torch.Generator().manual_seed(seed)
    sizes = [SIZES[(5 * i + 1) % len(SIZES)] or 1 for i in range(count)]
    return [randn(n, dtype, gen=gen).cuda() for n in sizes]


def test_cuda_table_cache_hits_on_the_same_tensors_and_is_bit_identical(table_cache):
    """A second call on the same tensors (new values in them, another scale) reuses the table and
    writes what the reference and a run with the cache off write."""
    ext = table_cache
    tensors = cache_bucket(ext, 3 * ext.cuda_inline_tensors)
    total = sum(t.numel() for t in tensors)
    out = torch.full((total + 3,), 7.0, device="cuda")
    assert counted(ext, lambda: ext.pack(tensors, out, SCALE)) == (0, 1)
    for scale in (SCALE, 0.5, 1.0):
        for t in tensors:
            t.mul_(-3)  # new values at the same addresses: a stale copy of the values would show
        out.fill_(7.0)
        flag = torch.empty(())
        assert counted(ext, lambda: flag.copy_(ext.pack(tensors, out, scale))) == (1, 0)
        expected = torch.full_like(out, 7.0)
        expected_flag = ref.pack(tensors, expected, scale)
        same(out, expected)
        assert flag.item() == expected_flag.item()
    previous = ext.set_cuda_table_cache(0)  # off (and emptied)
    try:
        off = torch.full_like(out, 7.0)
        assert counted(ext, lambda: ext.pack(tensors, off, 1.0)) == (0, 0)
    finally:
        ext.set_cuda_table_cache(previous)
    same(out, off)
    # unpack on the same table words with assign, then accumulate, then another scale: all hit after the first
    outs = [torch.zeros(t.shape, device="cuda") for t in tensors]
    for i, (scale, accumulate) in enumerate([(1.0, False), (1.0, True), (0.25, True), (2.0, False)]):
        expected = [o.clone() for o in outs]
        want = (0, 1) if i == 0 else (1, 0)
        assert counted(ext, lambda: ext.unpack_accumulate(out, outs, scale, accumulate)) == want
        ref.unpack_accumulate(out, expected, scale, accumulate)
        for o, e in zip(outs, expected):
            same(o, e)


def test_cuda_table_cache_misses_when_a_tensor_is_replaced(table_cache):
    """One tensor of the list replaced by another of the same size (the old one still alive, so at
    another address): a miss, the new tensor is read (pack) or written (unpack), the old one untouched."""
    ext = table_cache
    tensors = cache_bucket(ext, 2 * ext.cuda_inline_tensors, torch.float32)
    total = sum(t.numel() for t in tensors)
    out = torch.zeros(total, device="cuda")
    ext.pack(tensors, out, 1.0)
    assert counted(ext, lambda: ext.pack(tensors, out, 1.0)) == (1, 0)
    i = len(tensors) - 5
    old = tensors[i]
    replaced = list(tensors)
    replaced[i] = torch.randn(old.numel(), device="cuda") + 100.0
    assert replaced[i].data_ptr() != old.data_ptr()
    assert counted(ext, lambda: ext.pack(replaced, out, 1.0)) == (0, 1)
    same(out, torch.cat(replaced))
    # unpack: a stale table would write into the old tensor
    outs = [torch.zeros(t.shape, device="cuda") for t in tensors]
    ext.unpack_accumulate(out, outs, 1.0, False)
    assert counted(ext, lambda: ext.unpack_accumulate(out, outs, 1.0, False)) == (1, 0)
    old_out, kept = outs[i], outs[i].clone()
    new_outs = list(outs)
    new_outs[i] = torch.full(old_out.shape, -1.0, device="cuda")
    out.add_(1.0)
    assert counted(ext, lambda: ext.unpack_accumulate(out, new_outs, 1.0, False)) == (0, 1)
    same(old_out, kept)
    same(torch.cat(new_outs), out)
    # the original list again: still cached (two different tables)
    assert counted(ext, lambda: ext.unpack_accumulate(out, outs, 1.0, False)) == (1, 0)
    same(torch.cat(outs), out)


def test_cuda_table_cache_is_per_stream(table_cache):
    """The same tensors on another stream: a table of that stream's own (its copy was queued there),
    then hits there; results right on both."""
    ext = table_cache
    tensors = cache_bucket(ext, 2 * ext.cuda_inline_tensors + 1, torch.float16)
    total = sum(t.numel() for t in tensors)
    out = torch.zeros(total, device="cuda")
    expected = torch.zeros(total, device="cuda")
    ref.pack(tensors, expected, SCALE)
    ext.pack(tensors, out, SCALE)
    side = torch.cuda.Stream()
    side_out = torch.zeros(total, device="cuda")
    side.wait_stream(torch.cuda.current_stream())

    def on_side():
        with torch.cuda.stream(side):
            side_out.zero_()
            ext.pack(tensors, side_out, SCALE)

    assert counted(ext, on_side) == (0, 1)
    assert counted(ext, on_side) == (1, 0)
    torch.cuda.current_stream().wait_stream(side)
    same(side_out, expected)
    out.zero_()
    assert counted(ext, lambda: ext.pack(tensors, out, SCALE)) == (1, 0)
    same(out, expected)


@pytest.mark.parametrize("extra", [-1, 0, 1], ids=lambda e: f"inline{e:+d}")
def test_cuda_table_cache_around_the_inline_size(table_cache, extra):
    """Tables that go in the launch's arguments have no copy to cache; larger ones are cached, and
    with set_cuda_inline_tensors(0) the small ones too."""
    ext = table_cache
    count = ext.cuda_inline_tensors + extra
    tensors = cache_bucket(ext, count, seed=200 + count)
    total = sum(t.numel() for t in tensors)
    out = torch.zeros(total, device="cuda")
    expected = torch.zeros(total, device="cuda")
    ref.pack(tensors, expected, SCALE)
    cached = count > ext.cuda_inline_tensors
    assert counted(ext, lambda: ext.pack(tensors, out, SCALE)) == (0, int(cached))
    assert counted(ext, lambda: ext.pack(tensors, out, SCALE)) == (int(cached), 0)
    same(out, expected)
    previous = ext.set_cuda_inline_tensors(0)
    try:
        out.zero_()
        first = counted(ext, lambda: ext.pack(tensors, out, SCALE))
        assert first == ((1, 0) if cached else (0, 1))
        assert counted(ext, lambda: ext.pack(tensors, out, SCALE)) == (1, 0)
        same(out, expected)
    finally:
        ext.set_cuda_inline_tensors(previous)


def test_cuda_table_cache_holds_capacity_tables_and_survives_a_longer_cycle(table_cache):
    """A cycle over more tables than the cache holds still hits on most of them (plain LRU would
    miss on every one); the cache never holds more than its capacity; set_cuda_table_cache checks n."""
    ext = table_cache
    ext.set_cuda_table_cache(0)
    ext.set_cuda_table_cache(4)
    buckets = [cache_bucket(ext, 40, torch.float32, seed=300 + b) for b in range(5)]
    outs = [torch.zeros(sum(t.numel() for t in b), device="cuda") for b in buckets]

    def cycle():
        for b, o in zip(buckets, outs):
            ext.pack(b, o, 1.0)

    counted(ext, cycle)
    hits, misses = counted(ext, lambda: [cycle() for _ in range(10)])
    assert hits + misses == 50 and hits >= 25, (hits, misses)
    stats = ext.cuda_table_cache_stats()
    assert stats["entries"] == 4 and stats["capacity"] == 4
    assert stats["bytes"] == 2 * 8 * sum(4 * 40 + 1 for _ in range(4))
    for b, o in zip(buckets, outs):
        same(o, torch.cat(b))
    with pytest.raises(ValueError, match=r"set_cuda_table_cache\(-1\): expected 0..1024"):
        ext.set_cuda_table_cache(-1)
    assert ext.set_cuda_table_cache(0) == 4
    assert ext.cuda_table_cache_stats()["entries"] == 0


# ------------------------------------------------------------------ pack_partitions
def deepspeed_interleave(tensors, world, dtype=torch.float32):
    """The flat input DeepSpeed's reduce_scatter_coalesced builds (its cat, before the divide),
    with the padding as NaN so that a test sees whether the op leaves it untouched."""
    parts = []
    for r in range(world):
        for t in tensors:
            c = -(-t.numel() // world)
            chunk = t.reshape(-1)[r * c:r * c + c]
            parts += [chunk, torch.full((c - chunk.numel(), ), float("nan"), dtype=t.dtype)]
    return torch.cat(parts) if parts else torch.empty(0, dtype=dtype)


@settings(max_examples=150, deadline=None)
@given(sizes=st.lists(st.sampled_from([0, 1, 2, 3, 5, 7, 8, 31, 32, 33, 1023, 1024, 1025, (1 << 15) + 1]),
                      max_size=12),
       world=st.integers(1, 5), dtype=st.sampled_from(DTYPES), out_dtype=st.sampled_from(DTYPES),
       scale=st.sampled_from([1.0, 0.5, 0.25, 0.3]), seed=st.integers(0, 2**16))
def test_pack_partitions_is_deepspeeds_interleave(ext, sizes, world, dtype, out_dtype, scale, seed):
    """Every chunk lands where reduce_scatter_coalesced puts it, * scale, cast; padding untouched.

    Where scale = 1/world is a power of two this equals DeepSpeed's cat + div_ bit for bit."""
    gen = torch.Generator().manual_seed(seed)
    tensors = [randn(n, dtype, gen=gen) for n in sizes]
    expected = deepspeed_interleave(tensors, world, dtype)
    total = expected.numel()
    pad = torch.isnan(expected)
    for impl in (ext, ref):
        out = torch.full((total + 2, ), float("nan"), dtype=out_dtype)
        flag = impl.pack_partitions(tensors, out, world, scale)
        assert flag.item() == 0.0
        assert torch.isnan(out[total:]).all() and torch.isnan(out[:total][pad]).all()
        if 1 / scale == world and dtype == out_dtype:
            same(out[:total][~pad], expected[~pad].div_(world))  # DeepSpeed's pre-divide
        same(out[:total][~pad], (expected[~pad].float() * scale).to(out_dtype))


def test_pack_partitions_noncontiguous_and_flag(ext):
    base = torch.randn(40, 30)
    tensors = [base.t(), torch.randn(7), base[1:, 3:5]]
    expected = deepspeed_interleave(tensors, 2)
    data = ~torch.isnan(expected)
    for impl in (ext, ref):
        out = torch.zeros(expected.numel())
        assert impl.pack_partitions(tensors, out, 2, 0.5).item() == 0.0
        same(out[data], expected[data] * 0.5)
        kept, tensors[1][6] = tensors[1][6].item(), float("inf")
        assert impl.pack_partitions(tensors, out, 2, 0.5).item() == 1.0
        tensors[1][6] = kept


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_pack_partitions_matches_reference(ext):
    gen = torch.Generator().manual_seed(3)
    tensors = [randn(n, torch.float32, gen=gen) for n in SIZES + [3 * CHUNK + 5]]
    for world in (1, 2, 3, 8):
        total = world * sum(-(-t.numel() // world) for t in tensors)
        out, expected = torch.zeros(total, device="cuda"), torch.zeros(total)
        ext.pack_partitions([t.cuda() for t in tensors], out, world, 1 / world)
        ref.pack_partitions(tensors, expected, world, 1 / world)
        same(out.cpu(), expected)


@pytest.mark.parametrize("impl_name", ["ext", "ref"])
def test_pack_partitions_refusals(ext, impl_name):
    impl = ext if impl_name == "ext" else ref
    with pytest.raises(ValueError, match=r"pack_partitions: out .* has 8 elements but world \* sum\(ceil\(numel / "
                                         r"world\)\) = 10 are needed"):
        impl.pack_partitions([torch.randn(5), torch.randn(4)], torch.empty(8), 2, 1.0)
    with pytest.raises(ValueError, match=r"world must be >= 1"):
        impl.pack_partitions([torch.randn(5)], torch.empty(8), 0, 1.0)
    with pytest.raises(ValueError, match=r"tensors\[1\].*int64"):
        impl.pack_partitions([torch.randn(2), torch.ones(2, dtype=torch.int64)], torch.empty(8), 2, 1.0)


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.sampled_from([0, 1, 15, 16, 17, 31, 33, 32767, 32768, 32769, 65553]), min_size=1, max_size=5),
       dtype=st.sampled_from([torch.bfloat16, torch.float16]),
       bad=st.sampled_from([None, float("inf"), float("-inf"), float("nan"), "payload"]),
       data=st.data())
def test_pack_at_scale_one_copies_16_bit_values_bit_for_bit(ext, sizes, dtype, bad, data):
    """The copy fast path (same 16-bit dtype, scale 1): the bits copy_ would write, NaN payloads
    included, the flag from the exponent bits, across the AVX2 lane and thread-chunk edges."""
    gen = torch.Generator().manual_seed(sum(sizes))
    tensors = [randn(n, dtype, gen=gen) for n in sizes]
    filled = [t for t in tensors if t.numel()]
    if bad is not None and filled:
        target = data.draw(st.sampled_from(filled))
        index = data.draw(st.integers(0, target.numel() - 1))
        if bad == "payload":  # a NaN that is not the canonical one: the cast path would rewrite it
            target.view(torch.int16)[index] = 0x7f81 if dtype == torch.bfloat16 else 0x7c01
        else:
            target[index] = bad
    total = sum(sizes)
    out = torch.full((total + 3, ), 7.0, dtype=dtype)
    flag = ext.pack(tensors, out, 1.0)
    want = torch.cat([t.reshape(-1) for t in tensors]) if total else torch.zeros(0, dtype=dtype)
    assert torch.equal(out[:total].view(torch.int16), want.view(torch.int16))
    assert (out[total:] == 7.0).all()
    assert flag.item() == float(bool(filled) and not torch.isfinite(want).all().item())
