"""Triton paged prefill attention: many new query tokens per request, causal, keys read through
a block table (the cached prefix and the tokens just written alike).

The problem. A step's new tokens are packed into one flat batch: request ``r`` owns query rows
``query_start_loc[r] : query_start_loc[r + 1]`` (``q_len`` of them) and attends to the
``seq_lens[r]`` tokens of its sequence, all in the paged cache (this step's keys and values were
written there first). Its new tokens are the sequence's last ``q_len``: new token ``i`` sits at
position ``prefix + i`` (``prefix = seq_len - q_len``, e.g. a prefix-cache hit) and sees keys
``0 .. prefix + i``. A decoding request is the case ``q_len = 1``; so one call serves a mixed batch.

The method (FlashAttention-2 over pages).

* One program per (request, tile of ``BLOCK_M`` new tokens, KV head). Its tile's rows are those
  tokens times the query heads that share the KV head (GQA): ``BLOCK_M * GROUP`` rows, row ``i``
  being token ``i // GROUP`` and head ``i % GROUP`` of the group, so each key and value loaded
  serves all of them. Programs past a request's last token exit at once (the grid is sized by
  the longest request).
* It walks the keys ``TILE_N`` at a time, up to the last position its tile can see, looking up
  each token's physical block in the block table (as the decode kernel does), with the online
  softmax (running max, sum and weighted sum, base 2).
* The causal mask is ``key position <= prefix + token``; key 0 is visible to every row, so no row
  is ever all ``-inf``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from paged_attention.kernels import args
from paged_attention.kernels.triton.common import LOG2E, check_triton_dtype, load_kv_tile, span
from paged_attention.kernels.triton.launch import cached_plan, check_planned, tensor_signature
from paged_attention.triton_launch import Launcher
from paged_attention.utils import check_int


@triton.jit
def _paged_prefill_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    qk_scale,                                   # scale * log2(e)
    q_stride_t, q_stride_h, o_stride_t, o_stride_h,
    k_stride_blk, k_stride_tok, k_stride_head,
    v_stride_blk, v_stride_tok, v_stride_head,
    bt_stride_s, bt_stride_b, sl_stride, qsl_stride,
    QUERIES_PER_KV: tl.constexpr,               # query heads sharing one KV head
    GROUP: tl.constexpr,                        # that number padded to a power of two
    BLOCK_M: tl.constexpr,                      # new tokens per program
    HEAD_SIZE: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,                   # tokens per KV-cache block
    TILE_N: tl.constexpr,                       # keys per loop step
    DOT_PRECISION: tl.constexpr,
    OFFSETS_64: tl.constexpr,
):
    req = tl.program_id(0)
    m_tile = tl.program_id(1)
    kv_head = tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + req * qsl_stride).to(tl.int32)
    q_len = tl.load(query_start_loc_ptr + (req + 1) * qsl_stride).to(tl.int32) - q_start
    if m_tile * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req * sl_stride).to(tl.int32)
    prefix = seq_len - q_len

    # Row i of the tile: new token m_tile * BLOCK_M + i // GROUP, query head i % GROUP of the group.
    i = tl.arange(0, BLOCK_M * GROUP)
    tok = m_tile * BLOCK_M + i // GROUP
    head = kv_head * QUERIES_PER_KV + i % GROUP
    row_mask = (tok < q_len) & (i % GROUP < QUERIES_PER_KV)
    q_pos = prefix + tok                                  # the token's position in its sequence
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_SIZE
    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * q_stride_t + head[:, None] * q_stride_h + d[None, :],
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_M * GROUP], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M * GROUP], tl.float32)
    acc = tl.zeros([BLOCK_M * GROUP, BLOCK_D], tl.float32)

    table = block_tables_ptr + req.to(tl.int64) * bt_stride_s
    k_head = k_cache_ptr + kv_head * k_stride_head
    v_head = v_cache_ptr + kv_head * v_stride_head
    # The tile's last token sees keys up to prefix + its index: nothing past that is read.
    end = tl.minimum(seq_len, prefix + (m_tile + 1) * BLOCK_M)
    for tile_start in range(0, end, TILE_N):
        n = tile_start + tl.arange(0, TILE_N)             # key positions
        n_mask = n < end
        # Paging: key n sits in physical block table[n // BLOCK_SIZE], row n % BLOCK_SIZE.
        k, v = load_kv_tile(k_head, v_head, table, bt_stride_b, n, n_mask, d, d_mask,
                            k_stride_blk, k_stride_tok, v_stride_blk, v_stride_tok,
                            BLOCK_SIZE=BLOCK_SIZE, OFFSETS_64=OFFSETS_64)   # [TILE_N, BLOCK_D] each

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale   # [rows, TILE_N]
        # causal: the token at position q_pos sees keys 0 .. q_pos
        s = tl.where(n_mask[None, :] & (n[None, :] <= q_pos[:, None]), s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / l_i[:, None]
    tl.store(out_ptr + q_rows[:, None] * o_stride_t + head[:, None] * o_stride_h + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


def check_prefill_args(out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                       max_query_len, check_ids: bool, max_seq_len: int | None = None) -> None:
    """The prefill's arguments: the decode's checks per request, plus the query layout.

    ``check_ids=True`` reads ``seq_lens`` and ``query_start_loc`` to the host and checks that
    every request brings ``1 <= q_len <= seq_len`` tokens, that the last one ends at the batch's
    end, and that ``max_query_len`` bounds them; ``False`` skips those reads.
    """
    args.tensor("query", query, ndim=3, dtypes=args.FLOAT_DTYPES)
    args.tensor("out", out, ndim=3, dtypes=(query.dtype,))
    args.shape("out", out, tuple(query.shape))
    args.tensor("query_start_loc", query_start_loc, ndim=1, dtypes=(torch.int32, torch.int64))
    args.same_device(query=query, out=out, query_start_loc=query_start_loc)
    args.no_broadcast_dims("out", out)
    num_reqs = query_start_loc.numel() - 1
    if num_reqs < 0:
        raise ValueError("query_start_loc must have num_reqs + 1 entries, got none")
    # One "sequence" per request: the decode's checks of the caches, tables and lengths.
    stand_in = query.new_empty(num_reqs, query.size(1), query.size(2))
    # (Given an upper bound on the lengths, the unchecked call reads nothing back to the host.)
    args.check_flash_decode_args(stand_in, key_cache, value_cache, block_tables, seq_lens, None,
                                 check_ids=check_ids, scale=scale, max_seq_len=max_seq_len)
    max_query_len = check_int("max_query_len", max_query_len, 1)
    if not check_ids or num_reqs == 0:
        return
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    if starts[0] != 0 or starts[-1] != query.size(0):
        raise ValueError(f"query_start_loc must run from 0 to the number of query tokens ({query.size(0)}), "
                         f"got {starts[0]} .. {starts[-1]}")
    for r in range(num_reqs):
        q_len = starts[r + 1] - starts[r]
        if not 1 <= q_len <= lens[r]:
            raise ValueError(f"request {r} has {q_len} query tokens and seq_len {lens[r]}: each needs "
                             f"1 <= query tokens <= seq_len")
        if q_len > max_query_len:
            raise ValueError(f"max_query_len ({max_query_len}) must be >= every request's query tokens "
                             f"(request {r} has {q_len})")


class PrefillPlan:
    """A prefill call checked and prepared once, then run many times (``DecodePlan``'s way): every
    layer of a model's step attends with the same shapes, so the checks and the launch's
    arguments are worked out at the first layer and the other layers only launch.

    ``run`` takes tensors with exactly the planned shapes, strides, dtypes and device (new
    contents: another layer's queries and cache); one that differs is refused with a
    ``ValueError`` before anything is launched. The lengths are not checked again: they must stay
    within the planned ``max_query_len`` and ``max_seq_len``, as when planned.
    """

    def __init__(self, out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 query_start_loc: torch.Tensor, scale: float, *, max_query_len: int,
                 check_ids: bool = True, launch: tuple[int, int, int, int] | None = None,
                 max_seq_len: int | None = None) -> None:
        check_prefill_args(out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                           max_query_len, check_ids, max_seq_len)
        check_triton_dtype(query)
        args.unit_last_stride(query=query, out=out, key_cache=key_cache, value_cache=value_cache)
        self.signature = tuple(map(tensor_signature, (out, query, key_cache, value_cache, block_tables,
                                                      seq_lens, query_start_loc)))
        num_tokens, num_heads, head_size = query.shape
        num_reqs = query_start_loc.numel() - 1
        self.empty = num_reqs == 0 or num_tokens == 0
        if self.empty:
            return
        num_kv_heads = key_cache.size(2)
        queries_per_kv = num_heads // num_kv_heads
        group = triton.next_power_of_2(queries_per_kv)
        if launch is None:
            if query.is_cuda:
                # 64 rows a tile (16 tokens x a group of up to 4 heads), 64 keys a step
                launch = (max(1, 64 // group), 64, 4, 2)
            else:
                # Interpreter: few, large programs (its cost is per operation, not per element)
                launch = (min(64, triton.next_power_of_2(max_query_len)), 128, 1, 1)
        block_m, tile_n, num_warps, num_stages = launch
        block_m = max(block_m, triton.cdiv(16, group))        # tl.dot needs at least 16 rows
        self._grid = (num_reqs, triton.cdiv(max_query_len, block_m), num_kv_heads)
        # The strides are part of the plan (run checks them), so they are fixed arguments.
        self._prefill = Launcher(
            _paged_prefill_kernel, _RUN_ARGS_PTRS,
            qk_scale=float(scale) * LOG2E,
            q_stride_t=query.stride(0), q_stride_h=query.stride(1), o_stride_t=out.stride(0),
            o_stride_h=out.stride(1),
            k_stride_blk=key_cache.stride(0), k_stride_tok=key_cache.stride(1), k_stride_head=key_cache.stride(2),
            v_stride_blk=value_cache.stride(0), v_stride_tok=value_cache.stride(1),
            v_stride_head=value_cache.stride(2),
            bt_stride_s=block_tables.stride(0), bt_stride_b=block_tables.stride(1),
            sl_stride=seq_lens.stride(0), qsl_stride=query_start_loc.stride(0),
            QUERIES_PER_KV=queries_per_kv, GROUP=group, BLOCK_M=block_m,
            HEAD_SIZE=head_size, BLOCK_D=triton.next_power_of_2(head_size), BLOCK_SIZE=key_cache.size(1),
            TILE_N=tile_n, DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
            OFFSETS_64=max(span(key_cache), span(value_cache)) >= 2**31,
            num_warps=num_warps, num_stages=num_stages)

    def run(self, out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
            block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor) -> None:
        """Prefill attention into ``out``; the tensors must match the plan (``ValueError`` if not)."""
        tensors = (out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc)
        check_planned("PrefillPlan", _RUN_ARGS, tensors, self.signature)
        self._launch(*tensors)

    def _launch(self, out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc) -> None:
        if self.empty:
            return
        # Pinned: the plan's checks (signatures: dtype and alignment included) make every call
        # specialise as the first did.
        self._prefill.pinned(self._grid, out, query, key_cache, value_cache, block_tables, seq_lens,
                             query_start_loc)


_RUN_ARGS = ("out", "query", "key_cache", "value_cache", "block_tables", "seq_lens", "query_start_loc")
_RUN_ARGS_PTRS = ("out_ptr", "q_ptr", "k_cache_ptr", "v_cache_ptr", "block_tables_ptr", "seq_lens_ptr",
                  "query_start_loc_ptr")
# Unchecked calls (an engine's, with check_ids=False and a max_seq_len) keep their plans here, by
# what the checks depend on: the tensors' signatures and the options.
_PLANS: dict[tuple, PrefillPlan] = {}
_MAX_PLANS = 64


def paged_attention_prefill(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    max_query_len: int,
    check_ids: bool = True,
    launch: tuple[int, int, int, int] | None = None,
    max_seq_len: int | None = None,
) -> None:
    """Causal attention of a step's new tokens over a flash-layout paged cache, into ``out``.

    ``query``/``out``: ``[num_tokens, num_heads, head_size]``, request ``r``'s rows
    ``query_start_loc[r]:query_start_loc[r + 1]``, the last tokens of its sequence.
    ``key_cache``/``value_cache``: ``[num_blocks, block_size, num_kv_heads, head_size]`` (NHD or
    HND strides), already holding every key the requests attend to. ``block_tables``: int32
    ``[num_reqs, max_blocks]``; ``seq_lens``: ``[num_reqs]``; ``max_query_len``: the longest
    request's query tokens (it sizes the grid). ``launch`` overrides ``(BLOCK_M, TILE_N,
    num_warps, num_stages)``. ``max_seq_len``, an upper bound on ``seq_lens``, spares the unchecked
    call (``check_ids=False``) its one read of the lengths to the host (an engine step then waits
    for nothing).
    """
    if args.flag("check_ids", check_ids) or max_seq_len is None:
        PrefillPlan(out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                    max_query_len=max_query_len, check_ids=check_ids, launch=launch,
                    max_seq_len=max_seq_len)._launch(out, query, key_cache, value_cache, block_tables, seq_lens,
                                                     query_start_loc)
        return
    plan = cached_plan(
        _PLANS, _MAX_PLANS,
        lambda: (tuple(map(tensor_signature, (out, query, key_cache, value_cache, block_tables, seq_lens,
                                              query_start_loc))), scale, max_query_len, max_seq_len, launch),
        lambda: PrefillPlan(out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                            max_query_len=max_query_len, check_ids=False, launch=launch, max_seq_len=max_seq_len))
    plan._launch(out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc)
