"""The plain allocator (spec §1.3): physical ids handed out from a free list, counted, and
copied on write when shared; no prefix caching. Blocks are plain token lists.

Ids are reused last-in first-out: a freed id goes to the left of the free deque and allocation
pops from the left, so the id just freed is the next one given out.
"""
from __future__ import annotations

from collections import deque
from typing import FrozenSet, Iterable

from paged_attention.legacy.common import (BlockPool, BlockStateError, CopyOnWriteTracker, RefCounter,
                                           get_all_blocks_recursively)
from paged_attention.legacy.interfaces import Block, BlockAllocator, BlockId
from paged_attention.utils import Device


class NaiveBlockAllocator(BlockAllocator):
    """Physical ids for one device, with reference counts and copy on write."""

    def __init__(self, create_block: Block.Factory, num_blocks: int, block_size: int,
                 block_ids: Iterable[int] | None = None, block_pool: BlockPool | None = None):
        block_ids = list(range(num_blocks) if block_ids is None else block_ids)
        if len(set(block_ids)) != num_blocks or len(block_ids) != num_blocks:
            raise ValueError(f"block_ids must hold {num_blocks} distinct ids, got {len(set(block_ids))} distinct "
                             f"of {len(block_ids)}")
        self._free_block_indices: deque[BlockId] = deque(block_ids)
        self._all_block_indices = frozenset(block_ids)
        self._physical_block_ids = {block_id: i for i, block_id in enumerate(sorted(block_ids))}
        self._refcounter = RefCounter(all_block_indices=self._free_block_indices)
        self._block_size = block_size
        self._cow_tracker = CopyOnWriteTracker(refcounter=self._refcounter.as_readonly())
        # A prefix-caching allocator passes in the pool it shares with this one.
        self._block_pool = block_pool or BlockPool(self._block_size, create_block, self, num_blocks * 4)

    # ---- Allocation -----------------------------------------------------------------------------
    def allocate_immutable_block(self, prev_block: Block | None, token_ids: list[int],
                                 extra_hash: int | None = None, device: Device | None = None) -> Block:
        """A block holding ``token_ids`` (this allocator has no real immutability)."""
        self._no_device(device)
        if len(token_ids) > self._block_size:         # checked first: nothing allocated on failure
            raise BlockStateError(f"{len(token_ids)} tokens do not fit in a block of {self._block_size}")
        block = self.allocate_mutable_block(prev_block=prev_block, extra_hash=extra_hash)
        block.append_token_ids(token_ids)
        return block

    def allocate_immutable_blocks(self, prev_block: Block | None, block_token_ids: list[list[int]],
                                  extra_hash: int | None = None, device: Device | None = None) -> list[Block]:
        """All ids are taken first (so a fresh allocator gives 0, 1, 2, ...), then chained.
        All or nothing: if the ids run out part-way, those already taken are given back."""
        self._no_device(device)
        for token_ids in block_token_ids:
            if len(token_ids) > self._block_size:
                raise BlockStateError(f"{len(token_ids)} tokens do not fit in a block of {self._block_size}")
        if len(block_token_ids) > len(self._free_block_indices):
            raise BlockAllocator.NoFreeBlocksError(
                f"{len(block_token_ids)} blocks asked for, {len(self._free_block_indices)} free")
        block_ids = [self._allocate_block_id() for _ in block_token_ids]
        blocks = []
        for token_ids, block_id in zip(block_token_ids, block_ids):
            prev_block = self._block_pool.init_block(prev_block=prev_block, token_ids=token_ids,
                                                     block_size=self._block_size, physical_block_id=block_id,
                                                     extra_hash=extra_hash)
            blocks.append(prev_block)
        return blocks

    def allocate_mutable_block(self, prev_block: Block | None, extra_hash: int | None = None,
                               device: Device | None = None) -> Block:
        """An empty block with a fresh physical id (reference count 1)."""
        self._no_device(device)
        block_id = self._allocate_block_id()
        return self._block_pool.init_block(prev_block=prev_block, token_ids=[], block_size=self._block_size,
                                           physical_block_id=block_id, extra_hash=extra_hash)

    @staticmethod
    def _no_device(device: Device | None) -> None:
        if device is not None:
            raise ValueError(f"a single-device allocator takes no device, got {device}")

    def _allocate_block_id(self) -> BlockId:
        if not self._free_block_indices:
            raise BlockAllocator.NoFreeBlocksError("no free blocks")
        block_id = self._free_block_indices.popleft()
        self._refcounter.incr(block_id)
        return block_id

    def _free_block_id(self, block: Block | BlockId) -> None:
        """Drop one reference; the id returns to the free list (on the left) at zero."""
        if isinstance(block, Block):
            block_id = block.block_id
            if block_id is None:
                raise BlockStateError("the block has no physical id: freed twice?")
        else:
            block_id = block
        if self._refcounter.decr(block_id) == 0:
            self._free_block_indices.appendleft(block_id)
        if isinstance(block, Block):
            block.block_id = None

    # ---- Freeing and forking ------------------------------------------------------------------------
    def free(self, block: Block, keep_block_object: bool = False) -> None:
        self._free_block_id(block)
        if not keep_block_object:
            self._block_pool.free_block(block)

    def free_block_id(self, block_id: BlockId) -> None:
        self._free_block_id(block_id)

    def fork(self, last_block: Block) -> list[Block]:
        """A second chain over the same physical blocks: each id gains a holder."""
        source_blocks = get_all_blocks_recursively(last_block)
        for block in source_blocks:                   # all checked before any count changes
            if block.block_id is None or self._refcounter.get(block.block_id) == 0:
                raise BlockStateError(f"can't fork a freed block (block_id = {block.block_id})")
        forked_blocks: list[Block] = []
        prev_block = None
        for block in source_blocks:
            self._refcounter.incr(block.block_id)
            prev_block = self._block_pool.init_block(prev_block=prev_block, token_ids=block.token_ids,
                                                     block_size=self._block_size,
                                                     physical_block_id=block.block_id, extra_hash=block.extra_hash)
            forked_blocks.append(prev_block)
        return forked_blocks

    # ---- Counts and ids ---------------------------------------------------------------------------
    def get_num_free_blocks(self) -> int:
        return len(self._free_block_indices)

    def get_num_total_blocks(self) -> int:
        return len(self._all_block_indices)

    def get_physical_block_id(self, absolute_id: int) -> int:
        """The position of ``absolute_id`` among this allocator's ids in ascending order (a CPU
        allocator's ids follow the GPU's, but its cache tensor starts at 0)."""
        if absolute_id not in self._physical_block_ids:
            raise KeyError(f"block id {absolute_id} does not belong to this allocator")
        return self._physical_block_ids[absolute_id]

    @property
    def refcounter(self):
        return self._refcounter.as_readonly()

    @property
    def all_block_ids(self) -> FrozenSet[int]:
        return self._all_block_indices

    # ---- Copy on write ----------------------------------------------------------------------------
    def cow_block_if_not_appendable(self, block: Block) -> BlockId:
        """The id ``block`` may be written under: its own if nobody else holds it, otherwise a
        fresh one, with the (old, new) pair recorded for ``copy_blocks``."""
        src_block_id = block.block_id
        if src_block_id is None:
            raise BlockStateError("copy on write needs an allocated block")
        if self._cow_tracker.is_appendable(block):
            return src_block_id
        if self.get_num_free_blocks() == 0:           # before dropping the shared reference
            raise BlockAllocator.NoFreeBlocksError("no free block to copy a shared block into")
        self._free_block_id(block)
        trg_block_id = self._allocate_block_id()
        self._cow_tracker.record_cow(src_block_id, trg_block_id)
        return trg_block_id

    def clear_copy_on_writes(self) -> list[tuple[BlockId, BlockId]]:
        return self._cow_tracker.clear_cows()

    # ---- What only the prefix-caching allocator does --------------------------------------------------
    def mark_blocks_as_accessed(self, block_ids: list[int], now: float) -> None:
        pass

    def mark_blocks_as_computed(self, block_ids: list[int]) -> None:
        pass

    def get_common_computed_block_ids(self, computed_seq_block_ids: list[list[int]]) -> list[int]:
        return []

    def promote_to_immutable_block(self, block: Block) -> BlockId:
        raise NotImplementedError("the naive allocator has no immutable blocks")

    def get_num_full_blocks_touched(self, blocks: list[Block]) -> int:
        """Distinct full block objects among ``blocks``: what swapping them would move."""
        return len({id(block) for block in blocks if block.is_full})

    def get_prefix_cache_hit_rate(self) -> float:
        return -1

    def reset_prefix_cache(self) -> bool:
        return True

    def find_cached_blocks_prefix(self, block_hashes: list[int]) -> list[int]:
        return []

    # ---- Swapping ---------------------------------------------------------------------------------
    def swap_out(self, blocks: list[Block]) -> None:
        for block in blocks:
            self._free_block_id(block)

    def swap_in(self, blocks: list[Block]) -> None:
        """Give each block an id here, keeping its object (the table still points to it)."""
        if len(blocks) > len(self._free_block_indices):
            raise BlockAllocator.NoFreeBlocksError(f"{len(blocks)} blocks to swap in, "
                                                   f"{len(self._free_block_indices)} free")
        self._swap_in(blocks)

    def _swap_in(self, blocks: list[Block]) -> None:
        for block in blocks:
            # A temporary block takes the id (full blocks as immutable ones: the prefix-caching
            # allocator may find them cached); the id then moves into the existing object.
            if block.is_full:
                tmp_block = self.allocate_immutable_block(prev_block=block.prev_block, token_ids=block.token_ids,
                                                          extra_hash=block.extra_hash)
            else:
                tmp_block = self.allocate_mutable_block(prev_block=block.prev_block, extra_hash=block.extra_hash)
                tmp_block.append_token_ids(block.token_ids)
            block_id = tmp_block.block_id
            tmp_block.block_id = None
            self._block_pool.free_block(tmp_block)
            block.block_id = block_id


class NaiveBlock(Block):
    """A list of up to ``block_size`` token ids and the physical id they are cached under.

    Every append (of at least one token) asks the allocator whether the block may still be
    written in place, after adding the tokens: a block shared after a fork gets a fresh id here,
    and the copy of its contents is recorded for the cache kernels.
    """

    def __init__(self, prev_block: Block | None, token_ids: list[int], block_size: int,
                 allocator: BlockAllocator, block_id: int | None = None, _cow_target: Block | None = None,
                 extra_hash: int | None = None, computed: bool = False):
        self._token_ids: list[int] = []
        self._block_size = block_size
        self._prev_block = prev_block
        self._block_id = block_id
        self._allocator = allocator
        self._cow_target = _cow_target if _cow_target is not None else self
        self._append_token_ids_no_cow(token_ids)

    def append_token_ids(self, token_ids: list[int]) -> None:
        self._append_token_ids_no_cow(token_ids)
        if token_ids and self._block_id is not None:
            try:
                self._block_id = self._allocator.cow_block_if_not_appendable(self._cow_target)
            except BlockAllocator.NoFreeBlocksError:
                del self._token_ids[-len(token_ids):]     # all or nothing: the block is as it was
                raise

    def _append_token_ids_no_cow(self, token_ids: list[int]) -> None:
        if len(token_ids) == 0:
            return
        if len(token_ids) > self.num_empty_slots:
            raise BlockStateError(f"{len(token_ids)} tokens do not fit in the {self.num_empty_slots} empty "
                                  f"slots of this block")
        self._token_ids.extend(token_ids)

    def forget_prev_block(self) -> None:
        """Cut the chain before this block (the sliding window dropped its predecessors), so
        that nothing walks into block objects the pool may already have handed out again."""
        self._prev_block = None

    @property
    def computed(self) -> bool:
        raise NotImplementedError

    @computed.setter
    def computed(self, value: bool) -> None:
        raise NotImplementedError

    @property
    def last_accessed(self) -> float:
        raise NotImplementedError

    @last_accessed.setter
    def last_accessed(self, last_accessed_ts: float) -> None:
        raise NotImplementedError

    @property
    def block_id(self) -> int | None:
        return self._block_id

    @block_id.setter
    def block_id(self, value: int | None) -> None:
        self._block_id = value

    # The two below read ``_token_ids`` directly: they run on every append of every sequence.
    @property
    def is_full(self) -> bool:
        return len(self._token_ids) == self._block_size

    @property
    def num_empty_slots(self) -> int:
        return self._block_size - len(self._token_ids)

    @property
    def token_ids(self) -> list[int]:
        return self._token_ids

    @property
    def num_tokens_total(self) -> int:
        raise NotImplementedError("num_tokens_total is only used by the prefix-caching block")

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def prev_block(self) -> Block | None:
        return self._prev_block

    @property
    def extra_hash(self) -> int | None:
        return None

    @property
    def content_hash(self) -> int | None:
        return None
