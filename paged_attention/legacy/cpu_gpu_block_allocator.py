"""One allocator per device behind one interface, and the null block (as in vLLM's
``vllm/core/block/cpu_gpu_block_allocator.py``).

Block ids are *absolute*: the GPU's come first (0 .. G-1), then the CPU's (G .. G+C-1), so an
id alone says which device (and which allocator) owns it. The KV-cache tensors of each device
start at 0, so kernels get *physical* ids: an absolute id's position among its device's ids.

The module ends with what a reader asks of the GPU pool (``refcounts``, ``allocation_order``,
``eviction_order``), read through public accessors only.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import FrozenSet, Mapping, Union

from paged_attention.legacy.common import (BlockStateError, BlockTypeError, UnknownBlockIdError, check_block,
                                           check_blocks, rehearse)
from paged_attention.legacy.evictor import LRUEvictor
from paged_attention.legacy.interfaces import Block, BlockAllocator, BlockId, DeviceAwareBlockAllocator
from paged_attention.legacy.naive_block import NaiveBlock, NaiveBlockAllocator, check_held
from paged_attention.legacy.prefix_caching_block import PrefixCachingBlockAllocator
from paged_attention.utils import Device, check_int


class CpuGpuBlockAllocator(DeviceAwareBlockAllocator):
    """A GPU allocator and a CPU allocator over disjoint ids, plus swapping between them."""

    @staticmethod
    def create(allocator_type: str, num_gpu_blocks: int, num_cpu_blocks: int,
               block_size: int) -> CpuGpuBlockAllocator:
        """Two allocators of ``allocator_type`` (``"naive"`` or ``"prefix_caching"``)."""
        num_gpu_blocks = check_int("num_gpu_blocks", num_gpu_blocks, 0)
        num_cpu_blocks = check_int("num_cpu_blocks", num_cpu_blocks, 0)
        block_size = check_int("block_size", block_size, 1)
        if not isinstance(allocator_type, str):
            raise TypeError(f"allocator_type must be a str, got {allocator_type!r}")
        block_ids = list(range(num_gpu_blocks + num_cpu_blocks))
        gpu_block_ids = block_ids[:num_gpu_blocks]
        cpu_block_ids = block_ids[num_gpu_blocks:]
        if allocator_type == "naive":
            gpu_allocator: BlockAllocator = NaiveBlockAllocator(
                create_block=NaiveBlock, num_blocks=num_gpu_blocks, block_size=block_size, block_ids=gpu_block_ids)
            cpu_allocator: BlockAllocator = NaiveBlockAllocator(
                create_block=NaiveBlock, num_blocks=num_cpu_blocks, block_size=block_size, block_ids=cpu_block_ids)
        elif allocator_type == "prefix_caching":
            gpu_allocator = PrefixCachingBlockAllocator(num_blocks=num_gpu_blocks, block_size=block_size,
                                                        block_ids=gpu_block_ids)
            cpu_allocator = PrefixCachingBlockAllocator(num_blocks=num_cpu_blocks, block_size=block_size,
                                                        block_ids=cpu_block_ids)
        else:
            raise ValueError(f"Unknown allocator type {allocator_type=}")
        return CpuGpuBlockAllocator(cpu_block_allocator=cpu_allocator, gpu_block_allocator=gpu_allocator)

    def __init__(self, cpu_block_allocator: BlockAllocator, gpu_block_allocator: BlockAllocator):
        for name, allocator in (("cpu_block_allocator", cpu_block_allocator),
                                ("gpu_block_allocator", gpu_block_allocator)):
            if not isinstance(allocator, BlockAllocator):
                raise TypeError(f"{name} must be a BlockAllocator, got {type(allocator).__name__}")
        if cpu_block_allocator.all_block_ids & gpu_block_allocator.all_block_ids:
            raise ValueError("cpu and gpu block allocators can't have intersection of block ids")
        self._allocators = {Device.CPU: cpu_block_allocator, Device.GPU: gpu_block_allocator}
        self._cpu_allocator, self._gpu_allocator = cpu_block_allocator, gpu_block_allocator
        self._swap_mapping: dict[int, int] = {}            # absolute src id -> absolute dst id
        self._null_block: NullBlock | None = None
        self._block_ids_to_allocator: dict[int, BlockAllocator] = {}
        for allocator in self._allocators.values():
            for block_id in allocator.all_block_ids:
                self._block_ids_to_allocator[block_id] = allocator

    def _allocator(self, device: Device) -> BlockAllocator:
        # Identity tests: called on every append, and an Enum's hash is slow Python code.
        if device is Device.GPU:
            return self._gpu_allocator
        if device is Device.CPU:
            return self._cpu_allocator
        raise TypeError(f"device must be Device.GPU or Device.CPU, got {device!r}")

    def _owner(self, block: Block) -> BlockAllocator:
        """The allocator that owns ``block``'s id."""
        if block.block_id is None:
            raise BlockStateError("the block has no physical id: freed twice?")
        if block.block_id not in self._block_ids_to_allocator:
            raise UnknownBlockIdError(f"block id {block.block_id} belongs to no device")
        return self._block_ids_to_allocator[block.block_id]

    # ---- Allocation, routed by device -------------------------------------------------------------
    def allocate_or_get_null_block(self) -> Block:
        """The null block, allocated (one mutable GPU block) on first use and never freed."""
        if self._null_block is None:
            self._null_block = NullBlock(self.allocate_mutable_block(None, Device.GPU))
        return self._null_block

    def allocate_mutable_block(self, prev_block: Block | None, device: Device,
                               extra_hash: int | None = None) -> Block:
        return self._allocator(device).allocate_mutable_block(prev_block, extra_hash=extra_hash)

    def allocate_immutable_blocks(self, prev_block: Block | None, block_token_ids: list[list[int]],
                                  device: Device, extra_hash: int | None = None) -> list[Block]:
        return self._allocator(device).allocate_immutable_blocks(prev_block, block_token_ids,
                                                                 extra_hash=extra_hash)

    def allocate_immutable_block(self, prev_block: Block | None, token_ids: list[int], device: Device,
                                 extra_hash: int | None = None) -> Block:
        return self._allocator(device).allocate_immutable_block(prev_block, token_ids, extra_hash=extra_hash)

    # ---- Freeing and forking, routed by id --------------------------------------------------------
    def free(self, block: Block) -> None:
        """Give a block back to its device; the null block is shared and silently kept."""
        check_block("block", block)
        if isinstance(block, NullBlock):
            return
        self._owner(block).free(block)

    def fork(self, last_block: Block) -> list[Block]:
        check_block("last_block", last_block)
        if isinstance(last_block, NullBlock):
            raise BlockTypeError("the null block cannot be forked")
        return self._owner(last_block).fork(last_block)

    # ---- Counts and ids ---------------------------------------------------------------------------
    def get_num_free_blocks(self, device: Device) -> int:
        return self._allocator(device).get_num_free_blocks()

    def get_num_total_blocks(self, device: Device) -> int:
        return self._allocator(device).get_num_total_blocks()

    def get_physical_block_id(self, device: Device, absolute_id: int) -> int:
        return self._allocator(device).get_physical_block_id(absolute_id)

    @property
    def all_block_ids(self) -> FrozenSet[int]:
        return frozenset(self._block_ids_to_allocator.keys())

    @property
    def allocators(self) -> Mapping[Device, BlockAllocator]:
        """Each device's allocator (a read-only view)."""
        return MappingProxyType(self._allocators)

    @property
    def null_block(self) -> NullBlock | None:
        """The null block, or None before a sliding window first asked for it."""
        return self._null_block

    # ---- Swapping ---------------------------------------------------------------------------------
    def swap(self, blocks: list[Block], src_device: Device, dst_device: Device) -> dict[int, int]:
        """Move blocks from ``src_device`` to ``dst_device`` in place (same objects, new ids);
        returns {absolute src id: absolute dst id}. All or nothing: every argument is checked
        (a block listed twice, one not on ``src_device``, the same device twice) before anything
        moves, and nothing moves unless the destination can take every block."""
        src_allocator, dst_allocator = self._allocator(src_device), self._allocator(dst_device)
        if src_device is dst_device:
            raise ValueError(f"src_device and dst_device are both {src_device}: a swap moves blocks between devices")
        blocks = check_blocks("blocks", blocks, distinct=True)
        for block in blocks:
            if isinstance(block, NullBlock) or self._owner(block) is not src_allocator:
                raise ValueError(f"block {block.block_id} is not a block of {src_device}")
        check_held(src_allocator, blocks, "swap")
        if len(blocks) > dst_allocator.get_num_free_blocks():
            rehearse(lambda s: s[0]._swap(s[1], src_device, dst_device), (self, blocks))
        return self._swap(blocks, src_device, dst_device)

    def _swap(self, blocks: list[Block], src_device: Device, dst_device: Device) -> dict[int, int]:
        src_allocator, dst_allocator = self._allocators[src_device], self._allocators[dst_device]
        src_block_ids = [block.block_id for block in blocks]
        # The swap copies each block's KV: a block computed on one side is computed on the other.
        is_computed = getattr(src_allocator, "block_is_computed", None)
        mark_computed = getattr(dst_allocator, "_mark_ids_computed", None)
        computed = ([is_computed(block_id) for block_id in src_block_ids]
                    if is_computed is not None and mark_computed is not None else None)
        src_allocator.swap_out(blocks)
        dst_allocator.swap_in(blocks)
        if computed is not None:
            mark_computed([block.block_id for block, done in zip(blocks, computed) if done])
        current_swap_mapping: dict[int, int] = {}
        for src_block_id, block in zip(src_block_ids, blocks):
            if src_block_id is not None and block.block_id is not None:
                self._swap_mapping[src_block_id] = block.block_id
                current_swap_mapping[src_block_id] = block.block_id
        return current_swap_mapping

    def get_and_reset_swaps(self) -> list[tuple[int, int]]:
        """Every (absolute src, absolute dst) pair swapped since the last call."""
        mapping = list(self._swap_mapping.items())
        self._swap_mapping.clear()
        return mapping

    def get_num_full_blocks_touched(self, blocks: list[Block], device: Device) -> int:
        return self._allocator(device).get_num_full_blocks_touched(blocks)

    # ---- Copy on write, access times and the prefix cache: the GPU's ----------------------------------
    def clear_copy_on_writes(self) -> list[tuple[int, int]]:
        return self._gpu_allocator.clear_copy_on_writes()

    def mark_blocks_as_accessed(self, block_ids: list[int], now: float) -> None:
        self._gpu_allocator.mark_blocks_as_accessed(block_ids, now)

    def mark_blocks_as_computed(self, block_ids: list[int]) -> None:
        self._gpu_allocator.mark_blocks_as_computed(block_ids)

    def get_common_computed_block_ids(self, computed_seq_block_ids: list[list[int]]) -> list[int]:
        return self._gpu_allocator.get_common_computed_block_ids(computed_seq_block_ids)

    def get_prefix_cache_hit_rate(self, device: Device) -> float:
        return self._allocator(device).get_prefix_cache_hit_rate()

    def reset_prefix_cache(self, device: Device | None = None) -> bool:
        """Reset one device's prefix cache, or every device's. vLLM stops at the first device
        that refuses (the CPU, checked first); here every device is tried, and the result is
        True only if all of them reset."""
        if device is not None:
            return self._allocator(device).reset_prefix_cache()
        results = [allocator.reset_prefix_cache() for allocator in self._allocators.values()]
        return all(results)

    def find_cached_blocks_prefix(self, block_hashes: list[int], device: Device = Device.GPU) -> list[int]:
        return self._allocator(device).find_cached_blocks_prefix(block_hashes)


class NullBlock(Block):
    """The block that stands for "dropped by the sliding window".

    Tables put it where their leading blocks were, so indices keep matching token positions.
    It wraps one real GPU block (so its id is a valid index for the kernels), is shared by every
    table, is never freed and never written.
    """

    def __init__(self, proxy: Block):
        super().__init__()
        self._proxy = proxy

    def append_token_ids(self, token_ids: list[BlockId]) -> None:
        raise ValueError("null block should not be modified")

    @property
    def block_id(self) -> int | None:
        return self._proxy.block_id

    @block_id.setter
    def block_id(self, value: int | None) -> None:
        raise ValueError("null block should not be modified")

    @property
    def token_ids(self) -> list[BlockId]:
        return self._proxy.token_ids

    @property
    def num_tokens_total(self) -> int:
        raise NotImplementedError("num_tokens_total is not used for the null block")

    @property
    def num_empty_slots(self) -> int:
        return self._proxy.num_empty_slots

    @property
    def is_full(self) -> bool:
        return self._proxy.is_full

    @property
    def prev_block(self) -> Block | None:
        return self._proxy.prev_block

    @property
    def extra_hash(self) -> int | None:
        return None

    @property
    def computed(self) -> bool:
        return self._proxy.computed

    @computed.setter
    def computed(self, value: bool) -> None:
        self._proxy.computed = value

    @property
    def last_accessed(self) -> float:
        return self._proxy.last_accessed

    @last_accessed.setter
    def last_accessed(self, last_accessed_ts: float) -> None:
        self._proxy.last_accessed = last_accessed_ts

    @property
    def content_hash(self) -> int | None:
        return self._proxy.content_hash


# ---- The GPU pool, read from outside --------------------------------------------------------------
# What a reader (a drawing, an exercise checker) asks of a pool: each block's reference count, and
# which ids the next allocations will take. Each takes a CpuGpuBlockAllocator (its GPU side is
# read) or one device's allocator.
SingleDeviceAllocator = Union[NaiveBlockAllocator, PrefixCachingBlockAllocator]


def gpu_allocator(allocator: object) -> SingleDeviceAllocator:
    """The GPU's allocator of a ``CpuGpuBlockAllocator``, or a single-device allocator as is."""
    if isinstance(allocator, CpuGpuBlockAllocator):
        allocator = allocator.allocators[Device.GPU]
    if isinstance(allocator, (NaiveBlockAllocator, PrefixCachingBlockAllocator)):
        return allocator
    raise TypeError(f"allocator must be a CpuGpuBlockAllocator (or one device's NaiveBlockAllocator / "
                    f"PrefixCachingBlockAllocator), got {type(allocator).__name__}")


def refcounts(allocator: object) -> list[int]:
    """The reference count of every GPU block, in id order (0: free, or cached and evictable)."""
    gpu = gpu_allocator(allocator)
    return [gpu.refcounter.get(i) for i in sorted(gpu.all_block_ids)]


def eviction_order(evictor: object) -> list[int]:
    """The ids waiting in an LRU evictor, first to be evicted first.

    Oldest ``last_accessed`` goes first; among equal times the block ending the longer prefix
    (more ``num_hashed_tokens``: the tail of a chain before its head), then the lower block id,
    then the lower hash. ``evictor`` is an ``LRUEvictor``, or a prefix-caching allocator (a
    ``CpuGpuBlockAllocator``'s GPU side is read).
    """
    if not isinstance(evictor, LRUEvictor):
        allocators = (CpuGpuBlockAllocator, PrefixCachingBlockAllocator)
        if not isinstance(evictor, allocators) or not isinstance(gpu_allocator(evictor), PrefixCachingBlockAllocator):
            raise TypeError(f"evictor must be an LRUEvictor or a prefix-caching allocator, "
                            f"got {type(evictor).__name__}")
        evictor = gpu_allocator(evictor).evictor
    return evictor.eviction_order()


def allocation_order(allocator: object) -> list[int]:
    """The GPU ids a run of fresh (mutable) allocations would get, in order.

    A naive allocator pops its free list from the left, and a freed id is pushed back on the
    left, so the id freed last comes out first. A prefix-caching allocator uses its free list
    first, then takes back cached blocks nobody holds, in eviction order.
    """
    gpu = gpu_allocator(allocator)
    if isinstance(gpu, PrefixCachingBlockAllocator):
        return gpu.free_block_ids + gpu.evictor.eviction_order()
    return gpu.free_block_ids
