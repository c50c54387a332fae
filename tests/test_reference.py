"""The plain-torch reference kernels: each against an independent computation."""

import pytest
import torch

from paged_attention import check
from paged_attention.kernels import reference as ref
from paged_attention.kernels.workloads import assert_close_to_oracle, make_decode_problem

from conftest import dtype_params


def test_v0_x_is_16_bytes():
    assert (ref.v0_x(torch.float16), ref.v0_x(torch.bfloat16), ref.v0_x(torch.float32), ref.v0_x(torch.uint8)) == (8, 8, 4, 16)


def test_layout_round_trip_and_positions():
    p = make_decode_problem([40], num_heads=4, num_kv_heads=2, head_size=16, block_size=8, dtype=torch.float16)
    k0, v0 = ref.flash_to_v0(p.key_cache, p.value_cache)
    assert k0.shape == (5, 2, 2, 8, 8) and v0.shape == (5, 2, 16, 8)
    # Element d of head h at token row t of block b sits at [b, h, d // x, t, d % x] and [b, h, d, t].
    assert k0[3, 1, 1, 5, 2] == p.key_cache[3, 5, 1, 8 + 2]
    assert v0[2, 0, 11, 7] == p.value_cache[2, 7, 0, 11]
    k, v = ref.v0_to_flash(k0, v0)
    assert torch.equal(k, p.key_cache) and torch.equal(v, p.value_cache)


def test_oracle_against_a_hand_computed_case():
    # One sequence of 10 tokens, one head, blocks of 8 scattered as [2, 0]: token 0 is block 2
    # row 0, token 9 is block 0 row 1; every other token has zero key and value.
    key_cache = torch.zeros(3, 8, 1, 2)
    value_cache = torch.zeros(3, 8, 1, 2)
    key_cache[2, 0, 0] = torch.tensor([1.0, 0.0])
    value_cache[2, 0, 0] = torch.tensor([1.0, 2.0])
    key_cache[0, 1, 0] = torch.tensor([0.0, 1.0])
    value_cache[0, 1, 0] = torch.tensor([3.0, -1.0])
    value_cache[0, 2:] = 50.0                        # rows past token 9 in block 0: never read
    q = torch.tensor([[[2.0, 0.0]]])
    table = torch.tensor([[2, 0]], dtype=torch.int32)
    out = ref.ref_decode_attention(q, key_cache, value_cache, table, torch.tensor([10], dtype=torch.int32), 0.5)
    logits = torch.tensor([1.0] + [0.0] * 9)          # 0.5 * q.k: token 0 scores 1, the rest 0
    p = torch.softmax(logits.double(), 0)
    expected = p[0] * torch.tensor([1.0, 2.0]).double() + p[9] * torch.tensor([3.0, -1.0]).double()
    torch.testing.assert_close(out[0, 0], expected)


def test_oracle_alibi_bias_is_zero_at_the_newest_token():
    p = make_decode_problem([1], num_heads=2, num_kv_heads=1, head_size=8, block_size=8, alibi=True)
    with_alibi = ref.ref_decode_attention(*p.decode_args())
    p.alibi_slopes = None
    torch.testing.assert_close(with_alibi, ref.ref_decode_attention(*p.decode_args()))


@pytest.mark.parametrize("name", ["reshape_and_cache", "reshape_and_cache_flash", "copy_blocks", "swap_blocks",
                                  "paged_attention_v1", "paged_attention_v2"])
def test_reference_passes_its_check(name):
    check.CHECKS[name](ref)


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("alibi", [False, True])
def test_v1_v2_long_sequences(device, dtype, alibi):
    lens = [1, 512, 513, 1500]
    p = make_decode_problem(lens, num_heads=4, num_kv_heads=2, head_size=32, block_size=16, dtype=dtype,
                            device=device, alibi=alibi)
    expected = ref.ref_decode_attention(*p.decode_args())
    k0, v0 = ref.flash_to_v0(p.key_cache, p.value_cache)
    one = torch.ones(1, device=device)
    out1 = torch.empty_like(p.query)
    ref.paged_attention_v1(out1, p.query, k0, v0, 2, p.scale, p.block_tables, p.seq_lens, 16, 1500,
                           p.alibi_slopes, "auto", one, one)
    assert_close_to_oracle(out1, expected)
    P = 3
    out2 = torch.empty_like(p.query)
    exp_sums = torch.full((4, 4, P), -7.0, device=device)
    max_logits = torch.full((4, 4, P), -7.0, device=device)
    tmp = torch.zeros(4, 4, P, 32, dtype=dtype, device=device)
    ref.paged_attention_v2(out2, exp_sums, max_logits, tmp, p.query, k0, v0, 2, p.scale, p.block_tables,
                           p.seq_lens, 16, 1500, p.alibi_slopes, "auto", one, one)
    assert_close_to_oracle(out2, expected)
    # Partitions past a sequence's end are untouched; the ones inside are filled.
    assert (exp_sums[0, :, 1:] == -7).all() and (exp_sums[2, :, 2] == -7).all()
    assert (exp_sums[3] > 0).all() and (max_logits[3] != -7).all()
    # Each partition's exp-sum is at least 1 (its maximum contributes exp(0)).
    assert (exp_sums[3] >= 1).all()


def test_fp8_cache_round_trip_and_saturation():
    key = torch.tensor([[[0.5, -1.25, 1000.0, -1e6]]])
    value = key.clone()
    slots = torch.tensor([3])
    scale = torch.tensor([2.0])
    kc = torch.zeros(1, 4, 1, 4, dtype=torch.uint8)
    vc = torch.zeros_like(kc)
    ref.reshape_and_cache_flash(key, value, kc, vc, slots, "fp8", scale, scale)
    back = kc[0, 3, 0].view(torch.float8_e4m3fn).float() * 2.0
    # Exact where representable; beyond the format's range, clamped to 448 * scale.
    assert back.tolist() == [0.5, -1.25, 896.0, -896.0]
    kc5 = torch.zeros_like(kc)
    ref.reshape_and_cache_flash(key, value, kc5, vc, slots, "fp8_e5m2", scale, scale)
    assert kc5[0, 3, 0].view(torch.float8_e5m2).float()[3] * 2 == -2 * torch.finfo(torch.float8_e5m2).max


def test_fp8_attention_reads_scaled_values():
    p = make_decode_problem([20], num_heads=2, num_kv_heads=1, head_size=16, block_size=8)
    scale = torch.tensor([0.5])
    kf, vf = p.key_cache, p.value_cache
    # Quantise to fp8 in the flash layout, then lay the bytes out as v0 caches (x = 16 for fp8).
    k8, v8 = ref.flash_to_v0(*[(c / 0.5).to(torch.float8_e4m3fn).view(torch.uint8) for c in (kf, vf)])
    assert k8.shape[-1] == 16
    out = torch.empty_like(p.query)
    ref.paged_attention_v1(out, p.query, k8, v8, 1, p.scale, p.block_tables, p.seq_lens, 8, 20, None,
                           "fp8", scale, scale)
    # Expected: attention over the fp8-rounded values.
    kr = (kf / 0.5).to(torch.float8_e4m3fn).float() * 0.5
    vr = (vf / 0.5).to(torch.float8_e4m3fn).float() * 0.5
    expected = ref.ref_decode_attention(p.query, kr, vr, p.block_tables, p.seq_lens, p.scale)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-4)


def test_swap_blocks_partial_bytes():
    src = torch.arange(4 * 8, dtype=torch.float32).reshape(4, 8)
    dst = torch.zeros(2, 8)
    ref.swap_blocks(src, dst, 8, torch.tensor([[3, 1]]))      # 8 bytes = the first two floats
    assert dst[1].tolist() == [24.0, 25.0] + [0.0] * 6 and (dst[0] == 0).all()


def test_copy_blocks_reads_all_sources_before_writing():
    # A chain 0 -> 1, 1 -> 2: each destination gets the source's *old* contents.
    cache = torch.arange(3.0).reshape(3, 1).repeat(1, 4)
    ref.copy_blocks([cache], [cache.clone()], torch.tensor([[0, 1], [1, 2]]))
    assert cache[:, 0].tolist() == [0.0, 0.0, 1.0]
