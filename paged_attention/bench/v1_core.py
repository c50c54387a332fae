"""The V1 KV-cache manager and scheduler, ours against vLLM 0.33's own classes, on the host
(``benchmarks/bench_v1_core.py``).

Three kinds of line, each the same work on both sides:

* **requests**: building a trace's requests (``Request(...)``, which hashes every full block of
  the prompt with SHA-256, as vLLM's engine does when a request arrives). Ours also checks that
  every token id is an int, which vLLM leaves to its input processor (not timed here);
* **manager traces**: what a scheduler asks of a ``KVCacheManager``, replayed from a list of
  operations drawn from a seed. Requests arrive with prompts built from a few shared prefixes
  (``get_computed_blocks`` finds the hit, ``allocate_slots`` the rest), each running request
  decodes one token per step (the token appended, which hashes a block when it fills one, then
  ``allocate_slots`` for one slot), and a request that reaches its length is freed. The pool
  holds every live request, so no allocation fails, but it is small enough that cached blocks
  are evicted and reused;
* **scheduler workloads**: requests arriving over the first steps, run to completion by a
  ``Scheduler`` (or ``AsyncScheduler``) and the fake model of ``sched.differential`` through
  vLLM's engine loop: ``schedule``, the model's tokens, ``update_from_output``, step after step.

Each line runs on both sides in turn, several rounds, alternating which goes first, from fresh
objects built outside the timed span (requests included, except on the requests line), with
Python's garbage collector off during the span, timed in CPU time (the machines this runs on
are often shared). The fastest run of each side counts (the slower ones were slowed down by
something else on the machine), and the ratio is vLLM's time over ours: above 1.0, ours is faster. Before timing, both sides' answers are compared (every
hit and table of the manager traces; every step's scheduled tokens and finished requests of the
scheduler workloads): a line whose answers differ is an error, not a figure.
"""
from __future__ import annotations

import gc
import logging
import math
import platform
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from paged_attention.bench.timing import cpu_name
from paged_attention.v1.core import kv_cache_utils
from paged_attention.v1.core.kv_cache_manager import KVCacheManager
from paged_attention.v1.core.request import Request
from paged_attention.v1.core.sched.differential import (
    FakeSamplingParams, RequestSpec, SchedulerWorkload, our_side, vllm_side,
)

ADMIT, DECODE, FREE = 0, 1, 2


# --------------------------------------------------------------------------------------------
# Manager traces
# --------------------------------------------------------------------------------------------

@dataclass
class ManagerTrace:
    """A stream of requests through a ``KVCacheManager``. ``groups`` as in ``SchedulerWorkload``
    (``("full", block_size)`` or ``("window", block_size, sliding_window)``)."""

    name: str
    groups: list[tuple] = field(default_factory=lambda: [("full", 16)])
    num_requests: int = 300
    max_live: int = 32
    arrivals: tuple[int, ...] = (0, 1, 1, 2)     # new requests per step, drawn
    num_prefixes: int = 8
    prefix_len: tuple[int, int] = (32, 512)
    suffix_len: tuple[int, int] = (8, 256)
    decode_len: tuple[int, int] = (8, 96)
    enable_caching: bool = True
    seed: int = 0

    @property
    def block_sizes(self) -> tuple[int, int]:
        sizes = [g[1] for g in self.groups]
        return math.lcm(*sizes), math.gcd(*sizes)

    @property
    def max_model_len(self) -> int:
        return self.prefix_len[1] + self.suffix_len[1] + self.decode_len[1] + 1

    @property
    def num_blocks(self) -> int:
        """Room for ``max_live`` requests of the longest length in every group, plus a third
        (so cached blocks stay free a while before they are evicted)."""
        per_request = sum(math.ceil(self.max_model_len / g[1]) + 1 for g in self.groups)
        return self.max_live * per_request * 4 // 3 + 1

    def kv_cache_config(self, classes: Any) -> Any:
        workload = SchedulerWorkload(self.name, self.seed, groups=self.groups,
                                     num_blocks=self.num_blocks)
        return workload.kv_cache_config(classes)

    def operations(self) -> tuple[list[tuple[int, int, int]], list[list[int]]]:
        """``(operations, prompts)``: ``(ADMIT, i, 0)``, ``(DECODE, i, token)`` and
        ``(FREE, i, 0)`` on request ``i`` (whose prompt is ``prompts[i]``), in order."""
        rng = random.Random(self.seed)
        prefixes = [[rng.randrange(50_000) for _ in range(rng.randint(*self.prefix_len))]
                    for _ in range(self.num_prefixes)]
        ops: list[tuple[int, int, int]] = []
        prompts: list[list[int]] = []
        live: dict[int, int] = {}                  # request -> tokens still to decode
        while len(prompts) < self.num_requests or live:
            for _ in range(rng.choice(self.arrivals)):
                if len(prompts) < self.num_requests and len(live) < self.max_live:
                    i = len(prompts)
                    prompts.append(rng.choice(prefixes)[:rng.randint(0, self.prefix_len[1])]
                                   + [rng.randrange(50_000)
                                      for _ in range(rng.randint(*self.suffix_len))])
                    ops.append((ADMIT, i, 0))
                    live[i] = rng.randint(*self.decode_len)
            for i in list(live):
                if live[i] == 0:
                    ops.append((FREE, i, 0))
                    del live[i]
                else:
                    ops.append((DECODE, i, rng.randrange(50_000)))
                    live[i] -= 1
        return ops, prompts


@dataclass
class Side:
    """How one implementation builds a manager and its requests."""

    name: str
    make_manager: Callable[[ManagerTrace], Any]
    make_requests: Callable[[ManagerTrace, list[list[int]]], list[Any]]


def our_manager_side() -> Side:
    from paged_attention.kv_cache import interface

    def manager(trace: ManagerTrace) -> KVCacheManager:
        scheduler_block_size, hash_block_size = trace.block_sizes
        return KVCacheManager(trace.kv_cache_config(interface), max_model_len=trace.max_model_len,
                              scheduler_block_size=scheduler_block_size,
                              hash_block_size=hash_block_size,
                              enable_caching=trace.enable_caching)

    def requests(trace: ManagerTrace, prompts: list[list[int]]) -> list[Request]:
        kv_cache_utils.init_none_hash(kv_cache_utils.sha256)
        hasher = kv_cache_utils.get_request_block_hasher(trace.block_sizes[1],
                                                         kv_cache_utils.sha256)
        params = FakeSamplingParams(max_tokens=trace.decode_len[1] + 1)
        return [Request(f"r{i}", p, params, None, block_hasher=hasher)
                for i, p in enumerate(prompts)]
    return Side("ours", manager, requests)


def vllm_manager_side(o: Any) -> Side:
    def manager(trace: ManagerTrace) -> Any:
        scheduler_block_size, hash_block_size = trace.block_sizes
        return o.KVCacheManager(trace.kv_cache_config(o), max_model_len=trace.max_model_len,
                                scheduler_block_size=scheduler_block_size,
                                hash_block_size=hash_block_size,
                                enable_caching=trace.enable_caching)

    def requests(trace: ManagerTrace, prompts: list[list[int]]) -> list[Any]:
        o.init_none_hash(o.sha256)
        hasher = o.get_request_block_hasher(trace.block_sizes[1], o.sha256)
        params = o.SamplingParams(max_tokens=trace.decode_len[1] + 1)
        return [o.Request(f"r{i}", p, params, None, block_hasher=hasher)
                for i, p in enumerate(prompts)]
    return Side("vLLM", manager, requests)


def replay_manager(manager: Any, requests: list[Any], ops: list[tuple[int, int, int]],
                   answers: list | None = None) -> None:
    """Apply ``ops`` as a scheduler would (each admission prefills the whole prompt at once).
    With ``answers``, record every hit and every table (for the check, not the timing)."""
    get_computed_blocks, allocate_slots = manager.get_computed_blocks, manager.allocate_slots
    for op, i, token in ops:
        request = requests[i]
        if op == DECODE:
            request.append_output_token_ids(token)
            if allocate_slots(request, 1) is None:
                raise RuntimeError(f"the pool is too small for the trace (request {i})")
            request.num_computed_tokens += 1
        elif op == ADMIT:
            blocks, num_hit, _ = get_computed_blocks(request)
            if allocate_slots(request, request.num_tokens - num_hit, num_hit, blocks) is None:
                raise RuntimeError(f"the pool is too small for the trace (request {i})")
            request.num_computed_tokens = request.num_tokens
            if answers is not None:
                answers.append((i, num_hit, [list(g) for g in manager.get_block_ids(f"r{i}")]))
        else:
            if answers is not None:
                answers.append((i, [list(g) for g in manager.get_block_ids(f"r{i}")]))
            manager.free(request)
    if answers is not None:
        answers.append(manager.block_pool.get_num_free_blocks())


MANAGER_TRACES = (
    ManagerTrace("manager: one group, prefix caching"),
    ManagerTrace("manager: one group, no caching", enable_caching=False),
    ManagerTrace("manager: full + sliding window", groups=[("full", 16), ("window", 16, 128)]),
)


# --------------------------------------------------------------------------------------------
# Scheduler workloads
# --------------------------------------------------------------------------------------------

@dataclass
class SchedulerBench:
    """``num_requests`` requests arriving ``per_step`` at a time, run to completion."""

    name: str
    workload: SchedulerWorkload
    num_requests: int = 200
    per_step: int = 8

    def specs(self) -> list[list[RequestSpec]]:
        """The requests arriving at each step."""
        w = self.workload
        rng = random.Random(w.seed)
        prefixes = [[rng.randrange(w.vocab) for _ in range(rng.randint(*w.prefix_len))]
                    for _ in range(w.num_prefixes)]
        steps: list[list[RequestSpec]] = []
        for i in range(self.num_requests):
            if i % self.per_step == 0:
                steps.append([])
            prompt = (rng.choice(prefixes)[:rng.randint(0, w.prefix_len[1])]
                      + [rng.randrange(w.vocab) for _ in range(rng.randint(*w.suffix_len))])
            steps[-1].append(RequestSpec(
                f"r{i}", prompt[:w.max_model_len - 1], rng.randint(*w.max_tokens),
                eos_token_id=0 if rng.random() < w.p_eos else None,
                stop_token_ids=[1] if rng.random() < w.p_stop else None,
                priority=0, arrival_time=float(i)))
        return steps


def run_scheduler(side: Any, arrivals: list[list[Any]], record: list | None = None) -> int:
    """Add each step's requests and run the engine loop until every request is done. Returns
    the number of engine steps; with ``record``, notes every step's scheduled tokens and
    finished requests."""
    scheduler, loop = side.scheduler, side.loop
    step = 0
    while True:
        if step < len(arrivals):
            for request in arrivals[step]:
                scheduler.add_request(request)
        scheduler_output, results = loop.step()
        step += 1
        if record is not None:
            record.append((None if scheduler_output is None else
                           list(scheduler_output.num_scheduled_tokens.items()),
                           None if results is None else sorted(
                               (out.request_id, list(out.new_token_ids), str(out.finish_reason))
                               for outs in results.values() for out in outs.outputs)))
        if step >= len(arrivals) and not scheduler.has_requests() and not loop.batch_queue:
            return step


_SCHEDULER_DEFAULTS = dict(
    groups=[("full", 16)], max_num_seqs=128, max_num_batched_tokens=2048, max_model_len=2048,
    num_prefixes=8, prefix_len=(32, 512), suffix_len=(8, 256), max_tokens=(16, 128),
    vocab=50_000, p_eos=0.0, p_stop=0.0, p_abort=0.0, p_reset=0.0)

SCHEDULER_BENCHES = (
    SchedulerBench("scheduler: roomy pool", SchedulerWorkload(
        "roomy", 1, num_blocks=4096, **_SCHEDULER_DEFAULTS)),
    SchedulerBench("scheduler: tight pool, preemptions", SchedulerWorkload(
        "tight", 2, num_blocks=700, scheduler_reserve_full_isl=False, **_SCHEDULER_DEFAULTS)),
    SchedulerBench("scheduler: chunked prefill, 512-token budget", SchedulerWorkload(
        "chunked", 3, num_blocks=4096, **dict(_SCHEDULER_DEFAULTS, max_num_batched_tokens=512,
                                              long_prefill_token_threshold=128))),
    SchedulerBench("async scheduler: roomy pool", SchedulerWorkload(
        "async", 4, num_blocks=4096, async_scheduling=True, **_SCHEDULER_DEFAULTS)),
    SchedulerBench("scheduler: full + sliding window", SchedulerWorkload(
        "hybrid", 5, num_blocks=8192, **dict(_SCHEDULER_DEFAULTS,
                                             groups=[("full", 16), ("window", 16, 128)]))),
)


# --------------------------------------------------------------------------------------------
# Timing side by side
# --------------------------------------------------------------------------------------------

def side_by_side(prepare: dict[str, Callable[[], Callable[[], Any]]],
                 rounds: int = 5) -> dict[str, float]:
    """Seconds of the fastest run of each ``prepare[name]()()`` (prepare untimed, run timed),
    the sides taking turns and swapping who goes first each round; the garbage collector is
    off during each timed run. The time is the process's CPU time: on a shared machine the
    wall clock would also count the turns other programs take on the CPU (the work is
    single-threaded Python, so on an idle machine the two agree)."""
    best = {name: math.inf for name in prepare}
    names = list(prepare)
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            run = prepare[name]()
            gc.collect()
            gc.disable()
            try:
                start = time.process_time()
                run()
                elapsed = time.process_time() - start
            finally:
                gc.enable()
            best[name] = min(best[name], elapsed)
    return best


@dataclass
class Line:
    name: str
    ours_ms: float
    vllm_ms: float
    detail: str

    @property
    def ratio(self) -> float:
        return self.vllm_ms / self.ours_ms


def manager_lines(o: Any, traces=MANAGER_TRACES, rounds: int = 5) -> list[Line]:
    ours, theirs = our_manager_side(), vllm_manager_side(o)
    lines = []
    for trace in traces:
        ops, prompts = trace.operations()
        answers: dict[str, list] = {}
        for side in (ours, theirs):
            answers[side.name] = []
            replay_manager(side.make_manager(trace), side.make_requests(trace, prompts), ops,
                           answers[side.name])
        if answers["ours"] != answers["vLLM"]:
            raise AssertionError(f"{trace.name}: ours and vLLM's answers differ")

        def replay_on(side: Side) -> Callable[[], Callable[[], None]]:
            def prepare() -> Callable[[], None]:
                manager, requests = side.make_manager(trace), side.make_requests(trace, prompts)
                return lambda: replay_manager(manager, requests, ops)
            return prepare
        times = side_by_side({s.name: replay_on(s) for s in (ours, theirs)}, rounds)
        lines.append(Line(trace.name, times["ours"] * 1e3, times["vLLM"] * 1e3,
                          f"{len(ops)} operations, {trace.num_blocks} blocks"))
        if trace is traces[0]:
            def build_on(side: Side) -> Callable[[], Callable[[], None]]:
                return lambda: lambda: side.make_requests(trace, prompts)
            times = side_by_side({s.name: build_on(s) for s in (ours, theirs)}, rounds)
            tokens = sum(len(p) for p in prompts)
            lines.insert(0, Line("requests: Request(...) with block hashes", times["ours"] * 1e3,
                                 times["vLLM"] * 1e3, f"{len(prompts)} requests, {tokens} tokens"))
    return lines


def scheduler_lines(o: Any, benches=SCHEDULER_BENCHES, rounds: int = 5) -> list[Line]:
    lines = []
    for bench in benches:
        specs = bench.specs()
        makers = {"ours": lambda: our_side(bench.workload),
                  "vLLM": lambda: vllm_side(o, bench.workload)}

        def setup(name: str) -> tuple[Any, list[list[Any]]]:
            side = makers[name]()
            return side, [[side.make_request(spec) for spec in step] for step in specs]
        records: dict[str, list] = {}
        for name in makers:
            records[name] = []
            run_scheduler(*setup(name), record=records[name])
        if records["ours"] != records["vLLM"]:
            raise AssertionError(f"{bench.name}: ours and vLLM's steps differ")
        steps = len(records["ours"])
        tokens = sum(n for out, _ in records["ours"] if out for _, n in out)

        def run_on(name: str) -> Callable[[], Callable[[], int]]:
            def prepare() -> Callable[[], int]:
                side, arrivals = setup(name)
                return lambda: run_scheduler(side, arrivals)
            return prepare
        times = side_by_side({name: run_on(name) for name in makers}, rounds)
        lines.append(Line(bench.name, times["ours"] * 1e3, times["vLLM"] * 1e3,
                          f"{bench.num_requests} requests, {steps} steps, {tokens} tokens"))
    return lines


def machine() -> str:
    return (f"{platform.platform()}; Python {sys.version.split()[0]}; CPU: {cpu_name()}")


def report(rounds: int = 5, what: tuple[str, ...] = ("manager", "scheduler"),
           print_fn: Callable[[str], None] = print) -> list[Line]:
    """Print (and return) every line: ours, vLLM's, the ratio, what was run."""
    from paged_attention.v1.core import oracle

    o = oracle.load(scheduler=True)
    logging.getLogger("vllm").setLevel(logging.ERROR)
    print_fn(f"machine: {machine()}")
    print_fn(f"vLLM {oracle.VLLM_VERSION}'s classes from {o.folder}; best of {rounds} "
             f"alternating runs each; ratio = vLLM / ours (> 1: ours faster)")
    print_fn(f"{'line':48} {'ours ms':>9} {'vLLM ms':>9} {'ratio':>6}  work")
    lines: list[Line] = []
    for kind, make in (("manager", manager_lines), ("scheduler", scheduler_lines)):
        if kind not in what:
            continue
        for line in make(o, rounds=rounds):
            print_fn(f"{line.name:48} {line.ours_ms:9.2f} {line.vllm_ms:9.2f} "
                     f"{line.ratio:5.2f}x  {line.detail}")
            lines.append(line)
    return lines
