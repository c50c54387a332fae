"""Timers shared by every benchmark: GPU time with the L2 cache flushed, CUDA-graph replays,
host time, wall-clock steps.

Which one to read depends on the question. ``time_ms``/``graph_time_ms`` (events around each run,
L2 flushed before it, by writing or by reading) time bandwidth-bound kernels such as decode
attention. ``gpu_us`` (``triton.testing.do_bench``), ``graph_us``, ``hot_us`` and ``queued_us`` time
small latency-bound kernels, with or without Python's launch work in the span; ``host_us`` is that
launch work alone; ``wall_us`` a whole step, host work included; ``best_us`` host-only code;
``host_probe_us`` how fast the host runs Python at the moment.
"""
from __future__ import annotations

import os
import platform
import statistics
import time
from typing import Callable

import numpy as np
import torch


# ---- GPU time, L2 flushed before every run ----------------------------------------------------------
def time_ms(fn: Callable[[], object], rep: int = 200, flush: str = "write") -> float:
    """Median milliseconds of ``fn`` on the GPU, with the L2 cache flushed before every run.

    The flush streams a 256 MB buffer through L2 so that ``fn`` reads its data from memory:
    ``flush="write"`` zeroes it (what ``triton.testing.do_bench`` does), ``"read"`` only reads
    it. A write flush leaves L2 full of dirty lines which the timed kernel must write back as it
    evicts them: up to an L2's worth (tens of MB) of extra traffic, a visible share of a kernel
    that reads ~100 MB. A read flush leaves clean lines, closer to a kernel that runs after
    others in a forward pass. Both are reported where it matters.
    """
    if flush not in ("write", "read"):
        raise ValueError(f"flush must be 'write' or 'read', got {flush!r}")
    buffer = torch.empty(256 << 20 >> 2, dtype=torch.float32, device="cuda")
    for _ in range(min(25, rep)):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(rep)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(rep)]
    for start, end in zip(starts, ends):
        if flush == "write":
            buffer.zero_()
        else:
            buffer.sum()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def copy_bandwidth(nbytes: int = 1 << 30, flush: str = "write") -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), flush=flush)
    return 2 * nbytes / (ms * 1e-3)


def graph_time_ms(run: Callable[[], object], rep: int = 200, flush: str = "write") -> float:
    """Time ``run`` replayed from a CUDA graph, as served decode steps are.

    The graph keeps Python's launch overhead (and the gap it can leave before the kernel) out of
    the figure. ``run`` is called once outside the capture first, to compile what needs it.
    """
    run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return time_ms(graph.replay, rep, flush)


def warm_up(seconds: float = 1.0) -> None:
    """Keep the GPU busy for a while so that its clocks have ramped up before timing."""
    x = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        x.add_(1)
        torch.cuda.synchronize()


# ---- Small kernels: GPU time, replays, host time -------------------------------------------------
def gpu_us(fn: Callable[[], object]) -> float:
    """Median GPU microseconds per call (``triton.testing.do_bench``, L2 flushed between calls)."""
    import triton
    return 1000.0 * triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def graph_us(fn: Callable[[], object]) -> float:
    """``gpu_us`` of ``fn`` captured once in a CUDA graph and replayed."""
    fn()                                              # compile outside the capture
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):                   # warm-up on a side stream, as torch advises
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    return gpu_us(graph.replay)


def graph_of_calls(fn: Callable[[], object], k: int) -> torch.cuda.CUDAGraph:
    """``k`` calls of ``fn`` back to back, captured in one CUDA graph (after one call outside it,
    which compiles), replayed once."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(k):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def hot_us(fn: Callable[[], object], k: int = 20) -> float:
    """Microseconds per call with warm caches: ``k`` calls back to back captured in one CUDA
    graph, replayed (one L2 flush per replay, amortised over the ``k`` calls). Closer to a step
    inside a model run, where these small tensors were just written and sit in L2."""
    return gpu_us(graph_of_calls(fn, k).replay) / k


def queued_us(fn: Callable[[], object], reps: int = 100, head_start_cycles: int = 2_000_000) -> float:
    """Median GPU microseconds per call with the host's launch work hidden: as ``gpu_us`` (L2
    flushed before every call), but the GPU first sleeps ``head_start_cycles`` (about a
    millisecond), so that every launch of ``fn`` is queued before the GPU reaches it. What the
    launches cost the GPU back to back on a stream (gaps between kernels included), whatever
    Python spends issuing them. ``gpu_us`` measures the same unless the host needs longer to
    issue ``fn`` than the GPU needs for the flush (then the GPU waits inside the timed span)."""
    import triton
    fn()
    torch.cuda.synchronize()
    cache = triton.runtime.driver.active.get_empty_cache_for_benchmark()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        cache.zero_()
        torch.cuda._sleep(head_start_cycles)
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return 1000.0 * float(np.median([s.elapsed_time(e) for s, e in zip(starts, ends)]))


def host_us(fn: Callable[[], object], n: int = 200) -> float:
    """Host microseconds per call of ``fn`` (issuing its launches, checks included), with the GPU
    kept busy so that nothing waits on it."""
    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(50_000_000)            # the GPU is busy all along: launches never block
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return t


def launch_floor_us() -> dict[str, float]:
    """The same three measures for a Triton kernel that stores one number: what any kernel costs."""
    import triton
    import triton.language as tl

    @triton.jit
    def _one_store(x_ptr):
        tl.store(x_ptr, 1)

    x = torch.zeros(1, dtype=torch.int32, device="cuda")
    fn = lambda: _one_store[(1,)](x)  # noqa: E731
    return {"eager": gpu_us(fn), "graph": graph_us(fn), "hot": hot_us(fn)}


def wall_us(step: Callable[[int], object], n: int = 100, repeat: int = 3) -> float:
    """Wall-clock microseconds per step, host work included: ``n`` steps back to back (the GPU
    works while the host prepares the next), one synchronisation at the end. The best of
    ``repeat`` such runs counts: a run that something else slowed down (the first one to touch
    a cold allocator or cache, a busy host) would otherwise show up as a spike in the plot."""
    for i in range(10):
        step(i)
    torch.cuda.synchronize()
    best, i = float("inf"), 10
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(n):
            step(i)
            i += 1
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
    return best


# ---- Host-only code ---------------------------------------------------------------------------------
def cpu_name() -> str:
    """The host CPU's model name and core count (where the slot mapping is computed)."""
    name = ""
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    return f"{name or platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def best_us(fn: Callable[[], object], min_time: float = 0.02, repeat: int = 5) -> float:
    """Microseconds per call of ``fn`` on the host: calls are batched until a batch takes at
    least ``min_time`` seconds, and the fastest of ``repeat`` batches counts (the others were
    slowed down by something else running)."""
    number = 1
    while True:
        start = time.perf_counter()
        for _ in range(number):
            fn()
        elapsed = time.perf_counter() - start
        if elapsed >= min_time or number >= 1 << 20:
            break
        number *= 2 if elapsed * 4 > min_time else 8
    best = elapsed
    for _ in range(repeat - 1):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        best = min(best, time.perf_counter() - start)
    return best / number * 1e6


class _ProbeItem:
    __slots__ = ("count", "key")

    def __init__(self, key: str) -> None:
        self.count, self.key = 0, key


_PROBE_ITEMS = [_ProbeItem(f"req-{i}") for i in range(256)]
_PROBE_TABLE: dict[str, int] = {}


def _probe_work() -> None:
    for item in _PROBE_ITEMS:
        item.count += 1
        _PROBE_TABLE[item.key] = item.count


def host_probe_us() -> float:
    """Microseconds this host takes for a fixed piece of pure Python: for each of 256 objects an
    attribute read, an increment and a dict write (an engine step's work per request, in
    miniature), the best of five batches (``best_us``). The engine benchmark prints it beside its
    rounds: the GPU machines' hosts change speed from process to process (by about 1.8x on one
    H200 machine, the same code on the same core), and the host's speed decides whether a
    256-request decode step waits for the GPU or for the host."""
    return best_us(_probe_work, min_time=0.01)
