"""What one scheduling step hands the model runner (vLLM's ``vllm/v1/core/sched/output.py``).

The scheduler and the worker keep copies of the same requests. To keep the message small, a step
sends a request's whole state only once, when the worker first sees it (``NewRequestData``);
after that it sends only what changed (``CachedRequestData``): the blocks allocated this step and
how many tokens are computed. ``SchedulerOutput`` adds how many tokens of each request run this
step, and which requests left since the last step (finished, or preempted and so dropped by the
worker until they come back).

Block ids travel as one list per KV-cache group: ``block_ids[g]`` for group ``g``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from paged_attention.v1.core.request import Request


@dataclass
class NewRequestData:
    """A request the worker has not seen (or has dropped): everything it needs to run it.

    ``block_ids`` are all the request's blocks (cache hits included), ``num_computed_tokens``
    the tokens already in them (the prefix-cache hit). ``prefill_token_ids`` is set only for a
    model runner that takes resumed requests as new ones (vLLM's V2 runner): the prompt plus
    the tokens generated before the preemption, all to be recomputed.
    """

    req_id: str
    prompt_token_ids: Optional[list[int]]
    sampling_params: Any
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int
    prefill_token_ids: Optional[list[int]] = None

    @classmethod
    def from_request(cls, request: "Request", block_ids: tuple[list[int], ...],
                     prefill_token_ids: Optional[list[int]] = None) -> "NewRequestData":
        # (Positional, in the fields' order: once per admitted request, and keywords cost
        # twice as much.)
        return cls(request.request_id, request.prompt_token_ids, request.sampling_params,
                   block_ids, request.num_computed_tokens, prefill_token_ids)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids) if self.prompt_token_ids is not None else 0


@dataclass
class CachedRequestData:
    """The requests the worker already holds, as parallel lists (one entry per request).

    * ``new_block_ids[i]``: the blocks added this step, per group, or None if none were;
    * ``num_computed_tokens[i]``: tokens computed before this step;
    * ``num_output_tokens[i]``: tokens generated so far (placeholders of tokens still being
      sampled included, under async scheduling);
    * ``resumed_req_ids``: requests back from a preemption. Their blocks were all freed, so
      their ``new_block_ids`` replace the worker's row instead of extending it;
    * ``all_token_ids``: every token id of the requests that did not run in the previous step,
      whose copy on the worker may be stale (a resumed request, or one skipped for a step).
    """

    req_ids: list[str]
    resumed_req_ids: set[str]
    all_token_ids: dict[str, list[int]]
    new_block_ids: list[Optional[tuple[list[int], ...]]]
    num_computed_tokens: list[int]
    num_output_tokens: list[int]

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    @classmethod
    def make_empty(cls) -> "CachedRequestData":
        return cls(req_ids=[], resumed_req_ids=set(), all_token_ids={}, new_block_ids=[],
                   num_computed_tokens=[], num_output_tokens=[])


@dataclass
class SchedulerOutput:
    """One step's plan.

    ``num_scheduled_tokens[req_id]`` is the number of tokens the request runs this step (a
    prefill chunk, or 1 for a decode), in scheduling order: running requests first, then the
    newly admitted ones. Their sum is ``total_num_scheduled_tokens``, never more than the
    token budget (``max_num_batched_tokens``). ``finished_req_ids`` are the requests that
    finished since the previous step (the worker frees their state); ``preempted_req_ids`` those
    preempted since then (this step's preemptions included).
    """

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: set[str]
    preempted_req_ids: set[str] = field(default_factory=set)

    @classmethod
    def make_empty(cls) -> "SchedulerOutput":
        return cls(scheduled_new_reqs=[], scheduled_cached_reqs=CachedRequestData.make_empty(),
                   num_scheduled_tokens={}, total_num_scheduled_tokens=0, finished_req_ids=set())
