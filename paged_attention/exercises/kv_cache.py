"""Exercises of ``05_kv_cache_allocation.ipynb``.

Each checker computes its answer with the library's KV-cache code (specs, config, reshape) and
compares the student's answer with it.
"""
from __future__ import annotations

import torch

from paged_attention.exercises import as_int, report
from paged_attention.kv_cache import attn_utils as au
from paged_attention.kv_cache.backends import FlashAttentionBackend
from paged_attention.kv_cache.interface import FullAttentionSpec
from paged_attention.kv_cache.layer import Attention


def _layers(num_layers: int, num_kv_heads: int, head_size: int) -> dict[str, Attention]:
    return {f"layers.{i}.attn": Attention(num_kv_heads, head_size, head_size ** -0.5)
            for i in range(num_layers)}


def bytes_per_token(answer: int, num_layers: int = 28, num_kv_heads: int = 4, head_size: int = 128,
                    dtype: torch.dtype = torch.bfloat16) -> bool:
    """Exercise 1: how many bytes of KV cache does one token take in a model of ``num_layers``
    layers with ``num_kv_heads`` KV heads of ``head_size`` in ``dtype`` (default: Qwen2.5-7B's
    shape in bf16, a model the notebook's table does not list)?"""
    spec = FullAttentionSpec(block_size=1, num_kv_heads=num_kv_heads, head_size=head_size, dtype=dtype)
    expected = spec.page_size_bytes * num_layers
    return report(
        as_int(answer, "answer") == expected,
        f"2 (K, V) x {num_layers} layers x {num_kv_heads} KV heads x {head_size} x "
        f"{spec.page_size_bytes // (2 * num_kv_heads * head_size)} bytes = {expected:,} bytes",
        "count K and V, every layer, the KV heads (not the query heads), the head size and the "
        "bytes per element",
    )


def num_blocks(answer: int, available_gib: int = 4, num_layers: int = 28, num_kv_heads: int = 4,
               head_size: int = 128, block_size: int = 16) -> bool:
    """Exercise 2: ``available_gib`` GiB for the KV cache of the model of exercise 1 (bf16),
    blocks of ``block_size`` tokens. How many blocks does ``get_kv_cache_config`` make?"""
    layers = _layers(num_layers, num_kv_heads, head_size)
    specs = au.get_kv_cache_spec(layers, block_size, torch.bfloat16)
    expected = au.get_kv_cache_config(specs, available_gib << 30).num_blocks
    page = next(iter(specs.values())).page_size_bytes
    return report(
        as_int(answer, "answer") == expected,
        f"{available_gib} GiB // {page:,} bytes a page // {num_layers} layers = {expected:,} blocks "
        f"({expected * block_size:,} tokens)",
        "a block of one layer is block_size tokens of K and V of that layer (the page size); every "
        "layer needs one page per block",
    )


def hnd_offset(answer: int, block: int = 3, token: int = 5, head: int = 1, dim: int = 7,
               num_blocks: int = 8, block_size: int = 16, num_kv_heads: int = 2,
               head_size: int = 32) -> bool:
    """Exercise 3: FlashAttention backend, layout HND, one layer of ``num_blocks`` blocks. The
    key cache is ``kv_cache[0]``, of logical shape ``[num_blocks, block_size, num_kv_heads,
    head_size]``. At which element offset from the start of the key cache does the key
    ``key_cache[block, token, head, dim]`` lie?"""
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size,
                             dtype=torch.float16)
    config = au.get_kv_cache_config({"layers.0.attn": spec}, num_blocks * spec.page_size_bytes)
    raw = au._allocate_kv_cache(config, "cpu")
    view = au._reshape_kv_cache(config, raw, {"layers.0.attn": FlashAttentionBackend}, "HND")
    key_cache = view["layers.0.attn"][0]
    element = key_cache[block, token, head, dim]
    expected = (element.data_ptr() - key_cache.data_ptr()) // key_cache.element_size()
    return report(
        as_int(answer, "answer") == expected,
        f"strides {tuple(key_cache.stride())}: {block}*{key_cache.stride(0)} + {token}*"
        f"{key_cache.stride(1)} + {head}*{key_cache.stride(2)} + {dim} = {expected}",
        "HND puts heads outside tokens inside a block: the head stride is block_size * head_size, "
        "the token stride head_size",
    )
