"""Backend KV-cache shapes and stride orders, as vLLM's attention backends give them."""
import pytest

from paged_attention.kv_cache.backends import (
    FlashAttentionBackend, FlashInferBackend, TritonAttentionBackend, get_kv_cache_layout)

ALL = [FlashAttentionBackend, FlashInferBackend, TritonAttentionBackend]


def test_shapes():
    assert FlashAttentionBackend.get_kv_cache_shape(10, 16, 8, 128) == (2, 10, 16, 8, 128)
    assert FlashInferBackend.get_kv_cache_shape(10, 16, 8, 128) == (10, 2, 16, 8, 128)
    assert TritonAttentionBackend.get_kv_cache_shape(10, 32, 4, 64, "auto") == (10, 2, 32, 4, 64)
    assert FlashInferBackend.get_kv_cache_shape(3, 16, 2, 64, cache_dtype_str="nvfp4") \
        == (3, 2, 16, 2, 64 // 2 + 64 // 16)


@pytest.mark.parametrize("backend", [FlashAttentionBackend, TritonAttentionBackend])
def test_block_size_multiple_of_16(backend):
    with pytest.raises(ValueError, match="Block size must be a multiple of 16."):
        backend.get_kv_cache_shape(10, 8, 8, 128)
    # FlashInfer has no such check
    assert FlashInferBackend.get_kv_cache_shape(10, 8, 8, 128) == (10, 2, 8, 8, 128)


@pytest.mark.parametrize("backend", ALL)
def test_stride_orders(backend):
    assert backend.get_kv_cache_stride_order() == (0, 1, 2, 3, 4)
    assert backend.get_kv_cache_stride_order("NHD") == (0, 1, 2, 3, 4)
    assert backend.get_kv_cache_stride_order(layout="HND") == (0, 1, 3, 2, 4)
    with pytest.raises(ValueError):
        backend.get_kv_cache_stride_order("NDH")


def test_stride_orders_with_layers_dimension():
    fa = FlashAttentionBackend.get_kv_cache_stride_order
    assert fa("NHD", include_num_layers_dimension=True) == (2, 0, 1, 3, 4, 5)
    assert fa("HND", include_num_layers_dimension=True) == (2, 4, 0, 1, 3, 5)
    for backend in (FlashInferBackend, TritonAttentionBackend):
        so = backend.get_kv_cache_stride_order
        assert so("NHD", include_num_layers_dimension=True) == (1, 0, 2, 3, 4, 5)
        assert so("HND", include_num_layers_dimension=True) == (1, 2, 4, 0, 3, 5)
    # logical (L, 2, N, B, H, D) permuted by the FA HND order gives physical (N, H, L, 2, B, D)
    logical = ("L", "2", "N", "B", "H", "D")
    assert tuple(logical[i] for i in fa("HND", True)) == ("N", "H", "L", "2", "B", "D")


def test_names_and_bad_arguments():
    assert {b.get_name() for b in ALL} == {"FLASH_ATTN", "FLASHINFER", "TRITON_ATTN"}
    with pytest.raises(TypeError):
        FlashInferBackend.get_kv_cache_shape(10.0, 16, 8, 128)
    with pytest.raises(ValueError):
        FlashInferBackend.get_kv_cache_shape(10, 16, 0, 128)


def test_layout_from_env(monkeypatch):
    monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)
    assert get_kv_cache_layout() == "NHD"
    monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", "HND")
    assert get_kv_cache_layout() == "HND"
    assert FlashAttentionBackend.get_kv_cache_stride_order(None) == (0, 1, 3, 2, 4)
    monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", "XYZ")
    with pytest.raises(ValueError):
        get_kv_cache_layout()
