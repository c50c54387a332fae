"""Benchmarks that print figures: decode attention bandwidth against a device-to-device copy.

A decode step reads every cached key and value once and does little arithmetic, so its speed is
the memory bandwidth it reaches. The yardstick is a plain ``copy_`` of a large buffer, timed in
the same run: ``fraction = (KV bytes read / kernel time) / (bytes read + written / copy time)``.
A fraction near 1 means the kernel reads the cache about as fast as the GPU can move memory at
all. GPU only; ``benchmarks/bench_decode.py`` is the command-line entry.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from paged_attention.kernels.triton import paged_attention_decode
from paged_attention.kernels.triton.decode import choose_launch, choose_num_splits
from paged_attention.kernels.workloads import DecodeProblem, make_decode_problem

# The shapes of issue 2's targets: (batch, context).
DECODE_SHAPES = ((64, 512), (64, 4096), (64, 16384), (4, 32768), (1, 131072))
# Llama-3-8B-like attention: 32 query heads over 8 KV heads, head size 128, block size 16, bf16.
MODEL = dict(num_heads=32, num_kv_heads=8, head_size=128, block_size=16, dtype=torch.bfloat16)


def time_ms(fn: Callable[[], object], rep: int = 200) -> float:
    """Median milliseconds of ``fn`` on the GPU, with the L2 cache flushed before every run."""
    import triton.testing
    return triton.testing.do_bench(fn, warmup=min(25, rep), rep=rep, return_mode="median")


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src))
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
                launch: tuple[int, int, int] | None = None, rep: int = 200) -> DecodeTiming:
    """Time the Triton decode kernel on a prepared problem (index checks off: the tables are ours)."""
    out = torch.empty_like(p.query)
    batch = p.query.size(0)
    splits = num_splits or choose_num_splits(batch, p.key_cache.size(2), context, p.query.device)

    def run():
        paged_attention_decode(out, *p.decode_args(), num_splits=splits, max_seq_len=context,
                               check_ids=False, launch=launch)
    # Served decode steps are replayed from CUDA graphs; so is the timed call here, which keeps
    # Python's launch overhead (and the gap it can leave before the kernel) out of the figure.
    run()                                   # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return DecodeTiming(batch, context, splits, time_ms(graph.replay, rep), p.kv_bytes_read)


def warm_up(seconds: float = 1.0) -> None:
    """Keep the GPU busy for a while so that its clocks have ramped up before timing."""
    import time
    x = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        x.add_(1)
        torch.cuda.synchronize()


def decode_table(shapes=DECODE_SHAPES, *, identity: bool = True, print_fn=print) -> list[dict]:
    """Time every shape with a shuffled block table (and an identity one); print and return rows."""
    warm_up()
    copy_bw = copy_bandwidth()
    print_fn(f"device: {torch.cuda.get_device_name()}   copy bandwidth (read + write): {copy_bw / 1e12:.2f} TB/s")
    print_fn("model: 32 query heads / 8 KV heads, head size 128, block size 16, bf16; "
             "timed as CUDA-graph replays, L2 flushed before each")
    header = f"{'batch':>5} {'context':>7} {'splits':>6} {'time us':>9} {'KV TB/s':>8} {'fraction':>8}"
    if identity:
        header += f" {'identity us':>11} {'shuffled/identity':>17}"
    print_fn(header)
    rows = []
    for batch, context in shapes:
        row = {"batch": batch, "context": context}
        for shuffle in ((True, False) if identity else (True,)):
            p = make_decode_problem([context] * batch, device="cuda", shuffle=shuffle, **MODEL)
            t = time_decode(p, context)
            del p
            key = "shuffled" if shuffle else "identity"
            row[key] = t
        t = row["shuffled"]
        row["fraction"] = t.bandwidth / copy_bw
        line = (f"{batch:>5} {context:>7} {t.num_splits:>6} {t.ms * 1e3:>9.1f} {t.bandwidth / 1e12:>8.2f} "
                f"{row['fraction']:>8.2f}")
        if identity:
            row["slowdown"] = t.ms / row["identity"].ms
            line += f" {row['identity'].ms * 1e3:>11.1f} {row['slowdown']:>17.3f}"
        print_fn(line)
        rows.append(row)
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
