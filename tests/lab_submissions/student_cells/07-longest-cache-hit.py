def find_longest_cache_hit(block_hashes, cached_blocks, max_length, block_size):
    hit = []
    for block_hash in block_hashes[:max_length // block_size]:
        if not cached_blocks.get(block_hash):
            break
        hit.append(cached_blocks[block_hash][0])
    return hit, len(hit) * block_size
