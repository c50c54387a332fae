"""The V1 worker BlockTable and MultiGroupBlockTable (``vllm/v1/worker/block_table.py``).

Each test uses a worked example (many from vLLM's own tests of this layer) and checks whole
buffers wherever vLLM's behaviour says what every entry holds, so that stale columns (which vLLM
never clears), counts, the hybrid-block column count and the GPU side are covered too.
"""
import inspect

import numpy as np
import pytest
import torch

from paged_attention import runtime
from paged_attention.utils import PAD_SLOT_ID
from paged_attention.v1 import BlockTable, CpuGpuBuffer, MultiGroupBlockTable

DEV = runtime.DEVICE


def make(block_size=4, max_num_reqs=4, max_num_blocks_per_req=8, max_num_batched_tokens=32, kernel_block_size=None,
         interleave=1, **kw):
    return BlockTable(block_size, max_num_reqs, max_num_blocks_per_req, max_num_batched_tokens, False, DEV,
                      kernel_block_size or block_size, interleave, **kw)


def state(bt):
    """Everything a failed call must leave as it was."""
    return (bt.block_table.np.copy(), bt.block_table.gpu.cpu().clone(), bt.num_blocks_per_row.copy(),
            bt.slot_mapping.np.copy(), bt.slot_mapping.gpu.cpu().clone())


def same_state(a, b):
    return all((np.array_equal(x, y) if isinstance(x, np.ndarray) else torch.equal(x, y)) for x, y in zip(a, b))


def rows(bt, n=None):
    return bt.block_table.np[:n].tolist()


# ---- Construction ------------------------------------------------------------------------------------
def test_plain_table_attributes_and_buffers():
    bt = BlockTable(block_size=16, max_num_reqs=3, max_num_blocks_per_req=5, max_num_batched_tokens=40,
                    pin_memory=False, device=DEV, kernel_block_size=16, dcp_kv_cache_interleave_size=1)
    assert (bt.block_size, bt.blocks_per_kv_block, bt.use_hybrid_blocks) == (16, 1, False)
    assert bt.max_num_blocks_per_req == 5 and bt.max_num_reqs == 3 and bt.max_num_batched_tokens == 40
    assert isinstance(bt.block_table, CpuGpuBuffer) and isinstance(bt.slot_mapping, CpuGpuBuffer)
    assert bt.block_table.cpu.shape == bt.block_table.gpu.shape == (3, 5)
    assert bt.block_table.cpu.dtype == torch.int32 and bt.block_table.np.dtype == np.int32
    assert bt.slot_mapping.cpu.shape == (40,) and bt.slot_mapping.gpu.dtype == torch.int64
    assert isinstance(bt.num_blocks_per_row, np.ndarray) and bt.num_blocks_per_row.dtype == np.int32
    assert bt.num_blocks_per_row.tolist() == [0, 0, 0]
    assert (bt.dcp_world_size, bt.dcp_rank, bt.dcp_kv_cache_interleave_size) == (1, 0, 1)
    assert bt._kernel_block_arange is None
    assert bt.get_cpu_tensor() is bt.block_table.cpu and bt.get_numpy_array() is bt.block_table.np


def test_hybrid_table_is_kept_in_kernel_blocks():
    """Hybrid blocks: 32-token manager blocks, 16-token kernel blocks (vLLM's hybrid-table test)."""
    bt = BlockTable(block_size=32, max_num_reqs=10, max_num_blocks_per_req=20, max_num_batched_tokens=512,
                    pin_memory=False, device=DEV, kernel_block_size=16, dcp_kv_cache_interleave_size=8)
    assert bt.use_hybrid_blocks is True
    assert bt.block_size == 16 and bt.blocks_per_kv_block == 2
    assert bt.max_num_blocks_per_req == 40 and bt.block_table.np.shape == (10, 40)
    assert bt._kernel_block_arange.tolist() == [[0, 1]]
    assert bt.dcp_kv_cache_interleave_size == 8
    expected = bt.map_to_kernel_blocks(np.array([0, 1, 2]), bt.blocks_per_kv_block, bt._kernel_block_arange)
    assert expected.tolist() == [0, 1, 2, 3, 4, 5]
    bt.append_row([0, 1, 2], 0)
    assert bt.num_blocks_per_row[0] == len(expected)
    assert np.array_equal(bt.block_table.np[0, :len(expected)], expected)


def test_kernel_block_size_must_divide_the_block_size():
    with pytest.raises(ValueError, match="kernel_block_size 12 must divide kv_manager_block_size size 32"):
        make(block_size=32, kernel_block_size=12)
    with pytest.raises(ValueError, match="must divide"):
        make(block_size=16, kernel_block_size=32)


def test_interleave_size_by_position_keyword_or_default():
    assert make(interleave=2).dcp_kv_cache_interleave_size == 2
    bt = BlockTable(4, 2, 2, 8, False, DEV, 4, dcp_kv_cache_interleave_size=2)
    assert bt.dcp_kv_cache_interleave_size == 2
    assert BlockTable(4, 2, 2, 8, False, DEV, 4).dcp_kv_cache_interleave_size == 1
    with pytest.raises(TypeError):                    # vLLM's later name is not taken as a second name
        BlockTable(4, 2, 2, 8, False, DEV, 4, 2, cp_kv_cache_interleave_size=4)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(block_size=0), ValueError, "block_size must be >= 1"),
    (dict(block_size=4.0), TypeError, "block_size must be an int"),
    (dict(max_num_reqs=True), TypeError, "max_num_reqs must be an int"),
    (dict(max_num_blocks_per_req=0), ValueError, "max_num_blocks_per_req"),
    (dict(max_num_batched_tokens=-3), ValueError, "max_num_batched_tokens"),
    (dict(interleave=0), ValueError, "interleave_size must be >= 1"),
    (dict(dcp_world_size=2, dcp_rank=2), ValueError, "dcp_rank must be between 0 and"),
    (dict(dcp_world_size=2, dcp_rank=-1), ValueError, "dcp_rank"),
    (dict(dcp_world_size=0), ValueError, "dcp_world_size must be >= 1"),
    (dict(dcp_world_size=2, interleave=3), ValueError, "must divide the \\(kernel\\) block size"),
    (dict(dcp_world_size=2, dcp_rank="0"), TypeError, "dcp_rank must be an int"),
])
def test_bad_constructor_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        make(**kwargs)


# ---- Row operations: columns past a row's count keep stale ids -------------------------------------
def test_append_row_writes_after_the_row_end_and_counts():
    bt = make()
    bt.append_row([3, 7], 1)
    bt.append_row([9], 1)
    bt.append_row([], 1)                                  # an empty list is a no-op
    bt.append_row(np.array([5, 6], dtype=np.int32), 2)    # numpy ids too
    assert rows(bt, 3) == [[0] * 8, [3, 7, 9, 0, 0, 0, 0, 0], [5, 6, 0, 0, 0, 0, 0, 0]]
    assert bt.num_blocks_per_row.tolist() == [0, 3, 2, 0]
    assert not bt.block_table.gpu.any()                   # CPU side only until a commit


def test_hybrid_append_row_expands_manager_blocks():
    """Hybrid blocks, two kernel blocks each: [0,1,2] -> [0..5] (count 6); [5, 9] -> [10, 11, 18, 19]."""
    bt = make(block_size=32, kernel_block_size=16, max_num_blocks_per_req=20)
    bt.append_row([0, 1, 2], 0)
    bt.append_row([5, 9], 1)
    assert bt.block_table.np[0, :7].tolist() == [0, 1, 2, 3, 4, 5, 0]
    assert bt.block_table.np[1, :5].tolist() == [10, 11, 18, 19, 0]
    assert bt.num_blocks_per_row[:2].tolist() == [6, 4]
    assert bt._map_to_kernel_blocks(np.array([5, 9])).tolist() == [10, 11, 18, 19]
    assert make()._map_to_kernel_blocks(np.array([5, 9])).tolist() == [5, 9]    # bpk 1: unchanged
    # a 4-way split: manager block 3 holds kernel blocks 12..15
    assert BlockTable.map_to_kernel_blocks(np.array([3, 0]), 4, np.arange(4).reshape(1, -1)).tolist() == \
        [12, 13, 14, 15, 0, 1, 2, 3]


def test_add_row_resets_the_count_but_leaves_stale_columns():
    bt = make()
    bt.add_row([1, 2, 3, 4], 0)
    bt.add_row([9], 0)
    assert bt.block_table.np[0, :5].tolist() == [9, 2, 3, 4, 0]     # 2, 3, 4 stay: vLLM does not clear them
    assert bt.num_blocks_per_row[0] == 1
    bt.add_row([], 0)
    assert bt.num_blocks_per_row[0] == 0 and bt.block_table.np[0, 0] == 9


def test_clear_row_zeroes_only_the_counted_columns():
    bt = make()
    bt.add_row([1, 2, 3, 4], 0)
    bt.add_row([9, 8], 0)                                  # count 2, stale 3 and 4 behind it
    bt.append_row([5], 1)
    bt.clear_row(0)
    assert bt.block_table.np[0, :5].tolist() == [0, 0, 3, 4, 0]
    assert bt.num_blocks_per_row.tolist() == [0, 1, 0, 0]
    assert bt.block_table.np[1, 0] == 5                    # other rows untouched
    bt.clear_row(0)                                        # clearing an empty row is harmless
    assert bt.block_table.np[0, :4].tolist() == [0, 0, 3, 4]


def test_move_row_copies_the_used_columns_and_keeps_the_source():
    bt = make()
    bt.add_row([1, 2, 3, 4, 5], 0)                         # the target has five old ids
    bt.add_row([7, 8], 3)
    bt.move_row(3, 0)
    assert bt.block_table.np[0, :6].tolist() == [7, 8, 3, 4, 5, 0]   # columns 2.. not cleared
    assert bt.block_table.np[3, :3].tolist() == [7, 8, 0]            # the source is left intact
    assert bt.num_blocks_per_row.tolist() == [2, 0, 0, 2]


def test_swap_row_swaps_whole_rows_and_counts():
    bt = make()
    bt.add_row([1, 2, 3, 4], 0)
    bt.add_row([6], 0)                                     # row 0: [6, 2, 3, 4], count 1
    bt.add_row([7, 8], 1)
    bt.swap_row(0, 1)
    assert rows(bt, 2) == [[7, 8, 0, 0, 0, 0, 0, 0], [6, 2, 3, 4, 0, 0, 0, 0]]   # stale ids travel too
    assert bt.num_blocks_per_row.tolist() == [2, 1, 0, 0]
    bt.swap_row(1, 1)
    assert rows(bt, 2)[1] == [6, 2, 3, 4, 0, 0, 0, 0] and bt.num_blocks_per_row[1] == 1


def test_input_batch_lifecycle_add_remove_condense():
    """The input batch's calls: add_request -> add_row, remove_request -> clear_row, condense -> move_row."""
    bt = make()
    for i in range(4):
        bt.add_row([10 * i + 1, 10 * i + 2], i)
    bt.append_row([33], 3)                                 # request 3 grows
    bt.clear_row(1)                                        # request 1 finishes
    bt.move_row(3, 1)                                      # condense: the last row fills the hole
    bt.clear_row(3)
    assert bt.num_blocks_per_row.tolist() == [2, 3, 2, 0]
    assert rows(bt, 4) == [[1, 2, 0, 0, 0, 0, 0, 0], [31, 32, 33, 0, 0, 0, 0, 0],
                           [21, 22, 0, 0, 0, 0, 0, 0], [0] * 8]


# ---- Slot mapping --------------------------------------------------------------------------------
def test_slot_mapping_worked_example_without_cp():
    """Request 0: row [3, 7], positions 5, 6, 7; request 1: row [2], positions 0, 1."""
    bt = make(max_num_batched_tokens=8)
    bt.slot_mapping.np[:] = 12345
    bt.add_row([3, 7], 0)
    bt.add_row([2], 1)
    bt.compute_slot_mapping(np.array([0, 0, 0, 1, 1], dtype=np.int32), np.array([5, 6, 7, 0, 1]))
    assert bt.slot_mapping.np.tolist() == [29, 30, 31, 8, 9, 12345, 12345, 12345]   # the tail is left alone
    assert not bt.slot_mapping.gpu.any()
    bt.commit_slot_mapping(5)
    assert bt.slot_mapping.gpu.cpu().tolist() == [29, 30, 31, 8, 9, 0, 0, 0]


def test_slot_mapping_indexes_the_flattened_table():
    """The example of vLLM's docstring: block size 2, rows of K columns; token t reads entry
    req * K + pos // 2 of the flattened table."""
    K = 4
    bt = make(block_size=2, max_num_blocks_per_req=K)
    bt.block_table.np[:] = np.arange(4 * K).reshape(4, K)  # entry value == its flat index
    req = np.array([0, 0, 1, 1, 1, 1, 1, 2, 2, 2])
    pos = np.array([0, 1, 0, 1, 2, 3, 4, 0, 1, 2])
    bt.compute_slot_mapping(req, pos)
    slots = bt.slot_mapping.np[:10]
    assert (slots // 2).tolist() == [0, 0, K, K, K + 1, K + 1, K + 2, 2 * K, 2 * K, 2 * K + 1]
    assert (slots % 2).tolist() == (pos % 2).tolist()


@pytest.mark.parametrize("interleave,rank,expected", [
    (1, 0, [40, -1, 41, -1, 42, -1, 43, -1, 44, -1, 45, -1, 46, -1, 47, -1]),
    (1, 1, [-1, 40, -1, 41, -1, 42, -1, 43, -1, 44, -1, 45, -1, 46, -1, 47]),
    (2, 0, [40, 41, -1, -1, 42, 43, -1, -1, 44, 45, -1, -1, 46, 47, -1, -1]),
    (2, 1, [-1, -1, 40, 41, -1, -1, 42, 43, -1, -1, 44, 45, -1, -1, 46, 47]),
])
def test_dcp_world_size_2_spec_table(interleave, rank, expected):
    """DCP with interleaving: B=4, W=2, row [10, 11, 12], positions 0..15."""
    bt = make(interleave=interleave, dcp_world_size=2, dcp_rank=rank)
    bt.add_row([10, 11, 12], 0)
    bt.compute_slot_mapping(np.zeros(16, dtype=np.int64), np.arange(16))
    assert bt.slot_mapping.np[:16].tolist() == expected
    assert PAD_SLOT_ID == -1


@pytest.mark.parametrize("world,interleave,rank,positions,expected", [
    # W=4, I=1, B=16: rank 2 owns p % 4 == 2; a virtual block spans 64 positions.
    (4, 1, 2, [0, 2, 6, 62, 63, 66, 127], [-1, 80, 81, 95, -1, 144, -1]),
    # W=4, I=8: runs of 8 rotate; rank 1 owns 8..15, 40..47, 72..79 (= block 9's 0..7).
    (4, 8, 1, [0, 8, 15, 16, 40, 47, 72, 79], [-1, 80, 87, -1, 88, 95, 144, 151]),
    # W=2, I=8: rank 0 owns 0..7 and 16..23 of every 32; position 16 is its 9th token.
    (2, 8, 0, [7, 8, 16, 31, 32], [87, -1, 88, -1, 144]),
    # W=2, I=1 with the later keyword spelling; rank 1 owns the odd positions.
    (2, 1, 1, [1, 3, 5, 32, 33], [80, 81, 82, -1, 144]),
])
def test_dcp_world_sizes_2_and_4_hand_computed(world, interleave, rank, positions, expected):
    bt = BlockTable(16, 2, 4, 64, False, DEV, 16, dcp_kv_cache_interleave_size=interleave,
                    dcp_world_size=world, dcp_rank=rank)
    bt.add_row([5, 9], 1)
    bt.compute_slot_mapping(np.ones(len(positions), dtype=np.int64), np.array(positions))
    assert bt.slot_mapping.np[:len(positions)].tolist() == expected


def test_dcp_settings_set_after_construction_are_used_and_checked():
    """vLLM's tests set dcp_world_size/dcp_rank on the object: they take effect (and are checked)."""
    bt = make(block_size=16)
    bt.add_row([5, 6], 0)
    bt.dcp_world_size, bt.dcp_rank = 2, 1
    bt.compute_slot_mapping(np.zeros(8, dtype=np.int64), np.array([0, 1, 2, 3, 4, 5, 32, 33]))
    assert bt.slot_mapping.np[:8].tolist() == [-1, 80, -1, 81, -1, 82, -1, 96]
    bt.dcp_rank = 2
    before = state(bt)
    with pytest.raises(ValueError, match="dcp_rank"):
        bt.compute_slot_mapping(np.zeros(1, dtype=np.int64), np.array([0]))
    assert same_state(before, state(bt))


def test_hybrid_slot_is_the_manager_level_slot():
    """Hybrid blocks: position 17 of row 1 ([5, 9] -> [10, 11, 18, 19]) is 11*16 + 1 = 177 = 5*32 + 17."""
    bt = make(block_size=32, kernel_block_size=16, max_num_blocks_per_req=20)
    bt.append_row([0, 1, 2], 0)
    bt.append_row([5, 9], 1)
    pos = np.array([0, 15, 16, 17, 31, 32, 47, 48, 63])
    bt.compute_slot_mapping(np.ones(len(pos), dtype=np.int64), pos)
    slots = bt.slot_mapping.np[:len(pos)]
    assert slots[3] == 177
    assert slots.tolist() == [160, 175, 176, 177, 191, 288, 303, 304, 319]
    manager_ids = np.array([5, 9])
    assert slots.tolist() == (manager_ids[pos // 32] * 32 + pos % 32).tolist()


def test_slot_mapping_does_not_overflow_int32_block_ids():
    bt = make(block_size=16)
    big = 2**31 - 1
    bt.add_row([big], 0)
    bt.compute_slot_mapping(np.array([0]), np.array([15]))
    assert bt.slot_mapping.np[0] == big * 16 + 15


def test_later_form_reads_the_committed_table_and_pads_the_tail():
    """The kernel form: compute_slot_mapping_from_query_start_loc(num_reqs, query_start_loc, positions)."""
    bt = make(max_num_batched_tokens=8)
    bt.add_row([3, 7], 0)
    bt.add_row([2], 1)
    bt.commit_block_table(2)
    bt.add_row([6], 1)                                     # not committed: the kernel cannot see it
    bt.slot_mapping.gpu.fill_(777)
    qsl = torch.tensor([0, 3, 5], dtype=torch.int32, device=DEV)
    pos = torch.tensor([5, 6, 7, 0, 1], dtype=torch.int64, device=DEV)
    bt.compute_slot_mapping_from_query_start_loc(2, qsl, pos)
    assert bt.slot_mapping.gpu.cpu().tolist() == [29, 30, 31, 8, 9, -1, -1, -1]
    assert not bt.slot_mapping.np.any()                    # only the device buffer is written
    bt.commit_block_table(2)
    bt.compute_slot_mapping_from_query_start_loc(2, qsl, pos)
    assert bt.slot_mapping.gpu.cpu().tolist()[3:5] == [24, 25]


# ---- Commit, clear, accessors ----------------------------------------------------------------------
def test_commit_block_table_copies_only_the_first_rows():
    bt = make()
    for r in range(4):
        bt.add_row([r + 1], r)
    bt.commit_block_table(2)
    assert bt.block_table.gpu[:, 0].cpu().tolist() == [1, 2, 0, 0]
    assert bt.get_device_tensor(3).shape == (3, 8)
    assert bt.get_device_tensor(3).data_ptr() == bt.block_table.gpu.data_ptr()
    bt.commit_block_table(4)
    assert torch.equal(bt.block_table.gpu.cpu(), bt.block_table.cpu)


def test_clear_zeroes_both_sides_but_keeps_the_counts():
    bt = make()
    bt.add_row([4, 5], 0)
    bt.commit_block_table(1)
    bt.clear()
    assert not bt.block_table.np.any() and not bt.block_table.gpu.any()
    assert bt.num_blocks_per_row.tolist() == [2, 0, 0, 0]


# ---- Bad input: typed errors, nothing changed -------------------------------------------------------
@pytest.mark.parametrize("call,error,match", [
    (lambda bt: bt.append_row([1], 4), IndexError, "row_idx=4 is outside"),
    (lambda bt: bt.append_row([1], -1), IndexError, "row_idx=-1"),
    (lambda bt: bt.append_row([1], 1.0), TypeError, "row_idx must be an int"),
    (lambda bt: bt.append_row([1] * 7, 0), ValueError, "would hold 9 blocks"),
    (lambda bt: bt.append_row([1, -2], 1), ValueError, "block ids must be >= 0"),
    (lambda bt: bt.append_row([1.5], 1), TypeError, "must be ints"),
    (lambda bt: bt.append_row([[1, 2], [3, 4]], 1), TypeError, "one flat list"),
    (lambda bt: bt.append_row([[1, 2], [3]], 1), TypeError, "flat list"),
    (lambda bt: bt.append_row(5, 1), TypeError, "list of ints"),
    (lambda bt: bt.append_row([2**31], 1), ValueError, "int32"),
    (lambda bt: bt.add_row(list(range(9)), 1), ValueError, "would hold 9 blocks"),
    (lambda bt: bt.add_row([1], 9), IndexError, "outside"),
    (lambda bt: bt.move_row(0, 4), IndexError, "tgt=4"),
    (lambda bt: bt.move_row(7, 0), IndexError, "src=7"),
    (lambda bt: bt.swap_row(0, 4), IndexError, "tgt=4"),
    (lambda bt: bt.clear_row(4), IndexError, "outside"),
    (lambda bt: bt.compute_slot_mapping(np.array([0, 4]), np.array([0, 0])), IndexError, "request row 4"),
    (lambda bt: bt.compute_slot_mapping(np.array([0]), np.array([32])), ValueError, "only 8 columns"),
    (lambda bt: bt.compute_slot_mapping(np.array([0]), np.array([-1])), ValueError, "positions must be >= 0"),
    (lambda bt: bt.compute_slot_mapping(np.array([0, 0]), np.array([0])), ValueError, "same length"),
    (lambda bt: bt.compute_slot_mapping(np.zeros(33, dtype=int), np.zeros(33, dtype=int)), ValueError,
     "exceed max_num_batched_tokens"),
    (lambda bt: bt.compute_slot_mapping(np.array([0.0]), np.array([0])), TypeError, "must hold integers"),
    (lambda bt: bt.compute_slot_mapping(2, [0, 2], [0, 1]), TypeError, "takes"),
    (lambda bt: bt.compute_slot_mapping_from_query_start_loc(5, np.array([0] * 6), np.array([0])), ValueError,
     "num_reqs"),
    (lambda bt: bt.compute_slot_mapping_from_query_start_loc(2, np.array([0, 2]), np.array([0, 1])), ValueError,
     "num_reqs \\+ 1"),
    (lambda bt: bt.compute_slot_mapping_from_query_start_loc(2, np.array([0, 2, 1]), np.array([0, 1])), ValueError,
     "must rise"),
    (lambda bt: bt.compute_slot_mapping_from_query_start_loc(1, np.array([0, 3]), np.array([0, 1])), ValueError,
     "must rise"),
    (lambda bt: bt.commit_block_table(5), ValueError, "num_reqs must be between 0 and max_num_reqs=4"),
    (lambda bt: bt.commit_slot_mapping(33), ValueError, "max_num_batched_tokens=32"),
    (lambda bt: bt.commit_slot_mapping(-1), ValueError, "num_tokens"),
    (lambda bt: bt.get_device_tensor(5), ValueError, "num_reqs"),
])
def test_bad_input_raises_and_changes_nothing(call, error, match):
    bt = make()
    bt.add_row([1, 2], 0)
    bt.add_row([3], 1)
    bt.slot_mapping.np[:] = 11
    bt.slot_mapping.gpu.fill_(22)
    before = state(bt)
    with pytest.raises(error, match=match):
        call(bt)
    assert same_state(before, state(bt))


def test_hybrid_capacity_counts_kernel_blocks():
    bt = make(block_size=32, kernel_block_size=16, max_num_blocks_per_req=2)   # 4 kernel columns
    bt.append_row([1], 0)
    with pytest.raises(ValueError, match="would hold 6 blocks"):
        bt.append_row([2, 3], 0)
    assert bt.num_blocks_per_row[0] == 2 and bt.block_table.np[0].tolist() == [2, 3, 0, 0]
    bt.append_row([4], 0)
    assert bt.block_table.np[0].tolist() == [2, 3, 8, 9]


# ---- MultiGroupBlockTable -----------------------------------------------------------------------------
def make_multi(**kw):
    args = dict(max_num_reqs=4, max_model_len=64, max_num_batched_tokens=16, pin_memory=False, device=DEV,
                block_sizes=[16, 32], kernel_block_sizes=[16, 16])
    args.update(kw)
    return MultiGroupBlockTable(**args)


def test_multi_group_sizes_default_and_aligned():
    m = make_multi(max_model_len=1000, block_sizes=[16], kernel_block_sizes=[16])
    assert m[0].max_num_blocks_per_req == 64               # cdiv(1000, 16) = 63, aligned to 8 -> 64
    m = make_multi(max_model_len=1000, block_sizes=[16, 32, 256], kernel_block_sizes=[16, 16, 64])
    # 32: cdiv = 32 (a multiple of 4), times 2 kernel blocks; 256 > 128: no alignment, 4 x 4.
    assert [t.max_num_blocks_per_req for t in m.block_tables] == [64, 64, 16]
    assert [t.block_size for t in m.block_tables] == [16, 16, 64]
    assert [t.use_hybrid_blocks for t in m.block_tables] == [False, True, True]


def test_multi_group_speculative_floor_dcp_and_explicit_counts():
    m = make_multi(max_model_len=256, block_sizes=[256], kernel_block_sizes=[256], num_speculative_tokens=3)
    assert m[0].max_num_blocks_per_req == 4                # max(cdiv(256, 256), 1 + 3)
    m = make_multi(max_model_len=1024, block_sizes=[256], kernel_block_sizes=[256], dcp_world_size=2, dcp_rank=1)
    assert m[0].max_num_blocks_per_req == 2                # each rank holds 512 of the 1024 tokens
    assert (m[0].dcp_world_size, m[0].dcp_rank) == (2, 1)
    m = make_multi(max_num_blocks=[3, 5])
    assert [t.max_num_blocks_per_req for t in m.block_tables] == [8, 8 * 2]    # aligned to 8 and 4, x bpk
    m = MultiGroupBlockTable(4, 64, 16, False, DEV, [16], [16], 0, 4, max_num_blocks=[10])
    assert m[0].max_num_blocks_per_req == 16 and m[0].dcp_kv_cache_interleave_size == 4
    m = make_multi(dcp_kv_cache_interleave_size=8)
    assert all(t.dcp_kv_cache_interleave_size == 8 for t in m.block_tables)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(kernel_block_sizes=[16]), ValueError, "kernel_block_sizes length \\(1\\) must match block_sizes length"),
    (dict(max_num_blocks=[4]), ValueError, "max_num_blocks length \\(1\\) must match"),
    (dict(block_sizes=[], kernel_block_sizes=[]), ValueError, "at least one"),
    (dict(kernel_block_sizes=[16, 12]), ValueError, "must divide"),
    (dict(max_model_len=0), ValueError, "max_model_len"),
    (dict(block_sizes=16), TypeError, "block_sizes must be a list"),
    (dict(dcp_world_size=2, dcp_rank=3), ValueError, "dcp_rank"),
])
def test_multi_group_bad_constructor_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        make_multi(**kwargs)


def test_multi_group_fans_out_row_operations_and_slot_mapping():
    m = make_multi()
    m.add_row(([1, 2], [3]), 0)
    m.append_row(([4], [5]), 0)
    m.add_row(([6], [7]), 1)
    assert m[0].block_table.np[0, :3].tolist() == [1, 2, 4] and m[0].num_blocks_per_row[:2].tolist() == [3, 1]
    assert m[1].block_table.np[0, :4].tolist() == [6, 7, 10, 11] and m[1].num_blocks_per_row[:2].tolist() == [4, 2]
    m.compute_slot_mapping(np.array([0, 0, 1]), np.array([17, 40, 3]))
    assert m[0].slot_mapping.np[:3].tolist() == [2 * 16 + 1, 4 * 16 + 8, 6 * 16 + 3]
    assert m[1].slot_mapping.np[:3].tolist() == [7 * 16 + 1, 10 * 16 + 8, 14 * 16 + 3]   # manager 3*32+17 ...
    m.commit_block_table(2)
    m.commit_slot_mapping(3)
    for t in m.block_tables:
        assert torch.equal(t.block_table.gpu[:2].cpu(), t.block_table.cpu[:2])
        assert torch.equal(t.slot_mapping.gpu[:3].cpu(), t.slot_mapping.cpu[:3])
    m.swap_row(0, 1)
    assert m[0].num_blocks_per_row[:2].tolist() == [1, 3] and m[1].block_table.np[1, :4].tolist() == [6, 7, 10, 11]
    m.move_row(1, 3)
    assert m[1].block_table.np[3, :4].tolist() == [6, 7, 10, 11] and m[1].num_blocks_per_row[3] == 4
    m.clear_row(1)
    assert m[0].num_blocks_per_row.tolist() == [1, 0, 0, 3] and not m[1].block_table.np[1].any()
    m.clear()
    assert all(not t.block_table.np.any() and not t.block_table.gpu.any() for t in m.block_tables)
    assert m[1].num_blocks_per_row.tolist() == [2, 0, 0, 4]           # counts survive clear()
    qsl = np.array([0, 2])
    m.add_row(([1], [1]), 0)
    m.commit_block_table(1)
    m.compute_slot_mapping_from_query_start_loc(1, qsl, np.array([0, 1]))
    assert m[0].slot_mapping.gpu[:3].cpu().tolist() == [16, 17, -1]
    assert m[1].slot_mapping.gpu[:3].cpu().tolist() == [32, 33, -1]


def test_multi_group_bad_calls_change_no_group():
    m = make_multi(max_num_blocks=[16, 1])     # group 1: 1 block, aligned to 4, x2: 8 kernel columns
    assert [t.max_num_blocks_per_req for t in m.block_tables] == [16, 8]
    m.add_row(([1], [2]), 0)
    before = [state(t) for t in m.block_tables]
    with pytest.raises(ValueError, match="would hold"):    # fits group 0, overflows group 1
        m.append_row(([3], [4, 5, 6, 7]), 0)
    with pytest.raises(ValueError, match="block ids"):
        m.add_row(([3], [-4]), 0)
    with pytest.raises(ValueError, match="2 KV-cache groups"):
        m.add_row(([3],), 0)
    with pytest.raises(TypeError, match="one list of ids per KV-cache group"):
        m.append_row(np.array([3, 4]), 0)
    with pytest.raises(IndexError):
        m.swap_row(0, 4)
    with pytest.raises(ValueError, match="only 8 columns"):  # position 130 fits group 0, not group 1
        m.compute_slot_mapping(np.array([0, 0]), np.array([0, 130]))
    with pytest.raises(ValueError, match="num_tokens"):
        m.commit_slot_mapping(17)
    assert all(same_state(b, state(t)) for b, t in zip(before, m.block_tables))


def _compare_objs(a, b):
    """Attribute-by-attribute comparison in the manner of vLLM's input-batch tests: every
    non-method attribute of the two tables must compare equal by its kind."""
    names = {n for n, _ in inspect.getmembers(a, lambda v: not inspect.isroutine(v))
             if not (n.startswith("__") and n.endswith("__"))}
    assert {"block_table", "num_blocks_per_row", "slot_mapping", "block_size", "max_num_blocks_per_req"} <= names
    for name in names:
        x, y = getattr(a, name), getattr(b, name)
        if isinstance(x, torch.Tensor):
            ok = torch.equal(x, y)
        elif isinstance(x, np.ndarray):
            ok = np.array_equal(x, y)
        elif isinstance(x, CpuGpuBuffer):
            ok = np.array_equal(x.np, y.np) and torch.equal(x.gpu, y.gpu)
        elif isinstance(x, list):
            ok = all(_compare_objs(p, q) is None for p, q in zip(x, y))
        else:
            ok = x == y
        assert ok, f"attribute {name} differs: {x} != {y}"


def test_swapping_rows_matches_adding_them_in_swapped_order():
    """vLLM's swap-states test: swap rows of one batch, build another batch in the swapped order
    directly, and compare the two whole objects, buffers included: stale columns must match too."""
    ids = [([1, 2], [3]), ([4], [5, 6]), ([7, 8, 9], []), ([10], [11])]
    swapped = make_multi()
    for i, b in enumerate(ids):
        swapped.add_row(b, i)
    swapped.swap_row(0, 1)
    swapped.swap_row(1, 3)
    order = [1, 3, 2, 0]
    reference = make_multi()
    for i, j in enumerate(order):
        reference.add_row(ids[j], i)
    for t in (swapped, reference):
        t.commit_block_table(4)
    for a, b in zip(swapped.block_tables, reference.block_tables):
        _compare_objs(a, b)
    reference.add_row(([99], [99]), 2)
    with pytest.raises(AssertionError, match="differs"):
        _compare_objs(swapped[0], reference[0])
