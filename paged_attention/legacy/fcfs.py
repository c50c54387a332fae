"""A small first-come-first-served scheduler over the legacy block manager, and a synthetic workload.

vLLM V0's scheduler asked the block manager its questions once per step; this is the least of it
that shows what the answers do to memory. Requests wait in arrival order; the scheduler keeps a
*running* list and a *swapped* list, and each ``step()``:

1. **decodes** every running group: if ``can_append_slots`` says a group cannot grow by its new
   tokens, the most recently arrived running group is preempted, by swapping it out to the CPU
   (``can_swap_out``) or else by *recomputation* (its blocks are freed and it waits again, to be
   prefilled anew), until it can; then ``append_slots`` for each of its sequences, collecting the
   copy-on-write pairs;
2. **swaps in** swapped groups, oldest first, while ``can_swap_in`` is OK (only in a step that
   preempted nothing, as in V0: memory was just too short);
3. **admits** waiting groups in arrival order while ``can_allocate`` is OK, stopping at the first
   LATER (first come, first served: nobody overtakes) and dropping a NEVER; not while a group is
   still swapped out (it came first) nor in a step that preempted one;
4. after the "model" has run (``update``): every scheduled sequence has its tokens computed and
   samples one more; a sample that has its output length finishes and is freed.

This is V0's order (``_schedule_default``: running, then swapped, then waiting). Unlike V0, which ran
prefills in steps of their own, a step here decodes the running groups *and* prefills the newly
admitted ones. The scheduler keeps no token budget and no batch limit: the only limit is memory.

Every step leaves a ``StepRecord``: what happened (``Event``s: admitted, waited, swapped out or in,
preempted by recomputation, finished, copied on write), the block pairs for the cache kernels
(``blocks_to_swap_in``/``_out`` for ``swap_blocks``, ``blocks_to_copy`` for ``copy_blocks``), and
who owns each GPU and CPU block, for drawing the pools over time.

There is no model: a sample's next token is a number drawn from a seed (``Request.output_token``),
different for every sample of a request, so the samples of one prompt diverge at once.
"""
from __future__ import annotations

import bisect
import random
import zlib
from collections.abc import Iterable, Sequence as SequenceT
from dataclasses import dataclass, field

from paged_attention.legacy.block_manager import SelfAttnBlockSpaceManager
from paged_attention.legacy.block_table import BlockTable
from paged_attention.legacy.interfaces import AllocStatus
from paged_attention.legacy.sequence import Sequence, SequenceGroup, SequenceStatus
from paged_attention.utils import Device, check_int

__all__ = [
    "Request", "Event", "BlockOwner", "StepRecord", "FcfsScheduler", "synthetic_workload",
    "ADMITTED", "WAITED", "IGNORED", "SWAPPED_OUT", "SWAPPED_IN", "RECOMPUTED", "ABORTED", "FINISHED",
    "COPY_ON_WRITE", "EVENT_KINDS",
]

# Event kinds.
ADMITTED = "admitted"            # allocated: its prompt is prefilled this step
WAITED = "waited"                # can_allocate said LATER: admission stops here this step
IGNORED = "ignored"              # can_allocate said NEVER: the prompt can never fit
SWAPPED_OUT = "swapped out"      # preempted: its blocks moved to the CPU
SWAPPED_IN = "swapped in"        # back on the GPU
RECOMPUTED = "recomputed"        # preempted: its blocks freed, it waits to be prefilled again
ABORTED = "aborted"              # preempted with nowhere to go (see FcfsScheduler)
FINISHED = "finished"            # one sample reached its output length and was freed
COPY_ON_WRITE = "copy on write"  # append_slots wrote into a shared block
EVENT_KINDS = (ADMITTED, WAITED, IGNORED, SWAPPED_OUT, SWAPPED_IN, RECOMPUTED, ABORTED, FINISHED, COPY_ON_WRITE)

_VOCAB = 32000                   # token ids are drawn from [1, _VOCAB)
_MASK64 = (1 << 64) - 1


def _blocks(n: int) -> str:
    return f"{n} block" if n == 1 else f"{n} blocks"


_check_int = check_int


# --------------------------------------------------------------------------------------------
# 1. Requests and a synthetic workload
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Request:
    """One request: a prompt, when it arrives, and how many tokens each of its samples generates.

    ``len(output_lens)`` is the number of samples ``n`` (parallel sampling: ``n`` sequences grown
    from one prompt). ``shared_prefix_len`` says how many leading prompt tokens are a prefix
    other requests share (a system prompt); it only labels the request, the tokens say it all.
    """

    request_id: str
    arrival_step: int
    prompt_token_ids: tuple[int, ...]
    output_lens: tuple[int, ...]
    shared_prefix_len: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise TypeError(f"request_id must be a non-empty str, got {self.request_id!r}")
        _check_int("arrival_step", self.arrival_step, 0)
        for name in ("prompt_token_ids", "output_lens"):
            value = getattr(self, name)
            if isinstance(value, (str, bytes)) or not isinstance(value, SequenceT):
                raise TypeError(f"{name} must be a sequence of ints, got {type(value).__name__}")
            if not all(isinstance(x, int) and not isinstance(x, bool) for x in value):
                raise TypeError(f"{name} must hold ints only, got {list(value)!r}")
            object.__setattr__(self, name, tuple(value))        # frozen: normalise lists to tuples
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id!r} has an empty prompt")
        if not self.output_lens or min(self.output_lens) < 1:
            raise ValueError(f"output_lens must give each sample (at least one) an output length >= 1, "
                             f"got {self.output_lens!r}")
        _check_int("shared_prefix_len", self.shared_prefix_len, 0)
        if self.shared_prefix_len > len(self.prompt_token_ids):
            raise ValueError(f"shared_prefix_len ({self.shared_prefix_len}) is longer than the prompt "
                             f"({len(self.prompt_token_ids)} tokens)")
        _check_int("seed", self.seed, 0)

    @property
    def n(self) -> int:
        """The number of samples."""
        return len(self.output_lens)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    def output_token(self, sample: int, position: int) -> int:
        """The ``position``-th token sample ``sample`` generates: a number drawn from a hash of
        the seed, the request id, the sample and the position, the same in every process.

        It is congruent to ``sample`` modulo ``n``, so two samples of one request never generate
        the same token at the same position: they diverge from their first token on.
        """
        _check_int("position", position, 0)
        if isinstance(sample, bool) or not isinstance(sample, int) or not 0 <= sample < self.n:
            raise ValueError(f"sample must be an int in [0, {self.n}), got {sample!r}")
        # A hash of a tuple of ints does not depend on PYTHONHASHSEED (a str's would).
        h = hash((self.seed, zlib.crc32(self.request_id.encode()), sample, position)) & _MASK64
        return 1 + self.n * (h % ((_VOCAB - 1) // self.n)) + sample


def draw_length(rng: random.Random, mean: float, low: int, high: int) -> int:
    """An exponentially distributed length with the given mean, clipped to [low, high]: many
    short requests, a few long ones (``expovariate`` draws on ``rng.random()``, whose stream is the
    same in every Python version)."""
    length = low + int(rng.expovariate(1.0 / max(mean - low, 1e-9))) if mean > low else low
    return max(low, min(high, length))


def synthetic_workload(num_requests: int, *, seed: int = 0, mean_prompt_len: float = 24,
                       mean_output_len: float = 24, max_len: int = 128, n: int | SequenceT[int] = 1,
                       shared_prefix: SequenceT[int] = (), arrival_every: float = 1.0) -> list[Request]:
    """``num_requests`` reproducible requests with random lengths (a simulation, not a trace).

    * Prompt and output lengths are drawn from exponential distributions with the given means
      (at least 1 token each), so that prompt plus output stays within ``max_len``.
    * ``n`` is every request's number of samples, or a sequence of choices drawn from at random.
      Each sample gets its own output length.
    * ``shared_prefix``: tokens every prompt starts with (a system prompt), counted in its length.
    * Arrivals: on average one request every ``arrival_every`` steps (a Poisson process), the
      first at step 0; several may arrive in one step (``arrival_every < 1``).
    """
    _check_int("num_requests", num_requests, 1)
    _check_int("seed", seed, 0)
    _check_int("max_len", max_len, 2)
    for name, value in (("mean_prompt_len", mean_prompt_len), ("mean_output_len", mean_output_len),
                        ("arrival_every", arrival_every)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{name} must be a number > 0, got {value!r}")
    choices = [n] if isinstance(n, int) else list(n) if isinstance(n, SequenceT) and not isinstance(n, str) else None
    if not choices or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 1 for c in choices):
        raise ValueError(f"n must be an int >= 1 or a non-empty sequence of them, got {n!r}")
    prefix = list(shared_prefix)
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in prefix):
        raise TypeError(f"shared_prefix must hold ints only, got {prefix!r}")
    if len(prefix) >= max_len:
        raise ValueError(f"shared_prefix ({len(prefix)} tokens) leaves no room under max_len={max_len}")

    rng = random.Random(seed)
    requests, time = [], 0.0
    for i in range(num_requests):
        if i:
            time += rng.expovariate(1.0 / arrival_every)
        own_len = draw_length(rng, mean_prompt_len - len(prefix), 1, max_len - len(prefix) - 1)
        prompt = prefix + [1 + int(rng.random() * (_VOCAB - 1)) for _ in range(own_len)]
        num_samples = choices[int(rng.random() * len(choices))]
        room = max_len - len(prompt)
        output_lens = tuple(draw_length(rng, mean_output_len, 1, room) for _ in range(num_samples))
        requests.append(Request(f"r{i}", int(time), tuple(prompt), output_lens, shared_prefix_len=len(prefix),
                                seed=seed))
    return requests


# --------------------------------------------------------------------------------------------
# 2. What a step records
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Event:
    """Something that happened to a request in one step.

    ``pairs``: the block pairs of a swap or a copy on write (device-relative ids, as the
    kernels take them). ``num_blocks``: blocks involved (allocated, moved, freed or needed).
    ``on_watermark`` (``WAITED`` only): the request would have fit in the free blocks, only the
    watermark held it back.
    """

    step: int
    kind: str
    request_id: str
    detail: str = ""
    pairs: tuple[tuple[int, int], ...] = ()
    num_blocks: int = 0
    on_watermark: bool = False

    def __str__(self) -> str:
        return f"step {self.step:>3}  {self.request_id:<5} {self.kind:<13} {self.detail}".rstrip()


@dataclass(frozen=True)
class BlockOwner:
    """Who holds one physical block: the requests (in arrival order) and how many sequences."""

    request_ids: tuple[str, ...]
    num_holders: int

    @property
    def shared(self) -> bool:
        """Held by more than one sequence (samples of one request, or requests sharing a prefix)."""
        return self.num_holders > 1


@dataclass
class StepRecord:
    """Everything one step did, in the order an engine applies it to the KV cache.

    The worker of vLLM V0 ran, before the forward pass: ``swap_blocks`` for ``blocks_to_swap_in``
    (CPU → GPU), then for ``blocks_to_swap_out`` (GPU → CPU), then ``copy_blocks`` for
    ``blocks_to_copy``. The forward pass then wrote the K/V of the tokens each scheduled
    sequence's table holds but the cache does not: the prompts of ``prefills`` (all but their
    first ``num_cached_tokens`` under prefix caching) and one token per sequence of ``decodes``.

    ``gpu_owners``/``cpu_owners``: every block in use after scheduling, device-relative id ->
    ``BlockOwner``; ``num_free_gpu_blocks``/``num_free_cpu_blocks``: the manager's counts then.
    ``finished``: the sequences that finished (and were freed) in ``update``.
    """

    step: int
    events: list[Event] = field(default_factory=list)
    prefills: list[SequenceGroup] = field(default_factory=list)
    decodes: list[SequenceGroup] = field(default_factory=list)
    recomputed: list[SequenceGroup] = field(default_factory=list)
    num_cached_tokens: dict[str, int] = field(default_factory=dict)     # request id -> prefix-cache hits
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    gpu_owners: dict[int, BlockOwner] = field(default_factory=dict)
    cpu_owners: dict[int, BlockOwner] = field(default_factory=dict)
    num_free_gpu_blocks: int = 0
    num_free_cpu_blocks: int = 0
    running: list[str] = field(default_factory=list)       # request ids after scheduling
    swapped: list[str] = field(default_factory=list)
    waiting: list[str] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)

    def kinds(self) -> list[str]:
        return [e.kind for e in self.events]


# --------------------------------------------------------------------------------------------
# 3. The scheduler
# --------------------------------------------------------------------------------------------

class FcfsScheduler:
    """First come, first served over a ``SelfAttnBlockSpaceManager`` (see the module docstring).

    ``preemption_mode``: ``"swap"`` (the default) swaps a victim out when the CPU has room and
    recomputes it otherwise; ``"recompute"`` recomputes whenever it can (vLLM V0's default).
    Only a group with a single running sequence can be recomputed (its samples would otherwise
    be re-forked from one of them); a group of several samples that cannot be swapped out is
    aborted, as V0 did ("not enough CPU swap space"). A swapped group that cannot come back even
    to an otherwise empty GPU (the naive allocator does not keep the samples' sharing across a
    swap, so they may come back larger) is aborted too.

    Use ``step()`` (or ``run()``); to act between the scheduling and the model, as the notebook's
    KV-cache check does, call ``schedule()``, then ``update(record)``.
    """

    def __init__(self, block_manager: SelfAttnBlockSpaceManager, requests: Iterable[Request], *,
                 preemption_mode: str = "swap"):
        if not isinstance(block_manager, SelfAttnBlockSpaceManager):
            raise TypeError(f"block_manager must be a SelfAttnBlockSpaceManager, got {type(block_manager).__name__}")
        if block_manager.max_block_sliding_window is not None:
            raise ValueError("this scheduler does not model sliding windows (it keeps no computed-slot counts "
                             "for them): use a manager without sliding_window")
        if preemption_mode not in ("swap", "recompute"):
            raise ValueError(f"preemption_mode must be 'swap' or 'recompute', got {preemption_mode!r}")
        requests = list(requests)
        for r in requests:
            if not isinstance(r, Request):
                raise TypeError(f"requests must hold Request objects, got {type(r).__name__}")
        ids = [r.request_id for r in requests]
        if len(set(ids)) != len(ids):
            raise ValueError(f"request ids must be unique, got {ids}")
        if block_manager.block_tables:
            raise ValueError("the block manager already holds block tables: give the scheduler a fresh one")

        self.block_manager = block_manager
        self.preemption_mode = preemption_mode
        self.block_size = block_manager.block_size
        self.requests: dict[str, Request] = {r.request_id: r for r in requests}
        # Arrival order (stable for equal steps): the order FCFS serves them in.
        self._order = {r.request_id: k for k, r in enumerate(sorted(requests, key=lambda r: r.arrival_step))}
        self.groups: dict[str, SequenceGroup] = {}
        self.seq_names: dict[int, str] = {}                 # seq id -> "r3.1": request r3, sample 1
        self._sample: dict[int, tuple[Request, int]] = {}
        seq_id = 0
        for r in requests:
            seqs = []
            for sample in range(r.n):
                seqs.append(Sequence(seq_id, list(r.prompt_token_ids), self.block_size))
                self.seq_names[seq_id] = f"{r.request_id}.{sample}"
                self._sample[seq_id] = (r, sample)
                seq_id += 1
            self.groups[r.request_id] = SequenceGroup(r.request_id, seqs, arrival_time=float(r.arrival_step))

        self.now = 0                                         # the next step's number
        self._not_arrived = sorted(self.requests, key=self._order.get)
        self.waiting: list[str] = []                         # request ids, arrival order
        self.running: list[str] = []
        self.swapped: list[str] = []
        self.done_ids: list[str] = []                        # finished, ignored or aborted
        self.history: list[StepRecord] = []

    # ---- small helpers --------------------------------------------------------------------------
    def _insert(self, queue: list[str], request_id: str) -> None:
        """Put a request into a queue at its arrival position."""
        keys = [self._order[r] for r in queue]
        queue.insert(bisect.bisect(keys, self._order[request_id]), request_id)

    @property
    def done(self) -> bool:
        """Every request has finished (or was ignored or aborted)."""
        return len(self.done_ids) == len(self.requests)

    @property
    def events(self) -> list[Event]:
        """Every step's events, in order."""
        return [e for record in self.history for e in record.events]

    def seq_name(self, seq: Sequence) -> str:
        """``"<request id>.<sample>"``: how the notebook names a sequence."""
        return self.seq_names[seq.seq_id]

    def live_tables(self) -> dict[str, object]:
        """The block tables of every running sequence, by name (those a decode step reads)."""
        tables = self.block_manager.block_tables
        return {self.seq_names[s.seq_id]: tables[s.seq_id] for rid in self.running
                for s in self.groups[rid].get_seqs(SequenceStatus.RUNNING)}

    # ---- one step ---------------------------------------------------------------------------------
    def step(self) -> StepRecord:
        """Schedule one step, run the (pretend) model, finish and free what is done."""
        record = self.schedule()
        self.update(record)
        return record

    def run(self, max_steps: int = 10_000) -> list[StepRecord]:
        """Step until every request is done; ``RuntimeError`` if that takes over ``max_steps``."""
        _check_int("max_steps", max_steps, 1)
        start = len(self.history)
        while not self.done:
            if len(self.history) - start >= max_steps:
                raise RuntimeError(f"not done after {max_steps} steps")
            self.step()
        return self.history[start:]

    def schedule(self) -> StepRecord:
        """Decide this step: decodes (preempting if memory is short), swap-ins, admissions."""
        if self.history and self.history[-1].step == self.now:
            raise RuntimeError("schedule() was called twice: call update(record) after each schedule()")
        mgr = self.block_manager
        record = StepRecord(step=self.now)
        while self._not_arrived and self.requests[self._not_arrived[0]].arrival_step <= self.now:
            self._insert(self.waiting, self._not_arrived.pop(0))

        # 1. Decode the running groups, oldest first; preempt from the newest end when short.
        preempted = False
        queue = list(self.running)
        self.running = []
        while queue:
            rid = queue.pop(0)
            group = self.groups[rid]
            while not mgr.can_append_slots(group, num_lookahead_slots=0):
                victim = queue.pop() if queue else rid       # the most recently arrived one
                self._preempt(self.groups[victim], record)
                preempted = True
                if victim == rid:
                    break
            else:
                self._append_slots(group, record)
                record.decodes.append(group)
                self.running.append(rid)

        # 2. Swap groups back in, oldest first, unless this step was short of memory.
        if not preempted:
            while self.swapped:
                rid = self.swapped[0]
                group = self.groups[rid]
                status = mgr.can_swap_in(group, num_lookahead_slots=0)
                if status == AllocStatus.OK:
                    self.swapped.pop(0)
                    pairs = mgr.swap_in(group)
                    for seq in group.get_seqs(SequenceStatus.SWAPPED):
                        seq.status = SequenceStatus.RUNNING
                    record.blocks_to_swap_in.extend(pairs)
                    record.events.append(Event(self.now, SWAPPED_IN, rid, f"{_blocks(len(pairs))} CPU → GPU",
                                               pairs=tuple(pairs), num_blocks=len(pairs)))
                    self._append_slots(group, record)
                    record.decodes.append(group)
                    self._insert(self.running, rid)
                    continue
                if status == AllocStatus.NEVER or not self.running:
                    # Even a GPU with nothing else on it would not take it back.
                    self.swapped.pop(0)
                    self._abort(group, record, "cannot be swapped back in: too large for the GPU")
                    continue
                break                                        # LATER: the others wait behind it

        # 3. Admit waiting groups in arrival order.
        if not preempted and not self.swapped:
            while self.waiting:
                rid = self.waiting[0]
                group = self.groups[rid]
                status = mgr.can_allocate(group)
                if status == AllocStatus.NEVER:
                    self.waiting.pop(0)
                    need = self._num_required_blocks(group)
                    for seq in group.get_seqs(SequenceStatus.WAITING):
                        seq.status = SequenceStatus.FINISHED_IGNORED
                    self.done_ids.append(rid)
                    record.events.append(Event(self.now, IGNORED, rid,
                                               f"needs {_blocks(need)}; the GPU has {mgr.num_total_gpu_blocks} "
                                               f"(watermark {mgr.watermark_blocks})", num_blocks=need))
                    continue
                if status == AllocStatus.LATER:
                    need = self._num_required_blocks(group)
                    free = mgr.get_num_free_gpu_blocks()
                    on_watermark = free >= need
                    why = "only the watermark holds it back" if on_watermark else "not enough free blocks"
                    record.events.append(Event(self.now, WAITED, rid,
                                               f"needs {_blocks(need)}, {free} free, watermark "
                                               f"{mgr.watermark_blocks}: {why}", num_blocks=need,
                                               on_watermark=on_watermark))
                    break
                self.waiting.pop(0)
                self._admit(group, record)
                self._insert(self.running, rid)

        # Prefix caching: the scheduled blocks count as computed from now on (as in V0, where
        # the scheduler did this once it had scheduled them; each group's tokens of this step
        # are its chunk), and every running sequence is stamped with this step's time, for the
        # evictor's LRU order once it is freed.
        if mgr.enable_caching:
            for rid in self.running:
                for seq in self.groups[rid].get_seqs(SequenceStatus.RUNNING):
                    mgr.access_all_blocks_in_seq(seq, float(self.now))
            for group in record.prefills + record.decodes:
                chunk = max((seq.get_len() - seq.data.get_num_computed_tokens()
                             for seq in group.get_seqs(SequenceStatus.RUNNING)), default=0)
                mgr.mark_blocks_as_computed(group, token_chunk_size=chunk)

        record.running, record.swapped, record.waiting = list(self.running), list(self.swapped), list(self.waiting)
        record.gpu_owners, record.cpu_owners = self._owners()
        record.num_free_gpu_blocks = mgr.get_num_free_gpu_blocks()
        record.num_free_cpu_blocks = mgr.get_num_free_cpu_blocks()
        self.history.append(record)
        return record

    def update(self, record: StepRecord) -> list[Sequence]:
        """The model has run: every scheduled sequence's tokens are computed and it samples one
        more; a sample that has all its output tokens finishes and is freed. Returns those."""
        if not self.history or record is not self.history[-1] or record.step != self.now:
            raise ValueError("update() takes the record the last schedule() returned, once")
        mgr = self.block_manager
        for group in record.prefills + record.decodes:
            for seq in group.get_seqs(SequenceStatus.RUNNING):
                seq.data.update_num_computed_tokens(seq.get_len() - seq.data.get_num_computed_tokens())
                request, sample = self._sample[seq.seq_id]
                num_out = seq.get_len() - seq.get_prompt_len()
                seq.append_token_id(request.output_token(sample, num_out))
                if num_out + 1 >= request.output_lens[sample]:
                    seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED
                    mgr.free(seq)
                    record.finished.append(seq)
                    record.events.append(Event(self.now, FINISHED, group.request_id,
                                               f"sample {sample}: {num_out + 1} tokens generated"))
            if group.is_finished() and group.request_id in self.running:
                self.running.remove(group.request_id)
                self.done_ids.append(group.request_id)
        self.now += 1
        return record.finished

    # ---- what the steps do ------------------------------------------------------------------------
    def _num_required_blocks(self, group: SequenceGroup) -> int:
        """The blocks ``can_allocate`` counts: the first waiting sequence's tokens, unshared."""
        return BlockTable.get_num_required_blocks(group.get_seqs(SequenceStatus.WAITING)[0].get_token_ids(),
                                                  self.block_size)

    def _admit(self, group: SequenceGroup, record: StepRecord) -> None:
        mgr = self.block_manager
        free_before = mgr.get_num_free_gpu_blocks()
        mgr.allocate(group)
        seqs = group.get_seqs(SequenceStatus.WAITING)
        cached = mgr.get_num_cached_tokens(seqs[0]) if mgr.enable_caching else 0
        for seq in seqs:
            seq.status = SequenceStatus.RUNNING
        record.prefills.append(group)
        record.num_cached_tokens[group.request_id] = cached
        taken = free_before - mgr.get_num_free_gpu_blocks()
        detail = f"{seqs[0].get_len()} tokens, {len(seqs)} sample{'s' if len(seqs) > 1 else ''}: {_blocks(taken)}"
        if mgr.enable_caching:
            detail += f"; {cached} tokens found in the prefix cache"
        record.events.append(Event(self.now, ADMITTED, group.request_id, detail, num_blocks=taken))

    def _append_slots(self, group: SequenceGroup, record: StepRecord) -> None:
        for seq in group.get_seqs(SequenceStatus.RUNNING):
            pairs = self.block_manager.append_slots(seq, num_lookahead_slots=0)
            if pairs:
                record.blocks_to_copy.extend(pairs)
                record.events.append(Event(self.now, COPY_ON_WRITE, group.request_id,
                                           f"sample {self._sample[seq.seq_id][1]}: "
                                           + ", ".join(f"{s} → {d}" for s, d in pairs),
                                           pairs=tuple(pairs), num_blocks=len(pairs)))

    def _preempt(self, group: SequenceGroup, record: StepRecord) -> None:
        mgr = self.block_manager
        rid = group.request_id
        running = group.get_seqs(SequenceStatus.RUNNING)
        can_swap = mgr.can_swap_out(group)
        if can_swap and (self.preemption_mode == "swap" or len(running) > 1):
            pairs = mgr.swap_out(group)
            for seq in running:
                seq.status = SequenceStatus.SWAPPED
            record.blocks_to_swap_out.extend(pairs)
            record.events.append(Event(self.now, SWAPPED_OUT, rid, f"{_blocks(len(pairs))} GPU → CPU",
                                       pairs=tuple(pairs), num_blocks=len(pairs)))
            self._insert(self.swapped, rid)
        elif len(running) == 1:
            seq = running[0]
            free_before = mgr.get_num_free_gpu_blocks()
            mgr.free(seq)
            seq.data.reset_state_for_recompute()
            seq.status = SequenceStatus.WAITING
            record.recomputed.append(group)
            record.events.append(Event(self.now, RECOMPUTED, rid,
                                       f"{_blocks(mgr.get_num_free_gpu_blocks() - free_before)} freed; "
                                       f"{seq.get_len()} tokens to prefill again",
                                       num_blocks=mgr.get_num_free_gpu_blocks() - free_before))
            self._insert(self.waiting, rid)
        else:
            self._abort(group, record, f"{len(running)} samples and no room on the CPU to swap them out")

    def _abort(self, group: SequenceGroup, record: StepRecord, why: str) -> None:
        for seq in group.get_seqs():
            if not seq.is_finished():
                self.block_manager.free(seq)
                seq.status = SequenceStatus.FINISHED_ABORTED
        self.done_ids.append(group.request_id)
        record.events.append(Event(self.now, ABORTED, group.request_id, why))

    # ---- who owns which block ---------------------------------------------------------------------
    def _owners(self) -> tuple[dict[int, BlockOwner], dict[int, BlockOwner]]:
        """Device-relative block id -> owner, for the GPU and the CPU, from the live tables."""
        mgr = self.block_manager
        num_gpu = mgr.num_total_gpu_blocks
        holders: dict[int, list[str]] = {}
        for seq_id, table in mgr.block_tables.items():
            rid = self._sample[seq_id][0].request_id
            for block_id in table.physical_block_ids:
                holders.setdefault(block_id, []).append(rid)
        gpu, cpu = {}, {}
        for block_id in sorted(holders):
            rids = tuple(sorted(set(holders[block_id]), key=self._order.get))
            owner = BlockOwner(rids, len(holders[block_id]))
            if block_id < num_gpu:
                gpu[block_id] = owner
            else:
                cpu[mgr.block_allocator.get_physical_block_id(Device.CPU, block_id)] = owner
        return gpu, cpu
