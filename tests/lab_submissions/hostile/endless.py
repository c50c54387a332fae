def slot_mapping(block_table, seq_lens, block_size):
    while True:
        pass
