"""The model's KV caches: memory from the project's ``kv_cache`` package, shaped for its kernels.

The path is vLLM's (``paged_attention/kv_cache/attn_utils.py`` walks through it):

1. one ``Attention`` object per model layer, which gives a ``FullAttentionSpec`` (block size,
   KV heads, head size, dtype): ``page_size_bytes`` is one block of one layer, keys and values;
2. a ``KVCacheConfig`` of ``num_blocks`` blocks, one ``KVCacheTensor`` per layer;
3. the memory: **one** raw int8 allocation for the whole model, cut into each layer's
   ``num_blocks * page_size_bytes`` bytes (vLLM allocates one tensor per ``KVCacheTensor``; one
   buffer here makes the model's KV cache a single region that a notebook can draw and measure);
4. ``_reshape_kv_cache``: each layer's bytes viewed in the FlashAttention backend's shape
   ``(2, num_blocks, block_size, num_kv_heads, head_dim)``; index 0 is the key cache, 1 the value
   cache, each ``[num_blocks, block_size, num_kv_heads, head_dim]`` (NHD) and contiguous, so that
   ``swap_blocks`` and ``copy_blocks`` move whole blocks.

A block id means the same block in every layer: the engine's block table is shared by all 30.
"""
from __future__ import annotations

import torch

from paged_attention.kv_cache.attn_utils import _reshape_kv_cache, get_kv_cache_config, get_kv_cache_spec
from paged_attention.kv_cache.backends import FlashAttentionBackend
from paged_attention.kv_cache.interface import FullAttentionSpec
from paged_attention.kv_cache.layer import Attention
from paged_attention.kernels.layout import v0_x
from paged_attention.model.config import LlamaConfig
from paged_attention.model.llama import LlamaForCausalLM, resolve_device, resolve_dtype
from paged_attention.utils import check_int

KVCache = tuple[torch.Tensor, torch.Tensor]


class FlashLayoutBackend(FlashAttentionBackend):
    """FlashAttention's cache shape at any block size.

    vLLM's FlashAttention backend asks for a multiple of 16 tokens per block, a limit of FA3's
    kernels. This project's reference, Triton and CUDA kernels look each token's block up and
    take 8 too (the legacy block manager's favourite size), so for those the limit is lifted; FA3
    (``attention="vllm"``) still refuses such a cache when it runs.
    """

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                           head_size: int, cache_dtype_str: str = "auto") -> tuple[int, ...]:
        check_int("num_blocks", num_blocks, 0)
        for name, value in (("block_size", block_size), ("num_kv_heads", num_kv_heads), ("head_size", head_size)):
            check_int(name, value, 1)
        return (2, num_blocks, block_size, num_kv_heads, head_size)


def layer_names(config: LlamaConfig) -> list[str]:
    """vLLM's names of the attention layers: ``model.layers.{i}.self_attn.attn``."""
    return [f"model.layers.{i}.self_attn.attn" for i in range(config.num_hidden_layers)]


def attention_layers(config: LlamaConfig) -> dict[str, Attention]:
    """One ``Attention`` per layer: what the KV-cache code asks of a layer (heads, head size)."""
    return {name: Attention(config.num_attention_heads, config.head_dim, config.head_dim ** -0.5,
                            num_kv_heads=config.num_key_value_heads, backend=FlashLayoutBackend)
            for name in layer_names(config)}


def kv_cache_bytes_per_block(config: LlamaConfig, block_size: int, dtype: torch.dtype | str) -> int:
    """Bytes one block takes across all layers: ``2 (K, V) * layers * block_size * kv_heads * head_dim * elem``."""
    dtype = resolve_dtype(dtype)
    spec = FullAttentionSpec(block_size=check_int("block_size", block_size, 1),
                             num_kv_heads=config.num_key_value_heads, head_size=config.head_dim, dtype=dtype)
    return spec.page_size_bytes * config.num_hidden_layers


def allocate_kv_caches(model: LlamaForCausalLM | LlamaConfig, num_blocks: int, block_size: int, *,
                       device: torch.device | str | None = None, dtype: torch.dtype | str | None = None,
                       backend: str = "flash", layout: str | None = None) -> list[KVCache]:
    """Zeroed per-layer ``(key_cache, value_cache)`` of ``num_blocks`` blocks of ``block_size`` tokens.

    ``device`` and ``dtype`` default to the model's (pass ``device="cpu"`` for a swap pool).
    ``layout`` defaults to the model's ``kv_cache_layout``: ``"flash"``, ``[num_blocks, block_size,
    num_kv_heads, head_dim]`` each; or ``"v0"`` for the CUDA kernels, the same bytes viewed as
    vLLM's v0 layout (key ``[num_blocks, num_kv_heads, head_dim // x, block_size, x]``, value
    ``[num_blocks, num_kv_heads, head_dim, block_size]``). Every cache is contiguous with the block
    dimension first. ``backend``: ``"flash"`` (the only one: K and V in separate halves of a layer).
    """
    if isinstance(model, LlamaForCausalLM):
        config = model.config
        device = model.device if device is None else device
        dtype = model.dtype if dtype is None else dtype
        layout = model.kv_cache_layout if layout is None else layout
    elif isinstance(model, LlamaConfig):
        config = model
        if device is None or dtype is None:
            raise ValueError("with a LlamaConfig instead of a model, pass device= and dtype=")
        layout = "flash" if layout is None else layout
    else:
        raise TypeError(f"model must be a LlamaForCausalLM or a LlamaConfig, got {type(model).__name__}")
    device, dtype = resolve_device(device), resolve_dtype(dtype)
    num_blocks = check_int("num_blocks", num_blocks, 1)
    block_size = check_int("block_size", block_size, 1)
    if backend != "flash":
        raise ValueError(f"unknown KV-cache backend {backend!r}; expected 'flash'")
    if layout not in ("flash", "v0"):
        raise ValueError(f"unknown KV-cache layout {layout!r}; expected 'flash' or 'v0'")

    # 1-2. specs and config: num_blocks blocks, one KVCacheTensor of num_blocks pages per layer
    layers = attention_layers(config)
    specs = get_kv_cache_spec(layers, block_size, dtype)
    kv_config = get_kv_cache_config(specs, available_memory=0, num_gpu_blocks_override=num_blocks)
    # 3. one raw allocation, cut into each layer's bytes (tensor i is layer i's)
    sizes = [t.size for t in kv_config.kv_cache_tensors]
    raw = torch.zeros(sum(sizes), dtype=torch.int8, device=device)
    raw_by_layer: dict[str, torch.Tensor] = {}
    offset = 0
    for tensor, size in zip(kv_config.kv_cache_tensors, sizes):
        for name in tensor.shared_by:
            raw_by_layer[name] = raw[offset: offset + size]
        offset += size
    # 4. each layer's view: (2, num_blocks, block_size, kv_heads, head_dim), NHD
    views = _reshape_kv_cache(kv_config, raw_by_layer, {name: FlashLayoutBackend for name in layers}, "NHD")
    caches = []
    for name in layers:
        key_cache, value_cache = views[name].unbind(0)
        if layout == "v0":
            key_cache, value_cache = _as_v0(key_cache, value_cache)
        caches.append((key_cache, value_cache))
    return caches


def _as_v0(key_cache: torch.Tensor, value_cache: torch.Tensor) -> KVCache:
    """The same contiguous bytes, viewed as vLLM's v0 layout (the contents are reinterpreted, so
    only for empty caches: the kernels that read v0 also write it)."""
    n, b, h, d = key_cache.shape
    x = v0_x(key_cache.dtype)
    return key_cache.view(n, h, d // x, b, x), value_cache.view(n, h, d, b)


def kv_cache_nbytes(kv_caches: list[KVCache]) -> int:
    """Bytes held by these caches (keys and values of every layer)."""
    return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv_caches)


__all__ = ["FlashLayoutBackend", "layer_names", "attention_layers", "kv_cache_bytes_per_block",
           "allocate_kv_caches", "kv_cache_nbytes"]
