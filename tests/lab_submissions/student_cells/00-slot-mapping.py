def slot_mapping(block_table, seq_lens, block_size):
    slots = []
    for s, n in enumerate(seq_lens):
        for t in range(n):
            slots.append(block_table[s][t // block_size] * block_size + t % block_size)
    return slots
