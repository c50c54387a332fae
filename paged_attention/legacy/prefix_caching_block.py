"""Prefix caching (vLLM's ``vllm/core/block/prefix_caching_block.py``): full blocks are named by
a hash of their whole prefix, so two sequences that start with the same tokens share the same
physical blocks.

A block is *mutable* while it fills up. Once full it is *promoted*: its hash (its tokens, chained
to the previous block's hash) is looked up, and if the same prefix is already cached the block
moves onto the cached physical id and gives its own back. When the last holder of a cached
block lets go, the block is not wiped but parked in the evictor, still findable by hash, until
an allocation needs the id.

Every physical id has a ``BlockTracker`` (active while held, with the last access time and
whether its KV has been computed). A newly promoted block only counts as computed once it is
marked (``mark_blocks_as_computed``); the block manager marks a sequence's blocks only as far
as its computed tokens reach, so a chunked prefill never offers KV it has not written yet.
A cached block that is not computed may still be shared (its holders each compute it), but
is never reported as computed: not while held, and not while it waits in the evictor.
"""
from __future__ import annotations

from typing import FrozenSet, Iterable, Optional

from paged_attention.legacy.common import (BlockPool, BlockStateError, BlockTypeError, CacheMetricData,
                                           CopyOnWriteTracker, UnknownBlockIdError, check_block, check_block_ids,
                                           check_blocks, check_extra_hash, check_time, check_token_ids,
                                           get_all_blocks_recursively, rehearse)
from paged_attention.legacy.evictor import EvictionPolicy, make_evictor
from paged_attention.legacy.interfaces import Block, BlockAllocator, BlockId
from paged_attention.legacy.naive_block import (NaiveBlock, NaiveBlockAllocator, check_block_token_ids,
                                                check_computed_seq_block_ids)
from paged_attention.legacy.prefix_caching_hash import NONE_HASH, hash_block_tokens
# vLLM keeps the per-sequence trackers in this file; they live in their own module and are
# re-exported here, so that vLLM's import path works.
from paged_attention.legacy.prefix_caching_trackers import ComputedBlocksTracker, LastAccessBlocksTracker
from paged_attention.utils import Device, is_int

PrefixHash = int

# A block's last access time before anyone has recorded one.
_DEFAULT_LAST_ACCESSED_TIME = -1


class BlockTracker:
    """Per physical id: held or not (``active``), when last used, and whether its KV is computed."""

    __slots__ = ("active", "last_accessed", "computed")

    def __init__(self):
        self.active = False
        self.reset()

    def reset(self) -> None:
        self.last_accessed: float = _DEFAULT_LAST_ACCESSED_TIME
        self.computed: bool = False

    def enable(self) -> None:
        if self.active:
            raise BlockStateError("block tracker is already active")
        self.active = True
        self.reset()

    def disable(self) -> None:
        if not self.active:
            raise BlockStateError("block tracker is not active")
        self.active = False
        self.reset()


class PrefixCachingBlockAllocator(BlockAllocator):
    """Physical ids on one device, shared between sequences by prefix hash.

    It wraps a ``NaiveBlockAllocator`` over the same ids (the *hashless* allocator: mutable
    blocks, copy on write) and shares its reference counter and its pool of block objects, so
    a count is kept in one place whichever path a block takes. Free blocks are the hashless
    free list plus the cached blocks nobody holds (those in the evictor).
    """

    def __init__(self, num_blocks: int, block_size: int, block_ids: Optional[Iterable[int]] = None,
                 eviction_policy: EvictionPolicy = EvictionPolicy.LRU):
        block_ids = list(range(num_blocks) if block_ids is None else block_ids)
        self._block_size = block_size
        self._cached_blocks: dict[PrefixHash, BlockId] = {}      # promoted blocks, held or evictable
        # Cached blocks (held, or waiting in the evictor) whose KV is not computed yet.
        self._touched_blocks: set[BlockId] = set()
        self._block_tracker: dict[BlockId, BlockTracker] = {i: BlockTracker() for i in block_ids}
        self._block_pool = BlockPool(block_size=block_size, create_block=self._create_block, allocator=self,
                                     pool_size=num_blocks * 4)
        self._hashless_allocator = NaiveBlockAllocator(create_block=self._create_block, num_blocks=num_blocks,
                                                       block_size=block_size, block_ids=block_ids,
                                                       block_pool=self._block_pool)
        self._refcounter = self._hashless_allocator._refcounter   # one count for both paths
        self._cow_tracker = CopyOnWriteTracker(refcounter=self._refcounter.as_readonly())
        self.evictor = make_evictor(eviction_policy)
        self.metric_data = CacheMetricData()

    def _create_block(self, prev_block: Block | None, token_ids: list[int], block_size: int,
                      allocator: BlockAllocator, block_id: int | None = None, computed: bool = False,
                      extra_hash: int | None = None) -> Block:
        # The pool builds every object through here: they all belong to this allocator.
        return PrefixCachingBlock(prev_block=prev_block, token_ids=token_ids, block_size=block_size,
                                  block_id=block_id, allocator=self, computed=computed, extra_hash=extra_hash)

    # ---- Allocation -----------------------------------------------------------------------------
    def allocate_immutable_block(self, prev_block: Block | None, token_ids: list[int],
                                 extra_hash: int | None = None, device: Device | None = None) -> Block:
        """A full block of ``token_ids`` after ``prev_block``: the cached block if this prefix is
        cached (a hit), else a fresh block promoted to the cache (a miss)."""
        self._no_device(device)
        check_block("prev_block", prev_block, optional=True)
        check_extra_hash(extra_hash)
        token_ids = check_token_ids("token_ids", token_ids)
        if len(token_ids) != self._block_size:
            raise BlockStateError(f"an immutable block needs exactly {self._block_size} tokens, got {len(token_ids)}")
        block = self._block_pool.init_block(prev_block=prev_block, token_ids=token_ids, block_size=self._block_size,
                                            physical_block_id=None, extra_hash=extra_hash)
        content_hash = block.content_hash
        if content_hash is None:
            self._block_pool.free_block(block)
            raise BlockStateError("an immutable block needs a hashed previous block")

        cached_block_id = self._cached_blocks.get(content_hash)
        if cached_block_id is not None:
            self.metric_data.query(hit=True)
            block.block_id = cached_block_id
            self._incr_refcount_cached_block(block)
            return block

        self._block_pool.free_block(block)
        if self.get_num_free_blocks() == 0:              # before the query: a failure counts nothing
            raise BlockAllocator.NoFreeBlocksError("no free block for an uncached prefix block")
        self.metric_data.query(hit=False)
        block = self.allocate_mutable_block(prev_block=prev_block, extra_hash=extra_hash)
        block.append_token_ids(token_ids)                # fills the block, which promotes it
        return block

    def allocate_immutable_blocks(self, prev_block: Block | None, block_token_ids: list[list[int]],
                                  extra_hash: int | None = None, device: Device | None = None) -> list[Block]:
        """One ``allocate_immutable_block`` per chunk, chained. All or nothing: a hit on a held
        block takes no free block, so when the chunks outnumber the free blocks the call is
        rehearsed on a copy first."""
        self._no_device(device)
        check_block("prev_block", prev_block, optional=True)
        check_extra_hash(extra_hash)
        block_token_ids = check_block_token_ids(block_token_ids)
        for token_ids in block_token_ids:
            if len(token_ids) != self._block_size:
                raise BlockStateError(f"an immutable block needs exactly {self._block_size} tokens, "
                                      f"got {len(token_ids)}")
        if len(block_token_ids) > self.get_num_free_blocks():
            rehearse(lambda s: s[0]._allocate_immutable_blocks(s[1], block_token_ids, extra_hash),
                     (self, prev_block))
        return self._allocate_immutable_blocks(prev_block, block_token_ids, extra_hash)

    def _allocate_immutable_blocks(self, prev_block: Block | None, block_token_ids: list[list[int]],
                                   extra_hash: int | None) -> list[Block]:
        blocks = []
        for token_ids in block_token_ids:
            prev_block = self.allocate_immutable_block(prev_block=prev_block, token_ids=token_ids,
                                                       extra_hash=extra_hash)
            blocks.append(prev_block)
        return blocks

    # The same steps as the naive allocator's; the ids come and go through this class's own
    # _allocate_block_id (which may evict) and _free_block_id (which may park in the evictor).
    _no_device = staticmethod(NaiveBlockAllocator._no_device)
    allocate_mutable_block = NaiveBlockAllocator.allocate_mutable_block
    cow_block_if_not_appendable = NaiveBlockAllocator.cow_block_if_not_appendable
    clear_copy_on_writes = NaiveBlockAllocator.clear_copy_on_writes
    swap_out = NaiveBlockAllocator.swap_out
    _swap_in = NaiveBlockAllocator._swap_in

    def _allocate_block_id(self) -> BlockId:
        """A free id from the hashless free list, else one taken back from the evictor."""
        block_id = self._maybe_allocate_hashless_block_id()
        if block_id is None:
            block_id = self._maybe_allocate_evicted_block_id()
        if block_id is None:
            raise BlockAllocator.NoFreeBlocksError("no free or evictable blocks")
        return block_id

    def _maybe_allocate_hashless_block_id(self) -> BlockId | None:
        try:
            block_id = self._hashless_allocator._allocate_block_id()
        except BlockAllocator.NoFreeBlocksError:
            return None
        self._track_block_id(block_id, computed=False)
        return block_id

    def _maybe_allocate_evicted_block_id(self) -> BlockId | None:
        if self.evictor.num_blocks == 0:
            return None
        block_id, content_hash = self.evictor.evict()
        if self._cached_blocks.get(content_hash) != block_id or self._refcounter.get(block_id) != 0:
            raise BlockStateError(f"evicted block {block_id} is not a cached block nobody holds")
        del self._cached_blocks[content_hash]            # its contents are about to be overwritten
        self._touched_blocks.discard(block_id)
        self._refcounter.incr(block_id)
        self._track_block_id(block_id, computed=False)
        return block_id

    # ---- Reference counts on the two paths --------------------------------------------------------
    def _incr_refcount_cached_block(self, block: Block) -> None:
        """A new holder of a cached block; the first one takes it back out of the evictor. The
        block is computed if its KV was written (vLLM takes every hit as computed, though the
        first holder may still be writing it, or may have been freed before it did)."""
        block_id = block.block_id
        if self._refcounter.incr(block_id) == 1:
            if block_id in self.evictor:
                self.evictor.remove(block_id)
            self._track_block_id(block_id, computed=block_id not in self._touched_blocks)
        block.computed = self._block_tracker[block_id].computed

    def _decr_refcount_cached_block(self, block: Block) -> None:
        """A holder of a cached block lets go; the last one parks it in the evictor."""
        block_id = block.block_id
        if self._refcounter.decr(block_id) == 0:
            content_hash = block.content_hash
            if self._cached_blocks.get(content_hash) != block_id:
                raise BlockStateError(f"block {block_id} has a hash but is not the cached block for it")
            self.evictor.add(block_id, content_hash, block.num_tokens_total,
                             self._block_tracker[block_id].last_accessed)
            self._untrack_block_id(block_id)
        block.block_id = None

    def _decr_refcount_hashless_block(self, block: Block) -> None:
        block_id = block.block_id
        if self._refcounter.get(block_id) == 1:
            self._untrack_block_id(block_id)
        self._hashless_allocator.free(block, keep_block_object=True)

    def _track_block_id(self, block_id: BlockId, computed: bool) -> None:
        self._block_tracker[block_id].enable()
        self._block_tracker[block_id].computed = computed

    def _untrack_block_id(self, block_id: BlockId) -> None:
        self._block_tracker[block_id].disable()

    # ---- Freeing and forking ------------------------------------------------------------------------
    def free(self, block: Block, keep_block_object: bool = False) -> None:
        """Drop the block's hold on its id; the last holder of a cached block parks it in the
        evictor (still cached, and computed only if it was). TypeError for a non-block."""
        check_block("block", block)
        self._free_block_id(block)
        if not keep_block_object:
            self._block_pool.free_block(block)

    def _free_block_id(self, block: Block) -> None:
        if block.block_id is None:
            raise BlockStateError("the block has no physical id: freed twice?")
        if block.block_id not in self._block_tracker:
            raise UnknownBlockIdError(f"block id {block.block_id} does not belong to this allocator")
        if block.content_hash is not None:
            self._decr_refcount_cached_block(block)
        else:
            self._decr_refcount_hashless_block(block)

    def free_block_id(self, block_id: BlockId) -> None:
        """Give back an id held by no block object (used when emptying the evictor)."""
        if not is_int(block_id):
            raise TypeError(f"block_id must be an int, got {block_id!r}")
        if self._refcounter.get(block_id) == 1:
            self._untrack_block_id(block_id)
        self._hashless_allocator.free_block_id(block_id)

    def fork(self, last_block: Block) -> list[Block]:
        """The naive fork (each id gains a holder, the blocks keep their ``extra_hash``). Same
        tokens, same prefix: the forks also keep the source's hash and token total, which stay
        right even where a sliding window has cut the source's chain."""
        forked_blocks = NaiveBlockAllocator.fork(self, last_block)
        for source, forked in zip(get_all_blocks_recursively(last_block), forked_blocks):
            forked._cached_content_hash = source.content_hash
            forked._cached_num_tokens_total = source.num_tokens_total
        return forked_blocks

    # ---- Counts and ids ---------------------------------------------------------------------------
    def get_num_free_blocks(self, device: Device | None = None) -> int:
        self._no_device(device)
        return self._hashless_allocator.get_num_free_blocks() + self.evictor.num_blocks

    def get_num_total_blocks(self) -> int:
        return self._hashless_allocator.get_num_total_blocks()

    def get_physical_block_id(self, absolute_id: int) -> int:
        return self._hashless_allocator.get_physical_block_id(absolute_id)

    @property
    def refcounter(self):
        return self._refcounter.as_readonly()

    @property
    def all_block_ids(self) -> FrozenSet[int]:
        return self._hashless_allocator.all_block_ids

    @property
    def free_block_ids(self) -> list[BlockId]:
        """The never-cached free ids, in the order allocations take them (a copy); once they run
        out, allocations take the evictor's blocks, in ``evictor.eviction_order()``."""
        return self._hashless_allocator.free_block_ids

    @property
    def block_size(self) -> int:
        return self._block_size

    # ---- Prefix cache ---------------------------------------------------------------------------
    def get_prefix_cache_hit_rate(self) -> float:
        return self.metric_data.get_hit_rate()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; refused (False) while any block is held."""
        num_used_blocks = self.get_num_total_blocks() - self.get_num_free_blocks()
        if num_used_blocks > 0:
            return False
        while (block_id := self._maybe_allocate_evicted_block_id()) is not None:
            self.free_block_id(block_id)             # back to the hashless free list
        if self._cached_blocks:
            raise BlockStateError("cached blocks remain after emptying the evictor")
        self._touched_blocks.clear()
        self.evictor = make_evictor(EvictionPolicy.LRU)
        self._block_tracker = {i: BlockTracker() for i in self._block_tracker}
        self.metric_data = CacheMetricData()
        return True

    def is_block_cached(self, block: Block) -> bool:
        check_block("block", block)
        if block.content_hash is None:
            raise BlockStateError("only a full, hashed block can be cached")
        return block.content_hash in self._cached_blocks

    def promote_to_immutable_block(self, block: Block) -> BlockId:
        """A block just became full: cache it under its hash, or, if that prefix is cached
        already, give back its own id and share the cached one (no copy is needed: same
        tokens, same KV)."""
        check_block("block", block)
        content_hash = block.content_hash
        if content_hash is None or block.block_id is None or self._refcounter.get(block.block_id) == 0:
            raise BlockStateError("only a full, held block can be promoted")
        if content_hash not in self._cached_blocks:
            self._cached_blocks[content_hash] = block.block_id
            self._touched_blocks.add(block.block_id)
            return block.block_id
        self._decr_refcount_hashless_block(block)
        block.block_id = self._cached_blocks[content_hash]
        self._incr_refcount_cached_block(block)
        return block.block_id

    # ---- Access times and computed state ------------------------------------------------------------
    def mark_blocks_as_accessed(self, block_ids: list[int], now: float) -> None:
        """Stamp held blocks (in their tracker) and waiting ones (in the evictor) with ``now``.
        Everything is checked first (a str or NaN time would only fail later, inside the
        evictor's heap, in the middle of someone's ``free``)."""
        block_ids = check_block_ids("block_ids", block_ids)
        check_time("now", now)
        for block_id in block_ids:
            if block_id not in self._block_tracker:
                raise UnknownBlockIdError(f"block id {block_id} does not belong to this allocator")
            if not self._block_tracker[block_id].active and block_id not in self.evictor:
                raise ValueError("Mark block as accessed which is not belonged to GPU")
        for block_id in block_ids:
            if self._block_tracker[block_id].active:
                self._block_tracker[block_id].last_accessed = now
            else:
                self.evictor.update(block_id, now)

    def mark_blocks_as_computed(self, block_ids: list[int]) -> None:
        """Record that blocks' KV has been written, so they may be shared as computed.

        Given ids (each held, or waiting in the evictor), exactly those blocks; one that is not
        a cached block (still filling up) is skipped: it is marked once full. Given none, every
        cached block not computed yet, as vLLM does for any argument: the caller vouches that
        all their KV is written. The block manager passes ids, as far as each sequence's
        computed tokens reach, so a chunk never marks the blocks of the chunks after it.
        """
        block_ids = check_block_ids("block_ids", block_ids)
        if not block_ids:
            for block_id in self._touched_blocks:
                tracker = self._block_tracker[block_id]
                if tracker.active:
                    tracker.computed = True
            self._touched_blocks.clear()
            return
        for block_id in block_ids:                       # all checked before any is marked
            tracker = self._block_tracker.get(block_id)
            if tracker is None:
                raise UnknownBlockIdError(f"block id {block_id} does not belong to this allocator")
            if not tracker.active and block_id not in self.evictor:
                raise ValueError(f"block {block_id} is free: only a held or cached block can be marked computed")
        self._mark_ids_computed(block_ids)

    def _mark_ids_computed(self, block_ids: list[int]) -> None:
        """Mark the cached blocks among ``block_ids`` computed (no checks: the manager's path)."""
        touched = self._touched_blocks
        if not touched:
            return
        for block_id in block_ids:
            if block_id in touched:
                touched.discard(block_id)
                tracker = self._block_tracker[block_id]
                if tracker.active:
                    tracker.computed = True

    def block_is_computed(self, block_id: int) -> bool:
        """Is the block's KV written? A held block says so in its tracker; a block nobody holds
        only if it waits in the evictor having been computed before its last holder let go
        (vLLM counts every block in the evictor as computed, so a request freed after its
        first prefill chunk left its whole prompt there to be skipped by the next one)."""
        if not is_int(block_id):
            raise TypeError(f"block_id must be an int, got {block_id!r}")
        tracker = self._block_tracker.get(block_id)
        if tracker is None:
            raise UnknownBlockIdError(f"block id {block_id} does not belong to this allocator")
        if tracker.active:
            return tracker.computed
        return block_id in self.evictor and block_id not in self._touched_blocks

    def get_common_computed_block_ids(self, computed_seq_block_ids: list[list[int]]) -> list[int]:
        """The longest id prefix shared by every non-empty list (one list comes back as is).

        vLLM returns ``''`` (``os.path.commonprefix`` of nothing) when every list is empty; here
        it is ``[]``."""
        check_computed_seq_block_ids(computed_seq_block_ids)
        if len(computed_seq_block_ids) == 1:
            return computed_seq_block_ids[0]
        lists = [ids for ids in computed_seq_block_ids if ids]
        if not lists:
            return []
        common = []
        for column in zip(*lists):
            if any(block_id != column[0] for block_id in column):
                break
            common.append(column[0])
        return common

    def get_num_full_blocks_touched(self, blocks: list[Block]) -> int:
        """Full blocks that would take a free block here: not cached, or cached but waiting in
        the evictor (reviving it takes it out of the free count)."""
        check_blocks("blocks", blocks)
        num_touched_blocks = 0
        for block in blocks:
            if block.is_full and (not self.is_block_cached(block)
                                  or self._cached_blocks[block.content_hash] in self.evictor):
                num_touched_blocks += 1
        return num_touched_blocks

    # ---- Swapping ---------------------------------------------------------------------------------
    def swap_in(self, blocks: list[Block]) -> None:
        """Give each block an id here, keeping its object; full blocks may hit the cache (so
        more blocks than are free may fit: then the swap is rehearsed on a copy first)."""
        blocks = check_blocks("blocks", blocks, distinct=True)
        if any(block.block_id is not None for block in blocks):
            raise BlockStateError("swap_in takes blocks with no physical id (swapped out first)")
        if len(blocks) > self.get_num_free_blocks():
            rehearse(lambda s: s[0]._swap_in(s[1]), (self, blocks))
        self._swap_in(blocks)

    def find_cached_blocks_prefix(self, block_hashes: list[int]) -> list[int]:
        """The leading hashes whose blocks are cached with their KV computed, up to the first
        that is not.

        vLLM binary-searches, assuming the cached blocks of a chain always form a prefix. They
        need not: a sliding window frees a table's first blocks into the evictor while later
        ones are held, and a block freed with no access time is evicted before the blocks after
        it. The search could then land past a missing block and claim KV that is not there;
        a scan stops at the first miss.
        """
        check_block_ids("block_hashes", block_hashes)
        num_cached = 0
        for content_hash in block_hashes:
            block_id = self._cached_blocks.get(content_hash)
            if block_id is None or not self.block_is_computed(block_id):
                break
            num_cached += 1
        return block_hashes[:num_cached]


class PrefixCachingBlock(Block):
    """A block whose full contents are named by a hash chained through its predecessors.

    The tokens live in an inner ``NaiveBlock`` (which does the copy on write); this class adds
    the hash, the running token total of the chain, and promotion once the block fills up.
    """

    # The "previous hash" of a first block: fixed, the same in every process (prefix_caching_hash).
    _none_hash: int = NONE_HASH
    # Previous hashes that mean "the previous block has no hash": ours, vLLM's per-process
    # sentinel (its tests mock an unhashed predecessor with it) and None.
    _unhashed: tuple = (None, _none_hash, hash("None"))

    def __init__(self, prev_block: Block | None, token_ids: list[int], block_size: int,
                 allocator: BlockAllocator, block_id: int | None = None, computed: bool = False,
                 extra_hash: int | None = None):
        if not isinstance(allocator, PrefixCachingBlockAllocator):
            raise BlockTypeError(f"a PrefixCachingBlock needs a PrefixCachingBlockAllocator, got "
                                 f"{type(allocator).__name__}")
        if prev_block is not None and not isinstance(prev_block, PrefixCachingBlock):
            raise BlockTypeError(f"prev_block must be a PrefixCachingBlock, got {type(prev_block).__name__}")
        self._prev_block = prev_block
        self._cached_content_hash: int | None = None
        self._cached_num_tokens_total = 0
        self._allocator = allocator
        self._last_accessed: float = _DEFAULT_LAST_ACCESSED_TIME
        self._computed = computed
        self._extra_hash = extra_hash
        # A pooled object is re-initialised in place: reuse its inner block too.
        if hasattr(self, "_block"):
            self._block.__init__(prev_block=prev_block, token_ids=token_ids, block_size=block_size,
                                 block_id=block_id, allocator=self._allocator)
        else:
            self._block = NaiveBlock(prev_block=prev_block, token_ids=token_ids, block_size=block_size,
                                     block_id=block_id, allocator=self._allocator)
        self._update_num_tokens_total()

    @property
    def allocator(self) -> BlockAllocator:
        """The allocator that owns this block's id."""
        return self._allocator

    def forget_prev_block(self) -> None:
        """Cut the chain before this block (the sliding window dropped its predecessors). Its
        hash and token total are settled first, so they do not change."""
        _ = self.content_hash
        self._prev_block = None
        self._block.forget_prev_block()

    def _bind_allocator(self, allocator: BlockAllocator) -> None:
        """The allocator that now owns this block's id (after a swap to its device)."""
        self._allocator = allocator
        self._block._bind_allocator(allocator)

    def _update_num_tokens_total(self) -> None:
        previous = self._prev_block.num_tokens_total if self._prev_block is not None else 0
        self._cached_num_tokens_total = previous + len(self.token_ids)

    def append_token_ids(self, token_ids: list[int]) -> None:
        """Add tokens (copying on write if shared); a block that fills up is promoted."""
        if self.content_hash is not None or self.computed:
            raise BlockStateError("cannot append to a full, immutable block")
        if len(token_ids) == 0:
            return
        self._block.append_token_ids(token_ids)
        self._update_num_tokens_total()
        if self.content_hash is not None:
            self.block_id = self._allocator.promote_to_immutable_block(self)

    @property
    def block_id(self) -> int | None:
        return self._block.block_id

    @block_id.setter
    def block_id(self, value: int | None) -> None:
        self._block.block_id = value

    @property
    def computed(self) -> bool:
        return self._computed

    @computed.setter
    def computed(self, value: bool) -> None:
        self._computed = value

    @property
    def last_accessed(self) -> float:
        return self._last_accessed

    @last_accessed.setter
    def last_accessed(self, last_accessed_ts: float) -> None:
        self._last_accessed = last_accessed_ts

    @property
    def is_full(self) -> bool:
        return self._block.is_full

    @property
    def num_empty_slots(self) -> int:
        return self._block.num_empty_slots

    @property
    def num_tokens_total(self) -> int:
        return self._cached_num_tokens_total

    @property
    def block_size(self) -> int:
        return self._block.block_size

    @property
    def token_ids(self) -> list[int]:
        return self._block.token_ids

    @property
    def prev_block(self) -> Block | None:
        return self._prev_block

    @property
    def extra_hash(self) -> int | None:
        return self._extra_hash

    @property
    def content_hash(self) -> int | None:
        """The hash of this block and its whole prefix; None until the block is full, or if the
        previous block has no hash."""
        if self._cached_content_hash is not None:
            return self._cached_content_hash
        if not self.is_full:
            return None
        is_first_block = self._prev_block is None
        prev_block_hash = None if is_first_block else self._prev_block.content_hash
        if not is_first_block and prev_block_hash in self._unhashed:
            return None
        self._cached_content_hash = PrefixCachingBlock.hash_block_tokens(
            is_first_block, prev_block_hash, cur_block_token_ids=self.token_ids, extra_hash=self._extra_hash)
        return self._cached_content_hash

    @classmethod
    def hash_block_tokens(cls, is_first_block: bool, prev_block_hash: Optional[int], cur_block_token_ids: list[int],
                          extra_hash: Optional[int] = None) -> int:
        """Hash a block's tokens together with the hash of everything before it
        (``prefix_caching_hash.hash_block_tokens``, with this class's ``_none_hash``)."""
        return hash_block_tokens(is_first_block, prev_block_hash, cur_block_token_ids, extra_hash,
                                 none_hash=cls._none_hash)


__all__ = ["BlockTracker", "ComputedBlocksTracker", "LastAccessBlocksTracker", "PrefixCachingBlock",
           "PrefixCachingBlockAllocator", "PrefixHash"]
