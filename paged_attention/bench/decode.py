"""Decode attention's bandwidth against a device-to-device copy (GPU).

A decode step reads every cached key and value once and does little arithmetic, so its speed is
the memory bandwidth it reaches. The yardstick is a plain ``copy_`` of a large buffer, timed in
the same run: ``fraction = (KV bytes read / kernel time) / (bytes read + written / copy time)``.
A fraction near 1 means the kernel reads the cache about as fast as the GPU can move memory at
all. ``decode_table`` times the Triton kernel (and vLLM's FA3 where found), ``sweep`` its launch
shapes, ``cuda_attention_table`` and ``kernel_times`` our CUDA kernels next to it; ``calls_table`` and
``cache_write_calls`` what a call costs as a user's code makes it (eager, graph, host time) for
ours and vLLM's kernels; ``benchmarks/bench_decode.py`` is the command line.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from paged_attention.bench.timing import copy_bandwidth, gpu_us, graph_time_ms, graph_us, host_us, warm_up
from paged_attention.kernels.triton import paged_attention_decode
from paged_attention.kernels.triton.decode import DecodePlan, choose_launch, choose_num_splits
from paged_attention.kernels.workloads import DecodeProblem, make_decode_problem

# The shapes of the decode targets: (batch, context).
DECODE_SHAPES = ((64, 512), (64, 4096), (64, 16384), (4, 32768), (1, 131072))
# Llama-3-8B-like attention: 32 query heads over 8 KV heads, head size 128, block size 16, bf16.
MODEL = dict(num_heads=32, num_kv_heads=8, head_size=128, block_size=16, dtype=torch.bfloat16)


@dataclass
class DecodeTiming:
    """One timed decode shape: the median time of a CUDA-graph replay and the KV bytes it read."""
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
                flush: str = "write") -> DecodeTiming:
    """Time the Triton decode kernel on a prepared problem (index checks off: the tables are ours)."""
    out = torch.empty_like(p.query)
    batch = p.query.size(0)
    splits = num_splits or choose_num_splits(batch, p.key_cache.size(2), context, p.query.device)

    def run():
        paged_attention_decode(out, *p.decode_args(), num_splits=splits, max_seq_len=context,
                               check_ids=False, launch=launch)
    return DecodeTiming(batch, context, splits, graph_time_ms(run, rep, flush), p.kv_bytes_read)


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


# The engine's decode steps: SmolLM2-135M's attention (9 query heads over 3 KV heads, head size
# 64, block size 16, bf16) at the batch sizes of bench_engine, 128-token prompts plus half of the
# 128 new tokens.
SMOLLM2_MODEL = dict(num_heads=9, num_kv_heads=3, head_size=64, block_size=16, dtype=torch.bfloat16)
SMOLLM2_SHAPES = ((16, 192), (64, 192), (256, 192))


def sweep(shapes=DECODE_SHAPES, print_fn=print, model=MODEL) -> None:
    """Try launch shapes and split counts per shape; print the best few of each (for tuning)."""
    warm_up()
    copy_bw = copy_bandwidth()
    print_fn(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s")
    launches = [(64, 2, 3), (64, 4, 3), (64, 4, 2), (32, 2, 2), (32, 2, 3), (32, 4, 2), (128, 4, 2), (128, 8, 3)]
    if max(context for _, context in shapes) <= 1024:       # short contexts: short loops, small tiles too
        launches += [(16, 1, 2), (16, 2, 2), (32, 1, 2), (64, 2, 2), (64, 4, 1), (256, 8, 1), (256, 4, 1)]
    for batch, context in shapes:
        p = make_decode_problem([context] * batch, device="cuda", **model)
        auto = choose_num_splits(batch, model["num_kv_heads"], context, torch.device("cuda"))
        split_options = sorted({auto, max(1, auto // 2), auto * 2, auto * 4})
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
        programs = batch * model["num_kv_heads"] * auto
        default = [r for r in results
                   if r[1] == choose_launch(torch.device('cuda'), context, auto, programs) and r[2] == auto]
        if default:
            print_fn(f"  default: {default[0][0]:.3f}")
        del p
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------
# Our CUDA v1/v2 kernels, the Triton kernel and a contiguous SDPA floor side by side
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
    if not vllm.available("fa3")[0]:       # the decode needs FA3's library only
        return None
    out = torch.empty_like(p.query) if out is None else out
    return lambda: vllm.paged_attention_decode(out, *p.decode_args(), max_seq_len=context, check_ids=False)


def cuda_attention_table(shapes=CUDA_SHAPES, print_fn=print) -> list[dict]:
    """Our CUDA ``paged_attention_v1``/``_v2`` (and Triton, and vLLM's FA3 where found): bandwidth
    as a fraction of a copy, per shape, v0 key layout."""
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


def kv_bytes_per_step(batch: int, context: int, model: dict = MODEL) -> int:
    """Bytes of keys and values one decode step over ``batch`` sequences of ``context`` tokens reads
    (each cached K and V element once): the numerator of a read rate."""
    element = torch.empty(0, dtype=model["dtype"]).element_size()
    return 2 * batch * context * model["num_kv_heads"] * model["head_size"] * element


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
        p = k = v = None                                          # freed before the next context's
        torch.cuda.empty_cache()
    # A kernel that ran nowhere (vLLM's FA3 where its library is not found) is left out.
    return list(contexts), {name: t for name, t in times.items() if any(x is not None for x in t)}


# --------------------------------------------------------------------------------------------
# The cost of a call: ours, vLLM's FA3 and vLLM's Triton kernel as a user's code calls them
# --------------------------------------------------------------------------------------------

# (batch, context): short contexts, where the host's share of a call is largest, to long ones.
CALL_SHAPES = ((64, 512), (64, 1024), (32, 2048), (64, 4096), (64, 16384), (4, 32768), (1, 131072),
               (128, 256), (256, 1024))


def call_runners(p: DecodeProblem, context: int) -> dict[str, Callable[[], object]]:
    """One decode of ``p`` per call, for each kernel that can run here, each as its users call it:
    ours through the unchecked entry point (``check_ids=False``: a plan looked up by shape) and
    through a ``DecodePlan`` kept by the caller; vLLM's FA3 op called directly, its metadata
    prepared beforehand (as vLLM's backend does); vLLM's Triton ``unified_attention`` as vLLM's
    Triton backend calls it. Each runner's output is checked against the float64 reference first."""
    from paged_attention.kernels import vllm, vllm_triton
    from paged_attention.kernels.reference import ref_decode_attention
    q, k, v, bt, sl, scale, _ = p.decode_args()
    plan = DecodePlan(q, k, v, bt, sl, scale, max_seq_len=context, check_ids=False)
    outs: dict[str, torch.Tensor] = {}

    def out(name: str) -> torch.Tensor:
        return outs.setdefault(name, torch.empty_like(q))
    runners = {
        "ours": lambda: paged_attention_decode(out("ours"), q, k, v, bt, sl, scale, max_seq_len=context,
                                               check_ids=False),
        "ours plan.run": lambda: plan.run(out("ours plan.run"), q, k, v, bt, sl),
    }
    if vllm.available("fa3")[0]:
        runners["vLLM FA3"] = vllm.fa3_decode_call(out("vLLM FA3"), q, k, v, bt, sl, scale, context)
    if vllm_triton.available()[0]:
        peer = vllm_triton.VllmTritonDecode(q.size(1), k.size(2), q.size(2), q.size(0), q.device)
        runners["vLLM Triton"] = lambda: peer.run(out("vLLM Triton"), q, k, v, bt, sl, scale, context)
    expected = ref_decode_attention(*p.decode_args())
    for name, run in runners.items():
        run()
        err = (out(name).double() - expected).abs().max().item()
        if not err < 2e-2:
            raise AssertionError(f"{name} differs from the float64 reference by {err:.3g} "
                                 f"at {p.query.size(0)} x {context}")
    return runners


def _cost_cells(row: dict) -> str:
    """``name: eager / graph / host`` (µs) for every kernel timed in a row."""
    return "  ".join(f"{name}: {t['eager']:7.1f} / {t['graph']:7.1f} / {t['host']:5.1f}"
                     for name, t in row.items() if isinstance(t, dict) and "host" in t)


def calls_table(shapes=CALL_SHAPES, print_fn=print) -> list[dict]:
    """Per shape and kernel: eager µs (``do_bench``: median, L2 flushed by a write before each
    call), CUDA-graph replay µs, and host µs per call (Python issuing the call, the GPU kept busy);
    then ours over each peer (throughput: the peer's time over ours; > 1 means ours is faster)."""
    warm_up()
    print_fn(f"device: {torch.cuda.get_device_name()}; 32 query / 8 KV heads, head size 128, block size 16, bf16, "
             "shuffled block tables; every kernel checked against the float64 reference first")
    print_fn("eager: do_bench median (L2 flushed before each call); graph: one call replayed from a CUDA graph; "
             "host: Python time per call")
    rows = []
    for batch, context in shapes:
        p = make_decode_problem([context] * batch, device="cuda", shuffle=True, **MODEL)
        runners = call_runners(p, context)
        row = {"batch": batch, "context": context}
        for name, run in runners.items():
            row[name] = {"eager": gpu_us(run), "graph": graph_us(run), "host": host_us(run)}
        print_fn(f"{batch:>4} x {context:<6}  " + _cost_cells(row))
        ours = row["ours"]
        for peer in ("vLLM FA3", "vLLM Triton"):
            if peer in row:
                row[f"ours/{peer}"] = {m: row[peer][m] / ours[m] for m in ("eager", "graph")}
        ratios = "  ".join(f"{k}: eager {v['eager']:.2f}, graph {v['graph']:.2f}" for k, v in row.items()
                           if k.startswith("ours/"))
        if ratios:
            print_fn(f"{'':15}{ratios}")
        rows.append(row)
        del p, runners
        torch.cuda.empty_cache()
    return rows


def cache_write_calls(num_tokens=(1, 64, 256, 2048), print_fn=print) -> list[dict]:
    """``reshape_and_cache_flash`` per call: ours checked (reads the slots back), ours unchecked
    (a plan looked up by shape), vLLM's CUDA op (where its library is found), as eager / graph /
    host µs. 8 KV heads x 128, block size 16, bf16, 4096 blocks."""
    from paged_attention.kernels import vllm
    from paged_attention.kernels.triton import reshape_and_cache_flash
    warm_up()
    dev = "cuda"
    kc = torch.zeros(4096, 16, 8, 128, dtype=torch.bfloat16, device=dev)
    vc = torch.zeros_like(kc)
    one = torch.ones(1, dtype=torch.float32, device=dev)
    rows = []
    for n in num_tokens:
        key = torch.randn(n, 8, 128, dtype=torch.bfloat16, device=dev)
        value = torch.randn_like(key)
        slots = torch.randperm(4096 * 16, device=dev)[:n]
        runners = {
            "ours checked": lambda: reshape_and_cache_flash(key, value, kc, vc, slots, "auto", one, one),
            "ours": lambda: reshape_and_cache_flash(key, value, kc, vc, slots, "auto", one, one, check_slots=False),
        }
        if vllm.available("cache_ops")[0]:
            runners["vLLM CUDA op"] = lambda: vllm.reshape_and_cache_flash(key, value, kc, vc, slots, "auto", one, one,
                                                                       check_slots=False)
        row = {"tokens": n}
        for name, run in runners.items():
            row[name] = {"eager": gpu_us(run), "graph": graph_us(run) if name != "ours checked" else float("nan"),
                         "host": host_us(run)}
        print_fn(f"reshape_and_cache_flash, {n:>5} tokens  " + _cost_cells(row))
        rows.append(row)
    return rows
