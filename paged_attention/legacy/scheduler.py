"""A small first-come-first-served scheduler over the legacy block manager.

vLLM V0's scheduler asked the block manager its questions once per step; this is the least of it
that shows what the answers do to memory. Sequence groups wait in arrival order; the scheduler
keeps a *running* list and a *swapped* list, and each ``schedule()``:

1. **decodes** every running group: if ``can_append_slots`` says a group cannot grow by its new
   tokens, the most recently arrived running group is preempted, by swapping it out to the CPU
   (``can_swap_out``) or else by *recomputation* (its blocks are freed and it waits again, to be
   prefilled anew), until it can; then ``append_slots`` for each of its sequences, collecting the
   copy-on-write pairs;
2. **swaps in** swapped groups, oldest first, while ``can_swap_in`` is OK (only in a step that
   preempted nothing, as in V0: memory was just too short);
3. **admits** waiting groups in arrival order while ``can_allocate`` is OK, stopping at the first
   LATER (first come, first served: nobody overtakes) and dropping a NEVER; not while a group is
   still swapped out (it came first) nor in a step that preempted one. A group that not even an
   empty batch could take (more tokens to prefill than ``max_num_batched_tokens``: a group
   recomputed after it grew) is dropped too, as V0 ignored a prompt over its limit: waiting
   for it would stop the queue behind it for good;
4. under prefix caching, marks the scheduled tokens' blocks as computed (each group's chunk).

This is V0's order (``_schedule_default``: running, then swapped, then waiting). Unlike V0, which ran
prefills in steps of their own, a step here decodes the running groups *and* prefills the newly
admitted ones. By default the only limit is memory; an engine that runs a real model also caps a
step's batch (``max_num_seqs`` sequences, ``max_num_batched_tokens`` tokens), as V0's budget did.

``schedule()`` returns a ``StepRecord`` (``records``): what a model runner needs (the groups to
run with their token counts, the blocks to swap in, swap out and copy) and what happened. The
scheduler knows no model: whoever runs one (an engine, or the simulation in ``workload``) hands
back each sequence's sampled token and which sequences stopped, through ``update``.
"""
from __future__ import annotations

import bisect
from collections.abc import Collection, Mapping
from typing import Optional

from paged_attention.legacy.block_manager import SelfAttnBlockSpaceManager
from paged_attention.legacy.block_table import BlockTable
from paged_attention.legacy.interfaces import AllocStatus
from paged_attention.legacy.records import (
    ABORTED, ADMITTED, COPY_ON_WRITE, FINISHED, IGNORED, RECOMPUTED, SWAPPED_IN, SWAPPED_OUT, WAITED,
    BlockOwner, Event, ScheduledSequenceGroup, StepRecord,
)
from paged_attention.legacy.sequence import Sequence, SequenceGroup, SequenceStatus
from paged_attention.utils import Device, check_int

__all__ = ["FcfsScheduler", "SchedulerStalled"]


class SchedulerStalled(ValueError, RuntimeError):
    """``schedule()`` found nothing to do while groups wait: nothing to run, no block to move, no
    group to drop. Nothing would change, so every later step would find the same, forever; it
    raises this instead (leaving everything as it was). An engine drops its requests then."""


def _blocks(n: int) -> str:
    return f"{n} block" if n == 1 else f"{n} blocks"


class FcfsScheduler:
    """First come, first served over a ``SelfAttnBlockSpaceManager`` (see the module docstring).

    ``preemption_mode``: ``"swap"`` (the default) swaps a victim out when the CPU has room and
    recomputes it otherwise; ``"recompute"`` recomputes whenever it can (vLLM V0's default).
    Only a group with a single running sequence can be recomputed (its samples would otherwise
    be re-forked from one of them); a group of several samples that cannot be swapped out is
    aborted, as V0 did ("not enough CPU swap space"). A swapped group that cannot come back even
    to an otherwise empty GPU (the naive allocator does not keep the samples' sharing across a
    swap, so they may come back larger) is aborted too.

    Each step: ``add_seq_group`` for the groups that arrived, ``schedule()``, run the model on
    the record, then ``update(record, sampled_token_ids, finished_seq_ids)``. A step that would
    change nothing while groups wait raises ``SchedulerStalled`` rather than repeat forever.
    """

    def __init__(self, block_manager: SelfAttnBlockSpaceManager, *, preemption_mode: str = "swap",
                 max_num_seqs: Optional[int] = None, max_num_batched_tokens: Optional[int] = None,
                 record_block_owners: bool = True):
        if not isinstance(block_manager, SelfAttnBlockSpaceManager):
            raise TypeError(f"block_manager must be a SelfAttnBlockSpaceManager, got {type(block_manager).__name__}")
        if block_manager.max_block_sliding_window is not None:
            raise ValueError("this scheduler does not model sliding windows (it keeps no computed-slot counts "
                             "for them): use a manager without sliding_window")
        if preemption_mode not in ("swap", "recompute"):
            raise ValueError(f"preemption_mode must be 'swap' or 'recompute', got {preemption_mode!r}")
        if block_manager.block_tables:
            raise ValueError("the block manager already holds block tables: give the scheduler a fresh one")
        # The batch limits (None: none). A decode is never refused for them: only admissions
        # and swap-ins wait, so a limit can delay a request but never preempt one.
        self.max_num_seqs = None if max_num_seqs is None else check_int("max_num_seqs", max_num_seqs, 1)
        self.max_num_batched_tokens = (None if max_num_batched_tokens is None
                                       else check_int("max_num_batched_tokens", max_num_batched_tokens, 1))

        if not isinstance(record_block_owners, bool):
            raise TypeError(f"record_block_owners must be a bool, got {record_block_owners!r}")
        # Who holds each block, in every record (for the pool drawings): a walk over every table,
        # a quarter of a step's time with hundreds of running requests. An engine may skip it.
        self.record_block_owners = record_block_owners
        self.block_manager = block_manager
        self.preemption_mode = preemption_mode
        self.block_size = block_manager.block_size
        self.groups: dict[str, SequenceGroup] = {}          # every group ever added, by request id
        self._order: dict[str, int] = {}                      # request id -> arrival rank
        self._request_of: dict[int, str] = {}                 # seq id -> request id
        self.now = 0                                          # the next step's number
        self.waiting: list[str] = []                          # request ids, arrival order
        self.running: list[str] = []
        self.swapped: list[str] = []
        self.done_ids: list[str] = []                         # finished, ignored or aborted
        self.history: list[StepRecord] = []

    # ---- the queues -------------------------------------------------------------------------------
    def add_seq_group(self, seq_group: SequenceGroup) -> None:
        """A group arrives: it waits behind every group added before it."""
        if not isinstance(seq_group, SequenceGroup):
            raise TypeError(f"seq_group must be a SequenceGroup, got {type(seq_group).__name__}")
        rid = seq_group.request_id
        if rid in self.groups:
            raise ValueError(f"request {rid!r} was already added")
        seqs = seq_group.get_seqs()
        if any(seq.seq_id in self._request_of for seq in seqs):
            raise ValueError(f"request {rid!r} reuses a seq_id of an earlier request")
        if any(seq.status != SequenceStatus.WAITING for seq in seqs):
            raise ValueError(f"request {rid!r} has sequences that are not WAITING")
        self.groups[rid] = seq_group
        self._order[rid] = len(self._order)
        self._request_of.update((seq.seq_id, rid) for seq in seqs)
        self._insert(self.waiting, rid)

    def _insert(self, queue: list[str], request_id: str) -> None:
        """Put a request into a queue at its arrival position."""
        queue.insert(bisect.bisect(queue, self._order[request_id], key=self._order.__getitem__), request_id)

    def has_unfinished_seqs(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    @property
    def events(self) -> list[Event]:
        """Every step's events, in order."""
        return [e for record in self.history for e in record.events]

    # ---- one step ---------------------------------------------------------------------------------
    def schedule(self) -> StepRecord:
        """Decide this step: decodes (preempting if memory is short), swap-ins, admissions."""
        if self.history and self.history[-1].step == self.now:
            raise RuntimeError("schedule() was called twice: call update(record) after each schedule()")
        mgr = self.block_manager
        record = StepRecord(step=self.now)

        # 1. Decode the running groups, oldest first; preempt from the newest end when short.
        preempted = False
        queue = list(self.running)
        self.running = []
        while queue:
            rid = queue.pop(0)
            group = self.groups[rid]
            while not mgr.can_append_slots(group, num_lookahead_slots=0):
                victim = queue.pop() if queue else rid       # the most recently arrived one
                self._preempt(self.groups[victim], record)
                preempted = True
                if victim == rid:
                    break
            else:
                self._append_slots(group, record)
                record.decodes.append(group)
                self.running.append(rid)

        # 2. Swap groups back in, oldest first, unless this step was short of memory.
        load = self._batch_load()
        if not preempted:
            while self.swapped:
                rid = self.swapped[0]
                group = self.groups[rid]
                if not self._batch_has_room(load, group.num_seqs(SequenceStatus.SWAPPED), 1):
                    if load == [0, 0]:
                        # Not even an empty batch takes it: waiting would change nothing, forever.
                        self.swapped.pop(0)
                        self._abort(group, record, f"{group.num_seqs(SequenceStatus.SWAPPED)} samples "
                                                   f"exceed any step's batch ({self._batch_limits()})")
                        continue
                    break
                status = mgr.can_swap_in(group, num_lookahead_slots=0)
                if status == AllocStatus.OK:
                    self.swapped.pop(0)
                    self._swap_in(group, record)
                    self._add_to_load(load, group)
                    continue
                if status == AllocStatus.NEVER or not self.running:
                    # Even a GPU with nothing else on it would not take it back.
                    self.swapped.pop(0)
                    self._abort(group, record, "cannot be swapped back in: too large for the GPU")
                    continue
                break                                        # LATER: the others wait behind it

        # 3. Admit waiting groups in arrival order.
        if not preempted and not self.swapped:
            while self.waiting:
                rid = self.waiting[0]
                group = self.groups[rid]
                status = mgr.can_allocate(group)
                if status == AllocStatus.NEVER:
                    self.waiting.pop(0)
                    self._ignore(group, record)
                    continue
                if status == AllocStatus.LATER:
                    need = self._num_required_blocks(group)
                    free = mgr.get_num_free_gpu_blocks()
                    on_watermark = free >= need
                    why = "only the watermark holds it back" if on_watermark else "not enough free blocks"
                    record.events.append(Event(self.now, WAITED, rid,
                                               f"needs {_blocks(need)}, {free} free, watermark "
                                               f"{mgr.watermark_blocks}: {why}", num_blocks=need,
                                               on_watermark=on_watermark))
                    break
                seqs = group.get_seqs(SequenceStatus.WAITING)
                if not self._batch_has_room(load, len(seqs), seqs[0].get_len()):
                    if load == [0, 0]:
                        # Not even an empty batch takes its prefill (a group preempted by
                        # recomputation may have outgrown max_num_batched_tokens): ignored, as
                        # V0 ignored a prompt over its limit, rather than blocking the queue.
                        self.waiting.pop(0)
                        self._ignore(group, record, f"{len(seqs)} x {seqs[0].get_len()} tokens to prefill "
                                                    f"exceed any step's batch ({self._batch_limits()})")
                        continue
                    record.events.append(Event(self.now, WAITED, rid, "the step's batch is full "
                                               f"({self._batch_limits()})"))
                    break
                self.waiting.pop(0)
                self._admit(group, record)
                self._insert(self.running, rid)
                self._add_to_load(load, group)

        # 4. What the model runs: each group's chunk, the tokens its sequences have not computed.
        for group, is_prefill in [(g, True) for g in record.prefills] + [(g, False) for g in record.decodes]:
            seqs = group.get_seqs(SequenceStatus.RUNNING)
            chunk = max((seq.get_len() - seq.data.get_num_computed_tokens() for seq in seqs), default=0)
            record.scheduled_seq_groups.append(ScheduledSequenceGroup(
                group, chunk, is_prefill, record.num_cached_tokens.get(group.request_id, 0)))
            record.num_batched_tokens += chunk * len(seqs)

        if not (record.scheduled_seq_groups or record.blocks_to_swap_in or record.blocks_to_swap_out
                or record.blocks_to_copy or any(e.kind != WAITED for e in record.events)) and self.has_unfinished_seqs():
            # Nothing changed, so every step after this one would be the same: say so, not loop.
            why = "; ".join(f"{e.request_id}: {e.detail}" for e in record.events) or "no reason given"
            raise SchedulerStalled(f"step {self.now} would schedule nothing while {len(self.waiting)} groups wait and "
                                   f"{len(self.swapped)} are swapped out, and so would every step after it ({why})")

        # Prefix caching: the scheduled blocks count as computed from now on (as in V0, where
        # the scheduler did this once it had scheduled them), and every running sequence is
        # stamped with this step's time, for the evictor's LRU order once it is freed.
        if mgr.enable_caching:
            for rid in self.running:
                for seq in self.groups[rid].get_seqs(SequenceStatus.RUNNING):
                    mgr.access_all_blocks_in_seq(seq, float(self.now))
            for scheduled in record.scheduled_seq_groups:
                mgr.mark_blocks_as_computed(scheduled.seq_group, token_chunk_size=scheduled.token_chunk_size)

        record.running, record.swapped, record.waiting = list(self.running), list(self.swapped), list(self.waiting)
        if self.record_block_owners:
            record.gpu_owners, record.cpu_owners = self._owners()
            record.owners_recorded = True
        record.num_free_gpu_blocks = mgr.get_num_free_gpu_blocks()
        record.num_free_cpu_blocks = mgr.get_num_free_cpu_blocks()
        self.history.append(record)
        return record

    def update(self, record: StepRecord, sampled_token_ids: Mapping[int, int],
               finished_seq_ids: Collection[int] = ()) -> list[Sequence]:
        """The model has run ``record``: each scheduled sequence has its chunk computed and
        appends its sampled token (``sampled_token_ids``: seq id -> token; a sequence missing
        there computed part of a prefill and samples nothing yet). The sequences in
        ``finished_seq_ids`` (the caller's stop check: an output length, an end token) finish
        and are freed. Returns those."""
        if not self.history or record is not self.history[-1] or record.step != self.now:
            raise ValueError("update() takes the record the last schedule() returned, once")
        mgr = self.block_manager
        for scheduled in record.scheduled_seq_groups:
            group = scheduled.seq_group
            for sample, seq in enumerate(group.get_seqs()):
                if seq.status != SequenceStatus.RUNNING:
                    continue
                seq.data.update_num_computed_tokens(scheduled.token_chunk_size)
                if seq.seq_id in sampled_token_ids:
                    seq.append_token_id(sampled_token_ids[seq.seq_id])
                if seq.seq_id in finished_seq_ids:
                    seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED
                    mgr.free(seq)
                    record.finished.append(seq)
                    record.events.append(Event(self.now, FINISHED, group.request_id,
                                               f"sample {sample}: {seq.get_len() - seq.get_prompt_len()} tokens generated"))
            if group.is_finished() and group.request_id in self.running:
                self.running.remove(group.request_id)
                self.done_ids.append(group.request_id)
        self.now += 1
        return record.finished

    def _batch_load(self) -> list[int]:
        """[sequences, tokens] that the running groups put in this step's batch. Kept up to date
        as groups join (``_add_to_load``), so that each admission checks in O(1), not O(running)."""
        load = [0, 0]
        for rid in self.running:
            self._add_to_load(load, self.groups[rid])
        return load

    @staticmethod
    def _add_to_load(load: list[int], group: SequenceGroup) -> None:
        for seq in group.get_seqs(SequenceStatus.RUNNING):
            load[0] += 1
            load[1] += seq.get_len() - seq.data.get_num_computed_tokens()

    def _batch_has_room(self, load: list[int], num_seqs: int, tokens_per_seq: int) -> bool:
        """Whether ``num_seqs`` more sequences of ``tokens_per_seq`` new tokens each fit this
        step's batch limits, next to the ``load`` already in it."""
        if self.max_num_seqs is not None and load[0] + num_seqs > self.max_num_seqs:
            return False
        if self.max_num_batched_tokens is not None and load[1] + num_seqs * tokens_per_seq > self.max_num_batched_tokens:
            return False
        return True

    def _batch_limits(self) -> str:
        return f"max_num_seqs={self.max_num_seqs}, max_num_batched_tokens={self.max_num_batched_tokens}"

    def abort_seq_group(self, request_id: str, why: str = "aborted by the caller") -> None:
        """Drop a request wherever it is (waiting, running or swapped): its blocks are freed now.

        Between steps, or after a step that failed half-way (call ``update`` for it first). The
        event goes into the last record (or a record of its own if no step ran yet)."""
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {request_id!r}")
        if request_id not in self.groups:
            raise KeyError(f"unknown request {request_id!r}")
        group = self.groups[request_id]
        if group.is_finished():
            return
        for queue in (self.waiting, self.running, self.swapped):
            if request_id in queue:
                queue.remove(request_id)
        record = self.history[-1] if self.history else StepRecord(step=self.now)
        self._abort(group, record, why)

    # ---- what the steps do ------------------------------------------------------------------------
    def _num_required_blocks(self, group: SequenceGroup) -> int:
        """The blocks ``can_allocate`` counts: the first waiting sequence's tokens, unshared."""
        return BlockTable.get_num_required_blocks(group.get_seqs(SequenceStatus.WAITING)[0].get_token_ids(),
                                                  self.block_size)

    def _admit(self, group: SequenceGroup, record: StepRecord) -> None:
        mgr = self.block_manager
        free_before = mgr.get_num_free_gpu_blocks()
        mgr.allocate(group)
        seqs = group.get_seqs(SequenceStatus.WAITING)
        cached = mgr.get_num_cached_tokens(seqs[0]) if mgr.enable_caching else 0
        for seq in seqs:
            seq.status = SequenceStatus.RUNNING
        record.prefills.append(group)
        record.num_cached_tokens[group.request_id] = cached
        taken = free_before - mgr.get_num_free_gpu_blocks()
        detail = f"{seqs[0].get_len()} tokens, {len(seqs)} sample{'s' if len(seqs) > 1 else ''}: {_blocks(taken)}"
        if mgr.enable_caching:
            detail += f"; {cached} tokens found in the prefix cache"
        record.events.append(Event(self.now, ADMITTED, group.request_id, detail, num_blocks=taken))

    def _ignore(self, group: SequenceGroup, record: StepRecord, why: Optional[str] = None) -> None:
        """A waiting group that can never run: ``can_allocate`` said NEVER (the prompt does not
        fit even an empty GPU), or ``why``."""
        mgr = self.block_manager
        need = self._num_required_blocks(group)
        for seq in group.get_seqs(SequenceStatus.WAITING):
            seq.status = SequenceStatus.FINISHED_IGNORED
        self.done_ids.append(group.request_id)
        if why is None:
            why = f"needs {_blocks(need)}; the GPU has {mgr.num_total_gpu_blocks} (watermark {mgr.watermark_blocks})"
        record.events.append(Event(self.now, IGNORED, group.request_id, why, num_blocks=need))

    def _swap_in(self, group: SequenceGroup, record: StepRecord) -> None:
        """Bring a swapped group back to the GPU; it decodes this step."""
        pairs = self.block_manager.swap_in(group)
        for seq in group.get_seqs(SequenceStatus.SWAPPED):
            seq.status = SequenceStatus.RUNNING
        record.blocks_to_swap_in.extend(pairs)
        record.events.append(Event(self.now, SWAPPED_IN, group.request_id, f"{_blocks(len(pairs))} CPU → GPU",
                                   pairs=tuple(pairs), num_blocks=len(pairs)))
        self._append_slots(group, record)
        record.decodes.append(group)
        self._insert(self.running, group.request_id)

    def _append_slots(self, group: SequenceGroup, record: StepRecord) -> None:
        for sample, seq in enumerate(group.get_seqs()):
            if seq.status != SequenceStatus.RUNNING:
                continue
            pairs = self.block_manager.append_slots(seq, num_lookahead_slots=0)
            if pairs:
                record.blocks_to_copy.extend(pairs)
                record.events.append(Event(self.now, COPY_ON_WRITE, group.request_id,
                                           f"sample {sample}: " + ", ".join(f"{s} → {d}" for s, d in pairs),
                                           pairs=tuple(pairs), num_blocks=len(pairs)))

    def _preempt(self, group: SequenceGroup, record: StepRecord) -> None:
        mgr = self.block_manager
        rid = group.request_id
        running = group.get_seqs(SequenceStatus.RUNNING)
        can_swap = mgr.can_swap_out(group)
        if can_swap and (self.preemption_mode == "swap" or len(running) > 1):
            pairs = mgr.swap_out(group)
            for seq in running:
                seq.status = SequenceStatus.SWAPPED
            record.blocks_to_swap_out.extend(pairs)
            record.events.append(Event(self.now, SWAPPED_OUT, rid, f"{_blocks(len(pairs))} GPU → CPU",
                                       pairs=tuple(pairs), num_blocks=len(pairs)))
            self._insert(self.swapped, rid)
        elif len(running) == 1:
            seq = running[0]
            free_before = mgr.get_num_free_gpu_blocks()
            mgr.free(seq)
            seq.data.reset_state_for_recompute()
            seq.status = SequenceStatus.WAITING
            record.recomputed.append(group)
            record.events.append(Event(self.now, RECOMPUTED, rid,
                                       f"{_blocks(mgr.get_num_free_gpu_blocks() - free_before)} freed; "
                                       f"{seq.get_len()} tokens to prefill again",
                                       num_blocks=mgr.get_num_free_gpu_blocks() - free_before))
            self._insert(self.waiting, rid)
        else:
            self._abort(group, record, f"{len(running)} samples and no room on the CPU to swap them out")

    def _abort(self, group: SequenceGroup, record: StepRecord, why: str) -> None:
        for seq in group.get_seqs():
            if not seq.is_finished():
                self.block_manager.free(seq)
                seq.status = SequenceStatus.FINISHED_ABORTED
        self.done_ids.append(group.request_id)
        record.events.append(Event(self.now, ABORTED, group.request_id, why))

    # ---- who owns which block ---------------------------------------------------------------------
    def _owners(self) -> tuple[dict[int, BlockOwner], dict[int, BlockOwner]]:
        """Device-relative block id -> owner, for the GPU and the CPU, from the live tables."""
        mgr = self.block_manager
        num_gpu = mgr.num_total_gpu_blocks
        holders: dict[int, list[str]] = {}
        for seq_id, table in mgr.block_tables.items():
            rid = self._request_of[seq_id]
            for block_id in table.physical_block_ids:
                holders.setdefault(block_id, []).append(rid)
        gpu, cpu = {}, {}
        for block_id in sorted(holders):
            rids = tuple(sorted(set(holders[block_id]), key=self._order.get))
            owner = BlockOwner(rids, len(holders[block_id]))
            if block_id < num_gpu:
                gpu[block_id] = owner
            else:
                cpu[mgr.block_allocator.get_physical_block_id(Device.CPU, block_id)] = owner
        return gpu, cpu
