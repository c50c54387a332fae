def append_token(table, num_tokens, block_size, refcounts, free_ids):
    table = list(table)
    if num_tokens % block_size == 0:          # the last block is full (or there is none)
        new = free_ids.pop(0)
        refcounts[new] = 1
        return table + [new], None
    last = table[-1]
    if refcounts[last] == 1:                  # ours alone: write in place
        return table, None
    new = free_ids.pop(0)                     # shared: copy on write
    refcounts[last] -= 1
    refcounts[new] = 1
    table[-1] = new
    return table, (last, new)
