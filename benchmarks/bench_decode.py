"""Decode-attention bandwidth of the Triton kernel, as a fraction of a device-to-device copy.

Usage (GPU machine):  python benchmarks/bench_decode.py [--sweep | --cuda | --calls]
Prints one row per (batch, context) of the decode targets, with a shuffled and an identity block
table. ``--sweep`` tries launch shapes and split counts instead (for tuning the defaults);
``--cuda`` times our CUDA paged_attention_v1/v2 next to the Triton kernel; ``--calls`` times
each call as a user makes it (eager, CUDA-graph replay, host time) for ours, vLLM's FA3 and vLLM's
own Triton kernel, and the cache write. The workloads and
timers are ``paged_attention.bench.decode``'s.
"""
import argparse
import sys

import torch

import paged_attention  # noqa: F401  (device policy first)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="tune launch shapes and split counts")
    parser.add_argument("--smollm", action="store_true",
                        help="with --sweep: SmolLM2-135M's attention at the engine benchmark's batch sizes")
    parser.add_argument("--cuda", action="store_true", help="CUDA v1/v2 against Triton (v0 layout)")
    parser.add_argument("--calls", action="store_true",
                        help="eager / graph / host time per call: ours, vLLM's FA3 and vLLM's Triton kernel")
    opts = parser.parse_args()
    if not torch.cuda.is_available():
        print("this benchmark needs an NVIDIA GPU (on a CPU the Triton interpreter says nothing about speed)")
        return 1
    from paged_attention.bench import decode
    if opts.sweep and opts.smollm:
        decode.sweep(decode.SMOLLM2_SHAPES, model=decode.SMOLLM2_MODEL)
    elif opts.sweep:
        decode.sweep()
    elif opts.calls:
        decode.calls_table()
        decode.cache_write_calls()
    elif opts.cuda:
        decode.cuda_attention_table()
    else:
        decode.decode_table()
    return 0


if __name__ == "__main__":
    sys.exit(main())
