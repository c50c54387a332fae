"""Start a few processes joined in one ``torch.distributed`` group, and collect what they return.

A reader meets decode context parallelism on several GPUs, one process per GPU, talking through
``torch.distributed`` collectives. ``spawn`` makes such a group on one machine, for a test, a
notebook or a benchmark:

* ``torch.multiprocessing``'s *spawn* start method: every rank is a fresh Python process that
  imports what it needs (a forked copy of a notebook kernel, with its threads and CUDA state, is
  not safe), so the function it runs must be importable by name (a library or script function,
  not a lambda or a function defined in a notebook cell);
* a rendezvous on a free TCP port of 127.0.0.1, chosen by the operating system;
* the ``nccl`` backend when every rank can have a GPU of its own (rank ``r`` uses ``cuda:r``),
  else ``gloo`` on the CPU.

Each rank calls ``fn(rank, world_size, *args)``; its return value (small, CPU-side, picklable)
comes back to the caller, in rank order. An exception in any rank is raised in the caller
(``torch.multiprocessing.ProcessRaisedException``, with the rank's traceback), and the group is
taken down with it.
"""
from __future__ import annotations

import datetime
import os
import pickle
import socket
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from paged_attention.utils import check_int

BACKENDS = ("gloo", "nccl")


def free_port() -> int:
    """A TCP port of 127.0.0.1 that was free a moment ago (the OS picks it: bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_backend(world_size: int) -> str:
    """``nccl`` when there are at least ``world_size`` GPUs (and the CPU path is not forced),
    else ``gloo``."""
    from paged_attention import runtime

    if runtime.HAS_CUDA and dist.is_nccl_available() and torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo"


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, backend: str | None = None,
          timeout_s: float = 300.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` new processes that form the default
    ``torch.distributed`` group; return their results, ``results[rank]``.

    ``backend``: ``"gloo"`` (CPU tensors) or ``"nccl"`` (one GPU per rank, ``cuda:rank`` made
    current before ``fn`` runs); by default ``default_backend(world_size)``. ``timeout_s`` bounds
    each collective, so a rank that waits for a partner that died does not wait forever.
    """
    world_size = check_int("world_size", world_size, minimum=1)
    if not callable(fn):
        raise TypeError(f"fn must be a function, got {type(fn).__name__}")
    backend = default_backend(world_size) if backend is None else backend
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise ValueError(f"nccl needs one GPU per rank: {world_size} ranks, "
                         f"{torch.cuda.device_count()} GPU(s) here (use gloo on the CPU)")
    results = mp.get_context("spawn").SimpleQueue()
    context = mp.start_processes(
        _rank_main, args=(fn, world_size, free_port(), backend, timeout_s, results, args),
        nprocs=world_size, join=False, start_method="spawn")
    got: dict[int, Any] = {}
    # Read results while waiting, so that no rank blocks on a full pipe before it can exit.
    while not context.join(timeout=0.05):
        _drain(results, got)
    _drain(results, got)
    missing = [r for r in range(world_size) if r not in got]
    if missing:                        # every rank exited cleanly, yet some sent nothing back
        raise RuntimeError(f"ranks {missing} returned no result")
    return [got[r] for r in range(world_size)]


def _drain(results: Any, got: dict[int, Any]) -> None:
    while not results.empty():
        rank, blob = results.get()
        got[rank] = pickle.loads(blob)


def _rank_main(rank: int, fn: Callable[..., Any], world_size: int, port: int, backend: str,
               timeout_s: float, results: Any, args: tuple) -> None:
    """One rank: join the group, run ``fn``, send its result back, leave the group."""
    if backend == "gloo":
        # The ranks share the machine's cores: one thread each keeps them from fighting.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    else:
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
    try:
        result = fn(rank, world_size, *args)
        # Plain pickle (not torch's shared-memory reduction): the data travels by value and
        # stays readable after this process has exited.
        results.put((rank, pickle.dumps(result)))
    finally:
        dist.destroy_process_group()
