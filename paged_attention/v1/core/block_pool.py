"""The block pool: every KV-cache block, the free queue, and the prefix cache's hash map.

``BlockPool`` hands out blocks from the front of the free queue, takes freed blocks back
(never-cached ones to the front, cached ones to the back, so that cached blocks are evicted in
least-recently-freed order), and keeps ``cached_block_hash_to_block``: the blocks that a later
request with the same prefix can reuse. A cached block with no user stays in the free queue;
it is evicted, its hash forgotten, only when ``get_new_blocks`` hands it out again. Block 0 is
the null block, a placeholder for table entries that hold nothing (a sliding window's dropped
prefix); it is taken out at the start and never given to anyone.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from paged_attention.v1.core.kv_cache_utils import (
    BlockHash,
    BlockHashWithGroupId,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    make_block_hash_with_group_id,
    resolve_block_hashes,
)

if TYPE_CHECKING:
    from paged_attention.v1.core.request import Request


class BlockHashToBlockMap:
    """Hash key -> the cached block(s) with that content.

    Two blocks can hold the same content (vLLM does not merge them: a block's id never changes
    once it is in a request's table, so tables only grow at the end). Most keys have one block,
    stored bare; a second turns the entry into ``{block_id: block}``.
    """

    def __init__(self) -> None:
        self._cache: dict[BlockHashWithGroupId, KVCacheBlock | dict[int, KVCacheBlock]] = {}

    def get_one_block(self, key: BlockHashWithGroupId) -> KVCacheBlock | None:
        """A block cached under ``key`` (the first one, if several), or None."""
        blocks = self._cache.get(key)
        if isinstance(blocks, dict):
            return next(iter(blocks.values()))
        return blocks

    def contain(self, key: BlockHashWithGroupId, block_id: int) -> bool:
        blocks = self._cache.get(key)
        if isinstance(blocks, dict):
            return block_id in blocks
        return blocks is not None and blocks.block_id == block_id

    def insert(self, key: BlockHashWithGroupId, block: KVCacheBlock) -> None:
        blocks = self._cache.get(key)
        if blocks is None:
            self._cache[key] = block
        elif isinstance(blocks, dict):
            blocks[block.block_id] = block
        else:
            self._cache[key] = {blocks.block_id: blocks, block.block_id: block}

    def pop(self, key: BlockHashWithGroupId, block_id: int) -> KVCacheBlock | None:
        """Remove block ``block_id`` from ``key``'s entry; the block, or None if not there."""
        blocks = self._cache.get(key)
        if blocks is None:
            return None
        if isinstance(blocks, dict):
            block = blocks.pop(block_id, None)
            if not blocks:
                del self._cache[key]
            return block
        if blocks.block_id != block_id:
            return None
        del self._cache[key]
        return blocks

    def __len__(self) -> int:
        return len(self._cache)

    def items(self) -> Iterable[tuple[BlockHashWithGroupId, list[KVCacheBlock]]]:
        """``(key, blocks)`` pairs, blocks in insertion order (for checks and drawings)."""
        for key, blocks in self._cache.items():
            yield key, list(blocks.values()) if isinstance(blocks, dict) else [blocks]


class BlockPool:
    """All ``num_gpu_blocks`` blocks of one KV cache, shared by every KV-cache group.

    ``hash_block_size`` is the granularity of the requests' block hashes; a group's blocks may
    be a multiple of it. KV-cache events (vLLM's notifications to outside caches) are not
    modelled: ``enable_kv_cache_events`` must stay False.
    """

    def __init__(self, num_gpu_blocks: int, enable_caching: bool, hash_block_size: int,
                 enable_kv_cache_events: bool = False, metrics_collector: object = None,
                 ) -> None:
        for name, value in (("num_gpu_blocks", num_gpu_blocks),
                            ("hash_block_size", hash_block_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if enable_kv_cache_events:
            raise ValueError("KV-cache events are not modelled")
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = bool(enable_caching)
        self.hash_block_size = hash_block_size
        self.enable_kv_cache_events = False
        self.metrics_collector = metrics_collector
        self.blocks: list[KVCacheBlock] = [KVCacheBlock(i) for i in range(num_gpu_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        # Keys a block is cached under besides its own block_hash (a full block that also
        # stands for a shorter, partial prefix; see cache_partial_block).
        self.cached_block_hashes_by_block: dict[int, set[BlockHashWithGroupId]] = {}
        # Group id -> the bytes make_block_hash_with_group_id appends for it (made once).
        self._group_key_suffixes: dict[int, bytes] = {}
        # Block 0 stands for "nothing here": out of the queue for good, its ref_cnt unused.
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True

    # ----------------------------------------------------------------------------------------
    # The prefix cache
    # ----------------------------------------------------------------------------------------

    def get_cached_block(self, block_hash: BlockHash,
                         kv_cache_group_ids: list[int]) -> list[KVCacheBlock] | None:
        """The block cached under ``block_hash`` in each group, or None if one group lacks it."""
        if len(kv_cache_group_ids) == 1:
            # One group (most models; once per block of every prefix lookup): the key from
            # the group's suffix as cache_full_blocks made it (the same bytes
            # make_block_hash_with_group_id gives), and no list grown in a loop.
            group_id = kv_cache_group_ids[0]
            suffix = self._group_key_suffixes.get(group_id) if type(group_id) is int else None
            block = self.cached_block_hash_to_block.get_one_block(
                make_block_hash_with_group_id(block_hash, group_id) if suffix is None
                else block_hash + suffix)
            return None if block is None else [block]
        found = []
        for group_id in kv_cache_group_ids:
            block = self.cached_block_hash_to_block.get_one_block(
                make_block_hash_with_group_id(block_hash, group_id))
            if block is None:
                return None
            found.append(block)
        return found

    def _insert_block_hash(self, key: BlockHashWithGroupId, block: KVCacheBlock,
                           num_tokens: int | None) -> None:
        # A block gets its own hash before any other key, and loses all its keys together, so
        # one with no hash (a newly full block, the usual case) is cached under no key yet.
        if block.block_hash is None:
            block.set_block_hash(key, num_tokens)
        elif block.block_hash == key or self.cached_block_hash_to_block.contain(key,
                                                                                block.block_id):
            return
        else:
            self.cached_block_hashes_by_block.setdefault(block.block_id, set()).add(key)
        self.cached_block_hash_to_block.insert(key, block)

    def _remove_cached_block_hashes(self, block: KVCacheBlock) -> list[BlockHashWithGroupId]:
        """Forget every key ``block`` is cached under; the keys that were there."""
        keys = [] if block.block_hash is None else [block.block_hash]
        keys.extend(self.cached_block_hashes_by_block.pop(block.block_id, ()))
        removed = [k for k in keys
                   if self.cached_block_hash_to_block.pop(k, block.block_id) is not None]
        block.reset_hash()
        return removed

    def cache_full_blocks(self, request: Request, blocks: list[KVCacheBlock],
                          num_cached_blocks: int, num_full_blocks: int, block_size: int,
                          kv_cache_group_id: int, block_mask: list[bool] | None = None) -> None:
        """Cache ``blocks[num_cached_blocks:num_full_blocks]`` of ``request`` (now full) under
        their prefix hashes. Null blocks are skipped, and so are blocks whose ``block_mask``
        entry is False (sliding-window blocks no future hit can use)."""
        if num_cached_blocks >= num_full_blocks:
            return
        if num_full_blocks > len(blocks):
            raise ValueError(f"{num_full_blocks} full blocks asked, the request holds "
                             f"{len(blocks)}")
        hashes = (request.block_hashes if block_size == self.hash_block_size
                  else resolve_block_hashes(request.block_hashes, self.hash_block_size,
                                            block_size))
        if num_full_blocks > len(hashes):
            raise ValueError(f"request {request.request_id} has hashes for {len(hashes)} "
                             f"blocks of {block_size} tokens, not {num_full_blocks}")
        if block_mask is not None and len(block_mask) != num_full_blocks - num_cached_blocks:
            raise ValueError("block_mask must have one entry per newly full block")
        cached = self.cached_block_hash_to_block
        cache = cached._cache
        # The keys' group part (what make_block_hash_with_group_id appends), made at the first
        # block that needs it: a bad group id fails where it did, and only then.
        suffix = (self._group_key_suffixes.get(kv_cache_group_id)
                  if type(kv_cache_group_id) is int else None)
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.is_null or (block_mask is not None and not block_mask[i - num_cached_blocks]):
                continue
            num_tokens = (i + 1) * block_size
            if suffix is None:
                suffix = make_block_hash_with_group_id(BlockHash(b""), kv_cache_group_id)
                if type(kv_cache_group_id) is int:
                    self._group_key_suffixes[kv_cache_group_id] = suffix
            key = hashes[i] + suffix
            if block._block_hash is None:
                # The usual case, a newly full block: _insert_block_hash's first branch, with
                # set_block_hash's and insert's first branches written out (no hash to refuse;
                # a key seen for the first time) for a block boundary's one block per request.
                block._block_hash = key
                block._block_hash_num_tokens = num_tokens
                if key in cache:
                    cached.insert(key, block)
                else:
                    cache[key] = block
                continue
            # A block cached for a shorter prefix, now full: its old keys go.
            self._remove_cached_block_hashes(block)
            self._insert_block_hash(key, block, num_tokens)

    def cache_partial_block(self, request: Request, block: KVCacheBlock, num_tokens: int,
                            kv_cache_group_id: int, block_size: int,
                            replace_existing_hashes: bool = False,
                            ) -> BlockHashWithGroupId | None:
        """Cache ``block``, not yet full, as the end of the prefix of ``num_tokens`` tokens.

        In hybrid models the hashes are finer than a full-attention group's blocks; a prompt
        that ends inside such a block leaves its tail reachable under the hash at its last
        hash boundary. The key is added to the block's keys (it becomes the block's own hash
        if it has none; a shorter partial key is replaced). Returns the key, or None for the
        null block.
        """
        if block.is_null:
            return None
        if num_tokens % self.hash_block_size or not 0 < num_tokens // self.hash_block_size \
                <= len(request.block_hashes):
            raise ValueError(f"no hash of request {request.request_id} ends at {num_tokens} "
                             "tokens")
        key = make_block_hash_with_group_id(
            request.block_hashes[num_tokens // self.hash_block_size - 1], kv_cache_group_id)
        cached = block.block_hash == key or self.cached_block_hash_to_block.contain(
            key, block.block_id)
        if replace_existing_hashes or (not cached and block.block_hash is not None
                                       and block.block_hash_num_tokens is not None
                                       and block.block_hash_num_tokens < num_tokens):
            self._remove_cached_block_hashes(block)
        self._insert_block_hash(key, block, num_tokens)
        return key

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        """Forget ``block``'s hashes (it is about to hold something else). Whether it had any."""
        if block.block_hash is None:
            return False    # never cached, or evicted already: no key names it
        return bool(self._remove_cached_block_hashes(block))

    def evict_blocks(self, block_ids: set[int]) -> None:
        """Take these blocks out of the prefix cache (their users keep them)."""
        bad = [i for i in block_ids if not (isinstance(i, int) and 0 <= i < self.num_gpu_blocks)]
        if bad:
            raise KeyError(f"no such blocks: {sorted(map(repr, bad))}")
        for i in block_ids:
            self._maybe_evict_cached_block(self.blocks[i])

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash, so nothing hits any more. Refused (False) while any block
        is in use: their hashes would have to be forgotten under their users."""
        if self.num_gpu_blocks - self.get_num_free_blocks() != 1:  # the null block
            return False
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        self.cached_block_hashes_by_block.clear()
        for block in self.blocks:
            block.reset_hash()
        return True

    # ----------------------------------------------------------------------------------------
    # Handing blocks out and taking them back
    # ----------------------------------------------------------------------------------------

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` blocks from the front of the free queue, each with one user.
        A cached block taken this way is evicted: its hashes are forgotten."""
        if not (type(num_blocks) is int
                and 0 <= num_blocks <= self.free_block_queue.num_free_blocks):
            # (One test for a good count, each per step and request; the detail only here.)
            if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) \
                    or num_blocks < 0:
                raise ValueError(f"num_blocks must be an int >= 0, got {num_blocks!r}")
            if num_blocks > self.get_num_free_blocks():
                raise ValueError(f"Cannot get {num_blocks} free blocks from the pool "
                                 f"({self.get_num_free_blocks()} free)")
        blocks = self.free_block_queue.popleft_n(num_blocks)
        if self.enable_caching:
            for block in blocks:
                # Most blocks handed out were never cached: no key to forget (the slot, not
                # the property, is read: this runs for every block handed out).
                if block._block_hash is not None:
                    self._remove_cached_block_hashes(block)
                block.ref_cnt += 1
        else:
            for block in blocks:
                block.ref_cnt += 1
        return blocks

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """One more user for each block (a prefix hit). A block nobody used was in the free
        queue, and leaves it."""
        self._check_own(blocks)
        for block in blocks:
            if not block.is_null and block.ref_cnt == 0 and block.prev_free_block is None:
                raise ValueError(f"block {block.block_id} has no user and is not free")
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """One user fewer for each block, given in eviction order (first = evict first).

        Blocks left with no user return to the free queue: never-cached ones (or any, with
        caching off) to the front, in the given order, to be reused first; cached ones to the
        back, in the given order, so that they stay hittable as long as possible.

        vLLM lets a block's count go below zero when it is freed once too often; here that is a
        ``ValueError`` and nothing is freed.
        """
        blocks = [b for b in ordered_blocks if not b.is_null]
        pool, num_gpu_blocks = self.blocks, self.num_gpu_blocks
        caching = self.enable_caching
        to_front, to_back = [], []
        # One pass checks each block (as _check_own does) and counts it down; a bad block
        # undoes the counts so far, before the queue is touched, and the error is the one the
        # checks would raise in turn: a foreign block anywhere first, then over-freeing.
        for num_done, block in enumerate(blocks):
            i = block.block_id
            if not 0 <= i < num_gpu_blocks or pool[i] is not block:
                self._undo_counts(blocks, num_done)
                self._check_own(blocks)     # raises for this block, or one before it
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                # (The slot, not the property: this runs for every block a request frees.)
                if block._block_hash is None or not caching:
                    to_front.append(block)
                else:
                    to_back.append(block)
            elif block.ref_cnt < 0:
                # Freed once too often (it repeats, or had no user): name every such block.
                self._undo_counts(blocks, num_done + 1)
                self._check_own(blocks)
                counts = Counter(b.block_id for b in blocks)
                over = [i for i, n in counts.items() if self.blocks[i].ref_cnt < n]
                raise ValueError(f"blocks {sorted(over)} would be freed more often than they "
                                 "are used")
        self.free_block_queue.prepend_n(to_front)
        self.free_block_queue.append_n(to_back)

    @staticmethod
    def _undo_counts(blocks: list[KVCacheBlock], num_done: int) -> None:
        """Give back the user ``free_blocks`` took from each of the first ``num_done``."""
        for b in blocks[:num_done]:
            b.ref_cnt += 1

    def _check_own(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Every block but null ones must be this pool's own object."""
        pool, num_gpu_blocks = self.blocks, self.num_gpu_blocks
        for block in blocks:
            i = block.block_id
            if (not 0 <= i < num_gpu_blocks or pool[i] is not block) and not block.is_null:
                raise ValueError(f"block {i} does not belong to this pool")

    # ----------------------------------------------------------------------------------------
    # Counts
    # ----------------------------------------------------------------------------------------

    def get_num_free_blocks(self) -> int:
        """Blocks in the free queue (cached ones included: they can be evicted)."""
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """The fraction of blocks in use, the null block left out of both counts."""
        total = self.num_gpu_blocks - 1
        return 1.0 - self.get_num_free_blocks() / total if total else 0.0

    def take_events(self) -> list:
        """KV-cache events are not modelled: always empty."""
        return []
