"""How to pick each next token: vLLM's ``SamplingParams``, the part a small engine needs.

``temperature=0`` is greedy decoding (the most likely token, every time), and so is any
temperature below ``1e-5``, as in vLLM: dividing the logits by so small a number overflows
float32 and leaves no distribution to draw from. Above that the logits are divided by the
temperature and a token is drawn from their softmax; ``top_p < 1`` first keeps only the smallest
set of most likely tokens whose probabilities add up to ``top_p`` (never fewer than one). A
request with a ``seed`` draws from its own random generator, so its output does not depend on
what else is in the batch; one without draws from torch's global generator, as in vLLM, so
``torch.manual_seed`` makes a whole ``generate`` call reproducible.

A request stops at an end token (the model's end-of-sequence token, unless ``ignore_eos``, and
any of ``stop_token_ids``: finish reason ``"stop"``, the token kept in the output as Hugging Face
and vLLM keep it), after ``max_tokens`` tokens, or when it reaches the model's context length
(both ``"length"``).

Every field is checked when the params are made, and again (``verify``) when a request is
added to the engine, which keeps a checked copy: a field changed in between cannot slip a bad
value past the checks, and a change after that does not reach the running request.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from paged_attention.utils import check_int, is_int

# Below this temperature a request is greedy (vLLM's threshold, ``_SAMPLING_EPS``).
SAMPLING_EPS = 1e-5
# torch's generators take a seed of 64 bits.
MAX_SEED = 2**64 - 1


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 16
    seed: Optional[int] = None
    stop_token_ids: Optional[list[int]] = field(default=None)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        self.verify()

    def verify(self) -> None:
        """Check every field (``TypeError`` for a wrong type, ``ValueError`` for a wrong value)
        and normalise it in place: floats for the two real numbers, a fresh list of ints for
        ``stop_token_ids``. Running it twice changes nothing."""
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
                raise TypeError(f"{name} must be a real number, got {value!r}")
            try:
                number = float(value)
            except OverflowError:                 # an int beyond float's range
                number = math.inf
            if not math.isfinite(number):
                raise ValueError(f"{name} must be finite, got {value!r}")
            setattr(self, name, number)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (below {SAMPLING_EPS} is greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        self.max_tokens = check_int("max_tokens", self.max_tokens, 1)
        if self.seed is not None:
            self.seed = check_int("seed", self.seed, 0)
            if self.seed > MAX_SEED:
                raise ValueError(f"seed must be < 2**64 (a generator's seed has 64 bits), got {self.seed}")
        if self.stop_token_ids is not None:
            if isinstance(self.stop_token_ids, (str, bytes)) or not hasattr(self.stop_token_ids, "__iter__"):
                raise TypeError(f"stop_token_ids must be a list of ints, got {self.stop_token_ids!r}")
            ids = list(self.stop_token_ids)
            if not all(is_int(t) for t in ids):
                raise TypeError(f"stop_token_ids must be a list of ints, got {self.stop_token_ids!r}")
            self.stop_token_ids = [int(t) for t in ids]
        if not isinstance(self.ignore_eos, (bool, np.bool_)):
            raise TypeError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        self.ignore_eos = bool(self.ignore_eos)

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS
