def can_allocate(num_required_blocks, num_free_blocks, num_total_blocks, watermark_blocks):
    if num_total_blocks - num_required_blocks < watermark_blocks:
        return "NEVER"
    if num_free_blocks - num_required_blocks >= watermark_blocks:
        return "OK"
    return "LATER"
