"""A small inference engine over the project's paged KV cache, with vLLM's interface.

Read in this order: ``sampling_params`` (how a token is chosen), ``outputs`` (what comes back),
``sampler``, ``tables`` (block lists to kernel inputs), ``cuda_graphs`` (decode steps replayed),
``llm_engine`` (the step loop over the legacy scheduler and block manager), ``llm`` (``LLM``:
``generate`` and ``chat``).
"""
from paged_attention.engine.llm import LLM
from paged_attention.engine.llm_engine import LLMEngine, StepStats
from paged_attention.engine.outputs import CompletionOutput, RequestOutput
from paged_attention.engine.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "StepStats", "SamplingParams", "RequestOutput", "CompletionOutput"]
