import math


def decode_step(num_tokens, block_size, num_free_blocks):
    free, queue, decoded, preempted = num_free_blocks, list(range(len(num_tokens))), [], []
    while queue:
        i = queue.pop(0)
        while free < 1:
            victim = queue.pop() if queue else i
            preempted.append(victim)
            free += math.ceil((num_tokens[victim] - 1) / block_size)
            if victim == i:
                break
        else:
            if (num_tokens[i] - 1) % block_size == 0:
                free -= 1
            decoded.append(i)
    return sorted(decoded), sorted(preempted)
