"""Attention backends, reduced to what the KV cache needs from them.

A backend says which *logical* shape a layer's KV cache has (``get_kv_cache_shape``) and in
which order its dimensions lie in memory (``get_kv_cache_stride_order``). The reshape in
``attn_utils`` views the raw bytes in that physical order and permutes the view back, so the
logical shape is always the backend's while the strides follow the layout:

* FlashAttention: ``(2, num_blocks, block_size, num_kv_heads, head_size)`` (all K blocks,
  then all V blocks);
* FlashInfer and Triton: ``(num_blocks, 2, block_size, num_kv_heads, head_size)`` (each block
  holds its K page and then its V page).

Layout "NHD" keeps tokens outside heads inside a block; "HND" puts heads outside tokens.
"""
from __future__ import annotations

import os

from paged_attention.utils import check_int

_LAYOUTS = ("NHD", "HND")


def get_kv_cache_layout() -> str:
    """The layout in use: ``VLLM_KV_CACHE_LAYOUT`` if set (validated), else "NHD"."""
    layout = os.environ.get("VLLM_KV_CACHE_LAYOUT", "").strip() or "NHD"
    if layout not in _LAYOUTS:
        raise ValueError(f"VLLM_KV_CACHE_LAYOUT must be one of {_LAYOUTS}, got {layout!r}")
    return layout


def _check_layout(layout: str) -> None:
    if layout not in _LAYOUTS:
        raise ValueError(f"Unknown cache layout format {layout!r}; expected 'NHD' or 'HND'.")


def _check_dims(num_blocks, block_size, num_kv_heads, head_size, multiple_of_16: bool = False) -> None:
    for name, value in (("num_blocks", num_blocks), ("block_size", block_size),
                        ("num_kv_heads", num_kv_heads), ("head_size", head_size)):
        check_int(name, value, 0 if name == "num_blocks" else 1)
    if multiple_of_16 and block_size % 16 != 0:
        raise ValueError("Block size must be a multiple of 16.")


class AttentionBackend:
    """What every backend here answers; subclasses fill in the shape and the orders."""

    # stride orders: {layout: order}, without and with a leading layers dimension
    _STRIDE_ORDER: dict[str, tuple[int, ...]] = {}
    _STRIDE_ORDER_WITH_LAYERS: dict[str, tuple[int, ...]] = {}

    @staticmethod
    def get_name() -> str:
        raise NotImplementedError

    @staticmethod
    def get_supported_kernel_block_sizes() -> list:
        raise NotImplementedError

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                           head_size: int, cache_dtype_str: str = "auto") -> tuple[int, ...]:
        raise NotImplementedError

    @classmethod
    def get_kv_cache_stride_order(cls, layout: str | None = "NHD",
                                  include_num_layers_dimension: bool = False
                                  ) -> tuple[int, ...]:
        """The permutation of the logical dimensions that gives their order in memory.

        ``layout`` None means ``get_kv_cache_layout()``. With
        ``include_num_layers_dimension`` the logical shape is ``(num_layers, *shape)``.
        """
        if layout is None:
            layout = get_kv_cache_layout()
        _check_layout(layout)
        table = cls._STRIDE_ORDER_WITH_LAYERS if include_num_layers_dimension \
            else cls._STRIDE_ORDER
        return table[layout]

    @classmethod
    def full_cls_name(cls) -> tuple[str, str]:
        return (cls.__module__, cls.__qualname__)


class FlashAttentionBackend(AttentionBackend):
    """K/V dimension first: ``kv_cache.unbind(0)`` gives the key and value caches."""

    _STRIDE_ORDER = {"NHD": (0, 1, 2, 3, 4), "HND": (0, 1, 3, 2, 4)}
    _STRIDE_ORDER_WITH_LAYERS = {"NHD": (2, 0, 1, 3, 4, 5), "HND": (2, 4, 0, 1, 3, 5)}

    @staticmethod
    def get_name() -> str:
        return "FLASH_ATTN"

    @staticmethod
    def get_supported_kernel_block_sizes() -> list:
        return [16]   # any multiple of 16

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                           head_size: int, cache_dtype_str: str = "auto") -> tuple[int, ...]:
        _check_dims(num_blocks, block_size, num_kv_heads, head_size, multiple_of_16=True)
        return (2, num_blocks, block_size, num_kv_heads, head_size)


class FlashInferBackend(AttentionBackend):
    """K/V dimension second: a block holds its K page, then its V page."""

    _STRIDE_ORDER = {"NHD": (0, 1, 2, 3, 4), "HND": (0, 1, 3, 2, 4)}
    _STRIDE_ORDER_WITH_LAYERS = {"NHD": (1, 0, 2, 3, 4, 5), "HND": (1, 2, 4, 0, 3, 5)}

    @staticmethod
    def get_name() -> str:
        return "FLASHINFER"

    @staticmethod
    def get_supported_kernel_block_sizes() -> list:
        return [16, 32, 64]

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                           head_size: int, cache_dtype_str: str = "auto") -> tuple[int, ...]:
        _check_dims(num_blocks, block_size, num_kv_heads, head_size)
        if cache_dtype_str == "nvfp4":
            head_size = head_size // 2 + head_size // 16   # packed values + their scales
        return (num_blocks, 2, block_size, num_kv_heads, head_size)


class TritonAttentionBackend(AttentionBackend):
    """The same shape as FlashInfer; block sizes must be multiples of 16."""

    _STRIDE_ORDER = {"NHD": (0, 1, 2, 3, 4), "HND": (0, 1, 3, 2, 4)}
    _STRIDE_ORDER_WITH_LAYERS = {"NHD": (1, 0, 2, 3, 4, 5), "HND": (1, 2, 4, 0, 3, 5)}

    @staticmethod
    def get_name() -> str:
        return "TRITON_ATTN"

    @staticmethod
    def get_supported_kernel_block_sizes() -> list:
        return [16]   # any multiple of 16

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                           head_size: int, cache_dtype_str: str = "auto") -> tuple[int, ...]:
        _check_dims(num_blocks, block_size, num_kv_heads, head_size, multiple_of_16=True)
        return (num_blocks, 2, block_size, num_kv_heads, head_size)


BACKENDS = (FlashAttentionBackend, FlashInferBackend, TritonAttentionBackend)
