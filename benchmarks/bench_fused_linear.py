"""The fused norm-and-projection kernels against the unfused ops, on SmolLM2-135M's projections.

Usage (on a GPU):  python3 benchmarks/bench_fused_linear.py [--dtype bf16] [--m 1,2,4]      (the table)
                   python3 benchmarks/bench_fused_linear.py --sweep [--layer] [--m 1,2,4,8,16,32,64] [--table]
                   python3 benchmarks/bench_fused_linear.py --smoke [--sweep --table --layer]  (any machine:
                   tiny shapes, Triton's interpreter; only a check that the script runs)

For each token count M (1 to 256) and each of a layer's four projections (hidden 576,
intermediate 1536, QKV 960 wide), the fused side (as the model calls it) and the unfused side:

* qkv:     ``norm_linear(sum_sq=...)``                   vs ``add_rms_norm`` + ``F.linear``
* gate_up: ``norm_linear(sum_sq=..., act="silu_and_mul")`` vs ``add_rms_norm`` + ``F.linear`` + ``silu_and_mul``
* o_proj, down: ``fused_linear.linear_add``              vs ``F.linear`` (cuBLAS; the add is in the norm kernel)

Two timings each, in microseconds: ``bench`` is ``triton.testing.do_bench`` (median, L2 flushed
before each call, the launch in the span); ``graph`` is 30 calls captured in one CUDA graph and
replayed, per call: launch costs gone, the weights warm in L2, as in a decode step replayed from
a graph. ``ratio`` = unfused graph / fused graph (above 1: the fused side is faster). Both sides
run in the same process on the same GPU, one after the other, first checked to agree.

``--sweep`` (instead of the table, or after it with ``--table``) times a small grid of tile
configurations per projection and M (``candidates``: the CUDA-core product up to 16 rows, tl.dot
from 8 rows on; a few minutes on an H100, compilation included), each as 30 calls in a CUDA graph
with the unfused side timed the same way, and prints per (projection, M) the unfused time, the
default configuration's, the best one's and that configuration; then the best ones as a
``fused_linear.TUNED`` table, ready to paste, and a suggested ``small_batch`` for
``FusedLayerOps``: the largest M up to which the fused QKV and gate-up projections both beat the
unfused ones.

``--layer`` (after a sweep: with its best tiles) times what decides ``small_batch``: two layers'
projections and norms through ``FusedLayerOps``, with the fused kernels and without, per M.
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import sys
import time

import paged_attention  # noqa: F401  (device policy first)

HIDDEN, INTER, QKV = 576, 1536, 960          # SmolLM2-135M: 9 query + 2 * 3 KV heads of 64
EPS = 1e-5
GRAPH_REPEATS = 30


def shapes(smoke: bool) -> list[tuple[str, int, int]]:
    """(name, N, K) of each projection: N is the output width (gate_up: the intermediate size)."""
    if smoke:
        return [("qkv", 40, 48), ("gate_up", 32, 48), ("o_proj", 48, 48), ("down", 48, 32)]
    return [("qkv", QKV, HIDDEN), ("gate_up", INTER, HIDDEN), ("o_proj", HIDDEN, HIDDEN), ("down", HIDDEN, INTER)]


PDL = True
"""The fused calls launch with programmatic dependent launch where the GPU has it, as the model's
do (each call's weight read overlapping the previous call's end); ``--no-pdl`` turns it off."""


def make_pair(name: str, M: int, N: int, K: int, dtype, device, config=None):
    """The fused and the unfused callable of one projection at M rows, on fixed random inputs,
    as the model runs them:

    * qkv, gate_up: fused, ``norm_linear`` of a stream whose sums of squares a ``linear_add``
      handed over (``sum_sq=``); unfused, ``add_rms_norm`` then ``F.linear`` (then ``silu_and_mul``);
    * o_proj, down: fused, ``linear_add`` (the projection with the residual add and the sums of
      squares); unfused, ``F.linear`` (the add is then done by the next norm kernel, timed above).
    """
    import torch
    import torch.nn.functional as F

    from paged_attention.kernels.triton import fused_linear as fl
    from paged_attention.kernels.triton.layer_ops import add_rms_norm, silu_and_mul

    g = torch.Generator().manual_seed(M * 7 + N)
    x = torch.randn(M, K, generator=g).to(device, dtype)
    silu = name == "gate_up"
    # One weight per layer, taken in turn: the calls captured in a graph read each once, from
    # memory, as a model's step does (one weight timed again and again would sit in the L2 cache).
    layers = [(torch.randn(2 * N if silu else N, K, generator=g) / K ** 0.5).to(device, dtype)
              for _ in range(2 if device.type != "cuda" else GRAPH_REPEATS)]
    turn = itertools.cycle(range(len(layers)))
    turn_unfused = itertools.cycle(range(len(layers)))
    weight = layers[0]
    if name in ("qkv", "gate_up"):
        residual = torch.randn(M, K, generator=g).to(device, dtype)
        norm_weight = (1 + 0.1 * torch.randn(K, generator=g)).to(device, dtype)
        act = "silu_and_mul" if silu else None
        # The stream and its sums of squares, as a linear_add leaves them (pieces of 32 columns).
        stream = x + residual
        sum_sq = stream.float().pow(2).view(M, -1, 32).sum(2) if K % 32 == 0 else stream.float().pow(2).sum(1, True)
        # The unfused side stores its sum into its residual: each call gets its own copy, the same
        # every time (a copy of the original, refreshed outside the timed span would be another
        # kernel; the sum drifting from call to call does not change the time).
        res_unfused = residual.clone()

        def fused():
            return fl.norm_linear(stream, norm_weight, layers[next(turn)], EPS, act=act, config=config,
                                  sum_sq=sum_sq, pdl=PDL)[0]

        def unfused():
            out = F.linear(add_rms_norm(x, norm_weight, EPS, res_unfused), layers[next(turn_unfused)])
            return silu_and_mul(out) if silu else out

        def check():
            got = fl.norm_linear(stream, norm_weight, weight, EPS, act=act, config=config, sum_sq=sum_sq)[0]
            want = F.linear(add_rms_norm(x, norm_weight, EPS, residual.clone()), weight)
            return got, silu_and_mul(want) if silu else want
    else:
        residual = torch.randn(M, N, generator=g).to(device, dtype)

        def fused():
            return fl.linear_add(x, layers[next(turn)], residual, config=config, pdl=PDL)[0]

        def unfused():
            return F.linear(x, layers[next(turn_unfused)])

        def check():
            return fl.linear_add(x, weight, residual, config=config)[0], F.linear(x, weight) + residual
    return fused, unfused, check


def run_layer(Ms, dtype, device, smoke: bool) -> None:
    """A layer's projections and norms as the model runs them (``FusedLayerOps``: norm_linear,
    linear_add, norm_linear_silu_mul, linear_add) with the fused kernels (``small_batch`` above M)
    and without (norm kernels, cuBLAS, SwiGLU kernel), graph us per layer, and the suggested
    ``small_batch``: the largest M up to which the fused layer is faster at every M measured."""
    import torch

    from paged_attention.kernels.triton import pdl
    from paged_attention.model import LlamaConfig
    from paged_attention.model.attention import PagedAttention
    from paged_attention.model.layer_ops import FusedLayerOps, ResidualStream, RotaryEmbedding
    if smoke:
        cfg = LlamaConfig.tiny()
    else:
        cfg = LlamaConfig(vocab_size=49152, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=30,
                          num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=EPS)
    rope = RotaryEmbedding(cfg.head_dim, 64, cfg.rope_theta, device)
    attn = PagedAttention("reference" if smoke else "triton", cfg.num_attention_heads, cfg.num_key_value_heads,
                          cfg.head_dim, device)
    ops = FusedLayerOps(cfg, rope, attn)
    graph = timers(smoke)[1] if smoke else (lambda fn: quick_graph_us(fn, k=2))
    g = torch.Generator().manual_seed(0)

    def w(*shape):
        return (torch.randn(*shape, generator=g) / shape[-1] ** 0.5).to(device, dtype)
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    # Every layer its own weights (the model's 210 MB do not fit in the L2 cache).
    layers = [dict(ln1=1 + w(hidden), qkv=w(cfg.q_size + 2 * cfg.kv_size, hidden), o=w(hidden, cfg.q_size),
                   ln2=1 + w(hidden), gate_up=w(2 * inter, hidden), down=w(hidden, inter))
              for _ in range(cfg.num_hidden_layers)]
    print(f"\nlayer (graph us per layer, {len(layers)} layers: norm_linear, linear_add, norm_linear_silu_mul, "
          f"linear_add)")
    # Fused with and without programmatic dependent launch (each kernel reading its weights
    # while the one before finishes), where the GPU has it.
    variants = [("unfused", 0, False), ("fused", 1 << 20, False)]
    if PDL and pdl.enabled(device):
        variants.append(("fused+pdl", 1 << 20, True))
    faster = []
    for M in Ms:
        x0, attn_out = w(M, hidden) * hidden ** 0.5, w(M, cfg.q_size)

        def model():
            stream = ResidualStream(x0.clone())
            for weights in layers:
                qkv, residual = ops.norm_linear(stream, weights["ln1"], weights["qkv"])
                stream = ops.linear_add(attn_out + qkv[:, :1], weights["o"], residual)
                act, residual = ops.norm_linear_silu_mul(stream, weights["ln2"], weights["gate_up"])
                stream = ops.linear_add(act, weights["down"], residual)
            return ops.norm(stream, layers[0]["ln1"])
        times, outs = {}, {}
        for label, small, early in variants:
            ops.small_batch = small
            with contextlib.nullcontext() if early else pdl.disabled():
                outs[label] = model()
                times[label] = graph(model) / len(layers)
        err = max(((outs[label].float() - outs["unfused"].float()).abs().max() /
                   outs["unfused"].float().abs().max()).item() for label in outs)
        assert err < 0.05, f"fused and unfused layers disagree at M={M}: {err:.3g}"
        best_fused = min(t for label, t in times.items() if label != "unfused")
        faster.append(best_fused < times["unfused"])
        print(f"M={M:<4} " + "  ".join(f"{label} {t:7.2f}" for label, t in times.items())
              + f"  x{times['unfused'] / best_fused:4.2f}  (rel diff {err:.1e})", flush=True)
    best = 0
    for M, ok in zip(Ms, faster):
        if not ok:
            break
        best = M
    print(f"suggested small_batch: {best}")


def agree(check, dtype) -> float:
    """Max |fused - unfused| over max |unfused|; AssertionError if beyond a few roundings."""
    import torch
    got, want = check()
    err = ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-6)).item()
    assert err <= 8 * torch.finfo(dtype).eps, f"fused and unfused disagree: relative error {err:.3g}"
    return err


def timers(smoke: bool):
    """(bench, graph) microsecond timers: do_bench and 30 calls in a CUDA graph on a GPU; one
    wall-clock call each in the smoke run (the interpreter's times mean nothing)."""
    if smoke:
        def wall(fn):
            start = time.perf_counter()
            fn()
            return 1e6 * (time.perf_counter() - start)
        return wall, wall
    from paged_attention.bench import timing
    return timing.gpu_us, lambda fn: timing.hot_us(fn, k=GRAPH_REPEATS)


def run_table(Ms, dtype, device, smoke: bool) -> None:
    """One row per projection and M: both timings of both sides (fused with ``default_config``)."""
    from paged_attention.kernels.triton import fused_linear as fl
    bench, graph = timers(smoke)
    print(f"{'op':8} {'M':>4} | {'fused bench':>11} {'unfused bench':>13} | {'fused graph':>11} "
          f"{'unfused graph':>13} {'ratio':>6} | rel err | default config (BLOCK_M, N, K, warps, stages)")
    for name, N, K in shapes(smoke):
        for M in Ms:
            fused, unfused, check = make_pair(name, M, N, K, dtype, device)
            err = agree(check, dtype)
            fb, ub = bench(fused), bench(unfused)
            fg, ug = graph(fused), graph(unfused)
            cfg = tuple(fl.default_config(M, N, K, name == "gate_up"))
            print(f"{name:8} {M:>4} | {fb:>11.2f} {ub:>13.2f} | {fg:>11.2f} {ug:>13.2f} {ug / fg:>6.2f} | {err:.1e} | "
                  f"{cfg}", flush=True)


def quick_graph_us(fn, k: int = GRAPH_REPEATS, reps: int = 20) -> float:
    """``timing.hot_us`` in a few milliseconds instead of a few hundred: ``k`` calls captured in
    one CUDA graph, replayed ``reps`` times after an L2 flush each, the median per call. For the
    sweep, which times hundreds of configurations; both sides of each comparison use it."""
    import torch
    import triton

    from paged_attention.bench.timing import graph_of_calls

    graph = graph_of_calls(fn, k)
    cache = triton.runtime.driver.active.get_empty_cache_for_benchmark()
    for _ in range(2):
        graph.replay()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        cache.zero_()
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    times = sorted(start.elapsed_time(end) for start, end in events)
    return 1000.0 * times[len(times) // 2] / k


def candidates(M: int, N: int, K: int, silu: bool, smoke: bool = False) -> list:
    """The configurations the sweep tries for one projection at M rows (the default is timed too).

    * up to 16 rows, the CUDA-core product: one row tile of next_pow2(M) rows (at most 8: M = 16
      runs as two tiles), K in one chunk (K up to 2048), or in chunks of 512 (K > 1024, where one
      chunk would be a quarter masked), 1 to 32 columns a program while the product tile stays
      within 2K to 32K elements (4 warps up to 8K, then 8) and the programs number 24 to 512;
    * from 8 rows on, tl.dot: 16-row tiles (and M's own, up to 64), 16 to 64 columns, K in
      pipelined chunks of 64 to 256; also K in one chunk (padded to a power of two) on 8 warps,
      or in two unpadded ones (``two_chunks``), and above 128 rows 64- and 128-row tiles on 4 or
      8 warps.
    Configurations that spill registers when compiled for an H100 (tl.dot with K in one chunk of
    512 or more; 256 with SwiGLU's two weight tiles) are left out: every one of these compiles
    for sm_90 without a spill (checked with Triton 3.9's compiler, no GPU needed), except the
    one-chunk and the taller tiles, which were only timed (on an H200, where none was the best
    at 64 rows or more), and the two-chunk ones, only timed too (on an H100, where they won for
    QKV at 16 to 64 rows and lost for gate-up and down at 64).
    """
    from paged_attention.kernels.triton import fused_linear as fl
    from paged_attention.utils import next_power_of_2
    C = fl.FusedLinearConfig
    if smoke:
        return [C(min(8, next_power_of_2(M)), 8, 16, 4, 1), C(16, 16, 32, 4, 2)]
    out = []
    if M <= 16:
        bm = min(8, next_power_of_2(M))
        chunks = [(min(2048, next_power_of_2(K)), 1)] + ([(512, 2)] if K > 1024 else [])
        for bk, stages in chunks:
            for bn in (1, 2, 4, 8, 16, 32):
                tile = bm * bn * bk
                if 2048 <= tile <= 32768 and 24 <= -(-N // bn) <= 512:
                    out.append(C(bm, bn, bk, 4 if tile <= 8192 else 8, stages))
    if M >= 8:
        dots = [(16, 16, 64), (16, 32, 64), (16, 64, 64), (16, 16, 128), (16, 32, 128)]
        dots += [] if silu else [(16, 16, 256)]             # with two weight tiles it spills
        own = min(64, next_power_of_2(M))
        if own > 16:
            dots += [(own, 16, 64), (own, 16, 128), (own, 32, 64), (own, 32, 128), (own, 64, 64)]
        if M > 64:
            dots += [(32, 32, 64), (32, 64, 64)]
        out += [C(bm, bn, bk, 4, 2 if bk >= 256 else 3) for bm, bn, bk in dots]
        # K in one chunk (padded to a power of two, the padding masked) on 8 warps: the whole weight
        # tile loaded before the wait, nothing left to stream after it
        whole = min(2048, next_power_of_2(K))
        out += [C(16, bn, whole, 8, 1) for bn in ((16, 32) if whole <= 1024 else (16,))]
        out += two_chunks(M, K, silu)
        if M > 128:                                       # hundreds of rows: taller tiles, 8 warps too
            out += [C(bm, bn, 64, w, 3) for bm, bn in ((64, 64), (128, 32), (128, 64)) for w in (4, 8)]
    return out


def two_chunks(M: int, K: int, silu: bool) -> list:
    """Tiles that read all of a K which is not a power of two before the wait, unpadded, as two
    chunks (``BLOCK_K2``: 576 as 512 + 64, 1536 as 1024 + 512), on 4 or 8 warps; from 32 rows
    also 32-row tiles. None for a power-of-two K (one chunk is that) or one above 2048."""
    from paged_attention.kernels.triton import fused_linear as fl
    from paged_attention.utils import next_power_of_2
    first = 1 << (K.bit_length() - 1)
    if first == K or K > 2048:
        return []
    second = max(16, next_power_of_2(K - first))
    rows = [16] + ([32] if M >= 32 else [])
    cols = (16, 32) if silu or K > 1024 else (16, 32, 64)
    return [fl.FusedLinearConfig(bm, bn, first, w, 1, second) for bm in rows for bn in cols for w in (4, 8)]


def run_sweep(Ms, dtype, device, smoke: bool) -> None:
    """Per projection and M: the unfused time, the default configuration's, and the best of
    ``candidates`` (graph us per call); then the suggested ``small_batch``."""
    import torch

    from paged_attention.kernels.triton import fused_linear as fl
    graph = timers(smoke)[1] if smoke else quick_graph_us
    start = time.perf_counter()
    print("\nsweep (graph us per call; unfused = add_rms_norm + F.linear [+ silu_and_mul] or F.linear)")
    wins: dict[str, dict[int, tuple[bool, bool]]] = {}
    tuned: dict[tuple[int, int, bool], dict[int, object]] = {}
    for name, N, K in shapes(smoke):
        silu = name == "gate_up"
        for M in Ms:
            default = fl.default_config(M, N, K, silu)
            fused, unfused, check = make_pair(name, M, N, K, dtype, device, default)
            agree(check, dtype)
            t_unfused, t_default = graph(unfused), graph(fused)
            times, failed, last_error = {default: t_default}, 0, ""
            for cfg in candidates(M, N, K, silu, smoke):
                if cfg in times:
                    continue
                fused, _, check = make_pair(name, M, N, K, dtype, device, cfg)
                try:
                    agree(check, dtype)
                    times[cfg] = graph(fused)
                except Exception as e:      # a configuration this GPU cannot run (resources)
                    failed += 1
                    last_error = f"{type(e).__name__}: {str(e)[:80]}"
                    if not smoke:
                        torch.cuda.synchronize()
            best = min(times, key=times.get)
            wins.setdefault(name, {})[M] = (t_default < t_unfused, times[best] < t_unfused)
            tuned.setdefault((N, K, silu), {})[M] = best
            note = f"  ({failed} failed, e.g. {last_error})" if failed else ""
            print(f"{name:8} M={M:<4} unfused {t_unfused:7.2f}  default {t_default:7.2f}  best {times[best]:7.2f}  "
                  f"x{t_unfused / times[best]:4.2f}  {best!r}{note}", flush=True)
        print(f"  ({time.perf_counter() - start:.0f} s so far)", flush=True)
    from paged_attention import runtime
    print(f"\n# The best tiles measured on {runtime.device_name()}: to paste into "
          f"paged_attention/kernels/triton/fused_linear.py\nTUNED = {{")
    for shape, by_m in tuned.items():
        print(f"    {shape!r}: {{")
        for M, cfg in by_m.items():
            print(f"        {M}: {cfg!r},")
        print("    },")
    print("}\n")
    fl.TUNED.update(tuned)                     # what a --layer run after the sweep then takes
    for which, label in ((1, "the best configurations (once pasted as TUNED)"), (0, "default_config as it is")):
        print(f"suggested small_batch: {suggest_small_batch(Ms, wins, which)}  (fused QKV and gate-up both "
              f"faster than unfused at every M up to it, with {label})")


def suggest_small_batch(Ms, wins, which: int) -> int:
    """The largest M of ``Ms`` up to which (every smaller M of ``Ms`` included) the fused QKV and
    gate-up projections both beat the unfused ones; 0 if not even at the smallest."""
    best = 0
    for M in sorted(Ms):
        if not all(wins.get(op, {}).get(M, (False, False))[which] for op in ("qkv", "gate_up")):
            break
        best = M
    return best


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes in Triton's interpreter: the script runs")
    parser.add_argument("--dtype", default=None, help="bf16 (GPU default), fp16 or fp32 (smoke default)")
    parser.add_argument("--m", default=None, help="token counts, comma-separated (default 1,2,4,...,256)")
    parser.add_argument("--sweep", action="store_true", help="sweep the tile configurations (instead of the table)")
    parser.add_argument("--table", action="store_true", help="with --sweep: the table too, first")
    parser.add_argument("--layer", action="store_true", help="a whole layer's projections and norms, fused or not")
    parser.add_argument("--no-pdl", action="store_true", help="fused calls without programmatic dependent launch")
    a = parser.parse_args(argv)
    global PDL
    PDL = not a.no_pdl

    import torch

    from paged_attention import runtime
    from paged_attention.model.llama import resolve_dtype
    if not a.smoke and not runtime.HAS_CUDA:
        print("needs an NVIDIA GPU (or --smoke for a check that the script runs)", file=sys.stderr)
        return 2
    dtype = resolve_dtype(a.dtype or ("fp32" if a.smoke else "bf16"))
    default_ms = [1, 2, 4, 8, 16, 32, 64] + ([] if a.sweep else [128, 256])
    Ms = [int(m) for m in a.m.split(",")] if a.m else ([1, 3, 17] if a.smoke else default_ms)
    device = runtime.DEVICE
    print(f"device: {runtime.device_name()}  torch {torch.__version__}  dtype {dtype}  "
          f"{'(smoke: interpreter, times meaningless)' if a.smoke else ''}")
    if not a.smoke:
        from paged_attention.bench import timing
        timing.warm_up()
    if a.table or not (a.sweep or a.layer):
        run_table(Ms, dtype, device, a.smoke)
    if a.sweep:
        run_sweep(Ms, dtype, device, a.smoke)
    if a.layer:                                # after a sweep: with its best tiles
        run_layer(Ms, dtype, device, a.smoke)
    return 0


if __name__ == "__main__":
    sys.exit(main())
