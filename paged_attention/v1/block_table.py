"""vLLM V1's worker block table (``vllm/v1/worker/block_table.py``).

The scheduler decides which KV-cache blocks each request owns; the worker must tell the
attention kernels. It keeps one persistent table, a ``[max_num_reqs, max_num_blocks_per_req]``
int32 array whose row ``i`` lists the block ids of the request in batch position ``i``. The
table lives on the CPU (edited in place through numpy as requests come, grow, move and go) and
is copied to the GPU once per step (``commit_block_table``): only the rows in use, in one
asynchronous copy, instead of rebuilding a tensor from Python lists every step.

From the table the worker derives the *slot mapping*: for every token scheduled this step, the
slot of the KV cache its key and value are written to,

    slot = block_table[row, position // block_size] * block_size + position % block_size,

i.e. the block that holds the token, times the tokens per block, plus the token's offset in
its block. Two refinements change the arithmetic:

* hybrid (kernel) blocks: when the attention kernel wants smaller blocks than the
  KV-cache manager allocates, each manager block ``b`` is split into kernel blocks
  ``b*bpk .. b*bpk + bpk-1`` and the table (and its ``block_size``) is in kernel blocks;
* decode context parallelism (DCP): the KV cache of one request is spread over
  ``dcp_world_size`` GPUs, a few tokens on each in turn; each rank computes the slots of the
  tokens it stores and marks the others with ``PAD_SLOT_ID`` (-1), which cache writes skip.

``MultiGroupBlockTable`` holds one ``BlockTable`` per KV-cache group (for instance
full-attention layers and sliding-window layers with different block sizes) and fans every
operation out to all of them.

This is the numpy version of the slot mapping that vLLM used until 2026-03
(``compute_slot_mapping(req_indices, positions)`` then ``commit_slot_mapping(num_tokens)``);
the later Triton-kernel form ``compute_slot_mapping(num_reqs, query_start_loc, positions)``,
which reads the committed device table and pads the tail with -1, is provided too.

Bad input (rows or block counts past the configured maxima, positions past a row's columns,
a DCP rank outside the world size, wrong types) raises IndexError, ValueError or TypeError
before anything is written, so a failed call leaves every buffer as it was.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import numpy as np
import torch

from paged_attention.utils import PAD_SLOT_ID, cdiv, check_device, check_int, check_int_array, check_int_list, is_int
from paged_attention.v1.cpu_gpu_buffer import CpuGpuBuffer

_INT32_MAX = int(np.iinfo(np.int32).max)

BlockIds = Union[Sequence[int], np.ndarray]


class BlockTable:
    """The block table of one KV-cache group: block ids per batch row, on the CPU and the GPU.

    ``BlockTable(block_size, max_num_reqs, max_num_blocks_per_req, max_num_batched_tokens,
    pin_memory, device, kernel_block_size, dcp_kv_cache_interleave_size, *, dcp_world_size=1,
    dcp_rank=0)``:

    * ``block_size``: tokens per block of the KV-cache manager (what the scheduler allocates);
    * ``kernel_block_size``: tokens per block the attention kernel reads; it must divide
      ``block_size``. When it differs, ``self.block_size`` becomes the *kernel* block size and
      ``self.max_num_blocks_per_req`` is multiplied by ``blocks_per_kv_block`` (the row holds kernel blocks, so it
      needs that many more columns);
    * ``dcp_kv_cache_interleave_size`` (default 1; vLLM later renamed it
      ``cp_kv_cache_interleave_size``): how many consecutive tokens go to one DCP rank before
      the next rank's turn;
    * ``dcp_world_size``/``dcp_rank``: vLLM reads them from the DCP process group (1 and 0
      when there is none); here they are plain keyword arguments. They stay plain attributes,
      so a test may set them after construction, as vLLM's tests do.

    Attributes, as in vLLM: ``block_table`` (CpuGpuBuffer, int32), ``num_blocks_per_row``
    (numpy int32, CPU only), ``slot_mapping`` (CpuGpuBuffer, int64), ``block_size``,
    ``blocks_per_kv_block``, ``use_hybrid_blocks``, ``max_num_blocks_per_req``,
    ``max_num_reqs``, ``max_num_batched_tokens``, ``pin_memory``, ``device``.
    """

    def __init__(self, block_size: int, max_num_reqs: int, max_num_blocks_per_req: int,
                 max_num_batched_tokens: int, pin_memory: bool, device: Union[torch.device, str],
                 kernel_block_size: int, dcp_kv_cache_interleave_size: int = 1, *,
                 dcp_world_size: int = 1, dcp_rank: int = 0) -> None:
        block_size = check_int("block_size", block_size, minimum=1)
        max_num_reqs = check_int("max_num_reqs", max_num_reqs, minimum=1)
        max_num_blocks_per_req = check_int("max_num_blocks_per_req", max_num_blocks_per_req, minimum=1)
        max_num_batched_tokens = check_int("max_num_batched_tokens", max_num_batched_tokens, minimum=1)
        kernel_block_size = check_int("kernel_block_size", kernel_block_size, minimum=1)
        interleave = check_int("dcp_kv_cache_interleave_size", dcp_kv_cache_interleave_size, minimum=1)
        check_device("device", device)          # a clear error here, not one from torch later
        if not isinstance(pin_memory, (bool, np.bool_)):
            raise TypeError(f"pin_memory must be a bool, got {pin_memory!r}")

        self.max_num_reqs = max_num_reqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.pin_memory = pin_memory
        self.device = device
        self.kv_cache_block_size = block_size     # the manager's block size, kept for reference

        if kernel_block_size == block_size:
            # The kernel reads blocks as the manager allocates them: ids go in unchanged.
            self.block_size = block_size
            self.blocks_per_kv_block = 1
            self.use_hybrid_blocks = False
        else:
            # The kernel wants smaller blocks: each manager block is cut into
            # blocks_per_kv_block kernel blocks, and the table is kept in kernel blocks.
            if block_size % kernel_block_size != 0:
                raise ValueError(f"kernel_block_size {kernel_block_size} must divide "
                                 f"kv_manager_block_size size {block_size} evenly")
            self.block_size = kernel_block_size
            self.blocks_per_kv_block = block_size // kernel_block_size
            self.use_hybrid_blocks = True

        # A request of max_num_blocks_per_req manager blocks fills that many times bpk columns.
        self.max_num_blocks_per_req = max_num_blocks_per_req * self.blocks_per_kv_block

        # Validate the DCP settings against the final (kernel) block size before allocating.
        _check_dcp(dcp_world_size, dcp_rank, interleave, self.block_size)
        self.dcp_world_size = int(dcp_world_size)
        self.dcp_rank = int(dcp_rank)
        self.dcp_kv_cache_interleave_size = interleave

        self.block_table = self._make_buffer(self.max_num_reqs, self.max_num_blocks_per_req, dtype=torch.int32)
        # How many columns of each row hold real ids; lives on the CPU only.
        self.num_blocks_per_row = np.zeros(max_num_reqs, dtype=np.int32)
        self.slot_mapping = self._make_buffer(self.max_num_batched_tokens, dtype=torch.int64)

        if self.use_hybrid_blocks:
            # [[0, 1, ..., bpk-1]]: the offsets of a manager block's kernel blocks (see
            # map_to_kernel_blocks), built once.
            self._kernel_block_arange: Optional[np.ndarray] = np.arange(
                0, self.blocks_per_kv_block).reshape(1, -1)
        else:
            self._kernel_block_arange = None

    # ---- Row operations (CPU side only; nothing reaches the GPU before commit_block_table) ----
    def append_row(self, block_ids: BlockIds, row_idx: int) -> None:
        """Append ``block_ids`` (manager block ids) to the end of row ``row_idx``: a running
        request got new blocks. An empty list changes nothing."""
        kernel_ids = self._prepare_row_ids(block_ids, row_idx, start=None)
        self._write_row_ids(kernel_ids, row_idx, start=int(self.num_blocks_per_row[row_idx]))

    def add_row(self, block_ids: BlockIds, row_idx: int) -> None:
        """Make row ``row_idx`` hold exactly ``block_ids``: a new (or resumed) request takes
        this batch position. Columns past the new count keep whatever they held (vLLM does not
        clear them; only ``num_blocks_per_row`` says where the row ends)."""
        kernel_ids = self._prepare_row_ids(block_ids, row_idx, start=0)
        self.num_blocks_per_row[row_idx] = 0
        self._write_row_ids(kernel_ids, row_idx, start=0)

    def clear_row(self, row_idx: int) -> None:
        """Zero the row's used columns and set its count to 0: a request left this batch
        position (vLLM added this in 2026-03 so no stale ids stay behind)."""
        self._check_row(row_idx, "row_idx")
        num_blocks = int(self.num_blocks_per_row[row_idx])
        self.block_table.np[row_idx, :num_blocks] = 0
        self.num_blocks_per_row[row_idx] = 0

    def move_row(self, src: int, tgt: int) -> None:
        """Copy row ``src``'s used columns into row ``tgt`` and give ``tgt`` the same count:
        condensing the batch moves the last request into a hole. The source row is left as it
        was, and columns of ``tgt`` past the copied ones are not cleared, as in vLLM."""
        self._check_row(src, "src")
        self._check_row(tgt, "tgt")
        num_blocks = int(self.num_blocks_per_row[src])
        table = self.block_table.np
        table[tgt, :num_blocks] = table[src, :num_blocks]
        self.num_blocks_per_row[tgt] = num_blocks

    def swap_row(self, src: int, tgt: int) -> None:
        """Exchange two rows, entirely (every column, not just the used ones), and their
        counts: the batch is reordered (stale columns travel with their row)."""
        self._check_row(src, "src")
        self._check_row(tgt, "tgt")
        # Fancy indexing reads both rows (a copy) before writing either, so this is a swap.
        src_tgt, tgt_src = [src, tgt], [tgt, src]
        self.num_blocks_per_row[src_tgt] = self.num_blocks_per_row[tgt_src]
        self.block_table.np[src_tgt] = self.block_table.np[tgt_src]

    # ---- Slot mapping --------------------------------------------------------------------------
    def compute_slot_mapping(self, req_indices: Any, positions: Any) -> None:
        """The KV-cache slot of every scheduled token, into ``slot_mapping.np[:num_tokens]``.

        Token ``t`` belongs to the request in batch row ``req_indices[t]`` and sits at position
        ``positions[t]`` of its sequence (vLLM passes ``req_indices = [0,0,0,1,1,...]`` and
        ``positions = num_computed_tokens[req] + 0, 1, 2, ...``). Entries past ``num_tokens``
        are left as they were (this version does not pad; ``commit_slot_mapping`` then copies
        the first ``num_tokens`` to the GPU). With DCP, tokens another rank stores get
        ``PAD_SLOT_ID`` (-1).

        vLLM's later form, ``(num_reqs, query_start_loc, positions)``, is
        ``compute_slot_mapping_from_query_start_loc``.
        """
        slots = self._slot_ids(req_indices, positions, self.block_table.np)
        self.slot_mapping.np[:slots.shape[0]] = slots

    def compute_slot_mapping_from_query_start_loc(self, num_reqs: int, query_start_loc: Any,
                                                  positions: Any) -> None:
        """vLLM's 2026 slot mapping (a Triton kernel there, numpy here), into ``slot_mapping.gpu``.

        Request ``i`` (row ``i``: the table is kept in batch order) owns the tokens
        ``query_start_loc[i] .. query_start_loc[i+1] - 1``. Unlike the numpy form it reads the
        *committed* device table (call ``commit_block_table`` first) and writes only the device
        buffer, and it pads ``[num_tokens, max_num_batched_tokens)`` with ``PAD_SLOT_ID`` so a
        CUDA graph captured for more tokens writes nothing for the padding.
        Tokens no request covers are padded too (vLLM's kernel would leave them stale).
        """
        self.slot_mapping.gpu.copy_(torch.from_numpy(self._padded_slot_ids(num_reqs, query_start_loc, positions)))

    def _padded_slot_ids(self, num_reqs: int, query_start_loc: Any, positions: Any) -> np.ndarray:
        """Validate, then compute the later form's whole padded slot array from the device table."""
        num_reqs = check_int("num_reqs", num_reqs, 0, self.max_num_reqs, max_name="max_num_reqs")
        qsl = check_int_array("query_start_loc", query_start_loc)
        pos = check_int_array("positions", positions)
        num_tokens = pos.shape[0]
        if qsl.shape[0] < num_reqs + 1:
            raise ValueError(f"query_start_loc needs num_reqs + 1 = {num_reqs + 1} entries, got {qsl.shape[0]}")
        qsl = qsl[:num_reqs + 1]
        if qsl[0] < 0 or np.any(np.diff(qsl) < 0) or qsl[-1] > num_tokens:
            raise ValueError(f"query_start_loc must rise from >= 0 to at most the {num_tokens} positions given, "
                             f"got {qsl.tolist()}")
        if num_tokens > self.max_num_batched_tokens:
            raise ValueError(f"{num_tokens} tokens exceed max_num_batched_tokens={self.max_num_batched_tokens}")
        # Row i repeated once per token of request i, as the kernel's program i walks them.
        req_indices = np.repeat(np.arange(num_reqs, dtype=np.int64), np.diff(qsl))
        committed = self.block_table.gpu.cpu().numpy()
        first, end = int(qsl[0]), int(qsl[-1])
        padded = np.full(self.max_num_batched_tokens, PAD_SLOT_ID, dtype=np.int64)
        padded[first:end] = self._slot_ids(req_indices, pos[first:end], committed)
        return padded

    def _slot_ids(self, req_indices: Any, positions: Any, table: np.ndarray) -> np.ndarray:
        """Validate, then compute the slot of each token from ``table`` (int64, vectorised)."""
        req = check_int_array("req_indices", req_indices)
        pos = check_int_array("positions", positions)
        if req.shape != pos.shape:
            raise ValueError(f"req_indices and positions must have the same length, "
                             f"got {req.shape[0]} and {pos.shape[0]}")
        if req.shape[0] > self.max_num_batched_tokens:
            raise ValueError(f"{req.shape[0]} tokens exceed max_num_batched_tokens={self.max_num_batched_tokens}")
        if req.size and (req.min() < 0 or req.max() >= self.max_num_reqs):
            bad = int(req[(req < 0) | (req >= self.max_num_reqs)][0])
            raise IndexError(f"request row {bad} is outside the table's rows 0..{self.max_num_reqs - 1}")
        if pos.size and pos.min() < 0:
            raise ValueError(f"positions must be >= 0, got {int(pos.min())}")
        world, rank = self.dcp_world_size, self.dcp_rank
        interleave = self.dcp_kv_cache_interleave_size
        _check_dcp(world, rank, interleave, self.block_size)   # they may have been set by hand

        B = self.block_size
        # With DCP each rank stores only 1/world of a request's tokens, so one block of B local
        # slots covers a "virtual block" of B * world consecutive positions.
        virtual_block_size = B * world
        # Which column of the row holds the token's block. The table is flat in memory, so row
        # r, column c is entry r * max_num_blocks_per_req + c of the raveled array.
        block_index = pos // virtual_block_size
        if block_index.size and block_index.max() >= self.max_num_blocks_per_req:
            p = int(pos[block_index.argmax()])
            raise ValueError(f"position {p} needs block column {p // virtual_block_size}, but rows have only "
                             f"{self.max_num_blocks_per_req} columns (max_num_blocks_per_req)")
        flat_index = req * self.max_num_blocks_per_req + block_index
        # int64 before multiplying: int32 ids times B could overflow int32 (numpy keeps int32).
        block_numbers = table.ravel()[flat_index].astype(np.int64)

        if world == 1:
            # No DCP: slot = block_id * block_size + offset of the token in its block.
            return block_numbers * B + pos % B

        # DCP. Within its virtual block the token sits at offset off (0 .. B*world - 1).
        # Tokens are dealt to ranks in runs of `interleave`: run k = off // interleave goes to
        # rank k % world. So rank r's tokens are runs r, r + world, r + 2*world, ...
        off = pos - block_index * virtual_block_size
        is_local = (off // interleave) % world == rank
        # A rank packs its own tokens densely: off // (world * interleave) whole rounds of
        # dealing came before this token (each gave this rank `interleave` tokens), plus the
        # token's place within its run. With interleave dividing B this is always < B.
        local_off = (off // (world * interleave)) * interleave + off % interleave
        return np.where(is_local, block_numbers * B + local_off, PAD_SLOT_ID).astype(np.int64)

    # ---- To the device -------------------------------------------------------------------------
    def commit_block_table(self, num_reqs: int) -> None:
        """Copy rows ``[0, num_reqs)`` of the table to the GPU (non-blocking)."""
        num_reqs = check_int("num_reqs", num_reqs, 0, self.max_num_reqs, max_name="max_num_reqs")
        self.block_table.copy_to_gpu(num_reqs)

    def commit_slot_mapping(self, num_tokens: int) -> None:
        """Copy the first ``num_tokens`` slots to the GPU (non-blocking)."""
        num_tokens = check_int("num_tokens", num_tokens, 0, self.max_num_batched_tokens,
                               max_name="max_num_batched_tokens")
        self.slot_mapping.copy_to_gpu(num_tokens)

    def clear(self) -> None:
        """Zero the table on both sides. As in vLLM the counts in ``num_blocks_per_row`` are
        *not* reset: call ``clear_row`` (or ``add_row``) to make rows empty."""
        self.block_table.gpu.fill_(0)
        self.block_table.cpu.fill_(0)

    # ---- Hybrid (kernel) blocks ---------------------------------------------------------------
    def _map_to_kernel_blocks(self, kv_manager_block_ids: np.ndarray) -> np.ndarray:
        """Manager block ids to kernel block ids, for this table's ``blocks_per_kv_block``.

        With 32-token manager blocks and 16-token kernel blocks (bpk = 2), manager block b
        holds kernel blocks 2b and 2b+1, so ``[0, 1, 2]`` becomes ``[0, 1, 2, 3, 4, 5]`` and
        ``[5, 9]`` becomes ``[10, 11, 18, 19]``. Without hybrid blocks ids pass unchanged.
        """
        return self.map_to_kernel_blocks(np.asarray(kv_manager_block_ids), self.blocks_per_kv_block,
                                         self._kernel_block_arange)

    @staticmethod
    def map_to_kernel_blocks(kv_manager_block_ids: np.ndarray, blocks_per_kv_block: int,
                             kernel_block_arange: Optional[np.ndarray]) -> np.ndarray:
        """The same mapping as a static function (vLLM's later form): with bpk > 1, manager
        block b becomes kernel blocks ``b*bpk + 0, b*bpk + 1, ..., b*bpk + bpk-1``, in order."""
        if blocks_per_kv_block == 1:
            return kv_manager_block_ids
        if kernel_block_arange is None:
            kernel_block_arange = np.arange(blocks_per_kv_block).reshape(1, -1)
        # A column of ids times bpk, plus the row [0 .. bpk-1]: broadcasting gives one row of
        # kernel ids per manager id; flattening keeps them in order.
        kernel_block_ids = np.asarray(kv_manager_block_ids).reshape(-1, 1) * blocks_per_kv_block \
            + kernel_block_arange
        return kernel_block_ids.reshape(-1)

    # ---- Accessors -----------------------------------------------------------------------------
    def get_device_tensor(self, num_reqs: int) -> torch.Tensor:
        """The first ``num_reqs`` rows of the device table (what attention metadata gets)."""
        num_reqs = check_int("num_reqs", num_reqs, 0, self.max_num_reqs, max_name="max_num_reqs")
        return self.block_table.gpu[:num_reqs]

    def get_cpu_tensor(self) -> torch.Tensor:
        """The whole host table as a torch tensor."""
        return self.block_table.cpu

    def get_numpy_array(self) -> np.ndarray:
        """The whole host table as a numpy array (same memory as ``get_cpu_tensor``)."""
        return self.block_table.np

    def _make_buffer(self, *size: int, dtype: torch.dtype) -> CpuGpuBuffer:
        return CpuGpuBuffer(*size, dtype=dtype, device=self.device, pin_memory=self.pin_memory)

    # ---- Checks (each runs before anything is written) -----------------------------------------
    def _check_row(self, row_idx: Any, name: str) -> int:
        if not is_int(row_idx):
            raise TypeError(f"{name} must be an int, got {row_idx!r}")
        if not 0 <= row_idx < self.max_num_reqs:
            raise IndexError(f"{name}={row_idx} is outside the table's rows 0..{self.max_num_reqs - 1}")
        return int(row_idx)

    def _prepare_row_ids(self, block_ids: BlockIds, row_idx: int, start: Optional[int]) -> np.ndarray:
        """Check a row write and return the kernel block ids it would store.

        ``start`` is the column the write begins at (0 for ``add_row``; None: the row's count).
        """
        row_idx = self._check_row(row_idx, "row_idx")
        ids = _as_block_id_array(block_ids)
        if start is None:
            start = int(self.num_blocks_per_row[row_idx])
        kernel_ids = self._map_to_kernel_blocks(ids) if self.use_hybrid_blocks else ids
        if start + kernel_ids.shape[0] > self.max_num_blocks_per_req:
            raise ValueError(f"row {row_idx} would hold {start + kernel_ids.shape[0]} blocks "
                             f"({start} + {kernel_ids.shape[0]}), more than max_num_blocks_per_req="
                             f"{self.max_num_blocks_per_req}")
        if kernel_ids.size and kernel_ids.max() > _INT32_MAX:
            raise ValueError(f"block id {int(ids.max())} does not fit the int32 table")
        return kernel_ids

    def _write_row_ids(self, kernel_ids: np.ndarray, row_idx: int, start: int) -> None:
        num_blocks = kernel_ids.shape[0]
        if num_blocks == 0:
            return
        self.block_table.np[row_idx, start:start + num_blocks] = kernel_ids
        self.num_blocks_per_row[row_idx] = start + num_blocks


class MultiGroupBlockTable:
    """One ``BlockTable`` per KV-cache group, driven together (``vllm/v1/worker/block_table.py``).

    ``MultiGroupBlockTable(max_num_reqs, max_model_len, max_num_batched_tokens, pin_memory,
    device, block_sizes, kernel_block_sizes, num_speculative_tokens=0,
    dcp_kv_cache_interleave_size=1, *, max_num_blocks=None, dcp_world_size=1, dcp_rank=0)``.

    Group ``i`` gets ``max_num_blocks[i]`` manager blocks per request; by default enough for
    ``max_model_len`` tokens, of which this DCP rank stores ``1/dcp_world_size``, and at least
    ``1 + num_speculative_tokens``. The count is then rounded up to a multiple of
    ``128 // block_size`` (for ``block_size <= 128``), as vLLM does for TRTLLM's kernels: with
    ``block_size=16``, ``max_model_len=1000`` gives 63 blocks, rounded to 64.

    ``max_num_blocks`` is a keyword here (vLLM's later signature puts it eighth, positionally).
    Row operations take the same row for every group; ``append_row`` and
    ``add_row`` take a tuple with one id list per group. Every fanned-out call checks all groups
    before it writes to any, so a bad call leaves every group as it was.
    """

    def __init__(self, max_num_reqs: int, max_model_len: int, max_num_batched_tokens: int, pin_memory: bool,
                 device: Union[torch.device, str], block_sizes: Sequence[int], kernel_block_sizes: Sequence[int],
                 num_speculative_tokens: int = 0, dcp_kv_cache_interleave_size: int = 1, *,
                 max_num_blocks: Optional[Sequence[int]] = None, dcp_world_size: int = 1,
                 dcp_rank: int = 0) -> None:
        max_model_len = check_int("max_model_len", max_model_len, minimum=1)
        num_speculative_tokens = check_int("num_speculative_tokens", num_speculative_tokens, minimum=0)
        interleave = check_int("dcp_kv_cache_interleave_size", dcp_kv_cache_interleave_size, minimum=1)
        block_sizes = check_int_list("block_sizes", block_sizes, 1)
        kernel_block_sizes = check_int_list("kernel_block_sizes", kernel_block_sizes, 1)
        if len(kernel_block_sizes) != len(block_sizes):
            raise ValueError(f"kernel_block_sizes length ({len(kernel_block_sizes)}) "
                             f"must match block_sizes length ({len(block_sizes)})")
        if not block_sizes:
            raise ValueError("block_sizes must name at least one KV-cache group")
        _check_dcp(dcp_world_size, dcp_rank, 1, 1)     # the interleave is checked per group below
        if max_num_blocks is None:
            # Each DCP rank stores only max_model_len / dcp_world_size tokens of a request, so
            # a block covers block_size * dcp_world_size of its positions.
            max_num_blocks = [max(cdiv(max_model_len, block_size * dcp_world_size), 1 + num_speculative_tokens)
                              for block_size in block_sizes]
        max_num_blocks = check_int_list("max_num_blocks", max_num_blocks, 1)
        if len(max_num_blocks) != len(block_sizes):
            raise ValueError(f"max_num_blocks length ({len(max_num_blocks)}) "
                             f"must match block_sizes length ({len(block_sizes)})")
        # Round up to a multiple of 128 // block_size (so a row spans a multiple of 128 tokens),
        # which some attention backends (TRTLLM) need.
        max_num_blocks = [cdiv(n, 128 // bs) * (128 // bs) if bs <= 128 else n
                          for n, bs in zip(max_num_blocks, block_sizes)]

        self.block_tables = [
            BlockTable(block_size, max_num_reqs, max_num_blocks_per_req, max_num_batched_tokens, pin_memory,
                       device, kernel_block_size, interleave, dcp_world_size=dcp_world_size, dcp_rank=dcp_rank)
            for block_size, kernel_block_size, max_num_blocks_per_req
            in zip(block_sizes, kernel_block_sizes, max_num_blocks)
        ]

    def append_row(self, block_ids: Sequence[BlockIds], row_idx: int) -> None:
        """Append ``block_ids[i]`` to row ``row_idx`` of group ``i``, for every group."""
        prepared = [t._prepare_row_ids(ids, row_idx, start=None)
                    for t, ids in zip(self.block_tables, self._per_group(block_ids))]
        for table, kernel_ids in zip(self.block_tables, prepared):
            table._write_row_ids(kernel_ids, row_idx, start=int(table.num_blocks_per_row[row_idx]))

    def add_row(self, block_ids: Sequence[BlockIds], row_idx: int) -> None:
        """Make row ``row_idx`` of group ``i`` hold exactly ``block_ids[i]``, for every group."""
        prepared = [t._prepare_row_ids(ids, row_idx, start=0)
                    for t, ids in zip(self.block_tables, self._per_group(block_ids))]
        for table, kernel_ids in zip(self.block_tables, prepared):
            table.num_blocks_per_row[row_idx] = 0
            table._write_row_ids(kernel_ids, row_idx, start=0)

    def clear_row(self, row_idx: int) -> None:
        for table in self.block_tables:
            table._check_row(row_idx, "row_idx")
        for table in self.block_tables:
            table.clear_row(row_idx)

    def move_row(self, src: int, tgt: int) -> None:
        for table in self.block_tables:
            table._check_row(src, "src")
            table._check_row(tgt, "tgt")
        for table in self.block_tables:
            table.move_row(src, tgt)

    def swap_row(self, src: int, tgt: int) -> None:
        for table in self.block_tables:
            table._check_row(src, "src")
            table._check_row(tgt, "tgt")
        for table in self.block_tables:
            table.swap_row(src, tgt)

    def compute_slot_mapping(self, req_indices: Any, positions: Any) -> None:
        """Every group's slot mapping for the same tokens (each in its own block size)."""
        # Compute every group's slots first: a position one group cannot hold fails the call
        # before any group's slot_mapping changes.
        all_slots = [t._slot_ids(req_indices, positions, t.block_table.np) for t in self.block_tables]
        for table, slots in zip(self.block_tables, all_slots):
            table.slot_mapping.np[:slots.shape[0]] = slots

    def compute_slot_mapping_from_query_start_loc(self, num_reqs: int, query_start_loc: Any,
                                                  positions: Any) -> None:
        """The later, padded form for every group (see ``BlockTable``'s method of that name)."""
        # Every group's slots first, so a bad call changes no group.
        all_slots = [t._padded_slot_ids(num_reqs, query_start_loc, positions) for t in self.block_tables]
        for table, slots in zip(self.block_tables, all_slots):
            table.slot_mapping.gpu.copy_(torch.from_numpy(slots))

    def commit_block_table(self, num_reqs: int) -> None:
        for table in self.block_tables:
            check_int("num_reqs", num_reqs, 0, table.max_num_reqs, max_name="max_num_reqs")
        for table in self.block_tables:
            table.commit_block_table(num_reqs)

    def commit_slot_mapping(self, num_tokens: int) -> None:
        for table in self.block_tables:
            check_int("num_tokens", num_tokens, 0, table.max_num_batched_tokens,
                      max_name="max_num_batched_tokens")
        for table in self.block_tables:
            table.commit_slot_mapping(num_tokens)

    def clear(self) -> None:
        for table in self.block_tables:
            table.clear()

    def __getitem__(self, idx: int) -> BlockTable:
        """The ``BlockTable`` of KV-cache group ``idx``."""
        return self.block_tables[idx]

    def _per_group(self, block_ids: Sequence[BlockIds]) -> Sequence[BlockIds]:
        if not isinstance(block_ids, (tuple, list)):
            raise TypeError(f"block_ids must be a tuple with one list of ids per KV-cache group, got {block_ids!r}")
        if len(block_ids) != len(self.block_tables):
            raise ValueError(f"block_ids has {len(block_ids)} lists but there are {len(self.block_tables)} "
                             f"KV-cache groups")
        return block_ids


# ---- Argument checks shared by both classes ------------------------------------------------------
def _check_dcp(world_size: Any, rank: Any, interleave: Any, block_size: int) -> None:
    """DCP settings that give every token exactly one rank and one slot."""
    world_size = check_int("dcp_world_size", world_size, minimum=1)
    if not is_int(rank):
        raise TypeError(f"dcp_rank must be an int, got {rank!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"dcp_rank must be between 0 and dcp_world_size - 1 = {world_size - 1}, got {rank}")
    interleave = check_int("dcp_kv_cache_interleave_size", interleave, minimum=1)
    if world_size > 1 and block_size % interleave != 0:
        # Each rank must get exactly block_size tokens out of every virtual block; otherwise a
        # local offset could pass the end of its block and land in another request's block.
        raise ValueError(f"with DCP the interleave size ({interleave}) must divide the (kernel) "
                         f"block size ({block_size})")


def _as_block_id_array(block_ids: Any) -> np.ndarray:
    """Block ids for one row: a flat list (or array) of ints >= 0."""
    if isinstance(block_ids, torch.Tensor):
        block_ids = block_ids.detach().cpu().numpy()
    if isinstance(block_ids, (str, bytes)) or not isinstance(block_ids, (Sequence, np.ndarray, range)):
        raise TypeError(f"block_ids must be a list of ints, got {block_ids!r}")
    try:
        arr = np.asarray(block_ids)
    except ValueError as e:                      # ragged nesting: [[1, 2], [3]]
        raise TypeError(f"block_ids must be one flat list of ints, got {block_ids!r}") from e
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.ndim != 1:
        raise TypeError(f"block_ids must be one flat list of ids for this row, got shape {arr.shape} "
                        f"(MultiGroupBlockTable takes a tuple with one list per group)")
    if arr.dtype.kind not in "iu":
        raise TypeError(f"block_ids must be ints, got dtype {arr.dtype}")
    if arr.min() < 0:
        raise ValueError(f"block ids must be >= 0, got {int(arr.min())}")
    return arr.astype(np.int64)
