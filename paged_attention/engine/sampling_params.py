"""How to pick each next token: vLLM's ``SamplingParams``, the part a small engine needs.

``temperature=0`` is greedy decoding (the most likely token, every time). Above zero the logits
are divided by the temperature and a token is drawn from their softmax; ``top_p < 1`` first keeps
only the smallest set of most likely tokens whose probabilities add up to ``top_p``. A request
with a ``seed`` draws from its own random generator, so its output does not depend on what else
is in the batch.

A request stops at an end token (the model's end-of-sequence token, unless ``ignore_eos``, and
any of ``stop_token_ids``: finish reason ``"stop"``, the token kept in the output as Hugging Face
and vLLM keep it), after ``max_tokens`` tokens, or when it reaches the model's context length
(both ``"length"``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from paged_attention.utils import check_int, is_int


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 16
    seed: Optional[int] = None
    stop_token_ids: Optional[list[int]] = field(default=None)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        # Every field is checked here, so that a request is refused before anything runs.
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{name} must be a real number, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"{name} must be finite, got {value!r}")
            setattr(self, name, float(value))
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        self.max_tokens = check_int("max_tokens", self.max_tokens, 1)
        if self.seed is not None:
            self.seed = check_int("seed", self.seed, 0)
        if self.stop_token_ids is not None:
            if isinstance(self.stop_token_ids, (str, bytes)) or not hasattr(self.stop_token_ids, "__iter__"):
                raise TypeError(f"stop_token_ids must be a list of ints, got {self.stop_token_ids!r}")
            ids = list(self.stop_token_ids)
            if not all(is_int(t) for t in ids):
                raise TypeError(f"stop_token_ids must be a list of ints, got {self.stop_token_ids!r}")
            self.stop_token_ids = [int(t) for t in ids]
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
