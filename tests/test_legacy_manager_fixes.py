"""Where vLLM's legacy block manager says yes and then cannot keep its word, or lets a prefill
skip KV that is not in the cache. Each test is a small, fixed reproduction of a case the
stateful tests found; the docstrings in ``block_manager.py`` and ``prefix_caching_block.py``
say what we do instead.
"""
import pytest

from paged_attention.legacy.block_manager import AllocStatus, SelfAttnBlockSpaceManager
from paged_attention.legacy.interfaces import BlockAllocator
from paged_attention.legacy.sequence import Sequence, SequenceGroup, SequenceStatus
from paged_attention.utils import Device


def admitted(mgr, seq_id, tokens):
    """A request through admission and its prefill, as the scheduler runs it."""
    seq = Sequence(seq_id, tokens, mgr.block_size)
    group = SequenceGroup(f"r{seq_id}", [seq])
    mgr.get_num_cached_tokens(seq)
    mgr.allocate(group)
    seq.status = SequenceStatus.RUNNING
    seq.data.update_num_computed_tokens(seq.get_len())
    mgr.mark_blocks_as_computed(group, seq.get_len())
    return seq, group


def really_cached_tokens(mgr, seq):
    """Leading blocks of ``seq`` whose hash is cached on the GPU with computed KV, in tokens."""
    gpu = mgr.block_allocator._allocators[Device.GPU]
    n = 0
    for h in mgr._computed_blocks_tracker._seq_id_to_blocks_hashes[seq.seq_id]:
        if h not in gpu._cached_blocks or not gpu.block_is_computed(gpu._cached_blocks[h]):
            break
        n += 1
    return n * mgr.block_size


def test_a_count_taken_while_waiting_is_not_kept_after_its_blocks_were_evicted():
    mgr = SelfAttnBlockSpaceManager(2, 4, 0, watermark=0, enable_caching=True)
    a, _ = admitted(mgr, 0, [0, 1, 2, 3])
    mgr.free(a)                                           # A's two blocks wait in the evictor
    b = Sequence(1, [0, 1, 2, 3, 4], 2)
    assert mgr.get_num_cached_tokens(b) == 4              # true while B waits...
    c, _ = admitted(mgr, 2, [5, 5, 6, 6, 7, 7, 8, 8])      # ...until C's prompt evicts them
    mgr.free(c)
    mgr.allocate(SequenceGroup("b", [b]))
    b.status = SequenceStatus.RUNNING
    assert mgr.get_num_cached_tokens(b) == really_cached_tokens(mgr, b)
    gpu = mgr.block_allocator._allocators[Device.GPU]
    assert all(gpu.block_is_computed(i) for i in mgr.get_common_computed_block_ids([b]))


def test_cached_prefix_stops_at_the_first_hole():
    # Without a window: blocks revived by a hit and swapped out go back to the evictor with no
    # access time, so one in the middle of a chain is evicted before the blocks after it.
    mgr = SelfAttnBlockSpaceManager(1, 5, 4, watermark=0, enable_caching=True)
    a, _ = admitted(mgr, 0, [0, 1, 2, 3, 4])
    mgr.access_all_blocks_in_seq(a, 5.0)
    mgr.free(a)
    b, group_b = admitted(mgr, 1, [0, 1])
    mgr.swap_out(group_b)
    b.status = SequenceStatus.SWAPPED
    admitted(mgr, 2, [9])                                  # evicts block 1, keeps 2-4
    d = Sequence(3, [0, 1, 2, 3, 4, 5], 1)
    assert mgr.get_num_cached_tokens(d) == really_cached_tokens(mgr, d) == 1


def test_cached_prefix_stops_at_the_first_hole_with_a_window():
    mgr = SelfAttnBlockSpaceManager(1, 8, 0, watermark=0, sliding_window=1, enable_caching=True)
    a, group_a = admitted(mgr, 0, [0, 1, 2, 3, 4, 5])
    a.append_token_id(6)
    mgr.append_slots(a, 0)                                 # the window drops blocks 0-2 to the evictor
    a.data.update_num_computed_tokens(1)
    mgr.mark_blocks_as_computed(group_a, 1)
    admitted(mgr, 1, [9])                                  # evicts the dropped chain's tail
    b = Sequence(2, [0, 1, 2, 3, 4, 5, 6, 7], 1)
    assert mgr.get_num_cached_tokens(b) == really_cached_tokens(mgr, b) == 2


def test_can_append_slots_counts_the_null_block_a_windowed_append_makes():
    mgr = SelfAttnBlockSpaceManager(2, 4, 0, watermark=0, sliding_window=2)
    a, group = admitted(mgr, 0, [0, 1, 2, 3, 4, 5])        # 3 full blocks, 1 free
    a.append_token_id(6)
    assert not mgr.can_append_slots(group, 0)              # a new block and the null block: 2 > 1
    assert mgr.get_num_free_gpu_blocks() == 1


def test_a_group_holding_the_null_block_cannot_be_swapped_out():
    mgr = SelfAttnBlockSpaceManager(1, 10, 10, watermark=0, sliding_window=1)
    a, group = admitted(mgr, 0, [0, 1, 2, 3, 4, 5])
    a.append_token_id(6)
    mgr.append_slots(a, 0)
    assert any(b is mgr.block_allocator._null_block for b in mgr.block_tables[0].blocks)
    assert not mgr.can_swap_out(group)


def test_can_swap_counts_blocks_reserved_by_lookahead():
    mgr = SelfAttnBlockSpaceManager(2, 8, 2, watermark=0)
    a, group = admitted(mgr, 0, [1, 2])
    a.append_token_id(3)
    mgr.append_slots(a, num_lookahead_slots=3)             # [1, 2] [3, _] [_, _]: 3 blocks move
    a.data.update_num_computed_tokens(1)
    assert len(mgr.get_block_table(a)) == 3
    assert not mgr.can_swap_out(group)                     # 2 CPU blocks
    bigger = SelfAttnBlockSpaceManager(2, 8, 3, watermark=0)
    b, group_b = admitted(bigger, 0, [1, 2])
    b.append_token_id(3)
    bigger.append_slots(b, num_lookahead_slots=3)
    assert bigger.can_swap_out(group_b)
    bigger.swap_out(group_b)                               # what it promised, it does
    b.status = SequenceStatus.SWAPPED
    assert bigger.can_swap_in(group_b, 0) == AllocStatus.OK and len(bigger.swap_in(group_b)) == 3


def test_free_forgets_a_request_asked_about_but_never_admitted():
    mgr = SelfAttnBlockSpaceManager(2, 4, 0, watermark=0, enable_caching=True)
    seq = Sequence(0, [0, 1, 2, 3], 2)
    mgr.get_num_cached_tokens(seq)
    assert 0 in mgr._computed_blocks_tracker
    seq.status = SequenceStatus.FINISHED_ABORTED
    mgr.free(seq)
    assert 0 not in mgr._computed_blocks_tracker


def test_a_failed_allocate_keeps_the_waiting_count():
    mgr = SelfAttnBlockSpaceManager(2, 2, 0, watermark=0, enable_caching=True)
    seq = Sequence(0, list(range(10)), 2)
    assert mgr.get_num_cached_tokens(seq) == 0
    before = dict(mgr._computed_blocks_tracker._seq_id_to_num_tokens_computed)
    with pytest.raises(BlockAllocator.NoFreeBlocksError):   # 5 blocks needed, 2 in the pool
        mgr.allocate(SequenceGroup("r", [seq]))
    assert mgr._computed_blocks_tracker._seq_id_to_num_tokens_computed == before
