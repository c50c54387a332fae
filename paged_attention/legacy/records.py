"""What one scheduler step decided: the work for the model runner, and a record for the reader.

``FcfsScheduler.schedule()`` returns a ``StepRecord``. Its first part is what vLLM V0's
``SchedulerOutputs`` carried to the worker: the groups to run and how many tokens of each
(``scheduled_seq_groups``), and the block-level work to do before the forward pass
(``blocks_to_swap_in``, ``blocks_to_swap_out``, ``blocks_to_copy``). Its second part is for
drawing and checking: what happened (``Event``s) and who holds each GPU and CPU block.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from paged_attention.legacy.sequence import Sequence, SequenceGroup

__all__ = [
    "ADMITTED", "WAITED", "IGNORED", "SWAPPED_OUT", "SWAPPED_IN", "RECOMPUTED", "ABORTED", "FINISHED",
    "COPY_ON_WRITE", "EVENT_KINDS", "Event", "BlockOwner", "ScheduledSequenceGroup", "StepRecord",
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


@dataclass(frozen=True)
class ScheduledSequenceGroup:
    """One group the model runs this step, as vLLM V0's scheduler handed it to the worker.

    Each running sequence of ``seq_group`` feeds ``token_chunk_size`` tokens through the model:
    a prefill's tokens not computed yet (the whole prompt here: prompts are not cut into
    chunks), or the one token a decode appends. Of a prefill's tokens, the first
    ``num_cached_tokens`` already have their K/V in the prefix cache.
    """

    seq_group: SequenceGroup
    token_chunk_size: int
    is_prefill: bool
    num_cached_tokens: int = 0


@dataclass
class StepRecord:
    """Everything one step did, in the order an engine applies it to the KV cache.

    The worker of vLLM V0 ran, before the forward pass: ``swap_blocks`` for ``blocks_to_swap_in``
    (CPU → GPU), then for ``blocks_to_swap_out`` (GPU → CPU), then ``copy_blocks`` for
    ``blocks_to_copy``. The forward pass then wrote the K/V of the tokens each scheduled
    sequence's table holds but the cache does not: the prompts of ``prefills`` (all but their
    first ``num_cached_tokens`` under prefix caching) and one token per sequence of ``decodes``.
    ``scheduled_seq_groups`` says the same per group, with its token count.

    ``gpu_owners``/``cpu_owners``: every block in use after scheduling, device-relative id ->
    ``BlockOwner`` (empty unless ``owners_recorded``: a scheduler may be told not to record them); ``num_free_gpu_blocks``/``num_free_cpu_blocks``: the manager's counts then.
    ``finished``: the sequences that finished (and were freed) in ``update``.
    """

    step: int
    events: list[Event] = field(default_factory=list)
    prefills: list[SequenceGroup] = field(default_factory=list)
    decodes: list[SequenceGroup] = field(default_factory=list)
    recomputed: list[SequenceGroup] = field(default_factory=list)
    num_cached_tokens: dict[str, int] = field(default_factory=dict)     # request id -> prefix-cache hits
    scheduled_seq_groups: list[ScheduledSequenceGroup] = field(default_factory=list)
    num_batched_tokens: int = 0                             # tokens the forward pass runs, all sequences
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    gpu_owners: dict[int, BlockOwner] = field(default_factory=dict)
    cpu_owners: dict[int, BlockOwner] = field(default_factory=dict)
    num_free_gpu_blocks: int = 0
    num_free_cpu_blocks: int = 0
    owners_recorded: bool = False
    running: list[str] = field(default_factory=list)       # request ids after scheduling
    swapped: list[str] = field(default_factory=list)
    waiting: list[str] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)

    def kinds(self) -> list[str]:
        return [e.kind for e in self.events]
