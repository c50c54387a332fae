"""v2 block tables on the GPU: vLLM's kernels against ours, and v2's step against v1's.

Usage (GPU machine):  python benchmarks/bench_v2_block_tables.py [--sweep] [--whole-path]
Prints, with the GPU's name:
* [1] gather_block_tables and compute_slot_mappings alone, each kernel set (do_bench: median GPU
  time, and the same call replayed from a CUDA graph), for 1024 requests of one group with 16
  tokens each (16384 tokens) and with 1 token each (pure decode, 1024 tokens);
* [2] the whole per-step v2 path with two groups (block sizes 16 and 32) at 1024 requests /
  16384 tokens: apply of all groups' staged writes + gather + slot mappings, the device launches,
  eager, replayed from a CUDA graph, and with the host's launch work hidden ("queued"); vLLM's
  kernels, ours, and ours with the gather and slots fused in one launch; and a real step (host
  staging included) on the wall clock;
* [3] v1's step (append_row, numpy slot mapping, pinned host-to-device copies) next to v2's for
  batch sizes 8 ... 1024, decoding one token per request, on the wall clock.
``--whole-path`` prints only the launch floor and [2]. ``--sweep`` also tries launch shapes of
our kernels (tile sizes; in [2], the staged writes' launch captured in a CUDA graph). Every
configuration is verified against numpy before it is timed. The workloads and the report are
``paged_attention.bench.v2_tables``'s.
"""
import argparse
import sys

import torch

import paged_attention  # noqa: F401  (device policy first)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also sweep our kernels' tile sizes")
    parser.add_argument("--whole-path", action="store_true",
                        help="only the launch floor and the whole per-step path (section [2])")
    opts = parser.parse_args()
    if not torch.cuda.is_available():
        print("this benchmark needs an NVIDIA GPU (on a CPU the Triton interpreter says nothing about speed)")
        return 1
    import triton

    from paged_attention.bench import timing, v2_tables
    print(f"GPU: {torch.cuda.get_device_name()}  (torch {torch.__version__}, triton {triton.__version__})", flush=True)
    timing.warm_up()
    v2_tables.report(sweep=opts.sweep, whole_path_only=opts.whole_path,
                     print_fn=lambda line: print(line, flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
