"""Where the engine's decode step spends its time: the GPU's kernels and the host's functions.

Usage (GPU machine, about a minute; no model file needed: SmolLM2-135M's shape, random weights):
    python benchmarks/profile_engine.py [--requests 1,64,256] [--out DIR]

For each batch size it prints

1. the engine's run (``bench.engine.run_engine``: tokens/s, ms per decode step, the host's parts,
   GPU busy and idle between decode steps);
2. one eager decode step under ``torch.profiler``: the kernels it launches, grouped by name, with
   their count and GPU time (what a CUDA graph replays);
3. ``cProfile`` of the engine's host work over the decode steps (the top functions by own time).

Random weights generate different tokens than the real model, but a step's work depends only on
the shapes (every request runs exactly ``--max-tokens`` tokens, end tokens ignored).

Tuning in the engine: a tile that wins alone (``bench_fused_linear.py --sweep``) can lose inside
a step, where the kernels before and after it share the GPU and the caches (and the reverse).
``--tile 'N,K,SILU,M=BM,BN,BK,WARPS,STAGES[,BK2];...'`` replaces ``fused_linear.TUNED``'s entry for
``M`` rows of the projection ``(N, K, silu_and_mul)`` (SILU 0 or 1), and ``--decode-launch
TILE_N,WARPS,STAGES`` gives every decode-attention launch that shape, for this run only: run it
with and without, alternating, on one warm machine, and compare the GPU busy time a step. (GPU
busy counts from an event recorded once the host has prepared the step's inputs; before 635d7a1
it counted from before the preparation, and moved with a slow host.) ``--graph-time`` times each
decode step's CUDA graph where the step replays it, against the host's own time a step
(``graph_time_table``). ``--steps`` lists every step of the run: the host's parts, the GPU's busy
time and its idle gap before the step (``per_step_table``), where the steps that keep the GPU
waiting show (at 256 requests of one length: the block boundaries, which every request crosses
at once).
``--leave-out gate_up,down,...`` (timing only) runs the decode steps without those parts'
launches: what a part costs inside a step, where PDL overlaps each kernel with its neighbours.

``--chain`` answers the same question without changing the step: the timed run again under
``torch.profiler`` (its CUDA graphs replayed as they are), and for each kernel of a decode step
how much later it ends than the kernel launched before it (``critical_path``). Those increments
add up to the step; a kernel launched early (PDL) that ends soon after its predecessor costs
little, whatever its own duration. The two views disagree, and both are worth reading: at 64
requests on an H100 the attention kernel ended 10.4 us after the QKV projection, the largest
share of a layer's 26 (gate-up 5.7, down 4.0, QKV 3.1, o_proj 3.1;
``benchmarks/results/profile_engine_chain_h100.log``), while leaving it out saved nothing
measurable; and in another run, with the whole context in one tile (``--decode-launch
256,8,1``), its share fell to 7.9 us and the down projection's, two kernels on, rose from 4.0 to
7.3, the step no shorter. Time a step's kernels save is not always time the step saves. The
chain needs greedy decode steps (they end with the argmax kernel).
"""
import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys

import torch

import paged_attention  # noqa: F401  (device policy first)
from paged_attention.bench.engine import idle_gap_ms, make_prompts, run_engine
from paged_attention.engine import LLM, SamplingParams
from paged_attention.model import LlamaConfig, LlamaForCausalLM
from paged_attention.model.weights import random_weights

SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5,
                    rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True)


def apply_overrides(tile: str, decode_launch: str) -> list[str]:
    """Apply ``--tile`` and ``--decode-launch`` (see the module's docstring) for this process;
    returns a line per override. A malformed or unbuildable value is a ``ValueError``, before
    anything is changed."""
    from paged_attention.kernels.triton import decode, fused_linear

    tiles = []
    for item in filter(None, (t.strip() for t in tile.split(";"))):
        try:
            key, cfg = item.split("=")
            n, k, silu, m = (int(v) for v in key.split(","))
            config = fused_linear.FusedLinearConfig(*(int(v) for v in cfg.split(",")))
        except (ValueError, TypeError) as e:       # a wrong count of fields, a non-integer field
            raise ValueError(f"--tile wants 'N,K,SILU,M=BM,BN,BK,WARPS,STAGES[,BK2]', got {item!r}") from e
        if silu not in (0, 1) or min(n, k, m) < 1:
            raise ValueError(f"--tile {item!r}: N, K and M must be positive and SILU 0 or 1")
        tiles.append(((n, k, bool(silu)), m, fused_linear._check_config(config)))
    launch = None
    if decode_launch:
        try:
            launch = decode.check_launch(tuple(int(v) for v in decode_launch.split(",")))
        except (ValueError, TypeError) as e:
            raise ValueError(f"--decode-launch wants TILE_N,WARPS,STAGES, got {decode_launch!r}: {e}") from e
    lines = []
    for shape, m, config in tiles:
        fused_linear.TUNED.setdefault(shape, {})[m] = config
        lines.append(f"fused_linear.TUNED[{shape}][{m}] = {config}")
    if launch is not None:
        general = decode.choose_launch

        def forced(device, max_seq_len, num_splits=1, num_programs=None):
            return launch if device.type == "cuda" else general(device, max_seq_len, num_splits, num_programs)

        decode.choose_launch = forced           # DecodePlan reads the module's function
        lines.append(f"decode launch {launch} on the GPU")
    return lines


LEAVE_OUT = ("qkv", "o_proj", "gate_up", "down", "attention", "head")


def leave_out_names(parts: str) -> list[str]:
    """The parts of ``--leave-out`` (comma-separated); an unknown one is a ``ValueError``."""
    names = [p.strip() for p in parts.split(",") if p.strip()]
    unknown = sorted(set(names) - set(LEAVE_OUT))
    if unknown:
        raise ValueError(f"--leave-out takes parts of {', '.join(LEAVE_OUT)}; got {', '.join(unknown)}")
    return names


def leave_out(parts: str, model: LlamaForCausalLM) -> list[str]:
    """``--leave-out``: from now on, decode steps skip the launches of these parts, for timing only
    (what the rest of the step costs without them; the outputs are garbage). The projections are
    skipped where the fused ops take them (decode steps of up to ``small_batch`` requests; their
    outputs are left unwritten, and the kernels after them read that), the attention kernel in
    every ``DecodePlan`` of the process, the head (output projection and argmax) in the model's
    ``greedy_tokens``. Returns a line per part; an unknown part is a ``ValueError`` before
    anything changes."""
    from paged_attention.kernels.triton import decode, fused_linear

    names = leave_out_names(parts)
    cfg, ops = model.config, model.ops
    shapes = {"qkv": (cfg.q_size + 2 * cfg.kv_size, cfg.hidden_size, False),
              "o_proj": (cfg.hidden_size, cfg.q_size, False),
              "gate_up": (cfg.intermediate_size, cfg.hidden_size, True),
              "down": (cfg.hidden_size, cfg.intermediate_size, False)}
    skipped = {shapes[n] for n in names if n in shapes}
    if skipped and hasattr(ops, "_fused"):
        fused = ops._fused

        def without(x, weight, residual=None, norm_weight=None, sum_sq=None, *, silu=False, add=None, prefetch=None):
            M, K = x.shape
            N = weight.size(0) // 2 if silu else weight.size(0)
            if (N, K, silu) not in skipped:
                return fused(x, weight, residual, norm_weight, sum_sq, silu=silu, add=add, prefetch=prefetch)
            # What the launch would return, unwritten: the next kernel reads shapes it expects.
            config = ops.linear_config or fused_linear.default_config
            config = config if isinstance(config, fused_linear.FusedLinearConfig) else config(M, N, K, silu)
            sums = None if add is None else torch.empty(M, -(-N // config.BLOCK_N), dtype=torch.float32,
                                                        device=x.device)
            return x.new_empty(M, N), x if residual is None else x.new_empty(M, K), sums
        ops._fused = without
    if "attention" in names:
        decode.DecodePlan._launch = lambda self, *args, **kwargs: None
    if "head" in names:
        model.greedy_tokens = lambda hidden: torch.zeros(hidden.size(0), dtype=torch.long, device=hidden.device)
    return [f"left out of decode steps, for timing only: {n}" for n in names]


def critical_path(kernels: list[tuple[str, float, float]], step_end: str, anchor: str,
                  after_anchor: tuple[str, ...] = ()) -> list[tuple[str, float, float, float, float, float]]:
    """Each kernel's share of the decode steps' time, from a profile's ``(name, start, end)``
    GPU events (any unit, any order).

    The events are taken in launch order (their starts) and cut into steps after each kernel
    whose name contains ``step_end`` (the step's last launch); events before the first such
    kernel, and after the last, are no complete step and are dropped, and so are steps of another
    kernel count than the most common one (a prefill among decode steps). A kernel's increment is
    its end minus the end of the kernel launched just before it (for a step's first kernel, the
    previous step's last): in a chain where every kernel waits for its predecessor, the time the
    step spent on it. The increments of a step add up to its span.

    Kernels are labelled by name, except that the ``i``-th kernel after one whose name contains
    ``anchor`` (a layer's attention, say), as long as they are the kernels that follow the step's
    first anchor, is labelled ``after_anchor[i - 1]`` where given (the projections that follow
    it), else ``name +i``. Returns, per label in order of first
    appearance: ``(label, launches a step, median increment, increments summed a step, median
    duration, median lead)``, the lead being how long before its predecessor's end the kernel
    started (PDL's early start; <= 0 for a kernel that started after it)."""
    events = sorted(kernels, key=lambda e: (e[1], e[2]))
    ends = [i for i, e in enumerate(events) if step_end in e[0]]
    spans = list(zip(ends, ends[1:]))
    if spans:
        lengths = [b - a for a, b in spans]
        common = max(set(lengths), key=lambda k: (lengths.count(k), -k))
        spans = [(a, b) for a, b in spans if b - a == common]
    rows: dict[str, list[list[float]]] = {}
    for a, b in spans:
        names = [e[0] for e in events[a + 1:b + 1]]
        anchors = [i for i, name in enumerate(names) if anchor in name]
        # A layer's kernels: those between the step's first two anchors. After a later anchor,
        # the kernels that repeat them take positional labels; the first that does not (the
        # head after the last layer) ends them.
        layer = names[anchors[0] + 1:anchors[1]] if len(anchors) > 1 else []
        pos = None
        for prev, (name, start, end) in zip(events[a:b], events[a + 1:b + 1]):
            if anchor in name:
                label, pos = name, 0
            elif pos is not None and pos < len(layer) and layer[pos] == name:
                pos += 1
                label = after_anchor[pos - 1] if pos <= len(after_anchor) else f"{name} +{pos}"
            else:
                label, pos = name, None
            r = rows.setdefault(label, [[], [], []])
            r[0].append(end - prev[2])
            r[1].append(end - start)
            r[2].append(prev[2] - start)
    steps = max(1, len(spans))
    median = statistics.median_high
    return [(label, len(inc) / steps, median(inc), sum(inc) / steps, median(dur), median(lead))
            for label, (inc, dur, lead) in rows.items()]


def chain_table(llm: LLM, n: int, prompt_len: int, max_tokens: int) -> str:
    """``--chain``: the run of ``n`` requests again under the profiler, its decode steps' kernels
    by ``critical_path`` (the fused projections named where the model takes them)."""
    from torch.profiler import ProfilerActivity, profile

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    prompts = make_prompts(n, prompt_len, llm.config.vocab_size, seed=n + 1)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
    kernels = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA]
    takes = getattr(llm.model.ops, "takes_fused", None)
    after = ("o_proj", "gate_up", "down", "qkv (next layer)") if takes and takes(n, True) else ()
    rows = critical_path(kernels, "argmax_reduce", "paged_decode", after)
    out = [f"  kernels' increments in the decode steps of {n} requests (us: launches a step, median "
           f"increment, increments a step, median duration, median early start)"]
    for label, count, inc, total, dur, lead in rows:
        if count >= 0.5:
            out.append(f"  {label[:48]:48s} {count:5.1f} {inc:8.2f} {total:8.1f} {dur:8.2f} {lead:8.2f}")
    return "\n".join(out)


def kernel_table(llm: LLM, n: int, prompt_len: int) -> str:
    """One eager decode step's kernels under the profiler, grouped by name."""
    from torch.profiler import ProfilerActivity, profile

    engine = llm.engine
    graphs, engine.runner.graphs = engine.runner.graphs, None
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = make_prompts(n, prompt_len, llm.config.vocab_size, seed=99)
    for i, p in enumerate(prompts):
        engine.add_request(f"prof-{i}", p, params)
    # The prefill (a few steps for many requests), until a decode-only step has run.
    first = len(engine.step_stats)
    while not any(s.decode_only for s in engine.step_stats[first:]):
        engine.step()
    engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.step()
        torch.cuda.synchronize()
    while engine.has_unfinished_requests():
        engine.step()
    engine.runner.graphs = graphs
    rows = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            r = rows.setdefault(e.name[:90], [0, 0.0])
            r[0] += 1
            r[1] += e.device_time
    total_n, total_t = sum(c for c, _ in rows.values()), sum(t for _, t in rows.values())
    out = [f"  one eager decode step, {n} requests: {total_n} kernels, {total_t:.0f} us of GPU time"]
    for name, (c, t) in sorted(rows.items(), key=lambda kv: -kv[1][1])[:25]:
        out.append(f"  {t:8.1f} us {c:5d}x  {name}")
    return "\n".join(out)


def prefill_trace(llm: LLM, n: int, prompt_len: int) -> str:
    """The first step of ``n`` new requests (their prefill, eager) under the profiler, host and
    GPU: the torch operations by the host's own time, and cProfile's view of the same step."""
    from torch.profiler import ProfilerActivity, profile

    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    for i, p in enumerate(make_prompts(n, prompt_len, llm.config.vocab_size, seed=97)):
        engine.add_request(f"pre-{i}", p, params)
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tp:
        prof.enable()
        engine.step()
        torch.cuda.synchronize()
        prof.disable()
    while engine.has_unfinished_requests():
        engine.step()
    table = tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60)
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("cumtime").print_stats("paged_attention|triton", 40)
    return f"  the prefill step of {n} requests of {prompt_len} tokens:\n{table}\n{s.getvalue()}"


def host_profile(llm: LLM, n: int, prompt_len: int, max_tokens: int) -> str:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    prompts = make_prompts(n, prompt_len, llm.config.vocab_size, seed=98)
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(f"host-{i}", p, params)
    for _ in range(3):
        engine.step()
    prof = cProfile.Profile()
    prof.enable()
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    prof.disable()
    s = io.StringIO()
    stats = pstats.Stats(prof, stream=s)
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumtime").print_stats("paged_attention", 45)
    return f"  cProfile over {steps} steps of {n} requests (own time, then cumulative):\n" + s.getvalue()


def is_decode_graph(key: tuple) -> bool:
    """Whether a ``StepGraphs`` key is a decode step's graph (one token a request), greedy or not."""
    return key[2] == 1 and key[0] == key[1]


def graph_summary(n: int, rows: list[tuple[float, float, float, float]]) -> str:
    """``--graph-time``'s lines from one row per decode step, ``(wall, host, busy, graph)`` in ms:
    the step's time in the host's loop, the host's own part of it (the rest is waiting for the
    GPU), the GPU's busy time (from the step's first CUDA event to its last) and its graph's
    replay. Medians; the graph's also over the first and the last fifth of the steps, where the
    contexts are shortest and longest. Whichever is longer, the host's own time or the graph,
    sets the pace of the steps."""
    if not rows:
        return f"  graph time: no decode step of {n} requests replayed a graph"
    median = statistics.median
    wall, host, busy, graph = (median(col) for col in zip(*rows))
    fifth = max(1, len(rows) // 5)
    early, late = median(r[3] for r in rows[:fifth]), median(r[3] for r in rows[-fifth:])
    pace = "the host's" if host > graph else "the GPU's"
    return (f"  decode steps of {n} requests replaying a graph ({len(rows)}, medians in ms): wall {wall:.3f}, the "
            f"host's own {host:.3f}, GPU busy {busy:.3f}, the graph {graph:.3f} (first fifth {early:.3f}, last "
            f"fifth {late:.3f}): {pace} work is the longer")


def graph_time_table(llm: LLM, n: int, prompt_len: int, max_tokens: int) -> str:
    """``--graph-time``: the run of ``n`` requests again, with CUDA events around each decode
    step's graph replay, as the step runs it (its own inputs and contexts), beside the step's GPU
    busy time and the host's time (``graph_summary``). A graph replayed apart from the run would
    read whatever inputs its buffers last held (at the end of a run, requests that have
    finished), and shows a shorter step than the run's."""
    runner = llm.engine.runner
    graphs = runner.graphs
    if graphs is None:
        return "  graph time: the engine runs no CUDA graphs"
    timed = []

    def timed_run(key, forward):
        if not is_decode_graph(key) or key not in graphs.graphs:
            return run(key, forward)                # a capture, or a step with prefills
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = run(key, forward)
        end.record()
        timed.append((start, end))
        return out

    run, graphs.run = graphs.run, timed_run
    first = len(llm.engine.step_stats)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    try:
        llm.generate(make_prompts(n, prompt_len, llm.config.vocab_size, seed=n + 2), params, use_tqdm=False)
    finally:
        del graphs.run                                 # the class's method again
    torch.cuda.synchronize()
    steps = [s for s in llm.engine.step_stats[first:] if s.decode_only and s.cuda_graph and s.gpu_events]
    if len(steps) != len(timed):
        return f"  graph time: {len(timed)} graph replays for {len(steps)} decode steps with graphs"
    rows = [(1e3 * s.total, 1e3 * (s.total - s.wait), s.gpu_events[0].elapsed_time(s.gpu_events[1]),
             start.elapsed_time(end)) for s, (start, end) in zip(steps, timed)]
    return graph_summary(n, rows)


def per_step_table(llm: LLM, first: int) -> str:
    """``--steps``: every step from ``first`` on, one line each: the host's own time and its
    schedule, prepare and update parts (ms), then the GPU's busy time and its idle gap before the
    step (CUDA events; blank for a step without them or after a gap in the numbering)."""
    out = ["    step  reqs tokens   host  sched   prep update   GPU busy  idle before"]
    prev = None
    for s in llm.engine.step_stats[first:]:
        busy = "" if s.gpu_events is None else f"{s.gpu_events[0].elapsed_time(s.gpu_events[1]):8.3f}"
        gap = idle_gap_ms(prev, s)
        idle = "" if gap is None else f"{gap:8.3f}"
        out.append(f"    {s.step:4d} {s.num_reqs:5d} {s.num_tokens:6d} {1e3 * (s.total - s.wait):6.3f} "
                   f"{1e3 * s.schedule:6.3f} {1e3 * s.prepare:6.3f} {1e3 * s.update:6.3f}   {busy:>8}  {idle:>8}")
        prev = s
    return "\n".join(out)


def step_table(llm: LLM, first: int, seconds: float) -> str:
    """Where the run's wall time went: the steps' own times against it, the slowest decode steps,
    and every step that was not decode-only (prefills, mixed steps)."""
    steps = llm.engine.step_stats[first:]
    decodes = sorted((s for s in steps if s.decode_only), key=lambda s: -s.total)
    totals = sorted(1e3 * s.total for s in decodes) or [float("nan")]
    out = [f"    {len(steps)} steps take {1e3 * sum(s.total for s in steps):.1f} of the run's {1e3 * seconds:.1f} ms; "
           f"decode steps: median {totals[len(totals) // 2]:.3f} ms, mean {sum(totals) / len(totals):.3f} ms; "
           f"slowest (ms): " + ", ".join(f"{s.step}: {1e3 * s.total:.2f} (wait {1e3 * s.wait:.2f}, schedule "
                                        f"{1e3 * s.schedule:.2f})" for s in decodes[:4])]
    for s in steps:
        if s.decode_only:
            continue
        busy = s.gpu_events[0].elapsed_time(s.gpu_events[1]) if s.gpu_events else float("nan")
        out.append(f"    step {s.step}: {s.num_reqs} requests, {s.num_tokens} tokens: sched {1e3 * s.schedule:.2f} "
                   f"prep {1e3 * s.prepare:.2f} fwd {1e3 * s.forward:.2f} sample {1e3 * s.sample:.2f} "
                   f"wait {1e3 * s.wait:.2f} update {1e3 * s.update:.2f} ms; GPU busy {busy:.2f} ms")
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", default="1,64,256")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--no-kernels", action="store_true")
    parser.add_argument("--no-host", action="store_true")
    parser.add_argument("--prefill", action="store_true", help="also trace one prefill step (host and GPU)")
    parser.add_argument("--small-batch", type=int, default=None,
                        help="the fused layer ops' small_batch (token rows that take the fused projections)")
    parser.add_argument("--out", default=None, help="also write the report to DIR/profile_engine.log")
    parser.add_argument("--llm", default="", help="extra LLM keyword arguments, k=v,k=v (ints and bools)")
    parser.add_argument("--tile", default="", help="fused_linear.TUNED overrides: 'N,K,SILU,M=BM,BN,BK,WARPS,STAGES[,BK2];...'")
    parser.add_argument("--decode-launch", default="", help="every decode launch's TILE_N,WARPS,STAGES")
    parser.add_argument("--chain", action="store_true",
                        help="also each decode kernel's increment of the step's time (critical_path)")
    parser.add_argument("--graph-time", action="store_true",
                        help="also each decode step's graph timed as the step runs it, against the host")
    parser.add_argument("--steps", action="store_true",
                        help="also every step of the run: host parts, GPU busy and the idle gap before it")
    parser.add_argument("--leave-out", default="", help=f"timing only: decode steps without these launches, "
                        f"some of {','.join(LEAVE_OUT)}")
    opts = parser.parse_args()
    overrides = apply_overrides(opts.tile, opts.decode_launch)
    leave_out_names(opts.leave_out)                     # refused before the model is built
    if not torch.cuda.is_available():
        print("this profile needs an NVIDIA GPU")
        return 1
    sizes = [int(x) for x in opts.requests.split(",")]
    extra = {}
    for kv in filter(None, opts.llm.split(",")):
        k, v = kv.split("=")
        extra[k] = {"True": True, "False": False}.get(v, int(v) if v.lstrip("-").isdigit() else v)
    config = LlamaConfig(**SMOLLM2_135M)
    model = LlamaForCausalLM(config, random_weights(config), dtype=torch.bfloat16, device="cuda")
    if opts.small_batch is not None:
        model.ops.small_batch = opts.small_batch
    overrides += leave_out(opts.leave_out, model)
    llm = LLM(model, max_num_seqs=max(sizes), kv_cache_memory=8 << 30, record_block_owners=False,
              record_gpu_time=True, **extra)
    lines = [f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, SmolLM2-135M shape, random weights, "
             f"bf16, {opts.prompt_len}+{opts.max_tokens} tokens; LLM extra {extra}; small_batch "
             f"{getattr(model.ops, 'small_batch', None)}" + "".join(f"; {o}" for o in overrides)]
    print(lines[0], flush=True)
    for n in sizes:
        prompts = make_prompts(n, opts.prompt_len, config.vocab_size, seed=n)
        e = run_engine(llm, prompts, opts.max_tokens)
        # run_engine's warm-up call ran first: the timed call's steps are the last e['steps'].
        first = len(llm.engine.step_stats) - e["steps"]
        line = (f"{n:4d} requests: {e['tokens_per_s']:8.0f} tok/s, {e['ms_per_decode_step']:.3f} ms/decode step "
                f"(sched {e['schedule_ms']:.3f} prep {e['prepare_ms']:.3f} fwd {e['forward_ms']:.3f} "
                f"sample {e['sample_ms']:.3f} wait {e['wait_ms']:.3f} update {e['update_ms']:.3f}); "
                f"GPU busy {e.get('gpu_busy_ms', float('nan')):.3f} ms, idle {100 * e.get('gpu_idle_share', 0):.1f}%; "
                f"{e['seconds'] * 1e3:.1f} ms in all, {e['steps']} steps")
        line += "\n" + step_table(llm, first, e["seconds"])
        if opts.steps:
            line += "\n" + per_step_table(llm, first)
        print(line, flush=True)
        lines.append(line)
        if opts.graph_time:
            t = graph_time_table(llm, n, opts.prompt_len, opts.max_tokens)
            print(t, flush=True)
            lines.append(t)
        if opts.prefill:
            t = prefill_trace(llm, n, opts.prompt_len)
            print(t, flush=True)
            lines.append(t)
        if opts.chain:
            t = chain_table(llm, n, opts.prompt_len, opts.max_tokens)
            print(t, flush=True)
            lines.append(t)
        if not opts.no_kernels:
            t = kernel_table(llm, n, opts.prompt_len)
            print(t, flush=True)
            lines.append(t)
        if not opts.no_host and n >= 64:
            t = host_profile(llm, n, opts.prompt_len, opts.max_tokens)
            print(t, flush=True)
            lines.append(t)
    if opts.out:
        os.makedirs(opts.out, exist_ok=True)
        with open(os.path.join(opts.out, "profile_engine.log"), "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
