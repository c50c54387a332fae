"""The engine loop: requests in, one scheduler step at a time, tokens out.

Each ``step()`` does what vLLM V0's engine did, with the project's own pieces:

1. **Schedule.** ``legacy.scheduler.FcfsScheduler`` over the legacy ``SelfAttnBlockSpaceManager``
   decides who runs: running requests decode (preempting the newest by swap or recompute when
   blocks run out), swapped ones come back, waiting ones are admitted (prefix-cache hits found
   here). It returns a ``StepRecord``: the work, and what happened, for the drawings.
2. **Move blocks.** The record's swap-ins (CPU → GPU), swap-outs (GPU → CPU) and copies on write
   are applied to every layer's real cache with ``swap_blocks`` and ``copy_blocks``.
3. **Build the batch.** Each scheduled sequence brings its tokens whose keys and values are not
   cached yet: a decode its last token, a prefill its prompt after the prefix-cache hit. The
   block manager's lists become a block table and a slot mapping (``engine/tables.py``).
4. **Run the model** on the batch (a CUDA graph for a decode batch on a GPU), **sample** one token
   per sequence, and **update** the scheduler, which frees the sequences that finished.

Every step's timings go to ``step_stats``, its ``StepRecord`` to ``history``.
"""
from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass
from typing import Optional

import torch

from paged_attention.engine.outputs import CompletionOutput, RequestOutput
from paged_attention.engine.sampler import sample
from paged_attention.engine.sampling_params import SamplingParams
from paged_attention.engine.tables import make_step_tables
from paged_attention.kernels import reference
from paged_attention.legacy.block_manager import SelfAttnBlockSpaceManager
from paged_attention.legacy.records import ABORTED, IGNORED, StepRecord
from paged_attention.legacy.scheduler import FcfsScheduler
from paged_attention.legacy.sequence import Sequence, SequenceGroup, SequenceStatus
from paged_attention.model import ForwardBatch, LlamaForCausalLM, allocate_kv_caches
from paged_attention.utils import PAD_SLOT_ID, cdiv

# How the scheduler's end of a sequence reads as a finish reason (vLLM's names).
_END_REASONS = {IGNORED: "length", ABORTED: "abort"}


@dataclass
class _Request:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    params: SamplingParams
    seq: Sequence
    stop_ids: frozenset[int]
    generator: Optional[torch.Generator]
    finish_reason: Optional[str] = None
    num_cached_tokens: int = 0


@dataclass
class StepStats:
    """One step's shape and where its time went (seconds). ``schedule``: scheduler and block
    manager; ``prepare``: block moves, the batch, tables and slot mapping; ``forward``: the
    model (launch time, or the graph replay); ``sample``: sampling, including the wait for the
    GPU; ``update``: the scheduler's bookkeeping and finished requests."""

    step: int
    num_reqs: int
    num_tokens: int
    decode_only: bool
    cuda_graph: bool
    schedule: float
    prepare: float
    forward: float
    sample: float
    update: float

    @property
    def total(self) -> float:
        return self.schedule + self.prepare + self.forward + self.sample + self.update

    @property
    def python(self) -> float:
        """The engine's own bookkeeping: scheduler, block manager, tables, updates."""
        return self.schedule + self.prepare + self.update


class LLMEngine:
    """The engine over one model (see the module docstring). ``LLM`` is its user-facing front."""

    def __init__(self, model: LlamaForCausalLM, *, eos_token_ids: frozenset[int], block_size: int,
                 num_gpu_blocks: int, num_cpu_blocks: int, enable_prefix_caching: bool, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int, preemption_mode: str = "swap",
                 block_tables: str = "auto", cuda_graphs: bool = True, watermark: float = 0.01,
                 record_block_owners: bool = True) -> None:
        self.model = model
        self.eos_token_ids = frozenset(eos_token_ids)
        self.block_size, self.max_model_len = block_size, max_model_len
        self.block_manager = SelfAttnBlockSpaceManager(block_size, num_gpu_blocks, num_cpu_blocks, watermark=watermark,
                                                       enable_caching=enable_prefix_caching)
        self.scheduler = FcfsScheduler(self.block_manager, preemption_mode=preemption_mode,
                                       max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                       record_block_owners=record_block_owners)
        self.tables = make_step_tables(block_tables, block_size, max_num_seqs, max_num_batched_tokens,
                                       max_model_len, model.device)
        self.kv_caches = allocate_kv_caches(model, num_gpu_blocks, block_size)
        # The swap pool: the same layout in host memory (on a CPU machine, a second CPU pool).
        self.cpu_kv_caches = (allocate_kv_caches(model, num_cpu_blocks, block_size, device="cpu")
                              if num_cpu_blocks else [])
        self.graphs = None
        # The reference decode reads lengths back to the host, which a capture does not allow.
        if cuda_graphs and model.device.type == "cuda" and model.attention_impl != "reference":
            from paged_attention.engine.cuda_graphs import DecodeGraphs
            self.graphs = DecodeGraphs(model, self.kv_caches, max_num_seqs, max_model_len, block_size)
        self.requests: dict[str, _Request] = {}         # unfinished requests
        self._request_of_seq: dict[int, str] = {}
        self._with_rows: set[int] = set()                # seq ids that hold a table row
        self.step_stats: list[StepStats] = []
        self._seq_ids = itertools.count()

    @property
    def history(self) -> list[StepRecord]:
        """Every step's ``StepRecord`` (events, block owners, free counts), for the drawings."""
        return self.scheduler.history

    # ---- requests -------------------------------------------------------------------------
    def check_prompt(self, prompt_token_ids: list[int]) -> None:
        """Typed errors for a prompt the engine can never run; nothing changes."""
        if not prompt_token_ids:
            raise ValueError("the prompt is empty: a request needs at least one token")
        self.model.check_token_ids(prompt_token_ids)
        n = len(prompt_token_ids)
        if n >= self.max_model_len:
            raise ValueError(f"the prompt has {n} tokens, but the model's context is {self.max_model_len} "
                             f"(max_model_len), which must leave room for at least one new token")
        if n > self.scheduler.max_num_batched_tokens:
            raise ValueError(f"the prompt has {n} tokens, more than one step may run "
                             f"(max_num_batched_tokens={self.scheduler.max_num_batched_tokens})")
        mgr = self.block_manager
        usable = mgr.num_total_gpu_blocks - mgr.watermark_blocks
        if cdiv(n, self.block_size) > usable:
            raise ValueError(f"the prompt has {n} tokens, {cdiv(n, self.block_size)} blocks of {self.block_size}, "
                             f"but the pool can never give one request more than {usable} "
                             f"({mgr.num_total_gpu_blocks} blocks, {mgr.watermark_blocks} kept as the watermark)")

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> SamplingParams:
        """Typed errors for a request the engine could not run to its end; nothing changes.
        Returns the checked copy of ``params`` that the request keeps.

        Besides the prompt, the params are checked again (a field may have been changed since
        they were made), and the request must be able to run to its end alone in the pool: be
        admitted, with the watermark to spare, at its longest (the tokens cached when its last
        one is sampled), which a preemption by recomputation may ask of it. vLLM admits a
        request that outgrows the pool and, once it holds every block, preempts it and drops it,
        cut short; here it is refused before anything runs, so that every request accepted runs
        to its end.
        """
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        params = dataclasses.replace(params)           # a copy, checked again by its __post_init__
        self.check_prompt(prompt_token_ids)
        n = len(prompt_token_ids)
        longest = min(n + params.max_tokens, self.max_model_len) - 1
        mgr = self.block_manager
        need = cdiv(longest, self.block_size) + mgr.watermark_blocks
        if need > mgr.num_total_gpu_blocks:
            raise ValueError(f"the request may hold {longest} tokens in the cache ({n} prompt tokens, max_tokens="
                             f"{params.max_tokens}, max_model_len={self.max_model_len}): running to its end alone "
                             f"takes {need} blocks of {self.block_size} (the watermark of {mgr.watermark_blocks} "
                             f"included), but the pool has {mgr.num_total_gpu_blocks}; lower max_tokens or give "
                             f"the pool more blocks")
        return params

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: Optional[str] = None) -> None:
        """Queue a request (checked first: a refused request leaves the engine as it was)."""
        if request_id in self.requests:
            raise ValueError(f"request {request_id!r} is already in the engine")
        params = self.check_request(prompt_token_ids, params)
        seq = Sequence(next(self._seq_ids), list(prompt_token_ids), self.block_size)
        stop_ids = set(params.stop_token_ids or ())
        if not params.ignore_eos:
            stop_ids |= self.eos_token_ids
        # A seeded request draws from its own generator; the others from torch's global one.
        generator = None
        if not params.greedy and params.seed is not None:
            generator = torch.Generator(self.model.device)
            generator.manual_seed(params.seed)
        self.scheduler.add_seq_group(SequenceGroup(request_id, [seq], arrival_time=float(len(self.requests))))
        self._request_of_seq[seq.seq_id] = request_id
        self.requests[request_id] = _Request(request_id, prompt, list(prompt_token_ids), params, seq,
                                             frozenset(stop_ids), generator)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_seqs()

    # ---- one step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; return the requests that finished in it."""
        with torch.inference_mode():
            t0 = time.perf_counter()
            record = self.scheduler.schedule()
            t1 = time.perf_counter()
            try:
                return self._run(record, t0, t1)
            except BaseException:
                self.abort_all("the step failed")
                raise

    def _run(self, record: StepRecord, t0: float, t1: float) -> list[RequestOutput]:
        self._move_blocks(record)
        seqs, params, generators = [], [], []
        ids, positions, starts, seq_lens, block_ids, pads = [], [], [0], [], [], []
        for scheduled in record.scheduled_seq_groups:
            request = self.requests[scheduled.seq_group.request_id]
            seq = request.seq
            if seq.status != SequenceStatus.RUNNING:
                continue
            n = seq.get_len()
            start = n - scheduled.token_chunk_size
            if scheduled.is_prefill:
                request.num_cached_tokens = scheduled.num_cached_tokens
                start = max(start, scheduled.num_cached_tokens)
                if start >= n:
                    # The whole prompt is cached, but its last token's logits are needed: run that
                    # token again, but do not write its keys and values, which are in the cache
                    # already (a shared block: a rewrite could change another request's cache).
                    start = n - 1
                    pads.append(len(ids))
            ids += seq.get_token_ids()[start:n]
            positions += range(start, n)
            starts.append(len(ids))
            seq_lens.append(n)
            block_ids.append(self.block_manager.get_block_table(seq))
            seqs.append(seq)
            params.append(request.params)
            generators.append(request.generator)

        sampled: dict[int, int] = {}
        finished: dict[int, str] = {}
        graph_key = None
        t2 = t3 = time.perf_counter()
        if seqs:
            device = self.model.device
            input_ids = torch.tensor(ids, dtype=torch.int64).to(device, non_blocking=True)
            pos = torch.tensor(positions, dtype=torch.int64).to(device, non_blocking=True)
            query_start_loc = torch.tensor(starts, dtype=torch.int32).to(device, non_blocking=True)
            self._with_rows.update(s.seq_id for s in seqs)
            tables, slots = self.tables.prepare([s.seq_id for s in seqs], block_ids, query_start_loc, pos,
                                                starts, positions)
            slot_mapping = slots[:len(ids)]
            if pads:
                slot_mapping[torch.tensor(pads, device=device)] = PAD_SLOT_ID
            batch = ForwardBatch(query_start_loc, torch.tensor(seq_lens, dtype=torch.int32).to(device, non_blocking=True),
                                 tables[:len(seqs)], slot_mapping, max_query_len=max(b - a for a, b in zip(starts, starts[1:])),
                                 max_seq_len=max(seq_lens))
            if self.graphs is not None and batch.is_decode_only:
                graph_key = self.graphs.key(batch.num_reqs, batch.max_seq_len)
            t2 = time.perf_counter()
            if graph_key is not None:
                logits = self.graphs.run(graph_key, input_ids, pos, batch)
            else:
                logits = self.model.forward(input_ids, pos, batch, self.kv_caches, check=False)
            t3 = time.perf_counter()
            tokens = sample(logits, params, generators)
            for seq, token, p in zip(seqs, tokens, params):
                sampled[seq.seq_id] = token
                request = self.requests[self._request_of_seq[seq.seq_id]]
                num_out = seq.get_len() - seq.get_prompt_len() + 1
                if token in request.stop_ids:
                    finished[seq.seq_id] = "stop"
                elif num_out >= p.max_tokens or seq.get_len() + 1 >= self.max_model_len:
                    finished[seq.seq_id] = "length"
        t4 = time.perf_counter()

        self.scheduler.update(record, sampled, finished.keys())
        done = []
        for seq_id, reason in finished.items():
            done.append(self._finish(self._request_of_seq[seq_id], reason))
        for event in record.events:
            if event.kind in _END_REASONS and event.request_id in self.requests:
                done.append(self._finish(event.request_id, _END_REASONS[event.kind]))
        self._release_rows()
        t5 = time.perf_counter()
        self.step_stats.append(StepStats(record.step, len(seqs), len(ids), bool(seqs) and len(ids) == len(seqs),
                                         graph_key is not None, t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4))
        return done

    # ---- the pieces of a step -------------------------------------------------------------
    def _move_blocks(self, record: StepRecord) -> None:
        """Apply the step's block moves to every layer, in vLLM V0's order: swap in, swap out,
        copy. Pairs are device-relative block ids, as the scheduler hands them over."""
        for pairs, src, dst in ((record.blocks_to_swap_in, self.cpu_kv_caches, self.kv_caches),
                                (record.blocks_to_swap_out, self.kv_caches, self.cpu_kv_caches)):
            if pairs:
                mapping = torch.tensor(pairs, dtype=torch.int64)          # on the CPU, as swap_blocks wants
                for (src_k, src_v), (dst_k, dst_v) in zip(src, dst):
                    reference.swap_blocks(src_k, dst_k, block_mapping=mapping)
                    reference.swap_blocks(src_v, dst_v, block_mapping=mapping)
        if record.blocks_to_copy:
            mapping = torch.tensor(record.blocks_to_copy, dtype=torch.int64, device=self.model.device)
            reference.copy_blocks([k for k, _ in self.kv_caches], [v for _, v in self.kv_caches], mapping)

    def _release_rows(self) -> None:
        """Sequences that stopped running (finished, swapped out, recomputed) give their table row back."""
        for seq_id in [s for s in self._with_rows if s not in self._request_of_seq
                       or self.requests[self._request_of_seq[s]].seq.status != SequenceStatus.RUNNING]:
            self._with_rows.discard(seq_id)
            self.tables.release(seq_id)

    def _finish(self, request_id: str, reason: str) -> RequestOutput:
        request = self.requests.pop(request_id)
        del self._request_of_seq[request.seq.seq_id]
        request.finish_reason = reason
        return self.output(request)

    def output(self, request: _Request) -> RequestOutput:
        token_ids = list(request.seq.data.output_token_ids)
        text = self.detokenize(token_ids) if self.detokenize is not None else ""
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids,
                             [CompletionOutput(0, text, token_ids, request.finish_reason)],
                             finished=request.finish_reason is not None, num_cached_tokens=request.num_cached_tokens)

    detokenize = None    # set by LLM: token ids -> text

    def abort_all(self, why: str = "aborted") -> None:
        """Drop every unfinished request and free its blocks; the engine is then as new (its
        pools full, its prefix cache empty: a step that failed half-way may have marked blocks
        computed whose keys and values were never written)."""
        sched = self.scheduler
        if sched.history and sched.history[-1].step == sched.now:
            # A step was scheduled but not updated: close it, with nothing sampled.
            try:
                sched.update(sched.history[-1], {}, ())
            except Exception:
                sched.now = sched.history[-1].step + 1    # its requests are dropped below anyway
        for request_id in list(self.requests):
            sched.abort_seq_group(request_id, why)
            self._finish(request_id, "abort")
        self._release_rows()
        self.block_manager.reset_prefix_cache()
