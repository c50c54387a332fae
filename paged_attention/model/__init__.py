"""A real language model served through the paged KV cache: SmolLM2-135M-Instruct (a Llama).

Read in this order: ``config`` (the model's shape), ``weights`` (the packaged GGUF file, or
random weights for a tiny model), ``tokenizer`` (text to token ids and the chat template),
``batch`` (what the engine tells a step), ``attention`` (how a layer writes and reads the paged
cache), ``llama`` (the forward pass), ``kv`` (allocating the caches), ``dense`` (a plain
contiguous-cache forward, the check that paging changes nothing).
"""
from paged_attention.model.attention import ATTENTION_IMPLS
from paged_attention.model.batch import ForwardBatch
from paged_attention.model.config import LlamaConfig
from paged_attention.model.kv import allocate_kv_caches, kv_cache_bytes_per_block
from paged_attention.model.llama import LlamaForCausalLM
from paged_attention.model.tokenizer import Tokenizer
from paged_attention.model.weights import load_gguf, packaged_model_path, random_weights

__all__ = ["ATTENTION_IMPLS", "ForwardBatch", "LlamaConfig", "LlamaForCausalLM", "allocate_kv_caches",
           "kv_cache_bytes_per_block", "load_gguf", "packaged_model_path", "random_weights", "Tokenizer"]
