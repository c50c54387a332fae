"""Decode context parallelism (DCP): one request's KV cache spread over several ranks, and the
attention of a decode step computed where the cache lies.

A long context's keys and values may not fit one GPU, and even when they do, a decode step
reads all of them: the step is bound by memory bandwidth. DCP deals every request's tokens out
to ``W`` ranks (runs of ``interleave`` consecutive positions to ranks 0, 1, ..., W-1 in turn),
so that each stores and reads about ``1/W`` of the context. A decode step then runs in three
moves:

1. every rank attends with the (same) new query over *its share only*, with an ordinary paged
   decode kernel, and keeps, per query head, the output ``o_r`` and the log-sum-exp ``lse_r`` of
   its scores;
2. the ranks exchange those partials (an all-gather: each gets every rank's ``o`` and ``lse``);
3. each merges them exactly as v2's partitions are merged: ``w_r = exp(lse_r - max lse)``,
   ``out = sum_r w_r o_r / sum_r w_r`` (``kernels.reference.merge_partials``).

The result is attention over the whole context, to rounding. Only ``W x [num_seqs, num_heads,
head_size + 1]`` numbers travel per step, however long the context.

A rank's share needs no kernel of its own. The v1 block table's DCP slot mapping
(``BlockTable(..., dcp_world_size=W, dcp_rank=r)``) packs the rank's tokens densely, in position
order, into its blocks: its ``n``-th token sits at column ``n // block_size`` of the row, offset
``n % block_size``, exactly where a sequence of its own would. So the rank's decode is the
ordinary decode over the same table rows with ``seq_lens`` replaced by the rank's token counts
(``get_dcp_local_seq_lens``).

vLLM does the same in ``vllm/v1/attention`` (the backends' DCP path and ``cp_lse_ag_out_rs``),
with two differences: its query heads are first all-gathered from tensor-parallel shards, and
after the correction it reduce-scatters the heads back; here every rank holds every head, and
the merged output is the same on every rank. ALiBi is not supported (vLLM's DCP has none
either): a rank's kernel would need its tokens' global positions.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from paged_attention.kernels import args
from paged_attention.kernels import reference as ref
from paged_attention.utils import check_int

IMPLS = ("triton", "reference")
"""Decode implementations a rank can attend with: the project's Triton kernel (compiled on a
GPU, the interpreter on a CPU) or the float64 plain-torch oracle."""

# torch 2.13 renamed all_gather_into_tensor; both gather into one tensor of world x the input.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def get_dcp_local_seq_lens(seq_lens: torch.Tensor, dcp_world_size: int, dcp_rank: int,
                           interleave: int = 1) -> torch.Tensor:
    """How many tokens of each sequence rank ``dcp_rank`` stores (same dtype and device).

    Positions are dealt in rounds of ``dcp_world_size * interleave``; each whole round gives
    every rank ``interleave`` tokens, and of the last, partial round of ``rem`` positions rank
    ``r`` gets those from ``r * interleave`` on, at most ``interleave``:
    ``local = (L // (W I)) * I + clamp(rem - r I, 0, I)``.
    """
    world = check_int("dcp_world_size", dcp_world_size, minimum=1)
    rank = check_int("dcp_rank", dcp_rank, minimum=0)
    interleave = check_int("interleave", interleave, minimum=1)
    if rank >= world:
        raise ValueError(f"dcp_rank must be below dcp_world_size = {world}, got {rank}")
    args.tensor("seq_lens", seq_lens, ndim=1, dtypes=(torch.int32, torch.int64))
    rounds, rem = seq_lens // (world * interleave), seq_lens % (world * interleave)
    return rounds * interleave + (rem - rank * interleave).clamp(0, interleave)


Tensors = tuple[torch.Tensor, torch.Tensor]


def partial_decode_attention(query: torch.Tensor, key_cache: torch.Tensor,
                             value_cache: torch.Tensor, block_tables: torch.Tensor,
                             local_seq_lens: torch.Tensor, scale: float, *, impl: str = "triton",
                             max_seq_len: int | None = None, check_ids: bool = True) -> Tensors:
    """Step 1: this rank's attention over its own share, ``(out, lse)``.

    ``out`` is ``[num_seqs, num_heads, head_size]`` (the query's dtype with Triton, float64 with
    the reference), ``lse`` the log-sum-exp of each head's scores over the share, ``[num_seqs,
    num_heads]`` (float32 / float64). A sequence of which this rank holds no token (a context
    shorter than ``W * interleave``) gets ``lse = -inf`` and a zero output: it weighs nothing in
    the merge. ``max_seq_len`` and ``check_ids`` go to the Triton kernel (its fast path: a bound
    on ``local_seq_lens``, and no index checks).
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    args.tensor("local_seq_lens", local_seq_lens, ndim=1, dtypes=(torch.int32, torch.int64))
    empty = local_seq_lens == 0
    # The kernels want >= 1 token: an empty share reads one token (column 0 of the row is a
    # valid block), and its result is then replaced by the empty one.
    lens = local_seq_lens.clamp(min=1)
    if impl == "reference":
        out, lse = ref.ref_decode_attention(query, key_cache, value_cache, block_tables, lens,
                                            scale, return_lse=True)
    else:
        from paged_attention.kernels.triton.decode import paged_attention_decode

        out = torch.empty_like(query)
        lse = torch.empty(query.shape[:2], dtype=torch.float32, device=query.device)
        paged_attention_decode(out, query, key_cache, value_cache, block_tables, lens, scale,
                               max_seq_len=max_seq_len, check_ids=check_ids, lse=lse)
    lse = lse.masked_fill(empty[:, None], float("-inf"))
    out = out.masked_fill(empty[:, None, None], 0.0)
    return out, lse


def all_gather_partials(out: torch.Tensor, lse: torch.Tensor,
                        group: dist.ProcessGroup | None = None) -> Tensors:
    """Step 2: every rank's ``(out, lse)``, stacked: ``[W, num_seqs, num_heads, head_size]``
    and ``[W, num_seqs, num_heads]``, the same on every rank (two ``torch.distributed``
    all-gathers)."""
    world = dist.get_world_size(group)
    outs = out.new_empty((world * out.size(0), *out.shape[1:]))
    lses = lse.new_empty((world * lse.size(0), *lse.shape[1:]))
    _all_gather_single(outs, out.contiguous(), group=group)
    _all_gather_single(lses, lse.contiguous(), group=group)
    return outs.view(world, *out.shape), lses.view(world, *lse.shape)


def merge_rank_partials(outs: torch.Tensor, lses: torch.Tensor) -> Tensors:
    """Step 3: the ranks' partials (along dim 0) merged into attention over the whole context,
    ``(out, lse)``, by the same function that merges v2's partitions: a rank's log-sum-exp is
    the pair (maximum = lse, exp-sum = 1)."""
    return ref.merge_partials(outs, lses, dim=0)


def dcp_decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, *,
                         interleave: int = 1, group: dist.ProcessGroup | None = None,
                         impl: str = "triton", max_seq_len: int | None = None,
                         check_ids: bool = True,
                         return_lse: bool = False) -> torch.Tensor | Tensors:
    """One decode step's attention over the whole context, with this rank holding only its share.

    Every rank of ``group`` (default: the default group) calls this with the same ``query`` and
    ``seq_lens`` (whole-context lengths), and its own caches and table rows, written through a
    v1 ``BlockTable`` made with ``dcp_world_size = group size``, ``dcp_rank = rank in group`` and
    ``dcp_kv_cache_interleave_size = interleave``. Returns the merged output, the same on every
    rank: the query's dtype with Triton, float64 with the reference; with ``return_lse`` also
    the whole context's log-sum-exps. ``max_seq_len``, a bound on the *whole* contexts, and
    ``check_ids`` go to the kernel as in ``paged_attention_decode``.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    # 1. Attention over this rank's share: its tokens of each sequence, in order, in its blocks.
    local = get_dcp_local_seq_lens(seq_lens, world, rank, interleave)
    out, lse = partial_decode_attention(query, key_cache, value_cache, block_tables, local, scale,
                                        impl=impl, check_ids=check_ids,
                                        max_seq_len=_local_bound(max_seq_len, world, interleave))
    # 2. Every rank's output and log-sum-exp. 3. The merge, the same on every rank.
    outs, lses = all_gather_partials(out, lse, group)
    merged, merged_lse = merge_rank_partials(outs, lses)
    merged = merged.to(out.dtype)
    return (merged, merged_lse) if return_lse else merged


def _local_bound(max_seq_len: int | None, world: int, interleave: int) -> int | None:
    """A bound on every rank's token count for contexts of at most ``max_seq_len`` tokens: rank
    0's count, the largest (it is first in every round of dealing)."""
    if max_seq_len is None:
        return None
    rounds, rem = divmod(check_int("max_seq_len", max_seq_len, minimum=1), world * interleave)
    return rounds * interleave + min(rem, interleave)
