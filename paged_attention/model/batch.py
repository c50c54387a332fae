"""What one forward step of the model is told about its batch: which tokens belong to which
request, where their keys and values go in the paged cache, and what each request can see.

The engine builds this every step from its block tables (the slot mapping and the rows of the
block table); the model only reads it. Tokens of all requests are packed into one flat batch:
request ``i`` owns tokens ``query_start_loc[i]:query_start_loc[i + 1]``. A request in prefill
contributes its new prompt tokens (after any prefix-cache hit), one in decode contributes one
token. ``seq_lens[i]`` counts every token request ``i`` attends to *after* this step's tokens
are written: its cached prefix plus its new tokens, so the request's first new token sits at
position ``seq_lens[i] - query_lens[i]``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch


@dataclass
class ForwardBatch:
    """One step's batch, every tensor on the model's device."""

    query_start_loc: torch.Tensor   # int32 [num_reqs + 1]: request i's tokens are [q[i], q[i+1])
    seq_lens: torch.Tensor          # int32 [num_reqs]: tokens each request attends to, new ones included
    block_tables: torch.Tensor      # int32 [num_reqs, max_blocks_per_req]: physical block ids
    slot_mapping: torch.Tensor      # int64 [num_tokens]: the cache slot each new token's K/V goes to
    max_query_len: int              # longest run of new tokens (1: a pure decode batch)
    max_seq_len: int                # longest of seq_lens (an upper bound the kernels size work by)
    # The host's copies of query_start_loc and seq_lens, where the caller has them (an engine
    # does): a batch with prefills then reads its layout from them instead of from the device.
    query_start_loc_cpu: Optional[Sequence[int]] = None
    seq_lens_cpu: Optional[Sequence[int]] = None
    # A batch padded to a CUDA graph's shape: requests after the real ones bring no token, and
    # tokens after the last request's belong to none (their slots are PAD_SLOT_ID).
    padded: bool = False

    @property
    def num_reqs(self) -> int:
        return self.seq_lens.numel()

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.numel()

    @property
    def is_decode_only(self) -> bool:
        """Every request brings exactly one new token: the decode kernel serves the whole batch."""
        return self.max_query_len == 1 and self.num_tokens == self.num_reqs
