"""The arithmetic of vLLM's classic CUDA paged-attention kernels, in plain Python.

vLLM's first attention kernels (``paged_attention_v1`` and ``_v2`` in vLLM's
``csrc/attention/attention_kernels.cuh``; ours are in ``kernels/cuda/csrc/attention.cuh``) read
a cache laid out for them, the *v0 layout*:

* key cache ``[num_blocks, num_kv_heads, head_size / x, block_size, x]`` with ``x = 16 bytes /
  element size``: a key is cut into ``x``-element chunks of 16 bytes, and chunk ``c`` of every
  token of a block is stored side by side, so one vectorised load fetches a whole chunk;
* value cache ``[num_blocks, num_kv_heads, head_size, block_size]``: tokens innermost.

v1 runs one CUDA block of 128 threads (4 warps) per (head, sequence) and spreads each KV block
over the lanes of a warp; v2 adds a third grid dimension, 512-token *partitions* of the context,
and a second kernel that merges them. The functions here say where an element lives, which lane
loads what, which tokens a partition covers and how partitions are weighted when merged: the
kernels' bookkeeping, small enough to check by hand (the drawings and exercises use them).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from paged_attention.utils import check_int, is_int

WARP_SIZE = 32
CHUNK_BYTES = 16              # one vectorised load: the key cache's x-chunk is this many bytes
V1_BLOCK_SIZES = (8, 16, 32)  # the block sizes vLLM compiles its v0 attention kernels for
PARTITION_SIZE = 512          # paged_attention_v2 cuts each sequence into partitions of this many tokens


# --------------------------------------------------------------------------------------------
# 1. Where an element lives
# --------------------------------------------------------------------------------------------

def v0_x(dtype: torch.dtype) -> int:
    """Elements per 16-byte chunk of the v0 key cache: 8 for fp16/bf16, 4 for fp32, 16 for fp8."""
    return CHUNK_BYTES // torch.empty((), dtype=dtype).element_size()


def v0_key_offset(d: int, t: int, block_size: int, x: int) -> int:
    """Where element ``d`` of token ``t``'s key sits in one head's slice of a v0 key-cache block.

    The slice is ``[head_size / x, block_size, x]`` in memory order: chunk ``d // x`` first, then
    the token, then the place ``d % x`` inside the chunk.

    >>> v0_key_offset(d=5, t=2, block_size=4, x=4)   # chunk 1, token 2, place 1
    25
    """
    return ((d // x) * block_size + t) * x + d % x


def v0_value_offset(d: int, t: int, block_size: int) -> int:
    """Where element ``d`` of token ``t``'s value sits in one head's ``[head_size, block_size]`` slice."""
    return d * block_size + t


# --------------------------------------------------------------------------------------------
# 2. Which lane of v1 loads what
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ThreadMapping:
    """How v1 spreads the keys of one KV block over the lanes of one warp.

    A *thread group* of ``thread_group_size`` lanes owns one token of the block; lane ``l`` of a
    group loads elements ``[l * vec_size, (l + 1) * vec_size)`` of every ``x``-chunk of that
    token's key, ``vecs_per_lane`` loads in all, and the group adds up its partial dot products
    with warp shuffles.
    """

    block_size: int
    head_size: int
    dtype_bytes: int
    num_warps: int
    x: int                  # elements per 16-byte chunk of the key cache
    thread_group_size: int  # lanes per token
    vec_size: int           # elements one lane loads at a time
    groups_per_warp: int    # tokens a warp works on at once
    vecs_per_lane: int      # loads per lane to cover a whole key

    @property
    def num_threads(self) -> int:
        return WARP_SIZE * self.num_warps

    def lane_elements(self, lane: int, chunk: int) -> tuple[int, list[int]]:
        """``(token, dims)``: the token of the block and the key dims ``lane`` loads from ``chunk``."""
        group, place = divmod(lane, self.thread_group_size)
        start = chunk * self.x + place * self.vec_size
        return group, list(range(start, start + self.vec_size))


def v1_thread_mapping(block_size: int = 16, head_size: int = 128, dtype_bytes: int = 2,
                      num_warps: int = 4) -> ThreadMapping:
    """The numbers of :class:`ThreadMapping` for a block size, head size and cache element size."""
    if block_size not in V1_BLOCK_SIZES or not is_int(block_size):
        raise ValueError(f"block_size must be one of {V1_BLOCK_SIZES} (vLLM's compiled sizes), "
                         f"got {block_size!r}")
    if dtype_bytes not in (1, 2, 4) or not is_int(dtype_bytes):
        raise ValueError(f"dtype_bytes must be 1 (fp8), 2 (fp16/bf16) or 4 (fp32), got {dtype_bytes!r}")
    head_size = check_int("head_size", head_size, 1)
    num_warps = check_int("num_warps", num_warps, 1)
    x = CHUNK_BYTES // dtype_bytes
    if head_size % x:
        raise ValueError(f"head_size ({head_size}) must be a multiple of x = {x} for "
                         f"{dtype_bytes}-byte elements")
    group = max(WARP_SIZE // block_size, 1)
    vec = max(x // group, 1)
    return ThreadMapping(block_size=block_size, head_size=head_size, dtype_bytes=dtype_bytes,
                         num_warps=num_warps, x=x, thread_group_size=group, vec_size=vec,
                         groups_per_warp=WARP_SIZE // group, vecs_per_lane=head_size // (group * vec))


@dataclass(frozen=True)
class V1Launch:
    """How this project's CUDA ``paged_attention_v1`` launches for one batch, and what shared
    memory lets a multiprocessor hold at once.

    v1 keeps a float32 score for every token of the longest sequence, per query head of the CUDA
    block, in shared memory. ``heads_per_block`` is 4 where a GQA group of four query heads shares
    each key and value load and their scores fit under the per-block limit, else 1 (vLLM's
    mapping). ``blocks_per_sm`` counts what shared memory alone allows (the threads' limit too, not
    the registers'); ``waves`` is how many rounds the grid takes when every multiprocessor is full.
    """

    heads_per_block: int
    shared_bytes: int       # one CUDA block's shared memory: the scores, the query, the reductions
    blocks_per_sm: int
    num_blocks: int         # the grid: (num_heads / heads_per_block) x num_seqs
    waves: int


V1_NUM_WARPS = 4
_SHARED_RESERVED = 1024     # bytes the CUDA runtime keeps per block (compute capability 8.0 and up)


def v1_launch(num_seqs: int, num_heads: int, num_kv_heads: int, head_size: int, max_seq_len: int,
              block_size: int, *, shared_per_block: int, shared_per_sm: int, num_sms: int) -> V1Launch:
    """The launch of ``kernels/cuda``'s v1 for a batch of ``num_seqs`` sequences (see
    :class:`V1Launch`). ``shared_per_block`` is the device's opt-in limit per block,
    ``shared_per_sm`` its shared memory per multiprocessor (``torch.cuda.get_device_properties``:
    ``shared_memory_per_block_optin``, ``shared_memory_per_multiprocessor``)."""
    for name, value in (("num_seqs", num_seqs), ("num_heads", num_heads), ("num_kv_heads", num_kv_heads),
                        ("head_size", head_size), ("max_seq_len", max_seq_len), ("block_size", block_size),
                        ("shared_per_block", shared_per_block), ("shared_per_sm", shared_per_sm),
                        ("num_sms", num_sms)):
        check_int(name, value, 1)
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    tokens = math.ceil(max_seq_len / block_size) * block_size       # scores are kept for whole blocks

    def shared(group: int) -> int:
        return 4 * (group * tokens + group * head_size + group * V1_NUM_WARPS)

    group = 4 if (num_heads // num_kv_heads) % 4 == 0 and shared(4) + 64 <= shared_per_block else 1
    need = shared(group)
    if need > shared_per_block:
        raise ValueError(f"a context of {max_seq_len} tokens needs {need} bytes of shared memory per CUDA "
                         f"block, more than the device allows ({shared_per_block}): v1 cannot run it")
    per_sm = max(1, min(shared_per_sm // (need + _SHARED_RESERVED), 2048 // (WARP_SIZE * V1_NUM_WARPS)))
    num_blocks = (num_heads // group) * num_seqs
    return V1Launch(group, need, per_sm, num_blocks, math.ceil(num_blocks / (per_sm * num_sms)))


# --------------------------------------------------------------------------------------------
# 3. v2's partitions and how they are merged
# --------------------------------------------------------------------------------------------

def v2_partitions(seq_len: int, partition_size: int = PARTITION_SIZE) -> list[range]:
    """The token ranges of a sequence's v2 partitions; the last one may be shorter.

    >>> v2_partitions(1400)
    [range(0, 512), range(512, 1024), range(1024, 1400)]
    """
    seq_len = check_int("seq_len", seq_len, 1)
    partition_size = check_int("partition_size", partition_size, 1)
    return [range(lo, min(lo + partition_size, seq_len)) for lo in range(0, seq_len, partition_size)]


def v2_merge_weights(max_logits: Sequence[float], exp_sums: Sequence[float]) -> list[float]:
    """Each partition's weight in v2's reduction: ``w_p = s_p * exp(m_p - M)``, ``M = max_p m_p``.

    ``s_p`` sums ``exp(logit - m_p)`` over partition ``p``; multiplying by ``exp(m_p - M)`` puts
    every partition's sum on the same scale, the global maximum's.
    """
    if len(max_logits) != len(exp_sums) or not len(max_logits):
        raise ValueError("max_logits and exp_sums must be non-empty and of the same length, got "
                         f"{len(max_logits)} and {len(exp_sums)}")
    top = max(max_logits)
    return [s * math.exp(m - top) for m, s in zip(max_logits, exp_sums)]


@dataclass(frozen=True)
class OnlineSoftmaxStep:
    """The running state after one tile of scores: ``m`` the maximum so far, ``alpha`` the factor
    that rescaled the earlier sums (``exp(m_before - m)``), ``l`` the sum of ``exp(score - m)``
    and ``acc`` the sum of ``exp(score - m) * value``. ``acc / l`` is the attention output over
    the tokens seen so far."""

    tokens: range
    tile_max: float
    m: float
    alpha: float
    l: float
    acc: tuple[float, ...]

    @property
    def output(self) -> tuple[float, ...]:
        return tuple(a / self.l for a in self.acc)


def online_softmax_steps(scores: Sequence[float], values: Sequence[Sequence[float]],
                         tile: int) -> list[OnlineSoftmaxStep]:
    """Softmax-weighted sum of ``values`` by ``scores``, one tile of tokens at a time, as the decode
    kernels compute it: no score is kept, only a running maximum, sum and weighted sum, rescaled
    by ``alpha`` whenever a tile brings a larger maximum. The last step's ``output`` equals
    ``softmax(scores) @ values``; its ``(m, l)`` are what v2 and flash-decoding store per
    partition for the merge (``v2_merge_weights``)."""
    tile = check_int("tile", tile, 1)
    if not len(scores) or len(scores) != len(values):
        raise ValueError(f"scores and values must be non-empty and of the same length, got {len(scores)} "
                         f"and {len(values)}")
    width = len(values[0])
    if any(len(v) != width for v in values):
        raise ValueError("every value must have the same length")
    m, l, acc, steps = -math.inf, 0.0, [0.0] * width, []
    for lo in range(0, len(scores), tile):
        part = range(lo, min(lo + tile, len(scores)))
        tile_max = max(scores[j] for j in part)
        m_new = max(m, tile_max)
        alpha = math.exp(m - m_new)                  # 0 on the first tile (m = -inf)
        p = [math.exp(scores[j] - m_new) for j in part]
        l = l * alpha + sum(p)
        acc = [a * alpha + sum(pj * values[j][d] for pj, j in zip(p, part)) for d, a in enumerate(acc)]
        m = m_new
        steps.append(OnlineSoftmaxStep(part, tile_max, m, alpha, l, tuple(acc)))
    return steps
