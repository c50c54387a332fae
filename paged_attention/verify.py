"""One call per notebook section: run what the reader built through every kernel this machine has.

A notebook builds a slot mapping or a block table, then hands it here. ``verify_cache_writes``
scatters keys and values through the slot mapping with the reference and with every other
implementation present (Triton, our CUDA, vLLM's own), and ``verify_decode`` runs a decode step
over the block table with the float64 oracle, Triton, our CUDA v1/v2 and vLLM's FA3. Every result
must equal the reference (exactly for cache writes, within the dtype's tolerance for attention),
or it is listed as FAILED. An implementation that cannot run here (no GPU, vLLM's kernels not
found, a head size it was not compiled for, ALiBi for FA3: it raises ``KernelUnavailable``) is
listed as skipped, with its whole reason. Anything else an implementation raises is a failure
too, with its message: a bug that raises ``ValueError`` on good input must not pass as "skipped".
Every implementation is tried; then, if any FAILED, ``VerificationFailed`` (an
``AssertionError``) is raised with the whole table, so a notebook cell that verifies stops
there. Otherwise the returned ``Verification`` prints as a small table.

For the legacy block layer, ``PagedCacheCheck`` keeps a KV cache per implementation, written
through ``BlockTable``s token by token (``reshape_and_cache``), copied on write
(``copy_blocks``) and read back by paged attention, each sequence compared with dense attention
over its own tokens; ``verify_block_tables`` is its one-call form, and ``check_scheduled_run``
drives it through a whole scheduler run, swaps and copies on write included.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import torch

from paged_attention.kernels import KernelUnavailable, args
from paged_attention.kernels import reference as ref
from paged_attention.kernels.workloads import assert_close_to_oracle
from paged_attention.legacy.block_table import BlockTable
from paged_attention.legacy.cpu_gpu_block_allocator import NullBlock
from paged_attention.legacy.sequence import SequenceStatus


@dataclass
class Verification:
    """What was compared: one ``(implementation, status, detail)`` row each.

    Status ``ok`` (it ran and agreed with the reference), ``skipped`` (it cannot run here: the
    detail is its ``KernelUnavailable`` message, whole) or ``FAILED`` (it disagreed, or raised
    anything else: the detail is the error).
    """
    what: str
    rows: list[tuple[str, str, str]] = field(default_factory=list)

    def _names(self, status: str) -> list[str]:
        return [name for name, s, _ in self.rows if s == status]

    @property
    def verified(self) -> list[str]:
        return self._names("ok")

    @property
    def skipped(self) -> list[str]:
        return self._names("skipped")

    @property
    def failed(self) -> list[str]:
        return self._names("FAILED")

    def __str__(self) -> str:
        width = max(len(name) for name, _, _ in self.rows)
        indent = "\n" + " " * (width + 13)     # a multi-line detail stays in its column
        lines = [self.what] + [f"  {name:<{width}}  {status:<7}  {detail.replace(chr(10), indent)}".rstrip()
                               for name, status, detail in self.rows]
        return "\n".join(lines)

    __repr__ = __str__


class VerificationFailed(AssertionError):
    """At least one implementation FAILED. The message is the whole table; ``verification``
    holds its rows."""

    def __init__(self, verification: Verification):
        super().__init__(str(verification))
        self.verification = verification


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def _attempt(v: Verification, name: str, run: Callable[[], str]) -> None:
    """Run one comparison and add its row: ``ok``, ``skipped`` for ``KernelUnavailable`` only,
    ``FAILED`` for anything else it raises (a wrong answer, or an error on good input)."""
    try:
        v.rows.append((name, "ok", run()))
    except KernelUnavailable as e:
        v.rows.append((name, "skipped", str(e)))
    except Exception as e:                     # noqa: BLE001  (any other error is the finding)
        v.rows.append((name, "FAILED", _describe(e)))


def _finish(v: Verification) -> Verification:
    """``v``, unless an implementation FAILED: then ``VerificationFailed`` with the table."""
    if v.failed:
        raise VerificationFailed(v)
    return v


def _implementations():
    """(name, module) of every implementation after the reference; GPU ones only on a GPU."""
    from paged_attention.kernels import cuda, triton, vllm
    return [("Triton", triton), ("CUDA (ours)", cuda), ("vLLM", vllm)]


# --------------------------------------------------------------------------------------------
# Cache writes
# --------------------------------------------------------------------------------------------

def _copy_with_strides(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` laid out in memory as ``t`` is (``clone`` makes a strided view contiguous),
    so that every implementation is handed the layout the caller gave."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).copy_(t)


def verify_cache_writes(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str = "auto",
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> Verification:
    """``reshape_and_cache_flash`` through ``slot_mapping``: the reference writes into the given
    caches (as the op would), every other implementation into copies of them with the same
    strides (an HND view, every other block of a larger tensor...), which must then be equal to
    it bit for bit. Scales default to 1."""
    args.tensor("key", key)
    one = torch.ones(1, device=key.device)
    k_scale = one if k_scale is None else k_scale
    v_scale = one if v_scale is None else v_scale
    args.check_reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype,
                                       k_scale, v_scale)
    before = _copy_with_strides(key_cache), _copy_with_strides(value_cache)
    ref.reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale)
    v = Verification(f"reshape_and_cache_flash: {int((slot_mapping >= 0).sum())} tokens through the slot mapping")
    v.rows.append(("reference", "ok", "plain torch, the oracle"))
    for name, impl in _implementations():
        def run(impl=impl) -> str:
            caches = [_copy_with_strides(c) for c in before]
            impl.reshape_and_cache_flash(key, value, *caches, slot_mapping, kv_cache_dtype, k_scale, v_scale)
            for got, want, which in ((caches[0], key_cache, "key"), (caches[1], value_cache, "value")):
                if not torch.equal(got, want):
                    raise AssertionError(f"{name}'s {which} cache differs from the reference's")
            return "identical to the reference"
        _attempt(v, name, run)
    return _finish(v)


# --------------------------------------------------------------------------------------------
# Decode attention
# --------------------------------------------------------------------------------------------

def verify_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    alibi_slopes: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Verification]:
    """One decode step over flash-layout caches and a block table, by every implementation.

    Returns the float64 oracle's output and the verification. Our CUDA v1/v2 read vLLM's v0
    layout, so they get the same cache converted (``reference.flash_to_v0``). vLLM's FA3 runs in
    16 bits: float32 inputs are rounded to bfloat16 for it, and its output is compared with the
    oracle on those rounded inputs (with bfloat16's tolerance).
    """
    decode_args = (query, key_cache, value_cache, block_tables, seq_lens, scale, alibi_slopes)
    oracle = ref.ref_decode_attention(*decode_args)
    v = Verification(f"decode attention: {query.size(0)} sequences, {query.size(1)} query heads over "
                     f"{key_cache.size(2)} KV heads, head size {query.size(2)}, block size {key_cache.size(1)}, "
                     f"{str(query.dtype).replace('torch.', '')}")
    v.rows.append(("reference", "ok", "float64 oracle"))

    def compare(out: torch.Tensor, expected: torch.Tensor, name: str) -> str:
        assert_close_to_oracle(out, expected, name)
        return f"max |error| {(out.double() - expected).abs().max().item():.1e}"

    def triton_run() -> str:
        from paged_attention.kernels import triton
        out = torch.empty_like(query)
        triton.paged_attention_decode(out, *decode_args)
        return compare(out, oracle, "Triton")

    def cuda_run(version: int) -> str:
        from paged_attention.kernels import cuda
        out = torch.empty_like(query)
        v0_args = ref.v0_decode_args(*decode_args)
        if version == 1:
            cuda.paged_attention_v1(out, *v0_args)
        else:
            cuda.paged_attention_v2(out, *ref.v2_scratch(query, int(seq_lens.max())), *v0_args)
        return compare(out, oracle, f"CUDA v{version}")

    def vllm_run() -> str:
        from paged_attention.kernels import vllm
        q, k, c = query, key_cache, value_cache
        expected, note = oracle, ""
        if query.dtype not in vllm.DECODE_DTYPES:     # FA3 runs in 16 bits: round the inputs for it
            q, k, c = (t.to(torch.bfloat16) for t in (query, key_cache, value_cache))
            expected = ref.ref_decode_attention(q, k, c, block_tables, seq_lens, scale, alibi_slopes)
            note = " (inputs rounded to bf16)"
        out = torch.empty_like(q)
        vllm.paged_attention_decode(out, q, k, c, block_tables, seq_lens, scale, alibi_slopes)
        return compare(out, expected, "vLLM FA3") + note

    _attempt(v, "Triton", triton_run)
    _attempt(v, "CUDA v1 (ours)", lambda: cuda_run(1))
    _attempt(v, "CUDA v2 (ours)", lambda: cuda_run(2))
    _attempt(v, "vLLM FA3", vllm_run)
    return oracle, _finish(v)


# --------------------------------------------------------------------------------------------
# Legacy block tables: a cache written through them, read back by every kernel
# --------------------------------------------------------------------------------------------

_MASK64 = (1 << 64) - 1

def token_kv(token_ids: Sequence[int], num_kv_heads: int, head_size: int, dtype: torch.dtype = torch.float32,
             device: torch.device | str = "cpu", seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[len(token_ids), num_kv_heads, head_size]`` for a sequence's tokens.

    Token ``t``'s key and value are random numbers drawn from a seed that depends on every token
    up to ``t`` (and on ``seed``), the way a model's depend on the whole prefix: two sequences
    with the same first tokens have the same K/V there (so a shared prefix block may be written
    by either), and differ from the first token where they differ.
    """
    keys = torch.empty(len(token_ids), num_kv_heads, head_size)
    values = torch.empty_like(keys)
    state = seed & _MASK64
    for t, token in enumerate(token_ids):
        state = hash((state, int(token))) & _MASK64      # a hash of ints: the same in every process
        kv = torch.randn(2, num_kv_heads, head_size, generator=torch.Generator().manual_seed(state))
        keys[t], values[t] = kv[0], kv[1]
    return keys.to(device=device, dtype=dtype), values.to(device=device, dtype=dtype)


@dataclass
class _CacheCopy:
    """One implementation's own copy of the KV cache, and why it stopped (both None while it runs):
    ``skipped`` it cannot run here, ``failed`` it raised or went wrong at some step."""
    name: str
    layout: str                  # "v0": vLLM's v0 layout; "flash": [num_blocks, block_size, H_kv, D]
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    cpu_key_cache: torch.Tensor
    cpu_value_cache: torch.Tensor
    skipped: str | None = None
    failed: str | None = None
    swapped: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # CPU id -> block sent


class PagedCacheCheck:
    """A KV cache written through legacy ``BlockTable``s, by every implementation this machine has.

    Each implementation keeps its own cache (all start from the same random garbage, so a slot
    that should have been written but was not shows up):

    * ``reference``: the plain-torch ``reshape_and_cache``, ``copy_blocks`` and
      ``paged_attention_v1`` over vLLM's v0 layout;
    * ``Triton``: ``reshape_and_cache_flash`` and the paged decode kernel over the flash layout
      (Triton has no block copy: ``copy_blocks`` there is the plain-torch one, which copies
      whole blocks of any layout);
    * ``CUDA (ours)``: ``reshape_and_cache``, ``copy_blocks``, ``paged_attention_v1`` and ``_v2``
      over the v0 layout, on a GPU (elsewhere: skipped, with the reason).

    ``write`` scatters a sequence's new tokens to ``physical id * block_size + offset`` through
    its table; ``fork`` notes that a child shares its parent's written tokens; ``copy_blocks``
    applies copy-on-write pairs; ``swap_out`` and ``swap_in`` move blocks to a CPU cache (pinned
    when there is a GPU) and back with ``swap_blocks``, checking that each block returns bit for
    bit as it left; ``forget`` drops a finished sequence; ``check`` runs a decode step over the tables and compares each
    sequence's output with float64 dense attention over that sequence's own keys and values,
    computed from its tokens (``token_kv``), not read from any cache: a wrong table entry, a
    missed copy or a write to the wrong slot makes it fail with an ``AssertionError``.

    Block ids are the tables' ids: GPU ids, which the legacy allocator numbers from 0, so they
    index the cache directly. Swap pairs are the block manager's device-relative ids, so a CPU
    id indexes the CPU cache directly too.
    """

    def __init__(self, num_blocks: int, block_size: int, *, num_cpu_blocks: int = 0, num_heads: int = 4,
                 num_kv_heads: int = 2, head_size: int = 32, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None, seed: int = 0):
        from paged_attention import runtime
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size), ("num_heads", num_heads),
                            ("num_kv_heads", num_kv_heads), ("head_size", head_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(num_cpu_blocks, int) or isinstance(num_cpu_blocks, bool) or num_cpu_blocks < 0:
            raise ValueError(f"num_cpu_blocks must be an int >= 0, got {num_cpu_blocks!r}")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise TypeError(f"dtype must be float32, float16 or bfloat16, got {dtype}")
        if head_size % ref.v0_x(dtype):
            raise ValueError(f"head_size ({head_size}) must be a multiple of {ref.v0_x(dtype)} for the v0 layout")
        self.num_blocks, self.block_size, self.num_cpu_blocks = num_blocks, block_size, num_cpu_blocks
        self.num_heads, self.num_kv_heads, self.head_size = num_heads, num_kv_heads, head_size
        self.dtype, self.seed = dtype, seed
        self.device = torch.device(device) if device is not None else runtime.DEVICE
        self._tokens: dict[str, list[int]] = {}        # per sequence: the tokens whose K/V are in the cache
        self._num_checks = 0
        self._one = torch.ones(1, dtype=torch.float32, device=self.device)

        gen = torch.Generator().manual_seed(seed + 1)
        shape = (num_blocks, block_size, num_kv_heads, head_size)
        garbage = [torch.randn(shape, generator=gen).to(device=self.device, dtype=dtype) for _ in range(2)]
        v0 = ref.flash_to_v0(*garbage)
        # Host caches are pinned where there is a GPU, so swap_blocks' copies can run asynchronously.
        pin = self.device.type == "cuda"

        def host(t: torch.Tensor) -> torch.Tensor:
            return torch.zeros((num_cpu_blocks, *t.shape[1:]), dtype=dtype, pin_memory=pin)
        self._copies = [_CacheCopy("reference", "v0", *[t.clone() for t in v0], *[host(t) for t in v0]),
                        _CacheCopy("Triton", "flash", *[t.clone() for t in garbage], *[host(t) for t in garbage]),
                        _CacheCopy("CUDA (ours)", "v0", *[t.clone() for t in v0], *[host(t) for t in v0])]

    # ---- what each implementation runs ---------------------------------------------------------
    @staticmethod
    def _module(copy: _CacheCopy):
        from paged_attention.kernels import cuda, triton
        return {"reference": ref, "Triton": triton, "CUDA (ours)": cuda}[copy.name]

    def _each(self, op: Callable[[_CacheCopy], None]) -> None:
        """Apply ``op`` to every running copy. The reference's errors propagate; another
        implementation stops at its first error, marked skipped (``KernelUnavailable``) or failed
        (anything else), and ``check`` reports it so."""
        for copy in self._copies:
            if copy.skipped is not None or copy.failed is not None:
                continue
            try:
                op(copy)
            except KernelUnavailable as e:
                if copy.name == "reference":
                    raise
                copy.skipped = str(e)
            except Exception as e:             # noqa: BLE001  (reported by check as FAILED)
                if copy.name == "reference":
                    raise
                copy.failed = _describe(e)

    # ---- the steps a notebook takes ------------------------------------------------------------
    def write(self, name: str, table, token_ids: Sequence[int], start: int | None = None) -> None:
        """Write the K/V of ``token_ids[start:]`` into their slots through ``table``.

        ``token_ids`` is the sequence's whole token list so far (the table must hold exactly
        that many tokens). ``start`` defaults to the first token not yet written for ``name``
        (0 for a new sequence); a larger ``start`` says the tokens before it are already in
        the cache (a prefix-cache hit), so they are not written again.
        """
        if not isinstance(name, str):
            raise TypeError(f"name must be a str, got {type(name).__name__}")
        ids = self._table_ids(name, table)
        token_ids = [int(t) for t in token_ids]
        if table.num_full_slots != len(token_ids):
            raise ValueError(f"table {name!r} holds {table.num_full_slots} tokens but token_ids has {len(token_ids)}")
        known = self._tokens.get(name, [])
        if start is None:
            if token_ids[:len(known)] != known:
                raise ValueError(f"the first {len(known)} tokens of {name!r} differ from those written before")
            start = len(known)
        if not isinstance(start, int) or not 0 <= start <= len(token_ids):
            raise ValueError(f"start must be an int in [0, {len(token_ids)}], got {start!r}")
        for p in range(start, len(token_ids)):
            if isinstance(table.blocks[p // self.block_size], NullBlock):
                raise ValueError(f"token {p} of {name!r} falls in a block its sliding window has dropped")
        slots = torch.tensor([ids[p // self.block_size] * self.block_size + p % self.block_size
                              for p in range(start, len(token_ids))], dtype=torch.int64, device=self.device)
        key, value = token_kv(token_ids, self.num_kv_heads, self.head_size, self.dtype, self.device, self.seed)
        key, value = key[start:], value[start:]

        def op(copy: _CacheCopy) -> None:
            module = self._module(copy)
            write = module.reshape_and_cache if copy.layout == "v0" else module.reshape_and_cache_flash
            write(key, value, copy.key_cache, copy.value_cache, slots, "auto", self._one, self._one)
        if slots.numel():
            self._each(op)
        self._tokens[name] = token_ids

    def fork(self, parent: str, child: str) -> None:
        """``child`` was forked from ``parent``: its tokens so far are in the cache already."""
        if parent not in self._tokens:
            raise KeyError(f"no sequence named {parent!r} has been written")
        if not isinstance(child, str):
            raise TypeError(f"child must be a str, got {type(child).__name__}")
        self._tokens[child] = list(self._tokens[parent])

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy block ``src`` over block ``dst`` for every ``(src, dst)`` copy-on-write pair
        (``allocator.clear_copy_on_writes()``), as an int64 ``[n, 2]`` tensor for ``copy_blocks``."""
        pairs = [tuple(p) for p in pairs]
        if not pairs:
            return
        for p in pairs:
            if len(p) != 2 or not all(isinstance(i, int) and 0 <= i < self.num_blocks for i in p):
                raise ValueError(f"each pair must be two block ids in [0, {self.num_blocks}), got {p!r}")
        mapping = torch.tensor(pairs, dtype=torch.int64, device=self.device)

        def op(copy: _CacheCopy) -> None:
            module = ref if copy.layout == "flash" else self._module(copy)
            module.copy_blocks([copy.key_cache], [copy.value_cache], mapping)
        self._each(op)

    def _pairs(self, pairs, src: tuple[str, int], dst: tuple[str, int]) -> torch.Tensor:
        """Validate ``(src, dst)`` block-id pairs against both caches' sizes; an int64 ``[n, 2]``
        CPU tensor, as ``swap_blocks`` wants."""
        pairs = [tuple(p) for p in pairs]
        for p in pairs:
            if len(p) != 2 or not all(isinstance(i, int) and not isinstance(i, bool) for i in p) \
                    or not (0 <= p[0] < src[1] and 0 <= p[1] < dst[1]):
                raise ValueError(f"each pair must be a {src[0]} block id in [0, {src[1]}) and a {dst[0]} block id "
                                 f"in [0, {dst[1]}), got {p!r}")
        return torch.tensor(pairs, dtype=torch.int64).reshape(-1, 2)

    def _swap_module(self, copy: _CacheCopy):
        """Our CUDA copy swaps with our CUDA kernel; the others with the plain-torch one."""
        return self._module(copy) if copy.name == "CUDA (ours)" else ref

    def swap_out(self, pairs: Sequence[tuple[int, int]]) -> int:
        """Copy GPU block ``g`` to CPU block ``c`` for every ``(g, c)`` pair of
        ``block_manager.swap_out``, and remember what each block held. Returns the number of
        blocks copied."""
        mapping = self._pairs(pairs, ("GPU", self.num_blocks), ("CPU", self.num_cpu_blocks))
        if not mapping.numel():
            return 0

        def op(copy: _CacheCopy) -> None:
            gpu = mapping[:, 0].to(copy.key_cache.device)
            sent = (copy.key_cache[gpu].clone(), copy.value_cache[gpu].clone())
            swap = self._swap_module(copy).swap_blocks
            swap(copy.key_cache, copy.cpu_key_cache, mapping)
            swap(copy.value_cache, copy.cpu_value_cache, mapping)
            for row, cpu_id in enumerate(mapping[:, 1].tolist()):
                copy.swapped[cpu_id] = (sent[0][row], sent[1][row])
        self._each(op)
        return len(set(mapping[:, 1].tolist()))

    def swap_in(self, pairs: Sequence[tuple[int, int]]) -> int:
        """Copy CPU block ``c`` to GPU block ``g`` for every ``(c, g)`` pair of
        ``block_manager.swap_in``; every block must arrive bit for bit as it was swapped out
        (``AssertionError`` otherwise). Returns the number of blocks checked.

        What a CPU block was sent is kept after it comes back: with prefix caching two swapped
        groups can share a CPU block, and the second swap-in reads it again."""
        mapping = self._pairs(pairs, ("CPU", self.num_cpu_blocks), ("GPU", self.num_blocks))
        if not mapping.numel():
            return 0
        cpu_ids = sorted(set(mapping[:, 0].tolist()))
        reference = self._copies[0]
        unknown = [c for c in cpu_ids if c not in reference.swapped]
        if unknown:
            raise ValueError(f"CPU block {unknown[0]} was not swapped out through this check")

        def op(copy: _CacheCopy) -> None:
            swap = self._swap_module(copy).swap_blocks
            swap(copy.cpu_key_cache, copy.key_cache, mapping)
            swap(copy.cpu_value_cache, copy.value_cache, mapping)
            for cpu_id, gpu_id in mapping.tolist():
                key, value = copy.swapped[cpu_id]
                if not (torch.equal(copy.key_cache[gpu_id], key) and torch.equal(copy.value_cache[gpu_id], value)):
                    raise AssertionError(f"{copy.name}: CPU block {cpu_id} came back to GPU block {gpu_id} "
                                         "different from what was swapped out")
        self._each(op)
        return len(cpu_ids)

    def forget(self, name: str) -> None:
        """``name`` finished: its tokens are no longer expected anywhere (its blocks may be reused)."""
        if name not in self._tokens:
            raise KeyError(f"no sequence named {name!r} has been written")
        del self._tokens[name]

    def check(self, tables: Mapping[str, object]) -> Verification:
        """One decode step over ``tables`` by every implementation, each sequence compared with
        dense float64 attention over its own tokens' keys and values; the caches of Triton and
        CUDA must also equal the reference's bit for bit."""
        if not isinstance(tables, Mapping) or not tables:
            raise TypeError("tables must be a non-empty dict of name -> BlockTable")
        names = list(tables)
        rows = []
        for name in names:
            ids = self._table_ids(name, tables[name])
            if any(isinstance(b, NullBlock) for b in tables[name].blocks):
                raise ValueError(f"table {name!r} has sliding-window null blocks: these kernels attend to "
                                 "every token, so its dropped tokens cannot be checked")
            if name not in self._tokens or len(self._tokens[name]) != tables[name].num_full_slots:
                written = len(self._tokens.get(name, []))
                raise ValueError(f"table {name!r} holds {tables[name].num_full_slots} tokens, but {written} "
                                 "have been written: call write() first")
            if not tables[name].num_full_slots:
                raise ValueError(f"table {name!r} holds no tokens")
            rows.append(ids)
        width = max(len(r) for r in rows)
        block_tables = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32, device=self.device)
        seq_lens = torch.tensor([len(self._tokens[n]) for n in names], dtype=torch.int32, device=self.device)
        max_len = int(seq_lens.max())
        gen = torch.Generator().manual_seed(self.seed * 7919 + self._num_checks)
        self._num_checks += 1
        query = torch.randn(len(names), self.num_heads, self.head_size, generator=gen).to(self.device, self.dtype)
        scale = self.head_size ** -0.5

        # Dense attention over each sequence's own tokens: one block holding all of them.
        oracle = torch.empty(len(names), self.num_heads, self.head_size, dtype=torch.float64, device=self.device)
        for s, name in enumerate(names):
            k, v = token_kv(self._tokens[name], self.num_kv_heads, self.head_size, self.dtype, self.device, self.seed)
            one_block = torch.zeros(1, 1, dtype=torch.int32, device=self.device)
            oracle[s] = ref.ref_decode_attention(query[s:s + 1], k[None], v[None], one_block, seq_lens[s:s + 1],
                                                 scale)[0]

        v = Verification(f"{len(names)} block tables ({', '.join(names)}) over {self.num_blocks} blocks of "
                         f"{self.block_size}: paged attention vs dense attention over each sequence's own tokens; "
                         f"{self.num_heads} query heads over {self.num_kv_heads} KV heads, head size "
                         f"{self.head_size}, {str(self.dtype).replace('torch.', '')}")
        reference = self._copies[0]

        def compare(out: torch.Tensor, impl: str) -> str:
            for s, name in enumerate(names):
                assert_close_to_oracle(out[s], oracle[s], f"{impl}, sequence {name!r}")
            return f"max |error| {(out.double() - oracle).abs().max().item():.1e}"

        def same_cache(copy: _CacheCopy) -> None:
            caches = (copy.key_cache, copy.value_cache)
            if copy.layout == "flash":
                caches = ref.flash_to_v0(*caches)
            if not (torch.equal(caches[0], reference.key_cache) and torch.equal(caches[1], reference.value_cache)):
                raise AssertionError(f"{copy.name}'s KV cache differs from the reference's")

        def v0_args(copy: _CacheCopy) -> tuple:
            return (query, copy.key_cache, copy.value_cache, self.num_kv_heads, scale, block_tables, seq_lens,
                    self.block_size, max_len, None, "auto", self._one, self._one)

        def run_attention(copy: _CacheCopy, version: str) -> str:
            module = self._module(copy)
            out = torch.empty_like(query)
            if copy.layout == "flash":
                module.paged_attention_decode(out, query, copy.key_cache, copy.value_cache, block_tables,
                                              seq_lens, scale)
            elif version == "v1":
                module.paged_attention_v1(out, *v0_args(copy))
            else:
                module.paged_attention_v2(out, *ref.v2_scratch(query, max_len), *v0_args(copy))
            detail = compare(out, f"{copy.name} {version}".strip())
            if copy is not reference:
                same_cache(copy)
                detail += "; cache identical to the reference's"
            return detail

        v.rows.append(("reference v1", "ok", run_attention(reference, "v1")))
        for label, copy, version in (("Triton", self._copies[1], ""), ("CUDA v1 (ours)", self._copies[2], "v1"),
                                     ("CUDA v2 (ours)", self._copies[2], "v2")):
            if copy.skipped is not None:
                v.rows.append((label, "skipped", copy.skipped))
            elif copy.failed is not None:
                v.rows.append((label, "FAILED", f"at an earlier step: {copy.failed}"))
            else:
                _attempt(v, label, lambda: run_attention(copy, version))
        return _finish(v)

    def _table_ids(self, name: str, table) -> list[int]:
        if not isinstance(table, BlockTable):
            raise TypeError(f"table {name!r} must be a legacy BlockTable, got {type(table).__name__}")
        ids = list(table.physical_block_ids)
        bad = [i for i in ids if not 0 <= i < self.num_blocks]
        if bad:
            raise ValueError(f"table {name!r} holds block id {bad[0]}, outside the cache's [0, {self.num_blocks}) "
                             "(a CPU id after a swap?)")
        return ids


@dataclass
class ScheduledRun:
    """What ``check_scheduled_run`` did: the steps run, the blocks that came back from the CPU
    (each bit for bit as it left), the copies on write applied, and every step's check."""
    steps: int
    blocks_swapped_in: int
    copies: int
    checks: list[Verification]


def check_scheduled_run(engine, kv: PagedCacheCheck) -> ScheduledRun:
    """Drive ``engine`` (a ``legacy.workload.SimulatedEngine``) to the end, keeping real keys and
    values in ``kv``'s caches as vLLM V0's worker did before each forward pass: the swap-ins
    (``swap_blocks`` CPU -> GPU, each block checked bit-identical to what went out), the
    swap-outs (GPU -> CPU), the copies on write (``copy_blocks``); then each prefill's prompt
    (after its prefix-cache hit) and each decode's new token written through its table, and every
    running sequence's attention checked (``PagedCacheCheck.check``). A sequence recomputed or
    finished is forgotten. Raises ``AssertionError`` at the first step that goes wrong."""
    tables = engine.block_manager.block_tables
    name = engine.seq_name
    returned, copies, checks = 0, 0, []
    while not engine.done:
        record = engine.schedule()
        returned += kv.swap_in(record.blocks_to_swap_in)
        kv.swap_out(record.blocks_to_swap_out)
        kv.copy_blocks(record.blocks_to_copy)
        copies += len(record.blocks_to_copy)
        for group in record.recomputed:               # their K/V is gone: written again on admission
            for seq in group.get_seqs(SequenceStatus.WAITING):
                kv.forget(name(seq))
        for group in record.prefills:                 # the prompt, once; the other samples fork it
            first, *rest = group.get_seqs(SequenceStatus.RUNNING)
            kv.write(name(first), tables[first.seq_id], first.get_token_ids(),
                     start=record.num_cached_tokens[group.request_id])
            for seq in rest:
                kv.fork(name(first), name(seq))
        for group in record.decodes:                  # one new token per sequence
            for seq in group.get_seqs(SequenceStatus.RUNNING):
                kv.write(name(seq), tables[seq.seq_id], seq.get_token_ids())
        if engine.live_tables():
            checks.append(kv.check(engine.live_tables()))
        for seq in engine.update(record):             # finished samples are freed
            kv.forget(name(seq))
    return ScheduledRun(len(engine.history), returned, copies, checks)


def verify_block_tables(tables: Mapping[str, object], token_ids: Mapping[str, Sequence[int]], num_blocks: int,
                        block_size: int, **kwargs) -> Verification:
    """Write every sequence's tokens through its table into fresh caches, then ``check``: the
    one-call form of ``PagedCacheCheck`` (``kwargs``: its shape, dtype, device and seed)."""
    if not isinstance(token_ids, Mapping) or set(token_ids) != set(tables):
        raise ValueError("token_ids must be a dict with the same names as tables")
    kv = PagedCacheCheck(num_blocks, block_size, **kwargs)
    for name, table in tables.items():
        kv.write(name, table, token_ids[name])
    return kv.check(tables)
