# Prints 200 MiB, then answers correctly.
import os

chunk = b"x" * (1 << 20)
for _ in range(200):
    os.write(1, chunk)


def slot_mapping(block_table, seq_lens, block_size):
    return [block_table[s][t // block_size] * block_size + t % block_size
            for s, n in enumerate(seq_lens) for t in range(n)]
