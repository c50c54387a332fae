def free_table(table, refcounts, free_ids):
    for block in table:
        refcounts[block] -= 1
        if refcounts[block] == 0:
            free_ids.insert(0, block)
