"""The messages around a step: what the model runner answers (vLLM's ``ModelRunnerOutput``,
``vllm/v1/outputs.py``) and what ``Scheduler.update_from_output`` hands the engine (vLLM's
``EngineCoreOutput`` and ``EngineCoreOutputs``, ``vllm/v1/engine/__init__.py``).

The runner answers with one list of sampled token ids per request it ran, indexed through
``req_id_to_index``; a request whose prefill is not finished yet samples nothing (an empty list).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union


@dataclass
class ModelRunnerOutput:
    """``sampled_token_ids[req_id_to_index[req_id]]``: the tokens sampled for ``req_id`` this
    step (one without speculative decoding; none while its prompt is still being prefilled)."""

    req_ids: list[str]
    req_id_to_index: dict[str, int]
    sampled_token_ids: list[list[int]] = field(default_factory=list)


@dataclass(slots=True)      # one per request and step: slots make it cheaper to build
class EngineCoreOutput:
    """One request's news from a step: its new tokens and, if it finished, why.

    ``finish_reason`` is None while the request goes on; ``stop_reason`` is the stop token that
    ended it, if one did.
    """

    request_id: str
    new_token_ids: list[int]
    finish_reason: Any = None
    stop_reason: Union[int, str, None] = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class EngineCoreOutputs:
    """A step's outputs for one client (an API front end), and the requests that finished."""

    outputs: list[EngineCoreOutput] = field(default_factory=list)
    finished_requests: Optional[set[str]] = None
