"""One KV-cache group's blocks per request: full attention, or a sliding window.

A ``SingleTypeKVCacheManager`` keeps ``req_to_blocks`` (each request's block list, the table
the worker will see for this group) and ``num_cached_block`` (how many of them are cached),
and knows what its attention type needs:

- full attention keeps every block until the request ends, and a prefix hit is the longest run
  of cached blocks from the start;
- a sliding window of ``w`` tokens only reads the last ``w - 1`` tokens before the next one, so
  blocks that fall wholly behind the window are given back early and their table entries
  become the null block; a hit needs only the last ``cdiv(w - 1, block_size)`` blocks before
  the hit point to be cached, the earlier ones are null.

``find_longest_cache_hit`` is a class method: the coordinator calls it for several groups of
the same spec at once, and a hit must hold in all of them.
"""
from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

from paged_attention.kv_cache.interface import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec
from paged_attention.utils import cdiv
from paged_attention.v1.core.block_pool import BlockPool
from paged_attention.v1.core.kv_cache_utils import (
    BlockHashList,
    KVCacheBlock,
    resolve_block_hashes,
    trim_null_head,
)

if TYPE_CHECKING:
    from paged_attention.v1.core.request import Request


def replay_boundaries(num_prompt_tokens: int, scheduler_block_size: int,
                      use_eagle: bool) -> tuple[int, ...]:
    """Where a later request with the same prompt can resume: a resend hits at most the prompt
    less its last token (recomputed for its logits)."""
    if use_eagle:
        raise ValueError("EAGLE is not modelled")
    return (num_prompt_tokens - 1,)


class SingleTypeKVCacheManager:
    """The per-request block lists of one KV-cache group (the base of both types).

    ``scheduler_block_size`` is the step in which hits and chunk ends are aligned (the least
    common multiple of all groups' block sizes). ``max_admission_blocks_per_request`` caps what
    a request is asked to reserve up front (sliding windows recycle blocks; None: no cap).
    """

    supports_fine_grained_hash_lookup: ClassVar[bool] = False

    def __init__(self, kv_cache_spec: KVCacheSpec, block_pool: BlockPool, enable_caching: bool,
                 kv_cache_group_id: int, scheduler_block_size: int, dcp_world_size: int = 1,
                 pcp_world_size: int = 1, needs_kv_cache_zeroing: bool = False,
                 max_admission_blocks_per_request: int | None = None) -> None:
        if dcp_world_size != 1 or pcp_world_size != 1:
            raise ValueError("context parallelism (dcp/pcp world size > 1) is not modelled")
        self.kv_cache_spec = kv_cache_spec
        self.block_size = kv_cache_spec.block_size
        self.block_pool = block_pool
        self.enable_caching = enable_caching
        self.kv_cache_group_id = kv_cache_group_id
        self.scheduler_block_size = scheduler_block_size
        # Hits end on multiples of this (the coordinator may set it for hybrid models).
        self.cache_hit_alignment_tokens = scheduler_block_size
        self.max_admission_blocks_per_request = max_admission_blocks_per_request
        self.dcp_world_size = self.pcp_world_size = 1
        self.use_eagle = False
        self.req_to_blocks: defaultdict[str, list[KVCacheBlock]] = defaultdict(list)
        # Only for requests that have been allocated (running); a preempted request is freed.
        self.num_cached_block: dict[str, int] = {}
        self._null_block = block_pool.null_block
        self.new_block_ids: list[int] = []

    # ----------------------------------------------------------------------------------------
    # How many blocks a step needs, and taking them
    # ----------------------------------------------------------------------------------------

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence[KVCacheBlock],
                                   total_computed_tokens: int, num_local_computed_tokens: int,
                                   num_tokens_main_model: int, apply_admission_cap: bool = False,
                                   prefill_end: int = 0) -> int:
        """Blocks the pool must give for ``request_id`` to hold ``num_tokens`` tokens: the new
        ones, plus the hit blocks that are free right now (touching them takes them out of
        the free queue, so they count against it too)."""
        num_required = -(num_tokens // -self.block_size)    # cdiv, inline: called every step
        if apply_admission_cap and self.max_admission_blocks_per_request is not None:
            num_required = min(num_required, self.max_admission_blocks_per_request)
        num_held = len(self.req_to_blocks.get(request_id, ()))
        if request_id in self.num_cached_block:
            # Running already: no new hits, only growth.
            return num_required - num_held if num_required > num_held else 0
        num_skipped_blocks = self.get_num_skipped_tokens(total_computed_tokens) // self.block_size
        num_new = max(num_required - max(num_skipped_blocks, len(new_computed_blocks) + num_held),
                      0)
        # Hit blocks behind the window are replaced by the null block, not touched.
        kept = new_computed_blocks[max(0, num_skipped_blocks - num_held):]
        # (A loop, not sum() over a generator: twice per request admitted on a hit.)
        for b in kept:
            if b.ref_cnt == 0 and not b.is_null:
                num_new += 1
        return num_new

    def add_local_computed_blocks(self, request_id: str,
                                  new_computed_blocks: Sequence[KVCacheBlock],
                                  num_local_computed_tokens: int,
                                  num_external_computed_tokens: int) -> None:
        """Start ``request_id``'s list with its prefix hit: null blocks for what is already
        behind the window, then the hit blocks, touched (one more user each)."""
        req_blocks = self.req_to_blocks[request_id]
        if req_blocks:
            raise ValueError(f"request {request_id} already holds blocks in group "
                             f"{self.kv_cache_group_id}")
        total = num_local_computed_tokens + num_external_computed_tokens
        num_skipped_blocks = self.get_num_skipped_tokens(total) // self.block_size
        kept = new_computed_blocks[num_skipped_blocks:]
        if self.enable_caching:
            self.block_pool.touch(kept)
        elif any(kept):
            raise ValueError("computed blocks given with prefix caching off")
        req_blocks.extend([self._null_block] * num_skipped_blocks)
        req_blocks.extend(kept)
        # They are cached already (or null): cache_blocks must not cache them again.
        self.num_cached_block[request_id] = len(req_blocks)

    def allocate_external_computed_blocks(self, request_id: str, num_local_computed_tokens: int,
                                          num_external_computed_tokens: int,
                                          record_for_zeroing: bool = True) -> None:
        """Blocks for tokens a KV connector supplies (computed elsewhere): new blocks up to
        the computed length, inside the window."""
        total = num_local_computed_tokens + num_external_computed_tokens
        skipped = self.get_num_skipped_tokens(total)
        if skipped > 0:
            num_external_computed_tokens = min(total - skipped, num_external_computed_tokens)
        if num_external_computed_tokens <= 0:
            return
        req_blocks = self.req_to_blocks[request_id]
        num_new = max(0, cdiv(total, self.block_size) - len(req_blocks))
        req_blocks.extend(self.block_pool.get_new_blocks(num_new))

    def allocate_new_blocks(self, request_id: str, num_tokens: int,
                            num_tokens_main_model: int) -> list[KVCacheBlock]:
        """Grow ``request_id``'s list to hold ``num_tokens`` tokens; the blocks added."""
        req_blocks = self.req_to_blocks[request_id]
        num_new = -(num_tokens // -self.block_size) - len(req_blocks)   # cdiv, inline
        if num_new <= 0:
            return []   # the common case: a decode step that stays inside its last block
        new_blocks = self.block_pool.get_new_blocks(num_new)
        req_blocks.extend(new_blocks)
        return new_blocks

    def take_new_block_ids(self) -> list[int]:
        """Blocks the worker must zero (Mamba models only; none here)."""
        ids, self.new_block_ids = self.new_block_ids, []
        return ids

    # ----------------------------------------------------------------------------------------
    # Caching, freeing, the window
    # ----------------------------------------------------------------------------------------

    def cache_blocks(self, request: Request, num_tokens: int, retention_interval: int | None = None,
                     *, replay_boundaries: Sequence[int] = ()) -> None:
        """Cache the blocks of ``request`` that its first ``num_tokens`` tokens fill (those
        that have hashes and were not cached yet)."""
        rid = request.request_id
        num_cached = self.num_cached_block.get(rid, 0)
        num_hashed_tokens = len(request.block_hashes) * self.block_pool.hash_block_size
        num_full = min(num_tokens, num_hashed_tokens) // self.block_size
        if num_cached >= num_full:
            return
        self._cache_new_full_blocks(request, num_cached, num_full, retention_interval,
                                    replay_boundaries)

    def _cache_new_full_blocks(self, request: Request, num_cached: int, num_full: int,
                               retention_interval: int | None,
                               boundaries: Sequence[int] | None) -> None:
        """``cache_blocks`` once it knows there is work: cache blocks ``num_cached`` to
        ``num_full - 1`` of ``request`` (``num_cached < num_full``, the request's current
        ``num_cached_block`` entry) and record them. The coordinator calls it directly where
        it has counted the same two numbers already, with ``boundaries`` None: the request's
        replay boundaries, worked out here only if the block mask reads them."""
        if type(self).reachable_block_mask.__func__ is _BASE_REACHABLE_BLOCK_MASK:
            mask = None     # the base rule, every block reachable, known without the call
        else:
            if boundaries is None:
                boundaries = replay_boundaries(request.num_prompt_tokens,
                                               self.scheduler_block_size, use_eagle=False)
            mask = self.reachable_block_mask(num_cached, num_full,
                                             self.cache_hit_alignment_tokens,
                                             self.kv_cache_spec, self.use_eagle,
                                             retention_interval, boundaries)
        rid = request.request_id
        self.block_pool.cache_full_blocks(request, self.req_to_blocks[rid], num_cached, num_full,
                                          self.block_size, self.kv_cache_group_id, mask)
        self.num_cached_block[rid] = num_full

    @classmethod
    def reachable_block_mask(cls, start_block: int, end_block: int, alignment_tokens: int | None,
                             kv_cache_spec: KVCacheSpec, use_eagle: bool,
                             retention_interval: int | None = None,
                             reachable_boundaries: Sequence[int] = ()) -> list[bool] | None:
        """Which of blocks ``start_block..end_block`` a future hit could use (None: all)."""
        return None

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        """Forget ``request_id`` here; its blocks in table order, leading null blocks dropped
        (the caller frees them, tail first)."""
        blocks = self.req_to_blocks.pop(request_id, [])
        self.num_cached_block.pop(request_id, None)
        return list(trim_null_head(blocks))

    def free(self, request_id: str) -> None:
        """Give ``request_id``'s blocks back, last block first: with equal standing, the tail
        of a prompt is evicted before its head, which more requests are likely to share."""
        # pop_blocks_for_free without its copy: free_blocks skips the null blocks itself (and
        # takes a list as it is: the reversed copy is made here, in one C call).
        blocks = self.req_to_blocks.pop(request_id, None)
        self.num_cached_block.pop(request_id, None)
        if blocks:
            self.block_pool.free_blocks(blocks[::-1])

    def _remove_blocks_in_range(self, request_id: str, first_block: int, last_block: int) -> None:
        """Give back the blocks ``first_block..last_block-1`` and put the null block in their
        place, from the end backwards, stopping at the first null (the rest went before)."""
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None or first_block >= last_block:
            return
        freed = []
        for i in range(min(last_block, len(blocks)) - 1, first_block - 1, -1):
            if blocks[i] is self._null_block:
                break
            freed.append(blocks[i])
            blocks[i] = self._null_block
        if freed:
            self.block_pool.free_blocks(freed)

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        """Give back the blocks no attention reads any more, once ``processed_computed_tokens``
        tokens are computed (for full attention: none)."""
        skipped = self.get_num_skipped_tokens(processed_computed_tokens)
        if skipped <= 0:
            return
        blocks = self.req_to_blocks[request_id]
        self._remove_blocks_in_range(request_id, 0, min(skipped // self.block_size, len(blocks)))

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Tokens the next token's attention does not read (full attention: 0)."""
        return 0

    def new_step_starts(self) -> None:
        return None

    @classmethod
    def find_longest_cache_hit(cls, block_hashes: BlockHashList, max_length: int,
                               kv_cache_group_ids: list[int], block_pool: BlockPool,
                               kv_cache_spec: KVCacheSpec, drop_eagle_block: bool,
                               alignment_tokens: int, dcp_world_size: int = 1,
                               pcp_world_size: int = 1,
                               ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """The longest prefix of at most ``max_length`` tokens cached in every group of
        ``kv_cache_group_ids``, a multiple of ``alignment_tokens``: (its blocks per group,
        its length in tokens)."""
        raise NotImplementedError


_BASE_REACHABLE_BLOCK_MASK = SingleTypeKVCacheManager.reachable_block_mask.__func__


class FullAttentionManager(SingleTypeKVCacheManager):
    """Full attention: every block is kept until the request ends."""

    @classmethod
    def find_longest_cache_hit(cls, block_hashes: BlockHashList, max_length: int,
                               kv_cache_group_ids: list[int], block_pool: BlockPool,
                               kv_cache_spec: KVCacheSpec, drop_eagle_block: bool,
                               alignment_tokens: int, dcp_world_size: int = 1,
                               pcp_world_size: int = 1,
                               ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """Scan from the first block while blocks are cached: hashes are chained, so after the
        first miss nothing can hit. Then round down to ``alignment_tokens``."""
        if drop_eagle_block:
            raise ValueError("EAGLE's dropped block is not modelled")
        block_size = kv_cache_spec.block_size
        hashes = resolve_block_hashes(block_hashes, block_pool.hash_block_size, block_size)
        computed: tuple[list[KVCacheBlock], ...] = tuple([] for _ in kv_cache_group_ids)
        for block_hash in itertools.islice(hashes, max_length // block_size):
            cached = block_pool.get_cached_block(block_hash, kv_cache_group_ids)
            if cached is None:
                break
            for blocks, block in zip(computed, cached):
                blocks.append(block)
        hit_length = len(computed[0]) * block_size
        hit_length -= hit_length % alignment_tokens
        for blocks in computed:
            del blocks[cdiv(hit_length, block_size):]
        return computed, hit_length

    def cache_blocks(self, request: Request, num_tokens: int, retention_interval: int | None = None,
                     *, replay_boundaries: Sequence[int] = ()) -> None:
        """As for any group; and where this group's blocks are coarser than the hashes, the
        prompt's last hash boundary inside a block is cached too (a partial entry)."""
        super().cache_blocks(request, num_tokens, retention_interval,
                             replay_boundaries=replay_boundaries)
        if self.block_size != self.block_pool.hash_block_size:
            self._cache_partial_tail_block(request, num_tokens)

    def _cache_partial_tail_block(self, request: Request, num_tokens: int) -> None:
        hash_block_size = self.block_pool.hash_block_size
        # A resend of the same prompt can hit at most num_prompt_tokens - 1 tokens.
        boundary = min((request.num_prompt_tokens - 1) // hash_block_size,
                       len(request.block_hashes)) * hash_block_size
        if boundary == 0 or boundary > num_tokens or boundary % self.block_size == 0:
            return
        blocks = self.req_to_blocks[request.request_id]
        index = boundary // self.block_size
        if index < len(blocks):
            self.block_pool.cache_partial_block(request, blocks[index], boundary,
                                                self.kv_cache_group_id, self.block_size)


class SlidingWindowManager(SingleTypeKVCacheManager):
    """A sliding window: blocks behind the window are given back and become the null block."""

    def __init__(self, kv_cache_spec: SlidingWindowSpec, **kwargs) -> None:
        super().__init__(kv_cache_spec, **kwargs)
        self.sliding_window = kv_cache_spec.sliding_window

    @classmethod
    def _contiguous_blocks_for_hit(cls, window_size: int, block_size: int,
                                   use_eagle: bool) -> int:
        # The next token reads the window_size - 1 tokens before it.
        return cdiv(window_size - 1, block_size) + (1 if use_eagle else 0)

    @classmethod
    def find_longest_cache_hit(cls, block_hashes: BlockHashList, max_length: int,
                               kv_cache_group_ids: list[int], block_pool: BlockPool,
                               kv_cache_spec: KVCacheSpec, drop_eagle_block: bool,
                               alignment_tokens: int, dcp_world_size: int = 1,
                               pcp_world_size: int = 1,
                               ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """Scan from the right for the first run of enough cached blocks to fill the window,
        ending on an aligned boundary; everything before the run is the null block. Without
        such a run, a run that starts at block 0 is a (short) hit too."""
        if drop_eagle_block:
            raise ValueError("EAGLE's dropped block is not modelled")
        if not isinstance(kv_cache_spec, SlidingWindowSpec):
            raise TypeError(f"a sliding-window spec is needed, got {kv_cache_spec!r}")
        block_size = kv_cache_spec.block_size
        hashes = resolve_block_hashes(block_hashes, block_pool.hash_block_size, block_size)
        need = cls._contiguous_blocks_for_hit(kv_cache_spec.sliding_window, block_size, False)
        max_num_blocks = max_length // block_size
        null = block_pool.null_block
        computed = tuple([null] * max_num_blocks for _ in kv_cache_group_ids)
        run = 0
        found = False
        for i in range(max_num_blocks - 1, -1, -1):
            cached = block_pool.get_cached_block(hashes[i], kv_cache_group_ids)
            if cached is None:
                run = 0
                continue
            # The run's right end must sit on an aligned boundary.
            if run == 0 and ((i + 1) * block_size) % alignment_tokens:
                continue
            for blocks, block in zip(computed, cached):
                blocks[i] = block
            run += 1
            if run >= need:
                for blocks in computed:
                    del blocks[i + run:]
                found = True
                break
        if not found:
            # Only a run from the very start counts (there is nothing before it to miss).
            for blocks in computed:
                del blocks[run:]
            while len(computed[0]) * block_size % alignment_tokens:
                for blocks in computed:
                    blocks.pop()
        return computed, len(computed[0]) * block_size

    @classmethod
    def reachable_block_mask(cls, start_block: int, end_block: int, alignment_tokens: int | None,
                             kv_cache_spec: KVCacheSpec, use_eagle: bool,
                             retention_interval: int | None = None,
                             reachable_boundaries: Sequence[int] = ()) -> list[bool] | None:
        """With hits aligned to ``alignment_tokens`` (several of this group's blocks), only the
        last ``need`` blocks before each aligned boundary can be part of a hit: the others are
        not cached at all."""
        if retention_interval is not None:
            raise ValueError("a prefix-cache retention interval is not modelled")
        if alignment_tokens is None or alignment_tokens % kv_cache_spec.block_size:
            return None
        per_segment = alignment_tokens // kv_cache_spec.block_size
        need = cls._contiguous_blocks_for_hit(kv_cache_spec.sliding_window,
                                              kv_cache_spec.block_size, use_eagle)
        if need >= per_segment:
            return None
        return [i % per_segment >= per_segment - need for i in range(start_block, end_block)]

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """With ``n`` tokens computed, token ``n`` reads tokens ``n - w + 1 .. n``: the first
        ``n - w + 1`` are behind the window. (w = 4, n = 7: tokens 0..3 are skipped.)"""
        return max(0, num_computed_tokens - self.sliding_window + 1)


def sliding_window_admission_cap(spec: SlidingWindowSpec, max_in_flight_tokens: int,
                                 max_model_len: int) -> int:
    """The most blocks a sliding-window request holds at once: the window's ``w - 1`` tokens
    plus the tokens in flight (capped by the model length), plus one, because the window need
    not start on a block boundary."""
    return cdiv(min(spec.sliding_window - 1 + max_in_flight_tokens, max_model_len),
                spec.block_size) + 1


def get_manager_for_kv_cache_spec(kv_cache_spec: KVCacheSpec, max_in_flight_tokens: int,
                                  max_model_len: int, role: str | None = None,
                                  **kwargs) -> SingleTypeKVCacheManager:
    """The manager for a spec: sliding window or full attention (a full-attention spec that
    records a window is full attention to the manager: it keeps every block)."""
    if isinstance(kv_cache_spec, SlidingWindowSpec):
        cap = sliding_window_admission_cap(kv_cache_spec, max_in_flight_tokens, max_model_len)
        return SlidingWindowManager(kv_cache_spec, max_admission_blocks_per_request=cap,
                                    **kwargs)
    if isinstance(kv_cache_spec, FullAttentionSpec):
        if kv_cache_spec.attention_chunk_size is not None:
            raise ValueError("chunked local attention is not modelled")
        return FullAttentionManager(kv_cache_spec, **kwargs)
    raise TypeError(f"no manager for {type(kv_cache_spec).__name__} (full attention and sliding "
                    "window are modelled)")
