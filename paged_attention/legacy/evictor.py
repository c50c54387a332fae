"""Which cached block to give up when the pool is full (vLLM's ``vllm/core/evictor.py``).

A prefix-cached block that nobody holds any more is not wiped: it waits in the evictor, still
findable by its hash, until an allocation needs its physical id. The LRU evictor gives up the
block used longest ago; among blocks used at the same time, the one ending the longest prefix
(the tail of a chain goes before its head), then the lowest id, then the lowest hash.
"""
from __future__ import annotations

import enum
import heapq
from dataclasses import dataclass

from paged_attention.legacy.common import UnknownBlockIdError, check_time
from paged_attention.legacy.interfaces import BlockId


class EvictionPolicy(enum.Enum):
    LRU = enum.auto()


@dataclass
class BlockMetaData:
    """What the evictor knows of a waiting block."""

    content_hash: int
    num_hashed_tokens: int
    last_accessed: float


class LRUEvictor:
    """Least-recently-used eviction over a table of waiting blocks and a heap of candidates.

    The heap holds ``(last_accessed, -num_hashed_tokens, block_id, content_hash)``, so popping
    it yields the eviction order directly. Entries are never removed from the middle of the
    heap: ``remove`` and ``update`` only change the table, and an entry that no longer matches
    its table row is stale and skipped when popped. When stale entries outnumber live ones
    ``CLEANUP_THRESHOLD`` to one, the heap is rebuilt from the table.

    vLLM's ``update`` pushes no new entry, which leaves an updated block unevictable until the
    next rebuild (``evict`` can then fail with blocks still waiting). Here ``update`` pushes the
    new entry, so a waiting block is always evictable.
    """

    CLEANUP_THRESHOLD = 50

    def __init__(self):
        self.free_table: dict[BlockId, BlockMetaData] = {}
        self.priority_queue: list[tuple[float, int, BlockId, int]] = []

    def __contains__(self, block_id: BlockId) -> bool:
        return block_id in self.free_table

    @property
    def num_blocks(self) -> int:
        return len(self.free_table)

    def eviction_order(self) -> list[BlockId]:
        """The waiting ids, first to be evicted first: the order ``evict`` gives them up in."""
        return sorted(self.free_table, key=lambda block_id: self._entry(block_id, self.free_table[block_id]))

    @staticmethod
    def _entry(block_id: BlockId, meta: BlockMetaData) -> tuple[float, int, BlockId, int]:
        return (meta.last_accessed, -meta.num_hashed_tokens, block_id, meta.content_hash)

    def add(self, block_id: BlockId, content_hash: int, num_hashed_tokens: int, last_accessed: float) -> None:
        """Park a block (its time is checked here: a str or NaN in the heap breaks every later
        push and pop)."""
        check_time("last_accessed", last_accessed)
        meta = BlockMetaData(content_hash, num_hashed_tokens, last_accessed)
        self.free_table[block_id] = meta
        heapq.heappush(self.priority_queue, self._entry(block_id, meta))
        self._cleanup_if_necessary()

    def evict(self) -> tuple[BlockId, int]:
        """Remove and return ``(block_id, content_hash)`` of the block to give up."""
        while self.priority_queue:
            entry = heapq.heappop(self.priority_queue)
            block_id = entry[2]
            meta = self.free_table.get(block_id)
            if meta is not None and self._entry(block_id, meta) == entry:   # live, not stale
                del self.free_table[block_id]
                return block_id, meta.content_hash
        raise ValueError("No usable cache memory left")

    def update(self, block_id: BlockId, last_accessed: float) -> None:
        """Record a new access time for a waiting block (it moves back in the queue)."""
        check_time("last_accessed", last_accessed)
        if block_id not in self.free_table:
            raise UnknownBlockIdError(f"block {block_id} is not in the evictor")
        meta = self.free_table[block_id]
        meta.last_accessed = last_accessed
        heapq.heappush(self.priority_queue, self._entry(block_id, meta))
        self._cleanup_if_necessary()

    def remove(self, block_id: BlockId) -> None:
        """Take a block out of the evictor (it is being reused by its hash)."""
        if block_id not in self.free_table:
            raise ValueError("Attempting to remove block that's not in the evictor")
        del self.free_table[block_id]

    def _cleanup_if_necessary(self) -> None:
        if len(self.priority_queue) > self.CLEANUP_THRESHOLD * len(self.free_table):
            self.priority_queue = [self._entry(i, meta) for i, meta in self.free_table.items()]
            heapq.heapify(self.priority_queue)


Evictor = LRUEvictor


def make_evictor(eviction_policy: EvictionPolicy) -> LRUEvictor:
    if eviction_policy == EvictionPolicy.LRU:
        return LRUEvictor()
    raise ValueError(f"Unknown cache eviction policy: {eviction_policy}")
