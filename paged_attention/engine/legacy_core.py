"""vLLM V0's scheduler and block manager (``legacy/``) behind the interface the engine expects of a core.

``LLM(core="v0")`` runs this: the "before" of the engine's ablation, and the project's V0 chapter
serving a real model. Each step:

1. ``schedule()``: the FCFS scheduler over the legacy block manager decides who runs (decodes
   first, preempting the newest by swap or recomputation when blocks run out; then swap-ins;
   then admissions, prefix-cache hits found there) and returns a ``StepRecord``. Its block moves
   (swap in, swap out, copies on write) are applied to every layer's real cache here, in V0's
   order. The record becomes a V1-shaped ``SchedulerOutput``: a request the runner does not
   hold (new, swapped back in, recomputed) comes whole, with the tokens to compute from; one it
   holds comes with the blocks it gained; one whose last block changed (a copy on write) has its
   row rewritten.
2. ``update_from_output()``: the sampled tokens are checked for stops (end tokens, ``max_tokens``,
   the context) and handed to the scheduler, which appends them and frees what finished.

V0 knows every token when it schedules (it appends a step's tokens before scheduling the next),
so it runs synchronously: no step is scheduled before the previous one's tokens are back.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from paged_attention.engine.sampling_params import SamplingParams
from paged_attention.kernels import reference
from paged_attention.legacy.block_manager import SelfAttnBlockSpaceManager
from paged_attention.legacy.records import ABORTED, IGNORED, StepRecord
from paged_attention.legacy.scheduler import FcfsScheduler, SchedulerStalled
from paged_attention.legacy.sequence import Sequence, SequenceGroup, SequenceStatus
from paged_attention.v1.core.sched.messages import EngineCoreOutput, ModelRunnerOutput
from paged_attention.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

# How the scheduler's end of a sequence reads as a finish reason (vLLM's names).
_END_REASONS = {IGNORED: "length", ABORTED: "abort"}


@dataclass
class LegacySchedulerOutput(SchedulerOutput):
    """V1's ``SchedulerOutput`` plus what only V0 needs: the requests whose one scheduled token
    is already in the cache (a prompt found whole in the prefix cache). Its logits are needed;
    its keys and values must not be written again into a block other requests share."""

    no_kv_write_req_ids: set[str] = field(default_factory=set)


@dataclass
class _LegacyRequest:
    seq: Sequence
    params: SamplingParams
    stop_ids: frozenset[int]


class LegacyCore:
    """The V0 scheduler and block manager, scheduling V1-shaped steps for the model runner."""

    def __init__(self, *, block_size: int, num_gpu_blocks: int, num_cpu_blocks: int, enable_prefix_caching: bool,
                 max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int, kv_caches: list,
                 cpu_kv_caches: list, preemption_mode: str = "swap", watermark: float = 0.01,
                 record_block_owners: bool = True) -> None:
        self.block_size, self.max_model_len = block_size, max_model_len
        self.block_manager = SelfAttnBlockSpaceManager(block_size, num_gpu_blocks, num_cpu_blocks,
                                                       watermark=watermark, enable_caching=enable_prefix_caching)
        self.scheduler = FcfsScheduler(self.block_manager, preemption_mode=preemption_mode,
                                       max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                       record_block_owners=record_block_owners)
        self.kv_caches, self.cpu_kv_caches = kv_caches, cpu_kv_caches
        self.requests: dict[str, _LegacyRequest] = {}
        # What the runner holds of each request: (number of block ids, the last one).
        self._held: dict[str, tuple[int, int]] = {}
        self._seq_ids = 0
        self._record: Optional[StepRecord] = None
        # Prompt tokens found in the prefix cache when each request was (last) admitted.
        self.num_cached_tokens: dict[str, int] = {}

    @property
    def history(self) -> list[StepRecord]:
        return self.scheduler.history

    # ---- requests -------------------------------------------------------------------------
    def check_prompt(self, num_tokens: int) -> None:
        """ValueError for a prompt no step can run whole (V0 does not chunk a prefill)."""
        if num_tokens > self.scheduler.max_num_batched_tokens:
            raise ValueError(f"the prompt has {num_tokens} tokens, more than one step may run "
                             f"(max_num_batched_tokens={self.scheduler.max_num_batched_tokens})")

    @property
    def usable_blocks(self) -> tuple[int, str]:
        """The most blocks one request can ever hold, and why not all of the pool's."""
        mgr = self.block_manager
        return (mgr.num_total_gpu_blocks - mgr.watermark_blocks,
                f"{mgr.num_total_gpu_blocks} blocks, {mgr.watermark_blocks} kept as the watermark")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    stop_ids: frozenset[int]) -> None:
        seq = Sequence(self._seq_ids, list(prompt_token_ids), self.block_size)
        self._seq_ids += 1
        self.scheduler.add_seq_group(SequenceGroup(request_id, [seq], arrival_time=float(seq.seq_id)))
        self.requests[request_id] = _LegacyRequest(seq, params, stop_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_seqs()

    # ---- one step -------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        record = self._record = self.scheduler.schedule()      # SchedulerStalled rather than spin
        self._move_blocks(record)
        so = LegacySchedulerOutput([], CachedRequestData.make_empty(), {}, 0, set())
        cached = so.scheduled_cached_reqs
        for scheduled in record.scheduled_seq_groups:
            rid = scheduled.seq_group.request_id
            request = self.requests[rid]
            seq = request.seq
            if seq.status != SequenceStatus.RUNNING:
                continue
            n = seq.get_len()
            start = n - scheduled.token_chunk_size
            if scheduled.is_prefill:
                self.num_cached_tokens[rid] = scheduled.num_cached_tokens
                start = max(start, scheduled.num_cached_tokens)
                if start >= n:
                    # The whole prompt is cached, but its last token's logits are needed: run that
                    # token again without writing its keys and values, which are in the cache
                    # already (a shared block: a rewrite could change another request's cache).
                    start = n - 1
                    so.no_kv_write_req_ids.add(rid)
            blocks = self.block_manager.get_block_table(seq)
            held = self._held.get(rid)
            if held is None:
                tokens = seq.get_token_ids()
                so.scheduled_new_reqs.append(NewRequestData(rid, tokens[:seq.get_prompt_len()], request.params,
                                                            (list(blocks),), start, prefill_token_ids=tokens))
            else:
                # Blocks only grow at the end, except that a copy on write replaces the last one.
                count, last = held
                same = count <= len(blocks) and (count == 0 or blocks[count - 1] == last)
                cached.req_ids.append(rid)
                cached.new_block_ids.append((list(blocks[count:] if same else blocks),))
                if not same:
                    cached.resumed_req_ids.add(rid)
                cached.num_computed_tokens.append(start)
                cached.num_output_tokens.append(seq.get_len() - seq.get_prompt_len())
            self._held[rid] = (len(blocks), blocks[-1] if blocks else -1)
            so.num_scheduled_tokens[rid] = n - start
            so.total_num_scheduled_tokens += n - start
        # Requests the runner holds that did not run this step: finished, or preempted.
        for rid in [r for r in self._held if r not in so.num_scheduled_tokens]:
            del self._held[rid]
            (so.preempted_req_ids if rid in self.requests else so.finished_req_ids).add(rid)
        return so

    def update_from_output(self, so: SchedulerOutput, output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Stops checked, the tokens handed to the scheduler; each request's news."""
        record, self._record = self._record, None
        sampled: dict[int, int] = {}
        reasons: dict[str, Optional[str]] = {}
        for rid, tokens in zip(output.req_ids, output.sampled_token_ids):
            request = self.requests[rid]
            seq, token, params = request.seq, tokens[0], request.params
            sampled[seq.seq_id] = token
            num_out = seq.get_len() - seq.get_prompt_len() + 1
            reasons[rid] = ("stop" if token in request.stop_ids else
                            "length" if num_out >= params.max_tokens or seq.get_len() + 1 >= self.max_model_len
                            else None)
        self.scheduler.update(record, sampled, [self.requests[r].seq.seq_id for r, why in reasons.items() if why])
        outputs = [EngineCoreOutput(rid, [sampled[self.requests[rid].seq.seq_id]], why)
                   for rid, why in reasons.items()]
        for event in record.events:
            if event.kind in _END_REASONS and event.request_id in self.requests:
                outputs.append(EngineCoreOutput(event.request_id, [], _END_REASONS[event.kind]))
        for out in outputs:
            if out.finish_reason is not None:
                self.requests.pop(out.request_id, None)
        return outputs

    def _move_blocks(self, record: StepRecord) -> None:
        """Apply the step's block moves to every layer, in vLLM V0's order: swap in, swap out,
        copy. Pairs are device-relative block ids, as the scheduler hands them over."""
        for pairs, src, dst in ((record.blocks_to_swap_in, self.cpu_kv_caches, self.kv_caches),
                                (record.blocks_to_swap_out, self.kv_caches, self.cpu_kv_caches)):
            if pairs:
                mapping = torch.tensor(pairs, dtype=torch.int64)
                for (k_src, v_src), (k_dst, v_dst) in zip(src, dst):
                    reference.swap_blocks(k_src, k_dst, mapping)
                    reference.swap_blocks(v_src, v_dst, mapping)
        if record.blocks_to_copy:
            mapping = torch.tensor(record.blocks_to_copy, dtype=torch.int64, device=self.kv_caches[0][0].device)
            reference.copy_blocks([k for k, _ in self.kv_caches], [v for _, v in self.kv_caches], mapping)

    # ---- failure --------------------------------------------------------------------------
    def abort_all(self, why: str = "aborted") -> list[str]:
        """Drop every unfinished request and free its blocks; the core is then as new (its pools
        full, its prefix cache empty: a step that failed half-way may have marked blocks computed
        whose keys and values were never written). Returns the request ids dropped."""
        sched = self.scheduler
        if sched.history and sched.history[-1].step == sched.now:
            # A step was scheduled but not updated: close it, with nothing sampled.
            try:
                sched.update(sched.history[-1], {}, ())
            except Exception:
                sched.now = sched.history[-1].step + 1    # its requests are dropped below anyway
        dropped = list(self.requests)
        for request_id in dropped:
            sched.abort_seq_group(request_id, why)
        self.requests.clear()
        self._held.clear()
        self.num_cached_tokens.clear()
        self._record = None
        self.block_manager.reset_prefix_cache()
        return dropped


__all__ = ["LegacyCore", "LegacySchedulerOutput", "SchedulerStalled"]
