"""vLLM V1's scheduler (``vllm/v1/core/sched/scheduler.py``): who runs this step, and how much.

V1 has no prefill phase and no decode phase. Every request has ``num_tokens`` (prompt plus the
tokens generated so far) and ``num_computed_tokens`` (tokens whose keys and values are in the
KV cache); each step the scheduler hands out a budget of ``max_num_batched_tokens`` tokens so that
requests catch up. A decode is a request one token behind; a prefill is one many tokens behind,
and when the budget cannot hold all of it, it gets a *chunk* now and the rest in later steps
(chunked prefill). ``schedule()``:

1. serves the **running** requests first, in order. Each gets what it is behind by (at most
   ``long_prefill_token_threshold`` when set, at most what is left of the budget) and the KV-cache
   manager is asked for slots (``allocate_slots``). When there are no free blocks left, the
   *last* running request is **preempted by recomputation**: its blocks are freed, its computed
   tokens forgotten, and it goes back to the *front* of the waiting queue (to be prefilled again
   later, prompt and generated tokens together, which prefix caching often makes cheap). This
   repeats until the allocation succeeds or the request preempted is the one asking;
2. then, only if nobody was preempted this step, **admits waiting** requests in order while the
   budget lasts and fewer than ``max_num_seqs`` run: the prefix cache is asked for the longest
   cached prefix (``get_computed_blocks``; those tokens need no computing), and the rest (or a
   chunk of it) is allocated. The first request that does not fit stops admission: first come,
   first served, nobody overtakes.

It returns a ``SchedulerOutput``; the model runs it; ``update_from_output`` appends the sampled
tokens, stops requests (end token, a stop token, ``max_tokens``, the context length) and frees
their blocks.

Configuration. vLLM reads these from its config objects; here they are plain arguments:

- ``max_num_seqs``, ``max_num_batched_tokens``, ``long_prefill_token_threshold``,
  ``enable_chunked_prefill``, ``policy``, ``scheduler_reserve_full_isl``, ``watermark``: the
  ``SchedulerConfig`` fields of the same names (defaults 128, 2048, 0, True, "fcfs", True, 0.0);
- ``max_model_len``: ``ModelConfig.max_model_len`` (the model's context length);
- ``enable_caching``: ``CacheConfig.enable_prefix_caching`` (True);
- ``block_size``, ``hash_block_size``, ``include_finished_set``: the arguments of the same names
  of vLLM's ``Scheduler`` (its engine passes ``CacheConfig.block_size``, 16, for one group);
- ``use_v2_model_runner``: ``VllmConfig.use_v2_model_runner`` (how resumed requests are sent).

What vLLM's scheduler also does and this one leaves out: speculative decoding, KV connectors
(disaggregated prefill, offloading), encoder inputs (multimodal), structured output, LoRA,
pipeline parallelism, streaming input sessions, pausing, and statistics.
"""
from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from paged_attention.kv_cache.interface import FullAttentionSpec
from paged_attention.utils import cdiv, check_int
from paged_attention.v1.core.kv_cache_coordinator import default_block_sizes
from paged_attention.v1.core.kv_cache_manager import _NOT_TAKEN, KVCacheBlocks, KVCacheManager
from paged_attention.v1.core.request import Request, RequestStatus
from paged_attention.v1.core.sched.messages import (
    EngineCoreOutput, EngineCoreOutputs, ModelRunnerOutput,
)
from paged_attention.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from paged_attention.v1.core.sched.request_queue import SchedulingPolicy, create_request_queue
from paged_attention.v1.core.sched.utils import check_stop, remove_all

__all__ = ["Scheduler"]


def _priority_order(request: Request) -> tuple[int, float]:
    return request.priority, request.arrival_time


# The statuses the per-request loops compare with, looked up once.
_RUNNING, _PREEMPTED = RequestStatus.RUNNING, RequestStatus.PREEMPTED


@dataclass
class StepBudget:
    """What one ``schedule()`` call has decided so far: the budget left, who runs (how many
    tokens, which new blocks) and who was preempted."""

    token_budget: int
    long_prefill_threshold: int
    new_reqs: list[Request] = field(default_factory=list)
    resumed_reqs: list[Request] = field(default_factory=list)
    running_reqs: list[Request] = field(default_factory=list)
    preempted_reqs: list[Request] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    req_to_new_blocks: dict[str, KVCacheBlocks] = field(default_factory=dict)

    def schedule(self, request: Request, num_new_tokens: int, new_blocks: KVCacheBlocks) -> None:
        self.num_scheduled_tokens[request.request_id] = num_new_tokens
        self.req_to_new_blocks[request.request_id] = new_blocks
        self.token_budget -= num_new_tokens

    def unschedule(self, request: Request) -> None:
        self.running_reqs.remove(request)
        self.token_budget += self.num_scheduled_tokens.pop(request.request_id)
        del self.req_to_new_blocks[request.request_id]


class Scheduler:
    """One token budget per step, shared by the running requests (first) and newly admitted ones.

    ``Scheduler(kv_cache_config, max_num_seqs=128, max_num_batched_tokens=2048,
    max_model_len=8192, block_size=None, enable_caching=True, long_prefill_token_threshold=0,
    enable_chunked_prefill=True, policy="fcfs", scheduler_reserve_full_isl=True, watermark=0.0,
    use_v2_model_runner=False, include_finished_set=False, hash_block_size=None)``. It builds
    its own ``KVCacheManager`` over ``kv_cache_config``. ``block_size`` (the scheduler's block)
    and ``hash_block_size`` (the granularity of prefix-cache hashes) default as vLLM's engine
    picks them: one KV-cache group, its block size; several, the least common multiple and the
    greatest common divisor of theirs.
    """

    # Steps that may be in flight at once: one here; two for the AsyncScheduler (the next step
    # is scheduled while the model still runs this one).
    max_concurrent_batches: int = 1
    # Whether a scheduled step counts the token it will sample as a placeholder (the
    # AsyncScheduler's way of planning the next step before this one's tokens are known).
    holds_output_placeholders: bool = False

    def __init__(
        self,
        kv_cache_config: Any,
        max_num_seqs: int = 128,
        max_num_batched_tokens: int = 2048,
        max_model_len: int = 8192,
        block_size: Optional[int] = None,
        enable_caching: bool = True,
        long_prefill_token_threshold: int = 0,
        enable_chunked_prefill: bool = True,
        policy: str = "fcfs",
        scheduler_reserve_full_isl: bool = True,
        watermark: float = 0.0,
        use_v2_model_runner: bool = False,
        include_finished_set: bool = False,
        hash_block_size: Optional[int] = None,
    ) -> None:
        self.max_num_running_reqs = check_int("max_num_seqs", max_num_seqs, 1)
        self.max_num_scheduled_tokens = check_int(
            "max_num_batched_tokens", max_num_batched_tokens, 1)
        self.max_model_len = check_int("max_model_len", max_model_len, 2)
        self.long_prefill_token_threshold = check_int(
            "long_prefill_token_threshold", long_prefill_token_threshold, 0)
        for name, flag in (("enable_caching", enable_caching),
                           ("enable_chunked_prefill", enable_chunked_prefill),
                           ("scheduler_reserve_full_isl", scheduler_reserve_full_isl),
                           ("use_v2_model_runner", use_v2_model_runner),
                           ("include_finished_set", include_finished_set)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {flag!r}")
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= "
                             f"max_num_seqs ({max_num_seqs})")
        if not enable_chunked_prefill and max_num_batched_tokens < max_model_len:
            raise ValueError(f"without chunked prefill, max_num_batched_tokens "
                             f"({max_num_batched_tokens}) must be >= max_model_len "
                             f"({max_model_len}), or longer prompts could never run")
        if long_prefill_token_threshold > max_model_len:
            raise ValueError(f"long_prefill_token_threshold ({long_prefill_token_threshold}) "
                             f"cannot exceed max_model_len ({max_model_len})")
        try:
            self.policy = SchedulingPolicy(policy)
        except ValueError:
            raise ValueError(
                f"unknown scheduling policy {policy!r}: 'fcfs' or 'priority'") from None
        if isinstance(watermark, bool) or not isinstance(watermark, (int, float)):
            raise TypeError(f"watermark must be a float, got {watermark!r}")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        groups = getattr(kv_cache_config, "kv_cache_groups", None)
        if not groups:
            raise TypeError("kv_cache_config must be a KVCacheConfig with at least one group")
        default_block_size, default_hash_block_size = default_block_sizes(kv_cache_config)
        self.block_size = check_int(
            "block_size", default_block_size if block_size is None else block_size, 1)
        self.hash_block_size = check_int(
            "hash_block_size",
            default_hash_block_size if hash_block_size is None else hash_block_size, 1)
        self.enable_chunked_prefill = enable_chunked_prefill
        self.scheduler_reserve_full_isl = scheduler_reserve_full_isl
        self.use_v2_model_runner = use_v2_model_runner
        self.kv_cache_config = kv_cache_config
        # What one request needs at most: a block per block_size tokens in every full-attention
        # group (sliding windows need fewer); block 0, the null block, is never handed out.
        self._full_attention_block_sizes = [
            g.kv_cache_spec.block_size for g in groups
            if isinstance(g.kv_cache_spec, FullAttentionSpec)]
        self._usable_blocks = kv_cache_config.num_blocks - 1

        self.kv_cache_manager = KVCacheManager(
            kv_cache_config=kv_cache_config,
            max_model_len=self.max_model_len,
            max_in_flight_tokens=self.max_concurrent_batches * self.max_num_scheduled_tokens,
            enable_caching=enable_caching,
            scheduler_block_size=self.block_size,
            hash_block_size=self.hash_block_size,
            watermark=watermark,
        )

        # Every request not finished yet, by id; the waiting queue and the running list.
        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(self.policy)
        self.running: list[Request] = []
        # Requests finished or preempted since the last step: the next SchedulerOutput says so.
        self.finished_req_ids: set[str] = set()
        self.reset_preempted_req_ids: set[str] = set()
        # Finished ids per client, handed out with the next outputs (when include_finished_set).
        self.finished_req_ids_dict: Optional[dict[int, set[str]]] = (
            defaultdict(set) if include_finished_set else None)
        # Requests scheduled in the previous step: the worker's copy of their tokens is current.
        self.prev_step_scheduled_req_ids: set[str] = set()

    # ---- Requests in and out --------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a new request (it waits until ``schedule`` admits it).

        Refused (ValueError, nothing queued): a request id already here, an empty prompt, a
        prompt that leaves no room in ``max_model_len`` for one generated token (vLLM refuses
        these before they reach its scheduler), or a request that could not fit in the KV cache
        even alone, at its full length (its prompt and ``max_tokens``, up to ``max_model_len``):
        it would wait, or be preempted, forever. vLLM has no such check in its scheduler; its
        engine refuses to start unless a request of ``max_model_len`` tokens fits.
        """
        if not isinstance(request, Request):
            raise TypeError(f"add_request takes a Request, got {type(request).__name__}")
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the scheduler")
        if request.status != RequestStatus.WAITING or request.num_computed_tokens:
            raise ValueError(f"request {request.request_id!r} is not new "
                             f"(status {request.status.name})")
        if request.num_prompt_tokens == 0:
            raise ValueError(f"request {request.request_id!r} has an empty prompt")
        if request.num_tokens >= self.max_model_len:
            raise ValueError(f"request {request.request_id!r} has {request.num_tokens} tokens; "
                             f"max_model_len={self.max_model_len} leaves no room to generate")
        longest = min(request.num_prompt_tokens + request.max_tokens, self.max_model_len)
        needed = 0
        for size in self._full_attention_block_sizes:     # a loop, not sum(): per request
            needed += cdiv(longest, size)
        if needed > self._usable_blocks:
            raise ValueError(f"request {request.request_id!r} needs {needed} blocks at its full "
                             f"length ({longest} tokens); the KV cache has {self._usable_blocks}")
        self.waiting.add_request(request)
        self.requests[request.request_id] = request

    def finish_requests(self, request_ids: Union[str, Iterable[str], None],
                        finished_status: RequestStatus) -> list[Request]:
        """End requests from outside (a client went away: ``FINISHED_ABORTED``), wherever they
        are, and free their blocks. ``None`` means all. Unknown or already finished ids are
        ignored; the requests actually finished are returned."""
        if not isinstance(finished_status, RequestStatus) or not finished_status.is_finished(
                finished_status):
            raise ValueError(
                f"finished_status must be a FINISHED_* status, got {finished_status!r}")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        elif request_ids is None:
            request_ids = list(self.requests)
        else:
            request_ids = set(request_ids)

        running, waiting, valid = set(), [], []
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue
            valid.append(request)
            if request.status == RequestStatus.RUNNING:
                running.add(request)
            else:
                waiting.append(request)
        if running:
            self.running = remove_all(self.running, running)
        if waiting:
            self.waiting.remove_requests(waiting)
        for request in valid:
            request.status = finished_status
            self._free_request(request)
        return valid

    def _free_request(self, request: Request) -> None:
        """A finished request leaves: the worker is told next step, its blocks go back."""
        req_id = request.request_id
        self.finished_req_ids.add(req_id)
        if self.finished_req_ids_dict is not None:
            self.finished_req_ids_dict[request.client_index].add(req_id)
        self.kv_cache_manager.free(request)
        del self.requests[req_id]

    # ---- One step --------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Decide this step: the running requests first, then (if nobody was preempted) the
        waiting ones, within one token budget. See the module's description."""
        self.kv_cache_manager.new_step_starts()
        # The cap on a long prefill keeps it from starving the others; alone, it may take all.
        num_running, num_waiting = self.get_request_counts()
        step = StepBudget(self.max_num_scheduled_tokens,
                        self.long_prefill_token_threshold if num_running + num_waiting > 1 else 0)
        self._schedule_running(step)
        if not step.preempted_reqs:
            # Memory was short enough to preempt: admitting anyone now would only thrash.
            self._schedule_waiting(step)
        return self._make_scheduler_output(step)

    def _schedule_running(self, step: StepBudget) -> None:
        """Give each running request, in order, the tokens it is behind by, preempting from the
        back of the list when blocks run out."""
        manager = self.kv_cache_manager
        running = self.running
        # This loop runs once per running request and step: what it reads of the scheduler,
        # the step and the manager is looked up once, and each request's counts once.
        allocate_slots, max_model_len = manager.allocate_slots, self.max_model_len
        # The call made here, allocate_slots(request, n) with n a positive int, is the one that
        # allocate_slots hands to its running fast path: call that path directly (one call
        # less per request), where the manager's allocate_slots is ours and the path may apply.
        allocate_running = (
            manager._allocate_running_full_attention
            if (type(manager).allocate_slots is KVCacheManager.allocate_slots
                and manager._running_fast_path is not False) else None)
        threshold = step.long_prefill_threshold
        # StepBudget.schedule written out (per request and step): the budget lives in a local
        # and goes back to the step around a preemption, which may unschedule someone.
        scheduled_reqs_append = step.running_reqs.append
        num_scheduled_tokens = step.num_scheduled_tokens
        req_to_new_blocks = step.req_to_new_blocks
        token_budget = step.token_budget
        req_index = 0
        while req_index < len(running) and token_budget > 0:
            request = running[req_index]
            num_placeholders = request.num_output_placeholders
            num_computed = request.num_computed_tokens
            if (num_placeholders > 0 and num_computed + 2 - num_placeholders
                    >= request.num_prompt_tokens + request.max_tokens):
                # Async scheduling: the step in flight already produces its last token.
                req_index += 1
                continue

            num_new_tokens = len(request._all_token_ids) + num_placeholders - num_computed
            if 0 < threshold < num_new_tokens:
                num_new_tokens = threshold
            # At most the budget left, and room in the context for the token this step samples
            # (conditionals rather than min(): this runs per request and step).
            if num_new_tokens > token_budget:
                num_new_tokens = token_budget
            room = max_model_len - num_computed - 1
            if num_new_tokens > room:
                num_new_tokens = room
            if num_new_tokens <= 0:
                # Nothing to run now (under async scheduling, its tokens are all in flight).
                # Skip it rather than stop: the requests behind it may still run.
                req_index += 1
                continue

            while True:
                new_blocks = (allocate_running(request, num_new_tokens, False, True)
                              if allocate_running is not None else _NOT_TAKEN)
                if new_blocks is _NOT_TAKEN:
                    new_blocks = allocate_slots(request, num_new_tokens)
                if new_blocks is not None:
                    break
                # Out of blocks: preempt someone, and try again with what that freed.
                step.token_budget = token_budget
                victim = self._preemption_victim()
                victim_index = (len(running) - 1 if victim is running[-1]
                                else running.index(victim))
                del running[victim_index]
                if victim_index < req_index:
                    req_index -= 1
                    if victim.request_id in step.num_scheduled_tokens:
                        step.unschedule(victim)     # given tokens this step: take them back
                        token_budget = step.token_budget
                self._preempt_request(victim)
                step.preempted_reqs.append(victim)
                if victim is request:
                    break               # it preempted itself: nothing left to free

            if new_blocks is None:
                if (self.policy == SchedulingPolicy.PRIORITY
                        and request.status == RequestStatus.PREEMPTED):
                    # It was the lowest priority and is gone; req_index already names the next,
                    # which may fit in what it freed.
                    continue
                break

            scheduled_reqs_append(request)
            request_id = request.request_id
            num_scheduled_tokens[request_id] = num_new_tokens
            req_to_new_blocks[request_id] = new_blocks
            token_budget -= num_new_tokens
            req_index += 1
        step.token_budget = token_budget

    def _preemption_victim(self) -> Request:
        """Whom to preempt when blocks run out. First come, first served: the last running
        request (the latest admitted). Priority: the largest ``(priority, arrival_time)``,
        the first such in the running list on a tie."""
        if self.policy == SchedulingPolicy.PRIORITY:
            return max(self.running, key=_priority_order)
        return self.running[-1]

    def _schedule_waiting(self, step: StepBudget) -> None:
        """Admit waiting requests in order while the budget and ``max_num_seqs`` allow, each
        with its longest cached prefix; the first one that does not fit stops admission."""
        manager = self.kv_cache_manager
        skipped: deque[Request] = deque()
        # This loop runs once per admitted request: what it reads of the scheduler and the
        # step is looked up once, and StepBudget.schedule is written out (the budget lives in
        # a local and goes back to the step at the end).
        waiting, running = self.waiting, self.running
        max_num_running_reqs = self.max_num_running_reqs
        threshold = step.long_prefill_threshold
        enable_chunked_prefill = self.enable_chunked_prefill
        must_fit = self.scheduler_reserve_full_isl
        get_computed_blocks, allocate_slots = manager.get_computed_blocks, manager.allocate_slots
        num_scheduled_tokens = step.num_scheduled_tokens
        req_to_new_blocks = step.req_to_new_blocks
        token_budget = step.token_budget
        while token_budget > 0 and waiting:
            if len(running) >= max_num_running_reqs:
                break
            request = waiting.peek_request()
            if request.num_stale_output_tokens and not request.drop_stale_output:
                # Async scheduling: output of its preempted run is still in flight and would
                # land on positions a new run resamples. Wait for it, out of the others' way.
                skipped.appendleft(waiting.pop_request())
                continue

            # The longest cached prefix needs no computing (never the whole prompt: the last
            # token must run to give logits).
            new_computed_blocks, num_computed_tokens, request.shared_prefix_boundary = (
                get_computed_blocks(request))
            num_new_tokens = request.num_tokens - num_computed_tokens
            if 0 < threshold < num_new_tokens:
                num_new_tokens = threshold
            if not enable_chunked_prefill and num_new_tokens > token_budget:
                break
            if num_new_tokens > token_budget:
                num_new_tokens = token_budget

            new_blocks = allocate_slots(
                request, num_new_tokens,
                num_new_computed_tokens=num_computed_tokens,
                new_computed_blocks=new_computed_blocks,
                full_sequence_must_fit=must_fit,
                has_scheduled_reqs=bool(running),
            )
            if new_blocks is None:
                break                   # does not fit: it and everyone behind it wait

            waiting.pop_request()
            running.append(request)
            if request.status == RequestStatus.WAITING:
                step.new_reqs.append(request)
            else:
                step.resumed_reqs.append(request)
            # A new request's worker entry lists all its blocks, cache hits included.
            request_id = request.request_id
            num_scheduled_tokens[request_id] = num_new_tokens
            req_to_new_blocks[request_id] = manager.get_blocks(request_id)
            token_budget -= num_new_tokens
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_computed_tokens
        step.token_budget = token_budget
        if skipped:
            self.waiting.prepend_requests(skipped)

    def _make_scheduler_output(self, step: StepBudget) -> SchedulerOutput:
        num_scheduled_tokens = step.num_scheduled_tokens
        req_to_new_blocks = step.req_to_new_blocks
        total_num_scheduled_tokens = self.max_num_scheduled_tokens - step.token_budget
        if len(self.running) > self.max_num_running_reqs:
            raise RuntimeError("more running requests than max_num_seqs (a scheduler bug)")

        new_reqs, resumed_reqs = step.new_reqs, step.resumed_reqs
        if self.use_v2_model_runner:
            # V2's runner takes a resumed request as a new one, with all its tokens to prefill.
            new_reqs, resumed_reqs = new_reqs + resumed_reqs, []
            # (A copy of the request's own list: the same tokens as its read-only view holds,
            # without list() walking the view in Python, per admitted request.)
            new_reqs_data = [
                NewRequestData.from_request(req, req_to_new_blocks[req.request_id].get_block_ids(),
                                            list(req._all_token_ids))
                for req in new_reqs]
        else:
            new_reqs_data = [
                NewRequestData.from_request(req, req_to_new_blocks[req.request_id].get_block_ids())
                for req in new_reqs]
        cached_reqs_data = self._make_cached_request_data(
            step.running_reqs, resumed_reqs, req_to_new_blocks)
        if not self.use_v2_model_runner:
            self.prev_step_scheduled_req_ids = set(num_scheduled_tokens)

        scheduler_output = SchedulerOutput(
            scheduled_new_reqs=new_reqs_data,
            scheduled_cached_reqs=cached_reqs_data,
            num_scheduled_tokens=num_scheduled_tokens,
            total_num_scheduled_tokens=total_num_scheduled_tokens,
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids=self.reset_preempted_req_ids,
        )
        self._update_after_schedule(scheduler_output)
        return scheduler_output

    def _preempt_request(self, request: Request, drop_stale_output: bool = False) -> None:
        """Preemption by recomputation: free the blocks of ``request`` (already taken out of
        the running list), forget what it computed, put it first in the waiting queue.

        Its generated tokens are kept: when it comes back it prefills prompt and output
        together. Under async scheduling, output of its last step may still arrive; it is marked
        stale (delivered, but it does not move the request's counters).
        """
        self.kv_cache_manager.free(request)
        request.num_cache_checked_blocks = 0    # its blocks are gone, cached or not
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.drop_stale_output = drop_stale_output or (
            request.drop_stale_output and request.num_stale_output_tokens > 0)
        request.num_stale_output_tokens = request.num_in_flight_tokens
        request.num_output_placeholders = 0
        request.num_preemptions += 1
        self.waiting.prepend_request(request)
        self.reset_preempted_req_ids.add(request.request_id)

    def _update_after_schedule(self, scheduler_output: SchedulerOutput) -> None:
        """Count the scheduled tokens as computed now, before the model runs them, so that the
        next step can be scheduled at once (the output only adds the sampled tokens)."""
        requests = self.requests
        placeholders = self.holds_output_placeholders
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            request = requests[req_id]
            request.num_computed_tokens += n
            request.num_in_flight_tokens += n
            request.is_prefill_chunk = request.num_computed_tokens < (
                len(request._all_token_ids) + request.num_output_placeholders)
            if placeholders and not request.is_prefill_chunk:
                # Async scheduling: this step samples its next token; hold a place for it.
                request.num_output_placeholders += 1
        # New sets: the output just built keeps the old ones.
        self.finished_req_ids = set()
        self.reset_preempted_req_ids = set()

    def _make_cached_request_data(self, running_reqs: list[Request], resumed_reqs: list[Request],
                                  req_to_new_blocks: dict[str, KVCacheBlocks]) -> CachedRequestData:
        reqs = running_reqs + resumed_reqs if resumed_reqs else running_reqs
        # One comprehension per field (this runs for every running request every step).
        req_ids = [req.request_id for req in reqs]
        resumed_req_ids = {req.request_id for req in resumed_reqs}
        all_token_ids: dict[str, list[int]] = {}
        if not self.use_v2_model_runner:
            prev = self.prev_step_scheduled_req_ids
            all_token_ids = {req.request_id: list(req.all_token_ids) for req in reqs
                             if req.request_id not in prev}
        # Most steps give most requests no new block: the manager's shared empty answer.
        no_blocks = self.kv_cache_manager.empty_kv_cache_blocks
        new_block_ids = [None if blocks is no_blocks else blocks.get_block_ids(allow_none=True)
                         for blocks in map(req_to_new_blocks.__getitem__, req_ids)]
        return CachedRequestData(
            req_ids=req_ids, resumed_req_ids=resumed_req_ids, all_token_ids=all_token_ids,
            new_block_ids=new_block_ids,
            num_computed_tokens=[req.num_computed_tokens for req in reqs],
            num_output_tokens=[len(req._output_token_ids) + req.num_output_placeholders for req in reqs])

    # ---- The model's answer ---------------------------------------------------------------
    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput) -> dict[int, EngineCoreOutputs]:
        """Take the tokens sampled in a step: append them, stop the requests that are done and
        free their blocks. Returns, per client, an ``EngineCoreOutput`` for every request with
        new tokens or a finish reason. A request still in its prefill samples nothing (the
        runner returns no token for it) and gets no output."""
        sampled_token_ids = model_runner_output.sampled_token_ids
        req_id_to_index = model_runner_output.req_id_to_index
        outputs: dict[int, list[EngineCoreOutput]] = defaultdict(list)
        stopped_running: set[Request] = set()
        stopped_preempted: set[Request] = set()

        # This loop runs once per request and step: attributes are read once into locals.
        get_request, max_model_len = self.requests.get, self.max_model_len
        manager = self.kv_cache_manager
        cache_blocks, hash_block_size = manager.cache_blocks, self.hash_block_size
        if type(manager).cache_blocks is KVCacheManager.cache_blocks and manager.enable_caching:
            # What that method does with caching on: ask the coordinator (one call less for
            # each request at a block boundary).
            cache_blocks = manager.coordinator.cache_blocks
        last_client, add_output = object(), None     # no client yet: nothing equals it
        for req_id, num_tokens_scheduled in scheduler_output.num_scheduled_tokens.items():
            request = get_request(req_id)
            if request is None:
                continue        # finished and gone while the step ran
            num_in_flight = request.num_in_flight_tokens - num_tokens_scheduled
            request.num_in_flight_tokens = num_in_flight
            output_is_stale = request.num_stale_output_tokens > 0
            if output_is_stale:
                # Output of a run that was preempted since: drain it.
                request.num_stale_output_tokens -= num_tokens_scheduled
            status_before_stop = request.status
            if status_before_stop > _PREEMPTED:
                continue        # finished (aborted) while the step ran
            if output_is_stale and request.drop_stale_output:
                continue

            new_token_ids = sampled_token_ids[req_id_to_index[req_id]] if sampled_token_ids else []
            stopped = False
            if new_token_ids:
                had_placeholders = request.num_output_placeholders > 0
                if len(new_token_ids) == 1 and not output_is_stale:
                    # The common case, one token of a live run: _update_request_with_output's
                    # one-token path, written out (this runs for every request every step).
                    request.append_output_token_ids(new_token_ids[0])
                    stopped = check_stop(request, max_model_len)
                    if had_placeholders:
                        request.num_output_placeholders -= 1
                else:
                    new_token_ids, stopped = self._update_request_with_output(
                        request, new_token_ids, is_stale=output_is_stale)
                if (not output_is_stale and status_before_stop == _RUNNING
                        and had_placeholders):
                    # Async scheduling: blocks filled by tokens only now known can be cached.
                    # While the computed tokens are all hashed (tokens are known before they
                    # are computed), what that caches depends only on how many whole hash
                    # blocks they fill. The manager is asked when that count moves (once per
                    # hash block of tokens), not again for the same count while the request
                    # keeps its blocks (a preemption starts the count again).
                    num_computed = request.num_computed_tokens - num_in_flight
                    num_blocks = num_computed // hash_block_size
                    num_hashed = len(request.block_hashes)
                    if (num_blocks != request.num_cache_checked_blocks
                            or num_blocks > num_hashed):
                        cache_blocks(request, num_computed)
                        request.num_cache_checked_blocks = min(num_blocks, num_hashed)

            finish_reason = None
            if stopped:
                finish_reason = request.get_finished_reason()
                self._free_request(request)
                if status_before_stop == _RUNNING:
                    stopped_running.add(request)
                else:
                    stopped_preempted.add(request)
            if new_token_ids or stopped:
                # (Positional: keywords cost twice as much, per request and step.) The list of
                # the previous request's client is kept at hand: most steps have one client.
                client = request.client_index
                if client != last_client:
                    last_client = client
                    add_output = outputs[client].append
                add_output(EngineCoreOutput(req_id, new_token_ids, finish_reason,
                                            request.stop_reason))

        if stopped_running:
            self.running = remove_all(self.running, stopped_running)
        if stopped_preempted:
            self.waiting.remove_requests(stopped_preempted)

        engine_core_outputs = {client: EngineCoreOutputs(outputs=outs)
                               for client, outs in outputs.items()}
        if self.finished_req_ids_dict:
            for client, finished in self.finished_req_ids_dict.items():
                if client in engine_core_outputs:
                    engine_core_outputs[client].finished_requests = finished
                else:
                    engine_core_outputs[client] = EngineCoreOutputs(finished_requests=finished)
            self.finished_req_ids_dict.clear()
        return engine_core_outputs

    def _update_request_with_output(self, request: Request, new_token_ids: list[int],
                                    is_stale: bool = False) -> tuple[list[int], bool]:
        """Append the sampled tokens one by one, stopping at the first that ends the request
        (the tokens after it are dropped). Returns the tokens kept and whether it stopped."""
        num_new_tokens = len(new_token_ids)
        stopped = False
        for num_kept, token_id in enumerate(new_token_ids, 1):
            request.append_output_token_ids(token_id)
            if check_stop(request, self.max_model_len):
                stopped = True
                if not is_stale:
                    # Its computed count covered the dropped tokens too.
                    request.num_computed_tokens -= num_new_tokens - num_kept
                new_token_ids = new_token_ids[:num_kept]
                break
        if not is_stale and request.num_output_placeholders > 0:
            request.num_output_placeholders -= num_new_tokens
        return new_token_ids, stopped

    # ---- Questions and upkeep --------------------------------------------------------------
    def get_request_counts(self) -> tuple[int, int]:
        """``(running, waiting)``."""
        return len(self.running), len(self.waiting)

    def get_num_unfinished_requests(self) -> int:
        return len(self.running) + len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

    def has_finished_requests(self) -> bool:
        """Whether finished requests wait to be reported in the next ``SchedulerOutput``."""
        return bool(self.finished_req_ids)

    def has_requests(self) -> bool:
        return self.has_unfinished_requests() or self.has_finished_requests()

    def has_request(self, request_id: str) -> bool:
        return request_id in self.requests

    def get_kv_cache_usage(self) -> float:
        """The fraction of the KV cache's blocks in use (0.0 to 1.0)."""
        return self.kv_cache_manager.usage

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget every cached prefix. Only possible while no request holds blocks; with
        ``reset_running_requests`` the running ones are preempted first (their in-flight output
        is dropped). Returns whether the cache was reset."""
        if reset_running_requests:
            # Last first, so that they are back at the front of the queue in their order.
            while self.running:
                self._preempt_request(self.running.pop(), drop_stale_output=True)
            self.prev_step_scheduled_req_ids.clear()
        reset = self.kv_cache_manager.reset_prefix_cache()
        if reset_running_requests and not reset:
            raise RuntimeError("the prefix cache could not be reset although no request runs")
        return reset
