"""A request as the V1 core sees it: token ids, how many are computed, and its block hashes.

vLLM's ``Request`` (``vllm/v1/request.py``) carries much more (multimodal inputs, structured
output, LoRA, KV transfer); this one keeps its constructor's shape and what the KV-cache
manager and the scheduler read. Its ``block_hashes`` grow by themselves: the ``block_hasher``
given at construction is called on the prompt and again whenever output tokens are appended,
and hashes every newly full block.
"""
from __future__ import annotations

import enum
import math
import operator
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from paged_attention.utils import is_int

# A block hash is kv_cache_utils.BlockHash, i.e. bytes; named by its type here so that the request
# does not import the hashing module back (the hashing module reads requests).
BlockHash = bytes


class FinishReason(enum.IntEnum):
    """Why a request ended, as the API reports it."""

    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3
    REPETITION = 4

    def __str__(self) -> str:
        return self.name.lower()


class RequestStatus(enum.IntEnum):
    """Where a request is. Every status after ``PREEMPTED`` means finished."""

    WAITING = enum.auto()
    WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    WAITING_FOR_STREAMING_REQ = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()
    FINISHED_ERROR = enum.auto()
    FINISHED_REPETITION = enum.auto()

    def __str__(self) -> str:
        return self.name

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: RequestStatus) -> FinishReason | None:
        return _FINISHED_REASONS.get(status)


# An ignored request (a prompt longer than the model allows) reports "length", as OpenAI's API.
_FINISHED_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_IGNORED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
    RequestStatus.WAITING_FOR_STREAMING_REQ: FinishReason.STOP,
    RequestStatus.FINISHED_REPETITION: FinishReason.REPETITION,
}


class ConstantList(Sequence):
    """A read-only view of a list (no copy): the request's token ids as others see them."""

    def __init__(self, items: list) -> None:
        self._items = items

    def __getitem__(self, index):
        return self._items[index]

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self):
        return iter(self._items)

    def __eq__(self, other: object) -> bool:
        return list(self._items) == list(other) if isinstance(other, Sequence) else NotImplemented

    def __repr__(self) -> str:
        return f"ConstantList({self._items!r})"


def _int_list(token_ids: Any) -> list[int] | None:
    """``token_ids`` (a list or tuple) as a new list of plain ints, or None if it is not one
    or holds something else than ints (a bool is not a token id)."""
    if not isinstance(token_ids, (list, tuple)):
        return None
    ids = list(token_ids)
    # The common case, all plain ints, is checked in C: a prompt can have many thousand tokens.
    if operator.countOf(map(type, ids), int) == len(ids):
        return ids
    return [int(t) for t in ids] if all(is_int(t) for t in ids) else None


class Request:
    """One generation request.

    ``sampling_params`` is any object with an int ``max_tokens`` (the engine's
    ``SamplingParams``, or vLLM's); ``pooling_params`` must be None (pooling models are not
    modelled). ``lora_request`` (with ``lora_name`` and ``lora_path``) and ``cache_salt`` enter
    the block hashes, so that different adapters or salts never share cached blocks.
    """

    # Slots for what the constructor sets: the scheduler reads and writes a dozen of these per
    # request and step, and CPython keeps the attributes of an object with more than 30 of them
    # in a plain dict (slower to reach than a slot). ``__dict__`` stays, for attributes set
    # from outside.
    __slots__ = (
        "request_id", "client_index", "priority", "sampling_params", "pooling_params",
        "lora_request", "cache_salt", "trace_headers", "arrival_time", "max_tokens", "status",
        "stop_reason", "events", "prompt_token_ids", "num_prompt_tokens", "_output_token_ids",
        "_all_token_ids", "num_computed_tokens", "num_output_placeholders",
        "num_stale_output_tokens", "drop_stale_output", "num_in_flight_tokens", "spec_token_ids",
        "is_prefill_chunk", "num_preemptions", "shared_prefix_boundary",
        "num_cache_checked_blocks", "skip_reading_prefix_cache", "_output_view", "_all_view",
        "block_hashes", "_block_hasher", "_hash_block_size", "_next_hash_at", "__dict__",
        "__weakref__",
    )

    def __init__(self, request_id: str, prompt_token_ids: Sequence[int] | None,
                 sampling_params: Any, pooling_params: Any, client_index: int = 0,
                 arrival_time: float | None = None, prompt_embeds: Any = None,
                 mm_features: list | None = None, lora_request: Any = None,
                 cache_salt: str | None = None, priority: int = 0,
                 trace_headers: Mapping[str, str] | None = None,
                 block_hasher: Callable[[Request], list[BlockHash]] | None = None) -> None:
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {request_id!r}")
        if prompt_embeds is not None or mm_features:
            raise ValueError("prompt embeddings and multimodal inputs are not modelled")
        if pooling_params is not None:
            raise ValueError("pooling requests are not modelled: pooling_params must be None")
        max_tokens = getattr(sampling_params, "max_tokens", None)
        if not is_int(max_tokens) or max_tokens < 0:
            raise ValueError("sampling_params with an int max_tokens >= 0 is needed, got "
                             f"{sampling_params!r}")
        ids = _int_list(prompt_token_ids)
        if ids is None:
            raise TypeError("prompt_token_ids must be a list of ints")
        if not ids:
            raise ValueError("the prompt must have at least one token")
        if block_hasher is not None and not callable(block_hasher):
            raise TypeError(f"block_hasher must be callable, got {block_hasher!r}")
        self.request_id = request_id
        self.client_index = client_index
        self.priority = priority
        self.sampling_params = sampling_params
        self.pooling_params = None
        self.lora_request = lora_request
        self.cache_salt = cache_salt
        self.trace_headers = trace_headers
        self.arrival_time = arrival_time if arrival_time is not None else time.time()
        self.max_tokens = max_tokens
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.events: list = []

        self.prompt_token_ids = ids
        self.num_prompt_tokens = len(ids)
        self._output_token_ids: list[int] = []
        self._all_token_ids: list[int] = ids.copy()
        # Tokens whose KV is in the cache (or scheduled to be, this step).
        self.num_computed_tokens = 0
        # Asynchronous scheduling: tokens sampled on the device but not yet known here.
        self.num_output_placeholders = 0
        self.num_stale_output_tokens = 0
        self.drop_stale_output = False
        # Tokens scheduled in steps whose output has not come back yet.
        self.num_in_flight_tokens = 0
        self.spec_token_ids: list[int] = []
        self.is_prefill_chunk = False
        self.num_preemptions = 0
        # Hybrid models: a shared prefix to keep cached in every group (0: none).
        self.shared_prefix_boundary = 0
        # Async scheduling: the whole hash blocks of computed tokens the scheduler last asked
        # the KV-cache manager to cache after an output (0 again once it loses its blocks).
        self.num_cache_checked_blocks = 0
        self.skip_reading_prefix_cache = bool(
            getattr(sampling_params, "skip_reading_prefix_cache", False) or False)

        # Read-only views of the two lists (made once: the lists are only ever extended).
        self._output_view = ConstantList(self._output_token_ids)
        self._all_view = ConstantList(self._all_token_ids)

        self.block_hashes: list[BlockHash] = []
        self._block_hasher = block_hasher
        # Tokens per hashed block, where the hasher says (ours does): appending a token then
        # calls it only when a block may have filled, at _next_hash_at tokens. None: call it
        # after every append.
        self._hash_block_size: int | None = getattr(block_hasher, "hash_block_size", None)
        self._next_hash_at: float = math.inf      # no hasher: never
        self.update_block_hashes()

    # Read-only views: appending goes through append_output_token_ids, which rehashes.
    @property
    def output_token_ids(self) -> ConstantList:
        return self._output_view

    @property
    def all_token_ids(self) -> ConstantList:
        return self._all_view

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self._all_token_ids) + len(self.spec_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._output_token_ids)

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        """Append sampled tokens (one or a list), and hash any block they fill."""
        if type(token_ids) is int:
            # One sampled token, the common case: no list to build and check, and no call to
            # the hasher unless the token may have filled a block.
            self._output_token_ids.append(token_ids)
            all_ids = self._all_token_ids
            all_ids.append(token_ids)
            if len(all_ids) >= self._next_hash_at:
                self.update_block_hashes()
            return
        new = [token_ids] if is_int(token_ids) else list(token_ids)
        if not all(is_int(t) for t in new):
            raise TypeError(f"token ids must be ints, got {token_ids!r}")
        self._output_token_ids.extend(int(t) for t in new)
        self._all_token_ids.extend(int(t) for t in new)
        self.update_block_hashes()

    def update_block_hashes(self) -> None:
        """Hash the blocks that became full since the last call."""
        if self._block_hasher is not None:
            self.block_hashes.extend(self._block_hasher(self))
            every = self._hash_block_size
            self._next_hash_at = (len(self.block_hashes) + 1) * every if every else 0

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> FinishReason | None:
        return RequestStatus.get_finished_reason(self.status)

    def take_events(self) -> list | None:
        if not self.events:
            return None
        events, self.events = self.events, []
        return events

    def __lt__(self, other: Request) -> bool:
        """Priority order: lower ``priority`` first, then earlier arrival, then id."""
        return ((self.priority, self.arrival_time, self.request_id)
                < (other.priority, other.arrival_time, other.request_id))

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.num_tokens} tokens, "
                f"{self.num_computed_tokens} computed, {self.status})")
