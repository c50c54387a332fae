"""vLLM's model runner v2 block tables (spec §3.3-§3.5, ``vllm/v1/worker/gpu/block_table.py``).

v1 keeps one batch-ordered table on the host and copies it to the GPU every step. v2 keeps the
tables on the GPU, one row per **request state** (a slot ``req_index`` a request holds for its
whole life), and builds what attention needs with Triton kernels:

1. **Staging** (host). ``append_block_ids(req_index, new_block_ids, overwrite)`` records the ids
   a request got this step, one list per KV-cache group, and updates its block count in
   ``num_blocks.np`` at once. Nothing reaches the GPU yet.
2. **Applying** (one launch; one per group with the seed's kernels). ``apply_staged_writes()``
   scatters every staged id into the device tables and publishes the counts (``num_blocks.copy_to_uva()``: GPU kernels read them from
   pinned host memory).
3. **Gathering** (one launch). The scheduler's batch lists request states in batch order:
   ``idx_mapping[b]`` is the request state of batch position ``b``. ``gather_block_tables``
   copies those rows, in that order, into ``input_block_tables``: the batch-ordered tables the
   attention kernels read.
4. **Slot mapping** (one launch, every group). Token ``t`` of batch position ``b`` (the tokens of
   ``b`` are ``query_start_loc[b] .. query_start_loc[b+1]-1``) at sequence position ``p`` goes to

       slot = table[row, p // block_size] * block_size + p % block_size

   in each group's own block size; the tail of ``slot_mappings`` (up to
   ``max_num_batched_tokens``) is filled with ``PAD_SLOT_ID`` (-1) so that a CUDA graph captured
   for more tokens writes nothing for its padding.

Every group has its own block size, so its own table width ``cdiv(max_model_len, block_size)``
and its own slots; one kernel launch serves all groups through *pointer tables*: a uint64 tensor
of the groups' data pointers, which a program turns back into a pointer to int32.

Two implementations of each kernel, selected with ``impl=`` (constructor or per call):

* ``"seed"``: the kernels' structure as in the seed (vLLM, 2026-04): one program per (group,
  batch row) for the gather, one per (group, request) plus a last one that pads for the slot
  mapping, one launch *per group* for the staged writes.
* ``"fast"`` (default): the staged writes of all groups in one launch, several writes per
  program, with the same launch copying the just-published counts into device memory; the
  gather with several rows per program, reading those counts from device memory rather than
  over the bus; the slot mapping token-parallel (each program takes a tile of tokens, loads all
  of ``query_start_loc`` at once, finds each token's request by binary search in it, and does
  every group), so a pure-decode batch of 1024 one-token requests needs a few programs, each
  with a short chain of dependent memory loads, not 2049 programs.

These kernels are latency-bound (a few KB to a few MB of data): what they cost is launches and
chains of loads that wait on memory, which is what the fast versions cut. Ours also offers, with
the same results:

* ``gather_and_compute_slot_mappings``: the gather and the slot mapping in **one** launch (the
  slots read the persistent tables through ``idx_mapping``, so the two halves are independent);
  a step is then two launches: ``apply_staged_writes`` and this;
* ``pack_staged_writes`` / ``launch_staged_writes``: the fast apply's host half (pack every
  group's writes and the counts into one UVA buffer, at fixed offsets, the write count inside)
  and device half; the device half can be captured in a CUDA graph (one graph per pool buffer).
  What it costs is trips over the bus to host memory, so it makes one where it can: every load
  of a write's description (and its first id, packed beside it) has a fixed address, so they
  all go at once; captured, a few programs loop over the writes up to the count, rather than
  a grid sized for the most writes that can be staged (see ``_apply_writes``);
* ``apply_gather_and_compute_slot_mappings`` (experimental): the whole step in one launch, the
  table readers spinning on a counter until the write programs have signalled.

Both give the same results (the tests check them against each other, against v1 and against a
numpy model). Where the seed has a bug the spec records, both do the sane thing:

* Padding starts at the *real* token count ``query_start_loc[num_reqs]``, not at
  ``positions.shape[0]`` (upstream fix #36580; the seed left stale slots between them).
* ``gather_block_tables(idx_mapping, num_reqs_padded)`` zeroes the padded rows with **each
  group's own width** (upstream uses group 0's width for every group, which writes past the rows
  of a narrower group's table: pitfall 20).
* Slots are computed in 64 bits (the seed multiplies int32 block ids by the block size in 32
  bits, which overflows for ids above ``2**31 / block_size``).
* Bad input raises before any launch and changes nothing (below); vLLM has no checks at all.

Kept as upstream, on purpose: ``gather_block_tables`` copies only a row's ``num_blocks`` columns,
so columns past them keep stale ids from earlier steps (attention reads only ``seq_len``'s
blocks, and clearing would cost bandwidth every step; pitfall 20); staged writes are unordered,
and an ``overwrite=True`` append with an empty list still resets the count to 0 (pitfall 21).

Errors (before any kernel launch; the tables, counts and staged writes are as they were):
``IndexError`` for a request slot outside ``0 .. max_num_reqs-1`` (``req_index``, an
``idx_mapping`` entry); ``ValueError`` for block ids past a request's table width (beyond
``max_model_len``), overlapping staged writes, more tokens than ``max_num_batched_tokens``, a
malformed ``query_start_loc``, positions past the table, tensors on the wrong device;
``TypeError`` for wrong types and dtypes. Value checks read the index tensors on the host (one
synchronisation on a GPU); ``check=False`` skips them for speed (the fast kernels then still mask
every access that could leave a table, the seed ones do not), and they are skipped while a CUDA
graph is being captured (values cannot be read then).
"""
from __future__ import annotations

from typing import Any, Iterable, Optional, Sequence, Union

import numpy as np
import torch
import triton
import triton.language as tl

from paged_attention.utils import PAD_SLOT_ID, cdiv, check_count, check_int, is_int, next_power_of_2
from paged_attention.v2.buffers import (StagedWriteTensor, UvaBackedTensor, UvaBufferPool,
                                        check_kernel_device)

IMPLS = ("fast", "seed")
"""The kernel sets ``BlockTables`` can use: ours (``"fast"``) and the seed's structure (``"seed"``)."""

INDEX_DTYPES = (torch.int32, torch.int64)
"""The dtypes accepted for ``idx_mapping``, ``query_start_loc`` and ``positions``."""

_INT32_MAX = int(np.iinfo(np.int32).max)


class BlockTables:
    """The v2 block tables of every KV-cache group, on the device (spec §3.3).

    ``BlockTables(block_sizes, max_num_reqs, max_num_batched_tokens, max_model_len, device, *,
    impl="fast")`` as in the seed (vLLM's later form takes ``max_num_blocks_per_group`` and
    kernel block sizes instead of ``max_model_len``):

    * ``block_sizes[i]``: tokens per block of KV-cache group ``i``; its table has
      ``cdiv(max_model_len, block_sizes[i])`` columns (``max_num_blocks_per_group[i]``);
    * rows are request states ``0 .. max_num_reqs-1``; ``max_num_batched_tokens`` is the length
      of every group's slot mapping;
    * ``device``: ``paged_attention.DEVICE`` (cuda on a GPU; the CPU, with Triton's interpreter,
      elsewhere);
    * ``impl``: ``"fast"`` or ``"seed"`` kernels (see the module docstring); every method also
      takes ``impl=`` to override it for one call.

    Attributes, as in vLLM: ``block_tables`` (one ``StagedWriteTensor`` per group,
    ``[max_num_reqs, max_num_blocks]`` int32, rows by request state), ``num_blocks``
    (``UvaBackedTensor`` ``[num_groups, max_num_reqs]`` int32: each request's block count per
    group), ``input_block_tables`` (device ``[max_num_reqs, max_num_blocks]`` int32 per group,
    rows by batch position), ``slot_mappings`` (device ``[num_groups, max_num_batched_tokens]``
    int64), ``block_table_ptrs``/``input_block_table_ptrs`` (uint64 data pointers),
    ``block_table_strides`` (int64), ``block_sizes_tensor`` (int32).

    The device tables must stay where they are: the pointer tables hold their addresses (vLLM
    rebuilds them with ``init_block_table_layout_tensors`` after its memory is re-mapped).
    """

    def __init__(self, block_sizes: Sequence[int], max_num_reqs: int, max_num_batched_tokens: int,
                 max_model_len: int, device: Union[torch.device, str], *, impl: str = "fast") -> None:
        if isinstance(block_sizes, (str, bytes)) or not isinstance(block_sizes, (Sequence, np.ndarray)):
            raise TypeError(f"block_sizes must be a list of ints (one per KV-cache group), got {block_sizes!r}")
        if len(block_sizes) == 0:
            raise ValueError("block_sizes must name at least one KV-cache group")
        block_sizes = [check_int(f"block_sizes[{i}]", b, minimum=1) for i, b in enumerate(block_sizes)]
        max_num_reqs = check_int("max_num_reqs", max_num_reqs, minimum=1)
        max_num_batched_tokens = check_int("max_num_batched_tokens", max_num_batched_tokens, minimum=1)
        max_model_len = check_int("max_model_len", max_model_len, minimum=1)
        self._device = check_kernel_device(device, "BlockTables")
        if self._device.type == "cuda" and self._device.index is None:
            self._device = torch.device("cuda", torch.cuda.current_device())
        self.impl = _check_impl(impl)

        self.block_sizes = block_sizes
        self.max_num_reqs = max_num_reqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.device = device

        self.num_kv_cache_groups = len(self.block_sizes)
        # A request of max_model_len tokens fills cdiv(max_model_len, block_size) blocks.
        self.max_num_blocks_per_group = [cdiv(max_model_len, bs) for bs in block_sizes]
        # The persistent tables, one row per request state: [max_num_reqs, max_num_blocks] each.
        self.block_tables: list[StagedWriteTensor] = [
            StagedWriteTensor((max_num_reqs, max_num_blocks), dtype=torch.int32, device=self._device)
            for max_num_blocks in self.max_num_blocks_per_group
        ]
        # Each request's block count per group: edited on the host, read by kernels through UVA.
        self.num_blocks = UvaBackedTensor((self.num_kv_cache_groups, max_num_reqs), dtype=torch.int32)
        # The tables attention reads, one row per batch position: [max_num_reqs, max_num_blocks].
        self.input_block_tables: list[torch.Tensor] = [torch.zeros_like(b.gpu) for b in self.block_tables]
        self.slot_mappings = torch.zeros(self.num_kv_cache_groups, max_num_batched_tokens, dtype=torch.int64,
                                         device=self._device)
        self.init_block_table_layout_tensors()

        # Ours: how many real rows the last gather wrote (compute_slot_mappings without
        # idx_mapping reads them).
        self._num_gathered_reqs = 0
        # Ours: one packed buffer of all groups' staged writes, read by the fused write kernel
        # through UVA. Grows (rarely) when a step stages more than it holds.
        self._write_pool: Optional[UvaBufferPool] = None
        # Ours: a device-memory copy of the published counts, refreshed by the fast apply's
        # launch, so that the fast gather reads device memory instead of host memory over the
        # bus (the seed reads num_blocks.gpu, i.e. UVA). It is used only while num_blocks.gpu
        # is still the buffer it was copied from (any later copy_to_uva re-binds .gpu).
        self._num_blocks_device = torch.zeros(self.num_kv_cache_groups, max_num_reqs, dtype=torch.int32,
                                              device=self._device)
        self._num_blocks_device_source: Optional[torch.Tensor] = None
        # Ours: the two counters of the single-launch step (writers arrived, programs done),
        # zero between launches.
        self._step_sync = torch.zeros(2, dtype=torch.int32, device=self._device)
        # The token-parallel slot kernel's binary search: enough halvings of [0, max_num_reqs],
        # and a power of two covering query_start_loc (computed once: host time per call counts).
        self._search_steps = max(1, max_num_reqs.bit_length())
        self._qsl_block = next_power_of_2(max_num_reqs + 1)
        # Launch shapes of the fast kernels: big tiles on the interpreter (it pays per program
        # and per operation, hardly per element), small ones on a GPU (more programs in flight).
        # The staged writes' launch captured in a CUDA graph (launch_staged_writes): a few
        # programs of wide tiles, looping over them, rather than a grid sized for the most writes
        # that can be staged (they all read host memory over the bus).
        if self._device.type == "cuda":
            self.write_rows, self.write_block, self.counts_block = 16, 32, 1024
            self.capture_write_rows, self.capture_write_programs = 32, 4
            self.gather_rows, self.gather_block_cols = 4, 128
            self.slot_block_tokens = 128
        else:
            self.write_rows, self.write_block, self.counts_block = 64, 64, 1024
            self.capture_write_rows, self.capture_write_programs = 64, 2
            self.gather_rows, self.gather_block_cols = 64, 64
            self.slot_block_tokens = 1024

    def init_block_table_layout_tensors(self) -> None:
        """Build the pointer, stride and block-size tensors the kernels index by group (again
        after the tables moved; vLLM needs this after a CuMem wake-up)."""
        self.block_table_ptrs = self._make_ptr_tensor([b.gpu for b in self.block_tables])
        # The tables are contiguous, so a row's stride is also its width (its number of columns).
        self.block_table_strides = torch.tensor([b.gpu.stride(0) for b in self.block_tables],
                                                dtype=torch.int64, device=self._device)
        self.block_sizes_tensor = torch.tensor(self.block_sizes, dtype=torch.int32, device=self._device)
        self.input_block_table_ptrs = self._make_ptr_tensor(self.input_block_tables)

    def _make_ptr_tensor(self, x: Iterable[torch.Tensor]) -> torch.Tensor:
        # uint64: an address may not fit int64's positive range.
        return torch.tensor([t.data_ptr() for t in x], dtype=torch.uint64, device=self._device)

    # ---- 1. Staging -----------------------------------------------------------------------------
    def append_block_ids(self, req_index: int, new_block_ids: Sequence[Sequence[int]], overwrite: bool) -> None:
        """Stage request state ``req_index``'s new block ids, one list per group.

        ``overwrite=False`` (a running request got more blocks): the ids go after the request's
        current ones. ``overwrite=True`` (a new request, or one re-added): they replace the row
        from column 0, and the count becomes their number (0 for an empty list). The count in
        ``num_blocks.np`` changes now; the device table at ``apply_staged_writes``.

        Every group is checked before any is staged: an id list that would pass the group's
        table width (``cdiv(max_model_len, block_size)`` blocks) raises ValueError, as does a
        write overlapping one staged for the same request since the last apply.
        """
        req = self._check_req_index(req_index, "req_index")
        if not isinstance(overwrite, (bool, np.bool_)):
            raise TypeError(f"overwrite must be a bool, got {overwrite!r}")
        if isinstance(new_block_ids, (str, bytes)) or not isinstance(new_block_ids, (tuple, list)):
            raise TypeError(f"new_block_ids must be a tuple with one list of ids per KV-cache group, "
                            f"got {new_block_ids!r}")
        if len(new_block_ids) != self.num_kv_cache_groups:
            raise ValueError(f"new_block_ids has {len(new_block_ids)} lists but there are "
                             f"{self.num_kv_cache_groups} KV-cache groups")
        plans = []
        for g, ids in enumerate(new_block_ids):
            table = self.block_tables[g]
            values = table.as_values(ids) if not (type(ids) is list and _all_small_ints(ids)) else ids
            if values and (min(values) < 0 or max(values) > _INT32_MAX):
                raise ValueError(f"block ids must be between 0 and {_INT32_MAX} (int32), got "
                                 f"{min(values)} .. {max(values)} for group {g}")
            start = 0 if overwrite else int(self.num_blocks.np[g, req])
            end = start + len(values)
            width = self.max_num_blocks_per_group[g]
            if end > width:
                raise ValueError(
                    f"request state {req} would hold {end} blocks in group {g} ({start} + {len(values)}), "
                    f"but its table has {width} columns: cdiv(max_model_len={self.max_model_len}, "
                    f"block_size={self.block_sizes[g]}); that is past max_model_len")
            if values:
                earlier = table.overlaps_staged(req, start, end)
                if earlier is not None:
                    s, e = earlier
                    raise ValueError(
                        f"columns {start}..{end - 1} of request state {req} in group {g} overlap "
                        f"columns {s}..{e - 1} staged earlier in this step; staged writes are "
                        f"unordered, so call apply_staged_writes() in between")
                if table.num_staged_writes >= table.num_rows:
                    raise ValueError(f"group {g} has {table.num_rows} staged writes already (max_num_reqs): "
                                     f"call apply_staged_writes() first")
            plans.append((start, values))
        # Everything checked: now stage and count.
        for g, (start, values) in enumerate(plans):
            if values:
                self.block_tables[g]._stage(req, start, values)
            self.num_blocks.np[g, req] = start + len(values)

    # ---- 2. Applying ----------------------------------------------------------------------------
    def apply_staged_writes(self, *, impl: Optional[str] = None) -> None:
        """Write every staged id into the device tables, then publish the counts
        (``num_blocks.copy_to_uva()``). Once per step, before any kernel reads the tables.

        ``impl="seed"``: one launch per group (each table's ``apply_write``), as in the seed;
        ``"fast"``: one launch for all groups (the seed's TODO), always exactly one: the same
        launch also copies the published counts into device memory, where the fast gather reads
        them (the seed's gather reads them from host memory through UVA)."""
        impl = self._impl(impl)
        if impl == "seed":
            for block_table in self.block_tables:
                block_table.apply_write()
            self.num_blocks.copy_to_uva()
        else:
            self.num_blocks.copy_to_uva()
            self._apply_all_writes()

    def _apply_all_writes(self) -> None:
        """Every group's staged writes and the just-published counts, packed into one host
        buffer the kernel reads via UVA (``pack_staged_writes``), then one launch
        (``launch_staged_writes``)."""
        self.launch_staged_writes(self.pack_staged_writes())

    def pack_staged_writes(self) -> tuple[torch.Tensor, int]:
        """The host half of the fast ``apply_staged_writes`` (ours): pop every group's staged
        writes and pack them, with the counts in ``num_blocks.np``, into the next buffer of a
        UVA pool; return ``(buffer, num_writes)`` for ``launch_staged_writes``. Call
        ``num_blocks.copy_to_uva()`` first (``apply_staged_writes`` does).

        The buffer is int32, laid out at fixed offsets (``W = num_groups * max_num_reqs``, the
        most writes that can be staged; ``C`` the counts):
        ``[num_writes | groups (W) | rows (W) | starts (W) | ends (W) | firsts (W) | counts (C) |
        values]``; write k's values are ``values[ends[k-1] : ends[k]]`` (``ends[-1]`` read as 0),
        and ``firsts[k]`` repeats the first of them, ``values[ends[k-1]]``, so that the kernel
        gets a one-block write (the usual one) in the same trip over the bus as the write
        itself. The write count is *in* the buffer and the offsets do not depend on it (array
        j of the five starts at ``1 + j * W``, the counts at ``1 + 5 * W``, the values at
        ``1 + 5 * W + C``), so the kernel needs no per-step argument: a launch captured in a
        CUDA graph applies whatever the buffer holds at replay (see ``launch_staged_writes``)."""
        groups: list[int] = []
        rows: list[int] = []
        starts: list[int] = []
        ends: list[int] = []
        contents: list[int] = []
        for g, table in enumerate(self.block_tables):
            indices, table_starts, table_contents, cu_lens = table.pop_staged_writes()
            if not indices:
                continue
            base = len(contents)
            groups += [g] * len(indices)
            rows += indices
            starts += table_starts
            ends += [base + c for c in cu_lens] if base else cu_lens
            contents += table_contents
        n = len(rows)
        w, c = self._max_writes, self.num_blocks.np.size
        values_at = 1 + 5 * w + c
        buf = self._packed_write_pool(values_at + len(contents)).next_buffer()
        packed = buf.np
        packed[0] = n
        if n:
            packed[1:1 + n] = groups
            packed[1 + w:1 + w + n] = rows
            packed[1 + 2 * w:1 + 2 * w + n] = starts
            packed[1 + 3 * w:1 + 3 * w + n] = ends
            values = packed[values_at:values_at + len(contents)]
            values[:] = contents
            # firsts[k] = values[ends[k-1]]: write k's first id (no write is empty, so
            # firsts[0] = values[0]); one numpy gather through the ends just packed.
            packed[1 + 4 * w] = values[0]
            packed[2 + 4 * w:1 + 4 * w + n] = values[packed[1 + 3 * w:3 * w + n]]
        packed[1 + 5 * w:values_at] = self.num_blocks.np.reshape(-1)
        # The fast gather may read the device copy of the counts while num_blocks.gpu is the
        # buffer published with them (a later copy_to_uva re-binds .gpu).
        self._num_blocks_device_source = self.num_blocks.gpu
        return buf.uva, n

    def launch_staged_writes(self, packed: tuple[torch.Tensor, int]) -> None:
        """The device half of the fast ``apply_staged_writes`` (ours): one launch that applies
        the writes packed by ``pack_staged_writes`` and copies the counts to device memory.

        Eagerly the grid has just enough write programs for ``num_writes``
        (``cdiv(num_writes, write_rows)``, one tile of ``write_rows`` writes each). While a CUDA
        graph is being captured the count is not known yet: the grid then has a few write
        programs (``capture_write_programs``, tiles of ``capture_write_rows`` writes) that loop
        over the tiles up to the write count they read from the buffer at replay (see
        ``_apply_writes``), so a replay applies the step's writes, whatever their number, and a
        step of up to ``capture_write_programs * capture_write_rows`` writes waits for the bus
        no longer than an eager launch (on an H200, the whole step's graph, this launch and
        ``gather_and_compute_slot_mappings``, replays in about 11 us at 1024 requests, where
        the former capture grid of ``cdiv(_max_writes, write_rows)`` programs, each reading the
        count first, took 26). The graph holds the buffer's address, and the pool rotates
        between buffers (double buffering): capture one graph per pool buffer
        (``max_concurrency``, 2) and replay the one ``pack_staged_writes`` just filled. A pool that has to grow (a step
        staging more values than it holds) moves, and the graphs must then be captured again."""
        buf, n = packed
        num_counts = self.num_blocks.np.size
        num_write_programs, rows, strided = self._write_launch_shape(n)
        grid = (num_write_programs + cdiv(num_counts, self.counts_block),)
        _apply_block_table_writes_kernel[grid](
            buf, self._max_writes, self.block_table_ptrs, self.block_table_strides,
            self._num_blocks_device, num_counts, num_write_programs,
            NUM_GROUPS=self.num_kv_cache_groups, WRITES_PER_PROGRAM=rows, BLOCK_SIZE=self.write_block,
            COUNTS_BLOCK=self.counts_block, STRIDED=strided,
        )

    def _write_launch_shape(self, num_writes: int) -> tuple[int, int, bool]:
        """``(write programs, writes per tile, strided)`` of a fast apply launch. Eagerly one
        program per tile of ``write_rows`` writes: ``cdiv(num_writes, write_rows)``. Under CUDA
        graph capture, ``capture_write_programs`` programs (fewer when the most writes that can
        be staged, ``_max_writes``, fill fewer tiles of ``capture_write_rows``) looping over the
        tiles (``STRIDED``)."""
        if _capturing(self._device):
            rows = self.capture_write_rows
            return min(self.capture_write_programs, cdiv(self._max_writes, rows)), rows, True
        return cdiv(num_writes, self.write_rows), self.write_rows, False

    @property
    def _max_writes(self) -> int:
        # At most max_num_reqs writes per table between applies (StagedWriteTensor's limit).
        return self.num_kv_cache_groups * self.max_num_reqs

    def _packed_write_pool(self, length: int) -> UvaBufferPool:
        pool = self._write_pool
        if pool is None or pool.size[0] < length:
            if pool is not None and self._device.type == "cuda":
                # Kernels may still read the old buffers: wait for them before they are freed.
                torch.cuda.synchronize(self._device)
            fixed = 1 + 6 * self._max_writes             # all but the values (counts: as many)
            capacity = max(length, 2 * (pool.size[0] if pool else 0) - fixed,
                           fixed + 4 * self._max_writes + 4096)
            pool = self._write_pool = UvaBufferPool(capacity, torch.int32)
        return pool

    # ---- 3. Gathering ---------------------------------------------------------------------------
    def gather_block_tables(self, idx_mapping: torch.Tensor, num_reqs_padded: Optional[int] = None, *,
                            impl: Optional[str] = None, check: bool = True) -> tuple[torch.Tensor, ...]:
        """Copy the rows of the batch's request states, in batch order, into
        ``input_block_tables``; return each group's first ``num_reqs_padded`` rows.

        ``idx_mapping[b]`` (int32/int64, on the device) is the request state of batch position
        ``b``. Row ``b`` gets that request's first ``num_blocks`` columns; the columns after them
        keep what they held (stale, as upstream). ``num_reqs_padded`` (vLLM's later keyword;
        default ``len(idx_mapping)``) adds all-zero rows up to that count, for a CUDA graph
        captured for a bigger batch; each group's row is zeroed over its own width (upstream
        uses group 0's, pitfall 20).

        CUDA graphs: the fast gather reads the counts from a device buffer with a fixed address,
        refreshed by every fast ``apply_staged_writes``, so a captured gather stays right in later
        replays (give it a fixed ``idx_mapping`` buffer, updated in place). The seed's reads
        ``num_blocks.gpu``, which every ``copy_to_uva`` re-binds to another buffer: a replay
        would read the counts of the capture's step (vLLM runs these kernels outside graphs).
        """
        impl = self._impl(impl)
        num_reqs = self._check_idx_mapping(idx_mapping, check)
        if num_reqs_padded is None:
            num_reqs_padded = num_reqs
        num_reqs_padded = check_int("num_reqs_padded", num_reqs_padded, minimum=num_reqs)
        if num_reqs_padded > self.max_num_reqs:
            raise ValueError(f"num_reqs_padded={num_reqs_padded} is more than max_num_reqs={self.max_num_reqs}")
        if num_reqs_padded > 0:
            num_blocks = self.num_blocks.gpu
            if impl == "seed":
                _gather_block_tables_kernel[(self.num_kv_cache_groups, num_reqs_padded)](
                    idx_mapping, self.block_table_ptrs, self.input_block_table_ptrs,
                    self.block_table_strides, num_blocks, num_blocks.stride(0), num_reqs,
                    BLOCK_SIZE=1024,
                )
            else:
                if self._num_blocks_device_source is num_blocks:
                    num_blocks = self._num_blocks_device     # same contents, in device memory
                grid = (cdiv(num_reqs_padded, self.gather_rows), self.num_kv_cache_groups)
                _gather_block_tables_fast_kernel[grid](
                    idx_mapping, self.block_table_ptrs, self.input_block_table_ptrs,
                    self.block_table_strides, num_blocks, num_blocks.stride(0),
                    num_reqs, num_reqs_padded, self.max_num_reqs,
                    ROWS=self.gather_rows, BLOCK_COLS=self.gather_block_cols,
                )
        self._num_gathered_reqs = num_reqs
        return tuple(block_table[:num_reqs_padded] for block_table in self.input_block_tables)

    def get_dummy_block_tables(self, num_reqs: int) -> tuple[torch.Tensor, ...]:
        """The first ``num_reqs`` rows of each input table, unchanged: the same tensors (and
        addresses) every time, for dummy runs and CUDA-graph capture."""
        num_reqs = check_count("num_reqs", num_reqs, self.max_num_reqs, "max_num_reqs")
        return tuple(block_table[:num_reqs] for block_table in self.input_block_tables)

    # ---- 4. Slot mappings -----------------------------------------------------------------------
    def compute_slot_mappings(self, query_start_loc: torch.Tensor, positions: torch.Tensor, *,
                              idx_mapping: Optional[torch.Tensor] = None,
                              num_tokens_padded: Optional[int] = None, impl: Optional[str] = None,
                              check: bool = True) -> torch.Tensor:
        """Every scheduled token's slot, for every group: ``slot_mappings[:, :num_tokens]``.

        ``query_start_loc`` (``num_reqs + 1`` entries from 0, int32/int64): batch position ``b``
        owns tokens ``query_start_loc[b] .. query_start_loc[b+1]-1``; ``positions[t]``: token
        ``t``'s position in its sequence. As in the seed, the table rows are read from the
        gathered ``input_block_tables`` (row ``b``: call ``gather_block_tables`` first); with
        ``idx_mapping=`` (vLLM's later form) they are read from the persistent tables through it
        instead, and the gather is not needed. Tokens from ``query_start_loc[num_reqs]`` (the real
        count) to ``max_num_batched_tokens`` get ``PAD_SLOT_ID``. The returned view has
        ``num_tokens_padded`` columns (default ``len(positions)``).

        A position whose block is in the table but was never given to its request reads whatever
        id that column holds (0, or a stale id), as upstream: the caller schedules only tokens a
        request has blocks for.
        """
        impl = self._impl(impl)
        num_reqs, num_tokens = self._check_slot_inputs(query_start_loc, positions)
        if idx_mapping is not None:
            n = self._check_idx_mapping(idx_mapping, check)
            if n != num_reqs:
                raise ValueError(f"idx_mapping has {n} entries but query_start_loc describes {num_reqs} requests")
        if num_tokens_padded is None:
            num_tokens_padded = num_tokens
        num_tokens_padded = check_count("num_tokens_padded", num_tokens_padded, self.max_num_batched_tokens,
                                         "max_num_batched_tokens")
        if check and not _capturing(self._device):
            self._check_slot_values(query_start_loc, positions, num_reqs, num_tokens, idx_mapping is not None)

        has_idx = idx_mapping is not None
        ptrs = self.block_table_ptrs if has_idx else self.input_block_table_ptrs
        idx = idx_mapping if has_idx else query_start_loc      # never read without idx_mapping
        if impl == "seed":
            _compute_slot_mappings_kernel[(self.num_kv_cache_groups, num_reqs + 1)](
                self.max_num_batched_tokens, idx, query_start_loc, positions,
                ptrs, self.block_table_strides, self.block_sizes_tensor,
                self.slot_mappings, self.slot_mappings.stride(0),
                PAD_ID=PAD_SLOT_ID, HAS_IDX_MAPPING=has_idx, BLOCK_SIZE=1024,
            )
        else:
            grid = (cdiv(self.max_num_batched_tokens, self.slot_block_tokens),)
            _compute_slot_mappings_fast_kernel[grid](
                num_reqs, num_tokens, self.max_num_batched_tokens, self.max_num_reqs,
                idx, query_start_loc, positions,
                ptrs, self.block_table_strides, self.block_sizes_tensor,
                self.slot_mappings, self.slot_mappings.stride(0),
                PAD_ID=PAD_SLOT_ID, HAS_IDX_MAPPING=has_idx, NUM_GROUPS=self.num_kv_cache_groups,
                SEARCH_STEPS=self._search_steps, QSL_BLOCK=self._qsl_block, BLOCK_TOKENS=self.slot_block_tokens,
            )
        return self.slot_mappings[:, :num_tokens_padded]

    def _check_fused_inputs(self, idx_mapping: torch.Tensor, query_start_loc: torch.Tensor,
                            positions: torch.Tensor, num_reqs_padded: Optional[int],
                            num_tokens_padded: Optional[int], check: bool) -> tuple[int, int, int, int]:
        """The checks of a gather and a slot mapping through ``idx_mapping``, for the fused
        launches: ``(num_reqs, num_tokens, num_reqs_padded, num_tokens_padded)``."""
        num_reqs, num_tokens = self._check_slot_inputs(query_start_loc, positions)
        n = self._check_idx_mapping(idx_mapping, check)
        if n != num_reqs:
            raise ValueError(f"idx_mapping has {n} entries but query_start_loc describes {num_reqs} requests")
        if num_reqs_padded is None:
            num_reqs_padded = num_reqs
        num_reqs_padded = check_int("num_reqs_padded", num_reqs_padded, minimum=num_reqs)
        if num_reqs_padded > self.max_num_reqs:
            raise ValueError(f"num_reqs_padded={num_reqs_padded} is more than max_num_reqs={self.max_num_reqs}")
        if num_tokens_padded is None:
            num_tokens_padded = num_tokens
        num_tokens_padded = check_count("num_tokens_padded", num_tokens_padded, self.max_num_batched_tokens,
                                         "max_num_batched_tokens")
        if check and not _capturing(self._device):
            self._check_slot_values(query_start_loc, positions, num_reqs, num_tokens, True)
        return num_reqs, num_tokens, num_reqs_padded, num_tokens_padded

    def gather_and_compute_slot_mappings(
            self, idx_mapping: torch.Tensor, query_start_loc: torch.Tensor, positions: torch.Tensor, *,
            num_reqs_padded: Optional[int] = None, num_tokens_padded: Optional[int] = None,
            check: bool = True) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """Ours: ``gather_block_tables(idx_mapping, num_reqs_padded)`` and
        ``compute_slot_mappings(query_start_loc, positions, idx_mapping=idx_mapping)`` in **one**
        launch (the fast kernels only); returns both results, which are the same as the two
        calls'. The two halves are independent (the slots come from the persistent tables, through
        ``idx_mapping``), so their programs run side by side: one launch and one kernel's latency
        per step instead of two. The same checks as the two calls (``check=False`` skips the
        value checks that read tensors on the host)."""
        num_reqs, num_tokens, num_reqs_padded, num_tokens_padded = self._check_fused_inputs(
            idx_mapping, query_start_loc, positions, num_reqs_padded, num_tokens_padded, check)
        num_blocks = self.num_blocks.gpu
        if self._num_blocks_device_source is num_blocks:
            num_blocks = self._num_blocks_device     # same contents, in device memory
        num_slot_programs = cdiv(self.max_num_batched_tokens, self.slot_block_tokens)
        gather_tiles = cdiv(num_reqs_padded, self.gather_rows)
        grid = (num_slot_programs + gather_tiles * self.num_kv_cache_groups,)
        _gather_and_slots_fast_kernel[grid](
            idx_mapping, self.block_table_ptrs, self.input_block_table_ptrs, self.block_table_strides,
            num_blocks, num_blocks.stride(0), num_reqs, num_reqs_padded, self.max_num_reqs,
            num_tokens, self.max_num_batched_tokens, query_start_loc, positions, self.block_sizes_tensor,
            self.slot_mappings, self.slot_mappings.stride(0), num_slot_programs, max(gather_tiles, 1),
            PAD_ID=PAD_SLOT_ID, NUM_GROUPS=self.num_kv_cache_groups,
            SEARCH_STEPS=self._search_steps, QSL_BLOCK=self._qsl_block, BLOCK_TOKENS=self.slot_block_tokens,
            ROWS=self.gather_rows, BLOCK_COLS=self.gather_block_cols,
        )
        self._num_gathered_reqs = num_reqs
        return (tuple(block_table[:num_reqs_padded] for block_table in self.input_block_tables),
                self.slot_mappings[:, :num_tokens_padded])

    def apply_gather_and_compute_slot_mappings(
            self, idx_mapping: torch.Tensor, query_start_loc: torch.Tensor, positions: torch.Tensor, *,
            packed: Optional[tuple[torch.Tensor, int]] = None, num_reqs_padded: Optional[int] = None,
            num_tokens_padded: Optional[int] = None,
            check: bool = True) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """Ours, experimental: the whole step's device work in **one** launch: the fast
        ``apply_staged_writes`` (``packed``, from ``pack_staged_writes``; by default the writes
        staged now are packed here, after ``num_blocks.copy_to_uva()``), then what
        ``gather_and_compute_slot_mappings`` does. Same results.

        Inside the launch, the programs that read the tables wait (spinning on a counter in
        device memory) until every write program has signalled. That relies on the write
        programs, which have the lowest ids, being started before the waiting ones fill the GPU:
        what GPUs do in practice, though CUDA does not promise it (a grid small enough to be
        resident all at once, like 1024 requests here, never depends on it). The two-launch path
        (``apply_staged_writes`` + ``gather_and_compute_slot_mappings``) makes no such
        assumption. Captured in a CUDA graph, it applies the writes of the packed buffer
        it was captured with, as ``launch_staged_writes`` explains."""
        num_reqs, num_tokens, num_reqs_padded, num_tokens_padded = self._check_fused_inputs(
            idx_mapping, query_start_loc, positions, num_reqs_padded, num_tokens_padded, check)
        if packed is None:
            self.num_blocks.copy_to_uva()
            packed = self.pack_staged_writes()
        buf, num_writes = packed
        num_write_programs, write_rows, strided = self._write_launch_shape(num_writes)
        num_counts = self.num_blocks.np.size
        num_slot_programs = cdiv(self.max_num_batched_tokens, self.slot_block_tokens)
        gather_tiles = cdiv(num_reqs_padded, self.gather_rows)
        grid = (num_write_programs + cdiv(num_counts, self.counts_block) + num_slot_programs
                + gather_tiles * self.num_kv_cache_groups,)
        _whole_step_fast_kernel[grid](
            buf, self._max_writes, self._num_blocks_device, num_counts, self._step_sync,
            idx_mapping, self.block_table_ptrs, self.input_block_table_ptrs, self.block_table_strides,
            num_reqs, num_reqs_padded, self.max_num_reqs, num_tokens, self.max_num_batched_tokens,
            query_start_loc, positions, self.block_sizes_tensor, self.slot_mappings, self.slot_mappings.stride(0),
            num_write_programs, num_slot_programs, max(gather_tiles, 1),
            PAD_ID=PAD_SLOT_ID, NUM_GROUPS=self.num_kv_cache_groups, SEARCH_STEPS=self._search_steps,
            QSL_BLOCK=self._qsl_block, BLOCK_TOKENS=self.slot_block_tokens, ROWS=self.gather_rows,
            BLOCK_COLS=self.gather_block_cols, WRITES_PER_PROGRAM=write_rows, WRITE_BLOCK=self.write_block,
            COUNTS_BLOCK=self.counts_block, STRIDED=strided,
        )
        self._num_gathered_reqs = num_reqs
        return (tuple(block_table[:num_reqs_padded] for block_table in self.input_block_tables),
                self.slot_mappings[:, :num_tokens_padded])

    def get_dummy_slot_mappings(self, num_tokens: int) -> torch.Tensor:
        """Fill **all** of ``slot_mappings`` with ``PAD_SLOT_ID`` and return its first
        ``num_tokens`` columns (for dummy runs: every cache write is skipped)."""
        num_tokens = check_count("num_tokens", num_tokens, self.max_num_batched_tokens, "max_num_batched_tokens")
        self.slot_mappings.fill_(PAD_SLOT_ID)
        return self.slot_mappings[:, :num_tokens]

    # ---- Checks ---------------------------------------------------------------------------------
    def _impl(self, impl: Optional[str]) -> str:
        return self.impl if impl is None else _check_impl(impl)

    def _check_req_index(self, req_index: Any, name: str) -> int:
        if not is_int(req_index):
            raise TypeError(f"{name} must be an int, got {req_index!r}")
        if not 0 <= req_index < self.max_num_reqs:
            raise IndexError(f"{name}={req_index} names no request state: they are 0..{self.max_num_reqs - 1}")
        return int(req_index)

    def _check_tensor(self, name: str, t: Any) -> torch.Tensor:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in INDEX_DTYPES:
            raise TypeError(f"{name} must be int32 or int64, got {str(t.dtype).replace('torch.', '')}")
        if t.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
        if t.device.type != self._device.type or (t.is_cuda and t.device.index != self._device.index):
            raise ValueError(f"{name} must be on {self._device} (where the tables are), got {t.device}")
        if t.numel() > 1 and t.stride(0) != 1:
            raise ValueError(f"{name} must be contiguous, got stride {t.stride(0)}")
        return t

    def _check_idx_mapping(self, idx_mapping: Any, check: bool) -> int:
        self._check_tensor("idx_mapping", idx_mapping)
        num_reqs = idx_mapping.shape[0]
        if num_reqs > self.max_num_reqs:
            raise ValueError(f"idx_mapping has {num_reqs} entries, more than max_num_reqs={self.max_num_reqs}")
        if check and num_reqs and not _capturing(self._device):
            values = idx_mapping.cpu().numpy()
            bad = np.flatnonzero((values < 0) | (values >= self.max_num_reqs))
            if bad.size:
                b = int(bad[0])
                raise IndexError(f"idx_mapping[{b}] = {int(values[b])} names no request state: they are "
                                 f"0..{self.max_num_reqs - 1}")
        return int(num_reqs)

    def _check_slot_inputs(self, query_start_loc: Any, positions: Any) -> tuple[int, int]:
        self._check_tensor("query_start_loc", query_start_loc)
        self._check_tensor("positions", positions)
        num_reqs = query_start_loc.shape[0] - 1
        if num_reqs < 0:
            raise ValueError("query_start_loc needs num_reqs + 1 >= 1 entries, got none")
        if num_reqs > self.max_num_reqs:
            raise ValueError(f"query_start_loc describes {num_reqs} requests, more than max_num_reqs="
                             f"{self.max_num_reqs}")
        num_tokens = positions.shape[0]
        if num_tokens > self.max_num_batched_tokens:
            raise ValueError(f"{num_tokens} positions are more than max_num_batched_tokens="
                             f"{self.max_num_batched_tokens}")
        return num_reqs, num_tokens

    def _check_slot_values(self, query_start_loc: torch.Tensor, positions: torch.Tensor, num_reqs: int,
                           num_tokens: int, has_idx: bool) -> None:
        qsl = query_start_loc.cpu().numpy().astype(np.int64)
        if qsl[0] != 0 or np.any(np.diff(qsl) < 0) or qsl[-1] > num_tokens:
            raise ValueError(f"query_start_loc must rise from 0 to at most the {num_tokens} positions given "
                             f"(and at most max_num_batched_tokens={self.max_num_batched_tokens}), got "
                             f"{_short(qsl)}")
        if not has_idx and num_reqs > self._num_gathered_reqs:
            raise ValueError(f"compute_slot_mappings reads rows 0..{num_reqs - 1} of the gathered tables, but the "
                             f"last gather_block_tables wrote {self._num_gathered_reqs}: gather this batch "
                             f"first, or pass idx_mapping=")
        actual = int(qsl[-1])
        if actual == 0:
            return
        pos = positions[:actual].cpu().numpy()
        if pos.min() < 0:
            raise ValueError(f"positions must be >= 0, got {int(pos.min())}")
        top = int(pos.max())
        for g, (bs, width) in enumerate(zip(self.block_sizes, self.max_num_blocks_per_group)):
            if top // bs >= width:
                raise ValueError(f"position {top} needs block column {top // bs} of group {g}, but its table has "
                                 f"{width} columns (cdiv(max_model_len={self.max_model_len}, block_size={bs})): "
                                 f"past max_model_len")

    def __repr__(self) -> str:
        return (f"BlockTables(block_sizes={self.block_sizes}, max_num_reqs={self.max_num_reqs}, "
                f"max_num_batched_tokens={self.max_num_batched_tokens}, max_model_len={self.max_model_len}, "
                f"impl={self.impl!r})")


# ---- Small helpers ---------------------------------------------------------------------------------
def _check_impl(impl: Any) -> str:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    return impl


def _all_small_ints(values: list) -> bool:
    """True for a list of plain ints (the common case, checked without numpy)."""
    for v in values:
        if type(v) is not int:
            return False
    return True


def _capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured (then tensors cannot be read on the host)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _short(a: np.ndarray, n: int = 12) -> str:
    items = a.tolist()
    return str(items) if len(items) <= n else f"{items[:n]}... ({len(items)} entries)"


# ---- Kernels ----------------------------------------------------------------------------------------
@triton.jit
def _load_ptr(ptr_to_ptr, elem_dtype):
    # A pointer table holds addresses as uint64: load one and make it a typed pointer again.
    ptr = tl.load(ptr_to_ptr)
    ptr = tl.cast(ptr, tl.pointer_type(elem_dtype))
    # Device allocations are aligned (256 bytes in torch): tell the compiler it may vectorise.
    return tl.multiple_of(ptr, 16)


@triton.jit(do_not_specialize=["num_write_programs"])
def _apply_block_table_writes_kernel(
    packed_ptr,          # int32: num_writes | groups, rows, starts, ends, firsts (max_writes each) | counts
                         # | values (see pack_staged_writes)
    max_writes,          # room for writes in each of the four per-write arrays
    table_ptrs,          # uint64 [num_groups]: each group's persistent table
    table_strides,       # int64 [num_groups]: its row stride (= width)
    counts_dst,          # int32 [num_groups * max_num_reqs]: the counts' copy in device memory
    num_counts,
    num_write_programs,  # programs 0 .. num_write_programs-1 write; the rest copy counts
    NUM_GROUPS: tl.constexpr,
    WRITES_PER_PROGRAM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    COUNTS_BLOCK: tl.constexpr,
    STRIDED: tl.constexpr,       # a grid captured in a CUDA graph: few programs loop over the tiles
):
    # Ours: all groups' staged writes in one launch, WRITES_PER_PROGRAM writes per program, as
    # a [writes, columns] tile: one tile row per write. The last programs copy the counts.
    pid = tl.program_id(0)
    if pid >= num_write_programs:
        _copy_counts(pid - num_write_programs, packed_ptr, max_writes, counts_dst, num_counts, COUNTS_BLOCK)
        return
    _apply_writes(pid, num_write_programs, packed_ptr, max_writes, table_ptrs, table_strides, num_counts,
                  NUM_GROUPS, WRITES_PER_PROGRAM, BLOCK_SIZE, STRIDED)


@triton.jit
def _copy_counts(tile, packed_ptr, max_writes, counts_dst, num_counts, COUNTS_BLOCK: tl.constexpr):
    # Counts k .. k + COUNTS_BLOCK - 1 (both are [groups, max_num_reqs], contiguous).
    k = tile * COUNTS_BLOCK + tl.arange(0, COUNTS_BLOCK)
    in_range = k < num_counts
    counts_src = packed_ptr + 1 + 5 * max_writes       # after the header and the five write arrays
    tl.store(counts_dst + k, tl.load(counts_src + k, mask=in_range), mask=in_range)


@triton.jit
def _apply_writes(pid, num_write_programs, packed_ptr, max_writes, table_ptrs, table_strides, num_counts,
                  NUM_GROUPS: tl.constexpr, WRITES_PER_PROGRAM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                  STRIDED: tl.constexpr):
    # Write program pid of num_write_programs. Tile k holds writes k * WRITES_PER_PROGRAM ..
    # (k + 1) * WRITES_PER_PROGRAM - 1 of the packed buffer.
    #
    # Eagerly (STRIDED off) the host sized the grid to the write count: program pid does tile
    # pid, and that is all.
    #
    # Captured in a CUDA graph (STRIDED on), the count is known only at replay, and the grid
    # is a few programs (launch_staged_writes): program pid does tiles pid, pid + P, pid + 2P,
    # ... (P = num_write_programs) up to the last tile holding a write, cdiv(num_writes,
    # WRITES_PER_PROGRAM) - 1. Its first tile, pid, is done before the loop and without
    # waiting for the count: the offsets are fixed, so the count and that tile's five write
    # arrays travel over the bus together (one round trip), as eagerly; only the writes of a
    # step with more than P tiles wait for the count. (The former capture grid, one program
    # per tile of the most writes that can be staged, each reading the count first, cost a
    # round trip more and a hundred programs' worth of reads over the bus.)
    _apply_writes_tile(pid, packed_ptr, max_writes, table_ptrs, table_strides, num_counts,
                       NUM_GROUPS, WRITES_PER_PROGRAM, BLOCK_SIZE)
    if STRIDED:
        num_writes = tl.load(packed_ptr)
        num_tiles = tl.cdiv(num_writes, WRITES_PER_PROGRAM)
        for tile in range(pid + num_write_programs, num_tiles, num_write_programs):
            _apply_writes_tile(tile, packed_ptr, max_writes, table_ptrs, table_strides, num_counts,
                               NUM_GROUPS, WRITES_PER_PROGRAM, BLOCK_SIZE)


@triton.jit
def _apply_writes_tile(tile, packed_ptr, max_writes, table_ptrs, table_strides, num_counts,
                       NUM_GROUPS: tl.constexpr, WRITES_PER_PROGRAM: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    # Writes tile * WRITES_PER_PROGRAM .. + WRITES_PER_PROGRAM - 1 of a packed buffer.
    w = tile * WRITES_PER_PROGRAM + tl.arange(0, WRITES_PER_PROGRAM)
    room = w < max_writes
    num_writes = tl.load(packed_ptr)
    # The loads below do not wait for the count (the offsets are fixed: array j of the write
    # arrays starts at 1 + j * max_writes), so all of them travel over the bus together with
    # it; entries past the count (stale ones of earlier steps) are masked off afterwards.
    group = tl.load(packed_ptr + 1 + w, mask=room, other=0)
    row = tl.load(packed_ptr + 1 + max_writes + w, mask=room, other=0)
    start = tl.load(packed_ptr + 1 + 2 * max_writes + w, mask=room, other=0)
    end = tl.load(packed_ptr + 1 + 3 * max_writes + w, mask=room, other=0)
    # Write w's values are values[ends[w-1] : ends[w]] (the first write's begin at 0)...
    begin = tl.load(packed_ptr + 1 + 3 * max_writes + w - 1, mask=room & (w > 0), other=0)
    # ...and its first value, values[ends[w-1]], is also in the fifth array (firsts): a step's
    # usual write, one new block, needs nothing from the values region, whose address depends
    # on begin (a second round trip over the bus before the store).
    first = tl.load(packed_ptr + 1 + 4 * max_writes + w, mask=room, other=0)
    valid = room & (w < num_writes)
    length = tl.where(valid, end - begin, 0)
    values_ptr = packed_ptr + 1 + 5 * max_writes + num_counts
    # Each write's group gives its table and row stride. The NUM_GROUPS pointers and strides
    # are loaded up front (they do not depend on the buffer, so their loads overlap the bus's)
    # and picked per write, rather than loaded through `group` after it arrives.
    table_bits = tl.zeros([WRITES_PER_PROGRAM], tl.uint64)
    stride = tl.zeros([WRITES_PER_PROGRAM], tl.int64)
    for g in tl.static_range(NUM_GROUPS):
        table_bits = tl.where(group == g, tl.load(table_ptrs + g), table_bits)
        stride = tl.where(group == g, tl.load(table_strides + g), stride)
    table = tl.cast(table_bits, tl.pointer_type(tl.int32))
    # Element `start` of row `row` of that table: the write's column 0.
    dst = table + row.to(tl.int64) * stride + start
    tl.store(dst, first, mask=length > 0)
    # Columns 1 .. length-1 from the values region (only writes of several blocks have them:
    # a new request's, not a decode step's), BLOCK_SIZE columns at a time.
    for c in range(1, tl.max(length, axis=0), BLOCK_SIZE):
        cols = c + tl.arange(0, BLOCK_SIZE)
        mask = cols[None, :] < length[:, None]
        ids = tl.load(values_ptr + begin[:, None] + cols[None, :], mask=mask)
        tl.store(dst[:, None] + cols[None, :], ids, mask=mask)


@triton.jit
def _wait_for_writes(sync_ptr, num_writers):
    # Ours (single launch): spin until the num_writers write programs of this launch have
    # signalled (each adds 1 after its stores, with release semantics); acquire, so their
    # stores are visible to this program's loads after the wait.
    arrived = tl.atomic_add(sync_ptr, 0, sem="acquire", scope="gpu")
    while arrived < num_writers:
        arrived = tl.atomic_add(sync_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


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
    # The seed's structure: one program per (group, batch position).
    group_id = tl.program_id(0)
    batch_idx = tl.program_id(1)
    stride = tl.load(block_table_strides + group_id)
    # Row batch_idx of this group's input table.
    dst_row_ptr = _load_ptr(dst_block_table_ptrs + group_id, tl.int32) + batch_idx * stride
    if batch_idx >= num_reqs:
        # A padded row (vLLM's later num_reqs_padded): zero it over this group's own width.
        for i in range(0, stride, BLOCK_SIZE):
            offset = i + tl.arange(0, BLOCK_SIZE)
            tl.store(dst_row_ptr + offset, tl.zeros([BLOCK_SIZE], tl.int32), mask=offset < stride)
        return
    req_idx = tl.load(batch_idx_to_req_idx + batch_idx)
    # num_blocks[group_id, req_idx]: how many columns of that request's row are real.
    num_blocks = tl.load(num_blocks_ptr + group_id * num_blocks_stride + req_idx)
    # Row req_idx of this group's persistent table.
    src_row_ptr = _load_ptr(src_block_table_ptrs + group_id, tl.int32) + req_idx * stride
    for i in tl.range(0, num_blocks, BLOCK_SIZE):
        offset = i + tl.arange(0, BLOCK_SIZE)
        block_ids = tl.load(src_row_ptr + offset, mask=offset < num_blocks)
        tl.store(dst_row_ptr + offset, block_ids, mask=offset < num_blocks)


@triton.jit(do_not_specialize=["num_reqs", "num_reqs_padded"])
def _gather_block_tables_fast_kernel(
    idx_mapping,              # [num_reqs]: the request state of each batch position
    src_block_table_ptrs,     # uint64 [num_groups]: persistent tables
    dst_block_table_ptrs,     # uint64 [num_groups]: input tables
    block_table_strides,      # int64 [num_groups]: row stride (= width)
    num_blocks_ptr,           # int32 [num_groups, max_num_reqs] (UVA, or its device copy)
    num_blocks_stride,
    num_reqs,
    num_reqs_padded,
    max_num_reqs,
    ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    # Ours: ROWS batch rows of one group per program, copied as [ROWS, BLOCK_COLS] tiles.
    _gather_rows_fast(tl.program_id(0), tl.program_id(1), idx_mapping, src_block_table_ptrs,
                      dst_block_table_ptrs, block_table_strides, num_blocks_ptr, num_blocks_stride,
                      num_reqs, num_reqs_padded, max_num_reqs, idx_mapping, 0, ROWS, BLOCK_COLS, False)


@triton.jit
def _gather_rows_fast(row_tile, group_id, idx_mapping, src_block_table_ptrs, dst_block_table_ptrs,
                      block_table_strides, num_blocks_ptr, num_blocks_stride, num_reqs, num_reqs_padded,
                      max_num_reqs, sync_ptr, num_writers, ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
                      WAIT: tl.constexpr):
    # Batch rows row_tile * ROWS .. + ROWS - 1 of group group_id.
    b = row_tile * ROWS + tl.arange(0, ROWS)                  # this program's batch rows
    real = b < num_reqs
    padded = (b >= num_reqs) & (b < num_reqs_padded)
    stride = tl.load(block_table_strides + group_id)          # also the table's width
    req = tl.load(idx_mapping + b, mask=real, other=0)
    # Never leave the table, even when the Python checks were skipped.
    real = real & (req >= 0) & (req < max_num_reqs)
    n = tl.load(num_blocks_ptr + group_id * num_blocks_stride + req, mask=real, other=0)
    n = tl.minimum(n, stride)
    # Columns to write per row: the request's block count, or the whole width of a padded row
    # (which is written with zeros: its loads below are masked off).
    ncols = tl.where(real, n, tl.where(padded, stride, 0))
    src_row = _load_ptr(src_block_table_ptrs + group_id, tl.int32) + req.to(tl.int64) * stride
    dst_row = _load_ptr(dst_block_table_ptrs + group_id, tl.int32) + b.to(tl.int64) * stride
    if WAIT:
        _wait_for_writes(sync_ptr, num_writers)      # single launch: the tables are being written
    for c in range(0, tl.max(ncols, axis=0), BLOCK_COLS):
        cols = c + tl.arange(0, BLOCK_COLS)
        mask = cols[None, :] < ncols[:, None]
        ids = tl.load(src_row[:, None] + cols[None, :], mask=mask & real[:, None], other=0)
        tl.store(dst_row[:, None] + cols[None, :], ids, mask=mask)


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
    # The seed's structure: program (group, request), and one extra program per group that pads.
    group_id = tl.program_id(0)
    req_idx = tl.program_id(1)
    slot_mapping_ptr = slot_mappings_ptr + group_id * slot_mappings_stride   # this group's row

    if req_idx == tl.num_programs(1) - 1:
        # req_idx == num_reqs: pad from the real token count query_start_loc[num_reqs] (upstream's
        # fix #36580; the seed started at positions.shape[0]) to the end, for CUDA graphs.
        num_tokens = tl.load(cu_num_tokens + req_idx)
        for i in range(num_tokens, max_num_tokens, BLOCK_SIZE):
            offset = i + tl.arange(0, BLOCK_SIZE)
            tl.store(slot_mapping_ptr + offset, PAD_ID, mask=offset < max_num_tokens)
        return

    block_table_ptr = _load_ptr(block_table_ptrs + group_id, tl.int32)
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
        # slot = block id * block size + offset, in 64 bits (the seed overflows int32 here).
        slot_ids = block_numbers.to(tl.int64) * page_size + positions % page_size
        tl.store(slot_mapping_ptr + offset, slot_ids, mask=mask)


@triton.jit(do_not_specialize=["num_reqs", "num_positions"])
def _compute_slot_mappings_fast_kernel(
    num_reqs,
    num_positions,            # len(positions)
    max_num_tokens,           # the slot mappings' length (max_num_batched_tokens)
    max_num_reqs,             # rows of the tables
    idx_mapping,              # [num_reqs] request state per batch position (HAS_IDX_MAPPING)
    cu_num_tokens,            # [num_reqs + 1] query_start_loc, rising from 0
    pos,                      # [num_positions] positions
    block_table_ptrs,         # uint64 [num_groups]
    block_table_strides,      # int64 [num_groups]
    page_sizes,               # int32 [num_groups]
    slot_mappings_ptr,        # int64 [num_groups, max_num_tokens]
    slot_mappings_stride,
    PAD_ID: tl.constexpr,
    HAS_IDX_MAPPING: tl.constexpr,
    NUM_GROUPS: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,   # ceil(log2(max_num_reqs + 1)): enough halvings of [0, num_reqs]
    QSL_BLOCK: tl.constexpr,      # a power of two > max_num_reqs
    BLOCK_TOKENS: tl.constexpr,
):
    # Ours: token-parallel (see _slot_tile_fast).
    _slot_tile_fast(tl.program_id(0), num_reqs, num_positions, max_num_tokens, max_num_reqs, idx_mapping,
                    cu_num_tokens, pos, block_table_ptrs, block_table_strides, page_sizes, slot_mappings_ptr,
                    slot_mappings_stride, idx_mapping, 0, PAD_ID, HAS_IDX_MAPPING, NUM_GROUPS, SEARCH_STEPS,
                    QSL_BLOCK, BLOCK_TOKENS, False)


@triton.jit
def _slot_tile_fast(tile, num_reqs, num_positions, max_num_tokens, max_num_reqs, idx_mapping, cu_num_tokens,
                    pos, block_table_ptrs, block_table_strides, page_sizes, slot_mappings_ptr,
                    slot_mappings_stride, sync_ptr, num_writers, PAD_ID: tl.constexpr,
                    HAS_IDX_MAPPING: tl.constexpr, NUM_GROUPS: tl.constexpr, SEARCH_STEPS: tl.constexpr,
                    QSL_BLOCK: tl.constexpr, BLOCK_TOKENS: tl.constexpr, WAIT: tl.constexpr):
    # Ours: token-parallel. Each program takes BLOCK_TOKENS slots of the mapping (real tokens
    # and padding alike), finds each token's request, and writes every group's slot. The kernel
    # is a chain of dependent loads, so what matters is how many of them wait on memory.
    t = tile * BLOCK_TOKENS + tl.arange(0, BLOCK_TOKENS)
    in_buffer = t < max_num_tokens
    # Loads that depend on nothing else go first, so their latencies overlap: the positions...
    positions = tl.load(pos + t, mask=t < num_positions, other=0)
    # ...and all of query_start_loc in one vector load (its cache lines arrive together; the
    # binary search below then hits the cache instead of waiting on memory at every step).
    # It rises from 0, so its largest entry, query_start_loc[num_reqs], is the real token count.
    r = tl.arange(0, QSL_BLOCK)
    cu_all = tl.load(cu_num_tokens + r, mask=r <= num_reqs, other=0)
    num_tokens = tl.max(cu_all, axis=0)
    real = t < num_tokens

    # Token t's batch position b is the last one starting at or before t:
    # the largest b in [0, num_reqs] with cu_num_tokens[b] <= t (b < num_reqs for a real token,
    # and empty requests are skipped since their start equals the next one's).
    # Branch-free binary search, all lanes at once; invariant: cu[lo] <= t and b <= hi.
    lo = tl.zeros([BLOCK_TOKENS], tl.int32)
    hi = tl.zeros([BLOCK_TOKENS], tl.int32) + num_reqs
    for _ in tl.static_range(SEARCH_STEPS):
        mid = (lo + hi + 1) // 2                                # upper middle: lo < mid <= hi while lo < hi
        starts = tl.load(cu_num_tokens + mid, mask=real, other=0)
        go_right = starts <= t
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid - 1)
    batch_idx = tl.minimum(lo, num_reqs - 1)                    # (only malformed input needs the clamp)

    if HAS_IDX_MAPPING:
        row = tl.load(idx_mapping + batch_idx, mask=real, other=0)   # persistent table row
    else:
        row = batch_idx                                               # gathered table row
    row = row.to(tl.int64)
    # Never leave the tables, even when the Python checks were skipped.
    real_row = real & (row >= 0) & (row < max_num_reqs)

    if WAIT:
        _wait_for_writes(sync_ptr, num_writers)      # single launch: the tables are being written
    for g in tl.static_range(NUM_GROUPS):
        table = _load_ptr(block_table_ptrs + g, tl.int32)
        stride = tl.load(block_table_strides + g)
        page_size = tl.load(page_sizes + g)
        block_indices = positions // page_size                  # column of the token's block
        ok = real_row & (block_indices < stride)
        block_numbers = tl.load(table + row * stride + block_indices, mask=ok, other=0)
        slot_ids = block_numbers.to(tl.int64) * page_size + positions % page_size
        slot_ids = tl.where(real, slot_ids, PAD_ID)             # padding tokens: PAD_SLOT_ID
        tl.store(slot_mappings_ptr + g * slot_mappings_stride + t, slot_ids, mask=in_buffer)


@triton.jit(do_not_specialize=["num_reqs", "num_reqs_padded", "num_positions", "num_slot_programs",
                               "gather_tiles"])
def _gather_and_slots_fast_kernel(
    idx_mapping,              # [num_reqs]: the request state of each batch position
    src_block_table_ptrs,     # uint64 [num_groups]: persistent tables
    dst_block_table_ptrs,     # uint64 [num_groups]: input tables
    block_table_strides,      # int64 [num_groups]
    num_blocks_ptr,           # int32 [num_groups, max_num_reqs]
    num_blocks_stride,
    num_reqs,
    num_reqs_padded,
    max_num_reqs,
    num_positions,
    max_num_tokens,
    cu_num_tokens,            # [num_reqs + 1] query_start_loc
    pos,                      # [num_positions]
    page_sizes,               # int32 [num_groups]
    slot_mappings_ptr,        # int64 [num_groups, max_num_tokens]
    slot_mappings_stride,
    num_slot_programs,        # programs 0 .. num_slot_programs-1 compute slots, the rest gather
    gather_tiles,             # gather programs per group
    PAD_ID: tl.constexpr,
    NUM_GROUPS: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
    QSL_BLOCK: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    # Ours: the gather and the slot mapping in one launch. They are independent: the slots are
    # read from the persistent tables through idx_mapping, not from the gathered ones, so no
    # program waits for another. Slot programs first: theirs is the longer chain of loads.
    pid = tl.program_id(0)
    if pid < num_slot_programs:
        _slot_tile_fast(pid, num_reqs, num_positions, max_num_tokens, max_num_reqs, idx_mapping, cu_num_tokens,
                        pos, src_block_table_ptrs, block_table_strides, page_sizes, slot_mappings_ptr,
                        slot_mappings_stride, idx_mapping, 0, PAD_ID, True, NUM_GROUPS, SEARCH_STEPS, QSL_BLOCK,
                        BLOCK_TOKENS, False)
    else:
        g = pid - num_slot_programs
        _gather_rows_fast(g % gather_tiles, g // gather_tiles, idx_mapping, src_block_table_ptrs,
                          dst_block_table_ptrs, block_table_strides, num_blocks_ptr, num_blocks_stride,
                          num_reqs, num_reqs_padded, max_num_reqs, idx_mapping, 0, ROWS, BLOCK_COLS, False)


@triton.jit(do_not_specialize=["num_reqs", "num_reqs_padded", "num_positions", "num_write_programs",
                               "num_slot_programs", "gather_tiles"])
def _whole_step_fast_kernel(
    packed_ptr,               # the step's packed writes and counts (UVA; see pack_staged_writes)
    max_writes,
    counts_dst,               # int32 [num_groups * max_num_reqs]: the counts' copy in device memory
    num_counts,
    sync_ptr,                 # int32 [2], zero between launches: writers arrived, programs done
    idx_mapping,
    src_block_table_ptrs,
    dst_block_table_ptrs,
    block_table_strides,
    num_reqs,
    num_reqs_padded,
    max_num_reqs,
    num_positions,
    max_num_tokens,
    cu_num_tokens,
    pos,
    page_sizes,
    slot_mappings_ptr,
    slot_mappings_stride,
    num_write_programs,       # programs: writes | counts | slots | gather
    num_slot_programs,
    gather_tiles,
    PAD_ID: tl.constexpr,
    NUM_GROUPS: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
    QSL_BLOCK: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    WRITES_PER_PROGRAM: tl.constexpr,
    WRITE_BLOCK: tl.constexpr,
    COUNTS_BLOCK: tl.constexpr,
    STRIDED: tl.constexpr,
):
    # Ours, experimental: the whole step in one launch. The write programs (the lowest ids, so
    # the GPU starts them first) apply the staged writes and signal; the slot and gather
    # programs do everything that does not read the tables (the binary search, idx_mapping, the
    # counts, read straight from the packed buffer) and wait for every signal before reading
    # them. The last program to finish resets the two counters for the next launch.
    pid = tl.program_id(0)
    num_count_programs = tl.cdiv(num_counts, COUNTS_BLOCK)
    if pid < num_write_programs:
        _apply_writes(pid, num_write_programs, packed_ptr, max_writes, src_block_table_ptrs, block_table_strides,
                      num_counts, NUM_GROUPS, WRITES_PER_PROGRAM, WRITE_BLOCK, STRIDED)
        tl.debug_barrier()                               # every thread's stores issued...
        tl.atomic_add(sync_ptr, 1, sem="release", scope="gpu")   # ...and visible before the signal
    elif pid < num_write_programs + num_count_programs:
        _copy_counts(pid - num_write_programs, packed_ptr, max_writes, counts_dst, num_counts, COUNTS_BLOCK)
    elif pid < num_write_programs + num_count_programs + num_slot_programs:
        _slot_tile_fast(pid - num_write_programs - num_count_programs, num_reqs, num_positions, max_num_tokens,
                        max_num_reqs, idx_mapping, cu_num_tokens, pos, src_block_table_ptrs, block_table_strides,
                        page_sizes, slot_mappings_ptr, slot_mappings_stride, sync_ptr, num_write_programs,
                        PAD_ID, True, NUM_GROUPS, SEARCH_STEPS, QSL_BLOCK, BLOCK_TOKENS, True)
    else:
        g = pid - num_write_programs - num_count_programs - num_slot_programs
        _gather_rows_fast(g % gather_tiles, g // gather_tiles, idx_mapping, src_block_table_ptrs,
                          dst_block_table_ptrs, block_table_strides, packed_ptr + 1 + 5 * max_writes,
                          max_num_reqs, num_reqs, num_reqs_padded, max_num_reqs, sync_ptr, num_write_programs,
                          ROWS, BLOCK_COLS, True)
    done = tl.atomic_add(sync_ptr + 1, 1, sem="acq_rel", scope="gpu")
    if done == tl.num_programs(0) - 1:
        # Everyone is past the wait: reset for the next launch (the kernel's end publishes it).
        tl.store(sync_ptr, 0)
        tl.store(sync_ptr + 1, 0)
