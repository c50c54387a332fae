"""KV-cache specs, backend layouts, allocation and reshape: how vLLM turns memory into KV caches.

The submodules are imported on demand: ``paged_attention.kv_cache.interface``,
``paged_attention.kv_cache.backends`` and ``paged_attention.kv_cache.attn_utils``.
"""
