"""Triton paged decode attention: one new query token per sequence, keys and values read
through a block table.

The problem. Sequence ``s`` has ``seq_lens[s]`` tokens cached. Token ``j`` of it lives in
physical block ``block_tables[s, j // block_size]``, at row ``j % block_size`` of that block.
For each query head ``h`` we want ``softmax(scale * q_h . K^T) V`` over those tokens, where K and
V come from KV head ``h // (num_heads / num_kv_heads)`` (grouped-query attention, GQA).

The method (flash-decoding).

* One program per (sequence, KV head, split). It loads all the query heads that share its KV
  head as the rows of one tile, so every key and value it reads from memory serves all of them:
  a decode step is bound by memory, and this reads the cache exactly once.
* A program walks its tokens ``TILE_N`` at a time. For each token it looks up the physical block
  in the block table, so a tile may span several blocks that are scattered anywhere in the
  cache: paging costs one extra (cached) load per token, not a copy.
* Softmax is computed online: a running maximum ``m``, running sum ``l`` and running weighted
  sum ``acc`` are rescaled whenever a larger score appears, so no score is stored.
* Long sequences with few programs would leave most of the GPU idle. Then each sequence's
  context is cut into ``num_splits`` contiguous ranges, each program reduces one range to a
  partial ``(m, l, acc / l)``, and a second small kernel merges the partials:
  ``out = sum_i w_i o_i / sum_i w_i`` with ``w_i = l_i * 2^(m_i - M)`` and ``M = max_i m_i``.

Scores are kept in base 2 (``scale * log2(e)`` folded into the query scale), because ``exp2`` is
the GPU's native instruction; the softmax is unchanged by the change of base.

In a model's decode step the kernel may be launched early (``pdl=True``, ``pdl.py``): it then asks
the L2 cache for its context's keys and values while the QKV projection before it finishes, and
waits for that projection only before it reads the queries.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from paged_attention.kernels import args
from paged_attention.kernels.triton import pdl as _pdl
from paged_attention.kernels.triton.common import LOG2E, check_triton_dtype, kv_position, load_kv_tile
from paged_attention.kernels.triton.common import span as _span
from paged_attention.kernels.triton.launch import cached_plan, check_planned, tensor_signature
from paged_attention.triton_launch import Launcher
from paged_attention.utils import cdiv, is_int


@triton.jit
def _lse(m, total):
    """The natural log-sum-exp ``ln 2 * (m + log2 total)`` of scores whose base-2 maximum is ``m``
    and whose sum of ``2^(score - m)`` is ``total``; ``-inf`` where there were none (0)."""
    return tl.where(total > 0, (m + tl.log2(tl.where(total > 0, total, 1.0))) * 0.6931471805599453,
                    float("-inf"))


@triton.jit
def _rotate_half(x, partner, cos, sin, first_half):
    """Rotate-half RoPE of head vectors ``x`` in float32, ``partner`` holding each dimension's pair
    (``j + D/2`` for ``j < D/2`` and back): ``x1 cos - x2 sin`` on the first half, ``x2 cos + x1
    sin`` on the second, the products and sums of ``layer_ops``'s rotary kernel, in its order."""
    x = x.to(tl.float32)
    partner = partner.to(tl.float32)
    return tl.where(first_half, x * cos - partner * sin, x * cos + partner * sin)


@triton.jit
def _rope_inputs(cos_sin_ptr, pos_ptr, slot_ptr, seq, d, BLOCK_D: tl.constexpr):
    """What ``_rope_and_write`` needs besides the QKV row, none of it the QKV projection's output
    (so that, launched early, the kernel reads it before waiting): the cosines and sines of
    sequence ``seq``'s new position for dimensions ``d`` (pair ``j = d mod D/2``) and its slot."""
    HALF = BLOCK_D // 2
    pos = tl.load(pos_ptr + seq).to(tl.int64)
    j = d % HALF
    cos = tl.load(cos_sin_ptr + pos * BLOCK_D + j)
    sin = tl.load(cos_sin_ptr + pos * BLOCK_D + HALF + j)
    return cos, sin, tl.load(slot_ptr + seq).to(tl.int64)


@triton.jit
def _rope_and_write(q, row, head, g_mask, d, cos, sin, slot, seq_len, start, end, kv_head,
                    num_heads, num_kv_heads, head_stride, k_cache_ptr, v_cache_ptr,
                    k_stride_blk, k_stride_tok, k_stride_head, v_stride_blk, v_stride_tok, v_stride_head,
                    BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """A decode step's rotary embedding and cache write, done by the attention kernel itself
    (``cos``, ``sin`` and ``slot``: ``_rope_inputs``).

    ``row`` is the sequence's row of the fused QKV projection: ``num_heads`` query heads, then
    ``num_kv_heads`` key heads, then as many value heads, ``head_stride`` (= D) apart. Returns this
    program's query heads ``q`` rotated by the new token's position (float32 maths, rounded to
    the dtype, as the rotary kernel stores them). The program whose range of the context holds the
    new token (the sequence's last, ``seq_len - 1``) also rotates that token's key of this KV head
    and stores it, with the value, at the token's slot (none for a negative slot); then a barrier,
    so that the loop that follows reads the slot back as any other.
    """
    HALF = BLOCK_D // 2
    partner = (d + HALF) % BLOCK_D
    first_half = d < HALF
    q_partner = tl.load(row + head[:, None] * head_stride + partner[None, :], mask=g_mask[:, None], other=0.0)
    q = _rotate_half(q, q_partner, cos[None, :], sin[None, :], first_half[None, :]).to(q.dtype)

    last = seq_len - 1
    writes = (start <= last) & (last < end) & (slot >= 0)
    key = row + (num_heads + kv_head) * head_stride
    value = row + (num_heads + num_kv_heads + kv_head) * head_stride
    k = _rotate_half(tl.load(key + d), tl.load(key + partner), cos, sin, first_half)
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    mask = (tl.zeros([BLOCK_D], tl.int32) + writes.to(tl.int32)) != 0
    tl.store(k_cache_ptr + blk * k_stride_blk + off * k_stride_tok + kv_head * k_stride_head + d,
             k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + blk * v_stride_blk + off * v_stride_tok + kv_head * v_stride_head + d,
             tl.load(value + d), mask=mask)
    tl.debug_barrier()
    return q


@triton.jit
def _prefetch_context(k_head, v_head, table, bt_stride_b, start, end, k_stride_blk, k_stride_tok, v_stride_blk,
                      v_stride_tok, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
                      OFFSETS_64: tl.constexpr):
    """``pdl.prefetch`` the keys and values of tokens ``[start, end)`` of one KV head, found through
    the block table as ``load_kv_tile`` finds them: a 64-byte sector every 32 elements of a row."""
    STEPS: tl.constexpr = (BLOCK_D + 31) // 32
    d = tl.arange(0, STEPS) * 32
    for t0 in range(start, end, TILE_N):
        n = t0 + tl.arange(0, TILE_N)
        n_mask = n < end
        block, row = kv_position(table, bt_stride_b, n, n_mask, BLOCK_SIZE=BLOCK_SIZE, OFFSETS_64=OFFSETS_64)
        mask = n_mask[:, None] & (d < BLOCK_D)[None, :]
        _pdl.prefetch(k_head + block[:, None] * k_stride_blk + row[:, None] * k_stride_tok + d[None, :], mask, k_head)
        _pdl.prefetch(v_head + block[:, None] * v_stride_blk + row[:, None] * v_stride_tok + d[None, :], mask, v_head)


@triton.jit
def _paged_decode_kernel(
    out_ptr, part_out_ptr, part_m_ptr, part_l_ptr, lse_ptr,
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, alibi_ptr,
    cos_sin_ptr, pos_ptr, slot_ptr,             # ROPE only: angles [positions, 2, D/2], positions, slots
    qk_scale,                                   # scale * log2(e)
    tokens_per_split, num_splits,
    q_stride_s, q_stride_h,
    k_stride_blk, k_stride_tok, k_stride_head,
    v_stride_blk, v_stride_tok, v_stride_head,
    bt_stride_s, bt_stride_b,                   # block table: per sequence, per block entry
    sl_stride, alibi_stride,                    # seq_lens and alibi_slopes may be strided views
    o_stride_s, o_stride_h,
    QUERIES_PER_KV: tl.constexpr,               # query heads sharing one KV head (GQA group)
    BLOCK_G: tl.constexpr,                      # that group padded to a tile height >= 16
    HEAD_SIZE: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,                   # tokens per KV-cache block (page)
    TILE_N: tl.constexpr,                       # tokens per loop step
    SPLIT: tl.constexpr,                        # False: one split, write `out` directly
    USE_ALIBI: tl.constexpr, STORE_LSE: tl.constexpr,   # STORE_LSE: each head's log-sum-exp to lse_ptr
    ROPE: tl.constexpr,                         # q_ptr: unrotated QKV rows; rotate, write the new token
    DOT_PRECISION: tl.constexpr,
    OFFSETS_64: tl.constexpr,                   # the cache spans >= 2^31 elements: int64 offsets
    PDL: tl.constexpr,                          # launched early (pdl.py): lengths and tables read, and the
                                                # context prefetched, before the wait
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_heads = tl.num_programs(1) * QUERIES_PER_KV

    seq_len = tl.load(seq_lens_ptr + seq * sl_stride).to(tl.int32)
    start = split * tokens_per_split
    # The last split runs to the sequence's end, so a too-small max_seq_len (unchecked when
    # check_ids=False) costs balance, never tokens.
    end = tl.where(split == num_splits - 1, seq_len, tl.minimum(start + tokens_per_split, seq_len))
    if PDL:
        # While the previous kernel (the QKV projection) ends: ask the L2 cache for this program's
        # keys and values. They are this layer's cache, which no kernel of the step but this one
        # writes (the new token's row, after the wait: the line is fetched again then).
        _prefetch_context(k_cache_ptr + kv_head * k_stride_head, v_cache_ptr + kv_head * v_stride_head,
                          block_tables_ptr + seq.to(tl.int64) * bt_stride_s, bt_stride_b, start, end,
                          k_stride_blk, k_stride_tok, v_stride_blk, v_stride_tok,
                          BLOCK_D=BLOCK_D, BLOCK_SIZE=BLOCK_SIZE, TILE_N=TILE_N, OFFSETS_64=OFFSETS_64)
    # Rows of the tile: the query heads of this KV head's group (rows >= QUERIES_PER_KV are
    # padding, with zero queries). Columns: the head dimension, padded to a power of two.
    g = tl.arange(0, BLOCK_G)
    head = kv_head * QUERIES_PER_KV + g
    g_mask = g < QUERIES_PER_KV
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_SIZE
    if ROPE:
        cos, sin, slot = _rope_inputs(cos_sin_ptr, pos_ptr, slot_ptr, seq, d, BLOCK_D=BLOCK_D)
    _pdl.wait(PDL)                                      # the queries are the previous kernel's output
    _pdl.launch_dependents(PDL)
    q = tl.load(q_ptr + seq * q_stride_s + head[:, None] * q_stride_h + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if ROPE:
        q = _rope_and_write(q, q_ptr + seq * q_stride_s, head, g_mask, d, cos, sin, slot, seq_len, start, end,
                            kv_head, num_heads, tl.num_programs(1), q_stride_h,
                            k_cache_ptr, v_cache_ptr, k_stride_blk, k_stride_tok, k_stride_head,
                            v_stride_blk, v_stride_tok, v_stride_head, BLOCK_D=BLOCK_D, BLOCK_SIZE=BLOCK_SIZE)
    if USE_ALIBI:
        slope = tl.load(alibi_ptr + head * alibi_stride, mask=g_mask, other=0.0) * 1.4426950408889634

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)   # running max score (base 2)
    l_i = tl.zeros([BLOCK_G], tl.float32)                 # running sum of 2^(score - m_i)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)        # running sum of 2^(score - m_i) * v

    table = block_tables_ptr + seq.to(tl.int64) * bt_stride_s
    k_head = k_cache_ptr + kv_head * k_stride_head
    v_head = v_cache_ptr + kv_head * v_stride_head
    for tile_start in range(start, end, TILE_N):
        n = tile_start + tl.arange(0, TILE_N)             # token positions in the sequence
        n_mask = n < end
        k, v = load_kv_tile(k_head, v_head, table, bt_stride_b, n, n_mask, d, d_mask,
                            k_stride_blk, k_stride_tok, v_stride_blk, v_stride_tok,
                            BLOCK_SIZE=BLOCK_SIZE, OFFSETS_64=OFFSETS_64)   # [TILE_N, BLOCK_D] each

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale   # [BLOCK_G, TILE_N]
        if USE_ALIBI:
            # ALiBi: slope * (j - seq_len + 1), zero for the newest token.
            s += slope[:, None] * (n - seq_len + 1).to(tl.float32)[None, :]
        s = tl.where(n_mask[None, :], s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)                      # rescales what was summed so far
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    o_mask = g_mask[:, None] & d_mask[None, :]
    if not SPLIT:
        # An empty sequence (l = 0: only unchecked calls may pass a length of 0) gets a zero
        # output and lse = -inf, as an empty split does below: weight zero in any later merge.
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + seq * o_stride_s + head[:, None] * o_stride_h + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=o_mask)
        if STORE_LSE:                                     # ln(sum of e^score) = ln2 * (m + log2 l)
            tl.store(lse_ptr + seq * num_heads + head, _lse(m_i, l_i), mask=g_mask)
    else:
        # Partial result of this split: normalised output, max and sum, in float32 buffers of
        # shape [num_seqs, num_heads, num_splits(, HEAD_SIZE)]. An empty split (start >= end)
        # stores m = -inf, l = 0: weight zero in the merge.
        idx = (seq * num_heads + head) * num_splits + split
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(part_out_ptr + idx[:, None] * HEAD_SIZE + d[None, :], out, mask=o_mask)
        tl.store(part_m_ptr + idx, m_i, mask=g_mask)
        tl.store(part_l_ptr + idx, l_i, mask=g_mask)


@triton.jit
def _merge_splits_kernel(
    out_ptr, part_out_ptr, part_m_ptr, part_l_ptr, lse_ptr,
    o_stride_s, o_stride_h, num_splits,
    po_stride_p, po_stride_s, po_stride_h,      # partial outputs: per part, sequence, head
    pm_stride_p, pm_stride_s, pm_stride_h,      # their maxima (and sums, laid out alike)
    HEAD_SIZE: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, STORE_LSE: tl.constexpr,
    LSE_PARTS: tl.constexpr,                    # parts given by natural-log lse (sum 1), not (m, l)
):
    # One program per (sequence, query head): merge its num_splits partial results. The parts
    # are a decode's splits (base-2 maxima and sums) or, with LSE_PARTS, attention over disjoint
    # shares of a context given by their log-sum-exps (decode context parallelism's ranks).
    seq = tl.program_id(0)
    head = tl.program_id(1)
    i = tl.arange(0, BLOCK_S)
    i_mask = i < num_splits
    pm = seq * pm_stride_s + head * pm_stride_h + i * pm_stride_p
    m = tl.load(part_m_ptr + pm, mask=i_mask, other=float("-inf"))
    if LSE_PARTS:
        m = m * 1.4426950408889634                # ln -> log2; an empty part (-inf) has no mass
        sums = tl.where(m > float("-inf"), 1.0, 0.0)
    else:
        sums = tl.load(part_l_ptr + pm, mask=i_mask, other=0.0)
    m_max = tl.max(m, axis=0)
    m_ref = tl.where(m_max > float("-inf"), m_max, 0.0)   # all parts empty: no -inf - -inf
    w = sums * tl.exp2(m - m_ref)              # each split's softmax mass, on a common scale
    w = tl.where(i_mask & (sums > 0), w, 0.0)  # empty splits weigh nothing
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_SIZE
    po = seq * po_stride_s + head * po_stride_h + i * po_stride_p
    o = tl.load(part_out_ptr + po[:, None] + d[None, :], mask=i_mask[:, None] & d_mask[None, :], other=0.0)
    total = tl.sum(w, axis=0)
    # All parts empty (a sequence of length 0): a zero output and lse = -inf, not 0 / 0.
    out = tl.sum(o.to(tl.float32) * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * o_stride_s + head * o_stride_h + d, out.to(out_ptr.dtype.element_ty), mask=d_mask)
    if STORE_LSE:
        tl.store(lse_ptr + seq * tl.num_programs(1) + head, _lse(m_max, total))


def check_lse(lse: torch.Tensor | None, query: torch.Tensor, query_name: str = "query") -> None:
    """An ``lse`` output is None or a contiguous float32 ``[num_seqs, num_heads]`` tensor on the
    query's device (the kernels index it as one flat row per sequence)."""
    if lse is None:
        return
    args.tensor("lse", lse, ndim=2, dtypes=(torch.float32,))
    args.shape("lse", lse, query.shape[:2])
    args.same_device(**{query_name: query, "lse": lse})
    if not lse.is_contiguous():
        raise ValueError(f"lse must be contiguous (the kernels write it as one flat row per sequence), "
                         f"got strides {list(lse.stride())}")


def check_rope(rope: object, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """A decode's ``rope=(cos_sin, positions, slot_mapping)``, checked against its query and
    caches (typed errors, before any launch): ``cos_sin`` float32 ``[max_position, 2, D/2]``
    contiguous (cos then sin, RoPE's rotate-half pairing), ``positions`` and ``slot_mapping``
    contiguous int32/int64 ``[num_seqs]``, all on the query's device; a head size that is a power
    of two; ``query`` ``[num_seqs, num_heads, D]`` with contiguous heads, each row followed in
    memory by the token's ``num_kv_heads`` key heads and as many value heads (the fused QKV
    projection's layout, of which ``query`` is the first columns), of the caches' dtype."""
    if rope is None:
        return None
    if not isinstance(rope, tuple) or len(rope) != 3:
        raise TypeError(f"rope must be None or a tuple (cos_sin, positions, slot_mapping), got {args.type_name(rope)}")
    cos_sin, positions, slot_mapping = rope
    num_seqs, num_heads, head_size = query.shape
    num_kv_heads = key_cache.size(2)
    args.tensor("cos_sin", cos_sin, ndim=3, dtypes=(torch.float32,))
    for name, t in (("positions", positions), ("slot_mapping", slot_mapping)):
        args.tensor(name, t, ndim=1, dtypes=(torch.int32, torch.int64))
        args.shape(name, t, (num_seqs,))
    args.same_device(query=query, cos_sin=cos_sin, positions=positions, slot_mapping=slot_mapping)
    if head_size & (head_size - 1) or cos_sin.shape[1:] != (2, head_size // 2) or not cos_sin.is_contiguous():
        raise ValueError(f"rope needs a head size that is a power of two and a contiguous cos_sin [positions, 2, "
                         f"{head_size // 2}], got head size {head_size} and cos_sin {list(cos_sin.shape)}")
    if num_seqs > 1 and (positions.stride(0) != 1 or slot_mapping.stride(0) != 1):
        raise ValueError("rope's positions and slot_mapping must be contiguous")
    row = (num_heads + 2 * num_kv_heads) * head_size
    if query.stride(1) != head_size or query.stride(2) != 1 or (num_seqs > 1 and query.stride(0) < row) or \
            query.untyped_storage().nbytes() < query.element_size() * (
                query.storage_offset() + (num_seqs - 1) * query.stride(0) + row):
        raise ValueError(f"with rope, query must be the query columns of QKV rows of {row} elements "
                         f"({num_heads} query, {num_kv_heads} key and {num_kv_heads} value heads of {head_size}), "
                         f"got shape {list(query.shape)} with strides {list(query.stride())}")
    if key_cache.dtype != query.dtype or value_cache.dtype != query.dtype:
        raise TypeError("with rope, the caches must have the query's dtype (the new keys and values go there)")
    return cos_sin, positions, slot_mapping


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """How many ranges to cut each sequence's context into, so that the GPU is kept busy.

    With ``num_seqs * num_kv_heads`` programs already enough to give every multiprocessor a few,
    splitting only adds a merge. Below that, split until there are about four programs per
    multiprocessor, keeping at least 256 tokens per split so each program still streams a long
    run of memory. (Measured on an H200 at batch 4 x 32768 and 1 x 131072: two or eight
    programs per multiprocessor were 1-2% slower.) On the interpreter (a CPU), every program
    costs Python time: never split.
    """
    if device.type != "cuda":
        return 1
    programs = num_seqs * num_kv_heads
    sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    if programs >= 2 * sms:
        return 1
    target = 4 * sms
    splits = max(1, min(cdiv(target, programs), cdiv(max_seq_len, 256)))
    # A power of two cuts power-of-two contexts into equal ranges (17 splits of 32768 tokens
    # leave a short last range that idles its program; 16 measured 2% faster on an H200).
    return 1 << (splits.bit_length() - 1)


def choose_launch(device: torch.device, max_seq_len: int, num_splits: int = 1,
                  num_programs: int | None = None) -> tuple[int, int, int]:
    """``(TILE_N, num_warps, num_stages)``: tokens per loop step and launch shape.

    On a GPU: 64 tokens (four 16-token blocks) a step, four warps, and loads software-pipelined
    three steps deep (two when the context is split: each program then runs a short loop, and
    more programs fit on a multiprocessor), so that the next tiles' keys and values are already
    on their way while one tile is computed: a decode step is bound by memory, and this keeps it
    streaming. ``benchmarks/bench_decode.py --sweep`` compares these with their neighbours.

    Short contexts (``max_seq_len`` <= 256) over few programs (``num_programs``: sequences times
    KV heads times splits) are bound by latency instead: each program's chain of dependent loads,
    not the bytes. There, fewer and larger steps win: with at most half as many programs as the
    GPU has multiprocessors, the whole context in one tile on eight warps; with up to twice as
    many, 128-token steps two deep. (Measured in the engine's decode steps on an H200, SmolLM2's
    3 KV heads of 64, contexts up to 256: GPU time a step -7.5% at 1 request, -5.5% at 16, -3% at
    64 requests; at 256 requests, 768 programs, the default stayed the fastest.)
    """
    if device.type != "cuda":
        # Interpreter: few, large steps (its cost is per operation, not per byte).
        return min(256, max(16, triton.next_power_of_2(max_seq_len))), 1, 1
    if max_seq_len <= 256 and num_programs is not None:
        sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device())
        if num_programs <= sms // 2:
            return max(64, triton.next_power_of_2(max_seq_len)), 8, 1
        if num_programs <= 2 * sms:
            return 128, 4, 2
    return (64, 4, 2) if num_splits > 1 else (64, 4, 3)


class DecodePlan:
    """A decode call checked and prepared once, then run many times (FlashInfer's plan/run split).

    Planning does everything a checked ``paged_attention_decode`` does before its launch: it checks
    the tensors (shapes, dtypes, device, strides; the ids in the tables too unless
    ``check_ids=False``), picks the split count and the launch shape, and allocates the split
    buffers, which every run reuses. ``run`` takes tensors with exactly the planned shapes,
    strides, dtypes and device (new contents each time: the next step's queries, another layer's
    cache) and launches. Its only checks compare each tensor with the plan; one that differs is
    refused with a ``ValueError`` before anything is launched.

    A plan's split buffers are scratch for one launch at a time: run a plan on one CUDA stream
    (as a model does), or give each stream its own plan. ``pdl=True``: launched with programmatic
    dependent launch where the GPU has it (see ``paged_attention_decode``).
    """

    def __init__(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                 alibi_slopes: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
                 max_seq_len: int | None = None, num_splits: int | None = None, check_ids: bool = True,
                 launch: tuple[int, int, int] | None = None, lse: torch.Tensor | None = None,
                 rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None, pdl: bool = False) -> None:
        out = torch.empty_like(query) if out is None and isinstance(query, torch.Tensor) else out
        max_seq_len = args.check_flash_decode_args(query, key_cache, value_cache, block_tables, seq_lens,
                                                   alibi_slopes, check_ids=check_ids, scale=scale, out=out,
                                                   max_seq_len=max_seq_len, num_splits=num_splits)
        check_triton_dtype(query)
        args.unit_last_stride(query=query, out=out, key_cache=key_cache, value_cache=value_cache)
        num_seqs, num_heads, head_size = query.shape
        check_lse(lse, query)
        num_blocks, block_size, num_kv_heads, _ = key_cache.shape
        rope = check_rope(rope, query, key_cache, value_cache)
        pdl_on = args.flag("pdl", pdl) and _pdl.enabled(query.device)
        if num_splits is None:
            num_splits = choose_num_splits(num_seqs, num_kv_heads, max_seq_len, query.device) if num_seqs else 1
        if launch is None:
            launch = choose_launch(query.device, max_seq_len, num_splits, num_seqs * num_kv_heads * num_splits)
        tile_n, num_warps, num_stages = check_launch(launch)
        # Each split covers a whole number of tiles, so only a sequence's last tile is ragged.
        tokens_per_split = cdiv(cdiv(max(max_seq_len, 1), num_splits), tile_n) * tile_n
        self.num_splits = num_splits = cdiv(max(max_seq_len, 1), tokens_per_split)
        self.max_seq_len = max_seq_len
        self.signature = tuple(map(tensor_signature, (out, query, key_cache, value_cache, block_tables,
                                                      seq_lens, alibi_slopes, lse, *(rope or (None,) * 3))))
        self.num_seqs = num_seqs
        if num_seqs == 0:
            return
        dev = query.device
        if num_splits > 1:
            self._part_out = torch.empty(num_seqs, num_heads, num_splits, head_size, dtype=torch.float32, device=dev)
            self._part_m = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=dev)
            self._part_l = torch.empty_like(self._part_m)
        use_alibi = alibi_slopes is not None
        head_block = triton.next_power_of_2(head_size)
        self._grid = (num_seqs, num_kv_heads, num_splits)
        # The strides are part of the plan (run checks them), so they are fixed arguments.
        self._decode = Launcher(
            _paged_decode_kernel,
            ("out_ptr", "part_out_ptr", "part_m_ptr", "part_l_ptr", "lse_ptr", "q_ptr", "k_cache_ptr",
             "v_cache_ptr", "block_tables_ptr", "seq_lens_ptr", "alibi_ptr", "cos_sin_ptr", "pos_ptr", "slot_ptr"),
            qk_scale=float(scale) * LOG2E, tokens_per_split=tokens_per_split, num_splits=num_splits,
            q_stride_s=query.stride(0), q_stride_h=query.stride(1),
            k_stride_blk=key_cache.stride(0), k_stride_tok=key_cache.stride(1), k_stride_head=key_cache.stride(2),
            v_stride_blk=value_cache.stride(0), v_stride_tok=value_cache.stride(1),
            v_stride_head=value_cache.stride(2),
            bt_stride_s=block_tables.stride(0), bt_stride_b=block_tables.stride(1),
            sl_stride=seq_lens.stride(0), alibi_stride=alibi_slopes.stride(0) if use_alibi else 0,
            o_stride_s=out.stride(0), o_stride_h=out.stride(1),
            QUERIES_PER_KV=num_heads // num_kv_heads,
            BLOCK_G=max(16, triton.next_power_of_2(num_heads // num_kv_heads)),
            HEAD_SIZE=head_size, BLOCK_D=head_block, BLOCK_SIZE=block_size, TILE_N=tile_n,
            SPLIT=num_splits > 1, STORE_LSE=lse is not None, USE_ALIBI=use_alibi, ROPE=rope is not None,
            DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
            OFFSETS_64=max(_span(key_cache), _span(value_cache)) >= 2**31,
            num_warps=num_warps, num_stages=num_stages, **_pdl.launch_options(pdl_on))
        if num_splits > 1:
            self._merge_grid = (num_seqs, num_heads)
            # The split buffers: [num_seqs, num_heads, num_splits(, head_size)], contiguous.
            self._merge = Launcher(
                _merge_splits_kernel, ("out_ptr", "part_out_ptr", "part_m_ptr", "part_l_ptr", "lse_ptr"),
                o_stride_s=out.stride(0), o_stride_h=out.stride(1), num_splits=num_splits,
                po_stride_p=head_size, po_stride_s=num_heads * num_splits * head_size,
                po_stride_h=num_splits * head_size,
                pm_stride_p=1, pm_stride_s=num_heads * num_splits, pm_stride_h=num_splits,
                HEAD_SIZE=head_size, BLOCK_D=head_block, BLOCK_S=triton.next_power_of_2(num_splits),
                STORE_LSE=lse is not None, LSE_PARTS=False)

    def run(self, out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
            block_tables: torch.Tensor, seq_lens: torch.Tensor, alibi_slopes: torch.Tensor | None = None,
            lse: torch.Tensor | None = None, rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
            ) -> None:
        """Decode attention into ``out`` (and log-sum-exps into ``lse`` if the plan was made with one);
        the tensors must match the plan (``ValueError`` if not).
        The ids are not checked again: ``seq_lens`` must stay within the planned ``max_seq_len``
        and the tables within the cache, as they were when planned."""
        tensors = (out, query, key_cache, value_cache, block_tables, seq_lens, alibi_slopes, lse,
                   *(rope if isinstance(rope, tuple) and len(rope) == 3 else (rope, None, None)))
        check_planned("DecodePlan", _RUN_ARGS, tensors, self.signature,
                      optional=("alibi_slopes", "lse", "cos_sin", "positions", "slot_mapping"))
        self._launch(*tensors[:8], rope)

    def _launch(self, out, query, key_cache, value_cache, block_tables, seq_lens, alibi_slopes, lse=None,
                rope=None) -> None:
        if self.num_seqs == 0:
            return
        if self.num_splits > 1:
            parts = self._part_out, self._part_m, self._part_l
        else:
            parts = out, out, out                # unused without splits
        # Pinned launches: the plan's checks (signatures: dtype and alignment included) make every
        # call specialise as the first did.
        lse = out if lse is None else lse        # unused without STORE_LSE
        self._decode.pinned(self._grid, out, *parts, lse, query, key_cache, value_cache, block_tables, seq_lens,
                            query if alibi_slopes is None else alibi_slopes, *(rope or (query,) * 3))
        if self.num_splits > 1:
            self._merge.pinned(self._merge_grid, out, *parts, lse)


def check_launch(launch: object) -> tuple[int, int, int]:
    """A caller's ``(TILE_N, num_warps, num_stages)``, refused before anything compiles when
    Triton could not build it: TILE_N a power of two in [16, 1024], num_warps a power of two in
    [1, 32] (a block of at most 1024 threads), num_stages in [1, 8]."""
    if not isinstance(launch, (tuple, list)) or len(launch) != 3 or not all(is_int(v) for v in launch):
        raise TypeError(f"launch must be a tuple of three ints (TILE_N, num_warps, num_stages), got {launch!r}")
    tile_n, num_warps, num_stages = map(int, launch)
    if not 16 <= tile_n <= 1024 or tile_n & (tile_n - 1):
        raise ValueError(f"TILE_N must be a power of two in [16, 1024], got {tile_n}")
    if not 1 <= num_warps <= 32 or num_warps & (num_warps - 1):
        raise ValueError(f"num_warps must be a power of two in [1, 32], got {num_warps}")
    if not 1 <= num_stages <= 8:
        raise ValueError(f"num_stages must be in [1, 8], got {num_stages}")
    return tile_n, num_warps, num_stages


_RUN_ARGS = ("out", "query", "key_cache", "value_cache", "block_tables", "seq_lens", "alibi_slopes", "lse",
             "cos_sin", "positions", "slot_mapping")
# Plans made by unchecked calls (check_ids=False), by everything the checks depend on: a call
# with the same shapes, strides, dtypes and options is checked once. Bounded, oldest dropped.
_PLANS: dict[tuple, DecodePlan] = {}
_MAX_PLANS = 64


def paged_attention_decode(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    alibi_slopes: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
    check_ids: bool = True,
    launch: tuple[int, int, int] | None = None,
    lse: torch.Tensor | None = None,
    rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    pdl: bool = False,
) -> None:
    """Decode attention over a flash-layout paged cache, written into ``out``.

    ``query``/``out``: ``[num_seqs, num_heads, head_size]``. ``key_cache``/``value_cache``:
    ``[num_blocks, block_size, num_kv_heads, head_size]`` with NHD or HND strides, the query's
    dtype. ``block_tables``: int32 ``[num_seqs, max_blocks]``; ``seq_lens``: ``[num_seqs]``, each
    >= 1. ``alibi_slopes``: optional float32 ``[num_heads]``. ``scale``: a finite float. Every
    tensor may be a strided view (its strides go to the kernel), as long as the head dimension
    of ``query``, ``out`` and the caches is contiguous. Any block size works (each token looks
    its block up), though vLLM uses powers of two >= 8.

    ``num_splits`` overrides the context split (default: ``choose_num_splits``).
    ``max_seq_len``, a positive int, bounds the longest sequence; it sets the split and tile
    sizes and saves a device-to-host read when ``check_ids=False``. ``check_ids=False`` skips
    the index checks, which copy the tables to the host: only for tables known good; the caller
    then promises that ``max_seq_len`` is an upper bound (with ``check_ids=True`` a smaller one
    is refused). ``launch`` overrides ``(TILE_N, num_warps, num_stages)`` (default:
    ``choose_launch``), for tuning. ``lse``, a contiguous float32 ``[num_seqs, num_heads]``
    tensor, also receives each head's log-sum-exp ``ln(sum_j exp(scale * q . k_j))`` (``check_lse``):
    what a caller needs to merge this result with attention over other tokens of the same
    sequence (``reference.merge_partials``; decode context parallelism merges its ranks' so). The
    kernel keeps ``m`` (base 2) and ``l``; the log-sum-exp is ``ln 2 * (m + log2 l)``, and with
    splits ``ln 2 * (M + log2 sum_i w_i)`` (the split merge writes it). An unchecked call may pass
    a length of 0: that sequence reads nothing and gets a zero output and an ``lse`` of ``-inf``,
    a part that weighs nothing in a merge (a DCP rank holding none of a short sequence's tokens).

    ``rope=(cos_sin, positions, slot_mapping)`` has the kernel do the step's rotary embedding and
    cache write as well (``check_rope``), so that a decode layer needs no launch for them: ``query``
    is then the query columns of the fused QKV projection's output, not yet rotated (the rows go
    on with the keys and values), and each sequence's new token, its last, is rotated by
    ``positions`` and stored at ``slot_mapping`` before it is attended to, as
    ``layer_ops.rotary_and_cache_`` then this function would.

    ``pdl=True`` launches the kernel with programmatic dependent launch where the GPU has it
    (``pdl.py``): it may start while the previous kernel on the stream still runs, and reads
    ``seq_lens``, the block table and, with ``rope``, the positions, slots and angles before
    waiting for it. Only for a caller whose previous kernel writes none of these (a model's QKV
    projection); the queries, keys and values are read after the wait.

    The fast path: with ``check_ids=False`` and ``max_seq_len`` given, the checks run once per
    combination of shapes, strides, dtypes and options, and later calls reuse that
    ``DecodePlan`` (its split buffers included) and only launch. A caller that keeps its own
    ``DecodePlan`` and calls ``run`` saves the lookup too.
    """
    if args.flag("check_ids", check_ids) or max_seq_len is None:
        DecodePlan(query, key_cache, value_cache, block_tables, seq_lens, scale, alibi_slopes, out=out,
                   max_seq_len=max_seq_len, num_splits=num_splits, check_ids=check_ids, launch=launch,
                   lse=lse, rope=rope, pdl=pdl)._launch(out, query, key_cache, value_cache, block_tables, seq_lens,
                                               alibi_slopes, lse, rope)
        return
    plan = cached_plan(
        _PLANS, _MAX_PLANS,
        lambda: (tuple(map(tensor_signature, (out, query, key_cache, value_cache, block_tables, seq_lens,
                                              alibi_slopes, lse, *(rope or (None,) * 3)))),
                 scale, max_seq_len, num_splits, launch, pdl),
        lambda: DecodePlan(query, key_cache, value_cache, block_tables, seq_lens, scale, alibi_slopes, out=out,
                           max_seq_len=max_seq_len, num_splits=num_splits, check_ids=False, launch=launch, lse=lse,
                           rope=rope, pdl=pdl))
    plan._launch(out, query, key_cache, value_cache, block_tables, seq_lens, alibi_slopes, lse, rope)


# ---- Merging attention over disjoint parts of a context, given by their log-sum-exps ----------

class MergePlan:
    """Attention over a whole context from attention over its disjoint parts, on the device: the
    split merge kernel above, fed parts given by their log-sum-exps, in float32
    (``reference.merge_partials`` with ``exp_sums`` left out is its oracle). Decode context
    parallelism merges its ranks' partials so. Checked and prepared once, then run many times,
    like ``DecodePlan``.

    ``outputs``: ``[num_parts, num_seqs, num_heads, head_size]``, part ``p``'s attention normalised
    over its own tokens (any float dtype); ``lses``: float32 ``[num_parts, num_seqs, num_heads]``,
    ``-inf`` for a part that has no tokens (it weighs nothing). ``out``: ``[num_seqs, num_heads,
    head_size]``, any float dtype; ``lse``, optional: the whole context's log-sum-exps, a
    contiguous float32 ``[num_seqs, num_heads]``. Every input may be a strided view (the strides
    go to the kernel) whose head dimension is contiguous. A sequence whose parts are all empty
    gets a zero output and ``-inf``.
    """

    def __init__(self, out: torch.Tensor, outputs: torch.Tensor, lses: torch.Tensor,
                 lse: torch.Tensor | None = None) -> None:
        args.tensor("outputs", outputs, ndim=4, dtypes=args.FLOAT_DTYPES)
        args.tensor("lses", lses, ndim=3, dtypes=(torch.float32,))
        args.tensor("out", out, ndim=3, dtypes=args.FLOAT_DTYPES)
        num_parts, num_seqs, num_heads, head_size = outputs.shape
        if num_parts < 1:
            raise ValueError("outputs must hold at least one part (dimension 0), got none")
        args.shape("lses", lses, outputs.shape[:3])
        args.shape("out", out, outputs.shape[1:])
        args.same_device(out=out, outputs=outputs, lses=lses)
        args.unit_last_stride(out=out, outputs=outputs)
        args.no_broadcast_dims("out", out)
        check_lse(lse, out, "out")
        self.signature = tuple(map(tensor_signature, (out, outputs, lses, lse)))
        self._grid = (num_seqs, num_heads)
        self._merge = Launcher(
            _merge_splits_kernel, ("out_ptr", "part_out_ptr", "part_m_ptr", "part_l_ptr", "lse_ptr"),
            o_stride_s=out.stride(0), o_stride_h=out.stride(1), num_splits=num_parts,
            po_stride_p=outputs.stride(0), po_stride_s=outputs.stride(1), po_stride_h=outputs.stride(2),
            pm_stride_p=lses.stride(0), pm_stride_s=lses.stride(1), pm_stride_h=lses.stride(2),
            HEAD_SIZE=head_size, BLOCK_D=triton.next_power_of_2(head_size),
            BLOCK_S=max(2, triton.next_power_of_2(num_parts)), STORE_LSE=lse is not None, LSE_PARTS=True)

    def run(self, out: torch.Tensor, outputs: torch.Tensor, lses: torch.Tensor,
            lse: torch.Tensor | None = None) -> None:
        """Merge into ``out`` (and ``lse`` if the plan was made with one); the tensors must match
        the plan (``ValueError`` if not)."""
        tensors = (out, outputs, lses, lse)
        check_planned("MergePlan", ("out", "outputs", "lses", "lse"), tensors, self.signature,
                      optional=("lse",))
        self._launch(*tensors)

    def _launch(self, out, outputs, lses, lse=None) -> None:
        if self._grid[0] == 0:
            return
        # the sums (part_l_ptr) are not read with LSE_PARTS; lse_ptr only with STORE_LSE
        self._merge.pinned(self._grid, out, outputs, lses, lses, out if lse is None else lse)


def merge_partials(out: torch.Tensor, outputs: torch.Tensor, lses: torch.Tensor,
                   lse: torch.Tensor | None = None) -> None:
    """Merge attention over disjoint parts (along dim 0 of ``outputs`` and ``lses``) into ``out``,
    and the whole context's log-sum-exps into ``lse`` if given: see ``MergePlan``."""
    MergePlan(out, outputs, lses, lse)._launch(out, outputs, lses, lse)

