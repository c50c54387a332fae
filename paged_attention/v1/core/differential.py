"""Ours against vLLM's: the same random trace replayed on two KV-cache managers, compared after
every operation.

A trace is what a scheduler does to a manager, drawn at random from a seed: requests arrive
(prompts built from a few shared prefixes, so that prefix hits happen), are prefilled in
chunks, decode one token at a time, finish, are preempted (freed, then re-admitted from
scratch, hitting their own cached blocks), and now and then the prefix cache is reset.
``replay`` applies each operation to two managers built from the same config (ours, and vLLM's
own classes from ``oracle.load()``, or any pair with the same interface) and compares their
answers and their whole state after each: the hit length and blocks, the block ids of every
live request per group, the free count and the free queue in order, every block's reference
count and hash, and the cached-block map. The first difference is reported with the operation
that produced it.
"""
from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

from paged_attention.kv_cache.interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from paged_attention.v1.core import kv_cache_utils
from paged_attention.v1.core.kv_cache_coordinator import default_block_sizes
from paged_attention.v1.core.kv_cache_manager import KVCacheManager
from paged_attention.v1.core.request import Request, RequestStatus


@dataclass
class TraceConfig:
    """A KV-cache layout and a workload shape: ``groups`` is a list of ``("full", block_size)``
    or ``("window", block_size, sliding_window)``."""

    name: str
    groups: list[tuple]
    num_blocks: int
    max_model_len: int = 512
    num_prefixes: int = 4
    prefix_len: tuple[int, int] = (4, 40)
    suffix_len: tuple[int, int] = (1, 24)
    max_live: int = 6
    chunk: tuple[int, int] = (1, 24)
    max_tokens: int = 12
    enable_caching: bool = True

    def kv_cache_config(self) -> KVCacheConfig:
        return KVCacheConfig(self.num_blocks, [], [
            KVCacheGroupSpec([f"layer{i}"], _spec(FullAttentionSpec, SlidingWindowSpec, g))
            for i, g in enumerate(self.groups)])


def _spec(full_cls: type, window_cls: type, group: tuple) -> Any:
    common = dict(block_size=group[1], num_kv_heads=1, head_size=8, dtype=torch.float32)
    if group[0] == "full":
        return full_cls(**common)
    return window_cls(**common, sliding_window=group[2])


# --------------------------------------------------------------------------------------------
# The two sides
# --------------------------------------------------------------------------------------------

@dataclass
class Side:
    """One manager and how to make requests for it."""

    name: str
    manager: Any
    make_request: Callable[..., Any]
    statuses: Any  # the side's RequestStatus enum


def our_side(config: TraceConfig) -> Side:
    scheduler_block_size, hash_block_size = default_block_sizes(config.kv_cache_config())
    manager = KVCacheManager(config.kv_cache_config(), config.max_model_len,
                             scheduler_block_size, hash_block_size,
                             enable_caching=config.enable_caching, log_stats=True)
    kv_cache_utils.init_none_hash(kv_cache_utils.sha256)
    hasher = kv_cache_utils.get_request_block_hasher(hash_block_size, kv_cache_utils.sha256)

    def make(request_id: str, tokens: list[int]) -> Request:
        return Request(request_id, tokens, SimpleNamespace(max_tokens=config.max_tokens), None,
                       block_hasher=hasher)
    return Side("ours", manager, make, RequestStatus)


def vllm_side(o: SimpleNamespace, config: TraceConfig) -> Side:
    """vLLM's ``KVCacheManager`` for ``config`` (``o = oracle.load()``)."""
    kv_cache_config = o.KVCacheConfig(num_blocks=config.num_blocks, kv_cache_tensors=[],
                                      kv_cache_groups=[
        o.KVCacheGroupSpec([f"layer{i}"], _spec(o.FullAttentionSpec, o.SlidingWindowSpec, g))
        for i, g in enumerate(config.groups)])
    scheduler_block_size, hash_block_size = default_block_sizes(config.kv_cache_config())
    manager = o.KVCacheManager(kv_cache_config, max_model_len=config.max_model_len,
                               scheduler_block_size=scheduler_block_size,
                               hash_block_size=hash_block_size,
                               enable_caching=config.enable_caching, log_stats=True)
    o.init_none_hash(o.sha256)
    hasher = o.get_request_block_hasher(hash_block_size, o.sha256)
    params = o.SamplingParams(max_tokens=config.max_tokens)

    def make(request_id: str, tokens: list[int]) -> Any:
        return o.Request(request_id, tokens, params, None, block_hasher=hasher)
    return Side("vLLM", manager, make, o.RequestStatus)


# --------------------------------------------------------------------------------------------
# State, as plain data
# --------------------------------------------------------------------------------------------

def snapshot(manager: Any, request_ids: list[str]) -> dict[str, Any]:
    """Everything observable about ``manager``'s state, as plain data."""
    pool = manager.block_pool
    cached = {}
    for key, blocks in pool.cached_block_hash_to_block._cache.items():
        cached[key] = sorted(blocks) if isinstance(blocks, dict) else [blocks.block_id]
    return {
        "free count": pool.get_num_free_blocks(),
        "free queue": [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
        "ref counts": [b.ref_cnt for b in pool.blocks[1:]],
        "block hashes": [(b.block_hash, b.block_hash_num_tokens) for b in pool.blocks],
        "cached map": cached,
        "extra keys": {i: sorted(keys) for i, keys in pool.cached_block_hashes_by_block.items()
                       if keys},
        "block ids": {rid: [list(g) for g in manager.get_block_ids(rid)] for rid in request_ids},
        "usage": round(manager.usage, 12),
    }


def _answer(result: Any) -> Any:
    """A manager call's result as plain data (blocks become ids)."""
    if result is None or isinstance(result, (int, float, bool)):
        return result
    if isinstance(result, tuple):
        return tuple(_answer(r) for r in result)
    return [list(g) for g in result.get_block_ids()]


# --------------------------------------------------------------------------------------------
# The trace
# --------------------------------------------------------------------------------------------

@dataclass
class _Live:
    request_id: str
    tokens: list[int]
    requests: list[Any]
    started: bool = False
    hit: tuple[Any, ...] = field(default_factory=tuple)


class Mismatch(AssertionError):
    """The two managers disagreed; the message names the operation and the difference."""


def replay(config: TraceConfig, sides: list[Side], seed: int, num_ops: int,
           on_step: Callable[[int, str, list[dict]], None] | None = None) -> int:
    """Apply ``num_ops`` random operations (seeded) to every side; raise ``Mismatch`` at the
    first difference in an answer or in the state. Returns the number of operations applied.
    ``on_step(i, description, snapshots)`` sees each step (for drawings)."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1000) for _ in range(rng.randint(*config.prefix_len))]
                for _ in range(config.num_prefixes)]
    waiting: list[_Live] = []
    running: list[_Live] = []
    next_id = 0

    def call(what: str, fn: Callable[[Side, Any], Any], live: _Live | None) -> list[Any]:
        answers = [fn(side, live.requests[k] if live else None) for k, side in enumerate(sides)]
        plain = [_answer(a) for a in answers]
        if any(p != plain[0] for p in plain[1:]):
            raise Mismatch(f"{what}: {sides[0].name} answered {plain[0]}, "
                           f"{sides[1].name} answered {plain[1]}")
        return answers

    def compare(i: int, what: str) -> None:
        ids = [live.request_id for live in running]
        snaps = [snapshot(side.manager, ids) for side in sides]
        for key in snaps[0]:
            if any(s[key] != snaps[0][key] for s in snaps[1:]):
                raise Mismatch(f"operation {i} ({what}): {key} differs: {sides[0].name} "
                               f"{snaps[0][key]}, {sides[1].name} {snaps[1][key]}")
        if on_step is not None:
            on_step(i, what, snaps)

    def schedule(live: _Live, num_new: int) -> bool:
        """One chunk for ``live`` (its hit first, when it starts): whether it got slots."""
        reqs = live.requests
        if not live.started:
            answers = call(f"get_computed_blocks({live.request_id})",
                           lambda s, r: s.manager.get_computed_blocks(r), live)
            live.hit = tuple(answers)
            hit_tokens = answers[0][1]
            num_new = max(1, min(num_new, len(live.tokens) - hit_tokens))
            whole = rng.random() < 0.5
            results = call(f"allocate_slots({live.request_id}, {num_new}, hit {hit_tokens}, "
                           f"full_sequence_must_fit={whole})",
                           lambda s, r: s.manager.allocate_slots(
                               r, num_new, hit_tokens, live.hit[sides.index(s)][0],
                               full_sequence_must_fit=whole), live)
            if results[0] is None:
                return False
            live.started = True
            for side, r in zip(sides, reqs):
                r.num_computed_tokens = hit_tokens + num_new
                r.status = side.statuses.RUNNING
            return True
        left = reqs[0].num_tokens - reqs[0].num_computed_tokens
        num_new = max(1, min(num_new, left))
        results = call(f"allocate_slots({live.request_id}, {num_new})",
                       lambda s, r: s.manager.allocate_slots(r, num_new), live)
        if results[0] is None:
            return False
        for r in reqs:
            r.num_computed_tokens += num_new
        return True

    for i in range(num_ops):
        op = rng.random()
        if (op < 0.25 and len(running) < config.max_live) or not running and not waiting:
            prefix = rng.choice(prefixes)[:rng.randint(0, config.prefix_len[1])]
            tokens = prefix + [rng.randrange(1000) for _ in range(rng.randint(*config.suffix_len))]
            tokens = tokens[:config.max_model_len - config.max_tokens - 1]
            rid = f"r{next_id}"
            next_id += 1
            waiting.append(_Live(rid, tokens, [s.make_request(rid, tokens) for s in sides]))
            what = f"add {rid} ({len(tokens)} tokens)"
        elif op < 0.45 and waiting:
            live = waiting[0]
            if schedule(live, rng.randint(*config.chunk)):
                waiting.pop(0)
                running.append(live)
                what = f"admit {live.request_id}"
            else:
                what = f"admit {live.request_id}: no room"
        elif op < 0.85 and running:
            live = rng.choice(running)
            r0 = live.requests[0]
            if r0.num_computed_tokens == r0.num_tokens and r0.num_output_tokens >= \
                    config.max_tokens:
                running.remove(live)
                call(f"free({live.request_id})", lambda s, r: s.manager.free(r), live)
                compare(i, f"finish {live.request_id} (max_tokens)")
                continue
            if r0.num_computed_tokens == r0.num_tokens:
                # The step's token came back: append it (decode continues with it).
                token = rng.randrange(1000)
                for r in live.requests:
                    r.append_output_token_ids(token)
            if schedule(live, rng.randint(*config.chunk)):
                what = f"step {live.request_id}"
            else:
                # Out of blocks: preempt another request, as the scheduler would.
                victim = running[-1] if running[-1] is not live or len(running) == 1 \
                    else running[-2]
                _preempt(victim, sides, call)
                running.remove(victim)
                waiting.insert(0, victim)
                what = f"step {live.request_id}: no room, preempt {victim.request_id}"
        elif op < 0.95 and running:
            live = running.pop(rng.randrange(len(running)))
            call(f"free({live.request_id})", lambda s, r: s.manager.free(r), live)
            what = f"finish {live.request_id}"
        elif op < 0.97 and running:
            live = rng.choice(running)
            _preempt(live, sides, call)
            running.remove(live)
            waiting.append(live)
            what = f"preempt {live.request_id}"
        else:
            if rng.random() < 0.3:
                # Drain first, so that the reset can succeed.
                for live in running:
                    call(f"free({live.request_id})", lambda s, r: s.manager.free(r), live)
                running.clear()
            call("reset_prefix_cache()", lambda s, r: s.manager.reset_prefix_cache(), None)
            what = "reset prefix cache"
        compare(i, what)
    return num_ops


def _preempt(live: _Live, sides: list[Side], call: Callable) -> None:
    """Free ``live``'s blocks and start it over (recompute), as vLLM's scheduler preempts."""
    call(f"free({live.request_id}) (preempt)", lambda s, r: s.manager.free(r), live)
    for side, r in zip(sides, live.requests):
        r.num_computed_tokens = 0
        r.num_preemptions += 1
        r.status = side.statuses.PREEMPTED
    live.started = False
