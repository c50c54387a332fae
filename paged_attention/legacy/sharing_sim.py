"""How much KV-cache memory sharing blocks saves: parallel sampling and beam search, as n grows.

Section 6.1 of the PagedAttention paper shares a prompt's blocks between the ``n`` samples grown
from it (parallel sampling) and, in beam search, the common history of the beams; its Figure 15
measures the saving on the Alpaca trace with OPT-13B: 6.1-9.8% for parallel sampling and
37.6-55.2% for beam search. This module measures the same quantity on synthetic lengths, by
running vLLM V0's block manager twice per request:

* **with sharing**: one group of ``n`` sequences, forked from one prompt (``allocate`` forks the
  samples; beam search also ``fork``s and ``free``s beams as it goes), each appending its own
  tokens, so every shared block is copied on the first write that would change it;
* **without sharing**: ``n`` groups of one sequence each, with the same lengths.

The saving is ``1 - shared / unshared``, where each is the GPU blocks in use summed over the
steps (the prefill and every decode) (memory × time, what a pool of a given size pays for), and also at the peak.

Beam search here is a model, not a search: each step, each of the ``k`` new beams picks its parent
among the current beams at random (a stand-in for the model's scores). A parent picked several
times is forked, one picked by nobody is freed. How often beams share a parent, and so how much
history they share, is exactly what this choice decides: a real model's scores can share more or
less than this, so the beam-search figure is an illustration, less firm than the parallel-sampling
one (which depends only on the lengths).
"""
from __future__ import annotations

import random
from collections.abc import Iterable, Sequence as SequenceT
from dataclasses import dataclass

from paged_attention.legacy.block_manager import SelfAttnBlockSpaceManager
from paged_attention.legacy.workload import draw_length
from paged_attention.legacy.sequence import Sequence, SequenceGroup, SequenceStatus
from paged_attention.utils import check_int

MODES: tuple[str, ...] = ("parallel", "beam")

# Memory saved by sharing in the paper's Figure 15 (Alpaca trace, OPT-13B), in percent.
PAPER_SAVINGS: dict[str, tuple[float, float]] = {"parallel": (6.1, 9.8), "beam": (37.6, 55.2)}

# The Alpaca trace's mean prompt and output lengths (the paper's Figure 11b).
ALPACA_MEAN_PROMPT_LEN = 19.31
ALPACA_MEAN_OUTPUT_LEN = 58.45


@dataclass(frozen=True)
class SharingSavings:
    """The GPU blocks ``n`` sequences grown from one prompt used, with and without sharing.

    ``*_block_steps``: blocks in use summed over every step (prefill, decodes) of every request;
    ``peak_*``: the most blocks in use at once, summed over requests (each runs alone).
    """

    mode: str
    n: int
    shared_block_steps: int
    unshared_block_steps: int
    peak_shared: int
    peak_unshared: int

    @property
    def saving(self) -> float:
        """The share of memory × time that sharing saved (0 when nothing could be shared)."""
        return 1.0 - self.shared_block_steps / self.unshared_block_steps

    @property
    def peak_saving(self) -> float:
        """The share of the peak that sharing saved."""
        return 1.0 - self.peak_shared / self.peak_unshared


def _token(rng: random.Random) -> int:
    return 1 + int(rng.random() * 31999)


def _used(mgr: SelfAttnBlockSpaceManager) -> int:
    return mgr.num_total_gpu_blocks - mgr.get_num_free_gpu_blocks()


def _decode(mgr: SelfAttnBlockSpaceManager, seqs: list[Sequence], rng: random.Random) -> None:
    """One decode step: every sequence's last token gets a slot, then it samples a new one."""
    for seq in seqs:
        mgr.append_slots(seq, num_lookahead_slots=0)
        seq.data.update_num_computed_tokens(seq.get_len() - seq.data.get_num_computed_tokens())
    for seq in seqs:
        seq.append_token_id(_token(rng))


def _prefill(prompt: list[int], n: int, block_size: int, num_blocks: int, shared: bool,
             rng: random.Random) -> tuple[SelfAttnBlockSpaceManager, list[Sequence]]:
    """A fresh manager holding ``n`` sequences of ``prompt`` after their prefill, each with its
    first sampled token: one group (the prompt's blocks shared) or ``n`` separate groups."""
    mgr = SelfAttnBlockSpaceManager(block_size, num_blocks, 0, watermark=0.0)
    seqs = [Sequence(i, list(prompt), block_size) for i in range(n)]
    groups = [SequenceGroup("r", seqs)] if shared else [SequenceGroup(f"r{i}", [s]) for i, s in enumerate(seqs)]
    for group in groups:
        mgr.allocate(group)
    for seq in seqs:
        seq.status = SequenceStatus.RUNNING
        seq.data.update_num_computed_tokens(len(prompt))
        seq.append_token_id(_token(rng))               # the first sampled token
    return mgr, seqs


def _run_parallel(prompt: list[int], output_lens: SequenceT[int], block_size: int, shared: bool,
                  seed: int) -> tuple[int, int]:
    """Block-steps and peak of one request's samples, forked from one group or as separate groups."""
    rng = random.Random(seed)
    n = len(output_lens)
    num_blocks = n * (len(prompt) + max(output_lens)) // block_size + n + 1     # room for everything
    mgr, seqs = _prefill(prompt, n, block_size, num_blocks, shared, rng)
    block_steps = peak = _used(mgr)                    # the prefill step
    while True:
        for seq in seqs:
            if seq.status == SequenceStatus.RUNNING and seq.get_len() - len(prompt) >= output_lens[seq.seq_id]:
                seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED
                mgr.free(seq)
        live = [s for s in seqs if s.status == SequenceStatus.RUNNING]
        if not live:
            break
        _decode(mgr, live, rng)
        used = _used(mgr)
        block_steps, peak = block_steps + used, max(peak, used)
    if mgr.get_num_free_gpu_blocks() != num_blocks:
        raise AssertionError("blocks leaked: a finished sample's blocks were not all freed")
    return block_steps, peak


def _run_beam(prompt: list[int], output_len: int, beam_width: int, block_size: int, shared: bool,
              seed: int) -> tuple[int, int]:
    """Block-steps and peak of a beam search of ``beam_width`` beams for ``output_len`` steps."""
    rng, choice = random.Random(seed), random.Random(seed + 1)
    k = beam_width
    num_blocks = k * ((len(prompt) + output_len) // block_size + 2) + 1
    mgr, beams = _prefill(prompt, k, block_size, num_blocks, shared, rng)
    next_id = k
    block_steps = peak = _used(mgr)                    # the prefill step
    for _ in range(output_len - 1):
        for beam in beams:
            mgr.append_slots(beam, num_lookahead_slots=0)
            beam.data.update_num_computed_tokens(beam.get_len() - beam.data.get_num_computed_tokens())
        used = _used(mgr)
        block_steps, peak = block_steps + used, max(peak, used)
        if not shared:                                    # independent copies: each beam keeps its own
            for beam in beams:
                beam.append_token_id(_token(rng))
            continue
        # The next beams: each picks a parent at random. A parent picked c times keeps going as
        # one child and is forked c - 1 times (the children share its blocks); one picked by
        # nobody is freed. Every child samples its own token.
        picks = [0] * k
        for _ in range(k):
            picks[int(choice.random() * k)] += 1
        new_beams = []
        for parent, count in zip(beams, picks):
            if count == 0:
                mgr.free(parent)
                continue
            for _ in range(count - 1):
                child = Sequence(next_id, list(parent.get_token_ids()), block_size)
                next_id += 1
                child.status = SequenceStatus.RUNNING
                child.data.update_num_computed_tokens(child.get_len())
                mgr.fork(parent, child)
                child.append_token_id(_token(rng))
                new_beams.append(child)
            parent.append_token_id(_token(rng))
            new_beams.append(parent)
        beams = new_beams
    for beam in beams:
        mgr.free(beam)
    if mgr.get_num_free_gpu_blocks() != num_blocks:
        raise AssertionError("blocks leaked: a beam's blocks were not all freed")
    return block_steps, peak


def sharing_savings(n_values: Iterable[int], mode: str = "parallel", *, num_requests: int = 40,
                    block_size: int = 16, mean_prompt_len: float = ALPACA_MEAN_PROMPT_LEN,
                    mean_output_len: float = ALPACA_MEAN_OUTPUT_LEN, max_len: int = 512,
                    seed: int = 0) -> list[SharingSavings]:
    """The memory sharing saves for each ``n`` in ``n_values`` (samples, or beams for ``"beam"``).

    Every ``n`` runs the same ``num_requests`` synthetic requests (lengths drawn as in
    ``workload.synthetic_workload``, with the Alpaca trace's means by default); in parallel sampling
    each sample draws its own output length, in beam search every beam runs for the request's.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if isinstance(n_values, (str, bytes)):
        raise TypeError(f"n_values must be ints, got {n_values!r}")
    n_values = list(n_values)
    if not n_values or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in n_values):
        raise ValueError(f"n_values must be a non-empty list of ints >= 1, got {n_values!r}")
    check_int("num_requests", num_requests, 1)
    check_int("block_size", block_size, 1)
    check_int("max_len", max_len, 2)
    check_int("seed", seed, 0)
    for name, value in (("mean_prompt_len", mean_prompt_len), ("mean_output_len", mean_output_len)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{name} must be a number > 0, got {value!r}")

    results = []
    for n in n_values:
        rng = random.Random(seed)              # the same prompts and lengths for every n
        totals = [0, 0, 0, 0]
        for r in range(num_requests):
            prompt = [_token(rng) for _ in range(draw_length(rng, mean_prompt_len, 1, max_len - 2))]
            room = max_len - len(prompt)
            lens = [draw_length(rng, mean_output_len, 1, room) for _ in range(max(n_values))]
            run_seed = seed * 1_000_003 + r
            if mode == "parallel":
                shared = _run_parallel(prompt, lens[:n], block_size, True, run_seed)
                unshared = _run_parallel(prompt, lens[:n], block_size, False, run_seed)
            else:
                length = max(lens[0], 2)
                shared = _run_beam(prompt, length, n, block_size, True, run_seed)
                unshared = _run_beam(prompt, length, n, block_size, False, run_seed)
            for i, value in enumerate(shared + unshared):
                totals[i] += value
        results.append(SharingSavings(mode, n, totals[0], totals[2], totals[1], totals[3]))
    return results
