"""The legacy block manager (vLLM's ``vllm/core/block_manager.py``): where block tables meet the
scheduler.

The scheduler asks it four kinds of question, each a count of blocks against the free pool:
can this request be admitted (keeping a *watermark* of GPU blocks in reserve), can every running
sequence grow by its new tokens, can a group be swapped out to the CPU, and back in. Then it
tells it what to do: allocate a group's tables (the first sequence allocates, the others fork),
append slots (returning the copy-on-write pairs for ``copy_blocks``), fork, swap (returning
device-relative pairs for ``swap_blocks``) and free.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from paged_attention.legacy.block_table import BlockTable
from paged_attention.legacy.common import BlockStateError, check_time, rehearse
from paged_attention.legacy.cpu_gpu_block_allocator import CpuGpuBlockAllocator, NullBlock
from paged_attention.legacy.interfaces import AllocStatus, BlockAllocator
from paged_attention.legacy.prefix_caching_trackers import ComputedBlocksTracker, LastAccessBlocksTracker
from paged_attention.legacy.sequence import Sequence, SequenceGroup, SequenceStatus
from paged_attention.utils import Device, cdiv, check_int

__all__ = ["SelfAttnBlockSpaceManager", "AllocStatus", "check_no_caching_or_swa_for_blockmgr_encdec"]

SeqId = int


def _check_lookahead(num_lookahead_slots: int) -> None:
    if type(num_lookahead_slots) is not int or num_lookahead_slots < 0:     # the common case first
        check_int("num_lookahead_slots", num_lookahead_slots, 0)


def _check_seq(name: str, seq: object) -> None:
    if not isinstance(seq, Sequence):
        raise TypeError(f"{name} must be a Sequence, got {type(seq).__name__}")


def _check_group(seq_group: object) -> None:
    if not isinstance(seq_group, SequenceGroup):
        raise TypeError(f"seq_group must be a SequenceGroup, got {type(seq_group).__name__}")


def check_no_caching_or_swa_for_blockmgr_encdec(block_mgr: SelfAttnBlockSpaceManager, seq_group: SequenceGroup) -> None:
    """Encoder/decoder groups work with neither a sliding window nor prefix caching."""
    if seq_group.is_encoder_decoder():
        if block_mgr.max_block_sliding_window is not None:
            raise NotImplementedError("Sliding window attention for encoder/decoder models is not currently supported.")
        if block_mgr.enable_caching:
            raise NotImplementedError("Prefix caching for encoder/decoder models is not currently supported.")


class SelfAttnBlockSpaceManager:
    """Block tables for every sequence (and a cross-attention table per encoder/decoder request),
    over one CPU/GPU allocator: naive, or prefix caching when ``enable_caching``.

    ``sliding_window`` (in tokens) becomes a window of ``sliding_window // block_size + 2``
    blocks: the tokens a window can span may straddle one more block, and the block being
    written is one more.

    Every argument is checked on the way in (TypeError for a wrong type, bools included where an
    int is expected; ValueError for a bad value; KeyError for a sequence with no table), before
    anything changes. ``watermark`` is the fraction of GPU blocks kept in reserve, in [0, 1).
    """

    def __init__(self, block_size: int, num_gpu_blocks: int, num_cpu_blocks: int, watermark: float = 0.01,
                 sliding_window: Optional[int] = None, enable_caching: bool = False):
        block_size = check_int("block_size", block_size, 1)
        num_gpu_blocks = check_int("num_gpu_blocks", num_gpu_blocks, 0)
        num_cpu_blocks = check_int("num_cpu_blocks", num_cpu_blocks, 0)
        if isinstance(watermark, (bool, np.bool_)) or not isinstance(watermark, (int, float, np.integer, np.floating)):
            raise TypeError(f"watermark must be a real number, got {watermark!r}")
        if not 0 <= watermark < 1:                        # NaN and infinity fail this too
            raise ValueError(f"watermark must be in [0, 1), got {watermark!r}")
        watermark = float(watermark)
        if sliding_window is not None:
            sliding_window = check_int("sliding_window", sliding_window, 1)
        if not isinstance(enable_caching, (bool, np.bool_)):
            raise TypeError(f"enable_caching must be a bool, got {enable_caching!r}")
        enable_caching = bool(enable_caching)
        self.block_size = block_size
        self.num_total_gpu_blocks = num_gpu_blocks
        self.num_total_cpu_blocks = num_cpu_blocks
        self.sliding_window = sliding_window
        self.max_block_sliding_window = None if sliding_window is None else sliding_window // block_size + 2
        self.watermark = watermark
        self.watermark_blocks = int(watermark * num_gpu_blocks)
        self.enable_caching = enable_caching
        self.block_allocator = CpuGpuBlockAllocator.create(
            allocator_type="prefix_caching" if enable_caching else "naive", num_gpu_blocks=num_gpu_blocks,
            num_cpu_blocks=num_cpu_blocks, block_size=block_size)
        self.block_tables: dict[SeqId, BlockTable] = {}
        self.cross_block_tables: dict[str, BlockTable] = {}       # request id -> encoder's table
        self._computed_blocks_tracker = ComputedBlocksTracker(self.block_allocator, block_size, enable_caching)
        self._last_access_blocks_tracker = LastAccessBlocksTracker(self.block_allocator)

    def _table(self, seq: Sequence) -> BlockTable:
        _check_seq("seq", seq)
        if seq.seq_id not in self.block_tables:
            raise KeyError(f"sequence {seq.seq_id} has no block table (not allocated, or freed)")
        return self.block_tables[seq.seq_id]

    # ---- Admission ----------------------------------------------------------------------------
    def can_allocate(self, seq_group: SequenceGroup, num_lookahead_slots: int = 0) -> AllocStatus:
        """OK if the group's first waiting sequence fits now with the watermark to spare; NEVER
        if it could not fit even in an empty pool; LATER otherwise."""
        _check_group(seq_group)
        check_no_caching_or_swa_for_blockmgr_encdec(self, seq_group)
        _check_lookahead(num_lookahead_slots)
        num_required_blocks = self._num_required_blocks(seq_group, num_lookahead_slots)
        if self.max_block_sliding_window is not None:
            num_required_blocks = min(num_required_blocks, self.max_block_sliding_window)
        num_free_gpu_blocks = self.block_allocator.get_num_free_blocks(device=Device.GPU)
        if self.num_total_gpu_blocks - num_required_blocks < self.watermark_blocks:
            return AllocStatus.NEVER
        if num_free_gpu_blocks - num_required_blocks >= self.watermark_blocks:
            return AllocStatus.OK
        return AllocStatus.LATER

    def _num_required_blocks(self, seq_group: SequenceGroup, num_lookahead_slots: int = 0) -> int:
        waiting = seq_group.get_seqs(status=SequenceStatus.WAITING)
        if not waiting:
            raise ValueError(f"request {seq_group.request_id!r} has no waiting sequence to allocate")
        num_required_blocks = BlockTable.get_num_required_blocks(waiting[0].get_token_ids(), self.block_size,
                                                                 num_lookahead_slots)
        if seq_group.is_encoder_decoder():
            num_required_blocks += BlockTable.get_num_required_blocks(seq_group.get_encoder_seq().get_token_ids(),
                                                                      self.block_size)
        return num_required_blocks

    def _allocate_sequence(self, seq: Sequence) -> BlockTable:
        block_table = BlockTable(block_size=self.block_size, block_allocator=self.block_allocator,
                                 max_block_sliding_window=self.max_block_sliding_window)
        if seq.get_token_ids():
            block_table.allocate(token_ids=seq.get_token_ids(), extra_hash=seq.extra_hash())
        return block_table

    def allocate(self, seq_group: SequenceGroup) -> None:
        """Tables for the group's waiting sequences: the first allocates its tokens, the others
        fork it (parallel samples share the prompt's blocks), plus the encoder's cross table."""
        _check_group(seq_group)
        waiting = seq_group.get_seqs(status=SequenceStatus.WAITING)
        if not waiting:
            raise ValueError(f"request {seq_group.request_id!r} has no waiting sequence to allocate")
        if any(seq.seq_id in self.block_tables for seq in waiting):
            raise BlockStateError("block table already exists")
        if seq_group.request_id in self.cross_block_tables:
            raise BlockStateError(f"request {seq_group.request_id!r} already has a cross-attention block table")
        check_no_caching_or_swa_for_blockmgr_encdec(self, seq_group)
        if seq_group.is_encoder_decoder():
            # Two tables from a naive pool (the guard excludes caching): both fit, or neither is made.
            num_free = self.block_allocator.get_num_free_blocks(Device.GPU)
            needed = self._num_required_blocks(seq_group)
            if needed > num_free:
                raise BlockAllocator.NoFreeBlocksError(f"{needed} blocks needed, {num_free} free")

        block_table = self._allocate_sequence(waiting[0])
        self.block_tables[waiting[0].seq_id] = block_table
        self._last_access_blocks_tracker.add_seq(waiting[0].seq_id)
        for seq in waiting[1:]:
            self.block_tables[seq.seq_id] = block_table.fork()
            self._last_access_blocks_tracker.add_seq(seq.seq_id)
        for seq in waiting:                      # a count taken while waiting may be stale now
            self._computed_blocks_tracker.forget_num_cached_tokens(seq.seq_id)

        if seq_group.is_encoder_decoder():
            self.cross_block_tables[seq_group.request_id] = self._allocate_sequence(seq_group.get_encoder_seq())

    # ---- Decoding ---------------------------------------------------------------------------------
    def can_append_slots(self, seq_group: SequenceGroup, num_lookahead_slots: int) -> bool:
        """Do the blocks every running sequence would write into fit in the free GPU blocks?
        (An upper bound, with no watermark: appends must not be refused for it.)"""
        _check_group(seq_group)
        _check_lookahead(num_lookahead_slots)
        num_touched_blocks = self._num_null_blocks_needed()
        for seq in seq_group.seqs:
            if seq.status is SequenceStatus.RUNNING:
                block_table = self._table(seq)
                # The unseen tokens are the sequence's tail past what the table holds.
                num_touched_blocks += block_table._num_blocks_touched_by(
                    max(0, seq.get_len() - block_table.num_full_slots) + num_lookahead_slots)
        return num_touched_blocks <= self.block_allocator.get_num_free_blocks(Device.GPU)

    def _num_null_blocks_needed(self) -> int:
        """1 if an append would first take a GPU block for the null block: a window is set
        and the null block is not made yet (vLLM forgets it, and says yes to an append that
        then runs out)."""
        if self.max_block_sliding_window is None or self.block_allocator._null_block is not None:
            return 0
        return 1

    def append_slots(self, seq: Sequence, num_lookahead_slots: int) -> list[tuple[int, int]]:
        """Append the sequence's unseen tokens; returns the new copy-on-write pairs (absolute
        GPU ids, which are also the GPU cache's block indices)."""
        block_table = self._table(seq)
        _check_lookahead(num_lookahead_slots)
        # A Sequence's tokens and counts are checked as they come in: no need to again.
        block_table._append_checked(block_table.get_unseen_token_ids(seq.get_token_ids()), num_lookahead_slots,
                                    seq.data.get_num_computed_tokens(), seq.extra_hash())
        return self.block_allocator.clear_copy_on_writes()

    def fork(self, parent_seq: Sequence, child_seq: Sequence) -> None:
        """The child shares all of the parent's blocks (nothing happens if the parent has none)."""
        _check_seq("parent_seq", parent_seq)
        _check_seq("child_seq", child_seq)
        if parent_seq.seq_id not in self.block_tables:
            return
        if child_seq.seq_id in self.block_tables:
            raise BlockStateError(f"sequence {child_seq.seq_id} already has a block table")
        self.block_tables[child_seq.seq_id] = self.block_tables[parent_seq.seq_id].fork()
        self._last_access_blocks_tracker.add_seq(child_seq.seq_id)

    # ---- Freeing ------------------------------------------------------------------------------------
    def free(self, seq: Sequence) -> None:
        """Release a finished (or preempted) sequence's blocks; a sequence with no table is a
        no-op, except that its cached-token count is forgotten (vLLM returns first, and keeps the
        count of a request asked about and then dropped while waiting for ever). With caching,
        its blocks are first stamped with its last access time, so the evictor keeps recently
        used prefixes longer; and the blocks its computed tokens cover are marked computed (their
        KV was written, even if no ``mark_blocks_as_computed`` call said so), while those they
        do not cover wait in the evictor as cached but not computed: never offered as KV."""
        _check_seq("seq", seq)
        seq_id = seq.seq_id
        if seq_id not in self.block_tables:
            self.remove_seq_from_computed_blocks_tracker(seq)
            return
        block_table = self.block_tables[seq_id]
        if self.enable_caching:
            self._mark_computed_blocks(block_table, seq.data.get_num_computed_tokens())
        # Only GPU blocks carry access times (a swapped-out table's ids are CPU ids).
        gpu_ids = [i for i in block_table.physical_block_ids if i < self.num_total_gpu_blocks]
        self._last_access_blocks_tracker.update_seq_blocks_last_access(seq_id, gpu_ids)
        self._last_access_blocks_tracker.remove_seq(seq_id)
        self.remove_seq_from_computed_blocks_tracker(seq)
        block_table.free()
        del self.block_tables[seq_id]

    def remove_seq_from_computed_blocks_tracker(self, seq: Sequence) -> None:
        """Forget the sequence's prefix hashes. vLLM asserts they exist (so ``free`` failed for a
        sequence never asked about); here a sequence that was never tracked is fine."""
        _check_seq("seq", seq)
        if seq.seq_id in self._computed_blocks_tracker:
            self._computed_blocks_tracker.remove_seq(seq.seq_id)

    def free_cross(self, seq_group: SequenceGroup) -> None:
        _check_group(seq_group)
        request_id = seq_group.request_id
        if request_id not in self.cross_block_tables:
            return
        self.cross_block_tables[request_id].free()
        del self.cross_block_tables[request_id]

    # ---- Reading tables -------------------------------------------------------------------------------
    def get_block_table(self, seq: Sequence) -> list[int]:
        return self._table(seq).physical_block_ids

    def get_cross_block_table(self, seq_group: SequenceGroup) -> list[int]:
        _check_group(seq_group)
        request_id = seq_group.request_id
        if request_id not in self.cross_block_tables:
            raise KeyError(f"request {request_id!r} has no cross-attention block table")
        return self.cross_block_tables[request_id].physical_block_ids

    # ---- Prefix caching -------------------------------------------------------------------------------
    def access_all_blocks_in_seq(self, seq: Sequence, now: float) -> None:
        """Note when the sequence last ran; its blocks get the time when it is freed. The time is
        checked now (a str or NaN would only fail at ``free``, inside the evictor)."""
        _check_seq("seq", seq)
        check_time("now", now)
        if self.enable_caching:
            self._last_access_blocks_tracker.update_last_access(seq.seq_id, now)

    def mark_blocks_as_computed(self, seq_group: SequenceGroup, token_chunk_size: int) -> None:
        """The group's next ``token_chunk_size`` tokens are scheduled: each sequence's blocks
        that its computed tokens plus this chunk cover in full now count as computed, and may
        be shared as computed KV.

        vLLM ignores both arguments and marks every block cached since the last call, so after
        the first chunk of a chunked prefill the whole prompt's blocks were offered to other
        requests as KV to skip, though only the first chunk's had been written.
        """
        _check_group(seq_group)
        token_chunk_size = check_int("token_chunk_size", token_chunk_size, 0)
        if not self.enable_caching:
            return
        for seq in seq_group.get_seqs():
            block_table = self.block_tables.get(seq.seq_id)
            if block_table is not None:
                self._mark_computed_blocks(block_table, seq.data.get_num_computed_tokens() + token_chunk_size)

    def _mark_computed_blocks(self, block_table: BlockTable, num_computed_tokens: int) -> None:
        """Mark computed the table's leading blocks that ``num_computed_tokens`` fill (a block
        swapped out has a CPU id and is left alone). Cheap when nothing waits to be marked."""
        gpu_allocator = self.block_allocator._gpu_allocator
        if not gpu_allocator._touched_blocks:
            return
        num_blocks = min(num_computed_tokens, block_table.num_full_slots) // self.block_size
        if num_blocks:
            gpu_allocator._mark_ids_computed(block_table.physical_block_ids[:num_blocks])

    def get_common_computed_block_ids(self, seqs: list[Sequence]) -> list[int]:
        """The leading block ids that every sequence has cached and computed (the prefill can
        skip them)."""
        if not isinstance(seqs, (list, tuple)):
            raise TypeError(f"seqs must be a list of Sequences, got {type(seqs).__name__}")
        for seq in seqs:
            _check_seq("every item of seqs", seq)
        computed_seq_block_ids = []
        for seq in seqs:
            all_blocks = self._table(seq).physical_block_ids
            num_cached_tokens = self._computed_blocks_tracker.get_num_cached_tokens(seq)
            computed_seq_block_ids.append(all_blocks[:num_cached_tokens // self.block_size])
        return self.block_allocator.get_common_computed_block_ids(computed_seq_block_ids)

    def get_num_cached_tokens(self, seq: Sequence) -> int:
        """The leading prompt tokens whose KV is cached and computed (the prefill may skip them)."""
        _check_seq("seq", seq)
        return self._computed_blocks_tracker.get_num_cached_tokens(seq)

    def get_prefix_cache_hit_rate(self, device: Device) -> float:
        return self.block_allocator.get_prefix_cache_hit_rate(device)

    def reset_prefix_cache(self, device: Optional[Device] = None) -> bool:
        return self.block_allocator.reset_prefix_cache(device)

    # ---- Swapping ---------------------------------------------------------------------------------------
    def can_swap_in(self, seq_group: SequenceGroup, num_lookahead_slots: int) -> AllocStatus:
        return self._can_swap(seq_group, Device.GPU, SequenceStatus.SWAPPED, num_lookahead_slots)

    def can_swap_out(self, seq_group: SequenceGroup) -> bool:
        return self._can_swap(seq_group, Device.CPU, SequenceStatus.RUNNING) == AllocStatus.OK

    def _can_swap(self, seq_group: SequenceGroup, device: Device, status: SequenceStatus,
                  num_lookahead_slots: int = 0) -> AllocStatus:
        """Blocks the move would take on ``device``: the full blocks that are not there already
        (prefix caching may find some), every block that is not full, and the new blocks the
        unseen tokens and lookahead slots need. The watermark applies to the GPU only.

        Two corrections to vLLM, which counts only the last block that is not full (empty
        blocks reserved by an earlier lookahead move too, and its "yes" then ran out), and
        which says yes to a table holding the null block (it cannot move: NEVER here).
        """
        _check_group(seq_group)
        _check_lookahead(num_lookahead_slots)
        num_blocks_touched = self._num_null_blocks_needed() if device == Device.GPU else 0
        blocks = []
        for seq in seq_group.get_seqs(status=status):
            block_table = self._table(seq)
            if any(isinstance(block, NullBlock) for block in block_table.blocks):
                return AllocStatus.NEVER
            num_full_blocks = block_table.num_full_slots // self.block_size
            num_empty_slots = len(block_table.blocks) * self.block_size - block_table.num_full_slots
            num_new_slots = len(block_table.get_unseen_token_ids(seq.get_token_ids())) + num_lookahead_slots
            num_blocks_touched += (len(block_table.blocks) - num_full_blocks
                                   + max(0, cdiv(num_new_slots - num_empty_slots, self.block_size)))
            blocks.extend(block_table.blocks)
        num_blocks_touched += self.block_allocator.get_num_full_blocks_touched(blocks, device=device)
        watermark_blocks = self.watermark_blocks if device == Device.GPU else 0
        if self.block_allocator.get_num_total_blocks(device) < num_blocks_touched:
            return AllocStatus.NEVER
        if self.block_allocator.get_num_free_blocks(device) - num_blocks_touched >= watermark_blocks:
            return AllocStatus.OK
        return AllocStatus.LATER

    def swap_in(self, seq_group: SequenceGroup) -> list[tuple[int, int]]:
        """Move the group's swapped sequences to the GPU; returns (CPU block, GPU block) pairs
        of device-relative ids, the indices ``swap_blocks`` takes."""
        return self._swap(seq_group, SequenceStatus.SWAPPED, Device.CPU, Device.GPU)

    def swap_out(self, seq_group: SequenceGroup) -> list[tuple[int, int]]:
        """Move the group's running sequences to the CPU; returns (GPU block, CPU block) pairs
        of device-relative ids."""
        return self._swap(seq_group, SequenceStatus.RUNNING, Device.GPU, Device.CPU)

    def _swap(self, seq_group: SequenceGroup, status: SequenceStatus, src_device: Device,
              dst_device: Device) -> list[tuple[int, int]]:
        """All or nothing over the whole group: every table is checked to be on ``src_device``,
        and when the destination might not take them all, the swap is rehearsed on a copy."""
        _check_group(seq_group)
        seqs = [seq for seq in seq_group.get_seqs(status=status) if self._table(seq).blocks]
        src_ids = self.block_allocator._allocators[src_device].all_block_ids
        for seq in seqs:
            if any(block_id not in src_ids for block_id in self._table(seq).physical_block_ids):
                raise ValueError(f"sequence {seq.seq_id}'s blocks are not on {src_device.name}: "
                                 f"swap_{'in' if dst_device == Device.GPU else 'out'} needs them there")
        num_blocks = sum(len(self._table(seq).blocks) for seq in seqs)
        if num_blocks > self.block_allocator.get_num_free_blocks(dst_device):
            rehearse(lambda s: s[0]._swap_tables(s[1], src_device, dst_device), (self, seqs))
        return self._swap_tables(seqs, src_device, dst_device)

    def _swap_tables(self, seqs: list[Sequence], src_device: Device, dst_device: Device) -> list[tuple[int, int]]:
        physical_block_id_mapping = []
        for seq in seqs:
            block_table = self.block_tables[seq.seq_id]
            blocks = block_table.blocks
            seq_swap_mapping = self.block_allocator.swap(blocks=blocks, src_device=src_device, dst_device=dst_device)
            block_table.update(blocks)
            physical_block_id_mapping.extend(
                (self.block_allocator.get_physical_block_id(src_device, src_id),
                 self.block_allocator.get_physical_block_id(dst_device, dst_id))
                for src_id, dst_id in seq_swap_mapping.items())
        return physical_block_id_mapping

    # ---- Counts ---------------------------------------------------------------------------------------------
    def get_num_free_gpu_blocks(self) -> int:
        return self.block_allocator.get_num_free_blocks(Device.GPU)

    def get_num_free_cpu_blocks(self) -> int:
        return self.block_allocator.get_num_free_blocks(Device.CPU)
