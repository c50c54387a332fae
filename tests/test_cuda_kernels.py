"""Our CUDA kernels against the plain-torch reference, the float64 oracle and the Triton kernel.

All but the first two tests need a GPU (``cuda`` marker). Cache writes and copies must match the
reference bit for bit; attention must match the float64 oracle within the dtype's tolerance.
"""
import pytest
import torch

from paged_attention import runtime
from paged_attention.kernels import KernelUnavailable
from paged_attention.kernels import cuda as ck
from paged_attention.kernels import reference as ref
from paged_attention.kernels.reference import PARTITION_SIZE, flash_to_v0, ref_decode_attention, v0_x
from paged_attention.kernels.workloads import assert_close_to_oracle, make_decode_problem
from paged_attention.utils import cdiv

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _one(device="cuda"):
    return torch.ones(1, dtype=torch.float32, device=device)


# --------------------------------------------------------------------------------------------
# Without a GPU
# --------------------------------------------------------------------------------------------

@pytest.mark.skipif(runtime.HAS_CUDA, reason="checks the behaviour on a machine without CUDA")
def test_without_cuda_every_kernel_says_why():
    ok, why = ck.available()
    assert not ok and "triton" in why and "reference" in why
    t = torch.zeros(1)
    calls = {
        "reshape_and_cache": (t,) * 5 + ("auto", t, t),
        "reshape_and_cache_flash": (t,) * 5 + ("auto", t, t),
        "copy_blocks": ([t], [t], t),
        "swap_blocks": (t, t, t),
        "paged_attention_v1": (t, t, t, t, 1, 1.0, t, t, 16, 1, None, "auto", t, t),
        "paged_attention_v2": (t, t, t, t, t, t, t, 1, 1.0, t, t, 16, 1, None, "auto", t, t),
    }
    for name, call_args in calls.items():
        with pytest.raises(ck.CudaUnavailableError, match="paged_attention.kernels.triton"):
            getattr(ck, name)(*call_args)


def test_sources_cover_what_the_module_dispatches():
    # The build list and the files agree, and every compiled head size is dispatched in C++.
    names = {p.name for p in ck.CSRC.iterdir() if p.suffix in (".cu", ".cpp")}
    assert names == set(ck.SOURCES)
    dispatch = (ck.CSRC / "attention.cuh").read_text()
    for h in ck.HEAD_SIZES:
        assert f"case {h}: return dispatch_block_size<scalar_t, GROUP, {h}>(a);" in dispatch
    for b in ck.BLOCK_SIZES:
        assert f"case {b}: return launch_paged_attention<scalar_t, HEAD_SIZE, {b}, GROUP>(a);" in dispatch


# --------------------------------------------------------------------------------------------
# Cache writes
# --------------------------------------------------------------------------------------------

def _tokens(num_tokens, num_heads, head_size, num_slots, dtype, seed=0, padded=True):
    """Keys and values as slices of one qkv tensor (non-unit token stride), and distinct slots."""
    gen = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(num_tokens, 3, num_heads, head_size, generator=gen) * 3).to("cuda", dtype)
    slots = torch.randperm(num_slots, generator=gen)[:num_tokens]
    if padded:
        slots[::5] = -1
    return qkv[:, 1], qkv[:, 2], slots.cuda()


FP8_CASES = [("auto", None), ("fp8", 0.05), ("fp8_e5m2", 0.5)]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_dtype,scale", FP8_CASES)
@pytest.mark.parametrize("num_heads,head_size", [(4, 64), (2, 80), (32, 256)])   # 32 x 256: > 512 threads' worth
def test_reshape_and_cache_matches_reference(dtype, kv_dtype, scale, num_heads, head_size):
    block_size, num_blocks = 16, 9
    key, value, slots = _tokens(40, num_heads, head_size, num_blocks * block_size, dtype)
    cache_dtype = dtype if kv_dtype == "auto" else torch.uint8
    x = v0_x(cache_dtype)
    k_scale = torch.tensor([scale or 1.0], device="cuda")
    v_scale = torch.tensor([(scale or 1.0) * 2], device="cuda")
    results = []
    for impl in (ref, ck):
        key_cache = torch.zeros(num_blocks, num_heads, head_size // x, block_size, x, dtype=cache_dtype, device="cuda")
        value_cache = torch.zeros(num_blocks, num_heads, head_size, block_size, dtype=cache_dtype, device="cuda")
        impl.reshape_and_cache(key, value, key_cache, value_cache, slots, kv_dtype, k_scale, v_scale)
        results.append((key_cache, value_cache))
    assert torch.equal(results[0][0], results[1][0]), "key cache"
    assert torch.equal(results[0][1], results[1][1]), "value cache"
    assert results[1][0].count_nonzero() > 0


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("kv_dtype,per_head", [("auto", False), ("fp8_e4m3", False), ("fp8_e4m3", True), ("fp8_e5m2", True)])
def test_reshape_and_cache_flash_matches_reference(dtype, layout, kv_dtype, per_head):
    block_size, num_blocks, num_heads, head_size = 16, 7, 4, 128
    key, value, slots = _tokens(30, num_heads, head_size, num_blocks * block_size, dtype, seed=1)
    slots = slots[:22]                       # fewer slots than key rows: the rest is padding
    cache_dtype = dtype if kv_dtype == "auto" else torch.uint8
    n = num_heads if per_head else 1
    k_scale = torch.linspace(0.02, 0.2, n, device="cuda")
    v_scale = torch.linspace(0.2, 0.02, n, device="cuda")
    results = []
    for impl in (ref, ck):
        shape = (num_blocks, block_size, num_heads, head_size) if layout == "NHD" else (num_blocks, num_heads, block_size, head_size)
        caches = [torch.zeros(shape, dtype=cache_dtype, device="cuda") for _ in range(2)]
        if layout == "HND":
            caches = [c.permute(0, 2, 1, 3) for c in caches]
        impl.reshape_and_cache_flash(key, value, caches[0], caches[1], slots, kv_dtype, k_scale, v_scale)
        results.append(caches)
    for which in (0, 1):
        assert torch.equal(results[0][which], results[1][which]), ("key", "value")[which]


@pytest.mark.cuda
def test_cache_write_skips_padding_and_touches_nothing_else():
    key, value, slots = _tokens(10, 2, 64, 64, torch.float16, seed=2)
    key_cache = torch.full((4, 2, 8, 16, 8), 7.0, dtype=torch.float16, device="cuda")
    value_cache = torch.full((4, 2, 64, 16), 7.0, dtype=torch.float16, device="cuda")
    ck.reshape_and_cache(key, value, key_cache, value_cache, slots, "auto", _one(), _one())
    written = int((slots >= 0).sum()) * 2 * 64
    assert int((key_cache != 7).sum()) <= written and int((value_cache != 7).sum()) <= written
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(value_cache[s // 16, :, :, s % 16], value[t])


# --------------------------------------------------------------------------------------------
# Block copies
# --------------------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("dtype,shape", [(torch.bfloat16, (10, 16, 4, 64)), (torch.float32, (10, 3, 5)), (torch.uint8, (10, 7))])
def test_copy_blocks_matches_reference(dtype, shape):
    gen = torch.Generator(device="cuda").manual_seed(0)
    layers = [torch.randint(0, 100, shape, generator=gen, device="cuda").to(dtype) for _ in range(6)]
    mapping = torch.tensor([[0, 4], [0, 5], [3, 9], [2, 1]], device="cuda")
    expected = [t.clone() for t in layers]
    ref.copy_blocks(expected[:3], expected[3:], mapping)
    ck.copy_blocks(layers[:3], layers[3:], mapping)
    for got, want in zip(layers, expected):
        assert torch.equal(got, want)


@pytest.mark.cuda
def test_copy_blocks_refuses_chains_and_leaves_caches_alone():
    layers = [torch.randn(6, 16, device="cuda") for _ in range(2)]
    before = [t.clone() for t in layers]
    for pairs in ([[0, 1], [1, 2]], [[0, 3], [1, 3]]):
        with pytest.raises(ValueError, match="destination"):
            ck.copy_blocks(layers[:1], layers[1:], torch.tensor(pairs, device="cuda"))
    with pytest.raises(ValueError, match="block id"):
        ck.copy_blocks(layers[:1], layers[1:], torch.tensor([[0, 6]], device="cuda"))
    assert all(torch.equal(a, b) for a, b in zip(layers, before))


@pytest.mark.cuda
@pytest.mark.parametrize("new_signature", [False, True])
def test_swap_blocks_out_and_back_in(new_signature):
    gpu = torch.randn(8, 16, 2, 32, device="cuda", dtype=torch.bfloat16)
    host = torch.zeros(5, 16, 2, 32, dtype=torch.bfloat16, pin_memory=True)
    nbytes = gpu[0].numel() * gpu.element_size()

    def swap(src, dst, pairs):
        mapping = torch.tensor(pairs)
        ck.swap_blocks(src, dst, nbytes, mapping) if new_signature else ck.swap_blocks(src, dst, mapping)

    swap(gpu, host, [[7, 0], [2, 4]])
    torch.cuda.synchronize()
    assert torch.equal(host[0], gpu[7].cpu()) and torch.equal(host[4], gpu[2].cpu())
    assert host[1:4].count_nonzero() == 0
    back = torch.zeros_like(gpu)
    swap(host, back, [[4, 1]])
    swap(gpu, back, [[3, 6]])                # GPU to GPU as well
    torch.cuda.synchronize()
    assert torch.equal(back[1], gpu[2]) and torch.equal(back[6], gpu[3])
    assert back[[0, 2, 3, 4, 5, 7]].count_nonzero() == 0


@pytest.mark.cuda
def test_swap_blocks_refusals():
    gpu = torch.zeros(4, 8, device="cuda")
    with pytest.raises(KernelUnavailable, match="Invalid device combination"):
        ck.swap_blocks(torch.zeros(4, 8), torch.zeros(4, 8), torch.tensor([[0, 1]]))
    with pytest.raises(ValueError, match="cpu"):
        ck.swap_blocks(gpu, torch.zeros(4, 8), torch.tensor([[0, 1]], device="cuda"))


# --------------------------------------------------------------------------------------------
# Paged attention v1 / v2
# --------------------------------------------------------------------------------------------

def _v0_problem(lens, *, num_heads, num_kv_heads, head_size, block_size, dtype, alibi=False, seed=0, poison=True):
    """A decode batch in the v0 layout, with the unused tail slots of each last block set to NaN."""
    p = make_decode_problem(lens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
                            block_size=block_size, dtype=dtype, device="cuda", alibi=alibi, seed=seed)
    if poison and dtype != torch.uint8:
        for s, n in enumerate(lens):
            if n % block_size:
                last = int(p.block_tables[s, cdiv(n, block_size) - 1])
                p.key_cache[last, n % block_size:] = float("nan")
                p.value_cache[last, n % block_size:] = float("nan")
    expected = ref_decode_attention(*p.decode_args())
    key_v0, value_v0 = flash_to_v0(p.key_cache, p.value_cache)
    return p, expected, key_v0, value_v0


def _v1(p, key_v0, value_v0, max_seq_len, impl=ck):
    out = torch.full_like(p.query, float("nan"))
    impl.paged_attention_v1(out, p.query, key_v0, value_v0, p.key_cache.size(2), p.scale, p.block_tables,
                            p.seq_lens, p.key_cache.size(1), max_seq_len, p.alibi_slopes, "auto", _one(), _one())
    return out


def _v2(p, key_v0, value_v0, max_seq_len, impl=ck):
    out = torch.full_like(p.query, float("nan"))
    exp_sums, max_logits, tmp_out = ref.v2_scratch(p.query, max_seq_len)
    impl.paged_attention_v2(out, exp_sums, max_logits, tmp_out, p.query, key_v0, value_v0, p.key_cache.size(2),
                            p.scale, p.block_tables, p.seq_lens, p.key_cache.size(1), max_seq_len, p.alibi_slopes,
                            "auto", _one(), _one())
    return out, exp_sums, max_logits, tmp_out


LENS = [1, 16, 17, 512, 513, 1000, 1536, 5]      # 1, multiples of 16 and of 512, one past each


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 8), (8, 2), (16, 2)])   # GQA 1, 4, 8
@pytest.mark.parametrize("alibi", [False, True])
def test_v1_and_v2_match_oracle(dtype, num_heads, num_kv_heads, alibi):
    p, expected, k, v = _v0_problem(LENS, num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=128,
                                    block_size=16, dtype=dtype, alibi=alibi)
    assert_close_to_oracle(_v1(p, k, v, max(LENS)), expected, "paged_attention_v1")
    assert_close_to_oracle(_v2(p, k, v, max(LENS) + 100)[0], expected, "paged_attention_v2")


@pytest.mark.cuda
@pytest.mark.parametrize("head_size", ck.HEAD_SIZES)
@pytest.mark.parametrize("block_size", ck.BLOCK_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads", [4, 8])     # 2 or 4 query heads per KV head: 1 or 4 per thread block
def test_every_compiled_size(head_size, block_size, dtype, num_heads):
    lens = [1, block_size, 3 * block_size + 1, 700]
    p, expected, k, v = _v0_problem(lens, num_heads=num_heads, num_kv_heads=2, head_size=head_size,
                                    block_size=block_size, dtype=dtype, seed=head_size + block_size)
    assert_close_to_oracle(_v1(p, k, v, 700), expected, "paged_attention_v1")
    assert_close_to_oracle(_v2(p, k, v, 700)[0], expected, "paged_attention_v2")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_v2_partials_match_reference(dtype):
    # exp_sums, max_logits and tmp_out hold what the reference says, for every live partition.
    lens = [1, 600, 1537]
    p, _, k, v = _v0_problem(lens, num_heads=4, num_kv_heads=1, head_size=64, block_size=16, dtype=dtype)
    got = _v2(p, k, v, 1600)
    want = _v2(p, k, v, 1600, impl=ref)
    torch.testing.assert_close(got[0], want[0], atol=2e-2 if dtype != torch.float32 else 1e-5, rtol=1e-2)
    for s, n in enumerate(lens):
        live = cdiv(n, PARTITION_SIZE)
        torch.testing.assert_close(got[1][s, :, :live], want[1][s, :, :live], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got[2][s, :, :live], want[2][s, :, :live], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[3][s, :, :live].float(), want[3][s, :, :live].float(),
                                   atol=2e-2 if dtype != torch.float32 else 1e-5, rtol=1e-2)


@pytest.mark.cuda
def test_cuda_triton_and_reference_agree():
    from paged_attention.kernels.triton import paged_attention_decode
    p, expected, k, v = _v0_problem([3, 250, 1100], num_heads=32, num_kv_heads=8, head_size=128, block_size=16,
                                    dtype=torch.bfloat16, poison=False)
    triton_out = torch.empty_like(p.query)
    paged_attention_decode(triton_out, *p.decode_args())
    for out in (_v1(p, k, v, 1100), _v2(p, k, v, 1100)[0], _v1(p, k, v, 1100, impl=ref)):
        torch.testing.assert_close(out.float(), triton_out.float(), atol=2e-2, rtol=5e-2)


@pytest.mark.cuda
def test_query_may_be_a_strided_slice():
    p, expected, k, v = _v0_problem([40, 9], num_heads=4, num_kv_heads=2, head_size=64, block_size=16,
                                    dtype=torch.float16)
    qkv = torch.zeros(2, 3, 4, 64, dtype=torch.float16, device="cuda")
    qkv[:, 0] = p.query
    p.query = qkv[:, 0]
    assert not p.query.is_contiguous()
    assert_close_to_oracle(_v1(p, k, v, 40), expected)


@pytest.mark.cuda
def test_attention_bad_input_is_refused_before_launch():
    p, _, k, v = _v0_problem([40, 9], num_heads=4, num_kv_heads=2, head_size=64, block_size=16,
                             dtype=torch.float16)
    out = torch.full_like(p.query, 3.0)
    cases = [
        (dict(max_seq_len=20), ValueError, "max_seq_len"),                        # shorter than a length
        (dict(max_seq_len=10 ** 6), KernelUnavailable, "shared memory"),          # v1's limit
        (dict(num_kv_heads=3), ValueError, "num_kv_heads|shape"),
        (dict(kv_cache_dtype="fp8"), TypeError, "dtype"),
        (dict(kv_cache_dtype="int4"), ValueError, "Unsupported"),
    ]
    base = dict(num_kv_heads=2, max_seq_len=40, kv_cache_dtype="auto")
    for change, error, message in cases:
        kw = {**base, **change}
        with pytest.raises(error, match=message):
            ck.paged_attention_v1(out, p.query, k, v, kw["num_kv_heads"], p.scale, p.block_tables, p.seq_lens, 16,
                                  kw["max_seq_len"], None, kw["kv_cache_dtype"], _one(), _one())
    bad_table = p.block_tables.clone()
    bad_table[0, 0] = 10 ** 6
    with pytest.raises(ValueError, match="block id"):
        ck.paged_attention_v1(out, p.query, k, v, 2, p.scale, bad_table, p.seq_lens, 16, 40, None, "auto", _one(), _one())
    odd = make_decode_problem([5], num_heads=2, num_kv_heads=2, head_size=48, block_size=16, device="cuda")
    ko, vo = flash_to_v0(odd.key_cache, odd.value_cache)
    with pytest.raises(KernelUnavailable, match="Unsupported head size"):
        ck.paged_attention_v1(torch.empty_like(odd.query), odd.query, ko, vo, 2, 1.0, odd.block_tables, odd.seq_lens,
                              16, 5, None, "auto", _one(), _one())
    assert torch.all(out == 3.0), "a refused call wrote to out"


@pytest.mark.cuda
def test_v1_handles_long_contexts_up_to_its_limit():
    limit = ck.v1_max_seq_len(128)
    assert limit > 32768                      # Hopper: 227 KB of shared memory per block
    # GQA 4: four heads' scores per thread block would not fit; v1 falls back to one head each.
    p, expected, k, v = _v0_problem([32768, 3], num_heads=8, num_kv_heads=2, head_size=128, block_size=16,
                                    dtype=torch.bfloat16, poison=False)
    assert_close_to_oracle(_v1(p, k, v, 32768), expected)
