"""``KVCacheManager``: what the scheduler asks of the KV cache, and nothing else.

Three questions a step asks for each request, in this order:

1. ``get_computed_blocks(request)``: which of its prompt's blocks are cached already (a prefix
   hit), and how many tokens they hold. At most ``num_tokens - 1``: the last token is always
   computed, its logits are needed to sample the next one.
2. ``allocate_slots(request, num_new_tokens, num_new_computed_tokens, new_computed_blocks)``:
   room for this step's tokens. The hit blocks join the request's table, new blocks are taken
   from the pool, and the blocks this step fills are cached. ``None`` if the pool is short: then
   nothing has changed, and the scheduler preempts someone or waits.
3. ``free(request)``: the request is done (or preempted); its blocks go back, tail first.

The block ids per KV-cache group (``get_block_ids``) are what the worker's block tables hold.
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from paged_attention.kv_cache.interface import KVCacheConfig
from paged_attention.utils import cdiv, is_int
from paged_attention.v1.core.kv_cache_coordinator import (
    UnitaryKVCacheCoordinator,
    get_kv_cache_coordinator,
)
from paged_attention.v1.core.kv_cache_utils import (
    KVCacheBlock,
    make_block_hash_with_group_id,
    trim_null_head,
)
from paged_attention.v1.core.request import Request, RequestStatus
from paged_attention.v1.core.single_type_kv_cache_manager import FullAttentionManager


# A request in one of these states is being admitted: the watermark applies to it.
_ADMITTING = (RequestStatus.WAITING, RequestStatus.PREEMPTED)
_NOT_TAKEN = object()   # a fast path's "not my case" (None already means "no room")
_ZERO = 0               # compared by identity in allocate_slots' first test


def _check_counts(**counts: object) -> None:
    """Each count must be an int >= 0 (a ValueError naming the first that is not)."""
    for name, value in counts.items():
        if not is_int(value) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")


@dataclass
class PrefixCacheStats:
    """Prefix-cache hits since the last report: requests looked up, tokens asked for (queries)
    and found (hits); requests resumed after a preemption are counted apart. ``reset``: the
    cache was reset meanwhile."""

    reset: bool = False
    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0
    hits_by_source: dict = field(default_factory=dict)

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits


@dataclass(slots=True)     # one per request given blocks (at a block boundary, every one)
class KVCacheBlocks:
    """Blocks per KV-cache group (``blocks[group][i]``), as the manager hands them out: the
    scheduler sees blocks, never the pool."""

    blocks: tuple[Sequence[KVCacheBlock], ...]

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        return KVCacheBlocks(tuple(list(itertools.chain(a, b))
                                   for a, b in zip(self.blocks, other.blocks)))

    def get_block_ids(self, allow_none: bool = False, *,
                      group_ids: Sequence[int] | None = None) -> tuple[list[int], ...] | None:
        """One list of block ids per group (None, with ``allow_none``, if all are empty)."""
        groups = self.blocks if group_ids is None else tuple(self.blocks[g] for g in group_ids)
        if len(groups) == 1:
            # One group (most models): the same answer without any() and the outer loop, for
            # each request given a block (at a block boundary, every running request).
            group = groups[0]
            if allow_none and not group:
                return None
            return ([b.block_id for b in group],)
        if allow_none and not any(groups):
            return None
        # (Lists built in a comprehension, not a generator fed to tuple(): this runs for each
        # request given a block, at a block boundary every running request.)
        return tuple([[b.block_id for b in g] for g in groups])

    def get_unhashed_block_ids(self) -> list[int]:
        """Ids of the one group's blocks that are not cached."""
        if len(self.blocks) != 1:
            raise ValueError("get_unhashed_block_ids needs exactly one group")
        return [b.block_id for b in self.blocks[0] if b.block_hash is None]

    def get_unhashed_block_ids_all_groups(self) -> list[list[int]]:
        return [[b.block_id for b in trim_null_head(g) if b.block_hash is None and not b.is_null]
                for g in self.blocks]

    def new_empty(self) -> KVCacheBlocks:
        return KVCacheBlocks(tuple(() for _ in self.blocks))


class KVCacheManager:
    """The KV cache of one model, as the scheduler sees it.

    ``scheduler_block_size``: hits and cached lengths are multiples of it (the least common
    multiple of the groups' block sizes); ``hash_block_size``: how often block hashes are
    taken (the requests' hasher must use it). ``max_in_flight_tokens`` bounds what a
    sliding-window request reserves at admission. ``watermark``: the fraction of blocks kept
    free when admitting a waiting request while others run, so that the running ones can grow.
    Speculative decoding, context parallelism, KV events and connectors are not modelled (their
    arguments must keep their defaults).
    """

    def __init__(self, kv_cache_config: KVCacheConfig, max_model_len: int,
                 scheduler_block_size: int, hash_block_size: int,
                 max_in_flight_tokens: int | None = None, enable_caching: bool = True,
                 use_eagle: bool = False, num_hash_lookahead_tokens: int = 0,
                 num_prefill_lookahead: int = 0, log_stats: bool = False,
                 enable_kv_cache_events: bool = False, dcp_world_size: int = 1,
                 pcp_world_size: int = 1, metrics_collector: object = None,
                 watermark: float = 0.0,
                 enable_mamba_shared_prefix_checkpoint: bool = False) -> None:
        if not isinstance(kv_cache_config, KVCacheConfig):
            raise TypeError(f"kv_cache_config must be a KVCacheConfig, got {kv_cache_config!r}")
        kv_cache_config.validate()
        for name, value in (("max_model_len", max_model_len),
                            ("scheduler_block_size", scheduler_block_size),
                            ("hash_block_size", hash_block_size)):
            if not is_int(value) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark!r}")
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.enable_kv_cache_events = enable_kv_cache_events
        self.use_eagle = use_eagle
        self.log_stats = log_stats
        self.prefix_cache_stats = PrefixCacheStats() if log_stats else None
        self.coordinator = get_kv_cache_coordinator(
            kv_cache_config=kv_cache_config, max_model_len=max_model_len,
            max_in_flight_tokens=max_model_len if max_in_flight_tokens is None
            else max_in_flight_tokens,
            use_eagle=use_eagle, enable_caching=enable_caching,
            enable_kv_cache_events=enable_kv_cache_events, dcp_world_size=dcp_world_size,
            pcp_world_size=pcp_world_size, scheduler_block_size=scheduler_block_size,
            hash_block_size=hash_block_size, metrics_collector=metrics_collector,
            num_hash_lookahead_tokens=num_hash_lookahead_tokens,
            num_prefill_lookahead=num_prefill_lookahead)
        self.mamba_shared_prefix_checkpoint = False
        self.num_kv_cache_groups = len(kv_cache_config.kv_cache_groups)
        self.block_pool = self.coordinator.block_pool
        self.kv_cache_config = kv_cache_config
        self.watermark_blocks = int(watermark * kv_cache_config.num_blocks)
        self._running_fast_path: bool | None = None  # see _allocate_running_full_attention
        self._hash_block_size = self.block_pool.hash_block_size     # (read there per request)
        # (group 0's key suffix, block size) where get_computed_blocks may answer a miss on
        # the first block itself: one plain full-attention group, caching on.
        managers = self.coordinator.single_type_managers
        self._first_block_probe = (
            (make_block_hash_with_group_id(b"", 0), managers[0].block_size)
            if type(self.coordinator) is UnitaryKVCacheCoordinator
            and type(managers[0]) is FullAttentionManager
            and managers[0].block_size == self.block_pool.hash_block_size else None)
        # Shared, immutable "no blocks" answer (tuples): saves building one per request.
        self.empty_kv_cache_blocks = KVCacheBlocks(tuple(() for _ in
                                                         range(self.num_kv_cache_groups)))

    @property
    def usage(self) -> float:
        """The fraction of blocks in use (0.0 to 1.0)."""
        return self.block_pool.get_usage()

    # ----------------------------------------------------------------------------------------
    # Prefix-cache statistics
    # ----------------------------------------------------------------------------------------

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """The statistics since the last call (and start new ones); None without log_stats."""
        if not self.log_stats:
            return None
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    def prefix_cache_lookup_enabled(self, request: Request) -> bool:
        return self.enable_caching and not request.skip_reading_prefix_cache

    def record_prefix_cache_stats(self, request: Request, num_hits: int) -> None:
        """Count one lookup of ``request`` that found ``num_hits`` tokens (the scheduler calls
        this once the request is admitted)."""
        if self.log_stats and self.prefix_cache_lookup_enabled(request):
            self.prefix_cache_stats.record(request.num_tokens, num_hits,
                                           preempted=request.num_preemptions > 0)

    # ----------------------------------------------------------------------------------------
    # The three questions
    # ----------------------------------------------------------------------------------------

    def get_computed_blocks(self, request: Request, max_cache_hit_length: int | None = None,
                            ) -> tuple[KVCacheBlocks, int, int]:
        """``(hit blocks per group, hit tokens, shared-prefix boundary)``.

        The hit is at most ``request.num_tokens - 1`` tokens (the last one must be computed
        for its logits), which may cost a whole block of recomputation. The boundary is 0
        unless a hybrid model's full-attention group cached a longer prefix than a sliding
        window group: then it is where that longer prefix ends. Nothing is touched here: the
        blocks become the request's in ``allocate_slots``.
        """
        if not self.prefix_cache_lookup_enabled(request):
            return self.empty_kv_cache_blocks, 0, 0
        if max_cache_hit_length is None:
            max_cache_hit_length = request.num_tokens - 1
        probe = self._first_block_probe
        if probe is not None:
            # One full-attention group whose hashes are its blocks: the scan starts at the
            # first block and stops at the first miss, so if the first block's key is not in
            # the map (each key there names a block) the answer is "no hit", as below.
            hashes = request.block_hashes
            group_suffix, block_size = probe
            if (type(hashes) is list and hashes and type(max_cache_hit_length) is int
                    and max_cache_hit_length >= block_size
                    and hashes[0] + group_suffix
                    not in self.block_pool.cached_block_hash_to_block._cache):
                return self.empty_kv_cache_blocks, 0, 0
        blocks, num_hits, num_uncached = self.coordinator.find_longest_cache_hit(
            request.block_hashes, max_cache_hit_length)
        boundary = num_hits + num_uncached if num_uncached else 0
        return self.create_kv_cache_blocks(blocks), num_hits, boundary

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       num_new_computed_tokens: int = 0,
                       new_computed_blocks: KVCacheBlocks | None = None,
                       num_lookahead_tokens: int = 0, num_external_computed_tokens: int = 0,
                       delay_cache_blocks: bool = False, num_encoder_tokens: int = 0,
                       full_sequence_must_fit: bool = False, reserved_blocks: int = 0,
                       has_scheduled_reqs: bool = True,
                       skip_zeroing_group_ids: tuple[int, ...] = ()) -> KVCacheBlocks | None:
        """Room for ``num_new_tokens`` more tokens of ``request`` (after its computed ones and
        the ``num_new_computed_tokens`` of a fresh hit, whose ``new_computed_blocks`` join its
        table). Returns the newly taken blocks, or None, changing nothing, if the pool cannot
        give them (keeping ``reserved_blocks`` free, and the watermark for a waiting request
        when others are scheduled). With ``full_sequence_must_fit`` the whole request
        (``num_tokens``) must fit, not just this step: admission without later surprises.

        Order: blocks behind a sliding window are given back first (even if the answer is
        None), so they can be reused at once; then the count; then hit blocks, new blocks, and
        the caching of the blocks this step fills (``delay_cache_blocks``: not yet).
        """
        # The scheduler calls this once per running request and step with a positive int of
        # new tokens and every other count left at 0, and once per admitted request with the
        # same and, on a prefix miss, the shared empty blocks: those calls are recognised
        # first, the zeros by identity with the int 0 (CPython has one such object; a zero
        # that is another object, or not an int, just takes the general path, which checks
        # it). The flag is tested here too, so that models the fast path never fits pay no
        # extra call.
        if ((new_computed_blocks is None or new_computed_blocks is self.empty_kv_cache_blocks)
                and type(num_new_tokens) is int and num_new_tokens > 0
                and num_new_computed_tokens is num_lookahead_tokens
                is num_external_computed_tokens is reserved_blocks is _ZERO
                and not num_encoder_tokens and self._running_fast_path is not False):
            fast = self._allocate_running_full_attention(
                request, num_new_tokens, delay_cache_blocks, has_scheduled_reqs,
                bool(full_sequence_must_fit))
            if fast is not _NOT_TAKEN:
                return fast
        # Anything else has each count checked, and the wrong one named.
        plain = (type(num_new_tokens) is type(num_new_computed_tokens) is int
                 and num_new_tokens >= 0 and num_new_computed_tokens >= 0
                 and type(num_lookahead_tokens) is type(num_external_computed_tokens)
                 is type(reserved_blocks) is int
                 and num_lookahead_tokens == num_external_computed_tokens == reserved_blocks == 0)
        if not plain:
            _check_counts(num_new_tokens=num_new_tokens,
                          num_new_computed_tokens=num_new_computed_tokens,
                          num_lookahead_tokens=num_lookahead_tokens,
                          num_external_computed_tokens=num_external_computed_tokens,
                          reserved_blocks=reserved_blocks)
        if num_encoder_tokens:
            raise ValueError("encoder (cross-attention) tokens are not modelled")
        if num_new_tokens == 0 and num_external_computed_tokens == 0 \
                and num_new_computed_tokens == 0:
            raise ValueError("num_new_tokens must be greater than 0 when there are no computed "
                             "tokens to adopt")
        if new_computed_blocks is None:
            hit_blocks = self.empty_kv_cache_blocks.blocks
        else:
            hit_blocks = new_computed_blocks.blocks
            if len(hit_blocks) != self.num_kv_cache_groups:
                raise ValueError(f"new_computed_blocks must have {self.num_kv_cache_groups} "
                                 "groups")
        request_id, num_tokens = request.request_id, request.num_tokens
        max_model_len = self.max_model_len
        num_local_computed = request.num_computed_tokens + num_new_computed_tokens
        total_computed = min(num_local_computed + num_external_computed_tokens, max_model_len)
        watermark = (self.watermark_blocks if self.watermark_blocks and has_scheduled_reqs
                     and request.status in _ADMITTING else 0)
        prefill_end = max(request.num_prompt_tokens, num_tokens - 1)
        coordinator = self.coordinator
        if full_sequence_must_fit:
            full = min(num_tokens, max_model_len)
            needed = coordinator.get_num_blocks_to_allocate(
                request_id, full, hit_blocks, num_encoder_tokens, total_computed,
                num_local_computed, full, apply_admission_cap=True, prefill_end=prefill_end)
            if needed + watermark > self.block_pool.get_num_free_blocks():
                return None
        num_tokens_main_model = total_computed + num_new_tokens
        num_tokens_need_slot = min(num_tokens_main_model + num_lookahead_tokens, max_model_len)
        # Before counting: blocks behind a window are free to reuse (only those of tokens
        # whose step has come back; steps in flight still read them).
        coordinator.remove_skipped_blocks(
            request_id, max(0, total_computed - request.num_in_flight_tokens),
            num_prompt_tokens=request.num_prompt_tokens)
        needed = coordinator.get_num_blocks_to_allocate(
            request_id, num_tokens_need_slot, hit_blocks, num_encoder_tokens,
            num_local_computed + num_external_computed_tokens, num_local_computed,
            num_tokens_main_model, prefill_end=prefill_end)
        if needed + watermark > self.block_pool.get_num_free_blocks() - reserved_blocks:
            return None
        if hit_blocks is not self.empty_kv_cache_blocks.blocks \
                or num_external_computed_tokens > 0:
            coordinator.allocate_new_computed_blocks(
                request_id, hit_blocks, num_local_computed, num_external_computed_tokens,
                skip_zeroing_group_ids)
        new_blocks = coordinator.allocate_new_blocks(request_id, num_tokens_need_slot,
                                                     num_tokens_main_model)
        if not delay_cache_blocks:
            # Only tokens that are final (not speculative drafts) are cached.
            coordinator.cache_blocks(request, min(total_computed + num_new_tokens, num_tokens))
        return self.create_kv_cache_blocks(new_blocks)

    def _allocate_running_full_attention(self, request: Request, num_new_tokens: int,
                                         delay_cache_blocks: bool, has_scheduled_reqs: bool,
                                         full_sequence_must_fit: bool = False,
                                         ) -> KVCacheBlocks | None | object:
        """``allocate_slots`` with no hit to adopt when every group is full attention: the
        call the scheduler makes for each running request every step, and for each request it
        admits on a prefix miss. The general path then has nothing to give back behind a
        window and no hit blocks to count or touch, so each count (this step's, and the whole
        request's with ``full_sequence_must_fit``) is each group's growth, for a new request
        as for a running one; this does the same in one pass, with the same answer.
        ``_NOT_TAKEN`` where it does not apply (the general path decides)."""
        if not self._running_fast_path:
            if self._running_fast_path is False:
                return _NOT_TAKEN
            self._running_fast_path = all(type(m) is FullAttentionManager
                                          for m in self.coordinator.single_type_managers)
            if not self._running_fast_path:
                return _NOT_TAKEN
        request_id = request.request_id
        coordinator = self.coordinator
        max_model_len = self.max_model_len
        total_computed = request.num_computed_tokens
        if total_computed > max_model_len:
            total_computed = max_model_len
        num_tokens_main_model = total_computed + num_new_tokens
        num_tokens_need_slot = (num_tokens_main_model if num_tokens_main_model < max_model_len
                                else max_model_len)
        # Tokens whose block hashes exist: a group has blocks to cache only if it has cached
        # fewer than these (in a decode step, once per block_size steps).
        num_hashed_tokens = len(request.block_hashes) * self._hash_block_size
        # The whole request's length, for the admission check (0: none asked).
        full = 0
        if full_sequence_must_fit:
            full = len(request._all_token_ids)
            if full > max_model_len:
                full = max_model_len
        needed = needed_full = 0
        blocks_to_cache = False
        for m in coordinator.single_type_managers:
            # A request not running in this group yet (admitted on a miss) has cached none.
            num_cached = m.num_cached_block.get(request_id, 0)
            block_size = m.block_size
            num_held = len(m.req_to_blocks.get(request_id, ()))
            grow = -(num_tokens_need_slot // -block_size) - num_held
            if grow > 0:
                needed += grow
            if full:
                required = -(full // -block_size)
                cap = m.max_admission_blocks_per_request
                if cap is not None and required > cap:
                    required = cap
                if required > num_held:
                    needed_full += required - num_held
            if num_cached * block_size < num_hashed_tokens:
                blocks_to_cache = True
        watermark = (self.watermark_blocks if self.watermark_blocks and has_scheduled_reqs
                     and request.status in _ADMITTING else 0)
        # (No block needed and no watermark fits any pool: the free count is read only when
        # there is something to compare, not for each decode step inside its last block.)
        # The general path checks the whole request first, then the step: either refuses.
        checked = needed if needed >= needed_full else needed_full
        if ((checked or watermark)
                and checked + watermark > self.block_pool.free_block_queue.num_free_blocks):
            return None
        if needed:
            # Some group grows by ``needed`` > 0 blocks, so create_kv_cache_blocks' "any
            # blocks?" test holds: the answer is built directly.
            blocks = KVCacheBlocks(coordinator.allocate_new_blocks(
                request_id, num_tokens_need_slot, num_tokens_main_model))
        else:
            blocks = self.empty_kv_cache_blocks     # what the general path returns for none
        # The coordinator's plain caching test (its groups cache only full, hashed blocks)
        # has nothing to do when no group is behind the hashes: skip the call.
        if not delay_cache_blocks and (blocks_to_cache or not coordinator._plain_cache_test):
            num_tokens = len(request._all_token_ids)
            coordinator.cache_blocks(request, num_tokens_main_model
                                     if num_tokens_main_model < num_tokens else num_tokens)
        return blocks

    def free(self, request: Request) -> None:
        """Give back every block of ``request``, each group tail first (a prefix shared with
        others stays cached longest). An unknown request is a no-op (it may have been aborted
        before it got blocks)."""
        self.coordinator.free(request.request_id)

    # ----------------------------------------------------------------------------------------
    # The rest the scheduler uses
    # ----------------------------------------------------------------------------------------

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        self.coordinator.remove_skipped_blocks(request_id, processed_computed_tokens,
                                               num_prompt_tokens)

    def pop_blocks_for_free(self, request: Request) -> list[KVCacheBlock]:
        """Forget ``request``'s blocks without freeing them (the caller frees them later,
        reversed)."""
        return self.coordinator.pop_blocks_for_free(request.request_id)

    def evict_blocks(self, block_ids: set[int]) -> None:
        self.block_pool.evict_blocks(block_ids)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (False, changing nothing, while blocks are in use)."""
        if not self.coordinator.reset_prefix_cache():
            return False
        if self.log_stats:
            self.prefix_cache_stats.reset = True
        return True

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        """Cascade attention is gone from vLLM: always 0 per group."""
        return [0] * self.num_kv_cache_groups

    def take_events(self) -> list:
        return []

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        return self.create_kv_cache_blocks(self.coordinator.get_blocks(request_id))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block ids, one list per group: its rows of the block tables."""
        return self.get_blocks(request_id).get_block_ids()

    def get_block_ids_for_computed_tokens(self, request_id: str,
                                          num_computed_tokens: int) -> tuple[list[int], ...]:
        return tuple(ids[:cdiv(num_computed_tokens, g.kv_cache_spec.block_size)]
                     for g, ids in zip(self.kv_cache_config.kv_cache_groups,
                                       self.get_block_ids(request_id)))

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Cache ``request``'s blocks filled by its first ``num_computed_tokens`` tokens."""
        if self.enable_caching:
            self.coordinator.cache_blocks(request, num_computed_tokens)

    def create_kv_cache_blocks(self, blocks: tuple[list[KVCacheBlock], ...]) -> KVCacheBlocks:
        return KVCacheBlocks(blocks) if any(blocks) else self.empty_kv_cache_blocks

    def take_new_block_ids(self) -> list[int]:
        ids: list[int] = []
        for m in self.coordinator.single_type_managers:
            ids.extend(m.take_new_block_ids())
        return ids

    def new_step_starts(self) -> None:
        self.coordinator.new_step_starts()
