"""The LRU evictor's order, stale entries, and its errors."""
import pytest

from paged_attention.legacy.evictor import EvictionPolicy, LRUEvictor, make_evictor


def _drain(evictor):
    order = []
    while evictor.num_blocks:
        order.append(evictor.evict())
    return order


def test_oldest_first_then_longest_prefix_then_lowest_id_then_lowest_hash():
    e = make_evictor(EvictionPolicy.LRU)
    e.add(block_id=5, content_hash=50, num_hashed_tokens=16, last_accessed=2.0)
    e.add(block_id=1, content_hash=10, num_hashed_tokens=16, last_accessed=1.0)
    e.add(block_id=2, content_hash=20, num_hashed_tokens=32, last_accessed=1.0)   # the tail of a chain
    e.add(block_id=0, content_hash=99, num_hashed_tokens=16, last_accessed=1.0)
    e.add(block_id=3, content_hash=30, num_hashed_tokens=16, last_accessed=0.5)
    assert 2 in e and 4 not in e and e.num_blocks == 5
    assert _drain(e) == [(3, 30), (2, 20), (0, 99), (1, 10), (5, 50)]
    with pytest.raises(ValueError, match="No usable cache memory left"):
        e.evict()


def test_update_moves_a_block_back_and_keeps_it_evictable():
    e = LRUEvictor()
    e.add(1, 10, 4, 1.0)
    e.add(2, 20, 4, 2.0)
    e.update(1, 3.0)                   # now the newest: block 2 goes first
    assert e.evict() == (2, 20)
    assert e.evict() == (1, 10)        # vLLM would raise here (its update pushes no heap entry)
    e.add(7, 70, 4, 1.0)
    e.update(7, 5.0)
    assert e.num_blocks == 1 and e.evict() == (7, 70)


def test_removed_and_readded_blocks_leave_no_usable_stale_entry():
    e = LRUEvictor()
    e.add(1, 10, 4, 1.0)
    e.remove(1)
    assert 1 not in e and e.num_blocks == 0
    e.add(1, 11, 8, 1.0)               # same id and time, other content: the old entry is stale
    e.add(2, 20, 4, 0.0)
    assert _drain(e) == [(2, 20), (1, 11)]


def test_heap_is_rebuilt_when_stale_entries_pile_up():
    e = LRUEvictor()
    e.add(1, 10, 4, 0.0)
    for t in range(1, 200):
        e.update(1, float(t))
    assert len(e.priority_queue) <= LRUEvictor.CLEANUP_THRESHOLD * e.num_blocks + 1
    assert e.evict() == (1, 10)


def test_errors():
    e = LRUEvictor()
    with pytest.raises(ValueError, match="not in the evictor"):
        e.remove(3)
    with pytest.raises(KeyError):
        e.update(3, 1.0)
    with pytest.raises(ValueError):
        make_evictor("fifo")
