"""A sequence's block table (vLLM's ``vllm/core/block/block_table.py``): its tokens, cut into blocks, and the physical id of
each block. Logical block ``i`` holds tokens ``i*block_size .. (i+1)*block_size - 1``, so
token ``t`` lives in slot ``physical_block_ids[t // block_size] * block_size + t % block_size``
of the KV cache.

The table only ever grows at its end (or drops its front to the null block under a sliding
window); the allocator decides which physical ids it gets, shares and copies on write.
"""
from __future__ import annotations

import math
from typing import Optional

from paged_attention.legacy.common import (BlockList, BlockStateError, check_blocks, check_device,
                                           check_extra_hash, check_token_ids, rehearse)
from paged_attention.legacy.interfaces import Block, BlockAllocator, DeviceAwareBlockAllocator
from paged_attention.utils import Device, cdiv, check_int, chunk_list


class BlockTable:
    """The blocks of one sequence, allocated through a device-aware allocator.

    All or nothing: ``allocate``, ``append_token_ids`` and ``ensure_num_empty_slots`` either
    complete or raise ``NoFreeBlocksError`` with the table and the allocator as they were. When
    the free blocks might not suffice, the call is first rehearsed on a copy (see
    ``common.rehearse``).

    Arguments are checked before anything is taken: token ids must be ints (a list, a tuple, a
    range or a 1-d integer numpy array; a str is refused), counts ints (not bools).
    """

    def __init__(self, block_size: int, block_allocator: DeviceAwareBlockAllocator,
                 _blocks: Optional[list[Block]] = None, max_block_sliding_window: Optional[int] = None):
        block_size = check_int("block_size", block_size, 1)
        if not isinstance(block_allocator, DeviceAwareBlockAllocator):
            raise TypeError(f"block_allocator must be a DeviceAwareBlockAllocator, got "
                            f"{type(block_allocator).__name__}")
        if _blocks is not None:
            _blocks = check_blocks("_blocks", _blocks)
        if max_block_sliding_window is not None:
            max_block_sliding_window = check_int("max_block_sliding_window", max_block_sliding_window, 1)
        self._block_size = block_size
        self._allocator = block_allocator
        self._blocks = BlockList(_blocks if _blocks is not None else [])
        self._max_block_sliding_window = max_block_sliding_window
        self._num_full_slots = self._get_num_token_ids()

    @property
    def allocator(self) -> DeviceAwareBlockAllocator:
        """The device-aware allocator this table takes its blocks from."""
        return self._allocator

    @staticmethod
    def get_num_required_blocks(token_ids: list[int], block_size: int, num_lookahead_slots: int = 0) -> int:
        """Blocks for ``token_ids`` plus lookahead slots if nothing were shared."""
        token_ids = check_token_ids("token_ids", token_ids)
        block_size = check_int("block_size", block_size, 1)
        check_int("num_lookahead_slots", num_lookahead_slots, 0)
        return cdiv(len(token_ids) + num_lookahead_slots, block_size)

    # ---- Allocate -------------------------------------------------------------------------------------
    def allocate(self, token_ids: list[int], device: Device = Device.GPU, extra_hash: Optional[int] = None) -> None:
        """Blocks for a prompt: its full chunks as immutable blocks (one call, so a fresh naive
        allocator numbers them 0, 1, 2, ...), a trailing partial chunk as a mutable one."""
        token_ids = check_token_ids("token_ids", token_ids)
        check_device(device)
        check_extra_hash(extra_hash)
        if self._is_allocated:
            raise BlockStateError("the block table is already allocated")
        if len(token_ids) == 0:
            raise ValueError("cannot allocate a block table for no tokens")
        if cdiv(len(token_ids), self._block_size) > self._allocator.get_num_free_blocks(device):
            rehearse(lambda table: table._allocate_blocks_for_token_ids(None, token_ids, device, extra_hash), self)
        blocks = self._allocate_blocks_for_token_ids(prev_block=None, token_ids=token_ids, device=device,
                                                     extra_hash=extra_hash)
        self.update(blocks)
        self._num_full_slots = len(token_ids)

    def update(self, blocks: list[Block]) -> None:
        """Replace the blocks (after a swap) and rebuild the id list."""
        self._blocks.update(check_blocks("blocks", blocks))

    # ---- Append -------------------------------------------------------------------------------------
    def append_token_ids(self, token_ids: list[int], num_lookahead_slots: int = 0,
                         num_computed_slots: Optional[int] = None, extra_hash: Optional[int] = None) -> None:
        """Append tokens (and reserve lookahead slots) at the end of the sequence.

        With a sliding window, blocks wholly outside it are first freed and replaced by the null
        block. Then enough empty slots are ensured, and the tokens are written block by block
        from the first non-full one; each write may copy a shared block on write or promote a
        block that fills up.
        """
        token_ids = check_token_ids("token_ids", token_ids)
        num_lookahead_slots = check_int("num_lookahead_slots", num_lookahead_slots, 0)
        if num_computed_slots is not None:
            num_computed_slots = check_int("num_computed_slots", num_computed_slots, 0)
        check_extra_hash(extra_hash)
        self._append_checked(token_ids, num_lookahead_slots, num_computed_slots, extra_hash)

    def _append_checked(self, token_ids: list[int], num_lookahead_slots: int, num_computed_slots: Optional[int],
                        extra_hash: Optional[int]) -> None:
        """``append_token_ids`` once its arguments are known to be well typed (the block
        manager's decode path, whose tokens come from a ``Sequence`` that checked them)."""
        if not self._is_allocated:
            raise BlockStateError("no blocks have been allocated")
        if self._max_block_sliding_window is None and num_lookahead_slots == 0 and len(token_ids) == 1:
            self._append_one_token(token_ids, extra_hash)
            return
        if self._max_block_sliding_window is not None:
            if num_computed_slots is None:
                raise ValueError("a block table with a sliding window needs num_computed_slots (an int >= 0), "
                                 "got None")
            end_block_idx = num_computed_slots // self._block_size - self._max_block_sliding_window
            if end_block_idx > self._num_full_slots // self._block_size:
                raise ValueError(f"num_computed_slots={num_computed_slots} would drop the block the next token "
                                 f"goes to (the table holds {self._num_full_slots} tokens)")
        if self._max_block_allocations(token_ids, num_lookahead_slots) > self._allocator.get_num_free_blocks(
                Device.GPU):
            rehearse(lambda table: table._append_token_ids(token_ids, num_lookahead_slots, num_computed_slots,
                                                           extra_hash), self)
        self._append_token_ids(token_ids, num_lookahead_slots, num_computed_slots, extra_hash)

    def _append_one_token(self, token_ids: list[int], extra_hash: Optional[int]) -> None:
        """A decode step's append: one token, no lookahead, no window. It takes at most one free
        block (a new block when the last is full, or a copy of a shared last block), and either
        allocation fails before anything changes, so it needs no rehearsal."""
        block_idx = self._num_full_slots // self._block_size
        if block_idx == len(self._blocks):       # every block is full: the token starts a new one
            self._ensure_num_empty_slots(1, extra_hash)
        self._blocks.append_token_ids(block_idx, token_ids)
        self._num_full_slots += 1

    def _max_block_allocations(self, token_ids: list[int], num_lookahead_slots: int) -> int:
        """An upper bound on the free blocks an append can take: the null block if not made yet,
        the new blocks, and a copy for each shared block written into (a promotion never takes
        one; freeing blocks outside the window only gives some back)."""
        num_blocks = len(self._blocks)
        num_empty_slots = num_blocks * self._block_size - self._num_full_slots
        needed = max(0, cdiv(len(token_ids) + num_lookahead_slots - num_empty_slots, self._block_size))
        if self._max_block_sliding_window is not None:
            needed += 1                          # the null block (at most once; a bound is enough)
        if token_ids:                            # a write into an existing block may copy it
            first_chunk_size = self._block_size - self._num_full_slots % self._block_size
            num_chunks = 1 + cdiv(max(0, len(token_ids) - first_chunk_size), self._block_size)
            needed += max(0, min(num_chunks, num_blocks - self._num_full_slots // self._block_size))
        return needed

    def _append_token_ids(self, token_ids: list[int], num_lookahead_slots: int,
                          num_computed_slots: Optional[int], extra_hash: Optional[int]) -> None:
        if self._max_block_sliding_window is not None:
            null_block = self._allocator.allocate_or_get_null_block()
            # Blocks before this index hold only tokens the window no longer sees.
            end_block_idx = num_computed_slots // self._block_size - self._max_block_sliding_window
            if end_block_idx > 0 and self._blocks[end_block_idx - 1] is not null_block:
                # vLLM leaves the first kept block pointing at its dropped predecessor, whose
                # object goes back to the pool and is reused: a later fork would walk into
                # another sequence's blocks. Cut the chain there instead.
                self._blocks[end_block_idx].forget_prev_block()
            for idx in range(0, end_block_idx):
                block = self._blocks[idx]
                if block is not null_block:
                    self._allocator.free(block)
                    self._blocks[idx] = null_block

        self._ensure_num_empty_slots(len(token_ids) + num_lookahead_slots, extra_hash)

        first_block_idx = self._num_full_slots // self._block_size
        for i, token_block in enumerate(self._chunk_token_blocks_for_append(token_ids)):
            self._blocks.append_token_ids(first_block_idx + i, token_block)
        self._num_full_slots += len(token_ids)   # lookahead slots are reserved, not filled

    def ensure_num_empty_slots(self, num_empty_slots: int, extra_hash: Optional[int] = None) -> None:
        """Append empty GPU blocks until at least ``num_empty_slots`` slots are free."""
        num_empty_slots = check_int("num_empty_slots", num_empty_slots, 0)
        check_extra_hash(extra_hash)
        self._ensure_num_empty_slots(num_empty_slots, extra_hash)

    def _ensure_num_empty_slots(self, num_empty_slots: int, extra_hash: Optional[int]) -> None:
        device = Device.GPU                      # tables only grow on the GPU
        if not self._is_allocated:
            raise BlockStateError("no blocks have been allocated")
        if self._num_empty_slots >= num_empty_slots:
            return
        slots_to_allocate = num_empty_slots - self._num_empty_slots
        blocks_to_allocate = cdiv(slots_to_allocate, self._block_size)
        num_free = self._allocator.get_num_free_blocks(device)
        if blocks_to_allocate > num_free:        # each new block takes exactly one free block
            raise BlockAllocator.NoFreeBlocksError(f"{blocks_to_allocate} blocks needed, {num_free} free")
        for _ in range(blocks_to_allocate):
            self._blocks.append(self._allocator.allocate_mutable_block(prev_block=self._blocks[-1], device=device,
                                                                       extra_hash=extra_hash))

    # ---- Fork and free ------------------------------------------------------------------------------
    def fork(self) -> BlockTable:
        """A new table over the same physical blocks (each gains a holder; nothing is copied)."""
        if not self._is_allocated:
            raise BlockStateError("cannot fork a block table with no blocks")
        forked_blocks = self._allocator.fork(self._blocks[-1])
        # Positions the sliding window dropped are not in the chain: they stay the null block.
        num_dropped = len(self._blocks) - len(forked_blocks)
        forked = BlockTable(block_size=self._block_size, block_allocator=self._allocator,
                            _blocks=self.blocks[:num_dropped] + forked_blocks,
                            max_block_sliding_window=self._max_block_sliding_window)
        forked._num_full_slots = self._num_full_slots    # the null block holds no tokens to count
        return forked

    def free(self) -> None:
        """Give every block back (the allocator skips the null block); the table can then be
        allocated again."""
        for block in self.blocks:
            self._allocator.free(block)
        self._blocks.reset()
        self._num_full_slots = 0

    # ---- Reading the table ------------------------------------------------------------------------------
    @property
    def physical_block_ids(self) -> list[int]:
        """The ids a kernel's block table row holds for this sequence."""
        return self._blocks.ids()

    def get_unseen_token_ids(self, sequence_token_ids: list[int]) -> list[int]:
        """The sequence's tokens not yet appended to this table (its tail)."""
        if type(sequence_token_ids) is not list:     # a list's tail is checked where it is used
            sequence_token_ids = check_token_ids("sequence_token_ids", sequence_token_ids)
        return sequence_token_ids[self.num_full_slots:]

    def _allocate_blocks_for_token_ids(self, prev_block: Optional[Block], token_ids: list[int], device: Device,
                                       extra_hash: Optional[int] = None) -> list[Block]:
        block_token_ids = []
        tail_token_ids = []
        for cur_token_ids in chunk_list(token_ids, self._block_size):
            (block_token_ids if len(cur_token_ids) == self._block_size else tail_token_ids).append(cur_token_ids)
        blocks: list[Block] = []
        if block_token_ids:
            blocks.extend(self._allocator.allocate_immutable_blocks(prev_block, block_token_ids=block_token_ids,
                                                                    device=device, extra_hash=extra_hash))
            prev_block = blocks[-1]
        if tail_token_ids:
            block = self._allocator.allocate_mutable_block(prev_block=prev_block, device=device,
                                                           extra_hash=extra_hash)
            block.append_token_ids(tail_token_ids[0])
            blocks.append(block)
        return blocks

    def _get_all_token_ids(self) -> list[int]:
        token_ids: list[int] = []
        for block in self.blocks:
            token_ids.extend(block.token_ids)
        return token_ids

    def _get_num_token_ids(self) -> int:
        return sum(len(block.token_ids) for block in self.blocks)

    @property
    def _is_allocated(self) -> bool:
        return len(self._blocks) > 0

    @property
    def blocks(self) -> list[Block]:
        return self._blocks.list()

    @property
    def _num_empty_slots(self) -> int:
        if not self._is_allocated:
            raise BlockStateError("no blocks have been allocated")
        return len(self._blocks) * self._block_size - self._num_full_slots

    @property
    def num_full_slots(self) -> int:
        """Tokens appended so far (lookahead slots not included)."""
        return self._num_full_slots

    def get_num_blocks_touched_by_append_slots(self, token_ids: list[int], num_lookahead_slots: int) -> int:
        """Blocks an append of ``token_ids`` plus lookahead slots would write into: the
        current last block's free part, then whole blocks. Zero new slots touch nothing when
        the last block is full (1 + ceil(-1) = 0), one block when it is partly filled."""
        token_ids = check_token_ids("token_ids", token_ids)
        check_int("num_lookahead_slots", num_lookahead_slots, 0)
        return self._num_blocks_touched(token_ids, num_lookahead_slots)

    def _num_blocks_touched(self, token_ids: list[int], num_lookahead_slots: int) -> int:
        return self._num_blocks_touched_by(len(token_ids) + num_lookahead_slots)

    def _num_blocks_touched_by(self, num_token_ids: int) -> int:
        first_chunk_size = self._block_size - (self._num_full_slots % self._block_size)
        return 1 + math.ceil((num_token_ids - first_chunk_size) / self._block_size)

    def _chunk_token_blocks_for_append(self, token_ids: list[int]) -> list[list[int]]:
        """The tokens cut to fit: first what fills the current block, then whole blocks."""
        if not token_ids:
            return []
        first_chunk_size = self._block_size - (self._num_full_slots % self._block_size)
        return [token_ids[:first_chunk_size], *chunk_list(token_ids[first_chunk_size:], self._block_size)]
