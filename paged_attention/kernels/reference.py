"""Plain-torch oracles: what every kernel in this project must compute, as plain torch maths.

Two kinds of reference live here.

* ``ref_decode_attention``: dense attention in float64 for one decode step, read through block
  tables from a flash-layout cache. It is the ground truth every kernel is compared against.
* ``merge_partials``: attention over a context from attention over its parts (v2's partitions,
  decode context parallelism's ranks), each part reduced to its output and log-sum-exp.
* Plain-torch versions of vLLM's cache and attention ops, with vLLM's names, argument order and
  layouts, so that a CUDA or Triton kernel can be swapped in and compared call for call:
  ``reshape_and_cache`` (v0 layout), ``reshape_and_cache_flash`` (flash layout, NHD or HND),
  ``copy_blocks``, ``swap_blocks``, ``paged_attention_v1`` and ``paged_attention_v2``.

Two cache layouts appear throughout.

* Flash layout: ``[num_blocks, block_size, num_kv_heads, head_size]``; NHD when that is the
  memory order, HND when memory is ``[num_blocks, num_kv_heads, block_size, head_size]`` and the
  tensor is a permuted view of it.
* vLLM's v0 layout: key ``[num_blocks, num_kv_heads, head_size // x, block_size, x]`` and value
  ``[num_blocks, num_kv_heads, head_size, block_size]``, with ``x = 16 // element_size``: each
  run of ``x`` key elements is 16 bytes, one vectorised load for the v0 CUDA kernel.

Each function starts with its operation's checks from :mod:`paged_attention.kernels.args`, the
same ones the Triton, CUDA and vLLM front-ends call, so bad input fails alike everywhere; what
follows is the maths, to be held next to the kernels.
"""
from __future__ import annotations

import torch

from paged_attention.kernels import args
from paged_attention.kernels.layout import PARTITION_SIZE, v0_x
from paged_attention.utils import cdiv

# vLLM's v0 attention kernels divide by ``exp_sum + 1e-6`` (csrc/attention/attention_kernels.cuh),
# so a softmax over one token gives 1 / (1 + 1e-6), not 1: the plain-torch versions of those
# kernels do the same, the float64 oracle does not.
SOFTMAX_EPS = 1e-6

__all__ = [
    "SOFTMAX_EPS", "PARTITION_SIZE", "v0_x", "flash_to_v0", "v0_to_flash", "gather_kv", "ref_decode_attention",
    "merge_partials",
    "reshape_and_cache", "reshape_and_cache_flash", "copy_blocks", "swap_blocks", "v2_scratch", "v0_decode_args",
    "paged_attention_v1", "paged_attention_v2",
]


# --------------------------------------------------------------------------------------------
# Layouts
# --------------------------------------------------------------------------------------------

def flash_to_v0(key_cache: torch.Tensor, value_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Copy flash-layout caches ``[N, B, H, D]`` into vLLM's v0 layout (same contents)."""
    n, b, h, d = key_cache.shape
    x = v0_x(key_cache.dtype)
    # key[blk, tok, head, dim] -> key_v0[blk, head, dim // x, tok, dim % x]
    key_v0 = key_cache.reshape(n, b, h, d // x, x).permute(0, 2, 3, 1, 4).contiguous()
    # value[blk, tok, head, dim] -> value_v0[blk, head, dim, tok]: tokens innermost
    value_v0 = value_cache.permute(0, 2, 3, 1).contiguous()
    return key_v0, value_v0


def v0_to_flash(key_cache: torch.Tensor, value_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Copy v0-layout caches into the flash layout ``[N, B, H, D]`` (NHD, contiguous)."""
    n, h, dx, b, x = key_cache.shape
    key = key_cache.permute(0, 3, 1, 2, 4).reshape(n, b, h, dx * x).contiguous()
    value = value_cache.permute(0, 3, 1, 2).contiguous()
    return key, value


def gather_kv(
    key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's keys and values, ``[seq_len, num_kv_heads, head_size]`` each, in token order.

    Token ``j`` lives in physical block ``block_table[j // block_size]`` at offset
    ``j % block_size``: gathering the table's blocks and flattening (block, offset) gives the
    tokens back in order.
    """
    block_size = key_cache.size(1)
    blocks = block_table[: cdiv(seq_len, block_size)].long()
    k = key_cache[blocks].flatten(0, 1)[:seq_len]
    v = value_cache[blocks].flatten(0, 1)[:seq_len]
    return k, v


# --------------------------------------------------------------------------------------------
# The float64 oracle
# --------------------------------------------------------------------------------------------

def _logits(
    q: torch.Tensor,
    k: torch.Tensor,
    scale: float,
    alibi_slopes: torch.Tensor | None,
    positions: torch.Tensor,
    seq_len: int,
) -> torch.Tensor:
    """Scaled scores ``[num_heads, n]`` of one query ``[H, D]`` against keys ``[n, H_kv, D]``.

    Query head ``h`` reads KV head ``h // (H / H_kv)`` (grouped-query attention): repeating each
    KV head ``H / H_kv`` times lines the two up. ALiBi adds ``slope * (j - seq_len + 1)``, zero at
    the newest token and more negative the further back token ``j`` is.
    """
    group = q.size(0) // k.size(1)
    k = k.repeat_interleave(group, dim=1)
    logits = scale * torch.einsum("hd,nhd->hn", q, k)
    if alibi_slopes is not None:
        logits = logits + alibi_slopes.to(logits.dtype)[:, None] * (positions - seq_len + 1).to(logits.dtype)[None, :]
    return logits


def _weighted_values(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``sum_j p[h, j] * v[j, kv(h), :]`` for probabilities ``[H, n]`` and values ``[n, H_kv, D]``."""
    group = p.size(0) // v.size(1)
    return torch.einsum("hn,nhd->hd", p, v.repeat_interleave(group, dim=1))


def ref_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    alibi_slopes: torch.Tensor | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Dense attention of one decode step, in float64: the ground truth.

    ``query`` is ``[num_seqs, num_heads, head_size]``, the caches are flash layout
    ``[num_blocks, block_size, num_kv_heads, head_size]`` (any strides), ``block_tables`` is
    ``[num_seqs, max_blocks]`` and ``seq_lens`` is ``[num_seqs]``. Returns float64
    ``[num_seqs, num_heads, head_size]``. An exact softmax (no epsilon). With ``return_lse``,
    returns ``(out, lse)``: ``lse[s, h] = log(sum_j exp(logit_j))``, float64 ``[num_seqs,
    num_heads]``, what ``merge_partials`` needs to combine this result with attention over other
    tokens.
    """
    args.check_flash_decode_args(query, key_cache, value_cache, block_tables, seq_lens, alibi_slopes, scale=scale)
    scale = float(scale)
    num_seqs, num_heads, head_size = query.shape
    out = torch.empty(num_seqs, num_heads, head_size, dtype=torch.float64, device=query.device)
    lse = torch.empty(num_seqs, num_heads, dtype=torch.float64, device=query.device)
    slopes = None if alibi_slopes is None else alibi_slopes.double()
    for s, seq_len in enumerate(seq_lens.tolist()):
        k, v = gather_kv(key_cache, value_cache, block_tables[s], seq_len)
        positions = torch.arange(seq_len, device=query.device)
        logits = _logits(query[s].double(), k.double(), scale, slopes, positions, seq_len)
        out[s] = _weighted_values(torch.softmax(logits, dim=-1), v.double())
        lse[s] = torch.logsumexp(logits, dim=-1)
    return (out, lse) if return_lse else out


def merge_partials(outputs: torch.Tensor, max_logits: torch.Tensor, exp_sums: torch.Tensor | None = None,
                   *, dim: int = -1, eps: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over a whole context from attention over its disjoint parts.

    Part ``p`` reports its output ``o_p``, normalised over its own tokens, its largest logit
    ``m_p`` and ``s_p = sum exp(logit - m_p)`` over its tokens. ``exp(logit - M) = exp(logit - m_p)
    * exp(m_p - M)``, so rescaling each part's sum to the largest maximum ``M`` puts them all on
    one scale: ``w_p = s_p * exp(m_p - M)`` and ``out = sum_p w_p o_p / (sum_p w_p + eps)``.
    A part given by its log-sum-exp ``lse_p = m_p + log s_p`` is the pair ``(lse_p, 1)``: leave
    ``exp_sums`` out. An empty part (``m_p = -inf`` or ``s_p = 0``) weighs nothing.

    ``max_logits`` (and ``exp_sums``) index the parts along ``dim``; ``outputs`` has the same
    dimensions plus a trailing one (head_size). Returns ``(out, lse)`` with ``lse = M + log
    sum_p w_p``, the whole context's log-sum-exp, in the dtype the inputs promote to.
    vLLM's v2 reduction adds ``eps = 1e-6``; decode context parallelism merges with none.
    """
    d = dim % max_logits.dim()
    top = max_logits.amax(dim=d, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))     # all parts empty: no NaN
    w = torch.exp(max_logits - top)
    if exp_sums is not None:
        w = exp_sums * w
    total = w.sum(dim=d)
    out = (outputs * w.unsqueeze(-1)).sum(dim=d) / (total + eps).unsqueeze(-1)
    return out, top.squeeze(d) + torch.log(total)


# --------------------------------------------------------------------------------------------
# Cache writes (vLLM's csrc/cache_kernels.cu) and the fp8 conversions they may apply
# --------------------------------------------------------------------------------------------

def _to_cache(x: torch.Tensor, kv_cache_dtype: str, scale: torch.Tensor) -> torch.Tensor:
    """Convert input values to what the cache stores: unchanged, or fp8 bits as uint8.

    fp8 stores ``saturate(x / scale)``: values beyond the format's largest finite number clamp
    to it instead of becoming inf/NaN. ``scale`` broadcasts over the last dimension's heads.
    """
    if kv_cache_dtype in args.UNQUANTIZED_KV_DTYPES:
        return x
    fp8 = args.FP8_KV_DTYPES[kv_cache_dtype]
    limit = torch.finfo(fp8).max
    q = (x.float() / scale).clamp(-limit, limit)
    return q.to(fp8).view(torch.uint8)


def _from_cache(c: torch.Tensor, kv_cache_dtype: str, scale: torch.Tensor) -> torch.Tensor:
    """Read cache values back as float32: unchanged, or ``float(fp8) * scale``."""
    if kv_cache_dtype in args.UNQUANTIZED_KV_DTYPES:
        return c.float()
    return c.view(args.FP8_KV_DTYPES[kv_cache_dtype]).float() * scale.float()


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
) -> None:
    """Write each token's keys and values into its slot of a v0-layout cache.

    Token ``t`` goes to slot ``s = slot_mapping[t]``: block ``s // block_size``, offset
    ``s % block_size``. Key element ``d`` of head ``h`` lands at ``[blk, h, d // x, off, d % x]``
    and value element ``d`` at ``[blk, h, d, off]``. Tokens with a negative slot are skipped.
    Only ``slot_mapping.size(0)`` tokens are written (``key`` may be longer: padding).
    """
    args.check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale)
    num_blocks, num_heads, dx, block_size, x = key_cache.shape
    tokens = torch.nonzero(slot_mapping >= 0).flatten()
    slots = slot_mapping[tokens]
    blk, off = slots // block_size, slots % block_size
    k = _to_cache(key[tokens], kv_cache_dtype, k_scale)
    v = _to_cache(value[tokens], kv_cache_dtype, v_scale)
    # Advanced indices on dims 0 and 3 move to the front: the target is [n, H, D/x, x].
    key_cache[blk, :, :, off, :] = k.reshape(-1, num_heads, dx, x)
    value_cache[blk, :, :, off] = v


def reshape_and_cache_flash(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
) -> None:
    """Write each token's keys and values into a flash-layout cache.

    The caches are ``[num_blocks, block_size, num_heads, head_size]`` with any strides (NHD or
    HND memory) and a unit last stride. Token ``t`` with slot ``s >= 0`` is written to
    ``cache[s // block_size, s % block_size]``. Scales are ``[1]`` or per head ``[num_heads]``.
    """
    args.check_reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype,
                                  k_scale, v_scale)
    block_size = key_cache.size(1)
    tokens = torch.nonzero(slot_mapping >= 0).flatten()
    slots = slot_mapping[tokens]
    per_head = k_scale.reshape(-1, 1)  # [1, 1] or [H, 1]: broadcasts over [n, H, D]
    key_cache[slots // block_size, slots % block_size] = _to_cache(key[tokens], kv_cache_dtype, per_head)
    value_cache[slots // block_size, slots % block_size] = _to_cache(
        value[tokens], kv_cache_dtype, v_scale.reshape(-1, 1))


# --------------------------------------------------------------------------------------------
# Block copies (vLLM's csrc/cache_kernels.cu)
# --------------------------------------------------------------------------------------------

def copy_blocks(key_caches: list[torch.Tensor], value_caches: list[torch.Tensor], block_mapping: torch.Tensor) -> None:
    """For every layer and every ``(src, dst)`` pair, copy block ``src`` over block ``dst``.

    This is what copy-on-write needs: the legacy block manager's CoW pairs, applied to the caches
    of all layers at once. Pairs are independent (all sources are read before any write), so a
    block may be the source of several pairs. vLLM wanted ``block_mapping`` on the GPU; the
    reference takes it on any device.
    """
    if not args.check_copy_blocks(key_caches, value_caches, block_mapping):
        return
    src = block_mapping[:, 0].to(key_caches[0].device)
    dst = block_mapping[:, 1].to(key_caches[0].device)
    for cache in (*key_caches, *value_caches):
        cache[dst] = cache[src]  # the right side is gathered into a new tensor first


def swap_blocks(
    src: torch.Tensor,
    dst: torch.Tensor,
    block_size_in_bytes: int | torch.Tensor | None = None,
    block_mapping: torch.Tensor | None = None,
) -> None:
    """Copy whole blocks between two caches, e.g. GPU to pinned CPU and back.

    Both of vLLM's signatures work: ``swap_blocks(src, dst, block_mapping)`` (until 2026-01,
    a block is ``src.element_size() * src.stride(0)`` bytes) and
    ``swap_blocks(src, dst, block_size_in_bytes, block_mapping)`` (latest). ``block_mapping`` is
    an int64 ``[n, 2]`` tensor of ``(src, dst)`` block ids and must be on the CPU, as in vLLM.
    vLLM refuses CPU-to-CPU swaps; the reference allows them so that it runs on any machine.
    """
    nbytes, block_mapping = args.check_swap_blocks(src, dst, block_size_in_bytes, block_mapping)
    src_b, dst_b = args.block_bytes("src", src), args.block_bytes("dst", dst)
    s = block_mapping[:, 0].to(src.device)
    d = block_mapping[:, 1].to(dst.device)
    dst_b[d, :nbytes] = src_b[s, :nbytes].to(dst.device)


# --------------------------------------------------------------------------------------------
# Paged attention v1 / v2 over the v0 layout (vLLM's csrc/attention/), in plain torch
# --------------------------------------------------------------------------------------------

def _gather_v0(key_cache, value_cache, block_table, seq_len, kv_cache_dtype, k_scale, v_scale):
    """One sequence's keys and values as float32 ``[seq_len, H_kv, D]`` from v0-layout caches."""
    blocks = block_table[: cdiv(seq_len, value_cache.size(3))].long()
    kb = key_cache[blocks]                       # [nb, H, D/x, B, x]
    k = kb.permute(0, 3, 1, 2, 4).flatten(0, 1).flatten(2, 3)[:seq_len]   # [(nb*B), H, D]
    v = value_cache[blocks].permute(0, 3, 1, 2).flatten(0, 1)[:seq_len]  # [(nb*B), H, D]
    return _from_cache(k, kv_cache_dtype, k_scale), _from_cache(v, kv_cache_dtype, v_scale)


def _softmax_parts(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(max, exp_sum, probabilities)`` of a row-wise softmax with vLLM's ``+1e-6``."""
    m = logits.amax(dim=-1)
    e = torch.exp(logits - m[:, None])
    s = e.sum(dim=-1)
    return m, s, e / (s[:, None] + SOFTMAX_EPS)


def v2_scratch(query: torch.Tensor, max_seq_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Empty ``(exp_sums, max_logits, tmp_out)`` for ``paged_attention_v2`` on this query batch."""
    num_seqs, num_heads, head_size = query.shape
    parts = (num_seqs, num_heads, cdiv(max_seq_len, PARTITION_SIZE))
    exp_sums = torch.empty(parts, dtype=torch.float32, device=query.device)
    return exp_sums, torch.empty_like(exp_sums), torch.empty(*parts, head_size, dtype=query.dtype, device=query.device)


def v0_decode_args(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                   block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                   alibi_slopes: torch.Tensor | None = None, max_seq_len: int | None = None) -> tuple:
    """A flash-layout decode step (``DecodeProblem.decode_args()``) as the arguments of
    ``paged_attention_v1`` after ``out`` (v2: after ``out`` and ``v2_scratch``): the caches
    converted to the v0 layout, unquantized, unit scales. ``max_seq_len`` defaults to the longest."""
    key_v0, value_v0 = flash_to_v0(key_cache, value_cache)
    one = torch.ones(1, dtype=torch.float32, device=query.device)
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    return (query, key_v0, value_v0, key_cache.size(2), scale, block_tables, seq_lens, key_cache.size(1),
            max_seq_len, alibi_slopes, "auto", one, one)


def paged_attention_v1(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    num_kv_heads: int,
    scale: float,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    max_seq_len: int,
    alibi_slopes: torch.Tensor | None,
    kv_cache_dtype: str,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    tp_rank: int = 0,
    blocksparse_local_blocks: int = 0,
    blocksparse_vert_stride: int = 0,
    blocksparse_block_size: int = 64,
    blocksparse_head_sliding_step: int = 0,
) -> None:
    """One decode step over a v0-layout cache, each sequence in one pass.

    Scores and sums are float32, as in the CUDA kernel; the softmax denominator carries vLLM's
    ``+1e-6``; the result is written into ``out`` in the query's dtype. Block-sparse attention
    (``blocksparse_vert_stride > 1``) is not implemented; ``tp_rank`` only mattered there.
    """
    args.check_v0_attention(out, query, key_cache, value_cache, num_kv_heads, block_tables, seq_lens,
                       block_size, max_seq_len, alibi_slopes, kv_cache_dtype, k_scale, v_scale,
                       blocksparse_vert_stride, scale=scale)
    scale = float(scale)
    for s, seq_len in enumerate(seq_lens.tolist()):
        k, v = _gather_v0(key_cache, value_cache, block_tables[s], seq_len, kv_cache_dtype, k_scale, v_scale)
        positions = torch.arange(seq_len, device=query.device)
        logits = _logits(query[s].float(), k, scale, alibi_slopes, positions, seq_len)
        _, _, p = _softmax_parts(logits)
        out[s] = _weighted_values(p, v).to(out.dtype)


def paged_attention_v2(
    out: torch.Tensor,
    exp_sums: torch.Tensor,
    max_logits: torch.Tensor,
    tmp_out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    num_kv_heads: int,
    scale: float,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    max_seq_len: int,
    alibi_slopes: torch.Tensor | None,
    kv_cache_dtype: str,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    tp_rank: int = 0,
    blocksparse_local_blocks: int = 0,
    blocksparse_vert_stride: int = 0,
    blocksparse_block_size: int = 64,
    blocksparse_head_sliding_step: int = 0,
) -> None:
    """One decode step in 512-token partitions, then a reduction.

    Partition ``p`` of a sequence covers tokens ``[512 p, 512 (p + 1))``. It records its own
    maximum score ``m_p`` (``max_logits``), its exp-sum ``s_p`` (``exp_sums``) and its locally
    normalised output (``tmp_out``, query dtype). The reduction rescales each partition to the
    global maximum ``M``: weight ``w_p = s_p exp(m_p - M)``, and ``out = sum_p w_p tmp_out_p /
    (sum_p w_p + 1e-6)``. A single-partition sequence copies ``tmp_out`` straight to ``out``.
    Partitions past a sequence's end are left untouched, as the CUDA kernel leaves them.
    """
    args.check_v0_attention(out, query, key_cache, value_cache, num_kv_heads, block_tables, seq_lens,
                       block_size, max_seq_len, alibi_slopes, kv_cache_dtype, k_scale, v_scale,
                       blocksparse_vert_stride, scale=scale)
    args.check_v2_buffers(exp_sums, max_logits, tmp_out, query, max_seq_len)
    scale = float(scale)
    for s, seq_len in enumerate(seq_lens.tolist()):
        k, v = _gather_v0(key_cache, value_cache, block_tables[s], seq_len, kv_cache_dtype, k_scale, v_scale)
        q = query[s].float()
        n = cdiv(seq_len, PARTITION_SIZE)
        for p in range(n):
            lo, hi = p * PARTITION_SIZE, min((p + 1) * PARTITION_SIZE, seq_len)
            positions = torch.arange(lo, hi, device=query.device)
            m, e, probs = _softmax_parts(_logits(q, k[lo:hi], scale, alibi_slopes, positions, seq_len))
            max_logits[s, :, p] = m
            exp_sums[s, :, p] = e
            tmp_out[s, :, p] = _weighted_values(probs, v[lo:hi]).to(tmp_out.dtype)
        if n == 1:
            out[s] = tmp_out[s, :, 0]
            continue
        merged, _ = merge_partials(tmp_out[s, :, :n].float(), max_logits[s, :, :n], exp_sums[s, :, :n],
                                   eps=SOFTMAX_EPS)
        out[s] = merged.to(out.dtype)
