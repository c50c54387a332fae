# Hands in the library's own slot mapping.
from paged_attention.utils import slot_mapping as _library


def slot_mapping(block_table, seq_lens, block_size):
    return _library(block_table, seq_lens, block_size)
