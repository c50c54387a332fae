"""The per-layer object a KV cache is bound to (a reduced ``vllm.attention.layer.Attention``).

It carries what the KV-cache code asks of a layer: its heads and head size, an optional
sliding window, its attention backend, and optionally the earlier layer whose KV cache it reuses
(``kv_sharing_target_layer_name``). ``init_kv_cache`` sets ``.kv_cache``.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from paged_attention.kv_cache.backends import AttentionBackend, FlashAttentionBackend
from paged_attention.kv_cache.interface import (
    FullAttentionSpec, KVCacheSpec, SlidingWindowSpec)
from paged_attention.utils import check_int


class Attention:
    """One attention layer, as far as its KV cache is concerned."""

    def __init__(self, num_heads: int, head_size: int, scale: float,
                 num_kv_heads: int | None = None, sliding_window: int | None = None,
                 backend: type[AttentionBackend] = FlashAttentionBackend,
                 kv_sharing_target_layer_name: str | None = None) -> None:
        self.num_heads = check_int("num_heads", num_heads, 1)
        self.head_size = check_int("head_size", head_size, 1)
        self.num_kv_heads = (self.num_heads if num_kv_heads is None
                             else check_int("num_kv_heads", num_kv_heads, 1))
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        self.sliding_window = (None if sliding_window is None
                               else check_int("sliding_window", sliding_window, 1))
        if not (isinstance(backend, type) and issubclass(backend, AttentionBackend)):
            raise TypeError(f"backend must be an AttentionBackend class, got {backend!r}")
        if kv_sharing_target_layer_name is not None and \
                not isinstance(kv_sharing_target_layer_name, str):
            raise TypeError("kv_sharing_target_layer_name must be a str or None, got "
                            f"{kv_sharing_target_layer_name!r}")
        if isinstance(scale, bool) or not isinstance(scale, (int, float, np.integer, np.floating)):
            raise TypeError(f"scale must be a real number, got {scale!r}")
        if not math.isfinite(scale):
            raise ValueError(f"scale must be finite, got {scale}")
        self.scale = float(scale)
        self.backend = backend
        self.attn_backend = backend
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.kv_cache: torch.Tensor | None = None

    def get_attn_backend(self) -> type[AttentionBackend]:
        return self.backend

    def get_kv_cache_spec(self, block_size: int, kv_cache_dtype: torch.dtype
                          ) -> KVCacheSpec | None:
        """This layer's spec, or None when it reuses another layer's KV cache."""
        if self.kv_sharing_target_layer_name is not None:
            return None
        if self.sliding_window is not None:
            return SlidingWindowSpec(block_size=block_size, num_kv_heads=self.num_kv_heads,
                                     head_size=self.head_size, dtype=kv_cache_dtype,
                                     sliding_window=self.sliding_window)
        return FullAttentionSpec(block_size=block_size, num_kv_heads=self.num_kv_heads,
                                 head_size=self.head_size, dtype=kv_cache_dtype)
