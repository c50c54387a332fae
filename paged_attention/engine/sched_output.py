"""What a scheduler hands the model runner each step, and what comes back: vLLM V1's shapes.

``SchedulerOutput`` says who runs and how many tokens each brings: requests seen for the first
time (or again, after a preemption) come whole in ``scheduled_new_reqs`` (their tokens, block
ids and how many tokens are already computed); requests the runner already holds come in
``scheduled_cached_reqs`` with only what changed (new block ids, the computed count).
``num_scheduled_tokens`` gives the batch's order. ``finished_req_ids`` and ``preempted_req_ids``
are requests whose runner state can go. The runner answers with a ``ModelRunnerOutput``: one
sampled token per request of the batch. The core turns that into ``EngineCoreOutput``s: each
request's new tokens, and whether it finished.

Field names are vLLM's (``vllm/v1/core/sched/output.py``, ``vllm/v1/outputs.py``), with what a
small engine needs and nothing more. The legacy (V0) core builds the same objects from its
scheduler's step (``engine/legacy_core.py``), so one runner serves both cores.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class NewRequestData:
    """A request the runner has no state for: everything it needs to build one."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: Any
    block_ids: tuple[list[int], ...]           # one list per KV-cache group (one group here)
    num_computed_tokens: int                   # tokens whose keys and values are cached already
    # The tokens to compute from: the prompt, or (resumed after preemption) the prompt and the
    # output so far. None means the prompt.
    prefill_token_ids: Optional[list[int]] = None


@dataclass
class CachedRequestData:
    """Requests the runner holds: for each, the blocks it gained and its computed count.
    For a request in ``resumed_req_ids`` the block ids replace its row instead of extending it."""

    req_ids: list[str] = field(default_factory=list)
    resumed_req_ids: set[str] = field(default_factory=set)
    new_block_ids: list[Optional[tuple[list[int], ...]]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]       # request id -> new tokens this step, in batch order
    total_num_scheduled_tokens: int
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    # The legacy core only: requests whose one scheduled token is already in the cache (a prompt
    # found whole in the prefix cache). Its logits are needed; its keys and values must not be
    # written again into a block other requests share.
    no_kv_write_req_ids: set[str] = field(default_factory=set)


@dataclass
class ModelRunnerOutput:
    """One step's sampled tokens: ``sampled_token_ids[req_id_to_index[r]]`` is request ``r``'s."""

    req_ids: list[str]
    req_id_to_index: dict[str, int]
    sampled_token_ids: list[list[int]]


@dataclass
class EngineCoreOutput:
    """What a step did for one request, as the core reports it to the engine: the tokens it
    gained, and why it finished (None while it runs; ``"stop"``, ``"length"`` or ``"abort"``)."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: Optional[str] = None
    num_cached_tokens: int = 0


__all__ = ["NewRequestData", "CachedRequestData", "SchedulerOutput", "ModelRunnerOutput", "EngineCoreOutput"]
