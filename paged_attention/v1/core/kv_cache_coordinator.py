"""The coordinators: one block pool shared by every KV-cache group, and hits all groups agree on.

A model whose layers all use one kind of attention has one KV-cache group, and its coordinator
(``UnitaryKVCacheCoordinator``) passes every call to that group's manager. A hybrid model (some
layers with full attention, some with a sliding window) has several groups over one pool, and
``HybridKVCacheCoordinator`` must find a prefix hit that holds in every group: full attention
proposes the longest run of cached blocks, the sliding-window groups may shorten it (their
window before the hit point must be cached), and the full-attention blocks are cut back to the
agreed length. Without prefix caching, ``KVCacheCoordinatorNoPrefixCache`` never hits.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

from paged_attention.kv_cache.interface import FullAttentionSpec, KVCacheConfig, KVCacheSpec
from paged_attention.utils import cdiv
from paged_attention.v1.core.block_pool import BlockPool
from paged_attention.v1.core.kv_cache_utils import BlockHash, KVCacheBlock
from paged_attention.v1.core.request import Request
from paged_attention.v1.core.single_type_kv_cache_manager import (
    FullAttentionManager,
    SingleTypeKVCacheManager,
    get_manager_for_kv_cache_spec,
    replay_boundaries,
)

# The groups' cache_blocks whose "nothing new" test the coordinator may answer for them (the
# full-attention one adds only a partial tail block, and only where hashes are finer).
_BASE_CACHE_BLOCKS = SingleTypeKVCacheManager.cache_blocks
_PLAIN_CACHE_BLOCKS = (_BASE_CACHE_BLOCKS, FullAttentionManager.cache_blocks)


class KVCacheCoordinator:
    """What every coordinator does: one ``BlockPool``, one manager per group, calls fanned out."""

    enable_partial_hash_hits = False

    def __init__(self, kv_cache_config: KVCacheConfig, max_model_len: int,
                 max_in_flight_tokens: int, use_eagle: bool, enable_caching: bool,
                 enable_kv_cache_events: bool, dcp_world_size: int, pcp_world_size: int,
                 scheduler_block_size: int, hash_block_size: int,
                 metrics_collector: object = None, num_prefill_lookahead: int = 0,
                 num_hash_lookahead_tokens: int = 0) -> None:
        if use_eagle or num_prefill_lookahead or num_hash_lookahead_tokens:
            raise ValueError("speculative decoding (EAGLE, MTP lookahead) is not modelled")
        groups = kv_cache_config.kv_cache_groups
        if scheduler_block_size % hash_block_size or any(
                scheduler_block_size % g.kv_cache_spec.block_size for g in groups):
            raise ValueError(f"scheduler_block_size {scheduler_block_size} must be a multiple of "
                             f"hash_block_size {hash_block_size} and of every group's block size")
        self.kv_cache_config = kv_cache_config
        self.scheduler_block_size = scheduler_block_size
        self.num_reprefillable_tokens = 0
        self._plain_cache_test: bool | None = None     # see _is_plain_cache_test
        self.block_pool = BlockPool(kv_cache_config.num_blocks, enable_caching, hash_block_size,
                                    enable_kv_cache_events, metrics_collector)
        self.eagle_group_ids: set[int] = set()
        self.drop_eagle_group_ids: set[int] = set()
        self.single_type_managers: tuple[SingleTypeKVCacheManager, ...] = tuple(
            get_manager_for_kv_cache_spec(
                g.kv_cache_spec, max_in_flight_tokens=max_in_flight_tokens,
                max_model_len=max_model_len, block_pool=self.block_pool,
                enable_caching=enable_caching, kv_cache_group_id=i,
                scheduler_block_size=scheduler_block_size, dcp_world_size=dcp_world_size,
                pcp_world_size=pcp_world_size)
            for i, g in enumerate(groups))
        self.group_block_sizes = tuple(m.block_size for m in self.single_type_managers)
        # vLLM can keep sliding-window blocks sparsely (a retention interval); here: densely.
        self.retention_interval = None

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: tuple[Sequence[KVCacheBlock], ...],
                                   num_encoder_tokens: int, total_computed_tokens: int,
                                   num_local_computed_tokens: int, num_tokens_main_model: int,
                                   apply_admission_cap: bool = False,
                                   prefill_end: int = 0) -> int:
        """Blocks the pool must give, summed over the groups."""
        # Plain loops, not sum() over a generator, in this method and the next: they run for
        # every scheduled request in every step, mostly over one group.
        num_blocks = 0
        for m, blocks in zip(self.single_type_managers, new_computed_blocks, strict=True):
            num_blocks += m.get_num_blocks_to_allocate(
                request_id, num_tokens, blocks, total_computed_tokens, num_local_computed_tokens,
                num_tokens_main_model, apply_admission_cap, prefill_end)
        return num_blocks

    def allocate_new_computed_blocks(self, request_id: str,
                                     new_computed_blocks: tuple[Sequence[KVCacheBlock], ...],
                                     num_local_computed_tokens: int,
                                     num_external_computed_tokens: int,
                                     skip_zeroing_group_ids: tuple[int, ...] = ()) -> None:
        """Give a newly admitted request its hit blocks in every group (first all groups'
        touches, then any blocks for connector tokens: a new block for one group must not
        evict a hit block of another before it is touched)."""
        if any(request_id in m.num_cached_block for m in self.single_type_managers):
            return  # running already: no new hits
        for i, m in enumerate(self.single_type_managers):
            m.add_local_computed_blocks(request_id, new_computed_blocks[i],
                                        num_local_computed_tokens, num_external_computed_tokens)
        if num_external_computed_tokens > 0:
            for m in self.single_type_managers:
                m.allocate_external_computed_blocks(request_id, num_local_computed_tokens,
                                                    num_external_computed_tokens)

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_tokens_main_model: int,
                            num_encoder_tokens: int = 0) -> tuple[list[KVCacheBlock], ...]:
        managers = self.single_type_managers
        if len(managers) == 1:      # (one group, most models: at a block boundary, per request)
            return (managers[0].allocate_new_blocks(request_id, num_tokens,
                                                    num_tokens_main_model),)
        new_blocks = []
        for m in managers:
            new_blocks.append(m.allocate_new_blocks(request_id, num_tokens, num_tokens_main_model))
        return tuple(new_blocks)

    def get_num_cacheable_tokens(self, num_computed_tokens: int, kv_cache_group_id: int) -> int:
        return max(0, num_computed_tokens - self.num_reprefillable_tokens)

    def _is_plain_cache_test(self) -> bool:
        """Whether every group's own caching test is the plain one that ``cache_blocks`` answers
        first (plain groups, hashes of the block size, the base rule for cacheable tokens)."""
        if self._plain_cache_test is None:
            cls = type(self)
            self._plain_cache_test = (
                cls.get_num_cacheable_tokens is KVCacheCoordinator.get_num_cacheable_tokens
                and all(type(m).cache_blocks in _PLAIN_CACHE_BLOCKS
                        and m.block_size == self.block_pool.hash_block_size
                        for m in self.single_type_managers))
        return self._plain_cache_test

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        # Plain groups: the question a decode step inside its last block asks of every running
        # request every step (twice under async scheduling), has any group a newly filled,
        # hashed block to cache?, is answered here in one pass: usually not, and no group is
        # called. A group that is behind caches from the counts found here.
        plain = self._plain_cache_test
        if plain or (plain is None and self._is_plain_cache_test()):
            rid = request.request_id
            num_tokens = num_computed_tokens - self.num_reprefillable_tokens
            num_hashed = len(request.block_hashes) * self.block_pool.hash_block_size
            if num_hashed < num_tokens:
                num_tokens = num_hashed
            for m in self.single_type_managers:
                if m.enable_caching:
                    # The base class's cache_blocks from its "anything new?" test on: the same
                    # counts (a group caches only where its own count is behind).
                    num_cached = m.num_cached_block.get(rid, 0)
                    num_full = num_tokens // m.block_size
                    if num_cached < num_full:
                        m._cache_new_full_blocks(request, num_cached, num_full,
                                                 self.retention_interval, None)
            return
        boundaries = replay_boundaries(request.num_prompt_tokens, self.scheduler_block_size,
                                       use_eagle=False)
        for i, m in enumerate(self.single_type_managers):
            if m.enable_caching:
                m.cache_blocks(request, self.get_num_cacheable_tokens(num_computed_tokens, i),
                               self.retention_interval, replay_boundaries=boundaries)

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def free(self, request_id: str) -> None:
        for m in self.single_type_managers:
            m.free(request_id)

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        blocks: list[KVCacheBlock] = []
        for m in self.single_type_managers:
            blocks.extend(m.pop_blocks_for_free(request_id))
        return blocks

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        for m in self.single_type_managers:
            m.remove_skipped_blocks(request_id, processed_computed_tokens, num_prompt_tokens)

    def get_blocks(self, request_id: str) -> tuple[list[KVCacheBlock], ...]:
        managers = self.single_type_managers
        if len(managers) == 1:      # (one group, most models: per admitted request)
            return (managers[0].req_to_blocks.get(request_id) or [],)
        return tuple([m.req_to_blocks.get(request_id) or [] for m in managers])

    def find_longest_cache_hit(self, block_hashes: list[BlockHash], max_cache_hit_length: int,
                               ) -> tuple[tuple[list[KVCacheBlock], ...], int, int]:
        """(hit blocks per group, hit length, tokens of a longer prefix some group has cached
        but another has not: 0 unless hybrid)."""
        raise NotImplementedError

    def new_step_starts(self) -> None:
        for m in self.single_type_managers:
            m.new_step_starts()


class KVCacheCoordinatorNoPrefixCache(KVCacheCoordinator):
    """Prefix caching off: any number of groups, never a hit."""

    def __init__(self, kv_cache_config: KVCacheConfig, max_model_len: int,
                 max_in_flight_tokens: int, use_eagle: bool, enable_kv_cache_events: bool,
                 dcp_world_size: int, pcp_world_size: int, scheduler_block_size: int,
                 hash_block_size: int, metrics_collector: object = None, **kwargs) -> None:
        super().__init__(kv_cache_config, max_model_len, max_in_flight_tokens, use_eagle, False,
                         enable_kv_cache_events, dcp_world_size, pcp_world_size,
                         scheduler_block_size, hash_block_size, metrics_collector, **kwargs)
        self.num_single_type_manager = len(self.single_type_managers)

    def find_longest_cache_hit(self, block_hashes: list[BlockHash], max_cache_hit_length: int,
                               ) -> tuple[tuple[list[KVCacheBlock], ...], int, int]:
        return tuple([] for _ in range(self.num_single_type_manager)), 0, 0


class UnitaryKVCacheCoordinator(KVCacheCoordinator):
    """One group: its manager's hit is the hit (blocks and hashes of the same size)."""

    def __init__(self, kv_cache_config: KVCacheConfig, max_model_len: int,
                 max_in_flight_tokens: int, use_eagle: bool, enable_caching: bool,
                 enable_kv_cache_events: bool, dcp_world_size: int, pcp_world_size: int,
                 scheduler_block_size: int, hash_block_size: int,
                 metrics_collector: object = None, **kwargs) -> None:
        super().__init__(kv_cache_config, max_model_len, max_in_flight_tokens, use_eagle,
                         enable_caching, enable_kv_cache_events, dcp_world_size, pcp_world_size,
                         scheduler_block_size, hash_block_size, metrics_collector, **kwargs)
        if len(kv_cache_config.kv_cache_groups) != 1:
            raise ValueError("UnitaryKVCacheCoordinator takes exactly one KV-cache group")
        self.kv_cache_spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
        self.block_size = self.single_type_managers[0].block_size
        self.dcp_world_size = self.pcp_world_size = 1
        if enable_caching and hash_block_size != self.block_size:
            raise ValueError(f"one group hashes per block: hash_block_size {hash_block_size} "
                             f"must equal the block size {self.block_size}")

    def find_longest_cache_hit(self, block_hashes: list[BlockHash], max_cache_hit_length: int,
                               ) -> tuple[tuple[list[KVCacheBlock], ...], int, int]:
        blocks, length = self.single_type_managers[0].find_longest_cache_hit(
            block_hashes, max_cache_hit_length, [0], self.block_pool, self.kv_cache_spec, False,
            self.block_size)
        return blocks, length, 0


class SpecGroup(NamedTuple):
    """Groups with equal specs, looked up together (a hit must hold in each)."""

    spec: KVCacheSpec
    group_ids: list[int]
    manager_cls: type[SingleTypeKVCacheManager]
    use_eagle: bool


class HybridKVCacheCoordinator(KVCacheCoordinator):
    """Several groups (full attention and sliding windows) over one pool.

    Hashes are computed every ``hash_block_size`` tokens (the greatest common divisor of the
    groups' block sizes), hits end on multiples of ``scheduler_block_size`` (their least common
    multiple), so that every group's blocks end there too.
    """

    def __init__(self, kv_cache_config: KVCacheConfig, max_model_len: int,
                 max_in_flight_tokens: int, use_eagle: bool, enable_caching: bool,
                 enable_kv_cache_events: bool, dcp_world_size: int, pcp_world_size: int,
                 scheduler_block_size: int, hash_block_size: int,
                 metrics_collector: object = None, num_hash_lookahead_tokens: int = 0,
                 num_prefill_lookahead: int = 0, allow_partial_hash_hits: bool = True) -> None:
        super().__init__(kv_cache_config, max_model_len, max_in_flight_tokens, use_eagle,
                         enable_caching, enable_kv_cache_events, dcp_world_size, pcp_world_size,
                         scheduler_block_size, hash_block_size, metrics_collector,
                         num_prefill_lookahead, num_hash_lookahead_tokens)
        self.hash_block_size = hash_block_size
        self.dcp_world_size = 1
        if any(bs % hash_block_size for bs in self.group_block_sizes):
            raise ValueError(f"every group's block size {self.group_block_sizes} must be a "
                             f"multiple of hash_block_size {hash_block_size}")
        # Hits inside a block need Mamba state checkpoints (not modelled): never enabled.
        self.enable_partial_hash_hits = False
        for m in self.single_type_managers:
            m.cache_hit_alignment_tokens = self._cache_hit_alignment_tokens
        self.verify_and_split_kv_cache_groups()

    @property
    def _cache_hit_alignment_tokens(self) -> int:
        return self.scheduler_block_size

    def verify_and_split_kv_cache_groups(self) -> None:
        """Bundle groups with equal specs; full attention first (it bounds the others)."""
        self.attention_groups: list[SpecGroup] = []
        for i, g in enumerate(self.kv_cache_config.kv_cache_groups):
            cls = type(self.single_type_managers[i])
            for group in self.attention_groups:
                if group.spec == g.kv_cache_spec and group.manager_cls is cls:
                    group.group_ids.append(i)
                    break
            else:
                self.attention_groups.append(SpecGroup(g.kv_cache_spec, [i], cls, False))
        self.attention_groups.sort(key=lambda g: not isinstance(g.spec, FullAttentionSpec))
        first = self.attention_groups[0]
        self.full_attention_group_id = (first.group_ids[0]
                                        if isinstance(first.spec, FullAttentionSpec) else None)

    def _align_cacheable(self, num_tokens: int) -> int:
        return num_tokens - num_tokens % self.scheduler_block_size

    def get_num_cacheable_tokens(self, num_computed_tokens: int, kv_cache_group_id: int) -> int:
        """Only up to the last aligned boundary: no hit can end in between."""
        return self._align_cacheable(num_computed_tokens)

    def find_longest_cache_hit(self, block_hashes: list[BlockHash], max_cache_hit_length: int,
                               ) -> tuple[tuple[list[KVCacheBlock], ...], int, int]:
        """Ask each kind of group in turn for its hit within the current length; a shorter
        answer becomes the new length, and the groups are asked again until none shortens it
        (full attention is asked once: any prefix of its hit is a hit). With one full-attention
        kind and one other, one round is enough. Full-attention blocks are then cut back to
        the agreed length."""
        num_groups = len(self.kv_cache_config.kv_cache_groups)
        hit_length = max_cache_hit_length
        longest = 0
        blocks_by_group: list[list[KVCacheBlock] | None] = [None] * num_groups
        length_by_group = [0] * num_groups
        simple = (len(self.attention_groups) == 2
                  and isinstance(self.attention_groups[0].spec, FullAttentionSpec))
        while True:
            current = hit_length
            for spec, group_ids, manager_cls, _ in self.attention_groups:
                first = group_ids[0]
                if isinstance(spec, FullAttentionSpec) and blocks_by_group[first] is not None:
                    current = min(current, length_by_group[first])
                    continue
                blocks, length = manager_cls.find_longest_cache_hit(
                    block_hashes, current, group_ids, self.block_pool, spec, False,
                    self._cache_hit_alignment_tokens)
                current = length
                for gid, group_blocks in zip(group_ids, blocks):
                    blocks_by_group[gid] = group_blocks
                    length_by_group[gid] = length
                longest = max(longest, current)
            if current >= hit_length:
                break
            hit_length = current
            if simple:
                break
        for group in self.attention_groups:
            if not isinstance(group.spec, FullAttentionSpec):
                continue
            keep = cdiv(hit_length, self.single_type_managers[group.group_ids[0]].block_size)
            for gid in group.group_ids:
                if blocks_by_group[gid] is not None:
                    del blocks_by_group[gid][keep:]
                    length_by_group[gid] = hit_length
        hit_blocks = tuple(b if b is not None else [] for b in blocks_by_group)
        return hit_blocks, hit_length, longest - hit_length


def get_kv_cache_coordinator(kv_cache_config: KVCacheConfig, max_model_len: int,
                             max_in_flight_tokens: int, use_eagle: bool, enable_caching: bool,
                             enable_kv_cache_events: bool, dcp_world_size: int,
                             pcp_world_size: int, scheduler_block_size: int,
                             hash_block_size: int, metrics_collector: object = None,
                             num_hash_lookahead_tokens: int = 0, num_prefill_lookahead: int = 0,
                             allow_partial_hash_hits: bool = True) -> KVCacheCoordinator:
    """No caching: ``KVCacheCoordinatorNoPrefixCache``; one group: unitary; else hybrid."""
    args = (kv_cache_config, max_model_len, max_in_flight_tokens, use_eagle)
    rest = dict(dcp_world_size=dcp_world_size, pcp_world_size=pcp_world_size,
                scheduler_block_size=scheduler_block_size, hash_block_size=hash_block_size,
                metrics_collector=metrics_collector,
                num_hash_lookahead_tokens=num_hash_lookahead_tokens,
                num_prefill_lookahead=num_prefill_lookahead)
    if not enable_caching:
        return KVCacheCoordinatorNoPrefixCache(*args, enable_kv_cache_events, **rest)
    if len(kv_cache_config.kv_cache_groups) == 1:
        return UnitaryKVCacheCoordinator(*args, enable_caching, enable_kv_cache_events, **rest)
    return HybridKVCacheCoordinator(*args, enable_caching, enable_kv_cache_events,
                                    allow_partial_hash_hits=allow_partial_hash_hits, **rest)


def default_block_sizes(kv_cache_config: KVCacheConfig) -> tuple[int, int]:
    """(scheduler_block_size, hash_block_size) as vLLM picks them for these groups: one group,
    its block size twice; several, their least common multiple and greatest common divisor."""
    sizes = [g.kv_cache_spec.block_size for g in kv_cache_config.kv_cache_groups]
    if len(sizes) <= 1:
        return (sizes[0], sizes[0]) if sizes else (1, 1)
    return math.lcm(*sizes), math.gcd(*sizes)
