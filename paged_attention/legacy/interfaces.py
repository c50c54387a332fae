"""What a block and a block allocator promise (vLLM's ``vllm/core/block/interfaces.py``):
the abstract shapes every legacy
allocator fills in, with vLLM's names so the two codebases can be read side by side.

A *block* holds up to ``block_size`` token ids and, once allocated, the id of the physical KV
block they are cached in. An *allocator* hands out physical ids on one device; a
*device-aware* allocator holds one allocator per device (GPU ids first, then CPU ids).
"""
from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from typing import FrozenSet, Protocol

from paged_attention.utils import Device

BlockId = int


class AllocStatus(enum.Enum):
    """Can a sequence group be given its blocks? OK now; LATER (not now, but capacity would
    suffice); NEVER (it can never fit)."""

    OK = enum.auto()
    LATER = enum.auto()
    NEVER = enum.auto()


class Block(ABC):
    """A logical block: its tokens, its physical id (None when not allocated) and its place in
    a chain (``prev_block``), which the prefix cache hashes along."""

    @abstractmethod
    def append_token_ids(self, token_ids: list[int]) -> None: ...

    @property
    @abstractmethod
    def block_id(self) -> BlockId | None: ...

    @block_id.setter
    @abstractmethod
    def block_id(self, value: BlockId | None) -> None: ...

    @property
    @abstractmethod
    def token_ids(self) -> list[int]: ...

    @property
    @abstractmethod
    def num_tokens_total(self) -> int:
        """Tokens in this block and every block before it in the chain."""

    @property
    @abstractmethod
    def num_empty_slots(self) -> int: ...

    @property
    @abstractmethod
    def is_full(self) -> bool: ...

    @property
    @abstractmethod
    def prev_block(self) -> Block | None: ...

    @property
    @abstractmethod
    def extra_hash(self) -> int | None:
        """What else the prefix hash depends on (e.g. a LoRA id); None if nothing."""

    @property
    @abstractmethod
    def computed(self) -> bool: ...

    @computed.setter
    @abstractmethod
    def computed(self, value: bool) -> None: ...

    @property
    @abstractmethod
    def last_accessed(self) -> float: ...

    @last_accessed.setter
    @abstractmethod
    def last_accessed(self, last_accessed_ts: float) -> None: ...

    class Factory(Protocol):
        """How allocators build blocks (and how the pool re-initialises them in place)."""

        def __call__(self, prev_block: Block | None, token_ids: list[int], block_size: int,
                     allocator: BlockAllocator, block_id: int | None = None, computed: bool = False,
                     extra_hash: int | None = None) -> Block: ...

    @property
    @abstractmethod
    def content_hash(self) -> int | None:
        """The prefix-cache hash of this full block and its chain, or None."""


class BlockAllocator(ABC):
    """Hands out physical block ids on one device and tracks who holds them."""

    class NoFreeBlocksError(ValueError):
        """No physical block is free (nor evictable). A ValueError: asking for more blocks than
        exist is bad input to the allocator, and callers may catch it to retry later."""

    @abstractmethod
    def allocate_mutable_block(self, prev_block: Block | None, extra_hash: int | None = None) -> Block: ...

    @abstractmethod
    def allocate_immutable_block(self, prev_block: Block | None, token_ids: list[int],
                                 extra_hash: int | None = None) -> Block: ...

    @abstractmethod
    def allocate_immutable_blocks(self, prev_block: Block | None, block_token_ids: list[list[int]],
                                  extra_hash: int | None = None) -> list[Block]: ...

    @abstractmethod
    def free(self, block: Block) -> None: ...

    @abstractmethod
    def fork(self, last_block: Block) -> list[Block]: ...

    @abstractmethod
    def get_num_total_blocks(self) -> int: ...

    @abstractmethod
    def get_num_free_blocks(self) -> int: ...

    @abstractmethod
    def get_physical_block_id(self, absolute_id: int) -> int: ...

    @abstractmethod
    def swap_out(self, blocks: list[Block]) -> None: ...

    @abstractmethod
    def swap_in(self, blocks: list[Block]) -> None: ...

    @property
    @abstractmethod
    def all_block_ids(self) -> FrozenSet[int]: ...

    @abstractmethod
    def clear_copy_on_writes(self) -> list[tuple[int, int]]: ...

    @abstractmethod
    def mark_blocks_as_accessed(self, block_ids: list[int], now: float) -> None: ...

    @abstractmethod
    def mark_blocks_as_computed(self, block_ids: list[int]) -> None: ...

    @abstractmethod
    def get_common_computed_block_ids(self, computed_seq_block_ids: list[list[int]]) -> list[int]: ...

    @abstractmethod
    def cow_block_if_not_appendable(self, block: Block) -> BlockId | None: ...

    @abstractmethod
    def promote_to_immutable_block(self, block: Block) -> BlockId: ...

    @abstractmethod
    def get_num_full_blocks_touched(self, blocks: list[Block]) -> int: ...

    @abstractmethod
    def get_prefix_cache_hit_rate(self) -> float: ...

    @abstractmethod
    def reset_prefix_cache(self) -> bool: ...

    @abstractmethod
    def find_cached_blocks_prefix(self, block_hashes: list[int]) -> list[int]: ...


class DeviceAwareBlockAllocator(ABC):
    """The same operations over several devices: each takes the ``device`` it concerns."""

    @abstractmethod
    def allocate_mutable_block(self, prev_block: Block | None, device: Device,
                               extra_hash: int | None = None) -> Block: ...

    @abstractmethod
    def allocate_immutable_block(self, prev_block: Block | None, token_ids: list[int], device: Device,
                                 extra_hash: int | None = None) -> Block: ...

    @abstractmethod
    def allocate_immutable_blocks(self, prev_block: Block | None, block_token_ids: list[list[int]],
                                  device: Device, extra_hash: int | None = None) -> list[Block]: ...

    @abstractmethod
    def get_num_free_blocks(self, device: Device) -> int: ...

    @abstractmethod
    def get_num_total_blocks(self, device: Device) -> int: ...

    @abstractmethod
    def free(self, block: Block) -> None: ...

    @abstractmethod
    def fork(self, last_block: Block) -> list[Block]: ...

    @property
    @abstractmethod
    def all_block_ids(self) -> FrozenSet[int]: ...

    @abstractmethod
    def clear_copy_on_writes(self) -> list[tuple[int, int]]: ...

    @abstractmethod
    def mark_blocks_as_accessed(self, block_ids: list[int], now: float) -> None: ...

    @abstractmethod
    def mark_blocks_as_computed(self, block_ids: list[int]) -> None: ...

    @abstractmethod
    def get_common_computed_block_ids(self, computed_seq_block_ids: list[list[int]]) -> list[int]: ...

    @abstractmethod
    def get_num_full_blocks_touched(self, blocks: list[Block], device: Device) -> int: ...

    @abstractmethod
    def swap(self, blocks: list[Block], src_device: Device, dst_device: Device) -> dict[int, int]:
        """Move blocks between devices; returns {old physical id: new physical id}."""

    @abstractmethod
    def get_physical_block_id(self, device: Device, absolute_id: int) -> int: ...

    @abstractmethod
    def allocate_or_get_null_block(self) -> Block:
        """The one block that stands for "outside the sliding window": never freed."""

    @abstractmethod
    def get_prefix_cache_hit_rate(self, device: Device) -> float: ...

    @abstractmethod
    def reset_prefix_cache(self, device: Device | None = None) -> bool: ...

    @abstractmethod
    def find_cached_blocks_prefix(self, block_hashes: list[int], device: Device = Device.GPU) -> list[int]: ...
