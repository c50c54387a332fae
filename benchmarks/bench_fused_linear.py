"""The fused norm-and-projection kernels against the unfused ops, on SmolLM2-135M's projections.

Usage (on a GPU):  python3 benchmarks/bench_fused_linear.py [--dtype bf16] [--m 1,2,4] [--sweep]
                   python3 benchmarks/bench_fused_linear.py --smoke    (any machine: tiny shapes,
                   Triton's interpreter; only a check that the script runs)

For each token count M (1 to 256) and each of a layer's four projections (hidden 576,
intermediate 1536, QKV 960 wide), the fused side and the unfused side:

* qkv:     ``norm_linear``                       vs ``add_rms_norm`` + ``F.linear``
* gate_up: ``norm_linear(act="silu_and_mul")``   vs ``add_rms_norm`` + ``F.linear`` + ``silu_and_mul``
* o_proj, down: ``fused_linear.linear``          vs ``F.linear`` (cuBLAS)

Two timings each, in microseconds: ``bench`` is ``triton.testing.do_bench`` (median, L2 flushed
before each call, the launch in the span); ``graph`` is 30 calls captured in one CUDA graph and
replayed, per call: launch costs gone, the weights warm in L2, as in a decode step replayed from
a graph. ``ratio`` = unfused graph / fused graph (above 1: the fused side is faster). Both sides
run in the same process on the same GPU, one after the other, first checked to agree.

``--sweep`` also times every tile configuration of a small grid per shape and M (graph timing)
and prints the best, for choosing ``fused_linear.default_config``.
"""
from __future__ import annotations

import argparse
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


def make_pair(name: str, M: int, N: int, K: int, dtype, device, config=None):
    """The fused and the unfused callable of one projection at M rows, on fixed random inputs."""
    import torch
    import torch.nn.functional as F

    from paged_attention.kernels.triton import fused_linear as fl
    from paged_attention.kernels.triton.layer_ops import add_rms_norm, silu_and_mul

    g = torch.Generator().manual_seed(M * 7 + N)
    x = torch.randn(M, K, generator=g).to(device, dtype)
    residual = torch.randn(M, K, generator=g).to(device, dtype)
    norm_weight = (1 + 0.1 * torch.randn(K, generator=g)).to(device, dtype)
    silu = name == "gate_up"
    weight = (torch.randn(2 * N if silu else N, K, generator=g) / K ** 0.5).to(device, dtype)
    act = "silu_and_mul" if silu else None
    if name in ("qkv", "gate_up"):
        # The unfused side stores its sum into its residual: each call gets its own copy, the same
        # every time (a copy of the original, refreshed outside the timed span would be another
        # kernel; the sum drifting from call to call does not change the time).
        res_unfused = residual.clone()

        def fused():
            return fl.norm_linear(x, norm_weight, weight, EPS, residual, act=act, config=config)[0]

        def unfused():
            out = F.linear(add_rms_norm(x, norm_weight, EPS, res_unfused), weight)
            return silu_and_mul(out) if silu else out

        def check():
            want = F.linear(add_rms_norm(x, norm_weight, EPS, residual.clone()), weight)
            return fused(), silu_and_mul(want) if silu else want
    else:
        def fused():
            return fl.linear(x, weight, config=config)

        def unfused():
            return F.linear(x, weight)

        def check():
            return fused(), unfused()
    return fused, unfused, check


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
    bench, graph = timers(smoke)
    print(f"{'op':8} {'M':>4} | {'fused bench':>11} {'unfused bench':>13} | {'fused graph':>11} "
          f"{'unfused graph':>13} {'ratio':>6} | rel err")
    for name, N, K in shapes(smoke):
        for M in Ms:
            fused, unfused, check = make_pair(name, M, N, K, dtype, device)
            err = agree(check, dtype)
            fb, ub = bench(fused), bench(unfused)
            fg, ug = graph(fused), graph(unfused)
            print(f"{name:8} {M:>4} | {fb:>11.2f} {ub:>13.2f} | {fg:>11.2f} {ug:>13.2f} {ug / fg:>6.2f} | {err:.1e}",
                  flush=True)


SWEEP = dict(BLOCK_N=(16, 32, 64), BLOCK_K=(32, 64, 128), num_warps=(2, 4), num_stages=(2, 4))


def run_sweep(Ms, dtype, device, smoke: bool) -> None:
    """The best tile configuration per projection and M, by graph time (``default_config``'s for comparison)."""
    from paged_attention.kernels.triton import fused_linear as fl
    _, graph = timers(smoke)
    grid = list(itertools.product(*SWEEP.values()))
    if smoke:
        grid = grid[:2]
    print(f"\nsweep over {len(grid)} configurations of {', '.join(SWEEP)} (graph us per call)")
    for name, N, K in shapes(smoke):
        for M in Ms:
            default = fl.default_config(M, N, K, name == "gate_up")
            times, failed = {}, 0
            for bn, bk, warps, stages in grid:
                cfg = fl.FusedLinearConfig(default.BLOCK_M, bn, bk, warps, stages)
                fused, _, _ = make_pair(name, M, N, K, dtype, device, cfg)
                try:
                    times[cfg] = graph(fused)
                except Exception as e:      # a configuration this GPU cannot run (shared memory)
                    failed += 1
                    last_error = f"{type(e).__name__}: {str(e)[:80]}"
            fused, _, _ = make_pair(name, M, N, K, dtype, device, default)
            best = min(times, key=times.get)
            note = f"  ({failed} failed to run, e.g. {last_error})" if failed else ""
            print(f"{name:8} M={M:<4} default {graph(fused):7.2f}  best {times[best]:7.2f}  {best}{note}", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes in Triton's interpreter: the script runs")
    parser.add_argument("--dtype", default=None, help="bf16 (GPU default), fp16 or fp32 (smoke default)")
    parser.add_argument("--m", default=None, help="token counts, comma-separated (default 1,2,4,...,256)")
    parser.add_argument("--sweep", action="store_true", help="also sweep the tile configurations")
    a = parser.parse_args(argv)

    import torch

    from paged_attention import runtime
    from paged_attention.model.llama import resolve_dtype
    if not a.smoke and not runtime.HAS_CUDA:
        print("needs an NVIDIA GPU (or --smoke for a check that the script runs)", file=sys.stderr)
        return 2
    dtype = resolve_dtype(a.dtype or ("fp32" if a.smoke else "bf16"))
    Ms = [int(m) for m in a.m.split(",")] if a.m else ([1, 3, 17] if a.smoke else [1, 2, 4, 8, 16, 32, 64, 128, 256])
    device = runtime.DEVICE
    print(f"device: {runtime.device_name()}  torch {torch.__version__}  dtype {dtype}  "
          f"{'(smoke: interpreter, times meaningless)' if a.smoke else ''}")
    if not a.smoke:
        from paged_attention.bench import timing
        timing.warm_up()
    run_table(Ms, dtype, device, a.smoke)
    if a.sweep:
        run_sweep(Ms, dtype, device, a.smoke)
    return 0


if __name__ == "__main__":
    sys.exit(main())
