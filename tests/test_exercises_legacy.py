"""The checkers of 01_legacy_block_table accept the right answers and reject wrong ones."""
import pytest

import paged_attention.exercises.legacy as ex


def test_cow_after_fork(capsys):
    # 10 tokens in blocks 0, 1, 2; the fork shares all three; its write into block 2 moves it to 3.
    assert ex.cow_after_fork([2, 2, 1, 1], (2, 3))
    assert "correct" in capsys.readouterr().out
    assert not ex.cow_after_fork([2, 2, 2, 0], (2, 3))      # as if nothing had been copied
    assert "not yet" in capsys.readouterr().out
    assert not ex.cow_after_fork([2, 2, 1, 1], (3, 2))      # the pair is (old, new)
    assert not ex.cow_after_fork([2, 2, 1, 1], None)
    # A prompt that fills its last block: the fork's token goes into a fresh block, nothing is copied.
    assert ex.cow_after_fork([2, 2, 1], None, prompt_len=8)
    with pytest.raises(TypeError):
        ex.cow_after_fork("2211", (2, 3))
    with pytest.raises(TypeError):
        ex.next_ids(104)


def test_next_ids():
    assert ex.next_ids([1, 0, 4])
    assert not ex.next_ids([0, 1, 4])        # first in, first out: not how the free list works
    assert not ex.next_ids([4, 5, 6])        # freed ids are not put at the back
    assert ex.next_ids([1, 0, 4], num_gpu_blocks=6)


def test_eviction_sequence():
    assert ex.eviction_sequence([2, 1, 0, 4, 3])
    assert not ex.eviction_sequence([0, 1, 2, 3, 4])     # head before tail
    assert not ex.eviction_sequence([4, 3, 2, 1, 0])     # newest first
    assert not ex.eviction_sequence([2, 1, 0])


def test_window_table():
    assert ex.window_table([3, 3, 3, 4, 2], 13)
    assert not ex.window_table([3, 3, 3, 4, 5], 13)      # the freed block 2 comes back first
    assert not ex.window_table([3, 3, 2, 4, 5], 12)      # block 2 has left the window
