"""The pieces every legacy allocator is built from (vLLM's
``vllm/core/block/common.py``): a reference counter and its
read-only view, the log of copy-on-write pairs, a pool of reusable block objects, a list of
blocks that keeps their ids at hand, and the prefix-cache hit-rate bookkeeping.
"""
from __future__ import annotations

import copy
import math
import sys
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import numpy as np

from paged_attention.legacy.interfaces import Block, BlockAllocator, BlockId
from paged_attention.utils import Device, VllmAssertion, check_int_list, is_int


class BlockStateError(ValueError, VllmAssertion):
    """A call that breaks a block invariant: freeing a block twice, forking a freed one,
    appending past a block's end (vLLM asserts these)."""


class UnknownBlockIdError(KeyError, VllmAssertion):
    """A block id this allocator never owned (vLLM asserts this)."""


class BlockTypeError(TypeError, VllmAssertion):
    """An object of the wrong kind where a block or allocator was expected (vLLM asserts this)."""


# --------------------------------------------------------------------------------------------
# Argument checks for the public entry points (cheap: run once per call, not per token)
# --------------------------------------------------------------------------------------------

def check_block(name: str, block: object, optional: bool = False) -> None:
    """TypeError (a ``BlockTypeError``) unless ``block`` is a Block (or None when ``optional``)."""
    if isinstance(block, Block) or (optional and block is None):
        return
    expected = "a Block or None" if optional else "a Block"
    raise BlockTypeError(f"{name} must be {expected}, got {type(block).__name__}")


def check_blocks(name: str, blocks: object, distinct: bool = False) -> list:
    """``blocks`` as a list of Blocks; with ``distinct``, one block object listed twice is a
    ValueError (moving or freeing it twice would corrupt the counts)."""
    if not isinstance(blocks, (list, tuple)):
        raise TypeError(f"{name} must be a list of Blocks, got {type(blocks).__name__}")
    for block in blocks:
        check_block(f"every item of {name}", block)
    if distinct and len({id(block) for block in blocks}) != len(blocks):
        raise ValueError(f"{name} lists the same block object more than once")
    return list(blocks)


def check_device(device: object) -> None:
    """TypeError unless ``device`` is a ``Device`` (a string such as "gpu" is not one)."""
    if device is not Device.GPU and device is not Device.CPU:
        raise TypeError(f"device must be Device.GPU or Device.CPU, got {device!r}")


def check_extra_hash(extra_hash: object) -> None:
    """TypeError unless ``extra_hash`` is an int or None (it is hashed into the prefix hash)."""
    if extra_hash is not None and not is_int(extra_hash):
        raise TypeError(f"extra_hash must be an int or None, got {extra_hash!r}")


def check_token_ids(name: str, token_ids: object) -> list[int]:
    """``token_ids`` as a list of ints: a list or tuple of ints, a range, or a 1-d integer numpy
    array. A str (a sequence of characters), floats or bools are refused with TypeError, before
    anything is allocated. A plain list of plain ints is returned as it is (the common case)."""
    if type(token_ids) is list:
        for token in token_ids:
            if type(token) is not int:
                break
        else:
            return token_ids
    if isinstance(token_ids, np.ndarray):
        if token_ids.ndim != 1 or not np.issubdtype(token_ids.dtype, np.integer):
            raise TypeError(f"{name} must be a 1-d array of integers, got dtype {token_ids.dtype} with "
                            f"{token_ids.ndim} dimensions")
        return token_ids.tolist()
    return check_int_list(name, token_ids)


def check_block_ids(name: str, block_ids: object) -> list[int]:
    """``block_ids`` as a list of ints (TypeError otherwise); whether each is known is the
    allocator's to say (KeyError)."""
    return check_int_list(name, block_ids)


def check_time(name: str, now: object) -> float:
    """An access time: a real number (TypeError for a str, None or a bool) that is finite
    (ValueError for NaN or infinity, which would break the evictor's ordering later)."""
    if isinstance(now, (bool, np.bool_)) or not isinstance(now, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a real number, got {now!r}")
    if not math.isfinite(now):
        raise ValueError(f"{name} must be finite, got {now!r}")
    return now


def rehearse(operation: Callable[[Any], object], state: Any) -> None:
    """Run ``operation`` on a deep copy of ``state`` and let any error it raises propagate.

    This is how the legacy layer stays all or nothing when blocks may run out part-way: an
    operation that might fail is first rehearsed on a copy of the table and its allocator (a
    failed eviction or copy on write cannot be undone in place), and only run for real once
    the copy got through. Callers rehearse only when a cheap bound says blocks could run short.
    """
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 100_000))   # deepcopy recurses along prev_block chains
    try:
        operation(copy.deepcopy(state))
    finally:
        sys.setrecursionlimit(limit)


# --------------------------------------------------------------------------------------------
# Reference counts
# --------------------------------------------------------------------------------------------

class RefCounter:
    """How many holders each physical block id has; every id starts at 0 (free)."""

    def __init__(self, all_block_indices: Iterable[BlockId]):
        self._refcounts: dict[BlockId, int] = {index: 0 for index in dict.fromkeys(all_block_indices)}

    def _count(self, block_id: BlockId) -> int:
        try:
            return self._refcounts[block_id]
        except KeyError:
            raise UnknownBlockIdError(block_id) from None

    def incr(self, block_id: BlockId) -> int:
        count = self._count(block_id)
        if count < 0:                       # unreachable through decr; kept as vLLM's guard
            raise BlockStateError(f"block {block_id} has a negative reference count {count}")
        self._refcounts[block_id] = count + 1
        return count + 1

    def decr(self, block_id: BlockId) -> int:
        count = self._count(block_id)
        if count <= 0:
            raise BlockStateError(f"block {block_id} is already free (reference count 0): freed twice?")
        self._refcounts[block_id] = count - 1
        return count - 1

    def get(self, block_id: BlockId) -> int:
        return self._count(block_id)

    def as_readonly(self) -> ReadOnlyRefCounter:
        return ReadOnlyRefCounter(self)


class ReadOnlyRefCounter:
    """A view others may read (the copy-on-write tracker, callers) but not change."""

    def __init__(self, refcounter: RefCounter):
        self._refcounter = refcounter

    def incr(self, block_id: BlockId) -> int:
        raise ValueError("Incr not allowed")

    def decr(self, block_id: BlockId) -> int:
        raise ValueError("Decr not allowed")

    def get(self, block_id: BlockId) -> int:
        return self._refcounter.get(block_id)


# --------------------------------------------------------------------------------------------
# Copy on write
# --------------------------------------------------------------------------------------------

class CopyOnWriteTracker:
    """Decides whether a block may be written in place, and logs the (src, dst) copies made
    when it may not; the scheduler later hands the log to ``copy_blocks``."""

    def __init__(self, refcounter: RefCounter | ReadOnlyRefCounter):
        self._copy_on_writes: list[tuple[BlockId, BlockId]] = []
        self._refcounter = refcounter

    def is_appendable(self, block: Block) -> bool:
        """A block with no physical id yet, or held by one sequence only, can take new tokens."""
        block_id = block.block_id
        return block_id is None or self._refcounter.get(block_id) <= 1

    def record_cow(self, src_block_id: BlockId | None, trg_block_id: BlockId | None) -> None:
        if src_block_id is None or trg_block_id is None:
            raise BlockStateError(f"a copy-on-write needs two block ids, got {src_block_id} -> {trg_block_id}")
        self._copy_on_writes.append((src_block_id, trg_block_id))

    def clear_cows(self) -> list[tuple[BlockId, BlockId]]:
        """The pairs recorded so far, in order (duplicates kept); the log starts empty again."""
        cows, self._copy_on_writes = self._copy_on_writes, []
        return cows


# --------------------------------------------------------------------------------------------
# A pool of block objects
# --------------------------------------------------------------------------------------------

class BlockPool:
    """Block objects made once and re-initialised on reuse, to spare the garbage collector.

    Free pool slots are a deque: a new block takes the leftmost, a freed one goes back on the
    left, so the most recently freed object is reused first. When none is free the pool doubles.

    Every object remembers the pool that made it (``_home_pool``) and goes back there whichever
    allocator frees it: a block swapped to another device is freed by that device's allocator,
    and its pool slot number means nothing in that allocator's pool (putting it there handed a
    live object out twice, or an index past the pool's end).
    """

    def __init__(self, block_size: int, create_block: Block.Factory, allocator: BlockAllocator, pool_size: int):
        if pool_size < 0:
            raise ValueError(f"pool_size must be >= 0, got {pool_size}")
        self._block_size = block_size
        self._create_block = create_block
        self._allocator = allocator
        self._pool_size = pool_size
        self._free_ids: deque[int] = deque(range(pool_size))
        self._pool = [self._new_object() for _ in range(pool_size)]

    def _new_object(self) -> Block:
        block = self._create_block(prev_block=None, token_ids=[], block_size=self._block_size,
                                   allocator=self._allocator, block_id=None, extra_hash=None)
        block._home_pool = self
        return block

    def increase_pool(self) -> None:
        """Double the pool (a pool of 0 grows to 1)."""
        new_size = max(1, 2 * self._pool_size)
        self._pool.extend(self._new_object() for _ in range(self._pool_size, new_size))
        self._free_ids.extend(range(self._pool_size, new_size))
        self._pool_size = new_size

    def init_block(self, prev_block: Block | None, token_ids: list[int], block_size: int,
                   physical_block_id: BlockId | None, extra_hash: int | None = None) -> Block:
        if not self._free_ids:
            self.increase_pool()
        pool_id = self._free_ids.popleft()
        block = self._pool[pool_id]
        # Re-run the constructor on the existing object, for this pool's allocator (a swap may
        # have bound the object to another device's allocator while it was in use).
        try:
            block.__init__(prev_block=prev_block, token_ids=token_ids, block_size=block_size,
                           allocator=self._allocator, block_id=physical_block_id, extra_hash=extra_hash)
        except Exception:
            self._free_ids.appendleft(pool_id)       # bad arguments: the object stays free
            raise
        block.pool_id = pool_id
        return block

    def free_block(self, block: Block) -> None:
        """Give the object back to the pool that made it (an object no pool made is left alone)."""
        home = getattr(block, "_home_pool", None)
        if home is not None:
            home._free_ids.appendleft(block.pool_id)


# --------------------------------------------------------------------------------------------
# A list of blocks with their ids
# --------------------------------------------------------------------------------------------

class BlockList:
    """A sequence's blocks and, alongside, their physical ids (what the kernels' block table
    needs), kept in step when an append moves a block to a new id (copy on write, promotion)."""

    def __init__(self, blocks: list[Block]):
        self._blocks: list[Block] = []
        self._block_ids: list[int] = []
        self.update(blocks)

    @staticmethod
    def _id_of(block: Block) -> int:
        if block.block_id is None:
            raise BlockStateError("a block in a BlockList must have a physical id")
        return block.block_id

    def update(self, blocks: list[Block]) -> None:
        ids = [self._id_of(b) for b in blocks]          # check all before changing anything
        self._blocks = blocks
        # A new list: one a caller fetched before (say, the ids before a swap) keeps its ids.
        self._block_ids = ids

    def append_token_ids(self, block_index: int, token_ids: list[int]) -> None:
        block = self._blocks[block_index]
        prev_block_id = block.block_id
        block.append_token_ids(token_ids)
        if prev_block_id != block.block_id:              # moved by copy on write or promotion
            self._block_ids[block_index] = block.block_id

    def append(self, new_block: Block) -> None:
        self._block_ids.append(self._id_of(new_block))
        self._blocks.append(new_block)

    def __len__(self) -> int:
        return len(self._blocks)

    def __getitem__(self, block_index: int) -> Block:
        return self._blocks[block_index]

    def __setitem__(self, block_index: int, new_block: Block) -> None:
        self._block_ids[block_index] = self._id_of(new_block)
        self._blocks[block_index] = new_block

    def reset(self) -> None:
        self._blocks = []
        self._block_ids = []

    def list(self) -> list[Block]:
        return self._blocks

    def ids(self) -> list[int]:
        """The ids, as a live list: appends, copies on write and promotions change it in place;
        ``update`` and ``reset`` start a new one."""
        return self._block_ids


# --------------------------------------------------------------------------------------------
# Prefix-cache hit rate
# --------------------------------------------------------------------------------------------

@dataclass
class CacheMetricData:
    """A running hit ratio over every prefix-cache query since the last reset.

    Queries are counted in buckets of ``block_size`` (1000; a bucket of queries, not a KV block)
    so that the running mean stays exact without keeping one big counter: a completed bucket
    folds its rate into ``completed_block_cache_hit_rate``.
    """

    num_completed_blocks: int = 0
    completed_block_cache_hit_rate: float = 0.0
    num_incompleted_block_queries: int = 0
    num_incompleted_block_hit: int = 0
    block_size: int = 1000

    def query(self, hit: bool) -> None:
        self.num_incompleted_block_queries += 1
        if hit:
            self.num_incompleted_block_hit += 1
        if self.num_incompleted_block_queries == self.block_size:
            bucket_rate = self.num_incompleted_block_hit / self.block_size
            n = self.num_completed_blocks
            self.completed_block_cache_hit_rate = (self.completed_block_cache_hit_rate * n + bucket_rate) / (n + 1)
            self.num_incompleted_block_queries = 0
            self.num_incompleted_block_hit = 0
            self.num_completed_blocks += 1

    def get_hit_rate(self) -> float:
        partial = self.num_incompleted_block_queries / self.block_size   # a fraction of a bucket
        total = self.num_completed_blocks + partial
        if total == 0:
            return 0.0
        completed = (self.completed_block_cache_hit_rate * self.num_completed_blocks
                     if self.num_completed_blocks > 0 else 0.0)
        incomplete = (self.num_incompleted_block_hit / self.num_incompleted_block_queries * partial
                      if self.num_incompleted_block_queries > 0 else 0.0)
        return (completed + incomplete) / total


def get_all_blocks_recursively(last_block: Block) -> list[Block]:
    """The chain ending at ``last_block``, first block first (following ``prev_block``)."""
    chain = []
    block: Block | None = last_block
    while block is not None:
        chain.append(block)
        block = block.prev_block
    chain.reverse()
    return chain
