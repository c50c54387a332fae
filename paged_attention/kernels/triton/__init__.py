"""Triton kernels over the flash-layout paged cache; compiled on a GPU, interpreted on a CPU."""
import paged_attention.runtime  # noqa: F401  (sets TRITON_INTERPRET before the kernels below)
from paged_attention.kernels.triton.cache import reshape_and_cache_flash
from paged_attention.kernels.triton.decode import choose_num_splits, paged_attention_decode
from paged_attention.kernels.triton.prefill import PrefillPlan, paged_attention_prefill

__all__ = ["reshape_and_cache_flash", "paged_attention_decode", "choose_num_splits", "paged_attention_prefill", "PrefillPlan"]
