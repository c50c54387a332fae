"""Our faster kernels for v2's block tables: ``FastBlockTables``, a ``BlockTables`` that runs them
(``make_block_tables(..., impl="triton")``, the default there).

The same tables, the same results; what changes is how the work is cut into launches and
programs. These kernels move a few KB to a few MB, so they are latency-bound: what they cost is
launches and chains of loads that wait on memory, and that is what each of ours cuts.

* **Apply**: the staged writes of every group in one launch (vLLM's code has a TODO for it).
  ``pack_staged_writes`` (host) packs every write and the just-published counts into one UVA
  buffer at fixed offsets; ``launch_staged_writes`` (device) applies them, several writes per
  program, and the same launch copies the counts into device memory.
* **Gather**: several rows per program, the counts read from that device copy rather than over
  the bus.
* **Slot mapping**: token-parallel. Each program takes a tile of slots, loads all of
  ``query_start_loc`` at once, finds each token's request by binary search in it, and writes every
  group: a decode batch of 1024 one-token requests needs a few programs, not ``2 * 1025``.
* ``gather_and_compute_slot_mappings``: the gather and the slot mapping in one launch (the slots
  read the persistent tables through ``idx_mapping``, so the two halves do not wait on each other).

CUDA graphs: the apply's device half can be captured (``launch_staged_writes``), and so can the
gather, which reads the counts from a device buffer with a fixed address. These kernels also
mask every access that could leave a table, so ``check=False`` cannot make them write elsewhere.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence, Union

import torch
import triton
import triton.language as tl

from paged_attention.triton_launch import Launcher
from paged_attention.utils import PAD_SLOT_ID, cdiv, check_int, is_int, next_power_of_2
from paged_attention.v2.block_table import BlockTables
from paged_attention.v2.buffers import UvaBufferPool
from paged_attention.v2.common import SlotProgram, capturing, load_ptr


class FastBlockTables(BlockTables):
    """``BlockTables`` with our kernels (see the module docstring): the same constructor, the same
    results.

    Launch shapes (attributes, so a benchmark can sweep them): big tiles in the interpreter (it
    pays per program and per operation, hardly per element), small ones on a GPU (more programs
    in flight). ``write_rows`` writes per apply program, ``capture_write_programs`` programs of
    ``capture_write_rows`` writes when the apply is captured in a CUDA graph, ``gather_rows`` rows
    and ``gather_block_cols`` columns per gather tile, ``slot_block_tokens`` slots per tile.
    """

    impl = "triton"

    def __init__(self, block_sizes: Sequence[int], max_num_reqs: int, max_num_batched_tokens: int,
                 max_model_len: int, device: Union[torch.device, str]) -> None:
        super().__init__(block_sizes, max_num_reqs, max_num_batched_tokens, max_model_len, device)
        # One packed buffer of all groups' staged writes, read by the apply through UVA; it
        # grows (rarely) when a step stages more values than it holds.
        self._write_pool: Optional[UvaBufferPool] = None
        # The published counts in device memory, refreshed by every apply. The gather reads them
        # while num_blocks.gpu is still the buffer they were copied from (a later copy_to_uva
        # re-binds .gpu, and then the gather reads .gpu, over the bus).
        self._num_blocks_device = torch.zeros(self.num_kv_cache_groups, self.max_num_reqs, dtype=torch.int32,
                                              device=self._device)
        self._num_blocks_device_source: Optional[torch.Tensor] = None
        # The counts' bytes as the last apply published them (its skip compares against them:
        # two bytes objects of 1 KB compare in a fraction of numpy's array_equal time).
        self._published_counts = self.num_blocks.np.tobytes()
        # Launchers and the views handed back, made once per key (see _once).
        self._made: dict[tuple, object] = {}
        # The binary search: enough halvings of [0, max_num_reqs], and a power of two covering
        # query_start_loc (computed once: host time per call counts).
        self._search_steps = max(1, self.max_num_reqs.bit_length())
        self._qsl_block = next_power_of_2(self.max_num_reqs + 1)
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

    # ---- Applying ---------------------------------------------------------------------------------
    def apply_staged_writes(self) -> None:
        """Publish the counts, then apply every group's staged writes in exactly one launch (one
        even with nothing staged: it also copies the counts into device memory), or in none
        when there is nothing to do: no write staged, the counts the last apply published, still
        bound to ``num_blocks.gpu``, and no capture under way. Most decode steps are such steps
        (a request gains a block every ``block_size`` tokens), and they skip the packing, the
        counts' copy and the launch."""
        if (self._num_blocks_device_source is self.num_blocks.gpu
                and not any(table.num_staged_writes for table in self.block_tables)
                and self.num_blocks.np.tobytes() == self._published_counts
                and not capturing(self._device)):
            return
        self.num_blocks.copy_to_uva()
        self.launch_staged_writes(self.pack_staged_writes())
        self._published_counts = self.num_blocks.np.tobytes()

    @property
    def _max_writes(self) -> int:
        # At most max_num_reqs writes per table between applies (StagedWriteTensor's limit).
        return self.num_kv_cache_groups * self.max_num_reqs

    def pack_staged_writes(self) -> tuple[torch.Tensor, int]:
        """The apply's host half: pop every group's staged writes and pack them, with the counts
        in ``num_blocks.np``, into the next buffer of a UVA pool; return ``(buffer, num_writes)``
        for ``launch_staged_writes``. Call ``num_blocks.copy_to_uva()`` first.

        The int32 buffer, with ``W = num_groups * max_num_reqs`` (the most writes that can be
        staged) and ``C`` counts: ``[num_writes | groups (W) | rows (W) | starts (W) | ends (W) |
        firsts (W) | counts (C) | values]``. Write k's ids are ``values[ends[k-1] : ends[k]]``
        (``ends[-1]`` read as 0), and ``firsts[k]`` repeats the first of them, so that a one-block
        write (the usual one) arrives with its description in one trip over the bus. The count
        is *in* the buffer and no offset depends on it, so a launch captured in a CUDA graph
        applies whatever the buffer holds at replay."""
        groups: list[int] = []
        rows: list[int] = []
        starts: list[int] = []
        ends: list[int] = []
        contents: list[int] = []
        for g, table in enumerate(self.block_tables):
            indices, table_starts, table_contents, cu_lens = table.pop_staged_writes()
            base = len(contents)
            groups += [g] * len(indices)
            rows += indices
            starts += table_starts
            ends += [base + c for c in cu_lens]
            contents += table_contents
        n = len(rows)
        w, c = self._max_writes, self.num_blocks.np.size
        values_at = 1 + 5 * w + c
        buf = self._packed_write_pool(values_at + len(contents)).next_buffer()
        packed = buf.np
        packed[0] = n
        if n:
            # Array j of the five per-write arrays starts at 1 + j * w.
            packed[1:1 + n] = groups
            packed[1 + w:1 + w + n] = rows
            packed[1 + 2 * w:1 + 2 * w + n] = starts
            packed[1 + 3 * w:1 + 3 * w + n] = ends
            values = packed[values_at:values_at + len(contents)]
            values[:] = contents
            # firsts[k] = values[ends[k-1]] (no write is empty, so firsts[0] = values[0]).
            packed[1 + 4 * w] = values[0]
            packed[2 + 4 * w:1 + 4 * w + n] = values[packed[1 + 3 * w:3 * w + n]]
        packed[1 + 5 * w:values_at] = self.num_blocks.np.reshape(-1)
        self._num_blocks_device_source = self.num_blocks.gpu
        return buf.uva, n

    def launch_staged_writes(self, packed: tuple[torch.Tensor, int]) -> None:
        """The apply's device half: one launch that applies the writes ``pack_staged_writes``
        packed and copies the counts into device memory.

        Eagerly the grid has ``cdiv(num_writes, write_rows)`` write programs. Under CUDA-graph
        capture the count is not known yet: a few programs (``capture_write_programs``) loop over
        tiles of ``capture_write_rows`` writes up to the count they read at replay. The graph
        holds the buffer's address and the pool alternates between two buffers, so capture one
        graph per pool buffer and replay the one just packed; a pool that grows moves, and the
        graphs must then be captured again."""
        buf, n = packed
        num_counts = self.num_blocks.np.size
        captured = capturing(self._device)
        if captured:
            rows = self.capture_write_rows
            num_write_programs = min(self.capture_write_programs, cdiv(self._max_writes, rows))
        else:
            rows = self.write_rows
            num_write_programs = cdiv(n, rows)
        launch = self._once(("apply", captured, rows, self.write_block, self.counts_block), lambda: Launcher(
            _apply_block_table_writes_kernel, ("packed_ptr", "num_write_programs"),
            max_writes=self._max_writes, table_ptrs=self.block_table_ptrs, table_strides=self.block_table_strides,
            counts_dst=self._num_blocks_device, num_counts=num_counts, NUM_GROUPS=self.num_kv_cache_groups,
            WRITES_PER_PROGRAM=rows, BLOCK_SIZE=self.write_block, COUNTS_BLOCK=self.counts_block, STRIDED=captured))
        launch((num_write_programs + cdiv(num_counts, self.counts_block),), buf, num_write_programs)

    def _once(self, key: tuple, make: Callable[[], object]) -> object:
        """What ``make()`` made for ``key`` the first time. Keys name a kernel's ``Launcher`` with
        the tile attributes it is built with (later launches skip Triton's argument binding, and
        this object's fixed arguments are not gathered again: see ``paged_attention.triton_launch``), or
        a view handed back (slicing a tensor costs microseconds of host time, every step)."""
        made = self._made.get(key)
        if made is None:
            made = self._made[key] = make()
        return made

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

    # ---- Gathering and slot mappings ----------------------------------------------------------------
    def _counts(self) -> torch.Tensor:
        """The published counts: the device copy made by the last apply while ``num_blocks.gpu``
        is still the buffer it copied (same contents), else ``num_blocks.gpu`` itself."""
        if self._num_blocks_device_source is self.num_blocks.gpu:
            return self._num_blocks_device
        return self.num_blocks.gpu

    def gather_block_tables(self, idx_mapping: torch.Tensor, num_reqs_padded: Optional[int] = None, *,
                            check: bool = True) -> tuple[torch.Tensor, ...]:
        """As ``BlockTables.gather_block_tables``, with tiles of ``gather_rows`` rows. Captured
        in a CUDA graph it stays right in later replays (the counts' device copy has a fixed
        address; give it a fixed ``idx_mapping`` buffer, updated in place)."""
        num_reqs, num_reqs_padded = self._check_gather(idx_mapping, num_reqs_padded, check)
        if num_reqs_padded > 0:
            num_blocks = self._counts()
            launch = self._once(("gather", self.gather_rows, self.gather_block_cols), lambda: Launcher(
                _gather_block_tables_fast_kernel, ("idx_mapping", "num_blocks_ptr", "num_reqs", "num_reqs_padded"),
                src_block_table_ptrs=self.block_table_ptrs, dst_block_table_ptrs=self.input_block_table_ptrs,
                block_table_strides=self.block_table_strides, num_blocks_stride=self.max_num_reqs,
                max_num_reqs=self.max_num_reqs, ROWS=self.gather_rows, BLOCK_COLS=self.gather_block_cols))
            launch((cdiv(num_reqs_padded, self.gather_rows), self.num_kv_cache_groups), idx_mapping, num_blocks,
                   num_reqs, num_reqs_padded)
        return self._gathered(num_reqs, num_reqs_padded)

    def compute_slot_mappings(self, query_start_loc: torch.Tensor, positions: torch.Tensor, *,
                              idx_mapping: Optional[torch.Tensor] = None, num_tokens_padded: Optional[int] = None,
                              check: bool = True) -> torch.Tensor:
        """As ``BlockTables.compute_slot_mappings``, token-parallel: ``cdiv(max_num_batched_tokens,
        slot_block_tokens)`` programs, whatever the batch."""
        num_reqs, num_tokens, num_tokens_padded = self._check_slot_mappings(
            query_start_loc, positions, idx_mapping, num_tokens_padded, check)
        has_idx = idx_mapping is not None
        launch = self._once(("slots", has_idx, self.slot_block_tokens), lambda: Launcher(
            _compute_slot_mappings_fast_kernel, ("num_reqs", "num_positions", "idx_mapping", "cu_num_tokens", "pos"),
            max_num_tokens=self.max_num_batched_tokens, max_num_reqs=self.max_num_reqs,
            block_table_ptrs=self.block_table_ptrs if has_idx else self.input_block_table_ptrs,
            block_table_strides=self.block_table_strides, page_sizes=self.block_sizes_tensor,
            slot_mappings_ptr=self.slot_mappings, slot_mappings_stride=self.slot_mappings.stride(0),
            PAD_ID=PAD_SLOT_ID, HAS_IDX_MAPPING=has_idx, NUM_GROUPS=self.num_kv_cache_groups,
            SEARCH_STEPS=self._search_steps, QSL_BLOCK=self._qsl_block, BLOCK_TOKENS=self.slot_block_tokens))
        launch((cdiv(self.max_num_batched_tokens, self.slot_block_tokens),), num_reqs, num_tokens,
               idx_mapping if has_idx else query_start_loc, query_start_loc, positions)
        return self._slot_view(num_tokens_padded)

    def gather_and_compute_slot_mappings(
            self, idx_mapping: torch.Tensor, query_start_loc: torch.Tensor, positions: torch.Tensor, *,
            num_reqs_padded: Optional[int] = None, num_tokens_padded: Optional[int] = None,
            check: bool = True) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """``gather_block_tables(idx_mapping, num_reqs_padded)`` and ``compute_slot_mappings(
        query_start_loc, positions, idx_mapping=idx_mapping)`` in **one** launch, with the same
        checks and results. The slots read the persistent tables, so the two halves' programs run
        side by side: one launch and one kernel's latency per step instead of two."""
        num_reqs, num_tokens, num_tokens_padded = self._check_slot_mappings(
            query_start_loc, positions, idx_mapping, num_tokens_padded, check)
        # idx_mapping was checked with the slots; only the padded count is left to check.
        if num_reqs_padded is None:
            num_reqs_padded = num_reqs
        elif not (is_int(num_reqs_padded) and num_reqs <= num_reqs_padded <= self.max_num_reqs):
            self._check_gather(idx_mapping, num_reqs_padded, False)     # raises, saying why
        num_blocks = self._counts()
        num_slot_programs = cdiv(self.max_num_batched_tokens, self.slot_block_tokens)
        gather_tiles = cdiv(num_reqs_padded, self.gather_rows)
        key = ("fused", self.slot_block_tokens, self.gather_rows, self.gather_block_cols)
        launch = self._once(key, lambda: Launcher(
            _gather_and_slots_fast_kernel,
            ("idx_mapping", "num_blocks_ptr", "num_reqs", "num_reqs_padded", "num_positions", "cu_num_tokens", "pos",
             "gather_tiles"),
            src_block_table_ptrs=self.block_table_ptrs, dst_block_table_ptrs=self.input_block_table_ptrs,
            block_table_strides=self.block_table_strides, num_blocks_stride=self.max_num_reqs,
            max_num_reqs=self.max_num_reqs, max_num_tokens=self.max_num_batched_tokens,
            page_sizes=self.block_sizes_tensor, slot_mappings_ptr=self.slot_mappings,
            slot_mappings_stride=self.slot_mappings.stride(0), num_slot_programs=num_slot_programs,
            PAD_ID=PAD_SLOT_ID, NUM_GROUPS=self.num_kv_cache_groups, SEARCH_STEPS=self._search_steps,
            QSL_BLOCK=self._qsl_block, BLOCK_TOKENS=self.slot_block_tokens, ROWS=self.gather_rows,
            BLOCK_COLS=self.gather_block_cols))
        launch((num_slot_programs + gather_tiles * self.num_kv_cache_groups,), idx_mapping, num_blocks, num_reqs,
               num_reqs_padded, num_tokens, query_start_loc, positions, max(gather_tiles, 1))
        return self._gathered(num_reqs, num_reqs_padded), self._slot_view(num_tokens_padded)

    def _gathered(self, num_reqs: int, num_reqs_padded: int) -> tuple[torch.Tensor, ...]:
        self._num_gathered_reqs = num_reqs
        return self._once(("table views", num_reqs_padded), lambda: super(FastBlockTables, self)._gathered(
            num_reqs, num_reqs_padded))

    def _slot_view(self, num_tokens: int) -> torch.Tensor:
        return self._once(("slot view", num_tokens), lambda: self.slot_mappings[:, :num_tokens])

def fast_slot_programs(max_num_tokens: int, block_tokens: int) -> list[SlotProgram]:
    """The programs of ``_compute_slot_mappings_fast_kernel``, grid ``(cdiv(max_num_tokens,
    block_tokens),)``: program ``p`` takes slots ``p * block_tokens`` onwards, finds each one's
    request (or pads it), and writes it in every group."""
    max_num_tokens = check_int("max_num_tokens", max_num_tokens, minimum=1)
    block_tokens = check_int("block_tokens", block_tokens, minimum=1)
    return [SlotProgram((p,), None, p * block_tokens, min((p + 1) * block_tokens, max_num_tokens), "tile")
            for p in range(cdiv(max_num_tokens, block_tokens))]


# ---- Kernels: the apply ---------------------------------------------------------------------------
@triton.jit(do_not_specialize=["num_write_programs"])
def _apply_block_table_writes_kernel(
    packed_ptr,          # int32, laid out as pack_staged_writes says
    max_writes,          # room for writes in each of the five per-write arrays
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
    pid = tl.program_id(0)
    if pid >= num_write_programs:
        # Counts k .. k + COUNTS_BLOCK - 1 (both are [groups, max_num_reqs], contiguous), read
        # after the header and the five per-write arrays.
        k = (pid - num_write_programs) * COUNTS_BLOCK + tl.arange(0, COUNTS_BLOCK)
        in_range = k < num_counts
        tl.store(counts_dst + k, tl.load(packed_ptr + 1 + 5 * max_writes + k, mask=in_range), mask=in_range)
        return
    # Tile k holds writes k * WRITES_PER_PROGRAM .. (k + 1) * WRITES_PER_PROGRAM - 1. Eagerly the
    # grid fits the write count and program pid does tile pid. Captured (STRIDED), program pid
    # also does tiles pid + P, pid + 2P, ... (P = num_write_programs) up to the last tile that
    # holds a write; its first tile goes before the count is read, so that the count and that
    # tile's descriptions cross the bus together.
    _apply_writes_tile(tile=pid, packed_ptr=packed_ptr, max_writes=max_writes, table_ptrs=table_ptrs,
                       table_strides=table_strides, num_counts=num_counts, NUM_GROUPS=NUM_GROUPS,
                       WRITES_PER_PROGRAM=WRITES_PER_PROGRAM, BLOCK_SIZE=BLOCK_SIZE)
    if STRIDED:
        num_tiles = tl.cdiv(tl.load(packed_ptr), WRITES_PER_PROGRAM)
        for tile in range(pid + num_write_programs, num_tiles, num_write_programs):
            _apply_writes_tile(tile=tile, packed_ptr=packed_ptr, max_writes=max_writes, table_ptrs=table_ptrs,
                               table_strides=table_strides, num_counts=num_counts, NUM_GROUPS=NUM_GROUPS,
                               WRITES_PER_PROGRAM=WRITES_PER_PROGRAM, BLOCK_SIZE=BLOCK_SIZE)


@triton.jit
def _apply_writes_tile(tile, packed_ptr, max_writes, table_ptrs, table_strides, num_counts,
                       NUM_GROUPS: tl.constexpr, WRITES_PER_PROGRAM: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    # Writes tile * WRITES_PER_PROGRAM .. + WRITES_PER_PROGRAM - 1, as a [writes, columns] tile.
    w = tile * WRITES_PER_PROGRAM + tl.arange(0, WRITES_PER_PROGRAM)
    room = w < max_writes
    num_writes = tl.load(packed_ptr)
    # The loads below do not wait for the count (array j starts at 1 + j * max_writes), so they
    # all cross the bus with it; entries past the count (stale ones) are masked off afterwards.
    group = tl.load(packed_ptr + 1 + w, mask=room, other=0)
    row = tl.load(packed_ptr + 1 + max_writes + w, mask=room, other=0)
    start = tl.load(packed_ptr + 1 + 2 * max_writes + w, mask=room, other=0)
    end = tl.load(packed_ptr + 1 + 3 * max_writes + w, mask=room, other=0)
    # Write w's ids are values[ends[w-1] : ends[w]] (the first write's begin at 0)...
    begin = tl.load(packed_ptr + 1 + 3 * max_writes + w - 1, mask=room & (w > 0), other=0)
    # ...and its first id is also in firsts: a one-block write needs nothing from the values
    # region, whose address depends on begin (a second trip over the bus).
    first = tl.load(packed_ptr + 1 + 4 * max_writes + w, mask=room, other=0)
    valid = room & (w < num_writes)
    length = tl.where(valid, end - begin, 0)
    values_ptr = packed_ptr + 1 + 5 * max_writes + num_counts
    # Each write's table and row stride, picked from the NUM_GROUPS ones loaded up front (they
    # do not depend on the buffer, so their loads overlap the bus's).
    table_bits = tl.zeros([WRITES_PER_PROGRAM], tl.uint64)
    stride = tl.zeros([WRITES_PER_PROGRAM], tl.int64)
    for g in tl.static_range(NUM_GROUPS):
        table_bits = tl.where(group == g, tl.load(table_ptrs + g), table_bits)
        stride = tl.where(group == g, tl.load(table_strides + g), stride)
    table = tl.cast(table_bits, tl.pointer_type(tl.int32))
    # Element `start` of row `row` of that table: the write's column 0.
    dst = table + row.to(tl.int64) * stride + start
    tl.store(dst, first, mask=length > 0)
    # Columns 1 .. length-1 from the values region (a new request's write, not a decode step's).
    for c in range(1, tl.max(length, axis=0), BLOCK_SIZE):
        cols = c + tl.arange(0, BLOCK_SIZE)
        mask = cols[None, :] < length[:, None]
        ids = tl.load(values_ptr + begin[:, None] + cols[None, :], mask=mask)
        tl.store(dst[:, None] + cols[None, :], ids, mask=mask)


# ---- Kernels: the gather and the slot mapping ----------------------------------------------------
@triton.jit(do_not_specialize=["num_reqs", "num_reqs_padded"])
def _gather_block_tables_fast_kernel(idx_mapping, src_block_table_ptrs, dst_block_table_ptrs,
                                     block_table_strides, num_blocks_ptr, num_blocks_stride, num_reqs,
                                     num_reqs_padded, max_num_reqs, ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    # ROWS batch rows of one group per program (grid: row tiles x groups).
    _gather_rows(row_tile=tl.program_id(0), group_id=tl.program_id(1), idx_mapping=idx_mapping,
                 src_block_table_ptrs=src_block_table_ptrs, dst_block_table_ptrs=dst_block_table_ptrs,
                 block_table_strides=block_table_strides, num_blocks_ptr=num_blocks_ptr,
                 num_blocks_stride=num_blocks_stride, num_reqs=num_reqs, num_reqs_padded=num_reqs_padded,
                 max_num_reqs=max_num_reqs, ROWS=ROWS, BLOCK_COLS=BLOCK_COLS)


@triton.jit
def _gather_rows(row_tile, group_id, idx_mapping, src_block_table_ptrs, dst_block_table_ptrs, block_table_strides,
                 num_blocks_ptr, num_blocks_stride, num_reqs, num_reqs_padded, max_num_reqs,
                 ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    # Batch rows row_tile * ROWS .. + ROWS - 1 of group group_id, copied as [ROWS, BLOCK_COLS] tiles.
    b = row_tile * ROWS + tl.arange(0, ROWS)
    real = b < num_reqs
    padded = (b >= num_reqs) & (b < num_reqs_padded)
    stride = tl.load(block_table_strides + group_id)          # also the table's width
    req = tl.load(idx_mapping + b, mask=real, other=0)
    real = real & (req >= 0) & (req < max_num_reqs)          # never leave the table
    n = tl.load(num_blocks_ptr + group_id * num_blocks_stride + req, mask=real, other=0)
    n = tl.minimum(n, stride)
    # Columns to write per row: the request's count, or a padded row's whole width (zeros: its
    # loads below are masked off).
    ncols = tl.where(real, n, tl.where(padded, stride, 0))
    src_row = load_ptr(src_block_table_ptrs + group_id, tl.int32) + req.to(tl.int64) * stride
    dst_row = load_ptr(dst_block_table_ptrs + group_id, tl.int32) + b.to(tl.int64) * stride
    for c in range(0, tl.max(ncols, axis=0), BLOCK_COLS):
        cols = c + tl.arange(0, BLOCK_COLS)
        mask = cols[None, :] < ncols[:, None]
        ids = tl.load(src_row[:, None] + cols[None, :], mask=mask & real[:, None], other=0)
        tl.store(dst_row[:, None] + cols[None, :], ids, mask=mask)


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
    _slot_tile(tile=tl.program_id(0), num_reqs=num_reqs, num_positions=num_positions, max_num_tokens=max_num_tokens,
               max_num_reqs=max_num_reqs, idx_mapping=idx_mapping, cu_num_tokens=cu_num_tokens, pos=pos,
               block_table_ptrs=block_table_ptrs, block_table_strides=block_table_strides, page_sizes=page_sizes,
               slot_mappings_ptr=slot_mappings_ptr, slot_mappings_stride=slot_mappings_stride, PAD_ID=PAD_ID,
               HAS_IDX_MAPPING=HAS_IDX_MAPPING, NUM_GROUPS=NUM_GROUPS, SEARCH_STEPS=SEARCH_STEPS,
               QSL_BLOCK=QSL_BLOCK, BLOCK_TOKENS=BLOCK_TOKENS)


@triton.jit
def _slot_tile(tile, num_reqs, num_positions, max_num_tokens, max_num_reqs, idx_mapping, cu_num_tokens, pos,
               block_table_ptrs, block_table_strides, page_sizes, slot_mappings_ptr, slot_mappings_stride,
               PAD_ID: tl.constexpr, HAS_IDX_MAPPING: tl.constexpr, NUM_GROUPS: tl.constexpr,
               SEARCH_STEPS: tl.constexpr, QSL_BLOCK: tl.constexpr, BLOCK_TOKENS: tl.constexpr):
    # Slots tile * BLOCK_TOKENS .. + BLOCK_TOKENS - 1 (real tokens and padding alike), in every
    # group. A chain of dependent loads: what matters is how many of them wait on memory.
    t = tile * BLOCK_TOKENS + tl.arange(0, BLOCK_TOKENS)
    in_buffer = t < max_num_tokens
    # Loads that depend on nothing go first, so their latencies overlap: the positions, and all
    # of query_start_loc in one vector load (the binary search then hits the cache). It rises
    # from 0, so its largest entry, query_start_loc[num_reqs], is the real token count.
    positions = tl.load(pos + t, mask=t < num_positions, other=0)
    r = tl.arange(0, QSL_BLOCK)
    cu_all = tl.load(cu_num_tokens + r, mask=r <= num_reqs, other=0)
    num_tokens = tl.max(cu_all, axis=0)
    real = t < num_tokens

    # Token t's batch position is the largest b in [0, num_reqs] with cu_num_tokens[b] <= t
    # (empty requests are skipped: their start equals the next one's). A branch-free binary
    # search, all lanes at once; invariant: cu[lo] <= t and b <= hi.
    lo = tl.zeros([BLOCK_TOKENS], tl.int32)
    hi = tl.zeros([BLOCK_TOKENS], tl.int32) + num_reqs
    for _ in tl.static_range(SEARCH_STEPS):
        mid = (lo + hi + 1) // 2                                # upper middle: lo < mid <= hi while lo < hi
        go_right = tl.load(cu_num_tokens + mid, mask=real, other=0) <= t
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid - 1)
    batch_idx = tl.minimum(lo, num_reqs - 1)                    # (only malformed input needs the clamp)

    if HAS_IDX_MAPPING:
        row = tl.load(idx_mapping + batch_idx, mask=real, other=0)   # persistent table row
    else:
        row = batch_idx                                               # gathered table row
    row = row.to(tl.int64)
    real_row = real & (row >= 0) & (row < max_num_reqs)              # never leave the tables
    for g in tl.static_range(NUM_GROUPS):
        table = load_ptr(block_table_ptrs + g, tl.int32)
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
    idx_mapping, src_block_table_ptrs, dst_block_table_ptrs, block_table_strides, num_blocks_ptr,
    num_blocks_stride, num_reqs, num_reqs_padded, max_num_reqs, num_positions, max_num_tokens, cu_num_tokens,
    pos, page_sizes, slot_mappings_ptr, slot_mappings_stride,
    num_slot_programs,        # programs 0 .. num_slot_programs-1 compute slots, the rest gather
    gather_tiles,             # gather programs per group
    PAD_ID: tl.constexpr, NUM_GROUPS: tl.constexpr, SEARCH_STEPS: tl.constexpr, QSL_BLOCK: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr, ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
):
    # The slots are read from the persistent tables through idx_mapping, not from the gathered
    # ones, so no program waits for another. Slot programs first: theirs is the longer chain.
    pid = tl.program_id(0)
    if pid < num_slot_programs:
        _slot_tile(tile=pid, num_reqs=num_reqs, num_positions=num_positions, max_num_tokens=max_num_tokens,
                   max_num_reqs=max_num_reqs, idx_mapping=idx_mapping, cu_num_tokens=cu_num_tokens, pos=pos,
                   block_table_ptrs=src_block_table_ptrs, block_table_strides=block_table_strides,
                   page_sizes=page_sizes, slot_mappings_ptr=slot_mappings_ptr,
                   slot_mappings_stride=slot_mappings_stride, PAD_ID=PAD_ID, HAS_IDX_MAPPING=True,
                   NUM_GROUPS=NUM_GROUPS, SEARCH_STEPS=SEARCH_STEPS, QSL_BLOCK=QSL_BLOCK, BLOCK_TOKENS=BLOCK_TOKENS)
    else:
        g = pid - num_slot_programs
        _gather_rows(row_tile=g % gather_tiles, group_id=g // gather_tiles, idx_mapping=idx_mapping,
                     src_block_table_ptrs=src_block_table_ptrs, dst_block_table_ptrs=dst_block_table_ptrs,
                     block_table_strides=block_table_strides, num_blocks_ptr=num_blocks_ptr,
                     num_blocks_stride=num_blocks_stride, num_reqs=num_reqs, num_reqs_padded=num_reqs_padded,
                     max_num_reqs=max_num_reqs, ROWS=ROWS, BLOCK_COLS=BLOCK_COLS)
