"""Benchmarks that print figures: decode attention bandwidth against a device-to-device copy.

A decode step reads every cached key and value once and does little arithmetic, so its speed is
the memory bandwidth it reaches. The yardstick is a plain ``copy_`` of a large buffer, timed in
the same run: ``fraction = (KV bytes read / kernel time) / (bytes read + written / copy time)``.
A fraction near 1 means the kernel reads the cache about as fast as the GPU can move memory at
all. GPU only; ``benchmarks/bench_decode.py`` is the command-line entry.

The last section times something else, on the host: v1's numpy slot mapping against a plain
Python loop (``slot_mapping_times``, notebook 03; ``benchmarks/bench_slot_mapping.py``).
"""
from __future__ import annotations

import os
import platform
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from paged_attention.kernels.triton import paged_attention_decode
from paged_attention.kernels.triton.decode import choose_launch, choose_num_splits
from paged_attention.kernels.workloads import DecodeProblem, make_decode_problem
from paged_attention.utils import cdiv
from paged_attention.v1.block_table import BlockTable
from paged_attention.v1.reference import slot_mapping_loop

# The shapes of issue 2's targets: (batch, context).
DECODE_SHAPES = ((64, 512), (64, 4096), (64, 16384), (4, 32768), (1, 131072))
# Llama-3-8B-like attention: 32 query heads over 8 KV heads, head size 128, block size 16, bf16.
MODEL = dict(num_heads=32, num_kv_heads=8, head_size=128, block_size=16, dtype=torch.bfloat16)


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
    del src, dst
    return 2 * nbytes / (ms * 1e-3)


@dataclass
class DecodeTiming:
    batch: int
    context: int
    num_splits: int
    ms: float
    kv_bytes: int

    @property
    def bandwidth(self) -> float:
        """KV bytes read per second."""
        return self.kv_bytes / (self.ms * 1e-3)


def time_decode(p: DecodeProblem, context: int, *, num_splits: int | None = None,
                launch: tuple[int, int, int] | None = None, rep: int = 200,
                flush: str = "write", kv_evict: str = "") -> DecodeTiming:
    """Time the Triton decode kernel on a prepared problem (index checks off: the tables are ours)."""
    out = torch.empty_like(p.query)
    batch = p.query.size(0)
    splits = num_splits or choose_num_splits(batch, p.key_cache.size(2), context, p.query.device)

    def run():
        paged_attention_decode(out, *p.decode_args(), num_splits=splits, max_seq_len=context,
                               check_ids=False, launch=launch, kv_evict=kv_evict)
    return DecodeTiming(batch, context, splits, graph_time_ms(run, rep, flush), p.kv_bytes_read)


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
    import time
    x = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        x.add_(1)
        torch.cuda.synchronize()


def decode_table(shapes=DECODE_SHAPES, *, identity: bool = True, print_fn=print) -> list[dict]:
    """Time every shape with a shuffled block table (and an identity one); print and return rows.

    ``fraction`` uses the write flush of ``time_ms`` (as ``do_bench``); ``fraction_read`` times
    the same kernel and the copy again with the read flush.
    """
    warm_up()
    copy_bw = copy_bandwidth()
    copy_bw_read = copy_bandwidth(flush="read")
    print_fn(f"device: {torch.cuda.get_device_name()}   copy bandwidth (read + write): {copy_bw / 1e12:.2f} TB/s")
    print_fn("model: 32 query heads / 8 KV heads, head size 128, block size 16, bf16; "
             "timed as CUDA-graph replays, L2 flushed before each (by writing; 'read flush': by reading)")
    header = f"{'batch':>5} {'context':>7} {'splits':>6} {'time us':>9} {'KV TB/s':>8} {'fraction':>8} {'read flush':>10}"
    if identity:
        header += f" {'identity us':>11} {'shuffled/identity':>17}"
    header += f" {'vLLM FA3 us':>11} {'FA3 fraction':>12}"
    print_fn(header)
    rows = []
    for batch, context in shapes:
        row = {"batch": batch, "context": context}
        for shuffle in ((True, False) if identity else (True,)):
            p = make_decode_problem([context] * batch, device="cuda", shuffle=shuffle, **MODEL)
            row["shuffled" if shuffle else "identity"] = time_decode(p, context)
            if shuffle:
                row["shuffled_read"] = time_decode(p, context, flush="read")
                fa3 = _fa3_runner(p, context)
                if fa3 is not None:   # vLLM's production kernel on the same problem, same run
                    row["fa3_ms"] = graph_time_ms(fa3)
                    row["fa3_fraction"] = p.kv_bytes_read / (row["fa3_ms"] * 1e-3) / copy_bw
            del p
        t = row["shuffled"]
        row["fraction"] = t.bandwidth / copy_bw
        row["fraction_read"] = row["shuffled_read"].bandwidth / copy_bw_read
        line = (f"{batch:>5} {context:>7} {t.num_splits:>6} {t.ms * 1e3:>9.1f} {t.bandwidth / 1e12:>8.2f} "
                f"{row['fraction']:>8.2f} {row['fraction_read']:>10.2f}")
        if identity:
            row["slowdown"] = t.ms / row["identity"].ms
            line += f" {row['identity'].ms * 1e3:>11.1f} {row['slowdown']:>17.3f}"
        line += (f" {row['fa3_ms'] * 1e3:>11.1f} {row['fa3_fraction']:>12.2f}" if "fa3_ms" in row
                 else f" {'-':>11} {'-':>12}")
        print_fn(line)
        rows.append(row)
        torch.cuda.empty_cache()
    return rows


# Shapes whose KV reads range from ~1x to ~5x the size of an H100/H200's L2 (50 MB).
L2_HINT_SHAPES = ((8, 2048), (64, 512), (32, 1024), (64, 1024), (64, 4096), (4, 32768))


def l2_hint_table(shapes=L2_HINT_SHAPES, print_fn=print) -> list[dict]:
    """The default (pipelined, no hint) launch against an unpipelined one whose K/V loads carry
    ``evict_first``, timed after a write flush (dirty L2) and after a read flush (clean L2).

    The trade ``choose_launch`` explains: the hint saves writing back what the flush left dirty,
    the pipeline hides memory latency; which wins depends on the state of L2 and on the size of
    the read. Fractions of a copy timed with the same flush.
    """
    warm_up()
    bw = {flush: copy_bandwidth(flush=flush) for flush in ("write", "read")}
    print_fn(f"device: {torch.cuda.get_device_name()}; fraction of a copy; default = pipelined, no hint; "
             f"hinted = launch (64, 4, 1) with kv_evict='evict_first'")
    print_fn(f"{'batch':>5} {'context':>7} {'KV MB':>6} | {'dirty L2: default':>17} {'hinted':>7} | "
             f"{'clean L2: default':>17} {'hinted':>7}")
    rows = []
    for batch, context in shapes:
        p = make_decode_problem([context] * batch, device="cuda", **MODEL)
        row = {"batch": batch, "context": context}
        for flush in ("write", "read"):
            for name, kw in (("default", {}), ("hinted", dict(launch=(64, 4, 1), kv_evict="evict_first"))):
                t = time_decode(p, context, flush=flush, **kw)
                row[flush, name] = t.bandwidth / bw[flush]
        print_fn(f"{batch:>5} {context:>7} {p.kv_bytes_read / 1e6:>6.0f} | {row['write', 'default']:>17.3f} "
                 f"{row['write', 'hinted']:>7.3f} | {row['read', 'default']:>17.3f} {row['read', 'hinted']:>7.3f}")
        rows.append(row)
        del p
        torch.cuda.empty_cache()
    return rows


def sweep(shapes=DECODE_SHAPES, print_fn=print) -> None:
    """Try launch shapes and split counts per shape; print the best few of each (for tuning)."""
    warm_up()
    copy_bw = copy_bandwidth()
    print_fn(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s")
    launches = [(64, 2, 3), (64, 4, 3), (64, 4, 2), (32, 2, 2), (32, 2, 3), (32, 4, 2), (128, 4, 2), (128, 8, 3)]
    for batch, context in shapes:
        p = make_decode_problem([context] * batch, device="cuda", **MODEL)
        auto = choose_num_splits(batch, 8, context, torch.device("cuda"))
        split_options = sorted({auto, max(1, auto // 2), auto * 2, auto * 4 if auto > 1 else 1})
        results = []
        for launch in launches:
            for splits in split_options:
                try:
                    t = time_decode(p, context, num_splits=splits, launch=launch, rep=40)
                except Exception as e:  # e.g. out of shared memory for this launch shape
                    print_fn(f"  {launch} splits={splits}: {type(e).__name__}")
                    continue
                results.append((t.bandwidth / copy_bw, launch, splits, t.ms))
        results.sort(reverse=True)
        print_fn(f"batch {batch} x context {context} (auto splits {auto}):")
        for frac, launch, splits, ms in results[:6]:
            print_fn(f"  {frac:.3f}  launch={launch} splits={splits} {ms * 1e3:.1f} us")
        default = [r for r in results if r[1] == choose_launch(torch.device('cuda'), context, auto) and r[2] == auto]
        if default:
            print_fn(f"  default: {default[0][0]:.3f}")
        del p
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------
# The CUDA v1/v2 kernels (issue 3), the Triton kernel and a contiguous SDPA floor side by side
# --------------------------------------------------------------------------------------------

CUDA_SHAPES = ((64, 512), (64, 4096), (64, 16384), (4, 32768))


def _v0_runners(p: DecodeProblem, context: int) -> dict[str, Callable[[], object]]:
    """Callables running one decode step of ``p`` with each kernel (index checks off)."""
    from paged_attention.kernels import cuda as ck
    from paged_attention.kernels.reference import v0_decode_args, v2_scratch
    out = torch.empty_like(p.query)
    scratch = v2_scratch(p.query, context)
    v0_args = v0_decode_args(*p.decode_args(), max_seq_len=context)
    runners = {
        "CUDA v2": lambda: ck.paged_attention_v2(out, *scratch, *v0_args, check_ids=False),
        "Triton": lambda: paged_attention_decode(out, *p.decode_args(), max_seq_len=context, check_ids=False),
    }
    if context <= ck.v1_max_seq_len(p.query.size(2)):
        runners["CUDA v1"] = lambda: ck.paged_attention_v1(out, *v0_args, check_ids=False)
    fa3 = _fa3_runner(p, context, out)
    if fa3 is not None:
        runners["vLLM FA3"] = fa3
    return runners


def _fa3_runner(p: DecodeProblem, context: int, out: torch.Tensor | None = None) -> Callable[[], object] | None:
    """vLLM's FA3 decode on ``p`` (flash layout), or None where vLLM's kernels are not found."""
    from paged_attention.kernels import vllm
    if not vllm.available()[0]:
        return None
    out = torch.empty_like(p.query) if out is None else out
    return lambda: vllm.paged_attention_decode(out, *p.decode_args(), max_seq_len=context, check_ids=False)


def cuda_attention_table(shapes=CUDA_SHAPES, print_fn=print) -> list[dict]:
    """Issue 3's table: v1, v2 (and Triton) bandwidth as a fraction of a copy, per shape."""
    warm_up()
    copy_bw = copy_bandwidth()
    print_fn(f"device: {torch.cuda.get_device_name()}   copy bandwidth (read + write): {copy_bw / 1e12:.2f} TB/s")
    print_fn("model: 32 query heads / 8 KV heads, head size 128, block size 16, bf16, v0 layout; "
             "CUDA-graph replays, L2 flushed before each")
    names = ("CUDA v1", "CUDA v2", "Triton", "vLLM FA3")
    print_fn(f"{'batch':>5} {'context':>7} " + " ".join(f"{n + ' us':>12} {'frac':>5}" for n in names))
    rows = []
    for batch, context in shapes:
        p = make_decode_problem([context] * batch, device="cuda", **MODEL)
        row = {"batch": batch, "context": context}
        for name, run in _v0_runners(p, context).items():
            ms = graph_time_ms(run)
            row[name] = (ms, p.kv_bytes_read / (ms * 1e-3) / copy_bw)
        cells = [f"{row[n][0] * 1e3:>12.1f} {row[n][1]:>5.2f}" if n in row else f"{'-':>12} {'-':>5}" for n in names]
        print_fn(f"{batch:>5} {context:>7} " + " ".join(cells))
        rows.append(row)
        del p
        torch.cuda.empty_cache()
    return rows


def kernel_times(contexts=(512, 1024, 2048, 4096, 8192, 16384, 32768), batch: int = 8,
                 print_fn=print) -> tuple[list[int], dict[str, list[float]]]:
    """Decode time (µs) against context length for CUDA v1, v2, Triton, vLLM's FA3 (where its
    library is found) and a contiguous SDPA floor.

    The floor is ``torch.nn.functional.scaled_dot_product_attention`` on the same keys and
    values gathered into contiguous ``[batch, kv_heads, context, head_size]`` tensors: attention
    without paging (the gather itself is not timed). Returns ``(contexts, {name: [µs, ...]})``.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("kernel_times measures GPU kernels and needs a CUDA device")
    import torch.nn.functional as F
    from paged_attention.kernels.reference import gather_kv
    warm_up()
    times: dict[str, list[float]] = {"CUDA v1": [], "CUDA v2": [], "Triton": [], "vLLM FA3": [], "SDPA (contiguous)": []}
    for context in contexts:
        p = make_decode_problem([context] * batch, device="cuda", **MODEL)
        runners = _v0_runners(p, context)
        for name in ("CUDA v1", "CUDA v2", "Triton", "vLLM FA3"):   # None: cannot run this context here
            times[name].append(graph_time_ms(runners[name]) * 1e3 if name in runners else None)
        k, v = (torch.stack([t.transpose(0, 1) for t in kv]) for kv in
                zip(*(gather_kv(p.key_cache, p.value_cache, p.block_tables[s], context) for s in range(batch))))
        q = p.query.unsqueeze(2)                                  # [batch, heads, 1, head_size]
        times["SDPA (contiguous)"].append(
            graph_time_ms(lambda: F.scaled_dot_product_attention(q, k, v, scale=p.scale, enable_gqa=True)) * 1e3)
        print_fn(f"context {context:>6}: " + "  ".join(f"{n} {t[-1]:.1f} us" for n, t in times.items()
                                                        if t and t[-1] is not None))
        del p, k, v
        torch.cuda.empty_cache()
    # A kernel that ran nowhere (vLLM's FA3 where its library is not found) is left out.
    return list(contexts), {name: t for name, t in times.items() if any(x is not None for x in t)}


# --------------------------------------------------------------------------------------------
# The v1 slot mapping (notebook 03): numpy over the whole batch against a Python loop, on the CPU
# --------------------------------------------------------------------------------------------

# (requests, tokens scheduled per request): first more requests of 16 tokens, then 8 requests
# with longer and longer chunks (1 token each: a pure decode batch).
SLOT_MAPPING_BATCH_SWEEP = ((1, 16), (4, 16), (16, 16), (64, 16), (256, 16), (1024, 16))
SLOT_MAPPING_TOKEN_SWEEP = ((8, 1), (8, 8), (8, 64), (8, 512), (8, 2048))
SLOT_MAPPING_IMPLS = ("compute_slot_mapping (numpy)", "Python loop")


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


def slot_mapping_batch(num_reqs: int, tokens_per_req: int, block_size: int = 16, context: int = 2048,
                       seed: int = 0):
    """A v1 ``BlockTable`` holding ``num_reqs`` requests and the ``(req_indices, positions)`` of
    one step that schedules ``tokens_per_req`` tokens of each, as vLLM's ``_prepare_inputs``
    builds them: each request has already computed a random number of tokens (below
    ``context``), and its new tokens follow; every request's blocks are distinct random ids."""
    for name, value in (("num_reqs", num_reqs), ("tokens_per_req", tokens_per_req), ("block_size", block_size),
                        ("context", context)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    rng = np.random.default_rng(seed)
    computed = rng.integers(0, context, size=num_reqs)
    blocks_per_req = cdiv(context + tokens_per_req, block_size)
    table = BlockTable(block_size, num_reqs, blocks_per_req, num_reqs * tokens_per_req, False, "cpu", block_size, 1)
    ids = rng.permutation(num_reqs * blocks_per_req).reshape(num_reqs, blocks_per_req)
    for row in range(num_reqs):
        table.add_row(ids[row], row)
    req_indices = np.repeat(np.arange(num_reqs, dtype=np.int32), tokens_per_req)
    positions = (np.repeat(computed, tokens_per_req) + np.tile(np.arange(tokens_per_req), num_reqs)).astype(np.int64)
    return table, req_indices, positions


def slot_mapping_times(shapes=SLOT_MAPPING_BATCH_SWEEP, *, block_size: int = 16, min_time: float = 0.02,
                       repeat: int = 5, print_fn=print) -> tuple[list[int], dict[str, list[float]]]:
    """Time ``BlockTable.compute_slot_mapping`` and ``slot_mapping_loop`` on one step's batch for
    every ``(num_reqs, tokens_per_req)`` in ``shapes`` (``slot_mapping_batch``), after checking
    that both give the same slots.

    Returns ``(num_tokens, {name: [µs, ...]})``: the tokens in each batch, and the time per
    call of each implementation (names: ``SLOT_MAPPING_IMPLS``). Host-only numpy and Python,
    so the figures mean the same on any machine; print ``cpu_name()`` with them.
    """
    shapes = [tuple(s) for s in shapes]
    if not shapes:
        raise ValueError("shapes must hold at least one (num_reqs, tokens_per_req) pair")
    num_tokens: list[int] = []
    times: dict[str, list[float]] = {name: [] for name in SLOT_MAPPING_IMPLS}
    for num_reqs, tokens_per_req in shapes:
        table, req_indices, positions = slot_mapping_batch(num_reqs, tokens_per_req, block_size)
        n = len(positions)
        table.compute_slot_mapping(req_indices, positions)
        if table.slot_mapping.np[:n].tolist() != slot_mapping_loop(table, req_indices, positions):
            raise AssertionError(f"compute_slot_mapping and the loop disagree on {num_reqs} x {tokens_per_req} tokens")
        numpy_us = best_us(lambda: table.compute_slot_mapping(req_indices, positions), min_time, repeat)
        loop_us = best_us(lambda: slot_mapping_loop(table, req_indices, positions), min_time, repeat)
        num_tokens.append(n)
        times[SLOT_MAPPING_IMPLS[0]].append(numpy_us)
        times[SLOT_MAPPING_IMPLS[1]].append(loop_us)
        print_fn(f"{num_reqs:>4} requests x {tokens_per_req:>4} tokens = {n:>5} tokens: "
                 f"numpy {numpy_us:>8.1f} us   loop {loop_us:>9.1f} us   loop / numpy {loop_us / numpy_us:>6.1f}")
    return num_tokens, times
