"""What one layer's KV cache needs per block, and how the cache is laid out.

Mirrors ``vllm/v1/kv_cache_interface.py``: the specs are frozen dataclasses with vLLM's field
names; ``page_size_bytes`` is the number of bytes one block of one layer takes.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace, fields

import torch

from paged_attention.utils import VllmAssertion, cdiv, check_int


def _set_int(spec: object, name: str, minimum: int = 1, optional: bool = False) -> None:
    """Check the int field ``name`` of a frozen spec (``>= minimum``; None too if ``optional``)
    and store it as a plain int, so that a numpy int compares and hashes like one."""
    value = getattr(spec, name)
    if optional and value is None:
        return
    object.__setattr__(spec, name, check_int(f"{type(spec).__name__}.{name}", value, minimum))


class KVCacheSpecMismatchError(ValueError, VllmAssertion):
    """Specs that must be equal (one KV-cache group) are not (vLLM asserts this)."""


def get_dtype_size(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``."""
    return torch.tensor([], dtype=dtype).element_size()


@dataclass(frozen=True)
class KVCacheSpec:
    """The base of every spec: only the number of tokens per block."""

    block_size: int

    def __post_init__(self) -> None:
        # A spec is checked once, here: a page size of 0 or less, or one that is not an int,
        # would only fail later, as a division by zero or a wrong number of blocks.
        self._validate()

    def _validate(self) -> None:
        """TypeError/ValueError for a field that is not what it must be. Subclasses add theirs."""
        _set_int(self, "block_size")

    @property
    def page_size_bytes(self) -> int:
        raise NotImplementedError

    def max_memory_usage_bytes(self, max_model_len: int) -> int:
        raise NotImplementedError

    @property
    def storage_block_size(self) -> int:
        return self.block_size

    def copy_with_new_block_size(self, block_size: int) -> "KVCacheSpec":
        return replace(self, block_size=block_size)

    @classmethod
    def merge(cls, specs: list["KVCacheSpec"]) -> "KVCacheSpec":
        """One spec for a group of layers; every spec in ``specs`` must be equal."""
        if not specs:
            raise ValueError("merge needs at least one spec")
        if not all(spec == specs[0] for spec in specs[1:]):
            raise KVCacheSpecMismatchError(
                "All layers in the same KV cache group must be the same.")
        return copy.deepcopy(specs[0])


@dataclass(frozen=True)
class AttentionSpec(KVCacheSpec):
    """Attention layers: a K and a V page of ``block_size * num_kv_heads * head_size`` each."""

    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    page_size_padded: int | None = field(default=None, kw_only=True)

    def _validate(self) -> None:
        super()._validate()
        _set_int(self, "num_kv_heads")
        _set_int(self, "head_size")
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"{type(self).__name__}.dtype must be a torch.dtype, got {self.dtype!r}")
        _set_int(self, "page_size_padded", optional=True)
        if self.page_size_padded is not None:
            self.page_size_bytes       # raises if the padded page is smaller than the real one

    @property
    def real_page_size_bytes(self) -> int:
        # Specs with a ``head_size_v`` (full and sliding-window attention) size V pages by it.
        head_size_v = getattr(self, "head_size_v", None) or self.head_size
        return (self.block_size * self.num_kv_heads * (self.head_size + head_size_v)
                * get_dtype_size(self.dtype))

    @property
    def page_size_bytes(self) -> int:
        real = self.real_page_size_bytes
        if self.page_size_padded is not None:
            if self.page_size_padded < real:
                raise ValueError(f"page_size_padded={self.page_size_padded} is smaller than "
                                 f"the real page size {real}")
            return self.page_size_padded
        return real


@dataclass(frozen=True)
class FullAttentionSpec(AttentionSpec):
    """Every token attends to every earlier one; V may have its own head size."""

    head_size_v: int | None = None
    sliding_window: int | None = None
    attention_chunk_size: int | None = None

    def _validate(self) -> None:
        _set_int(self, "head_size_v", optional=True)
        _set_int(self, "sliding_window", optional=True)
        _set_int(self, "attention_chunk_size", optional=True)
        super()._validate()
        if self.head_size_v is None:
            object.__setattr__(self, "head_size_v", self.head_size)

    def max_memory_usage_bytes(self, max_model_len: int) -> int:
        return cdiv(max_model_len, self.block_size) * self.page_size_bytes

    @classmethod
    def merge(cls, specs: list[KVCacheSpec]) -> "FullAttentionSpec":
        """Merge full-attention specs; windows and chunk sizes (None ignored) must agree."""
        if not specs:
            raise ValueError("merge needs at least one spec")
        if not all(isinstance(spec, FullAttentionSpec) for spec in specs):
            raise KVCacheSpecMismatchError(
                "All attention layers in the same KV cache group must be FullAttentionSpec.")
        windows = {s.sliding_window for s in specs if s.sliding_window is not None}
        chunks = {s.attention_chunk_size for s in specs
                  if s.attention_chunk_size is not None}
        if len(windows) > 1:
            raise ValueError("All attention layers in the same KV cache group must have the "
                             "same window size.")
        if len(chunks) > 1:
            raise ValueError("All attention layers in the same KV cache group must have the "
                             "same attention chunk size.")
        base = [f.name for f in fields(AttentionSpec)] + ["head_size_v"]
        first = specs[0]
        for spec in specs[1:]:
            for name in base:
                if getattr(spec, name) != getattr(first, name):
                    raise KVCacheSpecMismatchError(
                        "All attention layers in the same KV cache group must have the same "
                        f"{name}: {getattr(first, name)!r} != {getattr(spec, name)!r}")
        window = next(iter(windows), None)
        chunk = next(iter(chunks), None)
        if window is not None and chunk is not None:
            raise KVCacheSpecMismatchError(
                "Model with both sliding window layers and chunked local attention layers "
                "is not supported.")
        return replace(first, sliding_window=window, attention_chunk_size=chunk)


@dataclass(frozen=True)
class SlidingWindowSpec(AttentionSpec):
    """Each token attends to the last ``sliding_window`` tokens only."""

    sliding_window: int
    head_size_v: int | None = None

    def _validate(self) -> None:
        _set_int(self, "sliding_window")
        _set_int(self, "head_size_v", optional=True)
        super()._validate()
        if self.head_size_v is None:
            object.__setattr__(self, "head_size_v", self.head_size)

    def max_admission_blocks_per_request(self, max_num_batched_tokens: int,
                                         max_model_len: int) -> int:
        tokens = min(self.sliding_window - 1 + max_num_batched_tokens, max_model_len)
        return cdiv(tokens, self.block_size) + 1

    def max_memory_usage_bytes(self, max_model_len: int,
                               max_num_batched_tokens: int | None = None) -> int:
        if max_num_batched_tokens is None:
            max_num_batched_tokens = max_model_len
        return (self.max_admission_blocks_per_request(max_num_batched_tokens, max_model_len)
                * self.page_size_bytes)


def _check_names(what: str, names: object) -> None:
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise TypeError(f"{what} must be a list of layer names (str), got {names!r}")


@dataclass
class KVCacheTensor:
    """One raw buffer of ``size`` bytes, used by every layer in ``shared_by``."""

    size: int
    shared_by: list[str]

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """TypeError/ValueError unless ``size`` is an int >= 1 and ``shared_by`` a list of
        layer names. Run on construction and again by ``KVCacheConfig.validate``."""
        check_int("KVCacheTensor.size", self.size, 1)
        _check_names("KVCacheTensor.shared_by", self.shared_by)


@dataclass
class KVCacheGroupSpec:
    """Layers that share one block table because their specs are the same."""

    layer_names: list[str]
    kv_cache_spec: KVCacheSpec
    is_eagle_group: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """TypeError unless ``layer_names`` is a list of names and ``kv_cache_spec`` a spec."""
        _check_names("KVCacheGroupSpec.layer_names", self.layer_names)
        if not isinstance(self.kv_cache_spec, KVCacheSpec):
            raise TypeError("KVCacheGroupSpec.kv_cache_spec must be a KVCacheSpec, got "
                            f"{self.kv_cache_spec!r}")


@dataclass
class KVCacheConfig:
    """How many blocks, which raw buffers, and which groups of layers use them."""

    num_blocks: int
    kv_cache_tensors: list[KVCacheTensor]
    kv_cache_groups: list[KVCacheGroupSpec]

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """TypeError/ValueError unless every field (and every tensor and group in it) has the
        right type. The fields can be edited after construction, so the KV-cache functions
        call this again before they use a config."""
        check_int("KVCacheConfig.num_blocks", self.num_blocks, 1)
        for name, items, kind in (("kv_cache_tensors", self.kv_cache_tensors, KVCacheTensor),
                                  ("kv_cache_groups", self.kv_cache_groups, KVCacheGroupSpec)):
            if not isinstance(items, (list, tuple)):
                raise TypeError(f"KVCacheConfig.{name} must be a list of {kind.__name__}, "
                                f"got {items!r}")
            for item in items:
                if not isinstance(item, kind):
                    raise TypeError(f"KVCacheConfig.{name} must hold {kind.__name__} objects, "
                                    f"got {item!r}")
                item.validate()

    @property
    def has_mamba_layers(self) -> bool:
        return False

    @property
    def needs_kv_cache_zeroing(self) -> bool:
        return self.has_mamba_layers
