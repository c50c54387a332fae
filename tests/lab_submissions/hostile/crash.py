import os


def slot_mapping(block_table, seq_lens, block_size):
    os._exit(9)
