"""Decode-attention bandwidth of the Triton kernel, as a fraction of a device-to-device copy.

Usage (GPU machine):  python benchmarks/bench_decode.py [--sweep | --cuda | --l2-hint]
Prints one row per (batch, context) of issue 2's targets, with a shuffled and an identity block
table. ``--sweep`` tries launch shapes and split counts instead (for tuning the defaults);
``--cuda`` times our CUDA paged_attention_v1/v2 next to the Triton kernel (issue 3's table);
``--l2-hint`` times the default launch against an unpipelined one with an evict-first L2 hint,
with a dirty and a clean L2 (``choose_launch`` explains the trade).
"""
import argparse
import sys

import torch

import paged_attention  # noqa: F401  (device policy first)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="tune launch shapes and split counts")
    parser.add_argument("--cuda", action="store_true", help="CUDA v1/v2 against Triton (v0 layout)")
    parser.add_argument("--l2-hint", action="store_true", help="evict-first hint against the pipeline, dirty and clean L2")
    opts = parser.parse_args()
    if not torch.cuda.is_available():
        print("this benchmark needs an NVIDIA GPU (on a CPU the Triton interpreter says nothing about speed)")
        return 1
    from paged_attention import bench
    if opts.sweep:
        bench.sweep()
    elif opts.cuda:
        bench.cuda_attention_table()
    elif opts.l2_hint:
        bench.l2_hint_table()
    else:
        bench.decode_table()
    return 0


if __name__ == "__main__":
    sys.exit(main())
