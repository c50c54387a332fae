"""Prefix-caching blocks and allocator, hashes, eviction, computed state, trackers."""
import subprocess
import sys
from dataclasses import dataclass

import pytest

from paged_attention.legacy.interfaces import BlockAllocator
from paged_attention.legacy.prefix_caching_block import (ComputedBlocksTracker, LastAccessBlocksTracker,
                                                         PrefixCachingBlock, PrefixCachingBlockAllocator)

BS = 4


def _allocator(num_blocks=4, block_size=BS):
    return PrefixCachingBlockAllocator(num_blocks=num_blocks, block_size=block_size)


def _chain(a, token_ids, prev=None):
    """Allocate ``token_ids`` as full immutable blocks then a partial mutable one."""
    chunks = [token_ids[i:i + BS] for i in range(0, len(token_ids), BS)]
    full = [c for c in chunks if len(c) == BS]
    blocks = a.allocate_immutable_blocks(prev, full) if full else []
    if len(chunks) > len(full):
        tail = a.allocate_mutable_block(blocks[-1] if blocks else prev)
        tail.append_token_ids(chunks[-1])
        blocks.append(tail)
    return blocks


def _state(a):
    return (a.get_num_free_blocks(), {i: a.refcounter.get(i) for i in a.all_block_ids}, dict(a._cached_blocks),
            dict(a.evictor.free_table), a.get_prefix_cache_hit_rate(), a.metric_data.num_incompleted_block_queries)


# ---- hashes -------------------------------------------------------------------------------------

def test_hashes_chain_through_the_prefix_and_the_extra_hash():
    a = _allocator(num_blocks=8)
    b0, b1 = a.allocate_immutable_blocks(None, [[1, 2, 3, 4], [5, 6, 7, 8]])
    assert b0.content_hash == PrefixCachingBlock.hash_block_tokens(True, None, [1, 2, 3, 4])
    assert b1.content_hash == PrefixCachingBlock.hash_block_tokens(False, b0.content_hash, [5, 6, 7, 8])
    # Same tokens after another prefix, or with another extra hash: another block.
    c0, c1 = a.allocate_immutable_blocks(None, [[9, 9, 9, 9], [5, 6, 7, 8]])
    assert c1.content_hash != b1.content_hash and c1.block_id != b1.block_id
    (d0,) = a.allocate_immutable_blocks(None, [[1, 2, 3, 4]], extra_hash=7)
    assert d0.content_hash != b0.content_hash
    assert PrefixCachingBlock.hash_block_tokens(True, None, [1], extra_hash=0) != \
        PrefixCachingBlock.hash_block_tokens(True, None, [1])


def test_hashes_are_the_same_in_every_process():
    code = ("from paged_attention.legacy.prefix_caching_block import PrefixCachingBlock as P;"
            "h = P.hash_block_tokens(True, None, [1, 2, 3]);"
            "print(P._none_hash, h, P.hash_block_tokens(False, h, [4, 5, 6], extra_hash=hash(3)))")
    runs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": seed, "PATH": ""}).stdout for seed in ("1", "2")}
    assert len(runs) == 1
    h = PrefixCachingBlock.hash_block_tokens(True, None, [1, 2, 3])
    assert runs.pop().split() == [str(PrefixCachingBlock._none_hash), str(h),
                                  str(PrefixCachingBlock.hash_block_tokens(False, h, [4, 5, 6], extra_hash=3))]


def test_partial_blocks_and_blocks_after_an_unhashed_one_have_no_hash():
    a = _allocator()
    partial = a.allocate_mutable_block(None)
    partial.append_token_ids([1, 2])
    assert partial.content_hash is None
    for sentinel in (None, PrefixCachingBlock._none_hash, hash("None")):
        prev = PrefixCachingBlock(None, [1], BS, a)
        prev._cached_content_hash = sentinel       # a predecessor that "has no hash"
        assert PrefixCachingBlock(prev, [1, 2, 3, 4], BS, a).content_hash is None
    with pytest.raises(ValueError):                # a full block needs a hashed predecessor
        a.allocate_immutable_block(partial, [5, 6, 7, 8])
    with pytest.raises(TypeError):
        PrefixCachingBlock(None, [1], BS, allocator=object())


# ---- hits, promotion, copy on write -----------------------------------------------------------------

def test_a_repeated_prefix_hits_the_cache_and_shares_its_blocks():
    a = _allocator()
    first = a.allocate_immutable_blocks(None, [[1, 2, 3, 4], [5, 6, 7, 8]])
    assert a.get_prefix_cache_hit_rate() == 0.0
    a.mark_blocks_as_computed([])                  # their KV is written: hits are computed
    second = a.allocate_immutable_blocks(None, [[1, 2, 3, 4], [5, 6, 7, 8]])
    assert [b.block_id for b in second] == [b.block_id for b in first] == [0, 1]
    assert a.refcounter.get(0) == 2 and a.get_num_free_blocks() == 2
    assert all(b.computed for b in second) and not first[0].computed
    assert a.get_prefix_cache_hit_rate() == 0.5


def test_a_block_that_fills_up_is_promoted_and_merges_with_a_cached_twin():
    a = _allocator()
    (cached,) = a.allocate_immutable_blocks(None, [[1, 2, 3, 4]])
    mutable = a.allocate_mutable_block(None)
    assert mutable.block_id == 1
    mutable.append_token_ids([1, 2])
    mutable.append_token_ids([3, 4])               # full: same prefix as block 0
    assert mutable.block_id == 0 and a.refcounter.get(0) == 2 and a.refcounter.get(1) == 0
    assert a.get_num_free_blocks() == 3 and a.clear_copy_on_writes() == []
    assert a.get_prefix_cache_hit_rate() == 0.0    # promotions are not cache queries
    with pytest.raises(AssertionError):            # a full block is immutable
        mutable.append_token_ids([5])
    with pytest.raises(ValueError):
        cached.append_token_ids([5])


def test_a_shared_partial_block_is_copied_on_write():
    a = _allocator()
    blocks = _chain(a, [1, 2, 3, 4, 5])
    forked = a.fork(blocks[-1])
    assert [b.block_id for b in forked] == [0, 1] and forked[0].extra_hash is None
    forked[-1].append_token_ids([6])
    assert forked[-1].block_id == 2 and blocks[-1].block_id == 1
    assert a.clear_copy_on_writes() == [(1, 2)]
    assert blocks[-1].token_ids == [5] and forked[-1].token_ids == [5, 6]


def test_newly_cached_blocks_count_as_computed_only_once_marked():
    a = _allocator()
    blocks = a.allocate_immutable_blocks(None, [[1, 2, 3, 4], [5, 6, 7, 8]])
    hashes = [b.content_hash for b in blocks]
    assert a.find_cached_blocks_prefix(hashes) == []
    assert not a.block_is_computed(0)
    a.mark_blocks_as_computed([])                  # the argument is ignored
    assert a.find_cached_blocks_prefix(hashes) == hashes
    assert a.find_cached_blocks_prefix(hashes + [12345]) == hashes
    a.free(blocks[1])                              # waiting in the evictor still counts
    assert a.block_is_computed(1) and a.find_cached_blocks_prefix(hashes) == hashes


# ---- freeing, the evictor, eviction -----------------------------------------------------------------

def test_freed_cached_blocks_wait_in_the_evictor_and_can_be_revived():
    a = _allocator()
    blocks = a.allocate_immutable_blocks(None, [[1, 2, 3, 4], [5, 6, 7, 8]])
    a.mark_blocks_as_computed([])                  # computed before they are freed
    for b in blocks:
        a.free(b)
    assert a.get_num_free_blocks() == 4 and a.evictor.num_blocks == 2 and 0 in a.evictor
    assert not a._block_tracker[0].active
    revived = a.allocate_immutable_blocks(None, [[1, 2, 3, 4]])
    assert revived[0].block_id == 0 and 0 not in a.evictor and a.refcounter.get(0) == 1
    assert a._block_tracker[0].active and a._block_tracker[0].computed
    with pytest.raises(ValueError):                # freed twice
        a.free(blocks[0])


def test_eviction_order_is_least_recently_used_then_chain_tail_first():
    a = _allocator(num_blocks=4)
    x = a.allocate_immutable_blocks(None, [[1, 1, 1, 1], [2, 2, 2, 2]])
    y = a.allocate_immutable_blocks(None, [[3, 3, 3, 3], [4, 4, 4, 4]])
    a.mark_blocks_as_accessed([b.block_id for b in x], now=10)
    a.mark_blocks_as_accessed([b.block_id for b in y], now=5)
    for b in x + y:
        a.free(b)
    a.mark_blocks_as_accessed([0], now=20)         # in the evictor: its time is updated there
    # y is older (5): its tail (id 3, 8 tokens) before its head (id 2); then x's tail; then 0.
    got = [a.allocate_mutable_block(None).block_id for _ in range(4)]
    assert got == [3, 2, 1, 0]
    assert a._cached_blocks == {}                  # evicting forgets the hash
    with pytest.raises(BlockAllocator.NoFreeBlocksError):
        a.allocate_mutable_block(None)
    fresh = PrefixCachingBlockAllocator(num_blocks=2, block_size=BS)
    with pytest.raises(ValueError, match="not belonged to GPU"):   # neither held nor waiting
        fresh.mark_blocks_as_accessed([1], now=1)
    with pytest.raises(KeyError):
        fresh.mark_blocks_as_accessed([9], now=1)


def test_free_blocks_count_the_evictor_and_full_blocks_touched_counts_what_swapping_would_take():
    a = _allocator(num_blocks=6)
    held = a.allocate_immutable_blocks(None, [[1, 2, 3, 4]])
    parked = a.allocate_immutable_blocks(None, [[5, 6, 7, 8]])
    a.free(parked[0])
    probe_a = _allocator(num_blocks=6)             # block objects to ask about
    ask = probe_a.allocate_immutable_blocks(None, [[1, 2, 3, 4], [9, 9, 9, 9]])
    ask_parked = probe_a.allocate_immutable_blocks(None, [[5, 6, 7, 8]])
    partial = probe_a.allocate_mutable_block(None)
    # Held here: 0 touched; not cached: 1; cached but parked in the evictor: 1; partial: 0.
    assert a.get_num_full_blocks_touched(ask + ask_parked + [partial]) == 2
    assert a.get_num_free_blocks() == 5 and held[0].block_id == 0


def test_reset_prefix_cache_is_refused_while_blocks_are_held():
    a = _allocator()
    first = a.allocate_immutable_blocks(None, [[1, 2, 3, 4]])
    second = a.allocate_immutable_blocks(None, [[1, 2, 3, 4]])
    assert a.reset_prefix_cache() is False and a.get_prefix_cache_hit_rate() == 0.5
    a.free(first[0])
    assert a.reset_prefix_cache() is False         # the second holder remains
    a.free(second[0])
    assert a.get_num_free_blocks() == 4 and a.evictor.num_blocks == 1
    assert a.reset_prefix_cache() is True
    assert a._cached_blocks == {} and a.evictor.num_blocks == 0 and a.get_prefix_cache_hit_rate() == 0.0
    assert a.get_num_free_blocks() == 4 and not any(t.active for t in a._block_tracker.values())
    assert a.allocate_immutable_blocks(None, [[1, 2, 3, 4]])[0].computed is False   # a miss now


def test_common_computed_block_ids():
    a = _allocator()
    assert a.get_common_computed_block_ids([[1, 2, 3]]) == [1, 2, 3]
    assert a.get_common_computed_block_ids([[1, 2, 3], [1, 2, 4], []]) == [1, 2]
    assert a.get_common_computed_block_ids([[], []]) == []       # vLLM returns ''
    assert a.get_common_computed_block_ids([[5], [6]]) == []


# ---- all or nothing --------------------------------------------------------------------------------

def test_immutable_blocks_that_hit_held_blocks_need_no_free_blocks():
    a = _allocator(num_blocks=3)
    a.allocate_immutable_blocks(None, [[1, 2, 3, 4], [5, 6, 7, 8]])
    # 3 chunks, 1 free block: fits, because the first two hit blocks already held.
    third = a.allocate_immutable_blocks(None, [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]])
    assert [b.block_id for b in third] == [0, 1, 2] and a.get_num_free_blocks() == 0


def test_running_out_part_way_changes_nothing_not_even_the_hit_rate():
    a = _allocator(num_blocks=3)
    kept = a.allocate_immutable_blocks(None, [[1, 2, 3, 4]])
    parked = a.allocate_immutable_blocks(None, [[7, 7, 7, 7]])
    a.free(parked[0])
    before = _state(a)
    with pytest.raises(BlockAllocator.NoFreeBlocksError):
        a.allocate_immutable_blocks(None, [[1, 2, 3, 4], [5, 5, 5, 5], [6, 6, 6, 6], [8, 8, 8, 8]])
    assert _state(a) == before and kept[0].block_id == 0
    shared = a.allocate_mutable_block(None)
    shared.append_token_ids([1])
    (fork,) = a.fork(shared)
    a.allocate_mutable_block(None)                 # takes the parked block: nothing free now
    before = _state(a)
    with pytest.raises(BlockAllocator.NoFreeBlocksError):
        fork.append_token_ids([2])                 # would copy on write
    assert _state(a) == before and fork.token_ids == [1]


def test_swap_in_of_full_blocks_hits_the_destination_cache():
    gpu = PrefixCachingBlockAllocator(num_blocks=4, block_size=BS, block_ids=range(4))
    cpu = PrefixCachingBlockAllocator(num_blocks=4, block_size=BS, block_ids=range(4, 8))
    resident = gpu.allocate_immutable_blocks(None, [[1, 2, 3, 4]])
    blocks = _chain(gpu, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert [b.block_id for b in blocks] == [0, 1, 2]
    gpu.swap_out(blocks)
    cpu.swap_in(blocks)
    assert [b.block_id for b in blocks] == [4, 5, 6] and gpu.refcounter.get(0) == 1
    cpu.swap_out(blocks)
    gpu.swap_in(blocks)
    assert blocks[0].block_id == resident[0].block_id == 0 and gpu.refcounter.get(0) == 2
    assert blocks[2].token_ids == [9] and cpu.get_num_free_blocks() == 4


# ---- trackers ------------------------------------------------------------------------------------------

@dataclass
class _Seq:
    seq_id: int
    tokens: list
    prefill: bool = True
    lora: int = 0

    def get_token_ids(self):
        return self.tokens

    def is_prefill(self):
        return self.prefill

    def extra_hash(self):
        return None if self.lora == 0 else hash(self.lora)


def test_computed_blocks_tracker_hashes_like_the_blocks_do():
    a = _allocator(num_blocks=8)
    tokens = list(range(10))
    blocks = _chain(a, tokens)
    a.mark_blocks_as_computed([])
    tracker = ComputedBlocksTracker(a, BS, enable_caching=True)
    seq = _Seq(1, tokens)
    assert tracker.get_num_cached_tokens(seq) == 8
    assert tracker._seq_id_to_blocks_hashes[1] == [b.content_hash for b in blocks[:2]]
    other = _Seq(2, tokens, lora=3)                # another LoRA: another hash, nothing cached
    assert tracker.get_num_cached_tokens(other) == 0
    seq.tokens = tokens + [10, 11]                 # still a prefill: the count is kept
    a.allocate_immutable_blocks(blocks[1], [[8, 9, 10, 11]])
    a.mark_blocks_as_computed([])
    assert tracker.get_num_cached_tokens(seq) == 8
    seq.prefill = False
    assert tracker.get_num_cached_tokens(seq) == 12
    tracker.remove_seq(1)
    assert 1 not in tracker
    with pytest.raises(KeyError):
        tracker.remove_seq(1)
    off = ComputedBlocksTracker(a, BS, enable_caching=False)
    assert off.get_num_cached_tokens(seq) == 0
    off.remove_seq(99)                             # nothing tracked when caching is off


def test_last_access_tracker_stamps_blocks_only_once_a_time_is_known():
    a = _allocator()
    (block,) = a.allocate_immutable_blocks(None, [[1, 2, 3, 4]])
    tracker = LastAccessBlocksTracker(a)
    tracker.add_seq(1)
    with pytest.raises(ValueError):
        tracker.add_seq(1)
    tracker.update_seq_blocks_last_access(1, [0])
    assert a._block_tracker[0].last_accessed == -1
    tracker.update_last_access(1, 7.5)
    tracker.update_seq_blocks_last_access(1, [0])
    assert a._block_tracker[0].last_accessed == 7.5
    tracker.remove_seq(1)
    with pytest.raises(KeyError):
        tracker.update_last_access(1, 1.0)
