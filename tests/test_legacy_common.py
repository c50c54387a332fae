"""The shared types and the pieces every legacy allocator is built from."""
import pytest

from paged_attention.legacy.common import (BlockList, BlockPool, BlockStateError, CacheMetricData,
                                           CopyOnWriteTracker, RefCounter, UnknownBlockIdError,
                                           get_all_blocks_recursively)
from paged_attention.legacy.interfaces import AllocStatus, BlockAllocator
from paged_attention.utils import Device


class FakeBlock:
    """Just enough of a block for the pool and the list: tokens, an id, a chain, an allocator."""

    def __init__(self, prev_block, token_ids, block_size, allocator, block_id=None, computed=False, extra_hash=None):
        self.prev_block, self.token_ids, self.block_size = prev_block, list(token_ids), block_size
        self._allocator, self.block_id, self.extra_hash = allocator, block_id, extra_hash
        self.next_id_on_append = None

    def append_token_ids(self, token_ids):
        self.token_ids += token_ids
        if self.next_id_on_append is not None:          # as if copy on write moved the block
            self.block_id = self.next_id_on_append


def test_enum_values_and_error_types():
    assert (Device.GPU.value, Device.CPU.value) == (1, 2)
    assert [s.value for s in AllocStatus] == [1, 2, 3] and [s.name for s in AllocStatus] == ["OK", "LATER", "NEVER"]
    assert issubclass(BlockAllocator.NoFreeBlocksError, ValueError)
    assert issubclass(BlockStateError, ValueError) and issubclass(BlockStateError, AssertionError)
    assert issubclass(UnknownBlockIdError, KeyError) and issubclass(UnknownBlockIdError, AssertionError)


def test_refcounter_counts_and_refuses_going_below_zero():
    rc = RefCounter([3, 1, 3, 7])                         # duplicates collapse
    assert [rc.get(i) for i in (1, 3, 7)] == [0, 0, 0]
    assert rc.incr(3) == 1 and rc.incr(3) == 2 and rc.decr(3) == 1 and rc.decr(3) == 0
    with pytest.raises(AssertionError):
        rc.decr(3)
    with pytest.raises(ValueError, match="freed twice"):
        rc.decr(3)
    assert rc.get(3) == 0                                 # unchanged by the refused call
    for op in (rc.incr, rc.decr, rc.get):
        with pytest.raises(KeyError):
            op(2)
    view = rc.as_readonly()
    rc.incr(7)
    assert view.get(7) == 1
    with pytest.raises(ValueError, match="Incr not allowed"):
        view.incr(7)
    with pytest.raises(ValueError, match="Decr not allowed"):
        view.decr(7)
    assert rc.get(7) == 1


def test_cow_tracker_appendable_and_log():
    rc = RefCounter(range(4))
    tracker = CopyOnWriteTracker(rc.as_readonly())
    block = FakeBlock(None, [], 4, None)
    assert tracker.is_appendable(block)                   # no id yet
    block.block_id = 2
    assert tracker.is_appendable(block)                   # refcount 0
    rc.incr(2)
    assert tracker.is_appendable(block)                   # one holder
    rc.incr(2)
    assert not tracker.is_appendable(block)               # shared
    tracker.record_cow(2, 3)
    tracker.record_cow(2, 3)
    tracker.record_cow(0, 1)
    with pytest.raises(AssertionError):
        tracker.record_cow(None, 1)
    assert tracker.clear_cows() == [(2, 3), (2, 3), (0, 1)]
    assert tracker.clear_cows() == []


def test_block_pool_reuses_most_recent_and_doubles():
    owner = object()
    pool = BlockPool(4, FakeBlock, owner, pool_size=2)
    a = pool.init_block(None, [1, 2], 4, physical_block_id=10)
    b = pool.init_block(a, [3], 4, physical_block_id=11)
    assert (a.pool_id, b.pool_id) == (0, 1) and b.prev_block is a and a._allocator is owner
    c = pool.init_block(None, [], 4, physical_block_id=12)  # pool empty: grows to 4
    assert c.pool_id == 2
    pool.free_block(a)
    d = pool.init_block(None, [9], 4, physical_block_id=13, extra_hash=5)
    assert d is a and d.pool_id == 0 and d.token_ids == [9] and d.block_id == 13 and d.extra_hash == 5
    assert d.prev_block is None                           # constructor re-run: nothing stale
    empty = BlockPool(4, FakeBlock, owner, pool_size=0)
    assert empty.init_block(None, [], 4, physical_block_id=0).pool_id == 0
    with pytest.raises(ValueError):
        BlockPool(4, FakeBlock, owner, pool_size=-1)


def test_block_list_keeps_ids_in_step():
    blocks = [FakeBlock(None, [1], 4, None, block_id=i) for i in (5, 6)]
    bl = BlockList(blocks)
    ids = bl.ids()
    assert ids == [5, 6] and len(bl) == 2 and bl[1] is blocks[1]
    blocks[1].next_id_on_append = 9
    bl.append_token_ids(1, [2])
    assert bl.ids() == [5, 9] and bl.ids() is ids
    bl.append(FakeBlock(None, [], 4, None, block_id=3))
    bl[0] = FakeBlock(None, [], 4, None, block_id=8)
    assert ids == [8, 9, 3]
    with pytest.raises(AssertionError):
        bl.append(FakeBlock(None, [], 4, None))
    with pytest.raises(ValueError):
        bl.update([FakeBlock(None, [], 4, None, block_id=1), FakeBlock(None, [], 4, None)])
    assert ids == [8, 9, 3] and len(bl) == 3             # a refused update changes nothing
    bl.update([FakeBlock(None, [], 4, None, block_id=4)])
    assert bl.ids() == [4] and ids == [8, 9, 3]           # a list fetched before keeps its ids
    bl.reset()
    assert len(bl) == 0 and bl.ids() == [] and ids == [8, 9, 3]


def test_cache_metric_is_a_running_ratio():
    m = CacheMetricData()
    assert m.get_hit_rate() == 0.0
    for i in range(2500):                                 # two full buckets and a half
        m.query(hit=i % 4 == 0)
    assert m.num_completed_blocks == 2 and m.num_incompleted_block_queries == 500
    assert m.get_hit_rate() == pytest.approx(sum(i % 4 == 0 for i in range(2500)) / 2500)
    m2 = CacheMetricData()
    for hit in [True] * 1000 + [False] * 1000 + [True] * 10:
        m2.query(hit)
    assert m2.get_hit_rate() == pytest.approx(1010 / 2010)


def test_chain_from_first_to_last():
    a = FakeBlock(None, [], 4, None)
    b = FakeBlock(a, [], 4, None)
    c = FakeBlock(b, [], 4, None)
    assert get_all_blocks_recursively(c) == [a, b, c] and get_all_blocks_recursively(a) == [a]
