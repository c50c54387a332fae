"""From the block manager's per-sequence block lists to one step's block tables and slot mapping.

The legacy block manager keeps each sequence's physical block ids as a Python list. The kernels
want device tensors: one block-table row per request of the batch and one cache slot per new
token. Two of the project's table classes can build them, selectable with ``block_tables=``:

* ``"v2"``: ``v2.BlockTables`` (``impl="triton"``, or ``"v2-vllm"`` for vLLM's kernels).
  Rows are *request states* that persist across steps: a sequence keeps its row while it runs, and
  only the ids it gained are staged (a copy on write or a swap rewrites the row). Each step the
  staged writes are applied, then one Triton launch gathers the batch's rows and computes every
  token's slot.
* ``"v1"``: ``v1.BlockTable``. Rows are *batch positions*; the slot mapping is computed in numpy
  and copied to the device.

``"auto"`` (the default) is v2 on a GPU and v1 on a CPU: in Triton's interpreter v2's two kernels
cost some 10 to 100 ms a step (the slot kernel pads all ``max_num_batched_tokens`` slots every
time), v1's numpy a fraction of a millisecond. The tokens are the same either way (a test checks).

Both keep a host mirror of what each row holds, so a step writes only what changed.
"""
from __future__ import annotations

import numpy as np
import torch

TABLE_IMPLS = ("auto", "v2", "v2-vllm", "v1")


class _RowMirror:
    """What the host believes each row holds: ``(owner, ids)``. ``needed_write`` says how to bring a row
    to ``ids``: append the new tail (``False``) or rewrite it (``True``), and which ids to write."""

    def __init__(self) -> None:
        self.rows: dict[int, tuple[int, list[int]]] = {}

    def needed_write(self, row: int, owner: int, ids: list[int]) -> tuple[bool, list[int]] | None:
        held = self.rows.get(row)
        self.rows[row] = (owner, list(ids))
        if held is not None and held[0] == owner and len(held[1]) <= len(ids) and ids[:len(held[1])] == held[1]:
            tail = ids[len(held[1]):]
            return (False, tail) if tail else None
        return True, ids

    def forget(self, row: int) -> None:
        self.rows.pop(row, None)


class V2StepTables:
    """Persistent request-state rows in ``v2.BlockTables``; one gather and slot-mapping launch a step."""

    def __init__(self, block_size: int, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 device: torch.device, impl: str = "triton") -> None:
        from paged_attention.v2 import make_block_tables

        self.tables = make_block_tables([block_size], max_num_seqs, max_num_batched_tokens, max_model_len, device,
                                        impl=impl)
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))
        self.row_of: dict[int, int] = {}        # seq id -> request-state row
        self._mirror = _RowMirror()
        self._fused = hasattr(self.tables, "gather_and_compute_slot_mappings")

    def prepare(self, seq_ids: list[int], block_ids: list[list[int]], query_start_loc: torch.Tensor,
                positions: torch.Tensor, host_query_start_loc: list[int], host_positions: list[int],
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(block_tables [num_reqs, width], slot_mapping [num_tokens])`` of this step's batch."""
        rows = []
        for seq_id, ids in zip(seq_ids, block_ids):
            row = self.row_of.get(seq_id)
            if row is None:
                row = self.row_of[seq_id] = self._free_rows.pop()
            rows.append(row)
            write = self._mirror.needed_write(row, seq_id, ids)
            if write is not None:
                overwrite, values = write
                self.tables.append_block_ids(row, (values,), overwrite=overwrite)
        self.tables.apply_staged_writes()
        idx_mapping = torch.tensor(rows, dtype=torch.int32).to(query_start_loc.device, non_blocking=True)
        if self._fused:
            (tables,), slots = self.tables.gather_and_compute_slot_mappings(idx_mapping, query_start_loc, positions,
                                                                           check=False)
        else:
            (tables,) = self.tables.gather_block_tables(idx_mapping, check=False)
            slots = self.tables.compute_slot_mappings(query_start_loc, positions, check=False)
        return tables, slots[0]

    def release(self, seq_id: int) -> None:
        """The sequence stopped running (finished, swapped out, preempted): its row is free."""
        row = self.row_of.pop(seq_id, None)
        if row is not None:
            self._mirror.forget(row)
            self._free_rows.append(row)


class V1StepTables:
    """``v1.BlockTable`` rows by batch position, slots computed in numpy and copied over."""

    def __init__(self, block_size: int, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 device: torch.device) -> None:
        from paged_attention.utils import cdiv
        from paged_attention.v1 import BlockTable

        self.table = BlockTable(block_size, max_num_seqs, cdiv(max_model_len, block_size), max_num_batched_tokens,
                                pin_memory=False, device=device, kernel_block_size=block_size)
        self._mirror = _RowMirror()

    def prepare(self, seq_ids: list[int], block_ids: list[list[int]], query_start_loc: torch.Tensor,
                positions: torch.Tensor, host_query_start_loc: list[int], host_positions: list[int],
                ) -> tuple[torch.Tensor, torch.Tensor]:
        for row, (seq_id, ids) in enumerate(zip(seq_ids, block_ids)):
            write = self._mirror.needed_write(row, seq_id, ids)
            if write is not None:
                overwrite, values = write
                (self.table.add_row if overwrite else self.table.append_row)(values, row)
        num_reqs, num_tokens = len(seq_ids), len(host_positions)
        self.table.commit_block_table(num_reqs)
        # Token t belongs to batch row req_indices[t]: row i repeated once per new token of request i.
        req_indices = np.repeat(np.arange(num_reqs), np.diff(np.asarray(host_query_start_loc)))
        self.table.compute_slot_mapping(req_indices, np.asarray(host_positions))
        self.table.commit_slot_mapping(num_tokens)
        return self.table.get_device_tensor(num_reqs), self.table.slot_mapping.gpu[:num_tokens]

    def release(self, seq_id: int) -> None:
        """Rows are batch positions: the mirror notices a new owner by itself."""


def make_step_tables(impl: str, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                     max_model_len: int, device: torch.device) -> V2StepTables | V1StepTables:
    if impl not in TABLE_IMPLS:
        raise ValueError(f"block_tables must be one of {', '.join(TABLE_IMPLS)}, got {impl!r}")
    if impl == "auto":
        impl = "v2" if device.type == "cuda" else "v1"
    if impl == "v1":
        return V1StepTables(block_size, max_num_seqs, max_num_batched_tokens, max_model_len, device)
    return V2StepTables(block_size, max_num_seqs, max_num_batched_tokens, max_model_len, device,
                        impl="vllm" if impl == "v2-vllm" else "triton")


__all__ = ["TABLE_IMPLS", "V1StepTables", "V2StepTables", "make_step_tables"]
