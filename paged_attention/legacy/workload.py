"""A synthetic workload for the FCFS scheduler, a pretend model, and the loop that runs them.

* ``Request``: a prompt, when it arrives, and how many tokens each of its samples generates;
  ``synthetic_workload`` draws reproducible ones (a simulation, not a trace).
* ``SyntheticModel``: stands in for the model. It computes nothing; a sample's next token is a
  number drawn from a seed (``Request.output_token``), different for every sample of a request,
  so the samples of one prompt diverge at once.
* ``SimulatedEngine``: what an engine does around the scheduler, with that model: it adds each
  request's sequence group when it arrives, calls ``FcfsScheduler.schedule()``, asks the model
  for the sampled tokens, stops each sample at its output length, and calls ``update``. An
  engine over a real model drives the same scheduler the same way.
"""
from __future__ import annotations

import random
import zlib
from collections.abc import Iterable, Sequence as SequenceT
from dataclasses import dataclass

from paged_attention.legacy.block_manager import SelfAttnBlockSpaceManager
from paged_attention.legacy.block_table import BlockTable
from paged_attention.legacy.records import Event, StepRecord
from paged_attention.legacy.scheduler import FcfsScheduler
from paged_attention.legacy.sequence import Sequence, SequenceGroup, SequenceStatus
from paged_attention.utils import check_int

__all__ = ["Request", "draw_length", "synthetic_workload", "SyntheticModel", "SimulatedEngine"]

_VOCAB = 32000                   # token ids are drawn from [1, _VOCAB)
_MASK64 = (1 << 64) - 1


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
        check_int("arrival_step", self.arrival_step, 0)
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
        check_int("shared_prefix_len", self.shared_prefix_len, 0)
        if self.shared_prefix_len > len(self.prompt_token_ids):
            raise ValueError(f"shared_prefix_len ({self.shared_prefix_len}) is longer than the prompt "
                             f"({len(self.prompt_token_ids)} tokens)")
        check_int("seed", self.seed, 0)

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
        check_int("position", position, 0)
        check_int("sample", sample, 0, self.n - 1, max_name="n - 1")
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
    check_int("num_requests", num_requests, 1)
    check_int("seed", seed, 0)
    check_int("max_len", max_len, 2)
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
# 2. The pretend model
# --------------------------------------------------------------------------------------------

class SyntheticModel:
    """Stands in for a model runner: for every sequence a step runs, the token it samples.

    Sequence ``seq_id`` is sample ``sample`` of ``request`` (``add``); its next token is
    ``request.output_token(sample, <tokens it has generated so far>)``. No K/V is computed.
    """

    def __init__(self) -> None:
        self._sample: dict[int, tuple[Request, int]] = {}

    def add(self, seq: Sequence, request: Request, sample: int) -> None:
        self._sample[seq.seq_id] = (request, sample)

    def sample_of(self, seq: Sequence) -> tuple[Request, int]:
        """The request and sample index ``seq`` belongs to."""
        return self._sample[seq.seq_id]

    def execute_model(self, record: StepRecord) -> dict[int, int]:
        """Seq id -> sampled token, for every running sequence of every scheduled group."""
        sampled = {}
        for scheduled in record.scheduled_seq_groups:
            for seq in scheduled.seq_group.get_seqs(SequenceStatus.RUNNING):
                request, sample = self._sample[seq.seq_id]
                sampled[seq.seq_id] = request.output_token(sample, seq.get_len() - seq.get_prompt_len())
        return sampled


# --------------------------------------------------------------------------------------------
# 3. The loop: requests arrive, the scheduler schedules, the model samples, samples stop
# --------------------------------------------------------------------------------------------

class SimulatedEngine:
    """An FCFS scheduler over ``block_manager`` serving ``requests`` with a ``SyntheticModel``.

    Each request becomes a ``SequenceGroup`` of ``n`` sequences (``seq_name``: ``"r3.1"`` is
    request r3's sample 1), added to the scheduler at its arrival step. Use ``step()`` (or
    ``run()``); to act between the scheduling and the model, as notebook 02's KV-cache check
    does, call ``schedule()``, then ``update(record)``. ``preemption_mode`` goes to the
    scheduler.
    """

    def __init__(self, block_manager: SelfAttnBlockSpaceManager, requests: Iterable[Request], *,
                 preemption_mode: str = "swap"):
        self.scheduler = FcfsScheduler(block_manager, preemption_mode=preemption_mode)
        requests = list(requests)
        for r in requests:
            if not isinstance(r, Request):
                raise TypeError(f"requests must hold Request objects, got {type(r).__name__}")
        ids = [r.request_id for r in requests]
        if len(set(ids)) != len(ids):
            raise ValueError(f"request ids must be unique, got {ids}")
        self.block_manager = block_manager
        self.requests: dict[str, Request] = {r.request_id: r for r in requests}
        self.model = SyntheticModel()
        self.groups: dict[str, SequenceGroup] = {}
        self.seq_names: dict[int, str] = {}                 # seq id -> "r3.1": request r3, sample 1
        seq_id = 0
        for r in requests:
            seqs = []
            for sample in range(r.n):
                seq = Sequence(seq_id, list(r.prompt_token_ids), block_manager.block_size)
                seqs.append(seq)
                self.seq_names[seq_id] = f"{r.request_id}.{sample}"
                self.model.add(seq, r, sample)
                seq_id += 1
            self.groups[r.request_id] = SequenceGroup(r.request_id, seqs, arrival_time=float(r.arrival_step))
        # Arrival order (stable for equal steps): the order FCFS serves them in.
        self._not_arrived = sorted(requests, key=lambda r: r.arrival_step)

    # ---- the scheduler's state, for reading ----------------------------------------------------------
    @property
    def history(self) -> list[StepRecord]:
        return self.scheduler.history

    @property
    def events(self) -> list[Event]:
        """Every step's events, in order."""
        return self.scheduler.events

    @property
    def done(self) -> bool:
        """Every request has finished (or was ignored or aborted)."""
        return len(self.scheduler.done_ids) == len(self.requests)

    def seq_name(self, seq: Sequence) -> str:
        """``"<request id>.<sample>"``: how the notebook names a sequence."""
        return self.seq_names[seq.seq_id]

    def live_tables(self) -> dict[str, BlockTable]:
        """The block tables of every running sequence, by name (those a decode step reads)."""
        tables = self.block_manager.block_tables
        return {self.seq_names[s.seq_id]: tables[s.seq_id] for rid in self.scheduler.running
                for s in self.groups[rid].get_seqs(SequenceStatus.RUNNING)}

    # ---- one step ---------------------------------------------------------------------------------
    def schedule(self) -> StepRecord:
        """Add the requests that have arrived by now, then schedule one step."""
        while self._not_arrived and self._not_arrived[0].arrival_step <= self.scheduler.now:
            self.scheduler.add_seq_group(self.groups[self._not_arrived.pop(0).request_id])
        return self.scheduler.schedule()

    def update(self, record: StepRecord) -> list[Sequence]:
        """Run the model on ``record``: every scheduled sequence samples a token, and a sample
        that has all its output tokens finishes and is freed. Returns those."""
        if not self.history or record is not self.history[-1] or record.step != self.scheduler.now:
            raise ValueError("update() takes the record the last schedule() returned, once")
        sampled = self.model.execute_model(record)
        finished = set()                             # the stop check: each sample's output length
        for scheduled in record.scheduled_seq_groups:
            for seq in scheduled.seq_group.get_seqs(SequenceStatus.RUNNING):
                request, sample = self.model.sample_of(seq)
                if seq.get_len() - seq.get_prompt_len() + 1 >= request.output_lens[sample]:
                    finished.add(seq.seq_id)
        return self.scheduler.update(record, sampled, finished)

    def step(self) -> StepRecord:
        """Schedule one step, run the (pretend) model, finish and free what is done."""
        record = self.schedule()
        self.update(record)
        return record

    def run(self, max_steps: int = 10_000) -> list[StepRecord]:
        """Step until every request is done; ``RuntimeError`` if that takes over ``max_steps``."""
        check_int("max_steps", max_steps, 1)
        start = len(self.history)
        while not self.done:
            if len(self.history) - start >= max_steps:
                raise RuntimeError(f"not done after {max_steps} steps")
            self.step()
        return self.history[start:]
