# Allocates without bound.
def slot_mapping(block_table, seq_lens, block_size):
    hoard = []
    while True:
        hoard.append(bytearray(256 << 20))
