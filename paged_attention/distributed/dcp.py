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
head_size + 1]`` numbers travel per step, however long the context: one all-gather carries each
rank's output and log-sum-exps side by side (``PartialsExchange``).

A model runs these moves in every layer of every step, so ``DcpDecodePlan`` does the checking
and the allocating once, and a run is one decode launch (two when the context is split), one
all-gather and one merge launch, with nothing read back to the host: the same cost per layer as
a single-GPU decode plus the exchange, and what a CUDA graph captures. The rank's token counts
change once per step, not per layer: a caller computes them once (``get_dcp_local_seq_lens``),
as vLLM's attention metadata does.

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
from paged_attention.kernels.triton.launch import cached_plan, check_planned, tensor_signature
from paged_attention.utils import check_int, check_int_list

IMPLS = ("triton", "reference")
"""Decode implementations a rank can attend with: the project's Triton kernel (compiled on a
GPU, the interpreter on a CPU; the merge in float32 on the device) or the float64 plain-torch
oracle (the merge too)."""

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


# ---- 1. Attention over this rank's share -----------------------------------------------------

def _share_bound(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 block_tables: torch.Tensor, local_seq_lens: torch.Tensor, scale: float,
                 max_seq_len: int | None, check_ids: bool) -> int:
    """Check a rank's decode arguments as the decode kernel would; return the bound on its token
    counts that the kernel sizes its work by (>= 1).

    A rank may hold none of a short sequence's tokens (a count of 0), which the decode's checks
    refuse, as no decode step has an empty sequence. The Triton kernel reads nothing for it and
    writes a zero output and ``lse = -inf``; so the checks see each count raised to one token
    (the row's first block, which every sequence has, must then be a valid id)."""
    args.tensor("local_seq_lens", local_seq_lens, ndim=1, dtypes=(torch.int32, torch.int64))
    checked = local_seq_lens.clamp(min=1) if check_ids else local_seq_lens
    bound = args.check_flash_decode_args(query, key_cache, value_cache, block_tables, checked, None,
                                         check_ids, scale=scale, max_seq_len=max_seq_len)
    return max(bound, 1)


def partial_decode_attention(query: torch.Tensor, key_cache: torch.Tensor,
                             value_cache: torch.Tensor, block_tables: torch.Tensor,
                             local_seq_lens: torch.Tensor, scale: float, *, impl: str = "triton",
                             max_seq_len: int | None = None, check_ids: bool = True) -> Tensors:
    """Step 1: this rank's attention over its own share, ``(out, lse)``.

    ``out`` is ``[num_seqs, num_heads, head_size]`` (the query's dtype with Triton, float64 with
    the reference), ``lse`` the log-sum-exp of each head's scores over the share, ``[num_seqs,
    num_heads]`` (float32 / float64). A sequence of which this rank holds no token (a context
    shorter than ``W * interleave``) gets ``lse = -inf`` and a zero output: it weighs nothing in
    the merge. ``max_seq_len`` (a bound on ``local_seq_lens``) and ``check_ids`` are the
    decode's: with ``check_ids=False`` and ``max_seq_len`` given, nothing is read back to the
    host and the decode's plan is reused.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "reference":
        args.tensor("local_seq_lens", local_seq_lens, ndim=1, dtypes=(torch.int32, torch.int64))
        # The oracle wants >= 1 token: an empty share reads one (column 0 of the row is a valid
        # block), and its result is then replaced by the empty one.
        empty = local_seq_lens == 0
        out, lse = ref.ref_decode_attention(query, key_cache, value_cache, block_tables,
                                            local_seq_lens.clamp(min=1), scale, return_lse=True)
        return out.masked_fill(empty[:, None, None], 0.0), lse.masked_fill(empty[:, None], -torch.inf)
    from paged_attention.kernels.triton.decode import paged_attention_decode

    if check_ids or max_seq_len is None:
        bound = _share_bound(query, key_cache, value_cache, block_tables, local_seq_lens, scale,
                             max_seq_len, check_ids)
    else:                     # the fast path: the decode checks once, when it makes its plan
        bound = max_seq_len
    out = torch.empty_like(query)
    lse = torch.empty(query.shape[:2], dtype=torch.float32, device=query.device)
    # The decode's own split heuristics; the log-sum-exp comes out of its split merge.
    paged_attention_decode(out, query, key_cache, value_cache, block_tables, local_seq_lens, scale,
                           max_seq_len=bound, check_ids=False, lse=lse)
    return out, lse


# ---- 2. The exchange: every rank's output and log-sum-exps -----------------------------------

class PartialsExchange:
    """The buffers of the all-gather that gives every rank every rank's ``(out, lse)``.

    The rank's output (``[num_seqs, num_heads, head_size]``) and log-sum-exps (``[num_seqs,
    num_heads]``) lie side by side in one byte buffer, ``send``, each at a 16-byte boundary; so
    one collective carries both, into ``recv``, ``world`` such rows. ``out`` and ``lse`` are
    views of the rank's part (the decode writes straight into them); ``outs``, ``lses`` views of
    every rank's, ``[world, ...]``. Made once and reused, nothing is allocated per step.
    """

    def __init__(self, world: int, shape: tuple[int, int, int], out_dtype: torch.dtype,
                 lse_dtype: torch.dtype, device: torch.device) -> None:
        world = check_int("world", world, minimum=1)
        sizes = check_int_list("shape", shape, 0)
        if len(sizes) != 3:
            raise ValueError(f"shape must be [num_seqs, num_heads, head_size], got {shape}")
        num_seqs, num_heads, head_size = sizes
        for name, dtype in (("out_dtype", out_dtype), ("lse_dtype", lse_dtype)):
            if not isinstance(dtype, torch.dtype):
                raise TypeError(f"{name} must be a torch.dtype, got {type(dtype).__name__}")
        shape = (num_seqs, num_heads, head_size)
        out_bytes = num_seqs * num_heads * head_size * out_dtype.itemsize
        lse_bytes = num_seqs * num_heads * lse_dtype.itemsize
        lse_at = -(-out_bytes // 16) * 16
        row = -(-(lse_at + lse_bytes) // 16) * 16
        self.world = world
        self.send = torch.empty(row, dtype=torch.uint8, device=device)
        self.recv = torch.empty(world * row, dtype=torch.uint8, device=device)
        rows = self.recv.view(world, row)
        self.out = self.send[:out_bytes].view(out_dtype).view(shape)
        self.lse = self.send[lse_at:lse_at + lse_bytes].view(lse_dtype).view(shape[:2])
        self.outs = rows[:, :out_bytes].view(out_dtype).view(world, *shape)
        self.lses = rows[:, lse_at:lse_at + lse_bytes].view(lse_dtype).view(world, *shape[:2])

    def all_gather(self, group: dist.ProcessGroup | None = None) -> None:
        """Every rank's ``send`` into every rank's ``recv``, in rank order (one collective)."""
        if self.send.numel():                   # an empty batch: nothing to send, on every rank
            _all_gather_single(self.recv, self.send, group=group)


def all_gather_partials(out: torch.Tensor, lse: torch.Tensor,
                        group: dist.ProcessGroup | None = None) -> Tensors:
    """Step 2: every rank's ``(out, lse)``, stacked: ``[W, num_seqs, num_heads, head_size]``
    and ``[W, num_seqs, num_heads]``, the same on every rank (one all-gather, through a
    ``PartialsExchange`` made for this call)."""
    args.tensor("out", out, ndim=3)
    args.tensor("lse", lse, ndim=2)
    args.shape("lse", lse, out.shape[:2])
    exchange = PartialsExchange(dist.get_world_size(group), tuple(out.shape), out.dtype, lse.dtype,
                                out.device)
    exchange.out.copy_(out)
    exchange.lse.copy_(lse)
    exchange.all_gather(group)
    return exchange.outs, exchange.lses


# ---- 3. The merge ------------------------------------------------------------------------------

def merge_rank_partials(outs: torch.Tensor, lses: torch.Tensor) -> Tensors:
    """Step 3: the ranks' partials (along dim 0) merged into attention over the whole context,
    ``(out, lse)``, by the same function that merges v2's partitions: a rank's log-sum-exp is
    the pair (maximum = lse, exp-sum = 1). (The plan below merges Triton partials with the
    Triton twin of this function, ``kernels.triton.decode.MergePlan``, in float32.)"""
    return ref.merge_partials(outs, lses, dim=0)


# ---- The three moves, planned once, run per layer ---------------------------------------------

_RUN_ARGS = ("out", "query", "key_cache", "value_cache", "block_tables", "local_seq_lens", "lse")


class DcpDecodePlan:
    """One rank's DCP decode, checked and prepared once, then run per layer and step.

    Every rank of ``group`` (default: the default group) makes one with its own caches and table
    rows (written through a v1 ``BlockTable`` made with ``dcp_world_size = group size`` and
    ``dcp_rank = rank in group``) and its token counts ``local_seq_lens``
    (``get_dcp_local_seq_lens``). Planning checks the tensors as the decode does
    (``check_ids=True`` also reads the tables and counts on the host), takes ``max_seq_len`` as a
    bound on the counts (else the largest count, read once), and makes the decode's plan, the
    exchange's buffers and the merge's plan. ``run`` takes tensors exactly like the planned ones
    (``ValueError`` if not) and writes the merged output into ``out`` (and the whole context's
    log-sum-exps into ``lse`` if the plan was made with one), the same on every rank.

    With ``impl="triton"`` (``out`` in the query's dtype, ``lse`` float32) a run launches the
    decode (its split merge writing the log-sum-exps), one all-gather, and the merge kernel,
    in float32: no host read, nothing allocated, every rank the same numbers in the same order.
    With ``impl="reference"`` (``out`` and ``lse`` float64) each move is the float64 oracle's.
    The buffers serve one run at a time: run a plan on one CUDA stream, as a model does.
    """

    def __init__(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 block_tables: torch.Tensor, local_seq_lens: torch.Tensor, scale: float, *,
                 out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
                 group: dist.ProcessGroup | None = None, impl: str = "triton",
                 max_seq_len: int | None = None, check_ids: bool = True) -> None:
        if impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
        bound = _share_bound(query, key_cache, value_cache, block_tables, local_seq_lens, scale,
                             max_seq_len, check_ids)
        out_dtype, lse_dtype = ((query.dtype, torch.float32) if impl == "triton"
                                else (torch.float64, torch.float64))
        out = torch.empty(query.shape, dtype=out_dtype, device=query.device) if out is None else out
        args.tensor("out", out, ndim=3, dtypes=(out_dtype,))
        args.shape("out", out, query.shape)
        args.same_device(query=query, out=out)
        args.no_broadcast_dims("out", out)
        if lse is not None:
            args.tensor("lse", lse, ndim=2, dtypes=(lse_dtype,))
            args.shape("lse", lse, query.shape[:2])
            args.same_device(query=query, lse=lse)
        self.group, self.impl, self.scale, self.max_seq_len = group, impl, float(scale), bound
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.exchange = PartialsExchange(self.world, tuple(query.shape), out_dtype, lse_dtype,
                                         query.device)
        self.signature = tuple(map(tensor_signature, (out, query, key_cache, value_cache,
                                                      block_tables, local_seq_lens, lse)))
        if impl == "triton":
            from paged_attention.kernels.triton.decode import DecodePlan, MergePlan

            ex = self.exchange
            self._decode = DecodePlan(query, key_cache, value_cache, block_tables, local_seq_lens,
                                      scale, out=ex.out, lse=ex.lse, max_seq_len=bound,
                                      check_ids=False)
            self._merge = MergePlan(out, ex.outs, ex.lses, lse)

    def run(self, out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor,
            value_cache: torch.Tensor, block_tables: torch.Tensor, local_seq_lens: torch.Tensor,
            lse: torch.Tensor | None = None) -> None:
        """The three moves: this rank's partial, the all-gather, the merge into ``out``."""
        check_planned("DcpDecodePlan", _RUN_ARGS,
                      (out, query, key_cache, value_cache, block_tables, local_seq_lens, lse),
                      self.signature, optional=("lse",))
        ex = self.exchange
        # 1. Attention over this rank's share, straight into its part of the exchange.
        self._partial(query, key_cache, value_cache, block_tables, local_seq_lens)
        # 2. Every rank's output and log-sum-exps, in rank order: one all-gather.
        ex.all_gather(self.group)
        # 3. The merge, the same on every rank: in float32 on the device, or the float64 oracle.
        if self.impl == "triton":
            self._merge._launch(out, ex.outs, ex.lses, lse)
        else:
            merged, merged_lse = merge_rank_partials(ex.outs, ex.lses)
            out.copy_(merged)
            if lse is not None:
                lse.copy_(merged_lse)

    def run_partial(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, local_seq_lens: torch.Tensor) -> Tensors:
        """Step 1 alone, as ``run`` makes it: this rank's ``(out, lse)``, views of the exchange's
        send buffer (overwritten by the next run)."""
        check_planned("DcpDecodePlan", _RUN_ARGS[1:6],
                      (query, key_cache, value_cache, block_tables, local_seq_lens),
                      self.signature[1:6])
        self._partial(query, key_cache, value_cache, block_tables, local_seq_lens)
        return self.exchange.out, self.exchange.lse

    def _partial(self, query, key_cache, value_cache, block_tables, local_seq_lens) -> None:
        ex = self.exchange
        if self.impl == "triton":
            self._decode._launch(ex.out, query, key_cache, value_cache, block_tables,
                                 local_seq_lens, None, ex.lse)
        else:
            out, lse = partial_decode_attention(query, key_cache, value_cache, block_tables,
                                                local_seq_lens, self.scale, impl="reference")
            ex.out.copy_(out)
            ex.lse.copy_(lse)


# Plans made by unchecked calls of dcp_decode_attention, by everything planning depends on.
_PLANS: dict[tuple, DcpDecodePlan] = {}
_MAX_PLANS = 16


def dcp_decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, *,
                         interleave: int = 1, group: dist.ProcessGroup | None = None,
                         impl: str = "triton", max_seq_len: int | None = None,
                         check_ids: bool = True, return_lse: bool = False,
                         local_seq_lens: torch.Tensor | None = None,
                         out: torch.Tensor | None = None) -> torch.Tensor | Tensors:
    """One decode step's attention over the whole context, with this rank holding only its share.

    Every rank of ``group`` (default: the default group) calls this with the same ``query`` and
    ``seq_lens`` (whole-context lengths), and its own caches and table rows, written through a
    v1 ``BlockTable`` made with ``dcp_world_size = group size``, ``dcp_rank = rank in group`` and
    ``dcp_kv_cache_interleave_size = interleave``. Returns the merged output (into ``out`` if
    given), the same on every rank: the query's dtype with Triton, float64 with the reference;
    with ``return_lse`` also the whole context's log-sum-exps. ``local_seq_lens``: this rank's
    token counts if the caller computed them once for the step (``get_dcp_local_seq_lens``; with
    ``check_ids`` they are checked against ``seq_lens``), else they are computed here.
    ``max_seq_len``, a bound on the *whole* contexts, and ``check_ids`` go to the kernel as in
    ``paged_attention_decode``: with ``check_ids=False`` and ``max_seq_len`` given, the
    ``DcpDecodePlan`` is made once per combination of shapes and options and reused.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    local = local_seq_lens
    if local is None or check_ids:
        counts = get_dcp_local_seq_lens(seq_lens, world, rank, interleave)
        if local is not None and not (isinstance(local, torch.Tensor)
                                      and torch.equal(local.cpu().long(), counts.cpu().long())):
            raise ValueError(f"local_seq_lens must be rank {rank}'s token counts of seq_lens "
                             f"(interleave {interleave}): {counts.tolist()}, got {local!r}")
        local = counts if local is None else local
    if out is None:
        out_dtype = query.dtype if impl == "triton" else torch.float64
        out = torch.empty(query.shape, dtype=out_dtype, device=query.device)
    lse = None
    if return_lse:
        lse_dtype = torch.float32 if impl == "triton" else torch.float64
        lse = torch.empty(query.shape[:2], dtype=lse_dtype, device=query.device)
    bound = _local_bound(max_seq_len, world, interleave)

    def make() -> DcpDecodePlan:
        return DcpDecodePlan(query, key_cache, value_cache, block_tables, local, scale, out=out,
                             lse=lse, group=group, impl=impl, max_seq_len=bound,
                             check_ids=check_ids)

    if check_ids or bound is None:
        plan = make()
    else:
        plan = cached_plan(_PLANS, _MAX_PLANS, lambda: (
            tuple(map(tensor_signature, (out, query, key_cache, value_cache, block_tables, local,
                                         lse))), scale, bound, impl, group, world, rank), make)
    plan.run(out, query, key_cache, value_cache, block_tables, local, lse)     # the three moves
    return (out, lse) if return_lse else out


def _local_bound(max_seq_len: int | None, world: int, interleave: int) -> int | None:
    """A bound on every rank's token count for contexts of at most ``max_seq_len`` tokens: rank
    0's count, the largest (it is first in every round of dealing)."""
    if max_seq_len is None:
        return None
    rounds, rem = divmod(check_int("max_seq_len", max_seq_len, minimum=1), world * interleave)
    return rounds * interleave + min(rem, interleave)
