"""The V1 KV-cache manager and scheduler: ours against vLLM 0.33's own classes, side by side.

Usage (any machine, CPU only):  python benchmarks/bench_v1_core.py [--rounds N]
                                    [--only manager|scheduler]
Needs vLLM's core files (``python tools/vllm_kernels.py fetch-core``). Prints the machine, then
one line per workload: our time, vLLM's, and the ratio vLLM / ours (above 1.0: ours is faster).
The lines: building requests (block hashes), three manager traces (one group with and without
prefix caching; full attention with a sliding window), five scheduler workloads (a roomy pool;
a tight one that preempts; chunked prefill under a small budget; the async scheduler; full
attention with a sliding window). Both sides' answers are compared before anything is timed.
The workloads, the timing and the report are ``paged_attention.bench.v1_core``'s.
"""
import argparse
import sys


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5,
                        help="alternating runs per side and line (the fastest counts)")
    parser.add_argument("--only", choices=("manager", "scheduler"),
                        help="only the manager lines (requests included) or the scheduler lines")
    opts = parser.parse_args()
    if opts.rounds < 1:
        parser.error("--rounds must be >= 1")

    from paged_attention.bench import v1_core
    from paged_attention.v1.core import oracle

    ok, why = oracle.available()
    if not ok:
        print(f"vLLM's core is not available: {why}")
        return 1
    what = (opts.only,) if opts.only else ("manager", "scheduler")
    lines = v1_core.report(rounds=opts.rounds, what=what,
                           print_fn=lambda line: print(line, flush=True))
    slower = [line.name for line in lines if line.ratio < 1.0]
    print("every line >= 1.0x" if not slower else f"below 1.0x: {', '.join(slower)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
