"""What ``LLM.generate`` returns: vLLM's ``RequestOutput`` and ``CompletionOutput``, in input order."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class CompletionOutput:
    """One generated continuation: its tokens, their text, and why it ended (``"stop"``: an end
    token; ``"length"``: ``max_tokens`` or the model's context; ``"abort"``: the engine dropped it)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: Optional[str]


@dataclass
class RequestOutput:
    """One request's result. ``num_cached_tokens``: prompt tokens whose KV came from the prefix
    cache when the request was (last) admitted, so its prefill skipped them."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
