"""The checkers of 06_paged_attention_kernels accept the right answers and reject wrong ones."""
import math

import pytest

import paged_attention.exercises.kernels as ex


def test_key_offset(capsys):
    # d=13 is in chunk 1 at place 5; token 6: (1 * 16 + 6) * 8 + 5.
    assert ex.key_offset(181)
    assert "correct" in capsys.readouterr().out
    assert not ex.key_offset(13 * 16 + 6)  # the value-cache offset d * block_size + t
    assert "not yet" in capsys.readouterr().out
    assert ex.key_offset(25, d=5, t=2, block_size=4, x=4)
    assert not ex.key_offset(6 * 128 + 13)  # the flash layout's offset


def test_partition_tokens():
    assert ex.partition_tokens(5, 2048, 2100)
    assert not ex.partition_tokens(5, 2048, 2560)  # the last partition stops at seq_len
    assert not ex.partition_tokens(4, 2048, 2100)
    assert not ex.partition_tokens(5, 1536, 2048)  # partition 3, not 4
    assert ex.partition_tokens(1, 0, 512, seq_len=512, p=0)
    assert not ex.partition_tokens(2, 0, 0, seq_len=512, p=1)  # no partition 1 at all


def test_thread_group():
    assert ex.thread_group(4, 2)                     # block 8, fp16: 4 lanes a token, 2 elements each
    assert not ex.thread_group(2, 4)                 # the block-16 numbers
    assert ex.thread_group(2, 4, block_size=16, dtype_bytes=2)
    assert ex.thread_group(1, 4, block_size=32, dtype_bytes=4)


def test_merge_weights():
    right = [20 * math.exp(-2), 8.0, 12 * math.exp(-1)]
    assert ex.merge_weights(right)
    assert ex.merge_weights([round(w, 4) for w in right])
    assert not ex.merge_weights([20.0, 8.0, 12.0])                   # not rescaled
    assert not ex.merge_weights([math.exp(-2), 1.0, math.exp(-1)])   # the exp factors alone
    assert not ex.merge_weights(right[:2])
    assert ex.merge_weights([2.0], max_logits=[7.0], exp_sums=[2.0])


def test_v1_context_limit():
    assert ex.v1_context_limit(58112)
    assert ex.v1_context_limit(57000)              # within 5 %: the scratch arrays take a little
    assert not ex.v1_context_limit(58112 * 2)      # two bytes a score: the scores are float32
    assert not ex.v1_context_limit(227 * 1024)     # bytes, not tokens
    with pytest.raises(TypeError):
        ex.v1_context_limit(58112.0)
