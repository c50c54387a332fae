"""vLLM's V1 KV-cache core (``vllm/v1/core/``): what decides the block ids the worker's tables hold.

Read in this order: ``kv_cache_utils`` (a block, the free queue, block hashes), ``block_pool``
(handing blocks out and back, the prefix cache), ``single_type_kv_cache_manager`` (one
KV-cache group: full attention or a sliding window), ``kv_cache_coordinator`` (all groups over
one pool, hits they agree on), ``kv_cache_manager`` (what the scheduler calls), ``request``.
``sched/`` holds the scheduler. ``oracle`` loads vLLM 0.33's own classes from its wheel, and
``differential`` replays random traces on ours and on them, comparing every step.
"""
from paged_attention.v1.core.block_pool import BlockPool
from paged_attention.v1.core.kv_cache_coordinator import (
    HybridKVCacheCoordinator,
    KVCacheCoordinator,
    UnitaryKVCacheCoordinator,
    get_kv_cache_coordinator,
)
from paged_attention.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from paged_attention.v1.core.kv_cache_utils import (
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    get_request_block_hasher,
    init_none_hash,
)
from paged_attention.v1.core.request import Request, RequestStatus
from paged_attention.v1.core.single_type_kv_cache_manager import (
    FullAttentionManager,
    SlidingWindowManager,
)

__all__ = [
    "BlockPool", "FreeKVCacheBlockQueue", "FullAttentionManager", "HybridKVCacheCoordinator",
    "KVCacheBlock", "KVCacheBlocks", "KVCacheCoordinator", "KVCacheManager", "Request",
    "RequestStatus", "SlidingWindowManager", "UnitaryKVCacheCoordinator",
    "get_kv_cache_coordinator", "get_request_block_hasher", "init_none_hash",
]
