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


def kv_cache_strides(layout, num_blocks, block_size, num_kv_heads, head_size):
    token, head = (num_kv_heads * head_size, head_size) if layout == "NHD" else (head_size, block_size * head_size)
    block = block_size * num_kv_heads * head_size
    return (num_blocks * block, block, token, head, 1)


import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _slots_kernel(table_ptr, req_ptr, pos_ptr, out_ptr, num_tokens, table_stride, BLOCK_SIZE: tl.constexpr,
                  TILE: tl.constexpr):
    offs = tl.program_id(0) * TILE + tl.arange(0, TILE)
    mask = offs < num_tokens
    req = tl.load(req_ptr + offs, mask=mask, other=0)
    pos = tl.load(pos_ptr + offs, mask=mask, other=0)
    block = tl.load(table_ptr + req * table_stride + pos // BLOCK_SIZE, mask=mask, other=0)
    tl.store(out_ptr + offs, block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE, mask=mask)


def triton_slot_mapping(block_table, req_indices, positions, block_size):
    out = torch.empty(positions.shape[0], dtype=torch.int64, device=positions.device)
    tile = 128
    _slots_kernel[(triton.cdiv(positions.shape[0], tile),)](block_table, req_indices, positions, out,
                                                            positions.shape[0], block_table.stride(0),
                                                            BLOCK_SIZE=block_size, TILE=tile)
    return out


def append_token(table, num_tokens, block_size, refcounts, free_ids):
    table = list(table)
    if num_tokens % block_size == 0:                     # no room: a new block
        new = free_ids.pop(0)
        refcounts[new] = 1
        return table + [new], None
    last = table[-1]
    if refcounts[last] == 1:                             # ours alone: write in place
        return table, None
    new = free_ids.pop(0)                                # shared: copy on write
    refcounts[last] -= 1
    refcounts[new] = 1
    table[-1] = new
    return table, (last, new)


def free_table(table, refcounts, free_ids):
    for block in table:
        refcounts[block] -= 1
        if refcounts[block] == 0:
            free_ids.insert(0, block)


def decode_step(num_tokens, block_size, num_free_blocks):
    free, queue, decoded, preempted = num_free_blocks, list(range(len(num_tokens))), [], []
    while queue:
        i = queue.pop(0)
        while free < 1:                                  # the block its token goes into, an upper bound
            victim = queue.pop() if queue else i         # the newest running request
            preempted.append(victim)
            free += math.ceil((num_tokens[victim] - 1) / block_size)
            if victim == i:
                break
        else:
            if (num_tokens[i] - 1) % block_size == 0:    # the new token starts a block
                free -= 1
            decoded.append(i)
    return decoded, preempted


def find_longest_cache_hit(block_hashes, cached_blocks, max_length, block_size):
    num_blocks = 0
    while (num_blocks < min(len(block_hashes), max_length // block_size)
           and block_hashes[num_blocks] in cached_blocks):
        num_blocks += 1                                  # a prefix: stop at the first miss
    hit = [cached_blocks[h][0] for h in block_hashes[:num_blocks]]      # the oldest of each
    return hit, num_blocks * block_size
