"""KV-cache specs, and the page size of a worked example."""
import dataclasses

import pytest
import torch

from paged_attention.kv_cache.interface import (
    AttentionSpec, FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheSpec,
    KVCacheTensor, SlidingWindowSpec)


def full(**kw):
    args = dict(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    args.update(kw)
    return FullAttentionSpec(**args)


def test_worked_example_page_size():
    spec = full()
    assert spec.page_size_bytes == 16 * 8 * (128 + 128) * 2 == 65536
    base = AttentionSpec(16, 8, 128, torch.bfloat16)
    assert base.page_size_bytes == 2 * 16 * 8 * 128 * 2 == 65536


def test_page_size_uses_dtype_and_head_size_v():
    assert full(dtype=torch.float32).page_size_bytes == 131072
    assert full(head_size_v=64).page_size_bytes == 16 * 8 * (128 + 64) * 2
    assert full().head_size_v == 128
    sw = SlidingWindowSpec(16, 8, 128, torch.float16, 256)
    assert sw.page_size_bytes == 65536 and sw.sliding_window == 256
    assert SlidingWindowSpec(16, 8, 128, torch.float16, 256, head_size_v=32).page_size_bytes \
        == 16 * 8 * 160 * 2


def test_page_size_padded():
    assert full(page_size_padded=70000).page_size_bytes == 70000
    with pytest.raises(ValueError):
        full(page_size_padded=100).page_size_bytes


def test_base_spec_raises_not_implemented_and_is_frozen():
    spec = KVCacheSpec(16)
    with pytest.raises(NotImplementedError):
        spec.page_size_bytes
    with pytest.raises(dataclasses.FrozenInstanceError):
        full().block_size = 32
    assert full().copy_with_new_block_size(32).page_size_bytes == 131072
    assert full().storage_block_size == 16


def test_field_names_and_order():
    assert [f.name for f in dataclasses.fields(AttentionSpec)] == [
        "block_size", "num_kv_heads", "head_size", "dtype", "page_size_padded"]
    assert [f.name for f in dataclasses.fields(KVCacheTensor)] == ["size", "shared_by"]
    assert [f.name for f in dataclasses.fields(KVCacheGroupSpec)][:2] == [
        "layer_names", "kv_cache_spec"]
    assert [f.name for f in dataclasses.fields(KVCacheConfig)] == [
        "num_blocks", "kv_cache_tensors", "kv_cache_groups"]


def test_max_memory_usage():
    assert full().max_memory_usage_bytes(100) == 7 * 65536
    sw = SlidingWindowSpec(16, 8, 128, torch.bfloat16, 32)
    # cdiv(min(32 - 1 + 10, 1000), 16) + 1 = 3 + 1
    assert sw.max_admission_blocks_per_request(10, 1000) == 4


def test_merge_equal_specs_returns_a_copy():
    a, b = full(), full()
    merged = KVCacheSpec.merge([a, b])
    assert merged == a and merged is not a
    assert FullAttentionSpec.merge([full(sliding_window=64), full()]).sliding_window == 64


def test_merge_mismatch():
    with pytest.raises(AssertionError, match="must be the same"):
        KVCacheSpec.merge([full(), full(num_kv_heads=4)])
    with pytest.raises(ValueError, match="must be the same"):
        KVCacheSpec.merge([full(), full(num_kv_heads=4)])
    with pytest.raises(ValueError, match="same window size"):
        FullAttentionSpec.merge([full(sliding_window=64), full(sliding_window=128)])
    with pytest.raises(AssertionError):
        FullAttentionSpec.merge([full(), full(head_size=64)])
    with pytest.raises(AssertionError):
        FullAttentionSpec.merge([full(), SlidingWindowSpec(16, 8, 128, torch.bfloat16, 4)])
    with pytest.raises(AssertionError):
        FullAttentionSpec.merge([full(sliding_window=4), full(attention_chunk_size=8)])
