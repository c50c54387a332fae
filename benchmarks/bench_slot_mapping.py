"""v1 slot mapping: ``BlockTable.compute_slot_mapping`` (numpy) against a plain Python loop.

Usage (any machine):  python benchmarks/bench_slot_mapping.py
Prints, for more and more requests of 16 tokens and then for 8 requests of more and more
tokens, the time per call of each and their ratio. The work is host-side numpy and Python, so
the figures are the CPU's (named in the first line), whether or not there is a GPU. The workloads
are ``paged_attention.bench.slot_mapping``'s.
"""
import sys

import paged_attention  # noqa: F401  (device policy first)


def main() -> int:
    from paged_attention.bench import slot_mapping, timing
    print(f"host CPU: {timing.cpu_name()}")
    print("more requests, 16 tokens each:")
    slot_mapping.slot_mapping_times(slot_mapping.SLOT_MAPPING_BATCH_SWEEP)
    print("8 requests, more tokens each:")
    slot_mapping.slot_mapping_times(slot_mapping.SLOT_MAPPING_TOKEN_SWEEP)
    return 0


if __name__ == "__main__":
    sys.exit(main())
