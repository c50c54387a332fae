"""The checkers of 05_kv_cache_allocation accept the right answers and reject wrong ones."""
import pytest
import torch

import paged_attention.exercises.kv_cache as ex


def test_bytes_per_token(capsys):
    assert ex.bytes_per_token(2 * 28 * 4 * 128 * 2)          # Qwen2.5-7B, bf16: 56 KiB
    assert ex.bytes_per_token(2 * 32 * 8 * 128 * 2, num_layers=32, num_kv_heads=8)   # Llama-3-8B: 128 KiB
    assert "correct" in capsys.readouterr().out
    assert not ex.bytes_per_token(28 * 4 * 128 * 2)          # K only
    assert "not yet" in capsys.readouterr().out
    assert not ex.bytes_per_token(2 * 28 * 28 * 128 * 2)     # query heads instead of KV heads
    assert not ex.bytes_per_token(2 * 4 * 128 * 2)           # one layer
    # OPT-13B (the PagedAttention paper): 800 KiB a token in fp16
    assert ex.bytes_per_token(819_200, num_layers=40, num_kv_heads=40, head_size=128, dtype=torch.float16)
    assert ex.bytes_per_token(2 * 2 * 4 * 8 * 4, num_layers=2, num_kv_heads=4, head_size=8, dtype=torch.float32)
    with pytest.raises(TypeError):
        ex.bytes_per_token("131072")
    with pytest.raises(TypeError):
        ex.bytes_per_token(131072.0)


def test_num_blocks():
    right = 4 * 2**30 // (16 * 2 * 4 * 128 * 2) // 28         # 4,681 blocks of 28 pages of 32 KiB
    assert ex.num_blocks(right)
    assert not ex.num_blocks(right * 28)                       # forgot the layers
    assert not ex.num_blocks(right * 16)                       # tokens, not blocks
    assert not ex.num_blocks(4 * 2**30 // (16 * 4 * 128 * 2) // 28)   # K or V only
    assert ex.num_blocks(2048, num_layers=32, num_kv_heads=8)  # Llama-3-8B
    assert ex.num_blocks(1, available_gib=1, num_layers=1, num_kv_heads=1, head_size=1,
                         block_size=1 << 28)                   # 1 GiB is exactly one page of 2**28 tokens
    with pytest.raises(TypeError):
        ex.num_blocks(True)


def test_hnd_offset():
    # block 3, token 5, head 1, dim 7; [16 tokens, 2 heads, 32 dims] a block, heads outside tokens
    assert ex.hnd_offset(3 * 1024 + 1 * 16 * 32 + 5 * 32 + 7)
    assert not ex.hnd_offset(3 * 1024 + 5 * 64 + 1 * 32 + 7)   # the NHD offset
    assert not ex.hnd_offset(3 * 2048 + 1 * 16 * 32 + 5 * 32 + 7)  # as if V sat inside each block
    assert ex.hnd_offset(0, block=0, token=0, head=0, dim=0)
    assert ex.hnd_offset(2 * 16 * 1 * 4 + 15 * 4 + 3, block=2, token=15, head=0, dim=3,
                         num_kv_heads=1, head_size=4)          # one head: HND equals NHD
    with pytest.raises(TypeError):
        ex.hnd_offset("3751")
