"""The checkers of 03_v1_block_table accept the right answers and reject wrong ones."""
import pytest

import paged_attention.exercises.v1 as ex


def test_token_slot(capsys):
    # Position 37 with blocks of 16: column 2 (block 40), offset 5.
    assert ex.token_slot(645)
    assert "correct" in capsys.readouterr().out
    assert not ex.token_slot(12 * 16 + 37)          # as if the row were contiguous from its first block
    assert "not yet" in capsys.readouterr().out
    assert not ex.token_slot(2 * 16 + 5)            # the column, not the block id
    assert ex.token_slot(29, position=5, row=[3, 7], block_size=4)
    with pytest.raises(TypeError):
        ex.token_slot("645")
    with pytest.raises(TypeError):
        ex.token_slot(True)


def test_row_after_condense():
    assert ex.row_after_condense([13, 4, 6, 8, 0, 0], 1)
    assert not ex.row_after_condense([13, 0, 0, 0, 0, 0], 1)     # add_row does not clear the rest
    assert not ex.row_after_condense([13, 4, 6, 8, 0, 0], 4)     # the count is add_row's
    assert not ex.row_after_condense([2, 5, 0, 0, 0, 0], 2)      # that is row 2 after the swap
    assert not ex.row_after_condense([13], 1)
    with pytest.raises(TypeError):
        ex.row_after_condense("13", 1)


def test_dcp_slot():
    # Position 21, interleave 2, 4 ranks: run 10 -> rank 2; local token 5 -> block 11, offset 1.
    assert ex.dcp_slot(2, 45)
    assert not ex.dcp_slot(1, 45)                      # 21 % 4 = 1: the interleave-1 owner
    assert not ex.dcp_slot(2, 11 * 4 + 21 % 8)         # the offset in the virtual block, not the local one
    assert not ex.dcp_slot(2, 12 * 4 + 5)              # block 21 // 8 = 2, without the local packing
    assert ex.dcp_slot(1, 40, position=1, dcp_world_size=2, interleave=1)
    assert ex.dcp_slot(0, 41, position=2, dcp_world_size=2, interleave=1)


def test_kernel_slot():
    # Position 40, manager blocks [5, 9] of 32, kernel blocks of 16: kernel column 2 = block 18, slot 296.
    assert ex.kernel_slot(18, 296)
    assert not ex.kernel_slot(9, 296)                  # the manager's id, not the kernel's
    assert not ex.kernel_slot(18, 18 * 32 + 8)         # the slot counts kernel blocks of 16
    assert not ex.kernel_slot(19, 296)
    assert ex.kernel_slot(11, 177, position=17)
    assert ex.kernel_slot(3, 3 * 16 + 5, position=5, row=[3], block_size=16, kernel_block_size=16)
