"""Property-based stateful tests of the legacy block manager, driven the way a scheduler drives it.

Hypothesis plays a small V0-style scheduler against ``SelfAttnBlockSpaceManager`` on small pools
(down to a single CPU block): requests arrive with one or several parallel samples, are admitted
when ``can_allocate`` says OK, have their prompts computed whole or in chunks of one to two
blocks, decode one token per step when ``can_append_slots`` allows it, and are otherwise
preempted (by swapping a group out, or by recomputing a single sequence); swapped groups come
back when ``can_swap_in`` says OK; running sequences fork, finish and get aborted, and requests
swapped out to the CPU or half way through their prefill are aborted too. Tokens come from a tiny
alphabet and prompts share a few prefixes, so the prefix cache hits; some prompts are sized to
leave a block or two free, so the checks meet their boundaries. A plain model keeps each
sequence's tokens and what its block table should look like.

A model step goes as in vLLM: the scheduler marks the group's blocks computed for the chunk it
schedules (``mark_blocks_as_computed(group, token_chunk_size)``), the model reads the KV of the
tokens computed before and of those the prefix cache supplied (``get_num_cached_tokens`` at
admission), writes the KV of the chunk, and then ``update_num_computed_tokens`` counts the chunk.

The test keeps a physical KV cache: one value per slot of every GPU and CPU block. The value of a
token's KV is a hash of the adapter and of every token up to and including it (all its KV depends
on). A slot changes only through what the manager hands out: the model writing a step's tokens
into the slots its table names, the copy-on-write pairs of ``append_slots`` (the whole block is
copied) and the pairs of ``swap_out``/``swap_in`` (GPU block to CPU block and back). A freed block
keeps its stale values, as memory does.

Checked after every step:

1. the manager's free counts equal the allocators' and an independent count (total minus the
   distinct physical ids the live tables and the null block reference; a prefix-cached block
   nobody holds waits in the evictor and counts as free);
2. exactly the live (running or swapped) sequences have tables, and every reference count is
   the number of table blocks holding that id (plus one, the allocator's, for the null block);
3. every table holds exactly its sequence's appended tokens (null-block positions aside), has
   the expected length and dropped prefix, and lives on the device its status says; two tables
   sharing a physical block agree on everything that block's KV depends on;
4. swapping a group out and back in gives every sequence back its tokens and table shape;
5. a call that raises (blocks ran out, or a refused bad call) changes nothing;
6. every token a sequence has computed reads back its own KV through its table, on the GPU or,
   swapped out, on the CPU (positions the sliding window dropped aside), and so do, before a
   step, the tokens the prefix cache told it to skip: a lost copy, a wrong swap pair, a wrong
   share or KV claimed before it was written shows here;
7. every GPU block the prefix cache counts as computed (held, or waiting in the evictor) holds
   the KV of the tokens its hash names: a block counts as computed only once its KV is written,
   even when a chunk covers only part of the prompt or the request is aborted part way;
8. every block object in a table is one its allocator's pool counts as in use, and a pool's
   free list names distinct objects of its own (a swapped-out request freed by an abort must
   give its block objects back to the pool that made them).

Every "yes" from the manager's checks is a promise, and is held to it: a call made after OK
(``can_append_slots``, ``can_swap_out``, ``can_swap_in``) never runs out of blocks, and each
check's answer equals an independent count of the blocks the call can take (only a call forced
past a "no" may run out, and it then changes nothing). One behaviour inherited from vLLM is left
as it is, and is recognised precisely (and counted, ``window_admission_overcommit``) rather than
treated as a pass: ``can_allocate`` caps a windowed prompt at the window, but ``allocate`` holds
every block of the prompt, so an OK admission can run out of blocks.

Five other inherited behaviours, once tolerated and counted here, were fixed in the library and
are now asserted:

* ``can_append_slots`` and ``can_swap_in`` count the null block (one GPU block, while a window
  is set and the null block is not made yet), which the first windowed append allocates;
* ``_can_swap`` counts every block that is not full (empty blocks that lookahead slots reserved
  earlier move too) and the new blocks past their empty slots, and says NEVER (``can_swap_out``:
  no) for a group holding the null block, which ``swap_out`` refuses (a swap-out forced past
  that "no" raises ``ValueError`` and changes nothing);
* ``find_cached_blocks_prefix`` scans up to the first block that is not cached with its KV
  computed, so a fresh cached-token count is exactly the leading cached blocks (vLLM's binary
  search could land past a hole in a cache that is not prefix-closed);
* ``allocate`` drops a cached-token count taken while the request waited (the tracker keeps it,
  stable, while the sequence is in prefill), so after admission the count is exact again even
  when the blocks were evicted since.
"""
import sys
from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from paged_attention.legacy.block_manager import AllocStatus, SelfAttnBlockSpaceManager
from paged_attention.legacy.common import BlockStateError
from paged_attention.legacy.cpu_gpu_block_allocator import NullBlock
from paged_attention.legacy.interfaces import BlockAllocator
from paged_attention.legacy.prefix_caching_block import PrefixCachingBlock
from paged_attention.legacy.sequence import Sequence, SequenceGroup, SequenceStatus
from paged_attention.utils import Device, cdiv

from legacy_state import allocator_state

GPU, CPU = Device.GPU, Device.CPU
WAITING, RUNNING, SWAPPED = SequenceStatus.WAITING, SequenceStatus.RUNNING, SequenceStatus.SWAPPED
NoFreeBlocks = BlockAllocator.NoFreeBlocksError
MAX_GROUPS, MAX_LIVE_SEQS = 4, 8
PREFIXES = ([], [0, 1, 2, 0], [0, 1, 2, 0, 1, 2, 0, 1], [2, 2, 2, 2, 2, 2])   # shared system prompts
indices = st.integers(0, 99)
lookaheads = st.sampled_from([0, 0, 0, 1, 2])
forced = st.sampled_from([False, False, False, True])      # a scheduler that ignores a "no"
chunks = st.sampled_from([None, None, 1, 2, 3, 4, 5, 6, 7, 8])  # prefill chunk (cut to 1..2 blocks); None: all


class _SeqModel:
    """What a sequence's table should hold: ``n`` of its ``tokens`` appended, ``num_blocks``
    blocks (lookahead slots may reserve more than the tokens need), ``nulls`` leading positions
    dropped by the sliding window. ``value(i)`` is the KV the model writes for token ``i``: a
    hash chained over the adapter and every token up to and including ``i`` (what the KV of a
    token depends on)."""

    def __init__(self, tokens, lora, n=0, num_blocks=0, nulls=0):
        self.tokens, self.lora, self.n, self.num_blocks, self.nulls = list(tokens), lora, n, num_blocks, nulls
        self.values = []
        self.hashes = []                # prefix hashes of the full blocks of ``tokens`` (all of them)

    def copy(self):
        twin = _SeqModel(self.tokens, self.lora, self.n, self.num_blocks, self.nulls)
        twin.values, twin.hashes = list(self.values), list(self.hashes)
        return twin

    def value(self, i):
        while len(self.values) <= i:
            j = len(self.values)
            self.values.append(hash((self.values[-1] if j else ("kv", self.lora), self.tokens[j])))
        return self.values[i]

    def clear(self):
        self.n = self.num_blocks = self.nulls = 0


def _blocks_touched(num_full, num_slots, block_size):
    """Blocks an append of ``num_slots`` slots after ``num_full`` tokens touches: those covering
    [num_full, num_full + num_slots); with no slots, the partly filled last block if any."""
    if num_slots == 0:
        return 1 if num_full % block_size else 0
    return (num_full + num_slots - 1) // block_size - num_full // block_size + 1


class ManagerMachine(RuleBasedStateMachine):
    enable_caching = False
    windowed = False
    counters: Counter = Counter()          # replaced per run by the test

    def _count(self, name, k=1):
        type(self).counters[name] += k

    @initialize(block_size=st.sampled_from([1, 2, 2, 4, 4]), num_gpu=st.integers(8, 16), num_cpu=st.sampled_from([1, 2, 4, 8, 8, 16]),
                watermark=st.sampled_from([0.0, 0.0, 0.15, 0.25]), window=st.sampled_from([1, 2, 4]))
    def setup(self, block_size, num_gpu, num_cpu, watermark, window):
        self.bs, self.G, self.C = block_size, num_gpu, num_cpu
        self.mgr = SelfAttnBlockSpaceManager(block_size, num_gpu, num_cpu, watermark=watermark,
                                             sliding_window=window if self.windowed else None,
                                             enable_caching=self.enable_caching)
        self.groups: list[SequenceGroup] = []
        self.model: dict[int, _SeqModel] = {}
        self.swap_records: dict[int, tuple] = {}
        self.finished_ids: set[int] = set()
        self.probed: dict[int, int] = {}       # waiting sequences asked for their cached tokens: the count
        self.claims: dict[int, int] = {}       # admitted sequences: the cached tokens the manager gave
        self.next_seq_id = self.next_request = 0
        self.now = 0.0
        # The physical KV cache: one value per slot, (absolute block id, offset) -> value, GPU
        # and CPU blocks alike. A slot never written has no entry; a freed block keeps its values.
        self.memory: dict[tuple[int, int], int] = {}
        self.block_kv: dict[int, tuple] = {}        # prefix hash -> the values of that block's tokens

    # ---- helpers ------------------------------------------------------------------------------
    def _new_seq(self, tokens, lora):
        seq = Sequence(self.next_seq_id, list(tokens), self.bs, lora_int_id=lora)
        self.next_seq_id += 1
        self.model[seq.seq_id] = _SeqModel(tokens, lora)
        self._register(seq)
        return seq

    @staticmethod
    def _live(group):
        return [s for s in group.seqs if not s.is_finished()]

    def _status(self, group):
        statuses = {s.status for s in self._live(group)}
        assert len(statuses) == 1, statuses          # a group's live sequences move together
        return statuses.pop()

    def _groups_in(self, status):
        return [g for g in self.groups if self._status(g) == status]

    def _num_live(self):
        return sum(len(self._live(g)) for g in self.groups)

    def _table(self, seq):
        return self.mgr.block_tables[seq.seq_id]

    def _rc(self, device, block_id):
        return self.mgr.block_allocator._allocators[device].refcounter.get(block_id)

    def _snapshot(self):
        """Everything a call could change: counts, free lists, refcounts, caches, tables."""
        mgr, a = self.mgr, self.mgr.block_allocator
        state = [mgr.get_num_free_gpu_blocks(), mgr.get_num_free_cpu_blocks(), dict(a._swap_mapping),
                 None if a._null_block is None else a._null_block.block_id,
                 dict(mgr._last_access_blocks_tracker._seq_last_access), dict(mgr.cross_block_tables)]
        for device in (GPU, CPU):
            state += allocator_state(a._allocators[device])
        state.append({sid: (list(t.physical_block_ids), [list(b.token_ids) for b in t.blocks], t.num_full_slots,
                            [id(b) for b in t.blocks]) for sid, t in mgr.block_tables.items()})
        return state

    def _query(self, call):
        """A question to the manager must not change it."""
        before = self._snapshot()
        answer = call()
        assert self._snapshot() == before
        return answer

    def _refused(self, call, errors):
        """A bad call must raise and leave everything as it was."""
        before = self._snapshot()
        with pytest.raises(errors):
            call()
        assert self._snapshot() == before
        self._count("refused_calls")

    def _touch(self, group):
        self.now += 1
        for seq in group.get_seqs(RUNNING):
            self.mgr.access_all_blocks_in_seq(seq, self.now)

    # ---- the physical KV cache -------------------------------------------------------------------
    def _register(self, seq):
        """Note the prefix hash of each full block of the sequence's tokens, and the values its
        KV holds: the cache may only ever offer a block under a hash whose KV is those values."""
        m, bs = self.model[seq.seq_id], self.bs
        while len(m.hashes) < len(m.tokens) // bs:
            i = len(m.hashes)
            m.hashes.append(PrefixCachingBlock.hash_block_tokens(i == 0, m.hashes[-1] if i else None,
                                                                 m.tokens[i * bs:(i + 1) * bs], seq.extra_hash()))
            kv = tuple(m.value(j) for j in range(i * bs, (i + 1) * bs))
            assert self.block_kv.setdefault(m.hashes[-1], kv) == kv
        return m.hashes

    def _copy_block(self, src, dst):
        """What ``copy_blocks``/``swap_blocks`` do: the whole block, written slots or not."""
        for offset in range(self.bs):
            if (src, offset) in self.memory:
                self.memory[dst, offset] = self.memory[src, offset]
            else:
                self.memory.pop((dst, offset), None)

    def _check_kv(self, seq, end, what):
        """Tokens [0, end) of the sequence must be read back right through its table (positions
        the sliding window dropped aside): a lost copy, a wrong share or KV claimed before it
        was written shows here."""
        m, table, bs = self.model[seq.seq_id], self._table(seq), self.bs
        for i in range(end):
            block = table.blocks[i // bs]
            if isinstance(block, NullBlock):
                continue
            got = self.memory.get((block.block_id, i % bs))
            assert got == m.value(i), (f"{what}: sequence {seq.seq_id} token {i} (of {len(m.tokens)}) reads "
                                       f"{'nothing' if got is None else 'wrong KV'} from block {block.block_id}")
        self._count("kv_slots_checked", end)

    def _step(self, group, chunk=None, cached=0):
        """One model step of a running group, as vLLM's scheduler and model runner do it: the
        blocks are marked computed when the step is scheduled (``token_chunk_size`` tokens per
        sequence); the model reads the KV of the tokens computed before and of those the prefix
        cache supplied (``cached``: the count the manager gave at admission), writes the KV of
        the next ``chunk`` tokens (all that are left if None) into the slots the table gives, and
        then the tokens count as computed."""
        seqs = group.get_seqs(RUNNING)
        plan = []
        for seq in seqs:
            done = seq.data.get_num_computed_tokens()
            end = seq.get_len() if chunk is None else min(seq.get_len(), done + chunk)
            plan.append((seq, done, end))
        sizes = {end - done for _, done, end in plan}
        assert len(sizes) == 1, plan                        # a group's sequences step together
        size = sizes.pop()
        if self.enable_caching:
            self.mgr.mark_blocks_as_computed(group, token_chunk_size=size)
        for seq, done, end in plan:
            self._check_kv(seq, max(done, min(cached, end)), "before a step")
            self._count("kv_claimed_by_cache", max(0, min(cached, end) - done))
            m, table = self.model[seq.seq_id], self._table(seq)
            for i in range(max(done, cached), end):
                block = table.blocks[i // self.bs]
                assert not isinstance(block, NullBlock), "a token to compute lies in a dropped block"
                self.memory[block.block_id, i % self.bs] = m.value(i)
            seq.data.update_num_computed_tokens(end - done)
            if end < seq.get_len():
                self._count("partial_prefills")
        self._touch(group)

    def _free(self, seq, status):
        seq.status = status
        self.mgr.free(seq)
        assert seq.seq_id not in self.mgr.block_tables
        assert seq.seq_id not in self.mgr._computed_blocks_tracker     # forgotten, table or not
        self.model[seq.seq_id].clear()
        self.probed.pop(seq.seq_id, None)
        self.claims.pop(seq.seq_id, None)
        self.swap_records.pop(seq.seq_id, None)
        self.finished_ids.add(seq.seq_id)

    def _drop_if_finished(self, group):
        if group.is_finished():
            self.groups.remove(group)
            for seq in group.seqs:
                del self.model[seq.seq_id]

    def _end_group(self, group, status):
        for seq in self._live(group):
            self._free(seq, status)
        self._drop_if_finished(group)

    def _block_hashes(self, seq, num_blocks):
        """The prefix hashes of the sequence's first ``num_blocks`` full blocks, from its tokens."""
        hashes, prev_hash, tokens, bs = [], None, seq.get_token_ids(), self.bs
        for i in range(num_blocks):
            prev_hash = PrefixCachingBlock.hash_block_tokens(i == 0, prev_hash, tokens[i * bs:(i + 1) * bs],
                                                             seq.extra_hash())
            hashes.append(prev_hash)
        return hashes

    def _cached_and_computed(self, seq):
        """For each full block of the sequence's tokens: is its prefix hash cached on the GPU with
        its KV computed? (Worked out here from the tokens, block by block.)"""
        inner = self.mgr.block_allocator._allocators[GPU]
        flags = []
        for content_hash in self._block_hashes(seq, seq.get_len() // self.bs):
            block_id = inner._cached_blocks.get(content_hash)
            flags.append(block_id is not None and inner.block_is_computed(block_id))
        return flags

    def _true_cached_tokens(self, seq):
        """The leading blocks really cached with their KV computed, in tokens."""
        cached = self._cached_and_computed(seq)
        return (cached.index(False) if False in cached else len(cached)) * self.bs

    def _null_block_pending(self):
        """1 while a window is set and the null block is not made yet: the first windowed append
        takes a GPU block for it."""
        return int(self.windowed and self.mgr.block_allocator._null_block is None)

    def _expected_swap_status(self, seqs, device, lookahead):
        """``_can_swap`` worked out independently from the model: NEVER if a table
        holds the null block (it cannot leave the GPU); otherwise, per sequence, every block that
        is not full (it moves too, even empty ones an earlier lookahead reserved) and the new
        blocks the unseen tokens and the lookahead need past those blocks' empty slots; plus the
        full blocks that would take a block on ``device`` (naive: every full block; prefix
        caching: those not cached there, or cached but waiting in the evictor); plus, on the
        GPU, the null block while it is still to be made."""
        if any(self.model[seq.seq_id].nulls for seq in seqs):
            return AllocStatus.NEVER
        inner, bs = self.mgr.block_allocator._allocators[device], self.bs
        touched = 0
        for seq in seqs:
            m = self.model[seq.seq_id]
            num_full = m.n // bs
            empty_slots = m.num_blocks * bs - m.n
            new_slots = seq.get_len() - m.n + lookahead
            touched += m.num_blocks - num_full + max(0, -((empty_slots - new_slots) // bs))    # ceil(.../bs)
            self._count("reserved_blocks_counted", m.num_blocks > cdiv(m.n, bs))   # empty, reserved by lookahead
            if self.enable_caching:
                for content_hash in self._block_hashes(seq, num_full):
                    cached_id = inner._cached_blocks.get(content_hash)
                    touched += cached_id is None or cached_id in inner.evictor
            else:
                touched += num_full
        total = self.G if device == GPU else self.C
        watermark = self.mgr.watermark_blocks if device == GPU else 0
        free = self.mgr.block_allocator.get_num_free_blocks(device)

        def status(touched):
            return (AllocStatus.NEVER if total < touched else
                    AllocStatus.OK if free - touched >= watermark else AllocStatus.LATER)

        if device == GPU and self._null_block_pending():
            self._count("null_block_decided", status(touched) != status(touched + 1))
            touched += 1
        return status(touched)

    # ---- admission ------------------------------------------------------------------------------
    @precondition(lambda self: len(self.groups) < MAX_GROUPS and self._num_live() < MAX_LIVE_SEQS)
    @rule(prefix=st.sampled_from(PREFIXES), suffix=st.lists(st.integers(0, 2), max_size=4),
          num_seqs=st.sampled_from([1, 1, 2, 3]), lora=st.sampled_from([0, 0, 0, 1]))
    def new_request(self, prefix, suffix, num_seqs, lora):
        prompt = (prefix + suffix)[:self.G * self.bs // 2] or [1]
        seqs = [self._new_seq(prompt, lora) for _ in range(num_seqs)]
        self.groups.append(SequenceGroup(f"req{self.next_request}", seqs, arrival_time=self.now))
        self.next_request += 1

    @precondition(lambda self: len(self.groups) < MAX_GROUPS and self._num_live() < MAX_LIVE_SEQS
                  and not self._groups_in(WAITING))
    @rule(prefix=st.sampled_from(PREFIXES), slack=st.integers(0, 2), num_seqs=st.sampled_from([1, 1, 2]),
          trim=st.integers(0, 3))
    def new_long_request(self, prefix, slack, num_seqs, trim):
        """A prompt that, admitted now, would leave ``slack`` GPU blocks above the watermark: the
        pool runs tight (the boundaries of every check, and the null block's one, are met). Its
        last block may be left partly filled (``trim`` tokens short)."""
        num_blocks = self.mgr.get_num_free_gpu_blocks() - self.mgr.watermark_blocks - slack
        if num_blocks < 1:
            return
        prompt = (prefix + [1, 0, 2] * (num_blocks * self.bs))[:num_blocks * self.bs - trim % self.bs]
        self.groups.append(SequenceGroup(f"req{self.next_request}", [self._new_seq(prompt, 0) for _ in range(num_seqs)],
                                         arrival_time=self.now))
        self.next_request += 1
        self._count("long_requests")

    def _chunk(self, chunk):
        return None if chunk is None else 1 + (chunk - 1) % (2 * self.bs)

    @precondition(lambda self: self._groups_in(WAITING))
    @rule(index=indices, lookahead=lookaheads, force=forced, chunk=chunks)
    def admit(self, index, lookahead, force, chunk):
        mgr, bs = self.mgr, self.bs
        if self._groups_in(SWAPPED) and not force:
            # vLLM's scheduler admits no new request while swapped ones wait to come back.
            self.swap_in(index, lookahead, force=False, chunk=chunk)
            return
        truth = 0
        candidates = self._groups_in(WAITING)
        group = candidates[index % len(candidates)]
        waiting = group.get_seqs(WAITING)
        tokens = waiting[0].get_token_ids()
        if self.enable_caching:
            # As vLLM's scheduler: the cached prefix is asked for before the admission check.
            truth = self._true_cached_tokens(waiting[0])
            for seq in waiting:
                num_cached = mgr.get_num_cached_tokens(seq)
                if seq.seq_id in self.probed:
                    # Asked before, while waiting: the count is kept, stable (as across the chunks
                    # of a prefill), though blocks may have been cached or evicted since.
                    assert num_cached == self.probed[seq.seq_id], (num_cached, self.probed[seq.seq_id])
                    self._count("repeated_probes")
                else:
                    # A fresh count is exactly the leading cached-and-computed blocks (a scan,
                    # not vLLM's binary search, which could land past an evicted block).
                    assert num_cached == truth, (num_cached, truth, self._cached_and_computed(seq))
                    self.probed[seq.seq_id] = num_cached
        status = self._query(lambda: mgr.can_allocate(group, num_lookahead_slots=lookahead))
        required = cdiv(len(tokens) + lookahead, bs)
        if self.windowed:
            required = min(required, mgr.max_block_sliding_window)
        free = mgr.get_num_free_gpu_blocks()
        assert status == (AllocStatus.NEVER if self.G - required < mgr.watermark_blocks else
                          AllocStatus.OK if free - required >= mgr.watermark_blocks else AllocStatus.LATER)
        if status == AllocStatus.NEVER:
            self._count("never_admissions")
            self._end_group(group, SequenceStatus.FINISHED_IGNORED)
            return
        if status == AllocStatus.LATER:
            self._count("later_admissions")
            if not force:
                return
        before = self._snapshot()
        try:
            mgr.allocate(group)
        except NoFreeBlocks:
            assert self._snapshot() == before  # the counts kept while waiting are kept too
            if status == AllocStatus.OK:
                # can_allocate caps its estimate at the window, but allocate holds the whole prompt.
                assert self.windowed and cdiv(len(tokens), bs) > free, "can_allocate said OK"
                self._count("window_admission_overcommit")
            else:
                self._count("forced_ran_out")
            return
        ids = list(self._table(waiting[0]).physical_block_ids)
        for seq in waiting:
            assert self._table(seq).physical_block_ids == ids          # parallel samples share the prompt
            seq.status = RUNNING
            m = self.model[seq.seq_id]
            m.n, m.num_blocks, m.nulls = len(tokens), cdiv(len(tokens), bs), 0
        self._count("admissions")
        if self.enable_caching:
            self._count("prefix_cache_hits", truth > 0)
            # allocate dropped any count kept from the waiting: now it is exact, even for a request
            # whose cached blocks were evicted since it was first asked about.
            assert self._true_cached_tokens(waiting[0]) == truth
            for seq in waiting:
                stale = self.probed.pop(seq.seq_id)
                assert mgr.get_num_cached_tokens(seq) == truth, (mgr.get_num_cached_tokens(seq), truth)
                self._count("stale_counts_dropped", stale != truth)
                self.claims[seq.seq_id] = truth
            k = truth // bs
            assert mgr.get_common_computed_block_ids(waiting) == ids[:k]        # what the prefill may skip
            assert all(block.computed for block in self._table(waiting[0]).blocks[:k])   # revived, not new
        # The first step of the prefill: the cached tokens (read, not computed again) and a chunk
        # of those after them, or the whole prompt.
        chunk = self._chunk(chunk)
        self._step(group, None if chunk is None else truth + chunk, cached=truth)

    # ---- decoding -------------------------------------------------------------------------------
    _decode_args = dict(index=indices, lookahead=lookaheads, new_tokens=st.lists(st.integers(0, 2), min_size=3,
                                                                                  max_size=3),
                        force=forced, swap=st.booleans())

    def _in_prefill(self, group):
        return any(s.data.get_num_computed_tokens() < s.get_len() for s in group.get_seqs(RUNNING))

    def _decoding(self):
        return [g for g in self._groups_in(RUNNING) if not self._in_prefill(g)]

    def _prefilling(self):
        return [g for g in self._groups_in(RUNNING) if self._in_prefill(g)]

    @precondition(lambda self: self._decoding())
    @rule(**_decode_args)
    def decode(self, **kwargs):
        self._decode(**kwargs)

    @precondition(lambda self: self._decoding())
    @rule(**_decode_args)
    def decode_again(self, **kwargs):          # a second rule: decoding is most of what a scheduler does
        self._decode(**kwargs)

    def _decode(self, index, lookahead, new_tokens, force, swap):
        """One decode step of a running group: each sequence got a token; make room or preempt."""
        candidates = self._decoding()
        group = candidates[index % len(candidates)]
        running = group.get_seqs(RUNNING)
        for i, seq in enumerate(running):                  # the samples of the previous step
            token = new_tokens[i % len(new_tokens)]
            seq.append_token_id(token)
            self.model[seq.seq_id].tokens.append(token)
            self._register(seq)
        if self._make_room(group, 1, lookahead, force, swap):
            self._step(group)
            self._count("decode_steps")

    @precondition(lambda self: self._prefilling())
    @rule(index=indices, chunk=chunks, force=forced, swap=st.booleans())
    def prefill(self, index, chunk, force, swap):
        """The next chunk of a running prefill. As vLLM's scheduler, a running prefill has its
        slots checked and appended like a decode (no new tokens: only the window may drop
        blocks), then the step computes the chunk."""
        candidates = self._prefilling()
        group = candidates[index % len(candidates)]
        for seq in group.get_seqs(RUNNING):
            if seq.seq_id in self.claims and seq.is_prefill():
                # The cached-token count is kept across the chunks of a prefill.
                assert self.mgr.get_num_cached_tokens(seq) == self.claims[seq.seq_id]
        if self._make_room(group, 0, 0, force, swap):
            self._step(group, self._chunk(chunk))
            self._count("prefill_chunks")

    def _make_room(self, group, num_new, lookahead, force, swap):
        """``can_append_slots`` (its answer checked against the blocks the ``num_new`` unseen
        tokens and the lookahead touch), then ``append_slots``, or a preemption; True when the
        group is ready for its step."""
        mgr, running = self.mgr, group.get_seqs(RUNNING)
        can = self._query(lambda: mgr.can_append_slots(group, num_lookahead_slots=lookahead))
        touched = sum(_blocks_touched(self.model[s.seq_id].n, num_new + lookahead, self.bs) for s in running)
        free = mgr.get_num_free_gpu_blocks()
        if self._null_block_pending():                  # the first windowed append makes the null block
            self._count("null_block_decided", touched <= free < touched + 1)
            touched += 1
        assert can == (touched <= free)
        if not can:
            self._count("append_refused")
            if not force:
                self._preempt(group, swap)
                return False
        return self._append_group(group, lookahead, promised=can)

    def _append_group(self, group, lookahead, promised):
        """``append_slots`` for each running sequence, checking the copy-on-write pairs. On
        running out of blocks (allowed only where nothing was promised) the group is preempted
        and False returned."""
        mgr, bs, a = self.mgr, self.bs, self.mgr.block_allocator
        for seq in group.get_seqs(RUNNING):
            m, table = self.model[seq.seq_id], self._table(seq)
            old_ids = list(table.physical_block_ids)
            refcounts = {i: self._rc(GPU, i) for i in old_ids}
            before = self._snapshot()
            try:
                cows = mgr.append_slots(seq, num_lookahead_slots=lookahead)
            except NoFreeBlocks:
                assert self._snapshot() == before
                assert not promised, "a promised append ran out of blocks"
                self._count("forced_ran_out")
                self._preempt(group, swap=True)
                return False
            n_old, n_new = m.n, seq.get_len()
            written = range(n_old // bs, cdiv(n_new, bs)) if n_new > n_old else range(0)
            cow_positions = [p for p in written if p < len(old_ids) and refcounts[old_ids[p]] > 1]
            # copies that carry computed KV (others copy an empty block a lookahead reserved)
            self._count("cow_pairs_with_kv", sum(p * bs < seq.data.get_num_computed_tokens() for p in cow_positions))
            assert [src for src, _ in cows] == [old_ids[p] for p in cow_positions]
            new_ids = table.physical_block_ids
            for p, (src, dst) in zip(cow_positions, cows):
                assert 0 <= src < self.G and 0 <= dst < self.G and src != dst       # GPU ids
                assert src not in new_ids and self._rc(GPU, src) >= 1              # others keep the source
                if new_ids[p] != dst:
                    # Prefix caching: the copy filled up and moved onto an identical cached block.
                    assert self.enable_caching and table.blocks[p].content_hash is not None
                    self._count("cow_deduplicated")
            self._count("cow_pairs", len(cows))
            for src, dst in cows:                       # copy_blocks, before the step's model runs
                self._copy_block(src, dst)
            assert a.clear_copy_on_writes() == []                                  # all handed over
            m.n = n_new
            m.num_blocks = max(m.num_blocks, cdiv(n_new + lookahead, bs))
            if self.windowed:
                dropped = seq.data.get_num_computed_tokens() // bs - mgr.max_block_sliding_window
                m.nulls = max(m.nulls, dropped)
        return True

    # ---- preemption -----------------------------------------------------------------------------
    def _preempt(self, group, swap):
        """As vLLM: a single sequence may be recomputed, a group of several must be swapped, and
        a group that cannot be swapped out is aborted."""
        running = group.get_seqs(RUNNING)
        if len(running) == 1 and not swap:
            self._recompute(running[0])
        elif not self._swap_out(group):
            if len(running) == 1:
                self._recompute(running[0])
            else:
                self._count("aborted_no_swap_space")
                self._end_group(group, SequenceStatus.FINISHED_ABORTED)

    def _recompute(self, seq):
        free = self.mgr.get_num_free_gpu_blocks()
        owned = {b.block_id for b in self._table(seq).blocks
                 if not isinstance(b, NullBlock) and self._rc(GPU, b.block_id) == 1}
        self.mgr.free(seq)
        assert self.mgr.get_num_free_gpu_blocks() == free + len(owned)
        seq.status = WAITING
        seq.data.reset_state_for_recompute()
        self.model[seq.seq_id].clear()
        self.claims.pop(seq.seq_id, None)
        self._count("recomputes")

    @precondition(lambda self: self._groups_in(RUNNING))
    @rule(index=indices, swap=st.booleans())
    def preempt(self, index, swap):
        """The scheduler makes room: a running group, at rest between steps, is preempted."""
        candidates = self._groups_in(RUNNING)
        self._preempt(candidates[index % len(candidates)], swap)

    def _swap_out(self, group, force=False):
        mgr, G = self.mgr, self.G
        running = group.get_seqs(RUNNING)
        can = self._query(lambda: mgr.can_swap_out(group))
        expected = self._expected_swap_status(running, CPU, 0)
        assert can == (expected == AllocStatus.OK)
        has_null = any(isinstance(b, NullBlock) for seq in running for b in self._table(seq).blocks)
        assert not (has_null and can), "can_swap_out said yes to a group holding the null block"
        if not can and not force:
            self._count("swap_out_refused")
            self._count("swap_out_refused_null_block", has_null)
            return False
        old = {seq.seq_id: list(self._table(seq).physical_block_ids) for seq in running}
        record = {seq.seq_id: self._table_shape(seq) for seq in running}
        before = self._snapshot()
        try:
            pairs = mgr.swap_out(group)
        except (NoFreeBlocks, ValueError) as exc:
            assert self._snapshot() == before
            assert not can, f"can_swap_out said yes, swap_out raised {exc!r}"
            if has_null:                                   # the null block cannot leave the GPU
                assert isinstance(exc, ValueError), exc
                self._count("refused_windowed_swap")
            else:
                assert isinstance(exc, NoFreeBlocks), exc
                self._count("forced_ran_out")
            return False
        assert not has_null
        expected = []
        for seq in running:
            new = self._table(seq).physical_block_ids
            assert all(G <= i < G + self.C for i in new)
            expected += [(o, n - G) for o, n in zip(old[seq.seq_id], new)]    # device-relative ids
            seq.status = SWAPPED
        assert pairs == expected
        for src, dst in pairs:                          # swap_blocks: GPU block to CPU block
            self._copy_block(src, G + dst)
        self.swap_records.update(record)
        self._count("swap_outs")
        return True

    def _table_shape(self, seq):
        table = self._table(seq)
        return (table._get_all_token_ids(), table.num_full_slots, len(table.blocks),
                [b.is_full for b in table.blocks], list(seq.get_token_ids()))

    @precondition(lambda self: self._groups_in(SWAPPED))
    @rule(index=indices, lookahead=lookaheads, force=forced, chunk=chunks)
    def swap_in(self, index, lookahead, force, chunk):
        mgr, G = self.mgr, self.G
        candidates = self._groups_in(SWAPPED)
        group = candidates[index % len(candidates)]
        swapped = group.get_seqs(SWAPPED)
        status = self._query(lambda: mgr.can_swap_in(group, num_lookahead_slots=lookahead))
        assert status == self._expected_swap_status(swapped, GPU, lookahead)
        if status == AllocStatus.NEVER:
            self._count("never_swap_ins")
            self._end_group(group, SequenceStatus.FINISHED_IGNORED)
            return
        if status == AllocStatus.LATER:
            self._count("later_swap_ins")
            if not force:
                return
        old = {seq.seq_id: list(self._table(seq).physical_block_ids) for seq in swapped}
        before = self._snapshot()
        try:
            pairs = mgr.swap_in(group)
        except NoFreeBlocks:
            assert self._snapshot() == before
            assert status != AllocStatus.OK, "can_swap_in said OK, swap_in ran out of blocks"
            self._count("forced_ran_out")
            return
        expected = []
        for seq in swapped:
            new = self._table(seq).physical_block_ids
            assert all(0 <= i < G for i in new)
            expected += [(o - G, n) for o, n in zip(old[seq.seq_id], new)]
            assert self._table_shape(seq) == self.swap_records.pop(seq.seq_id)    # all back, as it was
            seq.status = RUNNING
        assert pairs == expected
        for src, dst in pairs:                          # swap_blocks: CPU block to GPU block
            self._copy_block(G + src, dst)
        self._count("swap_ins")
        # As vLLM's scheduler: the swapped-in sequences get their slots in the same step (an OK
        # counted those blocks, and the null block, too); a prefill goes on with its next chunk.
        if self._append_group(group, lookahead, promised=status == AllocStatus.OK):
            self._step(group, self._chunk(chunk))

    # ---- forking and finishing ------------------------------------------------------------------
    @precondition(lambda self: self._groups_in(RUNNING) and self._num_live() < MAX_LIVE_SEQS)
    @rule(index=indices)
    def fork(self, index):
        running = [(g, s) for g in self._groups_in(RUNNING) for s in g.get_seqs(RUNNING)]
        group, parent = running[index % len(running)]
        child = self._new_seq(parent.get_token_ids(), parent.lora_int_id)
        child.data.update_num_computed_tokens(parent.data.get_num_computed_tokens())
        free = (self.mgr.get_num_free_gpu_blocks(), self.mgr.get_num_free_cpu_blocks())
        self.mgr.fork(parent, child)
        assert (self.mgr.get_num_free_gpu_blocks(), self.mgr.get_num_free_cpu_blocks()) == free
        assert self._table(child).physical_block_ids == self._table(parent).physical_block_ids
        child.status = RUNNING
        group.seqs.append(child)
        self.model[child.seq_id] = self.model[parent.seq_id].copy()
        self._count("forks")

    @precondition(lambda self: self._groups_in(RUNNING))
    @rule(index=indices, reason=st.sampled_from([SequenceStatus.FINISHED_STOPPED] * 2 + [
        SequenceStatus.FINISHED_LENGTH_CAPPED, SequenceStatus.FINISHED_ABORTED]))
    def finish(self, index, reason):
        """A running sequence stops; an abort ends its whole request, whatever state it is in."""
        running = [(g, s) for g in self._groups_in(RUNNING) for s in g.get_seqs(RUNNING)]
        group, seq = running[index % len(running)]
        if reason == SequenceStatus.FINISHED_ABORTED:
            group = self.groups[index % len(self.groups)]
            self._end_group(group, reason)
            self._count("aborted")
            return
        self._free(seq, reason)
        self._drop_if_finished(group)
        self._count("finished")

    @precondition(lambda self: self._groups_in(SWAPPED) or self._prefilling())
    @rule(index=indices)
    def abort(self, index):
        """A request swapped out to the CPU, or in the middle of its prefill, is aborted (``finish``
        aborts the others)."""
        candidates = self._groups_in(SWAPPED) + self._prefilling()
        group = candidates[index % len(candidates)]
        swapped = self._status(group) == SWAPPED
        self._count("swapped_aborts" if swapped else "prefill_aborts")
        self._end_group(group, SequenceStatus.FINISHED_ABORTED)

    # ---- refused and no-op calls ----------------------------------------------------------------
    @precondition(lambda self: self.groups)
    @rule(kind=st.integers(0, 6), index=indices)
    def bad_call(self, kind, index):
        mgr = self.mgr
        group = self.groups[index % len(self.groups)]
        live, status = self._live(group), self._status(group)
        others = [s for g in self.groups for s in self._live(g) if s.seq_id in mgr.block_tables]
        if kind == 0 and status == RUNNING and len(others) > 1:          # fork onto a sequence with a table
            child = next(s for s in others if s is not live[0])
            self._refused(lambda: mgr.fork(live[0], child), BlockStateError)
        elif kind == 1 and status == RUNNING:                              # allocate twice
            live[0].status = WAITING
            self._refused(lambda: mgr.allocate(group), BlockStateError)
            live[0].status = RUNNING
        elif kind == 2 and status in (RUNNING, SWAPPED):                   # swap from the wrong device
            lie = SWAPPED if status == RUNNING else RUNNING
            for seq in live:
                seq.status = lie
            self._refused(lambda: mgr.swap_in(group) if lie == SWAPPED else mgr.swap_out(group), ValueError)
            for seq in live:
                seq.status = status
        elif kind == 3 and status == WAITING:                              # no table yet
            self._refused(lambda: mgr.append_slots(live[0], 0), KeyError)
            self._refused(lambda: mgr.get_block_table(live[0]), KeyError)
        elif kind == 4 and status == RUNNING and any(isinstance(b, NullBlock) for b in self._table(live[0]).blocks):
            self._refused(lambda: mgr.swap_out(group), ValueError)          # the null block stays on the GPU
        elif kind == 5:                                                    # no-ops
            stranger = Sequence(10**6, [1, 2], self.bs)
            before = self._snapshot()
            mgr.free(stranger)
            mgr.fork(stranger, Sequence(10**6 + 1, [1, 2], self.bs))
            if status != SWAPPED:
                assert mgr.swap_in(group) == []                            # nothing swapped: nothing moves
            assert self._snapshot() == before
            self._count("no_op_calls")
        elif kind == 6 and status == RUNNING:                              # a swap-out forced past a "no"
            self._count("forced_swap_outs", self._swap_out(group, force=True))

    # ---- invariants -----------------------------------------------------------------------------
    @invariant()
    def manager_matches_model(self):
        if not hasattr(self, "mgr"):
            return
        type(self).counters["steps_checked"] += 1
        mgr, a, bs, G, C = self.mgr, self.mgr.block_allocator, self.bs, self.G, self.C
        live = {s.seq_id: s for g in self.groups for s in self._live(g) if s.status in (RUNNING, SWAPPED)}
        # 2. exactly the live sequences have tables; finished ones hold nothing
        assert set(mgr.block_tables) == set(live)
        assert not self.finished_ids & set(mgr.block_tables) and mgr.cross_block_tables == {}
        null = a._null_block
        null_id = None if null is None else null.block_id
        holders, objects, contents = Counter(), set(), {}
        for sid, table in mgr.block_tables.items():
            seq, m = live[sid], self.model[sid]
            # 3. the tokens, the shape and the device
            assert seq.get_token_ids() == m.tokens
            assert table.num_full_slots == m.n and len(table.blocks) == m.num_blocks
            assert seq.data.get_num_computed_tokens() <= m.n <= len(m.tokens)
            if seq.status == RUNNING:
                assert m.n == len(m.tokens)           # at rest between steps (a prefill may be part done)
            # 6. the physical cache: every computed token reads back right, on its device
            self._check_kv(seq, seq.data.get_num_computed_tokens(), "at rest")
            kinds = [isinstance(b, NullBlock) for b in table.blocks]
            assert kinds == [True] * m.nulls + [False] * (len(kinds) - m.nulls)
            assert mgr.get_block_table(seq) == table.physical_block_ids
            on_device = range(0, G) if seq.status == RUNNING else range(G, G + C)
            for i, block in enumerate(table.blocks):
                if isinstance(block, NullBlock):
                    assert block is null and seq.status == RUNNING
                    continue
                assert block.block_id in on_device and table.physical_block_ids[i] == block.block_id
                assert block.token_ids == m.tokens[i * bs:min((i + 1) * bs, m.n)]
                assert id(block) not in objects                  # no block object in two tables
                objects.add(id(block))
                holders[block.block_id] += 1
                if block.token_ids:
                    # One physical block, one KV: the same position after the same prefix, same
                    # adapter. (An empty block reserved by lookahead may be shared by forks that have
                    # diverged since: the first write into it copies it.)
                    key = (i, tuple(m.tokens[:i * bs + len(block.token_ids)]), seq.lora_int_id)
                    assert contents.setdefault(block.block_id, key) == key
            if self.enable_caching:
                prev_hash = None
                for i in range(m.n // bs):
                    prev_hash = PrefixCachingBlock.hash_block_tokens(i == 0, prev_hash, m.tokens[i * bs:(i + 1) * bs],
                                                                     seq.extra_hash())
                    block = table.blocks[i]
                    if not isinstance(block, NullBlock):
                        assert block.content_hash == prev_hash
                        device = GPU if seq.status == RUNNING else CPU
                        assert a._allocators[device]._cached_blocks.get(prev_hash) == block.block_id
        self._check_block_pools()
        # 1 and 2. refcounts, free counts and free lists
        referenced = set(holders) | ({null_id} if null is not None else set())
        for device, ids in ((GPU, range(0, G)), (CPU, range(G, G + C))):
            inner = a._allocators[device]
            for block_id in ids:
                assert inner.refcounter.get(block_id) == holders[block_id] + (block_id == null_id), block_id
            free = a.get_num_free_blocks(device)
            assert free == (mgr.get_num_free_gpu_blocks() if device == GPU else mgr.get_num_free_cpu_blocks())
            free_ids = set(ids) - referenced
            assert free == len(free_ids)
            assert not inner._cow_tracker._copy_on_writes                   # nothing left unreported
            if self.enable_caching:
                plain = list(inner._hashless_allocator._free_block_indices)
                evictable = set(inner.evictor.free_table)
                assert len(plain) == len(set(plain)) and not set(plain) & evictable
                assert set(plain) | evictable == free_ids                   # evictor blocks count as free
                for content_hash, block_id in inner._cached_blocks.items():
                    assert (block_id in evictable) == (block_id not in referenced)
                for block_id, meta in inner.evictor.free_table.items():
                    assert inner._cached_blocks.get(meta.content_hash) == block_id
                if device == GPU:
                    # 7. a block the cache would hand out as computed holds its prefix's KV
                    for content_hash, block_id in inner._cached_blocks.items():
                        if inner.block_is_computed(block_id):
                            kv = self.block_kv.get(content_hash)
                            assert kv is not None, f"block {block_id} is cached under a hash no sequence made"
                            got = tuple(self.memory.get((block_id, o)) for o in range(bs))
                            assert got == kv, (f"block {block_id} counts as computed, but "
                                               f"{sum(g != v for g, v in zip(got, kv))} of its {bs} slots "
                                               f"do not hold its tokens' KV")
                            self._count("computed_blocks_checked")
            else:
                plain = list(inner._free_block_indices)
                assert len(plain) == len(set(plain)) and set(plain) == free_ids

    def _check_block_pools(self):
        """8. Block objects are reused through a pool per allocator: every block object in a
        table is one its pool counts as in use, and a pool's free list names distinct objects of
        its own (a freed block that goes back to another allocator's pool corrupts both)."""
        pools = {id(inner._block_pool): inner._block_pool for inner in self.mgr.block_allocator._allocators.values()
                 if hasattr(inner, "_block_pool")}
        free = {}
        for key, pool in pools.items():
            ids = list(pool._free_ids)
            assert len(ids) == len(set(ids)), f"a block pool's free list names an object twice: {ids}"
            assert all(0 <= i < len(pool._pool) for i in ids), f"a block pool's free list names another's object: {ids}"
            free[key] = set(ids)
        for table in self.mgr.block_tables.values():
            for block in table.blocks:
                if isinstance(block, NullBlock):
                    continue
                owners = [key for key, pool in pools.items()
                          if block.pool_id < len(pool._pool) and pool._pool[block.pool_id] is block]
                assert len(owners) == 1, "a block object in a table belongs to no pool"
                assert block.pool_id not in free[owners[0]], "a block object in a table is on its pool's free list"

    def teardown(self):
        if not hasattr(self, "mgr") or isinstance(sys.exc_info()[1], Exception):
            return          # a step failed: let its error be the report (Hypothesis's own stops are not errors)
        mgr, a = self.mgr, self.mgr.block_allocator
        for group in list(self.groups):
            self._end_group(group, SequenceStatus.FINISHED_ABORTED)
        assert mgr.block_tables == {}
        null = 0 if a._null_block is None else 1            # allocated once, never given back
        assert mgr.get_num_free_gpu_blocks() == self.G - null
        assert mgr.get_num_free_cpu_blocks() == self.C
        if self.enable_caching:                             # the null block keeps the GPU cache "in use"
            assert mgr.reset_prefix_cache(CPU) is True and mgr.reset_prefix_cache(GPU) is (null == 0)
            assert mgr.get_num_free_gpu_blocks() == self.G - null and mgr.get_num_free_cpu_blocks() == self.C
        self._count("runs_torn_down")


class NaiveManager(ManagerMachine):
    pass


class NaiveWindowManager(ManagerMachine):
    windowed = True


class CachingManager(ManagerMachine):
    enable_caching = True


class CachingWindowManager(ManagerMachine):
    enable_caching = True
    windowed = True


_settings = settings(max_examples=100, stateful_step_count=50, deadline=None, derandomize=True, database=None,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

# Each counter must reach about half of what the run showed when these were set, so that every
# machine really admits, decodes, swaps both ways, recomputes, copies on write (KV-holding blocks
# too), forks, finishes, is told LATER, is refused, prefills in chunks (leaving prompts part
# done), aborts swapped-out and half-prefilled requests, reads back KV from the physical cache,
# and (with caching) hits the prefix cache, reads KV the cache supplied and checks the blocks it
# counts as computed. The runs are derandomized and, with the fixture below, the same whichever
# tests ran before.
_COUNTERS = ("steps_checked", "admissions", "decode_steps", "later_admissions", "swap_outs", "swap_ins",
             "recomputes", "cow_pairs", "forks", "finished", "refused_calls", "prefix_cache_hits",
             "prefill_chunks", "partial_prefills", "swapped_aborts", "prefill_aborts", "cow_pairs_with_kv",
             "kv_slots_checked", "kv_claimed_by_cache", "computed_blocks_checked")
# Seen, in the order of _COUNTERS:
#   Naive          3891 448 197 46  48 35  73 24 191 173 222   -  116 497  9 102 19 20290    -     -
#   NaiveWindow    3830 435 290 35 101 54  31 57 216 228 217   -  132 627 31 107 57 35852    -     -
#   Caching        4668 424 185 72  12  5  66 15 248 182 559 225   28 246  7  37 15 45460 1737 15918
#   CachingWindow  4348 572 234 55 136 75 140 67 296 126 257 220   45 484 46  86 59 40169 1413 16220
_MINIMUM = {
    NaiveManager: (1900, 220, 95, 23, 24, 17, 36, 12, 95, 86, 110, 0, 58, 240, 4, 50, 9, 10000, 0, 0),
    NaiveWindowManager: (1900, 215, 145, 17, 50, 27, 15, 28, 108, 114, 108, 0, 66, 310, 15, 53, 28, 17900, 0, 0),
    CachingManager: (2300, 210, 92, 36, 6, 2, 33, 7, 124, 91, 280, 112, 14, 123, 3, 18, 7, 22700, 860, 7900),
    CachingWindowManager: (2150, 286, 117, 27, 68, 37, 70, 33, 148, 63, 128, 110, 22, 242, 23, 43, 29, 20000,
                           700, 8100),
}


@pytest.fixture
def same_examples_whatever_ran_before(monkeypatch):
    """Hypothesis (since 6.131) now and then draws a constant found in the source of the local
    modules imported so far, so which tests ran first changed the examples, and the counts
    asserted below moved by up to 5x. With no local constants the runs are the same every time.
    (A private hook of the pinned Hypothesis; without it the counts may move again.)"""
    from hypothesis.internal.conjecture import providers
    if not hasattr(providers, "_get_local_constants"):
        yield
        return
    empty = providers.Constants()
    monkeypatch.setattr(providers, "_get_local_constants", lambda: empty)
    providers.CONSTANTS_CACHE.cache.clear()             # values cached from other tests' constants
    yield
    providers.CONSTANTS_CACHE.cache.clear()


@pytest.mark.parametrize("machine", list(_MINIMUM), ids=lambda m: m.__name__)
def test_manager_state_machine(machine, same_examples_whatever_ran_before):
    machine.counters = Counter()
    machine.TestCase.settings = _settings
    machine.TestCase().runTest()
    print(machine.__name__, dict(sorted(machine.counters.items())))
    short = {name: (machine.counters[name], least) for name, least in zip(_COUNTERS, _MINIMUM[machine])
             if machine.counters[name] < least}
    assert not short, short                     # {counter: (seen, needed)}
