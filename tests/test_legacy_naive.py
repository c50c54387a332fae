"""The naive block allocator and block (LIFO ids, forks, copy on write, swaps)."""
import pytest

from paged_attention.legacy.interfaces import BlockAllocator
from paged_attention.legacy.naive_block import NaiveBlock, NaiveBlockAllocator


def _allocator(num_blocks=4, block_size=4, **kw):
    return NaiveBlockAllocator(create_block=NaiveBlock, num_blocks=num_blocks, block_size=block_size, **kw)


def _counts(a):
    return a.get_num_free_blocks(), {i: a.refcounter.get(i) for i in a.all_block_ids}


def test_ids_ascend_then_are_reused_last_in_first_out():
    a = _allocator()
    blocks = a.allocate_immutable_blocks(None, [[1, 2, 3, 4], [5, 6, 7, 8], [9]])
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert blocks[1].prev_block is blocks[0] and blocks[2].token_ids == [9]
    a.free(blocks[0])
    a.free(blocks[2])
    assert blocks[0].block_id is None
    assert a.allocate_mutable_block(None).block_id == 2          # the last freed comes back first
    assert a.allocate_mutable_block(None).block_id == 0
    assert a.allocate_mutable_block(None).block_id == 3
    with pytest.raises(BlockAllocator.NoFreeBlocksError):
        a.allocate_mutable_block(None)


def test_all_or_nothing_when_blocks_run_out():
    a = _allocator()
    a.allocate_mutable_block(None)
    before = _counts(a)
    with pytest.raises(BlockAllocator.NoFreeBlocksError):
        a.allocate_immutable_blocks(None, [[1]] * 4)
    assert _counts(a) == before
    with pytest.raises(ValueError):                                # NoFreeBlocksError is a ValueError
        a.allocate_immutable_blocks(None, [[1]] * 5)


def test_fork_then_append_copies_on_write():
    a = _allocator()
    first, last = a.allocate_immutable_blocks(None, [[1, 2, 3, 4], [5, 6]])
    forked = a.fork(last)
    assert [b.block_id for b in forked] == [0, 1] and forked[1].prev_block is forked[0]
    assert a.refcounter.get(0) == 2 and a.refcounter.get(1) == 2
    forked[1].append_token_ids([7])                                # shared: moves to a fresh id
    assert forked[1].block_id == 2 and last.block_id == 1
    assert a.refcounter.get(1) == 1 and a.refcounter.get(2) == 1
    last.append_token_ids([8])                                     # now sole holder: in place
    assert last.block_id == 1
    assert a.clear_copy_on_writes() == [(1, 2)] and a.clear_copy_on_writes() == []
    assert forked[1].token_ids == [5, 6, 7] and last.token_ids == [5, 6, 8]


def test_copy_on_write_without_a_free_block_changes_nothing():
    a = _allocator(num_blocks=2)
    (block,) = a.allocate_immutable_blocks(None, [[1, 2]])
    (forked,) = a.fork(block)
    a.allocate_mutable_block(None)                                 # the last free id
    before = _counts(a)
    with pytest.raises(BlockAllocator.NoFreeBlocksError):
        forked.append_token_ids([3])
    assert _counts(a) == before and forked.token_ids == [1, 2] and forked.block_id == 0
    assert a.clear_copy_on_writes() == []


def test_bad_calls_raise_and_leave_counts():
    a = _allocator()
    block = a.allocate_immutable_block(None, [1, 2, 3])
    with pytest.raises(AssertionError):                            # overflow, as vLLM asserts
        block.append_token_ids([4, 5])
    with pytest.raises(ValueError):
        a.allocate_immutable_block(None, [1, 2, 3, 4, 5])
    assert block.token_ids == [1, 2, 3]
    a.free(block, keep_block_object=True)
    before = _counts(a)
    with pytest.raises(ValueError, match="freed twice"):
        a.free(block)
    with pytest.raises(ValueError, match="freed"):
        a.fork(block)
    with pytest.raises(AssertionError):
        a.free_block_id(1)                                         # never allocated
    assert _counts(a) == before
    with pytest.raises(ValueError):
        _allocator(num_blocks=3, block_ids=[1, 1, 2])
    with pytest.raises(ValueError):
        a.allocate_mutable_block(None, device="gpu")


def test_physical_ids_and_full_blocks_touched():
    a = _allocator(num_blocks=3, block_ids=[12, 10, 11])
    assert [a.get_physical_block_id(i) for i in (10, 11, 12)] == [0, 1, 2]
    with pytest.raises(KeyError):
        a.get_physical_block_id(3)
    full, partial = a.allocate_immutable_blocks(None, [[1, 2, 3, 4], [5]])
    assert full.block_id == 12                                     # ids come out in the given order
    assert a.get_num_full_blocks_touched([full, full, partial]) == 1
    assert (a.get_prefix_cache_hit_rate(), a.reset_prefix_cache(), a.find_cached_blocks_prefix([1])) == (-1, True, [])
    assert a.get_common_computed_block_ids([[1, 2]]) == []
    with pytest.raises(NotImplementedError):
        a.promote_to_immutable_block(full)
    assert full.content_hash is None and full.extra_hash is None


def test_swap_out_and_in_keep_the_block_objects():
    a = _allocator()
    blocks = a.allocate_immutable_blocks(None, [[1, 2, 3, 4], [5, 6]])
    a.swap_out(blocks)
    assert a.get_num_free_blocks() == 4 and all(b.block_id is None for b in blocks)
    other = a.allocate_mutable_block(None)                         # takes id 1 (LIFO: 1 was freed last)
    a.swap_in(blocks)
    assert [b.token_ids for b in blocks] == [[1, 2, 3, 4], [5, 6]]
    assert [b.block_id for b in blocks] == [0, 2] and other.block_id == 1
    assert all(a.refcounter.get(b.block_id) == 1 for b in blocks)
    assert a.get_num_free_blocks() == 1
    with pytest.raises(BlockAllocator.NoFreeBlocksError):
        a.swap_in([a.allocate_mutable_block(None), blocks[0]])
