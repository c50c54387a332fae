"""The Triton reshape_and_cache_flash against the reference: bit-exact (it only moves data)."""
import pytest
import torch

from paged_attention import check
from paged_attention.kernels import KernelUnavailable
from paged_attention.kernels import reference as ref
from paged_attention.kernels import triton as tk

from conftest import dtype_params


def test_triton_passes_its_checks():
    check.CHECKS["reshape_and_cache_flash"](tk)
    check.CHECKS["paged_attention_decode"](tk)


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("num_heads,head_size,block_size", [(1, 32, 8), (3, 80, 16), (8, 128, 32)])
def test_matches_reference(device, dtype, layout, num_heads, head_size, block_size):
    gen = torch.Generator().manual_seed(num_heads)
    num_blocks, num_tokens = 5, 37
    key = torch.randn(num_tokens + 3, num_heads, head_size, generator=gen).to(device, dtype)
    value = torch.randn(num_tokens + 3, num_heads, head_size, generator=gen).to(device, dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::5] = -1                                                    # padding tokens
    slots = slots.to(device)
    memory = (num_blocks, block_size, num_heads, head_size) if layout == "NHD" else (num_blocks, num_heads, block_size, head_size)
    caches = [torch.randn(memory, generator=gen).to(device, dtype) for _ in range(2)]
    if layout == "HND":
        caches = [c.permute(0, 2, 1, 3) for c in caches]
    expected = [c.clone() for c in caches]
    one = torch.ones(1, device=device)
    ref.reshape_and_cache_flash(key, value, *expected, slots, "auto", one, one)
    tk.reshape_and_cache_flash(key, value, *caches, slots, "auto", one, one)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])


def test_strided_key_from_a_qkv_tensor(device):
    # key and value are often slices of one fused qkv tensor: a token stride larger than H * D.
    qkv = torch.randn(6, 3, 2, 16, device=device)
    key, value = qkv[:, 1], qkv[:, 2]
    caches = [torch.zeros(2, 8, 2, 16, device=device) for _ in range(2)]
    slots = torch.tensor([0, 9, 3, -1, 15, 8], device=device)
    one = torch.ones(1, device=device)
    tk.reshape_and_cache_flash(key, value, *caches, slots, "auto", one, one)
    assert torch.equal(caches[0][1, 1], key[1]) and torch.equal(caches[1][1, 7], value[4])


def test_fp8_is_refused_with_a_pointer(device):
    key = torch.randn(2, 1, 16, device=device)
    caches = [torch.zeros(1, 8, 1, 16, dtype=torch.uint8, device=device) for _ in range(2)]
    one = torch.ones(1, device=device)
    with pytest.raises(KernelUnavailable, match="reference"):
        tk.reshape_and_cache_flash(key, key, *caches, torch.tensor([0, 1], device=device), "fp8", one, one)


def test_check_slots_false_skips_only_the_read_back(device):
    key = torch.randn(3, 2, 16, device=device)
    caches = [torch.zeros(2, 8, 2, 16, device=device) for _ in range(2)]
    expected = [c.clone() for c in caches]
    slots, one = torch.tensor([0, 9, -1], device=device), torch.ones(1, device=device)
    ref.reshape_and_cache_flash(key, key, *expected, slots, "auto", one, one)
    tk.reshape_and_cache_flash(key, key, *caches, slots, "auto", one, one, check_slots=False)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])
    with pytest.raises(ValueError, match="slot 16"):        # checked by default
        tk.reshape_and_cache_flash(key, key, *caches, torch.tensor([0, 16, 1], device=device), "auto", one, one)
    with pytest.raises(TypeError, match="int64"):           # the other checks stay
        tk.reshape_and_cache_flash(key, key, *caches, slots.int(), "auto", one, one, check_slots=False)
    with pytest.raises(TypeError, match="check_slots"):
        tk.reshape_and_cache_flash(key, key, *caches, slots, "auto", one, one, check_slots=1)
