"""The waiting queue (vLLM's ``vllm/v1/core/sched/request_queue.py``).

Under first come, first served (the default) it is a deque: new requests join at the back, and a
preempted request is put back at the *front*, so it is the first to be admitted again. Under the
priority policy it is a heap ordered by ``(priority, arrival_time, request_id)`` (a smaller
priority value runs first); "putting back at the front" then just means pushing it again.
"""
from __future__ import annotations

import enum
import heapq
from collections import deque
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from paged_attention.v1.core.request import Request


class SchedulingPolicy(enum.Enum):
    FCFS = "fcfs"
    PRIORITY = "priority"


class RequestQueue:
    """What the scheduler asks of a waiting queue."""

    def add_request(self, request: "Request") -> None:
        raise NotImplementedError

    def pop_request(self) -> "Request":
        raise NotImplementedError

    def peek_request(self) -> "Request":
        raise NotImplementedError

    def prepend_request(self, request: "Request") -> None:
        raise NotImplementedError

    def prepend_requests(self, requests: Iterable["Request"]) -> None:
        raise NotImplementedError

    def remove_request(self, request: "Request") -> None:
        raise NotImplementedError

    def remove_requests(self, requests: Iterable["Request"]) -> None:
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def __bool__(self) -> bool:
        return len(self) > 0

    def __iter__(self) -> Iterator["Request"]:
        raise NotImplementedError


class FCFSRequestQueue(RequestQueue):
    """Arrival order; a preempted request goes back to the front."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add_request(self, request: "Request") -> None:
        self._queue.append(request)

    def pop_request(self) -> "Request":
        return self._queue.popleft()

    def peek_request(self) -> "Request":
        if not self._queue:
            raise IndexError("peek from an empty queue")
        return self._queue[0]

    def prepend_request(self, request: "Request") -> None:
        self._queue.appendleft(request)

    def prepend_requests(self, requests: Iterable["Request"]) -> None:
        # Each one goes to the front in turn, so they end up in reverse order: a caller that
        # collected skipped requests with appendleft gets them back in their original order.
        self._queue.extendleft(requests)

    def remove_request(self, request: "Request") -> None:
        self._queue.remove(request)

    def remove_requests(self, requests: Iterable["Request"]) -> None:
        gone = set(requests)
        kept = [r for r in self._queue if r not in gone]
        self._queue.clear()
        self._queue.extend(kept)

    def __len__(self) -> int:
        return len(self._queue)

    def __bool__(self) -> bool:
        return bool(self._queue)

    def __iter__(self) -> Iterator["Request"]:
        return iter(self._queue)


class PriorityRequestQueue(RequestQueue):
    """A heap of requests, smallest ``(priority, arrival_time, request_id)`` first."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, str, Request]] = []

    @staticmethod
    def _key(request: "Request") -> tuple[int, float, str, "Request"]:
        # Request ids are unique in a scheduler, so the request itself is never compared.
        return (request.priority, request.arrival_time, request.request_id, request)

    def add_request(self, request: "Request") -> None:
        heapq.heappush(self._heap, self._key(request))

    def pop_request(self) -> "Request":
        if not self._heap:
            raise IndexError("pop from an empty queue")
        return heapq.heappop(self._heap)[-1]

    def peek_request(self) -> "Request":
        if not self._heap:
            raise IndexError("peek from an empty queue")
        return self._heap[0][-1]

    def prepend_request(self, request: "Request") -> None:
        self.add_request(request)

    def prepend_requests(self, requests: Iterable["Request"]) -> None:
        for request in requests:
            self.add_request(request)

    def remove_request(self, request: "Request") -> None:
        self.remove_requests((request,))

    def remove_requests(self, requests: Iterable["Request"]) -> None:
        gone = {id(r) for r in requests}
        self._heap = [entry for entry in self._heap if id(entry[-1]) not in gone]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator["Request"]:
        return (entry[-1] for entry in sorted(self._heap))


def create_request_queue(policy: SchedulingPolicy) -> RequestQueue:
    if policy == SchedulingPolicy.PRIORITY:
        return PriorityRequestQueue()
    if policy == SchedulingPolicy.FCFS:
        return FCFSRequestQueue()
    raise ValueError(f"unknown scheduling policy {policy!r}")
