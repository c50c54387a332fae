"""The checkers of 04_v2_triton_block_tables accept the right answers and reject wrong ones."""
import pytest

import paged_attention.exercises.v2 as ex


def test_slot_mapping(capsys):
    # State 0 = [9], state 3 = [4, 12, 7], blocks of 16; tokens at 14, 15 (state 0) and 40 (state 3).
    assert ex.slot_mapping([158, 159, 120])
    assert "correct" in capsys.readouterr().out
    assert not ex.slot_mapping([4 * 16 + 14, 4 * 16 + 15, 9 * 16 + 8])     # batch position read as request state
    assert "not yet" in capsys.readouterr().out
    assert not ex.slot_mapping([158, 159, 4 * 16 + 40])                    # as if the row were contiguous
    assert not ex.slot_mapping([158, 159])
    assert ex.slot_mapping([35, 3 * 8 + 1], rows={1: [2, 4], 0: [3]}, idx_mapping=[1, 0],
                           query_start_loc=[0, 1, 2], positions=[11, 1], block_size=8)
    with pytest.raises(TypeError):
        ex.slot_mapping("158")


def test_gathered_rows():
    assert ex.gathered_rows([2, 9, 11, 12, 0, 0], [8, 9, 0, 0, 0, 0])
    assert not ex.gathered_rows([2, 9, 11, 0, 0, 0], [8, 0, 0, 0, 0, 0])     # as if the gather cleared the rows
    assert not ex.gathered_rows([8, 9, 0, 0, 0, 0], [2, 9, 11, 12, 0, 0])    # rows swapped
    assert not ex.gathered_rows([2, 9, 11, 12, 0, 0], [8, 7, 10, 12, 0, 0])  # the persistent row of state 0
    assert not ex.gathered_rows([2, 9, 11, 12], [8, 9, 0, 0])
    with pytest.raises(TypeError):
        ex.gathered_rows("2, 9", [8])


def test_block_counts():
    assert ex.block_counts(5, 3)
    assert not ex.block_counts(5, 5)      # the GPU sees nothing before the apply
    assert not ex.block_counts(3, 3)      # the host count changes at once
    assert not ex.block_counts(2, 3)
    with pytest.raises(TypeError):
        ex.block_counts(True, 3)
    with pytest.raises(TypeError):
        ex.block_counts(5, "3")


def test_slot_programs():
    assert ex.slot_programs(2050, 128)
    assert not ex.slot_programs(2048, 128)          # the padding program of each group
    assert not ex.slot_programs(1025, 128)          # one per group
    assert not ex.slot_programs(2050, 8)            # tiles cover the whole buffer, not just the 1024 tokens
    assert not ex.slot_programs(2050, 256)          # ours does every group in one program
    assert ex.slot_programs(3 * 9, 4, num_groups=3, num_reqs=8, max_num_batched_tokens=64, block_tokens=16)
    with pytest.raises(TypeError):
        ex.slot_programs(2050.0, 128)
