"""The plain allocator (vLLM's ``vllm/core/block/naive_block.py``): physical ids handed out from a free list, counted, and
copied on write when shared; no prefix caching. Blocks are plain token lists.

Ids are reused last-in first-out: a freed id goes to the left of the free deque and allocation
pops from the left, so the id just freed is the next one given out.
"""
from __future__ import annotations

from collections import Counter, deque
from typing import FrozenSet, Iterable

from paged_attention.legacy.common import (BlockPool, BlockStateError, CopyOnWriteTracker, RefCounter,
                                           check_block, check_block_ids, check_blocks, check_extra_hash,
                                           check_time, check_token_ids, get_all_blocks_recursively)
from paged_attention.legacy.interfaces import Block, BlockAllocator, BlockId
from paged_attention.utils import Device, is_int


def check_block_token_ids(block_token_ids: object) -> list[list[int]]:
    """``block_token_ids`` as a list of token-id lists (TypeError for anything else)."""
    if not isinstance(block_token_ids, (list, tuple)):
        raise TypeError(f"block_token_ids must be a list of token-id lists, got {type(block_token_ids).__name__}")
    return [check_token_ids("every item of block_token_ids", token_ids) for token_ids in block_token_ids]


def check_computed_seq_block_ids(computed_seq_block_ids: object) -> None:
    """TypeError unless it is a list of block-id lists."""
    if not isinstance(computed_seq_block_ids, (list, tuple)):
        raise TypeError(f"computed_seq_block_ids must be a list of block-id lists, "
                        f"got {type(computed_seq_block_ids).__name__}")
    for ids in computed_seq_block_ids:
        check_block_ids("every item of computed_seq_block_ids", ids)


def check_held(allocator, blocks: list[Block], what: str) -> None:
    """Before freeing or moving ``blocks``: each has an id of ``allocator`` held at least as
    many times as it is listed (a ValueError or KeyError here, and nothing has changed)."""
    counts: Counter = Counter()
    for block in blocks:
        block_id = block.block_id
        if block_id is None:
            raise BlockStateError(f"cannot {what} a block with no physical id (freed already?)")
        counts[block_id] += 1
    for block_id, n in counts.items():
        held = allocator._refcounter.get(block_id)          # UnknownBlockIdError if not ours
        if held < n:
            raise BlockStateError(f"block {block_id} is listed {n} times but held {held} times")


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
        check_block("prev_block", prev_block, optional=True)
        check_extra_hash(extra_hash)
        token_ids = check_token_ids("token_ids", token_ids)
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
        check_block("prev_block", prev_block, optional=True)
        check_extra_hash(extra_hash)
        block_token_ids = check_block_token_ids(block_token_ids)
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
        check_block("prev_block", prev_block, optional=True)
        check_extra_hash(extra_hash)
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
        """Drop the block's hold on its id (a block, not an id: TypeError for an int, before
        anything changes; ``free_block_id`` takes ids)."""
        check_block("block", block)
        self._free_block_id(block)
        if not keep_block_object:
            self._block_pool.free_block(block)

    def free_block_id(self, block_id: BlockId) -> None:
        """Drop one hold on ``block_id`` (held by no block object)."""
        if not is_int(block_id):
            raise TypeError(f"block_id must be an int, got {block_id!r}")
        self._free_block_id(int(block_id))

    def fork(self, last_block: Block) -> list[Block]:
        """A second chain over the same physical blocks: each id gains a holder."""
        check_block("last_block", last_block)
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
        if not is_int(absolute_id):
            raise TypeError(f"absolute_id must be an int, got {absolute_id!r}")
        if absolute_id not in self._physical_block_ids:
            raise KeyError(f"block id {absolute_id} does not belong to this allocator")
        return self._physical_block_ids[absolute_id]

    @property
    def refcounter(self):
        return self._refcounter.as_readonly()

    @property
    def all_block_ids(self) -> FrozenSet[int]:
        return self._all_block_indices

    @property
    def free_block_ids(self) -> list[BlockId]:
        """The free ids in the order allocations take them (a copy): the id freed last first."""
        return list(self._free_block_indices)

    @property
    def block_size(self) -> int:
        return self._block_size

    # ---- Copy on write ----------------------------------------------------------------------------
    def cow_block_if_not_appendable(self, block: Block) -> BlockId:
        """The id ``block`` may be written under: its own if nobody else holds it, otherwise a
        fresh one, with the (old, new) pair recorded for ``copy_blocks``."""
        check_block("block", block)
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
        """Nothing to record without a prefix cache (the arguments are still checked)."""
        check_block_ids("block_ids", block_ids)
        check_time("now", now)

    def mark_blocks_as_computed(self, block_ids: list[int]) -> None:
        check_block_ids("block_ids", block_ids)

    def get_common_computed_block_ids(self, computed_seq_block_ids: list[list[int]]) -> list[int]:
        check_computed_seq_block_ids(computed_seq_block_ids)
        return []

    def promote_to_immutable_block(self, block: Block) -> BlockId:
        raise NotImplementedError("the naive allocator has no immutable blocks")

    def get_num_full_blocks_touched(self, blocks: list[Block]) -> int:
        """Distinct full block objects among ``blocks``: what swapping them would move."""
        check_blocks("blocks", blocks)
        return len({id(block) for block in blocks if block.is_full})

    def get_prefix_cache_hit_rate(self) -> float:
        return -1

    def reset_prefix_cache(self) -> bool:
        return True

    def find_cached_blocks_prefix(self, block_hashes: list[int]) -> list[int]:
        check_block_ids("block_hashes", block_hashes)
        return []

    # ---- Swapping ---------------------------------------------------------------------------------
    def swap_out(self, blocks: list[Block]) -> None:
        """Let go of each block's id here, keeping the object (it moves to another device).
        Every block is checked first, so a bad list changes nothing."""
        blocks = check_blocks("blocks", blocks, distinct=True)
        check_held(self, blocks, "swap out")
        for block in blocks:
            self._free_block_id(block)

    def swap_in(self, blocks: list[Block]) -> None:
        """Give each block an id here, keeping its object (the table still points to it)."""
        blocks = check_blocks("blocks", blocks, distinct=True)
        if len(blocks) > len(self._free_block_indices):
            raise BlockAllocator.NoFreeBlocksError(f"{len(blocks)} blocks to swap in, "
                                                   f"{len(self._free_block_indices)} free")
        if any(block.block_id is not None for block in blocks):
            raise BlockStateError("swap_in takes blocks with no physical id (swapped out first)")
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
            # From now on this allocator owns the id: appends (copy on write, promotion) must
            # come here, not to the allocator the object was made by.
            block._bind_allocator(self)


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

    def _bind_allocator(self, allocator: BlockAllocator) -> None:
        """The allocator that now owns this block's id (after a swap to its device)."""
        self._allocator = allocator

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
