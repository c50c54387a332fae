"""From a step's logits to one token per request.

Greedy requests take the argmax. The others are drawn from ``softmax(logits / temperature)``,
after top-p filtering, with their own generator when they have a seed and from torch's global
generator when they do not (vLLM's rule). All rows' tokens come back to the host in one read, the
only one of a decode step: the scheduler needs them to go on.
"""
from __future__ import annotations

from typing import Optional

import torch

from paged_attention.engine.sampling_params import SamplingParams


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the most likely tokens until their probabilities reach ``top_p`` (at least one),
    zero the rest. ``probs``: one row, summing to 1."""
    if top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(descending=True)
    # A token is kept if the tokens more likely than it add up to less than top_p. The most
    # likely one always is: a top_p too small for the row's dtype (1e-46 is 0 in float32) would
    # otherwise keep nothing, and there would be nothing to draw.
    keep_sorted = (sorted_probs.cumsum(-1) - sorted_probs) < top_p
    keep_sorted[..., 0] = True
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    return probs * keep


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[Optional[torch.Generator]]) -> list[int]:
    """One token id per row of ``logits`` ``[num_reqs, vocab]``, row ``i`` by ``params[i]``;
    ``generators[i]`` None draws from torch's global generator of the logits' device."""
    tokens = logits.argmax(dim=-1)
    for i, p in enumerate(params):
        if p.greedy:
            continue
        probs = torch.softmax(logits[i].float() / p.temperature, dim=-1)
        probs = top_p_filter(probs, p.top_p)
        tokens[i] = torch.multinomial(probs, 1, generator=generators[i])[0]
    return tokens.tolist()
