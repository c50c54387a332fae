# ruff: noqa: F821  (a lab cell: the name comes from the notebook's import cell)
# np comes from the notebook's first code cell.
def compute_slot_mapping(block_table, req_indices, positions, block_size):
    blocks = block_table[req_indices, positions // block_size].astype(np.int64)
    return blocks * block_size + positions % block_size
