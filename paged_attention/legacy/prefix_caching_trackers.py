"""What the block manager tracks per sequence under prefix caching (from vLLM's
``vllm/core/block/prefix_caching_block.py``).

* ``ComputedBlocksTracker``: how many leading tokens of each sequence are already in the prefix
  cache, found by hashing the sequence's full blocks as the blocks themselves would be hashed.
* ``LastAccessBlocksTracker``: when each sequence last ran, stamped on its blocks when it is
  freed, for the evictor's least-recently-used order.
"""
from __future__ import annotations

from typing import Optional

from paged_attention.legacy.common import check_time
from paged_attention.legacy.prefix_caching_hash import NONE_HASH, hash_block_tokens

__all__ = ["ComputedBlocksTracker", "LastAccessBlocksTracker"]


class ComputedBlocksTracker:
    """How many leading tokens of each sequence are already in the prefix cache.

    It hashes each sequence's full blocks from its raw token ids (as the blocks themselves
    would) and asks the allocator for the longest cached, computed prefix. The count is kept
    during a prefill, so chunks of one prompt see a stable number.
    """

    def __init__(self, allocator, block_size: int, enable_caching: bool):
        self._allocator = allocator
        self._block_size = block_size
        self._enable_caching = enable_caching
        self._seq_id_to_blocks_hashes: dict[int, list[int]] = {}
        self._seq_id_to_num_tokens_computed: dict[int, int] = {}

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._seq_id_to_blocks_hashes

    def _update_seq_hashes(self, seq) -> None:
        """Hash the sequence's full blocks not hashed yet, chaining from the last one."""
        block_hashes = self._seq_id_to_blocks_hashes.setdefault(seq.seq_id, [])
        token_ids = seq.get_token_ids()
        if len(token_ids) < len(block_hashes) * self._block_size:
            raise ValueError(f"sequence {seq.seq_id} has fewer tokens than its blocks already hashed")
        prev_block_hash = block_hashes[-1] if block_hashes else NONE_HASH
        for start in range(len(block_hashes) * self._block_size,
                           len(token_ids) // self._block_size * self._block_size, self._block_size):
            prev_block_hash = hash_block_tokens(
                is_first_block=prev_block_hash == NONE_HASH, prev_block_hash=prev_block_hash,
                cur_block_token_ids=token_ids[start:start + self._block_size], extra_hash=seq.extra_hash())
            block_hashes.append(prev_block_hash)

    def get_num_cached_tokens(self, seq) -> int:
        if not self._enable_caching:
            return 0
        self._update_seq_hashes(seq)
        num_computed_tokens_prev = self._seq_id_to_num_tokens_computed.get(seq.seq_id)
        if num_computed_tokens_prev is not None and seq.is_prefill():
            return num_computed_tokens_prev          # stable across the chunks of a prefill
        block_hashes = self._seq_id_to_blocks_hashes[seq.seq_id]
        num_cached_blocks = len(self._allocator.find_cached_blocks_prefix(block_hashes))
        num_cached_tokens = num_cached_blocks * self._block_size
        self._seq_id_to_num_tokens_computed[seq.seq_id] = num_cached_tokens
        return num_cached_tokens

    def forget_num_cached_tokens(self, seq_id: int) -> None:
        """Drop the stored count, so the next ``get_num_cached_tokens`` looks at the cache again.

        The block manager calls it when a sequence is allocated: a count taken while the
        request waited may name blocks evicted since (vLLM keeps it, and the prefill then skips
        KV that is not there).
        """
        self._seq_id_to_num_tokens_computed.pop(seq_id, None)

    def remove_seq(self, seq_id: int) -> None:
        if not self._enable_caching:
            return
        if seq_id not in self._seq_id_to_blocks_hashes:
            raise KeyError(f"sequence {seq_id} is not tracked")
        del self._seq_id_to_blocks_hashes[seq_id]
        self._seq_id_to_num_tokens_computed.pop(seq_id, None)


class LastAccessBlocksTracker:
    """When each sequence last ran; its blocks are stamped with that time when it is freed."""

    def __init__(self, allocator):
        self._allocator = allocator
        self._seq_last_access: dict[int, Optional[float]] = {}

    def _known(self, seq_id: int) -> None:
        if seq_id not in self._seq_last_access:
            raise KeyError(f"sequence {seq_id} is not tracked")

    def add_seq(self, seq_id: int) -> None:
        if seq_id in self._seq_last_access:
            raise ValueError(f"sequence {seq_id} is already tracked")
        self._seq_last_access[seq_id] = None

    def remove_seq(self, seq_id: int) -> None:
        self._known(seq_id)
        del self._seq_last_access[seq_id]

    def update_last_access(self, seq_id: int, time: float) -> None:
        check_time("time", time)
        self._known(seq_id)
        self._seq_last_access[seq_id] = time

    def update_seq_blocks_last_access(self, seq_id: int, block_ids: list[int]) -> None:
        self._known(seq_id)
        ts = self._seq_last_access[seq_id]
        if ts is None:
            return
        self._allocator.mark_blocks_as_accessed(block_ids, ts)
