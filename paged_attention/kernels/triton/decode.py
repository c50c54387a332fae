"""Triton paged decode attention: one new query token per sequence, keys and values read
through a block table.

The problem. Sequence ``s`` has ``seq_lens[s]`` tokens cached. Token ``j`` of it lives in
physical block ``block_tables[s, j // block_size]``, at row ``j % block_size`` of that block.
For each query head ``h`` we want ``softmax(scale * q_h . K^T) V`` over those tokens, where K and
V come from KV head ``h // (num_heads / num_kv_heads)`` (grouped-query attention, GQA).

The plan (flash-decoding).

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
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from paged_attention.kernels import args
from paged_attention.kernels.triton.cache import check_triton_dtype
from paged_attention.kernels.triton.launch import Launcher, cached_plan, check_planned, tensor_signature
from paged_attention.utils import cdiv, is_int

LOG2E = 1.4426950408889634


@triton.jit
def load_kv_tile(k_head, v_head, table, bt_stride_b, n, n_mask, d, d_mask,
                 k_stride_blk, k_stride_tok, v_stride_blk, v_stride_tok,
                 BLOCK_SIZE: tl.constexpr, OFFSETS_64: tl.constexpr):
    """The keys and values of token positions ``n`` of one KV head, read through the block table:
    token n sits in physical block ``table[n // BLOCK_SIZE]``, at row ``n % BLOCK_SIZE``. Shared by
    the decode and the prefill kernels. In a cache of 2^31 elements or more, ``block *
    block_stride`` needs 64 bits (``OFFSETS_64``)."""
    block = tl.load(table + (n // BLOCK_SIZE) * bt_stride_b, mask=n_mask, other=0)
    row = n % BLOCK_SIZE
    if OFFSETS_64:
        block = block.to(tl.int64)
        row = row.to(tl.int64)
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(k_head + block[:, None] * k_stride_blk + row[:, None] * k_stride_tok + d[None, :],
                mask=kv_mask, other=0.0)
    v = tl.load(v_head + block[:, None] * v_stride_blk + row[:, None] * v_stride_tok + d[None, :],
                mask=kv_mask, other=0.0)
    return k, v


@triton.jit
def _paged_decode_kernel(
    out_ptr, part_out_ptr, part_m_ptr, part_l_ptr,
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, alibi_ptr,
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
    USE_ALIBI: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    OFFSETS_64: tl.constexpr,                   # the cache spans >= 2^31 elements: int64 offsets
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

    # Rows of the tile: the query heads of this KV head's group (rows >= QUERIES_PER_KV are
    # padding, with zero queries). Columns: the head dimension, padded to a power of two.
    g = tl.arange(0, BLOCK_G)
    head = kv_head * QUERIES_PER_KV + g
    g_mask = g < QUERIES_PER_KV
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_SIZE
    q = tl.load(q_ptr + seq * q_stride_s + head[:, None] * q_stride_h + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
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
        out = acc / l_i[:, None]
        tl.store(out_ptr + seq * o_stride_s + head[:, None] * o_stride_h + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=o_mask)
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
    out_ptr, part_out_ptr, part_m_ptr, part_l_ptr,
    o_stride_s, o_stride_h, num_splits,
    HEAD_SIZE: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    # One program per (sequence, query head): merge its num_splits partial results.
    seq = tl.program_id(0)
    head = tl.program_id(1)
    base = (seq * tl.num_programs(1) + head) * num_splits
    i = tl.arange(0, BLOCK_S)
    i_mask = i < num_splits
    m = tl.load(part_m_ptr + base + i, mask=i_mask, other=float("-inf"))
    l = tl.load(part_l_ptr + base + i, mask=i_mask, other=0.0)
    m_max = tl.max(m, axis=0)
    w = l * tl.exp2(m - m_max)                 # each split's softmax mass, on a common scale
    w = tl.where(i_mask & (l > 0), w, 0.0)     # empty splits weigh nothing (and avoid -inf - -inf)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_SIZE
    o = tl.load(part_out_ptr + (base + i)[:, None] * HEAD_SIZE + d[None, :],
                mask=i_mask[:, None] & d_mask[None, :], other=0.0)
    out = tl.sum(o * w[:, None], axis=0) / tl.sum(w, axis=0)
    tl.store(out_ptr + seq * o_stride_s + head * o_stride_h + d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def _span(t: torch.Tensor) -> int:
    """One past the largest element offset a tensor view reaches from its first element."""
    return 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))


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


def choose_launch(device: torch.device, max_seq_len: int, num_splits: int = 1) -> tuple[int, int, int]:
    """``(TILE_N, num_warps, num_stages)``: tokens per loop step and launch shape.

    On a GPU: 64 tokens (four 16-token blocks) a step, four warps, and loads software-pipelined
    three steps deep (two when the context is split: each program then runs a short loop, and
    more programs fit on a multiprocessor), so that the next tiles' keys and values are already
    on their way while one tile is computed: a decode step is bound by memory, and this keeps it
    streaming. ``benchmarks/bench_decode.py --sweep`` compares these with their neighbours.
    """
    if device.type != "cuda":
        # Interpreter: few, large steps (its cost is per operation, not per byte).
        return min(256, max(16, triton.next_power_of_2(max_seq_len))), 1, 1
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
    (as a model does), or give each stream its own plan.
    """

    def __init__(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                 alibi_slopes: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
                 max_seq_len: int | None = None, num_splits: int | None = None, check_ids: bool = True,
                 launch: tuple[int, int, int] | None = None) -> None:
        out = torch.empty_like(query) if out is None and isinstance(query, torch.Tensor) else out
        max_seq_len = args.check_flash_decode_args(query, key_cache, value_cache, block_tables, seq_lens,
                                                   alibi_slopes, check_ids=check_ids, scale=scale, out=out,
                                                   max_seq_len=max_seq_len, num_splits=num_splits)
        check_triton_dtype(query)
        args.unit_last_stride(query=query, out=out, key_cache=key_cache, value_cache=value_cache)
        num_seqs, num_heads, head_size = query.shape
        num_blocks, block_size, num_kv_heads, _ = key_cache.shape
        if num_splits is None:
            num_splits = choose_num_splits(num_seqs, num_kv_heads, max_seq_len, query.device) if num_seqs else 1
        if launch is None:
            launch = choose_launch(query.device, max_seq_len, num_splits)
        tile_n, num_warps, num_stages = check_launch(launch)
        # Each split covers a whole number of tiles, so only a sequence's last tile is ragged.
        tokens_per_split = cdiv(cdiv(max(max_seq_len, 1), num_splits), tile_n) * tile_n
        self.num_splits = num_splits = cdiv(max(max_seq_len, 1), tokens_per_split)
        self.max_seq_len = max_seq_len
        self.signature = tuple(map(tensor_signature, (out, query, key_cache, value_cache, block_tables,
                                                      seq_lens, alibi_slopes)))
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
            ("out_ptr", "part_out_ptr", "part_m_ptr", "part_l_ptr", "q_ptr", "k_cache_ptr", "v_cache_ptr",
             "block_tables_ptr", "seq_lens_ptr", "alibi_ptr"),
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
            SPLIT=num_splits > 1, USE_ALIBI=use_alibi,
            DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
            OFFSETS_64=max(_span(key_cache), _span(value_cache)) >= 2**31,
            num_warps=num_warps, num_stages=num_stages)
        if num_splits > 1:
            self._merge_grid = (num_seqs, num_heads)
            self._merge = Launcher(
                _merge_splits_kernel, ("out_ptr", "part_out_ptr", "part_m_ptr", "part_l_ptr"),
                o_stride_s=out.stride(0), o_stride_h=out.stride(1), num_splits=num_splits,
                HEAD_SIZE=head_size, BLOCK_D=head_block, BLOCK_S=triton.next_power_of_2(num_splits))

    def run(self, out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
            block_tables: torch.Tensor, seq_lens: torch.Tensor, alibi_slopes: torch.Tensor | None = None) -> None:
        """Decode attention into ``out``; the tensors must match the plan (``ValueError`` if not).
        The ids are not checked again: ``seq_lens`` must stay within the planned ``max_seq_len``
        and the tables within the cache, as they were when planned."""
        tensors = (out, query, key_cache, value_cache, block_tables, seq_lens, alibi_slopes)
        check_planned("DecodePlan", _RUN_ARGS, tensors, self.signature, optional=("alibi_slopes",))
        self._launch(*tensors)

    def _launch(self, out, query, key_cache, value_cache, block_tables, seq_lens, alibi_slopes) -> None:
        if self.num_seqs == 0:
            return
        if self.num_splits > 1:
            parts = self._part_out, self._part_m, self._part_l
        else:
            parts = out, out, out                # unused without splits
        # Pinned launches: the plan's checks (signatures: dtype and alignment included) make every
        # call specialise as the first did.
        self._decode.pinned(self._grid, out, *parts, query, key_cache, value_cache, block_tables, seq_lens,
                            query if alibi_slopes is None else alibi_slopes)
        if self.num_splits > 1:
            self._merge.pinned(self._merge_grid, out, *parts)


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


_RUN_ARGS = ("out", "query", "key_cache", "value_cache", "block_tables", "seq_lens", "alibi_slopes")
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
    ``choose_launch``), for tuning.

    The fast path: with ``check_ids=False`` and ``max_seq_len`` given, the checks run once per
    combination of shapes, strides, dtypes and options, and later calls reuse that
    ``DecodePlan`` (its split buffers included) and only launch. A caller that keeps its own
    ``DecodePlan`` and calls ``run`` saves the lookup too.
    """
    if args.flag("check_ids", check_ids) or max_seq_len is None:
        DecodePlan(query, key_cache, value_cache, block_tables, seq_lens, scale, alibi_slopes, out=out,
                   max_seq_len=max_seq_len, num_splits=num_splits, check_ids=check_ids,
                   launch=launch)._launch(out, query, key_cache, value_cache, block_tables, seq_lens, alibi_slopes)
        return
    plan = cached_plan(
        _PLANS, _MAX_PLANS,
        lambda: (tuple(map(tensor_signature, (out, query, key_cache, value_cache, block_tables, seq_lens,
                                              alibi_slopes))), scale, max_seq_len, num_splits, launch),
        lambda: DecodePlan(query, key_cache, value_cache, block_tables, seq_lens, scale, alibi_slopes, out=out,
                           max_seq_len=max_seq_len, num_splits=num_splits, check_ids=False, launch=launch))
    plan._launch(out, query, key_cache, value_cache, block_tables, seq_lens, alibi_slopes)
