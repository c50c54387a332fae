"""vLLM's V1 KV-cache core, mirrored."""
