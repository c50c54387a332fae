"""The model runner's block tables: one row per request state, kept across steps.

A request holds a row (a *request state*, ``req_index``) from the step it is added until it
finishes or is preempted; the runner writes only the block ids the scheduler says it gained.
Each step the rows of the batch's requests are gathered, in batch order, into the block table the
kernels read, and every scheduled token's cache slot is computed. Two of the project's table
classes can do it (``block_tables=``):

* ``"v2"``: ``v2.BlockTables`` (``"v2-vllm"`` for the kernels shaped like vLLM's): the rows live
  on the device; new ids are staged on the host and applied with one launch, and one more launch
  gathers the batch's rows and computes the slots (``gather_and_compute_slot_mappings``).
* ``"v1"``: ``v1.BlockTable`` with its rows used as request states: slots computed in numpy, the
  rows copied to the device and gathered there with one indexing operation.

``"auto"`` is v2 on a GPU and v1 on a CPU: in Triton's interpreter v2's kernels cost 10 to 100 ms
a step (the slot kernel pads all ``max_num_batched_tokens`` slots every time), v1's numpy a small
fraction of that. The tokens are the same either way (a test checks).

Both give a padded batch for a CUDA graph: ``num_reqs_padded`` rows (zeros after the real ones)
and ``num_tokens_padded`` slots (``PAD_SLOT_ID`` after the real ones), in buffers whose addresses
never change, so a graph captured on them reads each step's values.
"""
from __future__ import annotations

import numpy as np
import torch

from paged_attention.utils import PAD_SLOT_ID, cdiv

TABLE_IMPLS = ("auto", "v2", "v2-vllm", "v1")


class V2StepTables:
    """Request-state rows in ``v2.BlockTables``, on the device."""

    def __init__(self, block_size: int, max_num_reqs: int, max_num_batched_tokens: int, max_model_len: int,
                 device: torch.device, impl: str = "triton") -> None:
        from paged_attention.v2 import make_block_tables

        self.tables = make_block_tables([block_size], max_num_reqs, max_num_batched_tokens, max_model_len, device,
                                        impl=impl)
        self._fused = hasattr(self.tables, "gather_and_compute_slot_mappings")
        # Whether a decode step's gather can be captured in its CUDA graph (``gather_padded``).
        self.captures_gather = self._fused

    def set_row(self, row: int, block_ids: list[int], overwrite: bool) -> None:
        """Row ``row`` gets ``block_ids`` after its current ids, or instead of them (``overwrite``)."""
        self.tables.append_block_ids(row, (block_ids,), overwrite=overwrite)

    def set_rows(self, rows: np.ndarray, block_ids: list[list[int]], overwrite: bool) -> None:
        """``set_row(rows[i], block_ids[i], overwrite)`` for every ``i``, as one batch: checked
        as a whole, so that a step where every request gains a block, or a step of many new
        requests, costs one call, and either all rows change or (an error) none. One row goes
        through ``append_block_ids`` (the batch's own rule for it, without the batch's fixed cost
        of some 20 us: a decode step that admits one request)."""
        if len(block_ids) == 1:
            self.set_row(int(rows[0]), block_ids[0], overwrite)
        else:
            self.tables.append_block_ids_batch(rows, [(ids,) for ids in block_ids], overwrite=overwrite)

    def apply_staged(self) -> None:
        """Apply the block ids staged since the last step (nothing to launch when none were)."""
        self.tables.apply_staged_writes()

    def gather_padded(self, idx_mapping: torch.Tensor, query_start_loc: torch.Tensor, positions: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """``prepare``'s gather for a batch given padded (``captures_gather``), one launch that reads
        only device memory, so that a decode step's CUDA graph can hold it: ``idx_mapping`` has a
        row per padded request (the padding ones out of the tables' range: their gathered rows
        are left as they were, and read one key), ``query_start_loc`` rises to the real token
        count and stays there (padding requests bring no token: their slots are ``PAD_SLOT_ID``).
        The staged block ids must have been applied (``apply_staged``)."""
        (tables,), slots = self.tables.gather_and_compute_slot_mappings(
            idx_mapping, query_start_loc, positions, num_reqs_padded=idx_mapping.numel(),
            num_tokens_padded=positions.numel(), check=False)
        return tables, slots[0]

    def reset(self) -> None:
        """Drop writes staged but not applied (a step that failed half-way)."""
        for table in self.tables.block_tables:
            table.clear_staged_writes()

    def prepare(self, idx_mapping: torch.Tensor, query_start_loc: torch.Tensor, positions: torch.Tensor,
                token_rows_np: np.ndarray, positions_np: np.ndarray, num_reqs_padded: int,
                num_tokens_padded: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(block_tables [num_reqs_padded, width], slot_mapping [num_tokens_padded])`` of this step:
        batch position ``b`` is request state ``idx_mapping[b]``, token ``t`` belongs to row
        ``token_rows_np[t]`` at position ``positions[t]`` (the host arrays copy the device ones)."""
        self.tables.apply_staged_writes()
        if self._fused:
            (tables,), slots = self.tables.gather_and_compute_slot_mappings(
                idx_mapping, query_start_loc, positions, num_reqs_padded=num_reqs_padded,
                num_tokens_padded=num_tokens_padded, check=False)
        else:
            (tables,) = self.tables.gather_block_tables(idx_mapping, num_reqs_padded, check=False)
            slots = self.tables.compute_slot_mappings(query_start_loc, positions,
                                                      num_tokens_padded=num_tokens_padded, check=False)
        return tables, slots[0]


class V1StepTables:
    """``v1.BlockTable`` rows as request states: numpy slots, a device gather of the rows."""

    def __init__(self, block_size: int, max_num_reqs: int, max_num_batched_tokens: int, max_model_len: int,
                 device: torch.device) -> None:
        from paged_attention.v1 import BlockTable

        self.table = BlockTable(block_size, max_num_reqs, cdiv(max_model_len, block_size), max_num_batched_tokens,
                                pin_memory=False, device=device, kernel_block_size=block_size)
        width = self.table.max_num_blocks_per_req
        self._batch_tables = torch.zeros(max_num_reqs, width, dtype=torch.int32, device=device)
        self._slots = torch.full((max_num_batched_tokens,), PAD_SLOT_ID, dtype=torch.int64, device=device)
        self._rows_used = 0          # rows 0 .. _rows_used-1 may hold ids: what a commit copies
        self.captures_gather = False  # the rows are committed from the host every step

    def set_row(self, row: int, block_ids: list[int], overwrite: bool) -> None:
        (self.table.add_row if overwrite else self.table.append_row)(block_ids, row)
        self._rows_used = max(self._rows_used, row + 1)

    def set_rows(self, rows: np.ndarray, block_ids: list[list[int]], overwrite: bool) -> None:
        """``set_row(rows[i], block_ids[i], overwrite)`` for every ``i``, one by one (a row
        written before an error stays written)."""
        for row, ids in zip(rows.tolist(), block_ids):
            self.set_row(row, ids, overwrite=overwrite)

    def reset(self) -> None:
        """Nothing is staged here: rows are written on the host at once."""

    def prepare(self, idx_mapping: torch.Tensor, query_start_loc: torch.Tensor, positions: torch.Tensor,
                token_rows_np: np.ndarray, positions_np: np.ndarray, num_reqs_padded: int,
                num_tokens_padded: int) -> tuple[torch.Tensor, torch.Tensor]:
        n, t = idx_mapping.numel(), len(positions_np)
        self.table.commit_block_table(self._rows_used)
        tables = self._batch_tables[:num_reqs_padded]
        torch.index_select(self.table.block_table.gpu, 0, idx_mapping.long(), out=tables[:n])
        tables[n:].zero_()
        self.table.compute_slot_mapping(token_rows_np, positions_np)
        self.table.commit_slot_mapping(t)
        slots = self._slots[:num_tokens_padded]
        slots[:t].copy_(self.table.slot_mapping.gpu[:t])
        slots[t:].fill_(PAD_SLOT_ID)
        return tables, slots


def make_step_tables(impl: str, block_size: int, max_num_reqs: int, max_num_batched_tokens: int,
                     max_model_len: int, device: torch.device) -> V2StepTables | V1StepTables:
    if impl not in TABLE_IMPLS:
        raise ValueError(f"block_tables must be one of {', '.join(TABLE_IMPLS)}, got {impl!r}")
    if impl == "auto":
        impl = "v2" if device.type == "cuda" else "v1"
    if impl == "v1":
        return V1StepTables(block_size, max_num_reqs, max_num_batched_tokens, max_model_len, device)
    return V2StepTables(block_size, max_num_reqs, max_num_batched_tokens, max_model_len, device,
                        impl="vllm" if impl == "v2-vllm" else "triton")


__all__ = ["TABLE_IMPLS", "V1StepTables", "V2StepTables", "make_step_tables"]
