"""The CPU/GPU allocator, the null block and the block table (sliding window included)."""
import pytest

from paged_attention.legacy.block_table import BlockTable
from paged_attention.legacy.cpu_gpu_block_allocator import CpuGpuBlockAllocator, NullBlock
from paged_attention.legacy.interfaces import BlockAllocator
from paged_attention.utils import Device

GPU, CPU = Device.GPU, Device.CPU
KINDS = ["naive", "prefix_caching"]


def _counts(a):
    """Everything a failed call must leave as it was."""
    per_device = {}
    for device in (GPU, CPU):
        inner = a._allocators[device]
        per_device[device] = (a.get_num_free_blocks(device), {i: inner.refcounter.get(i) for i in inner.all_block_ids},
                              a.get_prefix_cache_hit_rate(device))
    return per_device


def _table_state(t):
    return list(t.physical_block_ids), t._get_all_token_ids(), t.num_full_slots


# ---- CpuGpuBlockAllocator ------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_gpu_ids_come_first_and_frees_route_by_id(kind):
    a = CpuGpuBlockAllocator.create(kind, num_gpu_blocks=3, num_cpu_blocks=2, block_size=4)
    assert a.all_block_ids == frozenset(range(5))
    gpu = a.allocate_mutable_block(None, GPU)
    cpu = a.allocate_mutable_block(None, device=CPU)
    assert gpu.block_id == 0 and cpu.block_id == 3
    assert a.get_physical_block_id(CPU, 3) == 0 and a.get_physical_block_id(GPU, 0) == 0
    a.free(cpu)
    assert a.get_num_free_blocks(CPU) == 2 and a.get_num_free_blocks(GPU) == 2
    assert a.get_num_total_blocks(GPU) == 3 and a.get_num_total_blocks(CPU) == 2
    with pytest.raises(ValueError):                # freed twice
        a.free(cpu)
    assert a.get_prefix_cache_hit_rate(GPU) == (-1 if kind == "naive" else 0.0)


def test_bad_allocator_arguments():
    with pytest.raises(ValueError, match="Unknown allocator type"):
        CpuGpuBlockAllocator.create("lru", 2, 2, 4)
    with pytest.raises(ValueError):
        CpuGpuBlockAllocator.create("naive", -1, 2, 4)
    a = CpuGpuBlockAllocator.create("naive", 2, 2, 4)
    with pytest.raises(TypeError):                 # a device is a Device, not a str
        a.get_num_free_blocks("gpu")
    with pytest.raises(KeyError):
        a.get_physical_block_id(GPU, 3)            # a CPU id
    b = CpuGpuBlockAllocator.create("naive", 4, 0, 4).allocate_mutable_block(None, GPU)
    b.block_id = 3
    a2 = CpuGpuBlockAllocator.create("naive", 2, 0, 4)
    with pytest.raises(KeyError):                  # an id no device of this allocator owns
        a2.free(b)


def test_the_null_block_is_one_gpu_block_never_freed_never_written():
    a = CpuGpuBlockAllocator.create("naive", 4, 2, 4)
    null = a.allocate_or_get_null_block()
    assert isinstance(null, NullBlock) and a.allocate_or_get_null_block() is null
    assert null.block_id == 0 and a.get_num_free_blocks(GPU) == 3
    a.free(null)
    assert a.get_num_free_blocks(GPU) == 3 and null.block_id == 0
    with pytest.raises(ValueError, match="null block"):
        null.append_token_ids([1])
    with pytest.raises(ValueError, match="null block"):
        null.block_id = 2
    with pytest.raises(TypeError):
        a.fork(null)
    assert null.token_ids == [] and null.extra_hash is None


@pytest.mark.parametrize("kind", KINDS)
def test_swapping_moves_blocks_in_place_and_reports_absolute_ids(kind):
    a = CpuGpuBlockAllocator.create(kind, 4, 4, 4)
    t = BlockTable(4, a)
    t.allocate(list(range(6)))
    blocks = t.blocks
    mapping = a.swap(blocks, src_device=GPU, dst_device=CPU)
    assert mapping == {0: 4, 1: 5} and [b.block_id for b in blocks] == [4, 5]
    t.update(blocks)
    assert t.physical_block_ids == [4, 5] and a.get_num_free_blocks(GPU) == 4
    # Back on the GPU: the naive allocator hands out the ids freed last first (1, then 0); the
    # prefix cache still holds block 0's prefix (in its evictor) and hits it.
    back = {4: 1, 5: 0} if kind == "naive" else {4: 0, 5: 1}
    assert a.swap(blocks, CPU, GPU) == back
    assert a.get_and_reset_swaps() == [(0, 4), (1, 5), *back.items()] and a.get_and_reset_swaps() == []
    assert t._get_all_token_ids() == list(range(6))
    with pytest.raises(ValueError):                # they are on the GPU now
        a.swap(blocks, CPU, GPU)


@pytest.mark.parametrize("kind", KINDS)
def test_a_swap_the_destination_cannot_take_moves_nothing(kind):
    a = CpuGpuBlockAllocator.create(kind, 4, 1, 4)
    t = BlockTable(4, a)
    t.allocate(list(range(7)))
    before, table = _counts(a), _table_state(t)
    with pytest.raises(BlockAllocator.NoFreeBlocksError):
        a.swap(t.blocks, GPU, CPU)
    assert _counts(a) == before and _table_state(t) == table
    assert [b.block_id for b in t.blocks] == [0, 1]


def test_reset_prefix_cache_tries_every_device():
    a = CpuGpuBlockAllocator.create("prefix_caching", 2, 2, 4)
    cpu_block = a.allocate_mutable_block(None, CPU)
    gpu_block = a.allocate_immutable_block(None, [1, 2, 3, 4], GPU)
    a.free(gpu_block)
    assert a._allocators[GPU].evictor.num_blocks == 1
    assert a.reset_prefix_cache() is False         # the CPU refuses, the GPU still resets
    assert a._allocators[GPU].evictor.num_blocks == 0
    a.free(cpu_block)
    assert a.reset_prefix_cache() is True and a.reset_prefix_cache(GPU) is True


# ---- BlockTable --------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_allocate_then_append_fills_blocks_in_order(kind):
    a = CpuGpuBlockAllocator.create(kind, 8, 0, 4)
    t = BlockTable(4, a)
    assert BlockTable.get_num_required_blocks(list(range(9)), 4) == 3
    assert BlockTable.get_num_required_blocks(list(range(8)), 4, num_lookahead_slots=1) == 3
    t.allocate(list(range(9)))
    assert t.physical_block_ids == [0, 1, 2] and t.num_full_slots == 9
    t.append_token_ids([9, 10, 11, 12, 13])        # fills block 2, then a new block
    assert t.physical_block_ids == [0, 1, 2, 3] and t.num_full_slots == 14
    assert t._get_all_token_ids() == list(range(14))
    assert [b.token_ids for b in t.blocks] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13]]
    assert t.get_unseen_token_ids(list(range(16))) == [14, 15]
    t.free()
    assert a.get_num_free_blocks(GPU) == 8 and t.physical_block_ids == [] and t.blocks == []
    t.allocate([7])                                # a freed table can be allocated again
    assert t.num_full_slots == 1


def test_lookahead_slots_are_reserved_not_filled():
    a = CpuGpuBlockAllocator.create("naive", 8, 0, 4)
    t = BlockTable(4, a)
    t.allocate([1, 2, 3])
    t.append_token_ids([4], num_lookahead_slots=5)
    assert t.num_full_slots == 4 and t.physical_block_ids == [0, 1, 2]
    t.ensure_num_empty_slots(8)                    # already 8 empty
    assert len(t.blocks) == 3
    t.ensure_num_empty_slots(9)
    assert len(t.blocks) == 4 and t.blocks[3].prev_block is t.blocks[2]


@pytest.mark.parametrize("num_full, new, lookahead, expected", [
    (8, 0, 0, 0),      # nothing new and the last block is full: nothing touched
    (6, 0, 0, 1),      # nothing new, the last block partly filled: 1
    (6, 2, 0, 1),      # fits in the current block
    (6, 3, 0, 2),
    (8, 1, 0, 1),
    (8, 4, 1, 2),
    (5, 1, 10, 3),
])
def test_blocks_touched_by_append_slots(num_full, new, lookahead, expected):
    a = CpuGpuBlockAllocator.create("naive", 16, 0, 4)
    t = BlockTable(4, a)
    t.allocate(list(range(num_full)))
    assert t.get_num_blocks_touched_by_append_slots(list(range(new)), num_lookahead_slots=lookahead) == expected
    before = a.get_num_free_blocks(GPU) + len(t.blocks)
    t.append_token_ids(list(range(new)), num_lookahead_slots=lookahead)
    # Blocks written or reserved by the append never exceed what was announced.
    assert before - a.get_num_free_blocks(GPU) - (num_full + 3) // 4 <= expected


@pytest.mark.parametrize("kind", KINDS)
def test_fork_shares_blocks_and_the_first_write_copies(kind):
    a = CpuGpuBlockAllocator.create(kind, 8, 0, 4)
    t = BlockTable(4, a)
    t.allocate(list(range(6)))
    free = a.get_num_free_blocks(GPU)
    child = t.fork()
    assert child.physical_block_ids == t.physical_block_ids == [0, 1] and child.num_full_slots == 6
    assert a.get_num_free_blocks(GPU) == free
    child.append_token_ids([100])
    assert child.physical_block_ids == [0, 2] and t.physical_block_ids == [0, 1]
    assert a.clear_copy_on_writes() == [(1, 2)]
    t.append_token_ids([200])
    assert t.physical_block_ids == [0, 1] and a.clear_copy_on_writes() == []
    assert t._get_all_token_ids() == [0, 1, 2, 3, 4, 5, 200]
    assert child._get_all_token_ids() == [0, 1, 2, 3, 4, 5, 100]
    t.free()
    child.free()
    assert a.get_num_free_blocks(GPU) == 8


def test_lookahead_blocks_shared_by_a_fork_are_copied_on_first_write():
    a = CpuGpuBlockAllocator.create("naive", 8, 0, 4)
    t = BlockTable(4, a)
    t.allocate([1, 2, 3, 4])
    t.ensure_num_empty_slots(4)                    # block 1 reserved, empty
    child = t.fork()
    t.append_token_ids([5])
    assert t.physical_block_ids == [0, 2] and child.physical_block_ids == [0, 1]
    assert a.clear_copy_on_writes() == [(1, 2)]


def test_prefix_caching_tables_share_a_common_prefix():
    a = CpuGpuBlockAllocator.create("prefix_caching", 8, 0, 4)
    t1, t2 = BlockTable(4, a), BlockTable(4, a)
    t1.allocate([1, 2, 3, 4, 5, 6, 7, 8, 9])
    t2.allocate([1, 2, 3, 4, 5, 6, 7, 8, 10])
    assert t1.physical_block_ids[:2] == t2.physical_block_ids[:2] == [0, 1]
    assert t1.physical_block_ids[2] != t2.physical_block_ids[2]
    assert a.get_prefix_cache_hit_rate(GPU) == 0.5
    t2.append_token_ids([11, 12, 13])              # fills t2's tail block: promoted
    assert t2.blocks[2].content_hash is not None and t2.blocks[2].block_id == t2.physical_block_ids[2]


def test_sliding_window_trace_from_the_spec():
    a = CpuGpuBlockAllocator.create("naive", 16, 0, 4)
    t = BlockTable(4, a, max_block_sliding_window=2)
    t.allocate(list(range(10)))
    assert t.physical_block_ids == [0, 1, 2] and a.get_num_free_blocks(GPU) == 13
    t.append_token_ids([10], num_computed_slots=10)
    assert t.physical_block_ids == [0, 1, 2] and a.get_num_free_blocks(GPU) == 12   # null block = 3
    t.append_token_ids([11, 12], num_computed_slots=11)
    assert t.physical_block_ids == [0, 1, 2, 4] and a.get_num_free_blocks(GPU) == 11
    t.append_token_ids([13], num_computed_slots=16)
    assert t.physical_block_ids == [3, 3, 2, 4] and a.get_num_free_blocks(GPU) == 13
    assert isinstance(t.blocks[0], NullBlock)
    t.free()
    assert a.get_num_free_blocks(GPU) == 15        # the null block stays allocated


def test_bad_input_raises_and_changes_nothing():
    a = CpuGpuBlockAllocator.create("naive", 4, 0, 4)
    t = BlockTable(4, a)
    with pytest.raises(ValueError, match="no blocks have been allocated"):
        t.append_token_ids([1])
    with pytest.raises(ValueError):
        t.fork()
    with pytest.raises(ValueError):
        t.allocate([])
    t.allocate([1, 2])
    with pytest.raises(ValueError, match="already allocated"):
        t.allocate([1])
    windowed = BlockTable(4, CpuGpuBlockAllocator.create("naive", 8, 0, 4), max_block_sliding_window=2)
    windowed.allocate([1])
    with pytest.raises(ValueError, match="num_computed_slots"):
        windowed.append_token_ids([2])
    windowed.append_token_ids([2, 3, 4, 5, 6, 7, 8, 9, 10], num_computed_slots=1)
    free = windowed._allocator.get_num_free_blocks(GPU)
    with pytest.raises(ValueError, match="num_computed_slots"):   # past the table's end
        windowed.append_token_ids([11], num_computed_slots=20)
    assert windowed._allocator.get_num_free_blocks(GPU) == free and windowed.num_full_slots == 10
    with pytest.raises(ValueError):
        BlockTable(0, a)
    t.free()
    with pytest.raises(ValueError):
        t.append_token_ids([3])
    assert a.get_num_free_blocks(GPU) == 4


@pytest.mark.parametrize("kind", KINDS)
def test_running_out_of_blocks_leaves_tables_and_allocator_as_they_were(kind):
    a = CpuGpuBlockAllocator.create(kind, 4, 0, 4)
    t = BlockTable(4, a)
    t.allocate([1, 2, 3, 4, 5, 6])
    child = t.fork()
    other = BlockTable(4, a)
    before, parent_state, child_state = _counts(a), _table_state(t), _table_state(child)
    with pytest.raises(BlockAllocator.NoFreeBlocksError):
        other.allocate(list(range(100, 113)))      # 4 blocks, 2 free
    with pytest.raises(BlockAllocator.NoFreeBlocksError):
        child.append_token_ids(list(range(7)))     # a copy of block 1 and 2 new blocks: 3 > 2
    with pytest.raises(BlockAllocator.NoFreeBlocksError):
        t.ensure_num_empty_slots(11)
    assert _counts(a) == before and not other._is_allocated
    assert _table_state(t) == parent_state and _table_state(child) == child_state
    child.append_token_ids(list(range(6)))         # a copy and 1 new block: fits exactly
    assert a.get_num_free_blocks(GPU) == 0 and a.clear_copy_on_writes() == [(1, 3)]   # new block 2 first


@pytest.mark.parametrize("kind", KINDS)
def test_one_token_appends_with_no_free_block_change_nothing(kind):
    """A decode step's append (one token) takes at most one block: a new one when the last is
    full, a copy when the last is shared. With none free, both fail and leave everything as it was."""
    a = CpuGpuBlockAllocator.create(kind, 3, 0, 4)
    t = BlockTable(4, a)
    t.allocate([1, 2, 3, 4, 5, 6])                 # blocks 0 (full) and 1 (half)
    child = t.fork()
    filler = BlockTable(4, a)
    filler.allocate([7, 8, 9, 10])                 # the last free block
    before, parent_state, child_state = _counts(a), _table_state(t), _table_state(child)
    with pytest.raises(BlockAllocator.NoFreeBlocksError):
        child.append_token_ids([100])              # the shared half block needs a copy
    with pytest.raises(BlockAllocator.NoFreeBlocksError):
        filler.append_token_ids([11])              # its only block is full
    assert _counts(a) == before and _table_state(filler) == ([2], [7, 8, 9, 10], 4)
    assert _table_state(t) == parent_state and _table_state(child) == child_state
    filler.free()
    child.append_token_ids([100])
    assert child.physical_block_ids == [0, 2] and a.clear_copy_on_writes() == [(1, 2)]
    t.append_token_ids([7]), t.append_token_ids([8])          # private now: written in place
    assert t.physical_block_ids == [0, 1] and t._get_all_token_ids() == [1, 2, 3, 4, 5, 6, 7, 8]
    with pytest.raises(BlockAllocator.NoFreeBlocksError):
        t.append_token_ids([9])                    # full, and the pool is empty
    assert t.num_full_slots == 8 and len(t.blocks) == 2


@pytest.mark.parametrize("kind", KINDS)
def test_forking_a_windowed_table_keeps_the_null_block_and_its_own_chain(kind):
    """vLLM's fork walks prev_block links into blocks the window dropped (and the pool reused);
    here the chain is cut where the window drops blocks."""
    a = CpuGpuBlockAllocator.create(kind, 16, 0, 4)
    t = BlockTable(4, a, max_block_sliding_window=2)
    t.allocate(list(range(10)))
    for token_ids, computed in (([10], 10), ([11, 12], 11), ([13], 16), ([14, 15, 16], 17)):
        t.append_token_ids(token_ids, num_computed_slots=computed)
    other = BlockTable(4, a)
    other.allocate(list(range(500, 508)))          # reuses the dropped blocks' objects
    child = t.fork()
    assert child.physical_block_ids == t.physical_block_ids and t.physical_block_ids[:4] == [3, 3, 2, 4]
    assert child.num_full_slots == t.num_full_slots == 17
    assert child._get_all_token_ids() == t._get_all_token_ids() == list(range(8, 17))
    child.append_token_ids([99], num_computed_slots=17)
    ((src, dst),) = a.clear_copy_on_writes()        # the shared last block, copied on write
    assert src == t.physical_block_ids[-1] and dst == child.physical_block_ids[-1] != src
    assert t._get_all_token_ids()[-1] == 16 and child._get_all_token_ids()[-1] == 99
    for table in (t, child, other):
        table.free()
    assert a.get_num_free_blocks(GPU) == 15
