"""Two helpers of the scheduler (vLLM's ``vllm/v1/core/sched/utils.py``): when a request stops,
and removing several requests from the running list at once."""
from __future__ import annotations

from typing import TYPE_CHECKING

from paged_attention.v1.core.request import RequestStatus

if TYPE_CHECKING:
    from paged_attention.v1.core.request import Request


def check_stop(request: "Request", max_model_len: int) -> bool:
    """Whether the token just appended ends ``request``; if so its status says why.

    In this order: the end-of-sequence token (``FINISHED_STOPPED``), one of its stop tokens
    (``FINISHED_STOPPED``, with the token as ``stop_reason``), then its length: ``max_tokens``
    generated or the model's context full (``FINISHED_LENGTH_CAPPED``). The stopping token
    stays in the output. The end and stop tokens are the sampling parameters'
    ``eos_token_id`` and ``stop_token_ids``, where they have them (None: no such token).
    """
    params = request.sampling_params
    # Called for every sampled token: the request's lists are read directly, not through its
    # read-only views and properties.
    output = request._output_token_ids
    last_token_id = output[-1]
    if last_token_id == getattr(params, "eos_token_id", None):
        request.status = RequestStatus.FINISHED_STOPPED
        return True
    stop_token_ids = getattr(params, "stop_token_ids", None)
    if stop_token_ids and last_token_id in stop_token_ids:
        request.status = RequestStatus.FINISHED_STOPPED
        request.stop_reason = last_token_id
        return True
    if len(request._all_token_ids) >= max_model_len or len(output) >= request.max_tokens:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False


def remove_all(requests: list, to_remove: set) -> list:
    """``requests`` without those in ``to_remove``, in order. One removal (the common case)
    edits the list in place; more build a new one: use the returned list either way."""
    if not to_remove:
        return requests
    if len(to_remove) == 1:
        item = next(iter(to_remove))
        if item in requests:
            requests.remove(item)
        return requests
    return [r for r in requests if r not in to_remove]
