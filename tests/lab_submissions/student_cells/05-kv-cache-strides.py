def kv_cache_strides(layout, num_blocks, block_size, num_kv_heads, head_size):
    if layout == "NHD":
        token, head = num_kv_heads * head_size, head_size
    else:
        token, head = head_size, block_size * head_size
    block = block_size * num_kv_heads * head_size
    return (num_blocks * block, block, token, head, 1)
