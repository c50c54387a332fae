"""KV-cache specs, backend layouts, allocation and reshape (spec §4).

The submodules are imported on demand: ``paged_attention.kv_cache.interface``,
``paged_attention.kv_cache.backends`` and ``paged_attention.kv_cache.attn_utils``.
"""
