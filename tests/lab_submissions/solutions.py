# Reference solutions of every lab, written as a student would (no library calls).
import math

import numpy as np


def slot_mapping(block_table, seq_lens, block_size):
    return [block_table[s][t // block_size] * block_size + t % block_size
            for s, n in enumerate(seq_lens) for t in range(n)]


def can_allocate(num_required_blocks, num_free_blocks, num_total_blocks, watermark_blocks):
    if num_total_blocks - num_required_blocks < watermark_blocks:
        return "NEVER"
    if num_free_blocks - num_required_blocks >= watermark_blocks:
        return "OK"
    return "LATER"


def compute_slot_mapping(block_table, req_indices, positions, block_size):
    return block_table[req_indices, positions // block_size].astype(np.int64) * block_size + positions % block_size


def merge_partitions(max_logits, exp_sums, outputs):
    top = max(max_logits)
    w = [s * math.exp(m - top) for m, s in zip(max_logits, exp_sums)]
    return [sum(wi * o[d] for wi, o in zip(w, outputs)) / sum(w) for d in range(len(outputs[0]))]
