"""vLLM's model runner v2 block tables, kept on the GPU (``vllm/v1/worker/gpu/block_table.py``).

v1 keeps one batch-ordered table on the host and copies it to the GPU every step. v2 keeps the
tables on the GPU, one row per **request state** (a slot ``req_index`` a request holds for its
whole life), and builds what attention needs with Triton kernels. A step has four parts:

1. **Staging** (host). ``append_block_ids(req_index, new_block_ids, overwrite)`` records the ids
   a request got, one list per KV-cache group, and updates its count in ``num_blocks.np``.
2. **Applying**. ``apply_staged_writes()`` scatters the staged ids into the device tables (one
   launch per group) and publishes the counts with ``num_blocks.copy_to_uva()``: kernels read
   them from pinned host memory.
3. **Gathering** (one launch). ``idx_mapping[b]`` is the request state at batch position ``b``;
   ``gather_block_tables`` copies those rows, in batch order, into ``input_block_tables``.
4. **Slot mapping** (one launch, every group). Token ``t`` of batch position ``b`` at position
   ``p`` goes to ``table[row, p // block_size] * block_size + p % block_size`` in each group's own
   block size; the rest of ``slot_mappings`` gets ``PAD_SLOT_ID`` (-1), so that a CUDA graph
   captured for more tokens writes nothing for its padding.

One launch serves every group through *pointer tables*: uint64 tensors of the groups' data
pointers, which a program turns back into pointers to int32.

``BlockTables`` runs the kernels below, shaped like vLLM's. ``FastBlockTables``
(``block_table_fast``, a subclass) runs ours: the same results with fewer launches and shorter
chains of memory loads. ``paged_attention.v2.make_block_tables(..., impl=)`` picks one by name.

Where vLLM has a bug, both do the sane thing: padding starts at the real token count
``query_start_loc[num_reqs]`` (vLLM's fix in PR #36580); padded gather rows are zeroed over each
group's own width (vLLM uses group 0's, which runs past a narrower group's rows); slots are
computed in 64 bits (int32 block id times block size overflows). Kept as in vLLM: the gather
copies only ``num_blocks`` columns (later ones keep stale ids, which attention never reads), and
an ``overwrite=True`` append of an empty list stages nothing but still sets the count to 0.

Bad input raises before any launch and changes nothing: ``IndexError`` for a request state out of
range, ``ValueError`` for bad values (ids past a row's width, overlapping staged writes, too many
tokens, a malformed ``query_start_loc``), ``TypeError`` for wrong types. Value checks read the
index tensors on the host (one synchronisation on a GPU): ``check=False`` skips them, and so does
a CUDA-graph capture, when values cannot be read.
"""
from __future__ import annotations

import itertools
import operator
from typing import Any, Iterable, Optional, Sequence, Union

import numpy as np
import torch
import triton
import triton.language as tl

from paged_attention.utils import PAD_SLOT_ID, cdiv, check_int, check_int_array, check_int_list, is_int
from paged_attention.v2.buffers import StagedWriteTensor, UvaBackedTensor, check_kernel_device
from paged_attention.v2.common import SlotProgram, capturing, load_ptr

INDEX_DTYPES = (torch.int32, torch.int64)
"""The dtypes accepted for ``idx_mapping``, ``query_start_loc`` and ``positions``."""

_INT32_MAX = int(np.iinfo(np.int32).max)


class BlockTables:
    """The block tables of every KV-cache group, on the device, with vLLM's kernels.

    ``BlockTables(block_sizes, max_num_reqs, max_num_batched_tokens, max_model_len, device)``:
    group ``g`` has blocks of ``block_sizes[g]`` tokens and a table of ``cdiv(max_model_len,
    block_sizes[g])`` columns; rows are request states ``0 .. max_num_reqs-1``; every slot
    mapping has ``max_num_batched_tokens`` entries.

    Attributes as in vLLM: ``block_tables`` (a ``StagedWriteTensor`` per group, rows by request
    state), ``num_blocks`` (``UvaBackedTensor [num_groups, max_num_reqs]``), ``input_block_tables``
    (rows by batch position), ``slot_mappings`` (int64 ``[num_groups, max_num_batched_tokens]``),
    and the pointer, stride and block-size tensors the kernels index by group. The device tables
    must not move: the pointer tables hold their addresses.
    """

    impl = "vllm"
    """The kernel set this class runs (``FastBlockTables``: ``"triton"``)."""

    def __init__(self, block_sizes: Sequence[int], max_num_reqs: int, max_num_batched_tokens: int,
                 max_model_len: int, device: Union[torch.device, str]) -> None:
        if isinstance(block_sizes, (str, bytes)) or not isinstance(block_sizes, (Sequence, np.ndarray)):
            raise TypeError(f"block_sizes must be a list of ints (one per KV-cache group), got {block_sizes!r}")
        if len(block_sizes) == 0:
            raise ValueError("block_sizes must name at least one KV-cache group")
        self.block_sizes = [check_int(f"block_sizes[{i}]", b, minimum=1) for i, b in enumerate(block_sizes)]
        self.max_num_reqs = check_int("max_num_reqs", max_num_reqs, minimum=1)
        self.max_num_batched_tokens = check_int("max_num_batched_tokens", max_num_batched_tokens, minimum=1)
        self.max_model_len = check_int("max_model_len", max_model_len, minimum=1)
        self.device = device
        self._device = check_kernel_device(device, "BlockTables")
        if self._device.type == "cuda" and self._device.index is None:
            self._device = torch.device("cuda", torch.cuda.current_device())
        self._device_id = self._device.index if self._device.type == "cuda" else -1   # Tensor.get_device() there
        self.num_kv_cache_groups = len(self.block_sizes)
        # A request of max_model_len tokens fills cdiv(max_model_len, block_size) blocks.
        self.max_num_blocks_per_group = [cdiv(self.max_model_len, bs) for bs in self.block_sizes]
        self.block_tables: list[StagedWriteTensor] = [
            StagedWriteTensor((self.max_num_reqs, n), dtype=torch.int32, device=self._device)
            for n in self.max_num_blocks_per_group
        ]
        self.num_blocks = UvaBackedTensor((self.num_kv_cache_groups, self.max_num_reqs), dtype=torch.int32)
        self.input_block_tables: list[torch.Tensor] = [torch.zeros_like(b.gpu) for b in self.block_tables]
        self.slot_mappings = torch.zeros(self.num_kv_cache_groups, self.max_num_batched_tokens, dtype=torch.int64,
                                         device=self._device)
        self.init_block_table_layout_tensors()
        # How many real rows the last gather wrote (a slot mapping without idx_mapping reads them).
        self._num_gathered_reqs = 0

    def init_block_table_layout_tensors(self) -> None:
        """Build the pointer, stride and block-size tensors the kernels index by group (again
        after the tables moved, as vLLM does after its memory is re-mapped)."""
        self.block_table_ptrs = self._make_ptr_tensor([b.gpu for b in self.block_tables])
        # The tables are contiguous, so a row's stride is also its width.
        self.block_table_strides = torch.tensor([b.gpu.stride(0) for b in self.block_tables],
                                                dtype=torch.int64, device=self._device)
        self.block_sizes_tensor = torch.tensor(self.block_sizes, dtype=torch.int32, device=self._device)
        self.input_block_table_ptrs = self._make_ptr_tensor(self.input_block_tables)

    def _make_ptr_tensor(self, x: Iterable[torch.Tensor]) -> torch.Tensor:
        # uint64: an address may not fit int64's positive range.
        return torch.tensor([t.data_ptr() for t in x], dtype=torch.uint64, device=self._device)

    # ---- 1. Staging -------------------------------------------------------------------------------
    def append_block_ids(self, req_index: int, new_block_ids: Sequence[Sequence[int]], overwrite: bool) -> None:
        """Stage request state ``req_index``'s new block ids, one list per group.

        ``overwrite=False`` (a running request got blocks): the ids go after its current ones.
        ``overwrite=True`` (a new or re-added request): they replace the row from column 0, and
        the count becomes their number. The count changes now; the device table at
        ``apply_staged_writes``. Every group is checked before any is staged: ids past a row's
        width, or overlapping a write staged since the last apply, raise ValueError.
        """
        req = self._check_req_index(req_index)
        if not isinstance(overwrite, (bool, np.bool_)):
            raise TypeError(f"overwrite must be a bool, got {overwrite!r}")
        if isinstance(new_block_ids, (str, bytes)) or not isinstance(new_block_ids, (tuple, list)):
            raise TypeError(f"new_block_ids must be a tuple with one list of ids per KV-cache group, "
                            f"got {new_block_ids!r}")
        if len(new_block_ids) != self.num_kv_cache_groups:
            raise ValueError(f"new_block_ids has {len(new_block_ids)} lists but there are "
                             f"{self.num_kv_cache_groups} KV-cache groups")
        writes = [self._checked_write(g, req, ids, overwrite) for g, ids in enumerate(new_block_ids)]
        for g, (start, values) in enumerate(writes):    # everything checked: stage and count
            if values:
                self.block_tables[g]._stage(req, start, values)
            self.num_blocks.np[g, req] = start + len(values)

    def append_block_ids_batch(self, req_indices: Union[Sequence[int], np.ndarray],
                               new_block_ids: Sequence[Sequence[Sequence[int]]], overwrite: bool) -> None:
        """``append_block_ids(req_indices[i], new_block_ids[i], overwrite)`` for every ``i`` in
        order, as one operation: the same ids staged and the same counts. For bad input it
        raises what the first bad entry raises one by one, and then nothing of the batch is
        staged or counted (the entries before it included).

        A step where many requests gain a block (every ``block_size`` tokens in lockstep) costs
        one check over the batch instead of one call per request. Anything that check does not
        pass at a glance (a row twice, a row with writes staged already, ids that are not lists
        of plain ints, a row that would overflow...) goes entry by entry through
        ``append_block_ids`` itself, undone if an entry fails: its checks are the only rules.
        """
        if isinstance(req_indices, (str, bytes)) or not isinstance(req_indices, (list, tuple, range, np.ndarray)):
            raise TypeError(f"req_indices must be a list or 1-D array of request states, got {req_indices!r}")
        if isinstance(new_block_ids, (str, bytes)) or not isinstance(new_block_ids, (list, tuple)):
            raise TypeError(f"new_block_ids must be a list with one entry per request state, got {new_block_ids!r}")
        if len(req_indices) != len(new_block_ids):
            raise ValueError(f"req_indices has {len(req_indices)} entries but new_block_ids has {len(new_block_ids)}")
        if not self._stage_plain_batch(req_indices, new_block_ids, overwrite):
            self._append_each(req_indices, new_block_ids, overwrite)

    def _stage_plain_batch(self, req_indices: Union[Sequence[int], np.ndarray], new_block_ids: Sequence,
                           overwrite: bool) -> bool:
        """The batch checked as a whole (per group, not per request) for what passes
        ``append_block_ids``' checks at a glance: lists of plain ints within int32, in distinct
        rows with nothing staged since the last apply (so nothing to overlap), that fit their
        rows, under the limit of staged writes; then staged. False, with nothing staged, for
        any other batch."""
        n = len(new_block_ids)
        if type(overwrite) is not bool:
            return False
        if n == 0:
            return True
        if isinstance(req_indices, np.ndarray):
            if req_indices.ndim != 1 or req_indices.dtype.kind not in "iu":
                return False
            rows = req_indices.astype(np.int64)
        elif operator.countOf(map(type, req_indices), int) == n:
            rows = np.fromiter(req_indices, dtype=np.int64, count=n)
        else:
            return False
        num_groups = self.num_kv_cache_groups
        if (int(rows.min()) < 0 or int(rows.max()) >= self.max_num_reqs
                or operator.countOf(map(type, new_block_ids), tuple) != n
                or operator.countOf(map(len, new_block_ids), num_groups) != n):
            return False
        row_list = rows.tolist()
        if len(set(row_list)) != n:
            return False                   # a row twice: its second write starts where the first ends
        counts = self.num_blocks.np
        plans = []
        for g in range(num_groups):        # every group passes before any is staged
            table = self.block_tables[g]
            lists = [ids[g] for ids in new_block_ids]
            if operator.countOf(map(type, lists), list) != n:
                return False
            flat = list(itertools.chain.from_iterable(lists))
            if not _plain_ids(flat) or not table._staged_ranges.keys().isdisjoint(row_list):
                return False
            lens = np.fromiter(map(len, lists), dtype=np.int64, count=n)
            starts = np.zeros(n, dtype=np.int64) if overwrite else counts[g, rows].astype(np.int64)
            ends = starts + lens
            written = lens > 0
            if (int(ends.max()) > self.max_num_blocks_per_group[g]
                    or table.num_staged_writes + int(written.sum()) > table.num_rows):
                return False
            plans.append((rows[written].tolist(), starts[written].tolist(), flat, lens[written], ends))
        for g, (indices, starts, flat, lens, ends) in enumerate(plans):
            if indices:
                self.block_tables[g]._stage_many(indices, starts, flat, lens)
            counts[g, rows] = ends
        return True

    def _append_each(self, req_indices: Union[Sequence[int], np.ndarray], new_block_ids: Sequence,
                     overwrite: bool) -> None:
        """The batch one entry at a time; if one raises, the counts and staged writes go back to
        what they were before the batch, and its error propagates."""
        counts = self.num_blocks.np.copy()
        marks = [table.staged_mark() for table in self.block_tables]
        try:
            for req, ids in zip(req_indices, new_block_ids):
                self.append_block_ids(req, ids, overwrite)
        except BaseException:
            self.num_blocks.np[...] = counts
            for table, mark in zip(self.block_tables, marks):
                table.rollback_staged(mark)
            raise

    def _checked_write(self, g: int, req: int, ids: Any, overwrite: bool) -> tuple[int, list]:
        """``(start column, ids)`` of group ``g``'s write, checked; nothing is staged here."""
        table = self.block_tables[g]
        # A list of plain ints (the scheduler's) is counted in C and taken as it is; anything
        # else goes through as_values, which checks each value and makes that list.
        values = ids if type(ids) is list and operator.countOf(map(type, ids), int) == len(ids) \
            else table.as_values(ids)
        if values and (min(values) < 0 or max(values) > _INT32_MAX):
            raise ValueError(f"block ids must be between 0 and {_INT32_MAX} (int32), got "
                             f"{min(values)} .. {max(values)} for group {g}")
        start = 0 if overwrite else int(self.num_blocks.np[g, req])
        end = start + len(values)
        width = self.max_num_blocks_per_group[g]
        if end > width:
            raise ValueError(f"request state {req} would hold {end} blocks in group {g} ({start} + {len(values)}), "
                             f"but its table has {width} columns: cdiv(max_model_len={self.max_model_len}, "
                             f"block_size={self.block_sizes[g]}); that is past max_model_len")
        # (Only a row with writes staged since the last apply can overlap one: most have none.)
        earlier = table.overlaps_staged(req, start, end) if values and req in table._staged_ranges else None
        if earlier is not None:
            raise ValueError(f"columns {start}..{end - 1} of request state {req} in group {g} overlap columns "
                             f"{earlier[0]}..{earlier[1] - 1} staged earlier in this step; staged writes are "
                             f"unordered, so call apply_staged_writes() in between")
        if values and table.num_staged_writes >= table.num_rows:
            raise ValueError(f"group {g} has {table.num_rows} staged writes already (max_num_reqs): "
                             f"call apply_staged_writes() first")
        return start, values

    # ---- 2. Applying ------------------------------------------------------------------------------
    def apply_staged_writes(self) -> None:
        """Write every staged id into the device tables, one launch per group (vLLM marks this
        with a TODO: one launch could do all groups), then publish the counts."""
        for block_table in self.block_tables:
            block_table.apply_write()
        self.num_blocks.copy_to_uva()

    # ---- 3. Gathering -----------------------------------------------------------------------------
    def gather_block_tables(self, idx_mapping: torch.Tensor, num_reqs_padded: Optional[int] = None, *,
                            check: bool = True) -> tuple[torch.Tensor, ...]:
        """Copy the rows of the batch's request states, in batch order, into
        ``input_block_tables``; return each group's first ``num_reqs_padded`` rows.

        Row ``b`` gets the first ``num_blocks`` columns of request state ``idx_mapping[b]``.
        ``num_reqs_padded`` (vLLM's later keyword; default ``len(idx_mapping)``) adds zero rows,
        for a CUDA graph captured for a bigger batch. The counts are read through
        ``num_blocks.gpu``, which every ``copy_to_uva`` re-binds: a gather captured in a CUDA
        graph would keep reading the capture's counts (vLLM runs it outside graphs).
        """
        num_reqs, num_reqs_padded = self._check_gather(idx_mapping, num_reqs_padded, check)
        if num_reqs_padded > 0:
            num_blocks = self.num_blocks.gpu
            _gather_block_tables_kernel[(self.num_kv_cache_groups, num_reqs_padded)](
                batch_idx_to_req_idx=idx_mapping, src_block_table_ptrs=self.block_table_ptrs,
                dst_block_table_ptrs=self.input_block_table_ptrs, block_table_strides=self.block_table_strides,
                num_blocks_ptr=num_blocks, num_blocks_stride=num_blocks.stride(0), num_reqs=num_reqs,
                BLOCK_SIZE=1024,
            )
        return self._gathered(num_reqs, num_reqs_padded)

    def _gathered(self, num_reqs: int, num_reqs_padded: int) -> tuple[torch.Tensor, ...]:
        self._num_gathered_reqs = num_reqs
        return tuple(block_table[:num_reqs_padded] for block_table in self.input_block_tables)

    def get_dummy_block_tables(self, num_reqs: int) -> tuple[torch.Tensor, ...]:
        """The first ``num_reqs`` rows of each input table, unchanged (the same tensors every
        time: for dummy runs and CUDA-graph capture)."""
        num_reqs = check_int("num_reqs", num_reqs, 0, self.max_num_reqs, max_name="max_num_reqs")
        return tuple(block_table[:num_reqs] for block_table in self.input_block_tables)

    # ---- 4. Slot mappings -------------------------------------------------------------------------
    def compute_slot_mappings(self, query_start_loc: torch.Tensor, positions: torch.Tensor, *,
                              idx_mapping: Optional[torch.Tensor] = None, num_tokens_padded: Optional[int] = None,
                              check: bool = True) -> torch.Tensor:
        """Every scheduled token's slot, in every group: ``slot_mappings[:, :num_tokens_padded]``.

        Batch position ``b`` owns tokens ``query_start_loc[b] .. query_start_loc[b+1]-1``, and
        ``positions[t]`` is token ``t``'s position in its sequence. The rows are read from the
        gathered ``input_block_tables`` (gather first), or, with ``idx_mapping=`` (vLLM's later
        form), from the persistent tables through it. ``num_tokens_padded`` defaults to
        ``len(positions)``. A position in a column the request was never given reads whatever id
        is there, as in vLLM: the scheduler only schedules tokens a request has blocks for.
        """
        num_reqs, _, num_tokens_padded = self._check_slot_mappings(query_start_loc, positions, idx_mapping,
                                                                   num_tokens_padded, check)
        has_idx = idx_mapping is not None
        _compute_slot_mappings_kernel[(self.num_kv_cache_groups, num_reqs + 1)](
            max_num_tokens=self.max_num_batched_tokens,
            idx_mapping=idx_mapping if has_idx else query_start_loc,     # not read without idx_mapping
            cu_num_tokens=query_start_loc, pos=positions,
            block_table_ptrs=self.block_table_ptrs if has_idx else self.input_block_table_ptrs,
            block_table_strides=self.block_table_strides, page_sizes=self.block_sizes_tensor,
            slot_mappings_ptr=self.slot_mappings, slot_mappings_stride=self.slot_mappings.stride(0),
            PAD_ID=PAD_SLOT_ID, HAS_IDX_MAPPING=has_idx, BLOCK_SIZE=1024,
        )
        return self.slot_mappings[:, :num_tokens_padded]

    def get_dummy_slot_mappings(self, num_tokens: int) -> torch.Tensor:
        """Fill **all** of ``slot_mappings`` with ``PAD_SLOT_ID`` and return its first
        ``num_tokens`` columns (dummy runs: every cache write is skipped)."""
        num_tokens = check_int("num_tokens", num_tokens, 0, self.max_num_batched_tokens,
                               max_name="max_num_batched_tokens")
        self.slot_mappings.fill_(PAD_SLOT_ID)
        return self.slot_mappings[:, :num_tokens]

    # ---- Checks (vLLM has none) ----------------------------------------------------------------
    def _check_req_index(self, req_index: Any) -> int:
        if not is_int(req_index):
            raise TypeError(f"req_index must be an int, got {req_index!r}")
        if not 0 <= req_index < self.max_num_reqs:
            raise IndexError(f"req_index={req_index} names no request state: they are 0..{self.max_num_reqs - 1}")
        return int(req_index)

    def _check_tensor(self, name: str, t: Any) -> torch.Tensor:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in INDEX_DTYPES:
            raise TypeError(f"{name} must be int32 or int64, got {str(t.dtype).replace('torch.', '')}")
        if t.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
        if t.get_device() != self._device_id:
            raise ValueError(f"{name} must be on {self._device} (where the tables are), got {t.device}")
        if t.numel() > 1 and t.stride(0) != 1:
            raise ValueError(f"{name} must be contiguous, got stride {t.stride(0)}")
        return t

    def _check_gather(self, idx_mapping: Any, num_reqs_padded: Optional[int], check: bool) -> tuple[int, int]:
        """``(num_reqs, num_reqs_padded)`` of a gather, checked."""
        self._check_tensor("idx_mapping", idx_mapping)
        num_reqs = int(idx_mapping.shape[0])
        if num_reqs > self.max_num_reqs:
            raise ValueError(f"idx_mapping has {num_reqs} entries, more than max_num_reqs={self.max_num_reqs}")
        if check and num_reqs and not capturing(self._device):
            values = idx_mapping.cpu().numpy()
            bad = np.flatnonzero((values < 0) | (values >= self.max_num_reqs))
            if bad.size:
                b = int(bad[0])
                raise IndexError(f"idx_mapping[{b}] = {int(values[b])} names no request state: they are "
                                 f"0..{self.max_num_reqs - 1}")
        padded = check_int("num_reqs_padded", num_reqs if num_reqs_padded is None else num_reqs_padded,
                           minimum=num_reqs)
        if padded > self.max_num_reqs:
            raise ValueError(f"num_reqs_padded={padded} is more than max_num_reqs={self.max_num_reqs}")
        return num_reqs, padded

    def _check_slot_mappings(self, query_start_loc: Any, positions: Any, idx_mapping: Optional[torch.Tensor],
                             num_tokens_padded: Optional[int], check: bool) -> tuple[int, int, int]:
        """``(num_reqs, num_tokens, num_tokens_padded)`` of a slot mapping, checked."""
        self._check_tensor("query_start_loc", query_start_loc)
        self._check_tensor("positions", positions)
        num_reqs, num_tokens = query_start_loc.shape[0] - 1, positions.shape[0]
        if num_reqs < 0:
            raise ValueError("query_start_loc needs num_reqs + 1 >= 1 entries, got none")
        if num_reqs > self.max_num_reqs:
            raise ValueError(f"query_start_loc describes {num_reqs} requests, more than max_num_reqs="
                             f"{self.max_num_reqs}")
        if num_tokens > self.max_num_batched_tokens:
            raise ValueError(f"{num_tokens} positions are more than max_num_batched_tokens="
                             f"{self.max_num_batched_tokens}")
        if idx_mapping is not None:
            n, _ = self._check_gather(idx_mapping, None, check)
            if n != num_reqs:
                raise ValueError(f"idx_mapping has {n} entries but query_start_loc describes {num_reqs} requests")
        num_tokens_padded = check_int("num_tokens_padded", num_tokens if num_tokens_padded is None else num_tokens_padded,
                                      0, self.max_num_batched_tokens, max_name="max_num_batched_tokens")
        if check and not capturing(self._device):
            self._check_slot_values(query_start_loc, positions, num_reqs, num_tokens, idx_mapping is not None)
        return num_reqs, num_tokens, num_tokens_padded

    def _check_slot_values(self, query_start_loc: torch.Tensor, positions: torch.Tensor, num_reqs: int,
                           num_tokens: int, has_idx: bool) -> None:
        qsl = query_start_loc.cpu().numpy().astype(np.int64)
        if qsl[0] != 0 or np.any(np.diff(qsl) < 0) or qsl[-1] > num_tokens:
            items = qsl.tolist()
            shown = str(items) if len(items) <= 12 else f"{items[:12]}... ({len(items)} entries)"
            raise ValueError(f"query_start_loc must rise from 0 to at most the {num_tokens} positions given "
                             f"(and at most max_num_batched_tokens={self.max_num_batched_tokens}), got {shown}")
        if not has_idx and num_reqs > self._num_gathered_reqs:
            raise ValueError(f"compute_slot_mappings reads rows 0..{num_reqs - 1} of the gathered tables, but the "
                             f"last gather_block_tables wrote {self._num_gathered_reqs}: gather this batch "
                             f"first, or pass idx_mapping=")
        if qsl[-1] == 0:
            return
        pos = positions[:int(qsl[-1])].cpu().numpy()
        if pos.min() < 0:
            raise ValueError(f"positions must be >= 0, got {int(pos.min())}")
        top = int(pos.max())
        for g, (bs, width) in enumerate(zip(self.block_sizes, self.max_num_blocks_per_group)):
            if top // bs >= width:
                raise ValueError(f"position {top} needs block column {top // bs} of group {g}, but its table has "
                                 f"{width} columns (cdiv(max_model_len={self.max_model_len}, block_size={bs})): "
                                 f"past max_model_len")

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(block_sizes={self.block_sizes}, max_num_reqs={self.max_num_reqs}, "
                f"max_num_batched_tokens={self.max_num_batched_tokens}, max_model_len={self.max_model_len})")


def _plain_ids(ids: Any) -> bool:
    """Whether ``ids`` is a list of plain ints within int32: block ids that pass every value
    check as they are (the scheduler's; counted in C, not checked one by one)."""
    return (type(ids) is list and operator.countOf(map(type, ids), int) == len(ids)
            and (not ids or (min(ids) >= 0 and max(ids) <= _INT32_MAX)))


# ---- The slot-mapping grid, as a list -------------------------------------------------------------
def vllm_slot_programs(query_start_loc: Sequence[int], max_num_tokens: int, num_groups: int) -> list[SlotProgram]:
    """The programs of ``_compute_slot_mappings_kernel``, grid ``(num_groups, num_reqs + 1)``:
    ``(g, b)`` writes request ``b``'s slots in group ``g``; ``(g, num_reqs)`` pads the rest."""
    max_num_tokens = check_int("max_num_tokens", max_num_tokens, minimum=1)
    num_groups = check_int("num_groups", num_groups, minimum=1)
    qsl = list(query_start_loc.tolist() if hasattr(query_start_loc, "tolist") else query_start_loc)
    if not all(is_int(x) for x in qsl):
        raise TypeError(f"query_start_loc must hold ints, got {qsl}")
    if not qsl or qsl[0] != 0 or any(b < a for a, b in zip(qsl, qsl[1:])) or qsl[-1] > max_num_tokens:
        raise ValueError(f"query_start_loc must rise from 0 to at most max_num_tokens={max_num_tokens}, got {qsl}")
    num_reqs = len(qsl) - 1
    programs = []
    for g in range(num_groups):
        programs += [SlotProgram((g, b), g, qsl[b], qsl[b + 1], "request") for b in range(num_reqs)]
        programs.append(SlotProgram((g, num_reqs), g, qsl[-1], max_num_tokens, "padding"))
    return programs


# ---- The gather's result, cell by cell --------------------------------------------------------------
def gather_kinds(num_blocks: Any, idx_mapping: Any, gathered: Any) -> list[list[str]]:
    """What each cell of the gathered (batch-ordered) table is, row by row:

    * ``"copied"``: column ``< num_blocks[idx_mapping[b]]``: copied from the request's row now;
    * ``"stale"``: past that count but not zero: left from an earlier step (the gather copies
      only ``num_blocks`` columns, as vLLM does: attention never reads them);
    * ``"empty"``: past the count and zero;
    * ``"padding"``: a row ``b >= len(idx_mapping)`` (``num_reqs_padded``), zeroed.
    """
    counts = check_int_list("num_blocks", num_blocks)
    idx = check_int_list("idx_mapping", idx_mapping)
    table = check_int_array("gathered", gathered, 2)
    if len(idx) > table.shape[0]:
        raise ValueError(f"idx_mapping has {len(idx)} entries but gathered has {table.shape[0]} rows")
    for b, s in enumerate(idx):
        if not 0 <= s < len(counts):
            raise IndexError(f"idx_mapping[{b}] = {s} names no request state (0..{len(counts) - 1})")
    kinds = []
    for b, row in enumerate(table.tolist()):
        if b >= len(idx):
            kinds.append(["padding"] * len(row))
            continue
        n = counts[idx[b]]
        kinds.append(["copied" if c < n else "stale" if v != 0 else "empty" for c, v in enumerate(row)])
    return kinds


# ---- Kernels --------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["num_reqs"])
def _gather_block_tables_kernel(
    batch_idx_to_req_idx,     # [num_reqs]: the request state of each batch position
    src_block_table_ptrs,     # uint64 [num_groups]: persistent tables, rows by request state
    dst_block_table_ptrs,     # uint64 [num_groups]: input tables, rows by batch position
    block_table_strides,      # int64 [num_groups]: row stride (= width) of both
    num_blocks_ptr,           # int32 [num_groups, max_num_reqs]: block counts (UVA)
    num_blocks_stride,
    num_reqs,                 # real batch rows; rows from here to the grid's end are padding
    BLOCK_SIZE: tl.constexpr,
):
    # One program per (group, batch position).
    group_id = tl.program_id(0)
    batch_idx = tl.program_id(1)
    stride = tl.load(block_table_strides + group_id)
    dst_row_ptr = load_ptr(dst_block_table_ptrs + group_id, tl.int32) + batch_idx * stride
    if batch_idx >= num_reqs:
        # A padded row: zeroed over this group's own width.
        for i in range(0, stride, BLOCK_SIZE):
            offset = i + tl.arange(0, BLOCK_SIZE)
            tl.store(dst_row_ptr + offset, tl.zeros([BLOCK_SIZE], tl.int32), mask=offset < stride)
        return
    req_idx = tl.load(batch_idx_to_req_idx + batch_idx)
    # num_blocks[group_id, req_idx]: how many columns of that request's row are real.
    num_blocks = tl.load(num_blocks_ptr + group_id * num_blocks_stride + req_idx)
    src_row_ptr = load_ptr(src_block_table_ptrs + group_id, tl.int32) + req_idx * stride
    for i in tl.range(0, num_blocks, BLOCK_SIZE):
        offset = i + tl.arange(0, BLOCK_SIZE)
        block_ids = tl.load(src_row_ptr + offset, mask=offset < num_blocks)
        tl.store(dst_row_ptr + offset, block_ids, mask=offset < num_blocks)


@triton.jit
def _compute_slot_mappings_kernel(
    max_num_tokens,           # the slot mappings' length (max_num_batched_tokens)
    idx_mapping,              # [num_reqs] request state per batch position (HAS_IDX_MAPPING)
    cu_num_tokens,            # [num_reqs + 1] query_start_loc
    pos,                      # [num_tokens] positions
    block_table_ptrs,         # uint64 [num_groups]: input tables, or persistent ones with idx_mapping
    block_table_strides,      # int64 [num_groups]
    page_sizes,               # int32 [num_groups]: block sizes
    slot_mappings_ptr,        # int64 [num_groups, max_num_tokens]
    slot_mappings_stride,
    PAD_ID: tl.constexpr,
    HAS_IDX_MAPPING: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    # Program (group, request), and one more per group that pads.
    group_id = tl.program_id(0)
    req_idx = tl.program_id(1)
    slot_mapping_ptr = slot_mappings_ptr + group_id * slot_mappings_stride   # this group's row

    if req_idx == tl.num_programs(1) - 1:
        # req_idx == num_reqs: pad from the real token count query_start_loc[num_reqs] to the end.
        num_tokens = tl.load(cu_num_tokens + req_idx)
        for i in range(num_tokens, max_num_tokens, BLOCK_SIZE):
            offset = i + tl.arange(0, BLOCK_SIZE)
            tl.store(slot_mapping_ptr + offset, PAD_ID, mask=offset < max_num_tokens)
        return

    block_table_ptr = load_ptr(block_table_ptrs + group_id, tl.int32)
    block_table_stride = tl.load(block_table_strides + group_id)
    page_size = tl.load(page_sizes + group_id)
    if HAS_IDX_MAPPING:
        row = tl.load(idx_mapping + req_idx)      # persistent table: row of the request state
    else:
        row = req_idx                             # gathered table: row of the batch position

    # This request's tokens are cu_num_tokens[req_idx] .. cu_num_tokens[req_idx + 1] - 1.
    start_idx = tl.load(cu_num_tokens + req_idx)
    end_idx = tl.load(cu_num_tokens + req_idx + 1)
    for i in range(start_idx, end_idx, BLOCK_SIZE):
        offset = i + tl.arange(0, BLOCK_SIZE)
        mask = offset < end_idx
        positions = tl.load(pos + offset, mask=mask, other=0)
        # Column of the block holding each position, and the position's offset inside it.
        block_indices = positions // page_size
        block_numbers = tl.load(block_table_ptr + row * block_table_stride + block_indices, mask=mask, other=0)
        # slot = block id * block size + offset, in 64 bits (an int32 product would overflow).
        slot_ids = block_numbers.to(tl.int64) * page_size + positions % page_size
        tl.store(slot_mapping_ptr + offset, slot_ids, mask=mask)
