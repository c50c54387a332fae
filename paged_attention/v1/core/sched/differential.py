"""Ours against vLLM's: one workload through two schedulers, compared step by step.

A workload is drawn from a seed: requests arrive over time with prompts built from a few shared
prefixes (so that prefix hits happen), ask for a random number of tokens, some stop at an end
token or a stop token, a few are aborted, and now and then the prefix cache is reset (running
requests preempted). The KV-cache layout, the pool size (tight pools force preemptions), the
token budget, ``max_num_seqs`` and the other settings are drawn too, or given.

Both schedulers are driven by the same fake model: the token sampled at position ``p`` of request
``r`` is a fixed function of ``(seed, r, p)``, and a request samples only in a step that reaches
the end of its known tokens (a prefill chunk that does not samples nothing), as vLLM's runner
does. The engine loop is vLLM's: with async scheduling the next step is scheduled before the
previous one's output is processed (a batch queue of two).

After every engine step ``replay`` compares, as plain data: the ``SchedulerOutput`` (new
requests with their block ids and cache hits, cached requests with their new blocks, resumed
ones, tokens scheduled per request in order, preempted, finished), what ``update_from_output``
returned (new tokens, finish and stop reasons) and both schedulers' state (the running and
waiting order, free blocks, every request's status and counters). The first difference raises
``SchedulerMismatch`` naming the step.
"""
from __future__ import annotations

import math
import random
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, Optional

import torch

from paged_attention.kv_cache import interface
from paged_attention.v1.core import kv_cache_utils
from paged_attention.v1.core.request import Request, RequestStatus
from paged_attention.v1.core.sched.async_scheduler import AsyncScheduler
from paged_attention.v1.core.sched.messages import ModelRunnerOutput
from paged_attention.v1.core.sched.scheduler import Scheduler

__all__ = ["FakeSamplingParams", "SchedulerMismatch", "SchedulerWorkload", "EngineLoop",
           "fake_model_output", "our_side", "vllm_side", "replay"]


# --------------------------------------------------------------------------------------------
# The workload
# --------------------------------------------------------------------------------------------

@dataclass
class SchedulerWorkload:
    """A scheduler configuration and the shape of the traffic it gets.

    ``groups`` lists the KV-cache groups: ``("full", block_size)`` or ``("window", block_size,
    sliding_window)``. The fields from ``max_num_seqs`` to ``use_v2_model_runner`` are the
    schedulers' arguments.
    """

    name: str
    seed: int
    groups: list[tuple] = field(default_factory=lambda: [("full", 4)])
    num_blocks: int = 64
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 64
    max_model_len: int = 128
    enable_caching: bool = True
    long_prefill_token_threshold: int = 0
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"
    scheduler_reserve_full_isl: bool = True
    use_v2_model_runner: bool = False
    async_scheduling: bool = False
    steps: int = 300
    arrivals: tuple[int, ...] = (0, 0, 0, 1, 1, 2)    # requests arriving per step, drawn
    num_prefixes: int = 3
    prefix_len: tuple[int, int] = (1, 40)
    suffix_len: tuple[int, int] = (1, 30)
    max_tokens: tuple[int, int] = (1, 30)
    p_eos: float = 0.5                  # share of requests with an end token
    p_stop: float = 0.3                 # share of requests with a stop token
    p_abort: float = 0.03               # chance per step that a random request is aborted
    p_reset: float = 0.005              # chance per step of a prefix-cache reset
    vocab: int = 40                     # token ids 0..vocab-1; 0 is the end token, 1 the stop

    SCHEDULER_ARGS = ("max_num_seqs", "max_num_batched_tokens", "max_model_len",
                      "enable_caching", "long_prefill_token_threshold",
                      "enable_chunked_prefill", "policy", "scheduler_reserve_full_isl",
                      "use_v2_model_runner")

    @classmethod
    def random(cls, seed: int, **overrides: Any) -> "SchedulerWorkload":
        """A configuration drawn from ``seed``: block sizes 4 to 16, one group or a hybrid
        (full attention and a sliding window), pools from just enough for one request to
        roomy, budgets 16 to 128, 2 to 8 sequences, every switch on or off."""
        rng = random.Random(seed)
        block_size = rng.choice([4, 8, 16])
        max_model_len = rng.choice([64, 128])
        num_blocks = max_model_len // block_size + 1 + rng.choice([0, 2, 8, 40])
        groups: list[tuple] = [("full", block_size)]
        if rng.random() < 0.25:
            groups.append(("window", rng.choice([block_size, 2 * block_size]),
                           rng.choice([block_size, 2 * block_size + 3])))
            num_blocks *= 2
        values: dict[str, Any] = dict(
            name=f"random-{seed}", seed=seed, groups=groups, num_blocks=num_blocks,
            max_num_seqs=rng.choice([2, 4, 8]),
            max_num_batched_tokens=rng.choice([16, 32, 64, 128]),
            max_model_len=max_model_len, enable_caching=rng.random() < 0.8,
            long_prefill_token_threshold=rng.choice([0, 0, 8, 24]),
            scheduler_reserve_full_isl=rng.random() < 0.5,
            use_v2_model_runner=rng.random() < 0.3,
            policy=rng.choice(["fcfs", "fcfs", "priority"]),
            async_scheduling=rng.random() < 0.4)
        if values["max_num_batched_tokens"] >= max_model_len and rng.random() < 0.3:
            values["enable_chunked_prefill"] = False
        values.update(overrides)
        return cls(**values)

    def scheduler_kwargs(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.SCHEDULER_ARGS}

    def kv_cache_config(self, classes: Any = interface) -> Any:
        """The KV-cache config, built with ``classes``' spec classes (ours by default; vLLM's
        with ``classes=oracle.load()``)."""
        specs = []
        for group in self.groups:
            common = dict(block_size=group[1], num_kv_heads=1, head_size=8, dtype=torch.float32)
            if group[0] == "full":
                specs.append(classes.FullAttentionSpec(**common))
            else:
                specs.append(classes.SlidingWindowSpec(**common, sliding_window=group[2]))
        return classes.KVCacheConfig(num_blocks=self.num_blocks, kv_cache_tensors=[],
                                     kv_cache_groups=[classes.KVCacheGroupSpec([f"layer{i}"], s)
                                                      for i, s in enumerate(specs)])

    @property
    def hash_block_size(self) -> int:
        return math.gcd(*(g[1] for g in self.groups))

    def describe(self) -> str:
        changed = [f"{f.name}={getattr(self, f.name)!r}" for f in fields(self)
                   if f.name not in ("name", "seed")
                   and getattr(self, f.name) != getattr(_DEFAULTS, f.name)]
        return f"{self.name} (seed {self.seed}: {', '.join(changed) or 'defaults'})"


_DEFAULTS = SchedulerWorkload("defaults", 0)


@dataclass
class RequestSpec:
    """One request of a workload, before it is made for either side."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    eos_token_id: Optional[int]
    stop_token_ids: Optional[list[int]]
    priority: int
    arrival_time: float


@dataclass(frozen=True)
class FakeSamplingParams:
    """What the scheduler reads of a request's sampling parameters."""

    max_tokens: int
    eos_token_id: Optional[int] = None
    stop_token_ids: Optional[list[int]] = None


# --------------------------------------------------------------------------------------------
# The fake model and the engine loop
# --------------------------------------------------------------------------------------------

def fake_token(seed: int, request_id: str, position: int, vocab: int) -> int:
    """The token the fake model samples at ``position`` of ``request_id``: fixed, so that a
    preempted request regenerates what it had, and both schedulers see the same tokens."""
    return zlib.crc32(f"{seed}/{request_id}/{position}".encode()) % vocab


def fake_model_output(scheduler: Any, scheduler_output: Any, seed: int, vocab: int,
                      output_cls: type = ModelRunnerOutput) -> Any:
    """The runner's answer to ``scheduler_output``, computed right after ``schedule()``: one
    token for every request whose scheduled tokens reach the end of what it knows (its next
    position is ``num_computed_tokens``), none for a prefill chunk that stops short."""
    req_ids = list(scheduler_output.num_scheduled_tokens)
    requests = scheduler.requests
    sampled = []
    for req_id in req_ids:
        request = requests[req_id]
        sampled.append([] if request.is_prefill_chunk else
                       [fake_token(seed, req_id, request.num_computed_tokens, vocab)])
    return output_cls(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                      sampled_token_ids=sampled)


class EngineLoop:
    """vLLM's engine loop around a scheduler and the fake model (``EngineCore.step`` and, with
    more than one batch in flight, ``step_with_batch_queue``): schedule; with room in the batch
    queue, return at once; else process the oldest batch's output."""

    def __init__(self, scheduler: Any, seed: int, vocab: int, batch_queue_size: int = 1,
                 output_cls: type = ModelRunnerOutput,
                 on_schedule: Optional[Callable[[Any], None]] = None) -> None:
        self.scheduler = scheduler
        # Sees each SchedulerOutput as soon as it is made: vLLM's may share lists with its
        # requests (the V2 runner's prefill_token_ids), which later steps extend.
        self.on_schedule = on_schedule
        self.seed, self.vocab = seed, vocab
        self.batch_queue_size = batch_queue_size
        self.output_cls = output_cls
        self.batch_queue: list[tuple[Any, Any]] = []

    def step(self) -> tuple[Any, Any]:
        """``(the SchedulerOutput scheduled, or None; update_from_output's result, or None)``."""
        scheduler, queue = self.scheduler, self.batch_queue
        scheduler_output = None
        if scheduler.has_requests():
            scheduler_output = scheduler.schedule()
            if self.on_schedule is not None:
                self.on_schedule(scheduler_output)
            queue.insert(0, (scheduler_output, fake_model_output(
                scheduler, scheduler_output, self.seed, self.vocab, self.output_cls)))
            if len(queue) < self.batch_queue_size and (
                    scheduler_output.total_num_scheduled_tokens > 0 or scheduler.has_requests()):
                return scheduler_output, None
        elif not queue:
            return None, None
        done, model_output = queue.pop()
        return scheduler_output, scheduler.update_from_output(done, model_output)


# --------------------------------------------------------------------------------------------
# The two sides
# --------------------------------------------------------------------------------------------

@dataclass
class Side:
    """A scheduler, its engine loop, and how to make its requests."""

    name: str
    scheduler: Any
    loop: EngineLoop
    make_request: Callable[[RequestSpec], Any]
    statuses: Any       # the side's RequestStatus


def our_side(workload: SchedulerWorkload, scheduler_cls: Optional[type] = None) -> Side:
    """Our ``Scheduler`` (``AsyncScheduler`` for an async workload), or ``scheduler_cls``."""
    if scheduler_cls is None:
        scheduler_cls = AsyncScheduler if workload.async_scheduling else Scheduler
    scheduler = scheduler_cls(workload.kv_cache_config(), **workload.scheduler_kwargs())
    kv_cache_utils.init_none_hash(kv_cache_utils.sha256)
    hasher = kv_cache_utils.get_request_block_hasher(workload.hash_block_size,
                                                     kv_cache_utils.sha256)

    def make(spec: RequestSpec) -> Request:
        params = FakeSamplingParams(spec.max_tokens, spec.eos_token_id, spec.stop_token_ids)
        return Request(spec.request_id, spec.prompt_token_ids, params, None,
                       priority=spec.priority, arrival_time=spec.arrival_time,
                       block_hasher=hasher)
    loop = EngineLoop(scheduler, workload.seed, workload.vocab,
                      2 if workload.async_scheduling else 1)
    return Side("ours", scheduler, loop, make, RequestStatus)


def vllm_side(o: Any, workload: SchedulerWorkload) -> Side:
    """vLLM's ``Scheduler`` or ``AsyncScheduler`` (``o = oracle.load(scheduler=True)``)."""
    from paged_attention.v1.core.sched.oracle_config import vllm_request, vllm_scheduler

    scheduler = vllm_scheduler(o, workload.kv_cache_config(o),
                               async_scheduling=workload.async_scheduling,
                               **workload.scheduler_kwargs())
    o.init_none_hash(o.sha256)
    hasher = o.get_request_block_hasher(workload.hash_block_size, o.sha256)

    def make(spec: RequestSpec) -> Any:
        return vllm_request(o, spec.request_id, spec.prompt_token_ids, spec.max_tokens, hasher,
                            eos_token_id=spec.eos_token_id, stop_token_ids=spec.stop_token_ids,
                            priority=spec.priority, arrival_time=spec.arrival_time)
    loop = EngineLoop(scheduler, workload.seed, workload.vocab,
                      2 if workload.async_scheduling else 1, output_cls=o.ModelRunnerOutput)
    return Side("vLLM", scheduler, loop, make, o.RequestStatus)


# --------------------------------------------------------------------------------------------
# What is compared, as plain data
# --------------------------------------------------------------------------------------------

def _groups(block_ids: Any) -> Any:
    return None if block_ids is None else [list(g) for g in block_ids]


def describe_output(scheduler_output: Any) -> Optional[dict[str, Any]]:
    """A ``SchedulerOutput`` (ours or vLLM's) as plain data."""
    if scheduler_output is None:
        return None
    cached = scheduler_output.scheduled_cached_reqs
    return {
        "new requests": [
            (n.req_id, list(n.prompt_token_ids), _groups(n.block_ids), n.num_computed_tokens,
             None if n.prefill_token_ids is None else list(n.prefill_token_ids))
            for n in scheduler_output.scheduled_new_reqs],
        "cached requests": list(cached.req_ids),
        "resumed": sorted(cached.resumed_req_ids),
        "all token ids": {k: list(v) for k, v in sorted(cached.all_token_ids.items())},
        "new block ids": [_groups(b) for b in cached.new_block_ids],
        "num computed tokens": list(cached.num_computed_tokens),
        "num output tokens": list(cached.num_output_tokens),
        "tokens scheduled": list(scheduler_output.num_scheduled_tokens.items()),
        "total": scheduler_output.total_num_scheduled_tokens,
        "preempted": sorted(scheduler_output.preempted_req_ids or ()),
        "finished": sorted(scheduler_output.finished_req_ids),
    }


def describe_results(results: Any) -> Optional[dict[int, list]]:
    """What ``update_from_output`` returned, per client, as plain data."""
    if results is None:
        return None
    return {client: [(out.request_id, list(out.new_token_ids),
                      None if out.finish_reason is None else str(out.finish_reason),
                      out.stop_reason) for out in outs.outputs]
            for client, outs in sorted(results.items())}


def describe_state(scheduler: Any) -> dict[str, Any]:
    """What a scheduler holds between steps, as plain data."""
    return {
        "running": [r.request_id for r in scheduler.running],
        "waiting": [r.request_id for r in scheduler.waiting],
        "free blocks": scheduler.kv_cache_manager.block_pool.get_num_free_blocks(),
        "requests": {rid: (r.status.name, r.num_computed_tokens, r.num_tokens,
                           r.num_output_placeholders, r.num_preemptions)
                     for rid, r in sorted(scheduler.requests.items())},
    }


class SchedulerMismatch(AssertionError):
    """The two schedulers disagreed; the message names the step and the difference."""


@dataclass
class ReplayStats:
    """What a replay exercised (so that a test can check it was not vacuous)."""

    engine_steps: int = 0
    requests: int = 0
    tokens_scheduled: int = 0
    prefix_hits: int = 0
    chunked_prefills: int = 0
    preemptions: int = 0
    resumed: int = 0
    finished: int = 0
    aborted: int = 0
    resets: int = 0
    full_budget_steps: int = 0
    full_batch_steps: int = 0


def _compare(step: int, what: str, values: list[Any], sides: list[Side]) -> None:
    if all(v == values[0] for v in values[1:]):
        return
    first, second = values[0], values[1]
    if isinstance(first, dict) and isinstance(second, dict):
        for key in first:
            if first.get(key) != second.get(key):
                raise SchedulerMismatch(
                    f"step {step}, {what}, {key!r}: {sides[0].name} {first.get(key)!r}, "
                    f"{sides[1].name} {second.get(key)!r}")
    raise SchedulerMismatch(f"step {step}, {what}: {sides[0].name} {first!r}, "
                            f"{sides[1].name} {second!r}")


def replay(workload: SchedulerWorkload, sides: list[Side],
           on_step: Optional[Callable[[int, list[Any]], None]] = None) -> ReplayStats:
    """Run ``workload`` on every side, comparing after every engine step; raise
    ``SchedulerMismatch`` at the first difference (its message names the workload). ``on_step(
    step, scheduler_outputs)`` sees each step (for drawings). Returns what was exercised."""
    try:
        return _replay(workload, sides, on_step)
    except SchedulerMismatch as exc:
        raise SchedulerMismatch(f"{workload.describe()}: {exc}") from None


def _replay(workload: SchedulerWorkload, sides: list[Side],
            on_step: Optional[Callable[[int, list[Any]], None]]) -> ReplayStats:
    rng = random.Random(workload.seed * 7919 + 1)
    prefixes = [[rng.randrange(workload.vocab) for _ in range(rng.randint(*workload.prefix_len))]
                for _ in range(workload.num_prefixes)]
    stats = ReplayStats()
    seen_hits: set[str] = set()
    preempted: set[str] = set()
    scheduled: list[list[Any]] = [[] for _ in sides]
    for side, described in zip(sides, scheduled):
        side.loop.on_schedule = lambda out, described=described: described.append(
            describe_output(out))
    for step in range(workload.steps):
        for _ in range(rng.choice(workload.arrivals)):
            prompt = (rng.choice(prefixes)[:rng.randint(0, workload.prefix_len[1])]
                      + [rng.randrange(workload.vocab)
                         for _ in range(rng.randint(*workload.suffix_len))])
            spec = RequestSpec(
                request_id=f"r{stats.requests}",
                prompt_token_ids=prompt[:workload.max_model_len - 1],
                max_tokens=rng.randint(*workload.max_tokens),
                eos_token_id=0 if rng.random() < workload.p_eos else None,
                stop_token_ids=[1] if rng.random() < workload.p_stop else None,
                priority=rng.randrange(3), arrival_time=float(stats.requests))
            for side in sides:
                side.scheduler.add_request(side.make_request(spec))
            stats.requests += 1
        live = sorted(sides[0].scheduler.requests)
        if live and rng.random() < workload.p_abort:
            victim = rng.choice(live)
            aborted = [[r.request_id for r in side.scheduler.finish_requests(
                victim, side.statuses.FINISHED_ABORTED)] for side in sides]
            _compare(step, "finish_requests", aborted, sides)
            stats.aborted += len(aborted[0])
        if rng.random() < workload.p_reset:
            reset = [side.scheduler.reset_prefix_cache(reset_running_requests=True)
                     for side in sides]
            _compare(step, "reset_prefix_cache", reset, sides)
            stats.resets += 1

        for described in scheduled:
            described.clear()
        results = [side.loop.step() for side in sides]
        outputs = [described[0] if described else None for described in scheduled]
        _compare(step, "SchedulerOutput", outputs, sides)
        _compare(step, "update_from_output", [describe_results(r[1]) for r in results], sides)
        _compare(step, "state", [describe_state(side.scheduler) for side in sides], sides)
        if on_step is not None:
            on_step(step, [r[0] for r in results])

        stats.engine_steps += 1
        out = outputs[0]
        if out is None:
            continue
        stats.tokens_scheduled += out["total"]
        stats.preemptions += len(out["preempted"])
        preempted.update(out["preempted"])
        # A resumed request comes back as a cached one (V1 runner) or a new one (V2).
        stats.resumed += len(out["resumed"]) + sum(
            1 for n in out["new requests"] if n[0] in preempted)
        stats.finished += len(out["finished"])
        stats.full_budget_steps += out["total"] == workload.max_num_batched_tokens
        stats.full_batch_steps += len(out["tokens scheduled"]) == workload.max_num_seqs
        for req_id, _, _, num_computed, _ in out["new requests"]:
            if num_computed > 0 and req_id not in seen_hits:
                seen_hits.add(req_id)
                stats.prefix_hits += 1
        requests = sides[0].scheduler.requests
        for req_id, n in out["tokens scheduled"]:
            request = requests.get(req_id)
            if request is not None and n > 1 and request.is_prefill_chunk:
                stats.chunked_prefills += 1
    return stats
