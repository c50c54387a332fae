"""Exercises of ``06_paged_attention_kernels.ipynb``."""
from __future__ import annotations

import math
from typing import Sequence

from paged_attention.exercises import as_float_list, as_int, report
from paged_attention.kernels.layout import v0_key_offset, v1_thread_mapping, v2_merge_weights, v2_partitions


def key_offset(answer: int, d: int = 13, t: int = 6, block_size: int = 16, x: int = 8) -> bool:
    """Exercise 1: the offset of key element ``d`` of token ``t`` in one head's slice of a v0 block."""
    answer = as_int(answer, "answer")
    expected = v0_key_offset(d, t, block_size, x)
    return report(
        answer == expected,
        f"element {d} of token {t} is in chunk {d // x}, at place {d % x}: offset "
        f"({d // x} * {block_size} + {t}) * {x} + {d % x} = {expected}",
        "the slice is [head_size / x, block_size, x]: skip whole chunk rows (d // x of them, each "
        "block_size * x long), then whole tokens of this row (t of them, x each), then d % x",
    )


def partition_tokens(num_partitions: int, start: int, stop: int, seq_len: int = 2100, p: int = 4,
                     partition_size: int = 512) -> bool:
    """Exercise 2: how many v2 partitions a sequence needs, and tokens ``[start, stop)`` of partition ``p``."""
    answer = (as_int(num_partitions, "num_partitions"), as_int(start, "start"), as_int(stop, "stop"))
    parts = v2_partitions(seq_len, partition_size)
    tokens = parts[p] if 0 <= p < len(parts) else range(0)
    return report(
        answer == (len(parts), tokens.start, tokens.stop),
        f"{seq_len} tokens make {len(parts)} partitions of {partition_size}; partition {p} holds "
        f"tokens {tokens.start} to {tokens.stop - 1}",
        "there are ceil(seq_len / partition_size) partitions; partition p starts at "
        "p * partition_size and stops there plus partition_size, or at seq_len, whichever is first",
    )


def thread_group(thread_group_size: int, vec_size: int, block_size: int = 8, dtype_bytes: int = 2,
                 head_size: int = 128) -> bool:
    """Exercise 3: v1's THREAD_GROUP_SIZE and VEC_SIZE for a block size and cache element size."""
    answer = (as_int(thread_group_size, "thread_group_size"), as_int(vec_size, "vec_size"))
    m = v1_thread_mapping(block_size, head_size, dtype_bytes)
    return report(
        answer == (m.thread_group_size, m.vec_size),
        f"block_size {block_size}: {m.thread_group_size} lanes per token; x = {m.x}, so each lane "
        f"loads {m.vec_size} elements ({m.vec_size * dtype_bytes} bytes) of every chunk",
        "a warp's 32 lanes share out the block's tokens (32 // block_size lanes each), and the "
        "lanes of a group share out each 16-byte chunk of x = 16 // dtype_bytes elements",
    )


def merge_weights(answer: Sequence[float], max_logits: Sequence[float] = (3.0, 5.0, 4.0),
                  exp_sums: Sequence[float] = (20.0, 8.0, 12.0)) -> bool:
    """Exercise 4: v2's merge weights ``w_p`` for the given ``m_p`` (max_logits) and ``s_p`` (exp_sums)."""
    answer = as_float_list(answer, "answer")
    expected = v2_merge_weights(max_logits, exp_sums)
    correct = len(answer) == len(expected) and all(
        math.isclose(a, e, rel_tol=1e-4, abs_tol=1e-9) for a, e in zip(answer, expected))
    return report(
        correct,
        "w = [" + ", ".join(f"{w:.4g}" for w in expected) + "]: each exp-sum rescaled to the "
        f"largest maximum, M = {max(max_logits):g}",
        "w_p = s_p * exp(m_p - M) with M the largest m_p: the partition holding M keeps its s_p, "
        "the others shrink",
    )


def v1_context_limit(answer: int, smem_bytes: int = 227 * 1024, logit_bytes: int = 4) -> bool:
    """Exercise 5: about how many tokens of context fit v1's scores in one CUDA block's shared
    memory (the query and the reduction scratch take a little more; within 5 % is right)."""
    answer = as_int(answer, "answer")
    expected = smem_bytes // logit_bytes
    return report(
        abs(answer - expected) <= 0.05 * expected,
        f"{smem_bytes // 1024} KiB / {logit_bytes} bytes per float32 score = {expected} tokens, a little "
        "less once the query and the reduction scratch are in shared memory too",
        "v1 keeps one float32 score per token of the context in shared memory: divide the shared "
        "memory a CUDA block may use by the bytes of one score",
    )
