"""The model runner: from a scheduler's step to sampled tokens, with per-request state kept across steps.

vLLM's model runner v2 (``vllm/v1/worker/gpu/model_runner.py``) in a few hundred lines. A step:

1. **Update states.** Finished and preempted requests give their request-state row back; new
   ones take a row and bring their tokens, computed count, sampling parameters and block ids
   (all of a step's new requests as one batch: a first step brings hundreds); running ones
   bring only the blocks they gained (``engine/tables.py`` keeps the rows).
2. **Prepare.** The host works out, in numpy, the batch's request-state rows (``idx_mapping``),
   ``query_start_loc``, every token's position and sequence length, and the token ids it knows
   (prompt tokens; ``-1`` for a token sampled in an earlier step), packs them into one pinned
   buffer, and ships it with **one** copy (a kernel that reads the buffer through UVA). On the
   device the tables gather the batch's rows and compute the slots, and each ``-1`` is replaced
   by the request's last sampled token, which never left the device: the host need not have
   seen it, so the next step can be prepared while this one runs (async scheduling,
   ``engine/llm_engine.py``).
3. **Execute.** A step replays a CUDA graph captured for its shape padded up
   (``engine/cuda_graphs.py``): a decode batch padded with rows that read one key and write
   nothing, a batch with prefills with requests that bring no token and tokens that belong to
   none. A shape with no graph (too large, or past the cap on graphs of prefill shapes) runs
   eagerly.
4. **Sample** one token per request on the device, store it as the request's last sampled token
   (the next step's input), and copy the tokens to pinned host memory behind a CUDA event (a
   kernel that writes them there through UVA). The caller reads them (``get_output``) when it
   needs them: to check stops and detokenize. A decode batch's graph also holds the copy of its
   inputs and the tables' gather, and a greedy one samples inside it too (the output
   projection, the argmax, the store and the copy out): the host launches one replay a step.

Without CUDA the same code runs on the CPU (no graphs, no events, copies are plain copies).
"""
from __future__ import annotations

import dataclasses
import itertools
import operator
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from paged_attention.engine.sampler import sample_tensor
from paged_attention.engine.tables import make_step_tables
from paged_attention.model import ForwardBatch, LlamaForCausalLM
from paged_attention.utils import PAD_SLOT_ID, next_power_of_2
from paged_attention.v1.core.sched.messages import ModelRunnerOutput
from paged_attention.v1.core.sched.output import SchedulerOutput
from paged_attention.v2.buffers import UvaBuffer, kernel_copy


_NEW_FIELDS = operator.attrgetter("req_id", "prefill_token_ids", "prompt_token_ids", "num_computed_tokens",
                                  "sampling_params", "block_ids")
_FIRST_GROUP = operator.itemgetter(0)       # the block ids of the one KV-cache group
_GREEDY = operator.attrgetter("greedy")


class RequestStates:
    """One row per running request, kept across steps (vLLM's ``RequestState``).

    Host: the tokens the request was (re)added with (``token_ids[row, :prefill_len[row]]``), its
    computed count, its sampling parameters. Device: its last sampled token. Row
    ``max_num_reqs`` is a padding row: the extra rows of a CUDA-graph batch point at it.
    """

    def __init__(self, max_num_reqs: int, max_model_len: int, device: torch.device) -> None:
        self.max_num_reqs, self.max_model_len = max_num_reqs, max_model_len
        self.pad_row = max_num_reqs
        self.index_of: dict[str, int] = {}
        self._free = list(range(max_num_reqs - 1, -1, -1))
        rows = max_num_reqs + 1
        self.token_ids = np.zeros((rows, max_model_len), dtype=np.int32)
        self.prefill_len = np.zeros(rows, dtype=np.int32)
        self.num_computed = np.zeros(rows, dtype=np.int32)
        self.greedy = np.ones(rows, dtype=bool)
        self.params: list = [None] * rows
        self.req_ids: list[Optional[str]] = [None] * rows
        self.last_sampled = torch.zeros(rows, dtype=torch.int32, device=device)
        # The last batch's rows (see ``rows``), valid while no request was added or removed.
        self._rows_key: Optional[list[str]] = None
        self._rows = np.zeros(0, dtype=np.int32)
        # Whether every request of the rows array last asked about is greedy (see all_greedy).
        self._greedy_rows: Optional[np.ndarray] = None
        self._all_greedy = True

    def rows(self, req_ids: list[str]) -> np.ndarray:
        """The rows of ``req_ids``, in order (read-only). A decode step usually runs the same
        requests as the last, in the same order: then the last answer serves again (comparing
        two lists of the same strings is much cheaper than 256 dict look-ups)."""
        if req_ids != self._rows_key:
            rows = np.fromiter(map(self.index_of.__getitem__, req_ids), dtype=np.int32, count=len(req_ids))
            rows.flags.writeable = False        # shared by the steps that reuse it
            self._rows, self._rows_key = rows, list(req_ids)
        return self._rows

    def all_greedy(self, rows: np.ndarray) -> bool:
        """Whether every request of ``rows`` samples greedily. Asked again about the same array
        (the read-only one ``rows`` hands out while the batch stays the same), the last answer
        serves: only ``add`` changes a row's sampling, and it forgets the answer."""
        if rows is not self._greedy_rows:
            self._all_greedy = bool(self.greedy[rows].all())
            self._greedy_rows = rows
        return self._all_greedy

    def add(self, req_id: str, token_ids: list[int], num_computed: int, params) -> int:
        """Give ``req_id`` a row holding ``token_ids``; its row (``add_many`` of one request)."""
        return int(self.add_many([req_id], [token_ids], [num_computed], [params])[0])

    def add_many(self, req_ids: list[str], token_ids: list[list[int]], num_computed: list[int],
                 params: list) -> np.ndarray:
        """Give each of ``req_ids`` a row, in order (the rows ``add`` would give one by one); the
        rows. All or none: a bad request raises (ValueError, TypeError...) with every request's
        state as it was. A step's new requests come this way at once (a first step brings
        hundreds): their counts, sampling and ids are written with one operation each."""
        n = len(req_ids)
        if not len(token_ids) == len(num_computed) == len(params) == n:
            raise ValueError(f"{n} request ids but {len(token_ids)} token lists, {len(num_computed)} computed "
                             f"counts and {len(params)} sampling params")
        if len(set(req_ids)) != n or not self.index_of.keys().isdisjoint(req_ids):
            seen = set()
            for req_id in req_ids:
                if req_id in self.index_of:
                    raise ValueError(f"request {req_id!r} already holds request state {self.index_of[req_id]}")
                if req_id in seen:
                    raise ValueError(f"request {req_id!r} is added twice in one batch")
                seen.add(req_id)
        if n > len(self._free):
            raise ValueError(f"all {self.max_num_reqs} request states are taken (max_num_seqs): "
                             f"{n} requests asked for {len(self._free)} free ones")
        lens = list(map(len, token_ids))
        for req_id, length, computed in zip(req_ids, lens, num_computed):
            if not 0 < length <= self.max_model_len or not 0 <= computed < length:
                raise ValueError(f"request {req_id!r}: {length} tokens ({computed} computed) do not fit "
                                 f"a request state of max_model_len={self.max_model_len}")
        # The rows the requests will take (the free list's last n, in the order pop gives them).
        # Their tokens go in while the rows are still free, and the params are read, before
        # anything is taken: a token int32 cannot hold (or params without ``greedy``) fails
        # here with every request's state as it was (a free row's tokens are never read).
        rows = self._free[:-n - 1:-1] if n else []
        for row, ids in zip(rows, token_ids):
            self.token_ids[row, :len(ids)] = ids
        greedy = list(map(_GREEDY, params))
        del self._free[len(self._free) - n:]
        self._rows_key = self._greedy_rows = None      # a request's row may have changed
        self.index_of.update(zip(req_ids, rows))
        for row, req_id, p in zip(rows, req_ids, params):
            self.req_ids[row], self.params[row] = req_id, p
        rows_np = np.array(rows, dtype=np.int64)
        self.prefill_len[rows_np] = lens
        self.num_computed[rows_np] = num_computed
        self.greedy[rows_np] = greedy
        return rows_np

    def remove(self, req_id: str) -> Optional[int]:
        """Free ``req_id``'s row (``remove_many`` of one request); its row, None if it had none."""
        return self.remove_many((req_id,))[0]

    def remove_many(self, req_ids: Iterable[str]) -> list[Optional[int]]:
        """Free each request's row, in order (the rows go back to the free list in that order,
        as one ``remove`` after another would put them); each one's row, None for a request
        that had none. A step's finished requests come this way at once (the last step of a
        batch finishes hundreds)."""
        pop, req_ids_of, params, free = self.index_of.pop, self.req_ids, self.params, self._free
        rows = []
        for req_id in req_ids:
            row = pop(req_id, None)
            rows.append(row)
            if row is not None:
                self._rows_key = None           # the rows of the last batch are stale
                req_ids_of[row] = params[row] = None
                free.append(row)
        return rows


class InputBuffers:
    """One step's integers, packed: ``[idx_mapping (B) | query_start_loc (B + 1) | seq_lens (B) |
    positions (T) | token ids (T) | token rows (T)]`` for a batch of ``B`` requests and ``T``
    tokens. The host fills a pinned buffer (two, used in turn: the copy of step n may still be
    queued while step n + 1 is packed) and one copy moves it: a kernel that reads the pinned
    buffer through UVA (``v2.buffers.kernel_copy``), so that no copy engine stands between the
    step's kernels. The device views of a decode bucket's layout never move, so a CUDA graph
    reads them."""

    def __init__(self, max_num_reqs: int, max_num_tokens: int, device: torch.device) -> None:
        size = 3 * max_num_reqs + 1 + 3 * max_num_tokens
        cuda = device.type == "cuda"
        self._uva = [UvaBuffer(size, torch.int32) for _ in range(2)] if cuda else None
        self.host = [b.cpu for b in self._uva] if cuda else [torch.zeros(size, dtype=torch.int32)]
        self.host_np = [h.numpy() for h in self.host]
        self.device = torch.zeros(size, dtype=torch.int32, device=device) if cuda else self.host[0]
        self._views: dict[tuple, tuple[torch.Tensor, ...]] = {}
        self._copies: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._layouts: list[Optional[tuple[int, np.ndarray]]] = [None] * len(self.host)
        self._turn = 0

    @staticmethod
    def offsets(num_reqs: int, num_tokens: int) -> tuple[int, ...]:
        b, t = num_reqs, num_tokens
        return 0, b, 2 * b + 1, 3 * b + 1, 3 * b + 1 + t, 3 * b + 1 + 2 * t, 3 * b + 1 + 3 * t

    @property
    def turn(self) -> int:
        """Which pinned buffer the step being prepared is packed into."""
        return self._turn

    @property
    def uva_copies(self) -> bool:
        """Whether ``copy`` is a kernel reading the pinned buffer through UVA (a graph can hold it)."""
        return self._uva is not None

    def next_host(self) -> np.ndarray:
        self._turn = (self._turn + 1) % len(self.host)
        return self.host_np[self._turn]

    def holds(self, layout: tuple[int, np.ndarray]) -> bool:
        """Whether the current host buffer was last filled for a decode step of ``layout`` =
        ``(padded requests, rows)``, the rows the same (read-only) array."""
        last = self._layouts[self._turn]
        return last is not None and last[1] is layout[1] and last[0] == layout[0]

    def record_layout(self, layout: Optional[tuple[int, np.ndarray]]) -> None:
        """What the current host buffer was just filled for (None: a step ``holds`` never matches)."""
        self._layouts[self._turn] = layout

    def copy(self, length: int) -> None:
        if self.device is not self.host[self._turn]:
            key = (self._turn, length)
            pair = self._copies.get(key)        # (slicing costs host microseconds: decode lengths are few)
            if pair is None:
                src = self._uva[self._turn].uva if self._uva is not None else self.host[self._turn]
                pair = self.device[:length], src[:length]
                if len(self._copies) < 4096:
                    self._copies[key] = pair
            if self._uva is not None:
                kernel_copy(*pair, check=False)
            else:                               # host buffers without UVA views (a test's stand-in)
                pair[0].copy_(pair[1])

    def views(self, num_reqs: int, num_tokens: int, num_real_reqs: Optional[int] = None,
              num_real_tokens: Optional[int] = None) -> tuple[torch.Tensor, ...]:
        """``(idx_mapping, query_start_loc, seq_lens, positions, token_ids, token_rows)`` on the
        device for a padded batch of ``num_reqs`` requests and ``num_tokens`` tokens, then the
        real batch's ``idx_mapping[:num_real_reqs]``, ``query_start_loc[:num_real_reqs + 1]`` and
        ``positions[:num_real_tokens]`` (the real counts default to the padded ones)."""
        n = num_reqs if num_real_reqs is None else num_real_reqs
        t = num_tokens if num_real_tokens is None else num_real_tokens
        key = (num_reqs, num_tokens, n, t)
        views = self._views.get(key)
        if views is None:
            o = self.offsets(num_reqs, num_tokens)
            views = tuple(self.device[a:b] for a, b in zip(o, o[1:]))
            views += (views[0][:n], views[1][:n + 1], views[3][:t])
            if n == t:                         # decode shapes: few, and graphs hold them
                self._views[key] = views
        return views


@dataclass
class StepInputs:
    """One step's inputs on the device, and the host facts the runner decided them by."""

    req_ids: list[str]
    num_reqs: int
    num_tokens: int
    idx_mapping: torch.Tensor
    idx_padded: torch.Tensor         # idx_mapping with a CUDA graph's padding rows (the padding state)
    positions: torch.Tensor
    token_ids: torch.Tensor          # -1 where the request's last sampled token goes
    token_rows: torch.Tensor
    idx_np: np.ndarray
    samples: Optional[np.ndarray]    # which requests sample (None: all); a prefill chunk that stops short does not
    batch: Optional[ForwardBatch]    # None: a decode graph's step, whose graph copies and gathers its inputs
    graph_key: Optional[tuple]


class RunnerOutput:
    """A step's sampled tokens on their way to the host (vLLM's ``AsyncModelRunnerOutput``): the
    copy was queued behind the step's work; ``get_output`` waits for it (a CUDA event) and
    returns the ``ModelRunnerOutput``. The step's host timings (seconds) and GPU events ride along."""

    def __init__(self, req_ids: list[str], tokens: Optional[torch.Tensor], event, *, decode_only: bool,
                 cuda_graph: bool, num_tokens: int, prepare: float, forward: float, sample: float,
                 gpu_events: Optional[tuple] = None, samples: Optional[np.ndarray] = None,
                 req_id_to_index: Optional[dict[str, int]] = None) -> None:
        self.req_ids, self._tokens, self._event, self._samples = req_ids, tokens, event, samples
        if req_id_to_index is None:
            req_id_to_index = dict(zip(req_ids, range(len(req_ids))))
        self._req_id_to_index = req_id_to_index
        self.decode_only, self.cuda_graph, self.num_tokens = decode_only, cuda_graph, num_tokens
        self.prepare, self.forward, self.sample = prepare, forward, sample
        self.gpu_events = gpu_events
        self.wait = 0.0
        self._output: Optional[ModelRunnerOutput] = None

    def get_output(self) -> ModelRunnerOutput:
        if self._output is None:
            t0 = time.perf_counter()
            if self._event is not None:
                self._event.synchronize()
            tokens = self._tokens.tolist() if self._tokens is not None else []
            self.wait = time.perf_counter() - t0
            if self._samples is None:
                sampled = [[t] for t in tokens]
            else:                               # prefill chunks that stop short sample nothing
                sampled = [[t] if s else [] for t, s in zip(tokens, self._samples.tolist())]
            self._output = ModelRunnerOutput(self.req_ids, self._req_id_to_index, sampled)
        return self._output


class ModelRunner:
    """The model, its KV caches, the request states and tables, the graphs and the sampler."""

    def __init__(self, model: LlamaForCausalLM, kv_caches: list, *, block_size: int, max_num_reqs: int,
                 max_num_batched_tokens: int, max_model_len: int, block_tables: str = "auto",
                 cuda_graphs: bool = True, record_gpu_time: bool = False) -> None:
        self.model, self.kv_caches = model, kv_caches
        self.device = model.device
        self.max_num_reqs, self.max_model_len = max_num_reqs, max_model_len
        self.states = RequestStates(max_num_reqs, max_model_len, self.device)
        self.tables = make_step_tables(block_tables, block_size, max_num_reqs, max_num_batched_tokens,
                                       max_model_len, self.device)
        self.buffers = InputBuffers(max_num_reqs, max_num_batched_tokens, self.device)
        cuda = self.device.type == "cuda"
        self.graphs = None
        # The reference decode reads lengths back to the host, which a capture does not allow.
        if cuda_graphs and cuda and model.attention_impl != "reference":
            from paged_attention.engine.cuda_graphs import StepGraphs
            # Steps with prefills too, where the attention reads its layout on the device (the
            # paged prefill kernel); a split into decodes and prefills is made on the host.
            self.graphs = StepGraphs(max_num_reqs, max_num_batched_tokens, max_model_len, self.device,
                                     max_mixed=0 if model.attn.needs_split else 32)
        # The sampled tokens' host copies, two in turn: a step's tokens are read after the next
        # step is launched (async scheduling), which writes the other one. On a GPU a kernel
        # writes them through UVA (``kernel_copy``), as the step's inputs come in.
        self._sampled_uva = [UvaBuffer(max_num_reqs, torch.int64) for _ in range(2)] if cuda else None
        self._sampled_host = [b.cpu for b in self._sampled_uva] if cuda else \
            [torch.zeros(max_num_reqs, dtype=torch.int64) for _ in range(2)]
        self._sampled_views: dict[tuple[int, int], tuple[torch.Tensor, Optional[torch.Tensor]]] = {}
        self._row_views: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}    # see _first_rows
        # Their events, in the same turn: a step's event is recorded again two steps later, when
        # its host copy is written again (by then the engine has read both).
        self._events = [torch.cuda.Event() for _ in range(2)] if cuda else None
        self._turn = 0
        self.record_gpu_time = record_gpu_time and cuda
        # A decode graph's step copies its inputs, gathers its tables and (greedy) copies its tokens
        # out inside the graph, where the input copy reads pinned memory through UVA and the gather
        # reads only device memory: three launches a step fewer for the host (``_device_step``).
        self._inputs_in_graph = (self.graphs is not None and self.buffers.uva_copies
                                 and self.tables.captures_gather)
        self._generators: dict[str, Optional[torch.Generator]] = {}
        # The last batch's request ids and their positions in it, the ``ModelRunnerOutput``'s
        # index: kept while the batch stays the same (``batch_index``).
        self._batch_req_ids: list[str] = []
        self._batch_index: dict[str, int] = {}
        self.num_preemptions = 0            # requests dropped by a preemption (to be recomputed)

    # ---- 1. states ------------------------------------------------------------------------
    def update_states(self, so: SchedulerOutput) -> None:
        """Apply what the scheduler decided since the last step to the request states and tables."""
        states = self.states
        if so.finished_req_ids:
            states.remove_many(so.finished_req_ids)
            generators = self._generators
            if generators:                  # (none at all while every request is greedy)
                for req_id in so.finished_req_ids:
                    generators.pop(req_id, None)
        for req_id in so.preempted_req_ids:
            self.num_preemptions += states.remove(req_id) is not None
        if so.scheduled_new_reqs:
            self._add_requests(so.scheduled_new_reqs)
        cached = so.scheduled_cached_reqs
        if not cached.req_ids:
            return
        # Every running request's computed count at once; then the few that gained blocks
        # (None for the others: their positions are found by a scan in C, not a Python loop).
        rows = states.rows(cached.req_ids)
        states.num_computed[rows] = cached.num_computed_tokens
        new_block_ids = cached.new_block_ids
        if new_block_ids.count(None) == len(new_block_ids):
            return                              # no request gained a block (most decode steps)
        resumed = cached.resumed_req_ids
        gained = list(itertools.compress(range(len(new_block_ids)), map(operator.is_not, new_block_ids,
                                                                          itertools.repeat(None))))
        if resumed and not resumed.isdisjoint(map(cached.req_ids.__getitem__, gained)):
            # A resumed request's blocks replace its row (rare: after a preemption): one by one.
            for i in gained:
                new_ids, req_id = new_block_ids[i], cached.req_ids[i]
                if new_ids[0] or req_id in resumed:
                    self.tables.set_row(int(rows[i]), new_ids[0], overwrite=req_id in resumed)
            return
        # Only appends: one batch for them all (on a block-boundary step every running request
        # gains a block, and one call per request would cost the host that many checks).
        picked = [i for i in gained if new_block_ids[i][0]]
        if picked:
            self.tables.set_rows(rows[picked], [new_block_ids[i][0] for i in picked], overwrite=False)

    def _add_requests(self, new_reqs: list) -> None:
        """The step's new requests: their states, then their rows of the tables, each as one
        batch; a bad request (tokens, ids, blocks) raises with none of them added."""
        states = self.states
        # The fields as columns, read in C (a step of one new request is common: its fixed
        # cost counts as much as a first step's per-request cost).
        req_ids, prefill, prompts, computed, params, block_ids = map(list, zip(*map(_NEW_FIELDS, new_reqs)))
        tokens = prompts if prefill.count(None) == len(prefill) else [
            ids if ids is not None else prompt for ids, prompt in zip(prefill, prompts)]
        rows = states.add_many(req_ids, tokens, computed, params)
        try:
            self.tables.set_rows(rows, list(map(_FIRST_GROUP, block_ids)), overwrite=True)
        except BaseException:
            states.remove_many(reversed(req_ids))   # the free rows go back in the order they were taken
            raise
        # Only a request that samples can have a generator (a greedy one's is None, which
        # ``_generators.get`` gives too): the greedy flags just written pick them out at once.
        greedy = states.greedy[rows]
        if not greedy.all():
            generators = self._generators
            for i in np.flatnonzero(~greedy).tolist():
                if req_ids[i] not in generators:    # (a resumed request keeps its generator)
                    generators[req_ids[i]] = self._generator(params[i])

    def batch_index(self, req_ids: list[str]) -> tuple[list[str], dict[str, int]]:
        """``req_ids`` and each one's position in it. The same requests as the last batch's, in
        the same order (most decode steps), get the last list and dict back, not a new dict of
        every request: neither is ever changed after it is made."""
        if req_ids != self._batch_req_ids:
            self._batch_req_ids, self._batch_index = req_ids, dict(zip(req_ids, range(len(req_ids))))
        return self._batch_req_ids, self._batch_index

    def reset(self) -> None:
        """Forget every request (the engine dropped them all); staged table writes included."""
        for req_id in list(self.states.index_of):
            self.states.remove(req_id)
        self._generators.clear()
        self.tables.reset()

    def _generator(self, params) -> Optional[torch.Generator]:
        """A seeded request draws from its own generator (its tokens then do not depend on the
        batch, nor on preemptions: the generator lives until the request finishes); an unseeded
        one from torch's global generator."""
        if params.greedy or params.seed is None:
            return None
        return torch.Generator(self.device).manual_seed(params.seed)

    # ---- 2. prepare -----------------------------------------------------------------------
    def prepare_inputs(self, so: SchedulerOutput) -> StepInputs:
        states = self.states
        counts_by_req = so.num_scheduled_tokens
        req_ids, _ = self.batch_index(list(counts_by_req))
        n, num_tokens = len(req_ids), so.total_num_scheduled_tokens
        idx = states.rows(req_ids)
        start = states.num_computed[idx]
        decode_only = num_tokens == n
        if decode_only:                         # one token each: no counts to read
            seq_lens = start + 1
            positions, rows = start, idx
        else:
            counts = np.fromiter(counts_by_req.values(), dtype=np.int32, count=n)
            seq_lens = start + counts
            qsl = np.zeros(n + 1, dtype=np.int32)
            np.cumsum(counts, out=qsl[1:])
            rows = np.repeat(idx, counts)
            # token t of request b sits at start[b] + (t - qsl[b])
            positions = np.arange(num_tokens, dtype=np.int32) + np.repeat(start - qsl[:-1], counts)
        # Tokens the host knows (those the request was added with); -1: its last sampled token.
        # (Each request's count repeated over its tokens: cheaper than indexing by every token's row.)
        prefill_len = states.prefill_len[idx]
        known = positions < (prefill_len if decode_only else np.repeat(prefill_len, counts))
        if known.any():
            # One gather from the flattened table (half the cost of indexing it by row and column).
            at = rows.astype(np.intp) * self.max_model_len
            at += np.minimum(positions, self.max_model_len - 1)
            ids = states.token_ids.reshape(-1)[at]
            if not known.all():
                ids = np.where(known, ids, -1)
        else:
            ids = None
        # A request samples once this step reaches the end of the tokens it was added with.
        samples = None if decode_only else seq_lens >= prefill_len
        if samples is not None and samples.all():
            samples = None
        # The bound the kernels size their work by, rounded up on a GPU (a decode kernel's launch is
        # planned once per bound: an exact one would make a new plan every step).
        max_seq_len = int(seq_lens.max())
        if self.device.type == "cuda":
            max_seq_len = min(max(256, next_power_of_2(max_seq_len)), self.max_model_len)
        max_query_len = 1 if decode_only else int(counts.max())
        graph_key = None
        if self.graphs is not None:
            graph_key = (self.graphs.key(n, max_seq_len) if decode_only else
                         self.graphs.mixed_key(n, num_tokens, max_query_len, max_seq_len))
        if graph_key is not None:
            # (requests, tokens, query bound) padded to the graph's; its bounds size the kernels.
            b, t, max_query_len = graph_key[:3]
        else:
            b, t = n, num_tokens

        # One pinned buffer, one copy. Padding: rows of the padding state, one key, no slot.
        buf = self.buffers.next_host()
        o = InputBuffers.offsets(b, t)
        # A decode step of the same rows (the same array) as this buffer's last decode step only
        # changes its sequence lengths and positions: the rest of the buffer already holds it.
        layout = (b, idx) if decode_only and ids is None else None
        if layout is not None and self.buffers.holds(layout):
            buf[o[2]:o[2] + n] = seq_lens
            buf[o[3]:o[3] + n] = positions
        else:
            buf[o[0]:o[0] + n] = idx
            buf[o[0] + n:o[1]] = states.pad_row
            if decode_only:
                # One token a request; padding requests bring none (their slots are PAD_SLOT_ID).
                buf[o[1]:o[1] + n + 1] = np.arange(n + 1, dtype=np.int32)
                buf[o[1] + n + 1:o[2]] = n
            else:
                # A padded batch with prefills: the padding requests bring no token, and the
                # padding tokens (past the last request's) belong to none.
                buf[o[1]:o[1] + n + 1] = qsl
                buf[o[1] + n + 1:o[2]] = num_tokens
            buf[o[2]:o[2] + n] = seq_lens
            buf[o[2] + n:o[3]] = 1
            buf[o[3]:o[3] + num_tokens] = positions
            buf[o[3] + num_tokens:o[4]] = 0
            buf[o[4]:o[5]] = -1
            if ids is not None:
                buf[o[4]:o[4] + num_tokens] = ids
            buf[o[5]:o[5] + num_tokens] = rows
            buf[o[5] + num_tokens:o[6]] = states.pad_row
            self.buffers.record_layout(layout)
        idx_dev, qsl_dev, seq_lens_dev, pos_dev, ids_dev, rows_dev, idx_n, qsl_n, pos_n = self.buffers.views(
            b, t, n, num_tokens)
        no_kv_write = getattr(so, "no_kv_write_req_ids", None)       # the legacy core's, see there
        if decode_only and graph_key is not None and self._inputs_in_graph and not no_kv_write:
            # The copy and the tables' gather go into the decode graph (``_device_step``), which
            # reads and writes these views' addresses at every replay.
            self.tables.apply_staged()
            return StepInputs(req_ids, n, num_tokens, idx_n, idx_dev, pos_dev, ids_dev, rows_dev, idx, samples,
                              None, graph_key)
        self.buffers.copy(o[6])

        block_tables, slot_mapping = self.tables.prepare(idx_n, qsl_n, pos_n, rows, positions, b, t)
        if no_kv_write:
            at = [int(buf[o[1] + i]) for i, r in enumerate(req_ids) if r in no_kv_write]
            slot_mapping[torch.tensor(at, device=self.device)] = PAD_SLOT_ID
        host_layout = {}
        if not decode_only:
            host_layout = dict(query_start_loc_cpu=buf[o[1]:o[2]].tolist(), seq_lens_cpu=buf[o[2]:o[3]].tolist(),
                               padded=(b, t) != (n, num_tokens))
        batch = ForwardBatch(qsl_dev, seq_lens_dev, block_tables, slot_mapping,
                             max_query_len=max_query_len, max_seq_len=max_seq_len, **host_layout)
        return StepInputs(req_ids, n, num_tokens, idx_n, idx_dev, pos_dev, ids_dev, rows_dev, idx, samples, batch,
                          graph_key)

    def input_ids(self, token_ids: torch.Tensor, token_rows: torch.Tensor) -> torch.Tensor:
        """Each token's id: the host's, or (``-1``) its request's last sampled token."""
        return torch.where(token_ids >= 0, token_ids, self.states.last_sampled[token_rows])

    # ---- 3. execute and 4. sample -----------------------------------------------------------
    def execute_model(self, so: SchedulerOutput) -> RunnerOutput:
        """Run one step; the sampled tokens come back through the returned ``RunnerOutput``."""
        if torch.is_inference_mode_enabled():
            return self._execute_model(so)        # the engine's step entered it already
        with torch.inference_mode():
            return self._execute_model(so)

    def _execute_model(self, so: SchedulerOutput) -> RunnerOutput:
        t0 = time.perf_counter()
        self.update_states(so)
        if not so.num_scheduled_tokens:
            return RunnerOutput([], None, None, decode_only=False, cuda_graph=False, num_tokens=0,
                                prepare=time.perf_counter() - t0, forward=0.0, sample=0.0)
        inputs = self.prepare_inputs(so)
        events = None       # (from here: a GPU that waits for the host's preparation is idle, not busy)
        if self.record_gpu_time:
            events = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            events[0].record()
        t1 = time.perf_counter()
        n = inputs.num_reqs
        greedy = self.states.all_greedy(inputs.idx_np)
        if inputs.batch is None:
            # A decode graph that copies and gathers its inputs; a greedy one copies its tokens out
            # too. A graph reads and writes the pinned buffers of the turns it was captured in.
            turn_in = self.buffers.turn
            turn_out = (self._turn + 1) % len(self._sampled_host) if greedy else None
            key = inputs.graph_key + ((turn_in, "greedy", turn_out) if greedy else (turn_in,))
            out = self.graphs.run(key, lambda: self._device_step(inputs, turn_out))
            t2 = time.perf_counter()
            if greedy:
                self._turn = turn_out
                tokens = self._host_views(turn_out, n)[0]
            else:
                tokens = self._to_host(self._sample(self._first_rows(key, out, n), inputs, greedy), n)
        elif inputs.graph_key is not None and greedy:
            # A greedy step is one graph from the inputs to the tokens: the model, the output
            # projection, the argmax and each request's last token kept on the device.
            key = inputs.graph_key + ("greedy",)
            sampled = self._first_rows(key, self.graphs.run(key, lambda: self._forward_greedy(inputs)), n)
            t2 = time.perf_counter()
        else:
            if inputs.graph_key is not None:
                hidden = self._first_rows(inputs.graph_key, self.graphs.run(inputs.graph_key,
                                                                            lambda: self._forward(inputs)), n)
            else:
                hidden = self._forward(inputs)
            t2 = time.perf_counter()
            sampled = self._sample(hidden, inputs, greedy)
        if inputs.batch is not None:
            tokens = self._to_host(sampled, n)
        if events is not None:
            events[1].record()
        out = RunnerOutput(inputs.req_ids, tokens, self._event(), decode_only=inputs.num_tokens == n,
                           cuda_graph=inputs.graph_key is not None, num_tokens=inputs.num_tokens,
                           prepare=t1 - t0, forward=t2 - t1, sample=0.0, gpu_events=events,
                           samples=inputs.samples,
                           req_id_to_index=self._batch_index if inputs.req_ids is self._batch_req_ids else None)
        out.sample = time.perf_counter() - t2        # the copy, the event and this output
        return out

    def _first_rows(self, key: tuple, out: torch.Tensor, n: int) -> torch.Tensor:
        """``out[:n]`` of graph ``key``'s output: a replay returns the same tensor every time, so
        its view is made once (slicing costs host microseconds every step)."""
        made = self._row_views.get((key, n))
        if made is None or made[0] is not out:
            made = self._row_views[key, n] = (out, out[:n])
        return made[1]

    def _device_step(self, inputs: StepInputs, turn_out: Optional[int]) -> torch.Tensor:
        """A decode graph's step from its packed inputs (``prepare_inputs`` left them in the pinned
        buffer): the copy, the tables' gather over the padded batch, the model, and with
        ``turn_out`` (greedy) the tokens, every padded row's, copied to that turn's pinned buffer.
        Returns the hidden states, or (greedy) the tokens."""
        b, t, _, max_seq_len = inputs.graph_key[:4]
        self.buffers.copy(InputBuffers.offsets(b, t)[-1])
        _, qsl, seq_lens, *_ = self.buffers.views(b, t)
        block_tables, slot_mapping = self.tables.gather_padded(inputs.idx_padded, qsl, inputs.positions)
        batch = ForwardBatch(qsl, seq_lens, block_tables, slot_mapping, max_query_len=1, max_seq_len=max_seq_len)
        inputs = dataclasses.replace(inputs, batch=batch)
        if turn_out is None:
            return self._forward(inputs)
        sampled = self._forward_greedy(inputs)
        self._copy_out(sampled, turn_out, b)
        return sampled

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        ids = self.input_ids(inputs.token_ids, inputs.token_rows)
        return self.model.hidden_states(ids, inputs.positions, inputs.batch, self.kv_caches, check=False)

    def _forward_greedy(self, inputs: StepInputs) -> torch.Tensor:
        """A batch's greedy tokens, every padded row's (what a graph captures): padding rows
        write their token to the padding state's last token, which only padding reads."""
        sampled = self.model.greedy_tokens(self._forward(inputs))
        self.states.last_sampled[inputs.idx_padded] = sampled.to(torch.int32)
        return sampled

    def _sample(self, hidden: torch.Tensor, inputs: StepInputs, greedy: bool) -> torch.Tensor:
        """Sample on the device, and keep each token as its request's last (the next step's input)."""
        states = self.states
        if greedy:
            sampled = self.model.greedy_tokens(hidden)
        else:
            # A request that samples nothing this step (a prefill chunk) draws nothing either.
            params = [states.params[r] for r in inputs.idx_np]
            if inputs.samples is not None:
                params = [p if s else None for p, s in zip(params, inputs.samples.tolist())]
            sampled = sample_tensor(self.model.compute_logits(hidden), params,
                                    [self._generators.get(r) for r in inputs.req_ids])
        states.last_sampled[inputs.idx_mapping] = sampled.to(torch.int32)
        return sampled

    def _host_views(self, turn: int, n: int) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The first ``n`` tokens of turn ``turn``'s pinned buffer: on the host, and (UVA) on the device."""
        views = self._sampled_views.get((turn, n))
        if views is None:                       # (at most 2 * max_num_reqs views, made once)
            uva = self._sampled_uva[turn].uva[:n] if self._sampled_uva is not None else None
            views = self._sampled_views[turn, n] = (self._sampled_host[turn][:n], uva)
        return views

    def _to_host(self, sampled: torch.Tensor, n: int) -> torch.Tensor:
        """Queue the copy of a step's tokens to pinned host memory (read after the step's event)."""
        self._turn = (self._turn + 1) % len(self._sampled_host)
        return self._copy_out(sampled, self._turn, n)

    def _copy_out(self, sampled: torch.Tensor, turn: int, n: int) -> torch.Tensor:
        """Queue the copy of ``n`` tokens to turn ``turn``'s pinned buffer; its host view."""
        host, uva = self._host_views(turn, n)
        if uva is not None:
            if sampled.dtype != torch.int64 or not sampled.is_contiguous():     # (the copy is flat, int64)
                sampled = sampled.to(torch.int64).contiguous()
            kernel_copy(uva, sampled, check=False)
        else:
            host.copy_(sampled)
        return host

    def _event(self):
        """The event of the host copy ``_to_host`` just queued (the same turn's), recorded."""
        if self._events is None:
            return None
        event = self._events[self._turn]
        event.record()
        return event


__all__ = ["ModelRunner", "RequestStates", "RunnerOutput", "InputBuffers", "StepInputs"]
