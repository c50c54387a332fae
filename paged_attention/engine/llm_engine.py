"""The engine loop: requests in, one step at a time, tokens out.

Three parts, as in vLLM today:

* a **core** decides each step: who runs and how many tokens each brings (a ``SchedulerOutput``),
  and, once the step's tokens are back, which requests stopped. ``core="v1"``: the V1 scheduler
  over the V1 KV-cache manager (``v1/core/``); ``core="v0"``: the legacy scheduler and block
  manager (``engine/legacy_core.py``);
* the **model runner** (``engine/model_runner.py``) turns a step into the model's inputs, runs
  the model (a CUDA graph for a decode batch) and samples;
* the engine between them (``step``): schedule, run, update.

**Async scheduling** (``async_scheduling=True``, the V1 core's default): the core schedules step
n + 1 while the GPU still runs step n. Step n's tokens are placeholders for the scheduler, and
stay on the device for the runner, which feeds them into step n + 1 there; the host reads them
only to check stops and to detokenize, after it has queued step n + 1. A request that stopped at
step n has run one step too many; that token is dropped. With ``async_scheduling=False`` each
step waits for its tokens before the next is scheduled (the only way V0 can run: it appends each
step's tokens before scheduling the next).

Every step's timings go to ``step_stats``.
"""
from __future__ import annotations

import collections
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from paged_attention.engine.model_runner import ModelRunner, RunnerOutput
from paged_attention.engine.outputs import CompletionOutput, RequestOutput
from paged_attention.engine.sampling_params import SamplingParams
from paged_attention.legacy.scheduler import SchedulerStalled
from paged_attention.model import LlamaForCausalLM, allocate_kv_caches
from paged_attention.utils import cdiv
from paged_attention.v1.core.sched.messages import EngineCoreOutput
from paged_attention.v1.core.sched.output import SchedulerOutput

CORES = ("v1", "v0")
DEFAULT_CORE = "v1"


@dataclass
class _Request:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    finish_reason: Optional[str] = None
    num_cached_tokens: int = 0


@dataclass
class StepStats:
    """One step's shape and where its host time went (seconds). ``schedule``: the core's
    ``schedule``; ``prepare``: the runner's states, tables and inputs (and the call into the
    runner); ``forward``: launching the model (or replaying its graph) and the output projection;
    ``sample``: launching the sampler and the tokens' copy; ``wait``: the host blocked on the GPU
    for the tokens; ``update``: reading the tokens, the core's stop checks and bookkeeping, the
    outputs and these stats. The phases cover the whole of ``LLMEngine.step`` (for a step that
    ran tokens), so ``total`` is the host's time for the step. ``gpu_events``: CUDA events around
    the step's device work, when the engine records them: the first once the host has prepared the
    step's inputs, so that a GPU waiting for that preparation counts as idle, not busy (the table
    writes and the input copy it launches, microseconds of GPU work, fall before it)."""

    step: int
    num_reqs: int
    num_tokens: int
    decode_only: bool
    cuda_graph: bool
    schedule: float
    prepare: float
    forward: float
    sample: float
    update: float
    wait: float = 0.0
    gpu_events: Optional[tuple] = None

    @property
    def total(self) -> float:
        return self.schedule + self.prepare + self.forward + self.sample + self.wait + self.update

    @property
    def python(self) -> float:
        """The engine's own bookkeeping: core, runner preparation, updates."""
        return self.schedule + self.prepare + self.update


class LLMEngine:
    """The engine over one model (see the module docstring). ``LLM`` is its user-facing front."""

    def __init__(self, model: LlamaForCausalLM, *, eos_token_ids: frozenset[int], block_size: int,
                 num_gpu_blocks: int, num_cpu_blocks: int, enable_prefix_caching: bool, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int, core: str = DEFAULT_CORE,
                 async_scheduling: Optional[bool] = None, preemption_mode: Optional[str] = None,
                 block_tables: str = "auto", cuda_graphs: bool = True, watermark: float = 0.01,
                 record_block_owners: bool = True, record_gpu_time: bool = False) -> None:
        if core not in CORES:
            raise ValueError(f"core must be one of {', '.join(map(repr, CORES))}, got {core!r}")
        if async_scheduling is None:
            async_scheduling = core == "v1"
        if async_scheduling and core == "v0":
            raise ValueError("async_scheduling needs core='v1': the V0 scheduler appends each step's tokens "
                             "before it schedules the next")
        if core == "v1" and preemption_mode not in (None, "recompute"):
            raise ValueError("the V1 core preempts by recomputation only; use core='v0' for swapping")
        self.model = model
        self.eos_token_ids = frozenset(eos_token_ids)
        self.block_size, self.max_model_len = block_size, max_model_len
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.core_name, self.async_scheduling = core, bool(async_scheduling)
        self.kv_caches = allocate_kv_caches(model, num_gpu_blocks, block_size)
        self.runner = ModelRunner(model, self.kv_caches, block_size=block_size, max_num_reqs=max_num_seqs,
                                  max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                                  block_tables=block_tables, cuda_graphs=cuda_graphs, record_gpu_time=record_gpu_time)
        if core == "v0":
            from paged_attention.engine.legacy_core import LegacyCore
            # The swap pool: the same layout in host memory (on a CPU machine, a second CPU pool).
            self.cpu_kv_caches = (allocate_kv_caches(model, num_cpu_blocks, block_size, device="cpu")
                                  if num_cpu_blocks else [])
            self.core = LegacyCore(block_size=block_size, num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=num_cpu_blocks,
                                   enable_prefix_caching=enable_prefix_caching, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                                   kv_caches=self.kv_caches, cpu_kv_caches=self.cpu_kv_caches,
                                   preemption_mode=preemption_mode or "swap", watermark=watermark,
                                   record_block_owners=record_block_owners)
        else:
            from paged_attention.engine.v1_core import V1Core
            self.cpu_kv_caches = []
            self.core = V1Core(model.config, model.dtype, block_size=block_size, num_gpu_blocks=num_gpu_blocks,
                               enable_prefix_caching=enable_prefix_caching, max_num_seqs=max_num_seqs,
                               max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                               async_scheduling=self.async_scheduling)
        self.requests: dict[str, _Request] = {}          # unfinished requests
        self.step_stats: list[StepStats] = []
        self._in_flight: collections.deque[tuple[SchedulerOutput, RunnerOutput, float]] = collections.deque()
        self._num_steps = 0
        self._idle_steps = 0                              # steps in a row that ran and reported nothing
        self._last_stop_ids: tuple = (None, frozenset())  # see _add_checked_request

    # What the legacy core shows (the V0 chapter's drawings read these).
    @property
    def block_manager(self):
        """The legacy core's block manager (V1's KV-cache manager: ``core.kv_cache_manager``)."""
        return self._legacy("block_manager")

    @property
    def history(self) -> list:
        """The legacy core's ``StepRecord`` of every step (events, block owners, free counts)."""
        return self._legacy("history")

    def _legacy(self, name: str):
        if self.core_name != "v0":
            raise AttributeError(f"engine.{name} is the legacy core's: pass core='v0' to LLM for vLLM V0's "
                                 f"scheduler and block manager (the V1 core's are engine.core.scheduler and "
                                 f"engine.core.kv_cache_manager)")
        return getattr(self.core, name)

    @property
    def scheduler(self):
        return self.core.scheduler

    @property
    def tables(self):
        return self.runner.tables

    @property
    def graphs(self):
        return self.runner.graphs

    # ---- requests -------------------------------------------------------------------------
    def check_prompt(self, prompt_token_ids: list[int], *, plain_ints: bool = False) -> None:
        """Typed errors for a prompt the engine can never run; nothing changes. ``plain_ints``:
        the caller has found the prompt a list of plain ints (see ``check_token_ids``)."""
        if not prompt_token_ids:
            raise ValueError("the prompt is empty: a request needs at least one token")
        self.model.check_token_ids(prompt_token_ids, plain_ints=plain_ints)
        n = len(prompt_token_ids)
        if n >= self.max_model_len:
            raise ValueError(f"the prompt has {n} tokens, but the model's context is {self.max_model_len} "
                             f"(max_model_len), which must leave room for at least one new token")
        self.core.check_prompt(n)
        usable, why = self.core.usable_blocks
        if cdiv(n, self.block_size) > usable:
            raise ValueError(f"the prompt has {n} tokens, {cdiv(n, self.block_size)} blocks of {self.block_size}, "
                             f"but the pool can never give one request more than {usable} ({why})")

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> SamplingParams:
        """Typed errors for a request the engine could not run to its end; nothing changes.
        Returns the checked copy of ``params`` that the request keeps.

        Besides the prompt, the params are checked again (a field may have been changed since
        they were made), and the request must be able to run to its end alone in the pool, at
        its longest (the tokens cached when its last one is sampled), which a preemption by
        recomputation may ask of it. vLLM admits a request that outgrows the pool and, once it
        holds every block, preempts it again and again (V1) or drops it cut short (V0); here it
        is refused before anything runs, so that every request accepted runs to its end.
        """
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        params = dataclasses.replace(params)           # a copy, checked again by its __post_init__
        self._check_with_params(prompt_token_ids, params)
        return params

    def _check_with_params(self, prompt_token_ids: list[int], params: SamplingParams, *,
                           plain_ints: bool = False) -> None:
        """``check_request`` for params it has already checked (``LLM.generate`` checks each
        params object of a call once, and then every prompt that uses it with this)."""
        self.check_prompt(prompt_token_ids, plain_ints=plain_ints)
        n = len(prompt_token_ids)
        longest = min(n + params.max_tokens, self.max_model_len) - 1
        usable, why = self.core.usable_blocks
        if cdiv(longest, self.block_size) > usable:
            raise ValueError(f"the request may hold {longest} tokens in the cache ({n} prompt tokens, max_tokens="
                             f"{params.max_tokens}, max_model_len={self.max_model_len}): running to its end alone "
                             f"takes {cdiv(longest, self.block_size)} blocks of {self.block_size}, but the pool can "
                             f"give one request {usable} ({why}); lower max_tokens or give the pool more blocks")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: Optional[str] = None) -> None:
        """Queue a request (checked first: a refused request leaves the engine as it was)."""
        if request_id in self.requests:
            raise ValueError(f"request {request_id!r} is already in the engine")
        self._add_checked_request(request_id, prompt_token_ids, self.check_request(prompt_token_ids, params), prompt)

    def _add_checked_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                             prompt: Optional[str] = None) -> None:
        """``add_request`` for a request ``check_request`` has passed (``params``: its checked
        copy), as ``LLM.generate`` does for all its requests before it queues any."""
        if request_id in self.requests:
            raise ValueError(f"request {request_id!r} is already in the engine")
        # The stop tokens of the last params served again: LLM.generate passes one checked
        # copy for every prompt given the same params (a checked copy is never changed).
        if params is not self._last_stop_ids[0]:
            stop_ids = set(params.stop_token_ids or ())
            if not params.ignore_eos:
                stop_ids |= self.eos_token_ids
            self._last_stop_ids = (params, frozenset(stop_ids))
        prompt_token_ids = list(prompt_token_ids)         # ours (the core copies what it keeps)
        self.core.add_request(request_id, prompt_token_ids, params, self._last_stop_ids[1])
        self.requests[request_id] = _Request(request_id, prompt, prompt_token_ids, params)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self._in_flight)

    # ---- one step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule a step and launch it; then take the oldest step in flight back and update
        (with async scheduling, one step stays in flight). Returns the requests that finished.

        Every moment of a step that runs tokens is in one of its ``StepStats`` phases: the
        schedule from this call's start, the launch's own overhead in ``prepare``, and the update
        from the launch's end (or this call's start) to the end of its bookkeeping."""
        t0 = time.perf_counter()
        try:
            if self.core.has_unfinished_requests():
                # Only the launch needs inference mode (the runner does not enter it again); the
                # update reads host memory and Python state.
                with torch.inference_mode():
                    so = self.core.schedule()
                    t1 = time.perf_counter()
                    pending = self.runner.execute_model(so)
                t2 = time.perf_counter()
                # The runner times its parts from its own start; what the call around them cost
                # is counted as preparation.
                pending.prepare = t2 - t1 - pending.forward - pending.sample
                self._in_flight.append((so, pending, t1 - t0))
                t0 = t2
            if len(self._in_flight) < 2 and self.async_scheduling and self.core.has_unfinished_requests():
                return []                                  # update step n after step n + 1 is queued
            if not self._in_flight:
                return []
            return self._update(t0)
        except BaseException:
            self.abort_all("the step failed")
            raise

    def _update(self, t0: float) -> list[RequestOutput]:
        """The oldest step in flight taken back: its tokens (waited for) through the core, then
        the outputs; its stats go to ``step_stats``, its update counted from ``t0`` less the wait
        for the tokens."""
        so, pending, schedule = self._in_flight.popleft()
        output = pending.get_output()
        outputs = self.core.update_from_output(so, output)
        done = self._process(outputs)
        if not pending.num_tokens:
            self._check_progress(outputs)
            return done                         # a step that ran nothing (its news still went out)
        self._idle_steps = 0
        stats = StepStats(self._num_steps, len(output.req_ids), pending.num_tokens, pending.decode_only,
                          pending.cuda_graph, schedule, pending.prepare, pending.forward, pending.sample, 0.0,
                          pending.wait, pending.gpu_events)
        self.step_stats.append(stats)
        self._num_steps += 1
        # The step's messages (a few objects per request) are freed here, inside the update,
        # rather than unseen when this returns.
        del so, pending, output, outputs
        stats.update = time.perf_counter() - t0 - stats.wait
        return done

    def _check_progress(self, outputs: list[EngineCoreOutput]) -> None:
        """``SchedulerStalled`` when steps keep running nothing and reporting nothing while
        requests wait (one such step is normal under async scheduling: the step in flight holds
        every request's last token)."""
        if outputs or any(p.num_tokens for _, p, _ in self._in_flight) or not self.core.has_unfinished_requests():
            self._idle_steps = 0
            return
        self._idle_steps += 1
        if self._idle_steps >= 3:
            raise SchedulerStalled(f"{self._idle_steps} steps in a row scheduled nothing while "
                                   f"{len(self.requests)} requests wait, and the next would do the same; "
                                   f"every request was dropped")

    def _process(self, outputs: list[EngineCoreOutput]) -> list[RequestOutput]:
        """Each request's new tokens appended; the finished ones made ``RequestOutput``s."""
        done = []
        requests = self.requests
        get_request = requests.get               # (this loop runs for every request every step)
        for out in outputs:
            request = get_request(out.request_id)
            if request is None:
                continue                     # finished at an earlier step (an async step too many)
            request.output_token_ids += out.new_token_ids
            if out.finish_reason is not None:
                request.finish_reason = str(out.finish_reason)
                request.num_cached_tokens = self.core.num_cached_tokens.pop(out.request_id, 0)
                done.append(self.output(requests.pop(out.request_id)))
        return done

    def output(self, request: _Request) -> RequestOutput:
        token_ids = list(request.output_token_ids)
        text = self.detokenize(token_ids) if self.detokenize is not None else ""
        # (Positional: keywords cost more, and a step can finish hundreds of requests.)
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids,
                             [CompletionOutput(0, text, token_ids, request.finish_reason)],
                             request.finish_reason is not None, request.num_cached_tokens)

    detokenize = None    # set by LLM: token ids -> text

    def abort_all(self, why: str = "aborted") -> None:
        """Drop every unfinished request and free its blocks; the engine is then as new."""
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)      # nothing in flight reads a freed row
        self._in_flight.clear()
        self.core.abort_all(why)
        self.runner.reset()
        self.requests.clear()
