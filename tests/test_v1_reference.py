"""``paged_attention.v1.reference`` (the token-by-token slot mapping and the DCP arithmetic) and
``bench.slot_mapping_times``: the loop equals ``compute_slot_mapping``; the benchmark returns one
time per shape and implementation (its speed is not tested: figures go in notebooks)."""
import math

import numpy as np
import pytest

from paged_attention import bench, runtime
from paged_attention.bench import slot_mapping as slot_mapping_bench
from paged_attention.utils import PAD_SLOT_ID
from paged_attention.v1 import BlockTable
from paged_attention.v1.reference import dcp_local_position, dcp_owner_rank, slot_mapping_loop

DEV = runtime.DEVICE


def random_batch(rng, block_size, kernel_block_size=None, world=1, rank=0, interleave=1, num_reqs=5):
    """A table with random distinct ids in every row and a step of random positions inside them."""
    max_blocks = 6
    table = BlockTable(block_size, num_reqs, max_blocks, 4096, False, DEV, kernel_block_size or block_size,
                       interleave, dcp_world_size=world, dcp_rank=rank)
    ids = rng.permutation(num_reqs * max_blocks)
    for row in range(num_reqs):
        n = int(rng.integers(1, max_blocks + 1))
        table.add_row(ids[row * max_blocks: row * max_blocks + n].tolist(), row)
    reqs, positions = [], []
    for row in rng.permutation(num_reqs).tolist():       # any row order: the slot does not care
        capacity = int(table.num_blocks_per_row[row]) * table.block_size * world
        start = int(rng.integers(0, capacity))
        count = int(rng.integers(1, capacity - start + 1))
        reqs += [row] * count
        positions += range(start, start + count)
    return table, np.array(reqs), np.array(positions)


@pytest.mark.parametrize("block_size,kernel_block_size", [(4, 4), (16, 16), (1, 1), (32, 16), (16, 4)])
def test_loop_equals_compute_slot_mapping(block_size, kernel_block_size):
    rng = np.random.default_rng(block_size * 100 + kernel_block_size)
    for _ in range(20):
        table, reqs, positions = random_batch(rng, block_size, kernel_block_size)
        table.compute_slot_mapping(reqs, positions)
        expected = table.slot_mapping.np[:len(positions)].tolist()
        assert slot_mapping_loop(table, reqs, positions) == expected
        assert min(expected) >= 0


@pytest.mark.parametrize("world,interleave,block_size", [(2, 1, 4), (2, 2, 4), (4, 2, 8), (4, 8, 8), (3, 4, 4)])
def test_loop_equals_compute_slot_mapping_with_dcp(world, interleave, block_size):
    rng = np.random.default_rng(world * 1000 + interleave * 10 + block_size)
    kinds = set()
    for rank in range(world):
        for _ in range(8):
            table, reqs, positions = random_batch(rng, block_size, world=world, rank=rank, interleave=interleave)
            table.compute_slot_mapping(reqs, positions)
            expected = table.slot_mapping.np[:len(positions)].tolist()
            assert slot_mapping_loop(table, reqs, positions) == expected
            kinds |= {s == PAD_SLOT_ID for s in expected}
    assert kinds == {True, False}       # the batches had tokens of this rank and of others


def test_loop_by_hand():
    """Worked slot-mapping examples, without and with DCP."""
    table = BlockTable(4, 2, 4, 16, False, DEV, 4, 1)
    table.add_row([3, 7], 0)
    table.add_row([2], 1)
    assert slot_mapping_loop(table, [0, 0, 0, 1, 1], [5, 6, 7, 0, 1]) == [29, 30, 31, 8, 9]
    for interleave, rank, expected in [(1, 0, [40, -1, 41, -1, 42, -1, 43, -1, 44, -1]),
                                       (1, 1, [-1, 40, -1, 41, -1, 42, -1, 43, -1, 44]),
                                       (2, 0, [40, 41, -1, -1, 42, 43, -1, -1, 44, 45]),
                                       (2, 1, [-1, -1, 40, 41, -1, -1, 42, 43, -1, -1])]:
        dcp = BlockTable(4, 1, 3, 16, False, DEV, 4, interleave, dcp_world_size=2, dcp_rank=rank)
        dcp.add_row([10, 11, 12], 0)
        assert slot_mapping_loop(dcp, [0] * 10, list(range(10))) == expected


def test_loop_reads_the_table_as_it_is_now():
    table = BlockTable(4, 2, 4, 16, False, DEV, 4, 1)
    table.add_row([3, 7], 0)
    assert slot_mapping_loop(table, [0], [4]) == [28]
    table.add_row([9], 0)                       # column 1 still holds the stale 7: position 4 reads it
    assert slot_mapping_loop(table, [0, 0], [0, 4]) == [36, 28]


def test_loop_rejects_bad_input():
    table = BlockTable(4, 2, 4, 16, False, DEV, 4, 1)
    with pytest.raises(TypeError, match="BlockTable"):
        slot_mapping_loop(table.get_numpy_array(), [0], [0])
    with pytest.raises(ValueError, match="same length"):
        slot_mapping_loop(table, [0, 0], [0])
    with pytest.raises(IndexError):
        slot_mapping_loop(table, [0], [16])     # column 4 of a 4-column row


def test_dcp_arithmetic():
    assert [dcp_owner_rank(p, 2) for p in range(6)] == [0, 1, 0, 1, 0, 1]
    assert [dcp_owner_rank(p, 2, 2) for p in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [dcp_owner_rank(p, 4, 8) for p in (0, 7, 8, 31, 32)] == [0, 0, 1, 3, 0]
    assert [dcp_local_position(p, 2, 2) for p in range(8)] == [0, 1, 0, 1, 2, 3, 2, 3]
    assert [dcp_local_position(p, 3, 1) for p in range(7)] == [0, 0, 0, 1, 1, 1, 2]
    assert dcp_owner_rank(5, 1, 4) == 0 and dcp_local_position(5, 1, 4) == 5     # no DCP: unchanged
    # Each rank's tokens, in order, get local positions 0, 1, 2, ...: a dense packing.
    for world, interleave in [(2, 1), (2, 4), (4, 2), (3, 3)]:
        for rank in range(world):
            mine = [p for p in range(120) if dcp_owner_rank(p, world, interleave) == rank]
            assert [dcp_local_position(p, world, interleave) for p in mine] == list(range(len(mine)))
    with pytest.raises(ValueError):
        dcp_owner_rank(-1, 2)
    with pytest.raises(ValueError):
        dcp_local_position(3, 0)
    with pytest.raises(TypeError):
        dcp_owner_rank(1.5, 2)


# --- the benchmark helpers (shapes of results only; no timing thresholds) -------------------------

def test_slot_mapping_batch_is_a_valid_step():
    table, reqs, positions = bench.slot_mapping_batch(3, 5, block_size=8, context=40, seed=1)
    assert reqs.tolist() == [0] * 5 + [1] * 5 + [2] * 5
    for row in range(3):
        p = positions[reqs == row]
        assert np.array_equal(np.diff(p), np.ones(4)) and 0 <= p[0] < 40   # consecutive, after the computed ones
    ids = table.get_numpy_array()
    assert len(set(ids.ravel().tolist())) == ids.size                      # every block id distinct
    table.compute_slot_mapping(reqs, positions)
    assert len(set(table.slot_mapping.np[:15].tolist())) == 15
    with pytest.raises(ValueError):
        bench.slot_mapping_batch(0, 5)


def test_slot_mapping_times_returns_one_time_per_shape(capsys):
    shapes = [(1, 4), (3, 2), (2, 8)]
    num_tokens, times = bench.slot_mapping_times(shapes, block_size=4, min_time=1e-4, repeat=1)
    assert num_tokens == [4, 6, 16]
    assert list(times) == list(bench.SLOT_MAPPING_IMPLS)
    for name, values in times.items():
        assert len(values) == len(shapes) and all(v > 0 and math.isfinite(v) for v in values), name
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 3 and "3 requests x    2 tokens =     6 tokens" in out[1]
    with pytest.raises(ValueError):
        bench.slot_mapping_times([], min_time=1e-4, repeat=1)


def test_slot_mapping_times_catches_a_wrong_loop(monkeypatch):
    def off_by_one(table, reqs, positions):
        return [s + 1 for s in slot_mapping_loop(table, reqs, positions)]
    monkeypatch.setattr(slot_mapping_bench, "slot_mapping_loop", off_by_one)   # the loop it compares with
    with pytest.raises(AssertionError, match="disagree"):
        bench.slot_mapping_times([(2, 3)], min_time=1e-4, repeat=1, print_fn=lambda *_: None)


def test_best_us_counts_calls():
    calls = []
    us = bench.best_us(lambda: calls.append(1), min_time=1e-3, repeat=2)
    assert us > 0 and len(calls) >= 2
    assert bench.cpu_name().endswith("cores")
