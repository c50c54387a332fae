"""How one attention layer uses the paged KV cache: write the step's keys and values, then attend.

Every layer does the same two things each step, whatever the batch holds:

1. **Write.** Each new token's key and value go to the cache slot the engine gave it
   (``batch.slot_mapping``), with ``reshape_and_cache_flash``: slot ``s`` is row ``s % block_size``
   of physical block ``s // block_size``. (In a decode step on a GPU, Triton's decode kernel does
   the write itself, with the rotary embedding, just before it attends: ``decode``'s ``rope``.)
2. **Attend.** Each request's queries read every key of its sequence so far, through its block
   table. A *decode-only* batch (one new token per request) is exactly what
   ``paged_attention_decode`` computes, so one kernel call serves all requests. In a batch with
   prefills, the one-token requests still go to the decode kernel together, and the prefilling
   ones are attended in one padded ``scaled_dot_product_attention`` call: each request's keys and
   values are gathered from its blocks (the cached prefix, a prefix-cache hit included, then the
   tokens written in step 1) and the causal mask is shifted by the prefix length, so that the
   query at position ``p`` sees keys ``0..p``. With ``attention="triton"`` a paged prefill
   kernel (``kernels/triton/prefill.py``, checked against this SDPA path) does all of it in one
   launch, reading the blocks where they lie.

The kernels are selectable (``attention=``): ``reference`` (plain torch), ``triton`` (compiled on
a GPU, interpreted on a CPU), ``cuda`` (this project's CUDA kernels, vLLM's v0 cache layout),
``vllm`` (vLLM's FA3 and cache ops). ``auto`` is Triton on a GPU and the reference on a CPU,
where Triton's interpreter is correct but slow.
"""
from __future__ import annotations

import functools

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from paged_attention.kernels import KernelUnavailable
from paged_attention.model.batch import ForwardBatch
from paged_attention.utils import cdiv

ATTENTION_IMPLS = ("auto", "reference", "triton", "cuda", "vllm")

KVCache = tuple[torch.Tensor, torch.Tensor]   # (key_cache, value_cache) of one layer


def resolve_attention(name: object, device: torch.device, dtype: torch.dtype) -> str:
    """The implementation ``name`` stands for on this device, or a typed error before anything runs.

    ``ValueError`` for a name that is not one of :data:`ATTENTION_IMPLS`; ``KernelUnavailable``
    for a known one that cannot run here (CUDA or FA3 without a GPU, bf16 in Triton's interpreter).
    """
    if not isinstance(name, str) or name not in ATTENTION_IMPLS:
        raise ValueError(f"unknown attention implementation {name!r}; expected one of {', '.join(ATTENTION_IMPLS)}")
    if name == "auto":
        return "triton" if device.type == "cuda" else "reference"
    if name in ("cuda", "vllm") and device.type != "cuda":
        raise KernelUnavailable(f"attention={name!r} runs on a CUDA GPU only (the model is on {device}); "
                                f"use 'reference' or 'triton'")
    if name == "triton" and device.type != "cuda" and dtype == torch.bfloat16:
        raise KernelUnavailable("Triton's interpreter (on a CPU) has no bfloat16 arithmetic; use float32, "
                                "or attention='reference'")
    if name == "vllm" and dtype == torch.float32:
        raise KernelUnavailable("vLLM's FA3 runs in float16 or bfloat16 only; pass dtype=torch.bfloat16")
    return name


def kv_cache_layout(impl: str) -> str:
    """``flash`` (``[num_blocks, block_size, num_kv_heads, head_dim]``) for every implementation
    but ``cuda``, whose kernels read vLLM's v0 layout (key ``[num_blocks, num_kv_heads, head_dim // x,
    block_size, x]``, value ``[num_blocks, num_kv_heads, head_dim, block_size]``)."""
    return "v0" if impl == "cuda" else "flash"


# --------------------------------------------------------------------------------------------
# A batch with prefills, split into its decodes and its prefills: once a step, for every layer
# --------------------------------------------------------------------------------------------

@dataclass
class DecodePart:
    """The requests of a mixed batch that bring one token: they go to the decode kernel together."""

    tokens: torch.Tensor           # int64 [d]: their rows in the flat batch
    batch: ForwardBatch            # their block tables, lengths and bound, as a decode-only batch


@dataclass
class PrefillPart:
    """The requests that bring several tokens, padded to one rectangle for one SDPA call.

    ``R`` requests, each given ``max_q`` query rows and ``max_kv`` key rows. Request ``r``'s new
    tokens fill its first query rows (``rows``: flat index ``r * max_q + i`` of each token); its
    keys are the cache rows ``(blocks[r, p], offsets[p])`` for ``p < max_kv``; ``mask[r, 0, i, p]``
    says whether its query ``i`` sees key ``p``. Padding rows attend to key 0 only (never a row
    of all -inf, which would give NaN), and their outputs are dropped.
    """

    tokens: torch.Tensor           # int64 [t]: their rows in the flat batch
    rows: torch.Tensor             # int64 [t]: where each sits in the padded [R * max_q] queries
    blocks: torch.Tensor           # int64 [R, max_kv]: the physical block of each key row
    offsets: torch.Tensor          # int64 [max_kv]: the row inside that block
    mask: torch.Tensor             # bool [R, 1, max_q, max_kv]
    num_reqs: int
    max_q: int


@dataclass
class BatchSplit:
    """A batch with prefills, as ``split_batch`` cuts it: its decodes and its prefills (either
    may be None)."""

    decode: DecodePart | None
    prefill: PrefillPart | None


def read_layout(batch: ForwardBatch) -> tuple[list[int], list[int], list[int]]:
    """``(query_start_loc, seq_lens, new tokens per request)`` read to the host, and checked: every
    request brings ``1 <= new tokens <= seq_len`` (at most ``max_query_len``), the last ends at
    the batch's end (for a ``padded`` batch: the real requests, those before the trailing ones
    with no token). One read per step with prefills, none where the batch carries host copies."""
    starts = list(batch.query_start_loc_cpu) if batch.query_start_loc_cpu is not None else \
        batch.query_start_loc.tolist()
    lens = list(batch.seq_lens_cpu) if batch.seq_lens_cpu is not None else batch.seq_lens.tolist()
    if len(starts) != len(lens) + 1:
        raise ValueError(f"query_start_loc has {len(starts)} entries for {len(lens)} requests (num_reqs + 1 expected)")
    if batch.padded:
        # A CUDA graph's padding: requests with no token at the end, tokens past the last one's.
        # The real requests are checked as any batch's.
        while len(lens) > 1 and starts[-1] == starts[-2]:
            starts.pop()
            lens.pop()
        if starts[0] != 0 or starts[-1] > batch.num_tokens:
            raise ValueError(f"query_start_loc must run from 0 to at most the batch's {batch.num_tokens} tokens, "
                             f"got {starts[0]} .. {starts[-1]}")
    elif starts[0] != 0 or starts[-1] != batch.num_tokens:
        raise ValueError(f"query_start_loc must run from 0 to the batch's {batch.num_tokens} tokens, "
                         f"got {starts[0]} .. {starts[-1]}")
    n_new = [starts[i + 1] - starts[i] for i in range(len(lens))]
    for i, (n, seq_len) in enumerate(zip(n_new, lens)):
        if not 1 <= n <= seq_len:
            raise ValueError(f"request {i} brings {n} new tokens but attends to seq_lens[{i}] = {seq_len}: "
                             f"a request needs 1 <= new tokens <= seq_len")
        if n > batch.max_query_len or seq_len > batch.max_seq_len:
            raise ValueError(f"request {i} ({n} new tokens, seq_len {seq_len}) exceeds the batch's "
                             f"max_query_len {batch.max_query_len} or max_seq_len {batch.max_seq_len}")
    return starts, lens, n_new


def split_batch(batch: ForwardBatch, block_size: int) -> BatchSplit:
    """Split a batch that is not decode-only into its decodes and its prefills, and build the
    prefills' gather indices and mask, once: every layer then reuses the split."""
    starts, lens, n_new = read_layout(batch)
    device = batch.block_tables.device
    decodes = [i for i, n in enumerate(n_new) if n == 1]
    prefills = [i for i, n in enumerate(n_new) if n > 1]

    decode = None
    if decodes:
        idx = torch.tensor(decodes, device=device)
        tokens = torch.tensor([starts[i] for i in decodes], device=device)
        sub = ForwardBatch(
            query_start_loc=torch.arange(len(decodes) + 1, dtype=torch.int32, device=device),
            seq_lens=batch.seq_lens[idx], block_tables=batch.block_tables[idx],
            slot_mapping=batch.slot_mapping[tokens], max_query_len=1,
            max_seq_len=max(lens[i] for i in decodes))
        decode = DecodePart(tokens, sub)

    prefill = None
    if prefills:
        max_q = max(n_new[i] for i in prefills)
        max_kv = max(lens[i] for i in prefills)
        tokens, rows, prefix = [], [], []
        for r, i in enumerate(prefills):
            tokens += range(starts[i], starts[i + 1])
            rows += range(r * max_q, r * max_q + n_new[i])
            prefix.append(lens[i] - n_new[i])       # tokens already in the cache before this step
        idx = torch.tensor(prefills, device=device)
        p = torch.arange(max_kv, device=device)
        # Key row p of a request is its token p: block table column p // block_size, row p % block_size.
        table = batch.block_tables[idx, : cdiv(max_kv, block_size)].long()
        seq_lens = batch.seq_lens[idx].long()[:, None]                      # [R, 1]
        in_seq = p[None, :] < seq_lens                                      # [R, max_kv]
        # Past a request's end the table may hold anything: read its first block instead (masked).
        blocks = torch.where(in_seq, table[:, p // block_size], table[:, :1])
        # Query i of request r sits at position prefix_r + i and sees keys 0 .. prefix_r + i.
        q_pos = torch.tensor(prefix, device=device)[:, None] + torch.arange(max_q, device=device)[None, :]
        mask = (p[None, None, :] <= q_pos[:, :, None]) & in_seq[:, None, :]  # [R, max_q, max_kv]
        prefill = PrefillPart(torch.tensor(tokens, device=device), torch.tensor(rows, device=device),
                              blocks, p % block_size, mask[:, None], len(prefills), max_q)
    return BatchSplit(decode, prefill)


# --------------------------------------------------------------------------------------------
# One model's attention: the chosen kernels, and the two paths
# --------------------------------------------------------------------------------------------

class PagedAttention:
    """The cache writes and attention kernels of one implementation, shared by all layers."""

    def __init__(self, impl: str, num_heads: int, num_kv_heads: int, head_dim: int, device: torch.device) -> None:
        self.impl = impl
        self.layout = kv_cache_layout(impl)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5
        # Unquantized caches: unit scales, made once (a per-step allocation would cost a launch).
        self.one = torch.ones(1, dtype=torch.float32, device=device)
        self._write, self._decode = _kernels(impl)
        # A paged prefill kernel reads the cache directly (no gather, no split): Triton's.
        self._prefill = None
        if impl == "triton":
            from paged_attention.kernels.triton import paged_attention_prefill
            self._prefill = paged_attention_prefill

    @property
    def needs_split(self) -> bool:
        """Whether a batch with prefills needs a :func:`split_batch` (the SDPA path) or not (a kernel)."""
        return self._prefill is None

    # ---- 1. write --------------------------------------------------------------------------
    def write(self, key: torch.Tensor, value: torch.Tensor, kv_cache: KVCache, slot_mapping: torch.Tensor) -> None:
        """Store ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` at their slots."""
        self._write(key, value, kv_cache[0], kv_cache[1], slot_mapping, "auto", self.one, self.one)

    # ---- 2. attend -------------------------------------------------------------------------
    @property
    def fuses_rope(self) -> bool:
        """Whether ``decode`` can take ``rope=``: do the step's rotary embedding and cache write in
        its own kernel (Triton's), so that a decode layer launches nothing for them."""
        return self.impl == "triton"

    def decode(self, query: torch.Tensor, kv_cache: KVCache, batch: ForwardBatch,
               rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None, pdl: bool = False
               ) -> torch.Tensor:
        """One new token per request: one kernel call for the whole batch.

        No host reads (``check_ids=False``, the bound ``batch.max_seq_len`` passed in), so the
        call can be captured in a CUDA graph. With ``rope=(cos_sin, positions, slot_mapping)``
        (``fuses_rope`` only): ``query`` is the query columns of the QKV projection, unrotated,
        and the kernel rotates them and writes each new token's key and value first
        (``paged_attention_decode``'s ``rope``). ``pdl=True`` (with ``rope``): the kernel may start
        while the previous one (the QKV projection) ends (``kernels.triton.pdl``).
        """
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        if rope is None:
            self._decode(self, out, query, kv_cache[0], kv_cache[1], batch)
        elif not self.fuses_rope:
            raise ValueError(f"attention={self.impl!r} does not fuse the rotary embedding into its decode kernel")
        else:
            self._decode(self, out, query, kv_cache[0], kv_cache[1], batch, rope, pdl)
        return out

    def mixed(self, query: torch.Tensor, kv_cache: KVCache, batch: ForwardBatch,
              split: BatchSplit | None) -> torch.Tensor:
        """A batch with prefills. With Triton: one paged prefill kernel for every request (a
        decoding request is one with a single new token). Otherwise, by the ``split``: the decodes
        through the decode kernel, the prefills through one padded SDPA call."""
        out = torch.empty_like(query)
        if self._prefill is not None:
            self._prefill(out, query, kv_cache[0], kv_cache[1], batch.block_tables, batch.seq_lens,
                          batch.query_start_loc, self.scale, max_query_len=batch.max_query_len, check_ids=False,
                          max_seq_len=batch.max_seq_len)
            return out
        if split.decode is not None:
            d = split.decode
            out[d.tokens] = self.decode(query[d.tokens], kv_cache, d.batch)
        if split.prefill is not None:
            out[split.prefill.tokens] = self.prefill(query[split.prefill.tokens], kv_cache, split.prefill)
        return out

    def prefill(self, query: torch.Tensor, kv_cache: KVCache, part: PrefillPart) -> torch.Tensor:
        """The prefilling requests' queries against their whole sequences, gathered from their blocks.

        One SDPA call for all of them: queries padded to ``[R, heads, max_q, D]``, keys and values
        gathered to ``[R, kv_heads, max_kv, D]`` (the cached prefix, a prefix-cache hit included,
        then this step's tokens, written just before), and the causal mask shifted by each prefix.
        """
        num_tokens, num_heads, head_dim = query.shape
        padded = query.new_zeros(part.num_reqs * part.max_q, num_heads, head_dim)
        padded[part.rows] = query
        q = padded.view(part.num_reqs, part.max_q, num_heads, head_dim).transpose(1, 2)
        key, value = self.gather(kv_cache, part.blocks, part.offsets)          # [R, max_kv, H_kv, D]
        # enable_gqa: each KV head serves num_heads / num_kv_heads query heads (h -> h // group)
        o = F.scaled_dot_product_attention(q, key.transpose(1, 2), value.transpose(1, 2), attn_mask=part.mask,
                                           scale=self.scale, enable_gqa=True)  # [R, H, max_q, D]
        return o.transpose(1, 2).reshape(-1, num_heads, head_dim)[part.rows]

    def gather(self, kv_cache: KVCache, blocks: torch.Tensor, offsets: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values at cache rows ``(blocks[r, p], offsets[p])``: ``[R, max_kv, kv_heads, D]`` each."""
        key_cache, value_cache = kv_cache
        if self.layout == "flash":
            # [num_blocks, block_size, H, D] indexed on its first two dimensions: any strides (NHD, HND).
            return key_cache[blocks, offsets], value_cache[blocks, offsets]
        # v0 layout: key [N, H, D/x, B, x] at (block, :, :, row, :) -> [R, max_kv, H, D/x, x] -> [.., H, D];
        # value [N, H, D, B] at (block, :, :, row) -> [R, max_kv, H, D]
        key = key_cache[blocks, :, :, offsets, :]
        return key.flatten(-2), value_cache[blocks, :, :, offsets]


def torch_paged_decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                       block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                       max_seq_len: int) -> torch.Tensor:
    """Decode attention over a flash-layout cache in plain torch, every request at once.

    What ``paged_attention_decode`` computes, vectorised: each request's first
    ``cdiv(max_seq_len, block_size)`` blocks are gathered (``[num_seqs, those blocks * block_size,
    kv_heads, D]``), keys at or past its ``seq_len`` are masked out, and SDPA attends. No host
    reads (``max_seq_len`` is a Python int): the reference decode costs a few batched operations
    per layer rather than a loop over requests (``kernels.reference.ref_decode_attention``, the
    float64 oracle, loops).
    """
    block_size = key_cache.size(1)
    num_blocks = cdiv(max_seq_len, block_size)
    blocks = block_tables[:, :num_blocks].long()                      # [S, nb]
    # key_cache[blocks] is [S, nb, block_size, H_kv, D]; flattening (nb, block_size) puts token j at row j
    k = key_cache[blocks].flatten(1, 2).transpose(1, 2)               # [S, H_kv, L, D]
    v = value_cache[blocks].flatten(1, 2).transpose(1, 2)
    visible = torch.arange(k.size(2), device=query.device)[None, :] < seq_lens[:, None]   # [S, L]
    o = F.scaled_dot_product_attention(query.unsqueeze(2), k, v, attn_mask=visible[:, None, None, :],
                                       scale=scale, enable_gqa=True)  # [S, H, 1, D]
    return o.squeeze(2)


# --------------------------------------------------------------------------------------------
# The kernels behind each name
# --------------------------------------------------------------------------------------------

DecodeFn = Callable[[PagedAttention, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, ForwardBatch], None]


def _kernels(impl: str) -> tuple[Callable[..., None], DecodeFn]:
    """``(reshape_and_cache, decode)`` of an implementation (imported on demand)."""
    if impl == "reference":
        from paged_attention.kernels import reference

        def decode(attn, out, query, key_cache, value_cache, batch):
            out.copy_(torch_paged_decode(query, key_cache, value_cache, batch.block_tables, batch.seq_lens,
                                         attn.scale, batch.max_seq_len))
        return reference.reshape_and_cache_flash, decode

    if impl == "triton":
        from paged_attention.kernels import triton as kernels

        def decode(attn, out, query, key_cache, value_cache, batch, rope=None, pdl=False):
            kernels.paged_attention_decode(out, query, key_cache, value_cache, batch.block_tables, batch.seq_lens,
                                           attn.scale, max_seq_len=batch.max_seq_len, check_ids=False, rope=rope,
                                           pdl=pdl)
        return functools.partial(kernels.reshape_and_cache_flash, check_slots=False), decode

    if impl == "vllm":
        from paged_attention.kernels import vllm as kernels

        def decode(attn, out, query, key_cache, value_cache, batch):
            if key_cache.size(1) % 16:
                raise KernelUnavailable(f"vLLM's FA3 needs a block size that is a multiple of 16, "
                                        f"got {key_cache.size(1)}")
            kernels.paged_attention_decode(out, query, key_cache, value_cache, batch.block_tables, batch.seq_lens,
                                           attn.scale, max_seq_len=batch.max_seq_len, check_ids=False)
        return functools.partial(kernels.reshape_and_cache_flash, check_slots=False), decode

    if impl == "cuda":
        from paged_attention.kernels import cuda as kernels
        from paged_attention.kernels.layout import PARTITION_SIZE

        def decode(attn, out, query, key_cache, value_cache, batch):
            # v0-layout caches: value [N, H, D, B], so the block size is its last dimension.
            block_size, max_seq_len = value_cache.size(3), batch.max_seq_len
            num_seqs, num_heads, head_dim = query.shape
            common = (query, key_cache, value_cache, attn.num_kv_heads, attn.scale, batch.block_tables,
                      batch.seq_lens, block_size, max_seq_len, None, "auto", attn.one, attn.one)
            partitions = cdiv(max_seq_len, PARTITION_SIZE)
            # vLLM's rule: one pass (v1) when the context fits one partition or the grid is already
            # wide; partitions and a reduction (v2) for long contexts and few sequences.
            if max_seq_len <= kernels.v1_max_seq_len(head_dim, query.device) and (
                    partitions == 1 or num_seqs * num_heads > 512):
                kernels.paged_attention_v1(out, *common, check_ids=False)
                return
            shape = (num_seqs, num_heads, partitions)
            exp_sums = torch.empty(shape, dtype=torch.float32, device=query.device)
            max_logits = torch.empty_like(exp_sums)
            tmp_out = torch.empty(*shape, head_dim, dtype=query.dtype, device=query.device)
            kernels.paged_attention_v2(out, exp_sums, max_logits, tmp_out, *common, check_ids=False)
        return functools.partial(kernels.reshape_and_cache, check_slots=False), decode

    raise ValueError(f"unknown attention implementation {impl!r}")
