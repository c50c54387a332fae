"""Every kernel front-end and every tensor argument, given as a strided view.

A kernel that indexes a tensor by its shape alone reads the wrong elements of a view: a block
table with strided columns sent the Triton decode to block ids of a million (a crashed process),
strided lengths or ALiBi slopes gave wrong numbers without a word. Each front-end must honour a
tensor's strides, copy a small input to contiguous memory, or refuse the view before anything
is written: ``ValueError`` where no implementation takes it, ``KernelUnavailable`` where it is
the limit of one (our CUDA kernels and vLLM's index some tensors by shape).

The harness: an operation's arguments are built contiguous and the operation run once; then one
argument (or the key and value caches together) is replaced by a view holding the same values
through other strides, whose gaps hold values that would make any misread visible (NaN, an id
of a poisoned block, a "skip" slot). What the call writes must come out the same, and the gaps
of a written view must be untouched; a refused view must leave everything as it was.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch

from paged_attention import runtime, verify
from paged_attention.kernels import cuda as ck
from paged_attention.kernels import reference as ref
from paged_attention.kernels import triton as tk
from paged_attention.kernels import KernelUnavailable, vllm
from paged_attention.kernels.workloads import assert_close_to_oracle, every_other, make_decode_problem

needs_fa3 = pytest.mark.skipif(not (runtime.HAS_CUDA and vllm.available("fa3")[0]), reason="vLLM's FA3 not available")
needs_cache_ops = pytest.mark.skipif(not (runtime.HAS_CUDA and vllm.available("cache_ops")[0]),
                                     reason="vLLM's cache ops not available")
WRITTEN_FILL = 7.0            # what the gaps of a written view hold, and must still hold after


# --------------------------------------------------------------------------------------------
# Views with the same values through other strides
# --------------------------------------------------------------------------------------------

def reversed_memory(t: torch.Tensor) -> torch.Tensor:
    """``t`` stored with its dimensions in reverse order (a 2-D tensor: column-major)."""
    dims = tuple(reversed(range(t.dim())))
    return t.permute(dims).contiguous().permute(dims)


def restride(t: torch.Tensor, variant: str, fill) -> torch.Tensor:
    if variant == "reversed":
        return reversed_memory(t)
    dim = {"dim0": 0, "dim1": 1, "dim2": 2, "dim3": 3, "last": t.dim() - 1}[variant]
    return every_other(t, dim, fill)


def gaps_untouched(view: torch.Tensor, fill) -> bool:
    """Every element of ``view``'s base outside the view still holds ``fill``."""
    base = view._base if view._base is not None else view
    outside = torch.ones(base.shape, dtype=torch.bool, device=base.device)
    outside.as_strided(view.shape, view.stride(), view.storage_offset() - base.storage_offset()).zero_()
    return bool((base[outside] == fill).all())


# --------------------------------------------------------------------------------------------
# The operations
# --------------------------------------------------------------------------------------------

@dataclass
class Op:
    """An operation under test: fresh contiguous arguments, the call (its positional arguments
    are ``names``), what it writes, and the views it refuses (``(argument, variant) -> match``)."""
    make: Callable[[torch.device], dict]
    call: Callable[..., torch.Tensor | None]
    names: tuple[str, ...]
    written: tuple[str, ...]
    refused: dict[tuple[str, str], str] = field(default_factory=dict)
    exact: bool = True          # written values equal bit for bit (data movement) or to rounding
    gpu: bool = False           # needs CUDA tensors (our CUDA kernels, vLLM's)


def _problem(device, lens=(20, 9), block_size=8, dtype=torch.float32):
    """A small decode batch with ALiBi and one spare block, poisoned, whose id is returned:
    the gaps of a strided block table point at it."""
    p = make_decode_problem(list(lens), num_heads=4, num_kv_heads=2, head_size=32, block_size=block_size,
                            dtype=dtype, device=device, alibi=True, spare_blocks=1, seed=11)
    used = {b for s, n in enumerate(p.seq_lens.tolist()) for b in p.block_tables[s, :-(-n // block_size)].tolist()}
    (spare,) = set(range(p.key_cache.size(0))) - used
    p.key_cache[spare] = 1e4
    p.value_cache[spare] = 1e4
    return p, spare


def _decode_args(device, dtype=torch.float32):
    p, spare = _problem(device, dtype=dtype)
    a = dict(out=torch.zeros_like(p.query), query=p.query, key_cache=p.key_cache, value_cache=p.value_cache,
             block_tables=p.block_tables, seq_lens=p.seq_lens, scale=p.scale, alibi_slopes=p.alibi_slopes)
    return a, spare


def _make_decode(device):
    a, spare = _decode_args(device)
    a["_fills"] = {"block_tables": spare}
    return a


def _v0_args(device, lens=(530, 9), dtype=torch.float32, v2=False):
    """v1/v2 arguments over the v0 layout: a 530-token sequence makes v2 merge two partitions."""
    p, spare = _problem(device, lens=lens, block_size=16, dtype=dtype)
    key_v0, value_v0 = ref.flash_to_v0(p.key_cache, p.value_cache)
    one = torch.ones(1, dtype=torch.float32, device=device)
    a = dict(out=torch.zeros_like(p.query))
    if v2:
        a.update(zip(("exp_sums", "max_logits", "tmp_out"), (t.zero_() for t in ref.v2_scratch(p.query, max(lens)))))
    a.update(query=p.query, key_cache=key_v0, value_cache=value_v0, num_kv_heads=2, scale=p.scale,
             block_tables=p.block_tables, seq_lens=p.seq_lens, block_size=16, max_seq_len=max(lens),
             alibi_slopes=p.alibi_slopes, kv_cache_dtype="auto", k_scale=one, v_scale=one.clone())
    a["_fills"] = {"block_tables": spare}
    return a


def _tokens(device, num_tokens=12, num_heads=2, head_size=16, dtype=torch.float32):
    gen = torch.Generator().manual_seed(3)
    key = torch.randn(num_tokens, num_heads, head_size, generator=gen).to(device, dtype)
    value = torch.randn(num_tokens, num_heads, head_size, generator=gen).to(device, dtype)
    slots = torch.randperm(6 * 8, generator=gen)[:num_tokens]
    slots[::4] = -1                                         # padding tokens
    return key, value, slots.to(device)


def _make_flash_write(device, kv_dtype="auto"):
    key, value, slots = _tokens(device)
    cache_dtype = torch.uint8 if kv_dtype != "auto" else key.dtype
    return dict(key=key, value=value,
                key_cache=torch.zeros(6, 8, 2, 16, dtype=cache_dtype, device=device),
                value_cache=torch.zeros(6, 8, 2, 16, dtype=cache_dtype, device=device),
                slot_mapping=slots, kv_cache_dtype=kv_dtype,
                k_scale=torch.tensor([0.05, 0.1], device=device), v_scale=torch.tensor([0.2, 0.02], device=device))


def _make_v0_write(device, kv_dtype="auto"):
    key, value, slots = _tokens(device)
    cache_dtype = torch.uint8 if kv_dtype != "auto" else key.dtype
    x = ref.v0_x(cache_dtype)
    return dict(key=key, value=value,
                key_cache=torch.zeros(6, 2, 16 // x, 8, x, dtype=cache_dtype, device=device),
                value_cache=torch.zeros(6, 2, 16, 8, dtype=cache_dtype, device=device),
                slot_mapping=slots, kv_cache_dtype=kv_dtype,
                k_scale=torch.tensor([0.05], device=device), v_scale=torch.tensor([0.2], device=device))


def _make_copy(device):
    gen = torch.Generator().manual_seed(4)
    layers = [torch.randn(6, 8, 2, 16, generator=gen).to(device) for _ in range(2)]
    return dict(key_cache=layers[0], value_cache=layers[1],
                block_mapping=torch.tensor([[0, 3], [4, 1], [0, 5]], device=device))


def _make_swap(device):
    gen = torch.Generator().manual_seed(5)
    return dict(src=torch.randn(6, 8, 2, 16, generator=gen).to(device),
                dst=torch.zeros(4, 8, 2, 16, pin_memory=device.type == "cuda"),
                block_mapping=torch.tensor([[5, 0], [1, 3], [2, 1]]))


def _args(a: dict, *names: str) -> list:
    return [a[n] for n in names]


FLASH_WRITE = ("key", "value", "key_cache", "value_cache", "slot_mapping", "kv_cache_dtype", "k_scale", "v_scale")
DECODE = ("out", "query", "key_cache", "value_cache", "block_tables", "seq_lens", "scale", "alibi_slopes")
V1 = ("out", "query", "key_cache", "value_cache", "num_kv_heads", "scale", "block_tables", "seq_lens",
      "block_size", "max_seq_len", "alibi_slopes", "kv_cache_dtype", "k_scale", "v_scale")
V2 = V1[:1] + ("exp_sums", "max_logits", "tmp_out") + V1[1:]
COPY = ("key_cache", "value_cache", "block_mapping")
SWAP = ("src", "dst", "block_mapping")

FP8 = "fp8_e4m3"
UNIT_LAST = "unit stride in its last"


def _flash_refusals(*names: str) -> dict:
    """Flash caches need a unit last stride and one block stride for K and V (every front-end);
    ``names``: the key/value inputs whose head dimension must be contiguous too."""
    refused = {(n, v): "unit stride" for n in names for v in ("last", "reversed")}
    refused.update({(n, "dim0"): "same block stride" for n in ("key_cache", "value_cache")})
    refused.update({(n, "last"): "unit stride" for n in ("key_cache", "value_cache", "kv_caches")})
    return refused


def _unit_last(*names: str) -> dict:
    return {(n, v): UNIT_LAST for n in names for v in ("last", "reversed")}


def _copy_blocks(impl):
    return lambda key_cache, value_cache, block_mapping: impl.copy_blocks([key_cache], [value_cache], block_mapping)


_CUDA_NOT_CONTIGUOUS = "must be contiguous for the CUDA kernels"
_CUDA_ROWS = "contiguous heads within each token"
_ALL_VIEWS = ("dim0", "dim1", "dim2", "dim3", "last", "reversed")
_SWAP_REFUSED = {(n, v): "must be contiguous" for n in ("src", "dst") for v in _ALL_VIEWS}


def _cuda_attention_refusals(*written: str) -> dict:
    """Our CUDA attention reads the query through its strides and copies the index tensors, but
    indexes the caches (and writes its outputs) by shape: those must be contiguous."""
    refused = {(n, v): _CUDA_NOT_CONTIGUOUS for n in ("key_cache", "value_cache", *written) for v in _ALL_VIEWS}
    refused.update(_unit_last("query"))
    return refused


OPS: dict[str, Op] = {
    # ---- plain torch: reads and writes any view -------------------------------------------
    "ref.reshape_and_cache": Op(lambda d: _make_v0_write(d, FP8), ref.reshape_and_cache, FLASH_WRITE,
                                ("key_cache", "value_cache")),
    "ref.reshape_and_cache_flash": Op(lambda d: _make_flash_write(d, FP8), ref.reshape_and_cache_flash, FLASH_WRITE,
                                      ("key_cache", "value_cache"), refused=_flash_refusals()),
    "ref.copy_blocks": Op(_make_copy, _copy_blocks(ref), COPY, ("key_cache", "value_cache")),
    "ref.swap_blocks": Op(_make_swap, ref.swap_blocks, SWAP, ("dst",), refused=_SWAP_REFUSED),
    "ref.paged_attention_v1": Op(_v0_args, ref.paged_attention_v1, V1, ("out",), exact=False),
    "ref.paged_attention_v2": Op(lambda d: _v0_args(d, v2=True), ref.paged_attention_v2, V2,
                                 ("out", "exp_sums", "max_logits", "tmp_out"), exact=False),
    "ref.ref_decode_attention": Op(_make_decode, ref.ref_decode_attention, DECODE[1:], (), exact=False),
    # ---- Triton: strides go to the kernel; a head's elements must be contiguous ---------------
    "triton.reshape_and_cache_flash": Op(_make_flash_write, tk.reshape_and_cache_flash, FLASH_WRITE,
                                         ("key_cache", "value_cache"), refused=_flash_refusals("key", "value")),
    "triton.paged_attention_decode": Op(_make_decode, tk.paged_attention_decode, DECODE, ("out",), exact=False,
                                        refused=_unit_last("out", "query", "key_cache", "value_cache", "kv_caches")),
    "triton.paged_attention_decode (2 splits)": Op(
        _make_decode, lambda *a: tk.paged_attention_decode(*a, num_splits=2), DECODE, ("out",), exact=False),
    # ---- our CUDA kernels: strides passed where the kernel takes them, small inputs copied,
    # ---- the rest refused ---------------------------------------------------------------------
    "cuda.reshape_and_cache": Op(
        lambda d: _make_v0_write(d, FP8), ck.reshape_and_cache, FLASH_WRITE, ("key_cache", "value_cache"), gpu=True,
        refused={**{(n, v): _CUDA_NOT_CONTIGUOUS for n in ("key_cache", "value_cache", "kv_caches") for v in _ALL_VIEWS},
                 **{(n, v): _CUDA_ROWS for n in ("key", "value") for v in ("dim1", "last", "reversed")}}),
    "cuda.reshape_and_cache_flash": Op(
        lambda d: _make_flash_write(d, FP8), ck.reshape_and_cache_flash, FLASH_WRITE, ("key_cache", "value_cache"),
        gpu=True, refused=_flash_refusals("key", "value")),
    "cuda.copy_blocks": Op(
        _make_copy, _copy_blocks(ck), COPY, ("key_cache", "value_cache"), gpu=True,
        refused={(n, v): _CUDA_NOT_CONTIGUOUS for n in ("key_cache", "value_cache") for v in _ALL_VIEWS}),
    "cuda.swap_blocks": Op(_make_swap, ck.swap_blocks, SWAP, ("dst",), gpu=True, refused=_SWAP_REFUSED),
    "cuda.paged_attention_v1": Op(_v0_args, ck.paged_attention_v1, V1, ("out",), exact=False, gpu=True,
                                  refused=_cuda_attention_refusals("out")),
    "cuda.paged_attention_v2": Op(lambda d: _v0_args(d, v2=True), ck.paged_attention_v2, V2,
                                  ("out", "exp_sums", "max_logits", "tmp_out"), exact=False, gpu=True,
                                  refused=_cuda_attention_refusals("out", "exp_sums", "max_logits", "tmp_out")),
}

# Which views of which argument each operation is tried with ("kv_caches": both caches at once).
_FLOAT3 = ("dim0", "dim1", "last", "reversed")
_CACHE4 = ("dim0", "dim1", "dim2", "last")
_CACHE5 = ("dim0", "dim1", "dim2", "dim3", "last")
_TABLE = ("dim0", "dim1", "reversed")
_VECTOR = ("dim0",)
_WRITE = {"key": _FLOAT3, "value": _FLOAT3, "slot_mapping": _VECTOR, "k_scale": _VECTOR, "v_scale": _VECTOR}
_V0_WRITE = {**_WRITE, "key_cache": _CACHE5, "value_cache": _CACHE4, "kv_caches": _VECTOR}
_FLASH_WRITE = {**_WRITE, "key_cache": _VECTOR, "value_cache": _VECTOR, "kv_caches": _CACHE4}
_COPY = {"key_cache": _CACHE4, "value_cache": _CACHE4, "block_mapping": _TABLE}
_SWAP = {"src": ("dim0", "dim1"), "dst": ("dim0", "dim1"), "block_mapping": _TABLE}
_INDEX = {"block_tables": _TABLE, "seq_lens": _VECTOR, "alibi_slopes": _VECTOR}
_V1 = {"out": _FLOAT3, "query": _FLOAT3, "key_cache": _CACHE5, "value_cache": _CACHE4, **_INDEX,
       "k_scale": _VECTOR, "v_scale": _VECTOR}
_V2 = {**_V1, "exp_sums": ("dim0", "dim2", "reversed"), "max_logits": ("dim0", "dim2", "reversed"),
       "tmp_out": ("dim0", "dim2", "last")}
_DECODE = {"query": _FLOAT3, "key_cache": _CACHE4, "value_cache": _CACHE4, "kv_caches": _VECTOR, **_INDEX}
VIEWS: dict[str, dict[str, tuple[str, ...]]] = {
    "ref.reshape_and_cache": _V0_WRITE,
    "ref.reshape_and_cache_flash": _FLASH_WRITE,
    "ref.copy_blocks": _COPY,
    "ref.swap_blocks": _SWAP,
    "ref.paged_attention_v1": _V1,
    "ref.paged_attention_v2": _V2,
    "ref.ref_decode_attention": _DECODE,
    "triton.reshape_and_cache_flash": _FLASH_WRITE,
    "triton.paged_attention_decode": {"out": _FLOAT3, **_DECODE},
    "triton.paged_attention_decode (2 splits)": {"out": ("dim0", "dim1"), **_INDEX},
    "cuda.reshape_and_cache": _V0_WRITE,
    "cuda.reshape_and_cache_flash": _FLASH_WRITE,
    "cuda.copy_blocks": _COPY,
    "cuda.swap_blocks": _SWAP,
    "cuda.paged_attention_v1": _V1,
    "cuda.paged_attention_v2": _V2,
}
# What the gaps of a strided index tensor hold: a value that changes the result if read.
INDEX_FILLS = {"seq_lens": 1, "slot_mapping": -1, "block_mapping": 2}

CASES = [pytest.param(op, arg, view, id=f"{op}-{arg}-{view}", marks=[pytest.mark.cuda] if OPS[op].gpu else [])
         for op, views in VIEWS.items() for arg, kinds in views.items() for view in kinds]


def _fill(op: Op, a: dict, name: str, t: torch.Tensor):
    if name in op.written:
        return WRITTEN_FILL
    if name in a.get("_fills", {}):
        return a["_fills"][name]
    if name in INDEX_FILLS:
        return INDEX_FILLS[name]
    return float("nan") if t.is_floating_point() else 0


def _run(op: Op, a: dict):
    return op.call(*_args(a, *op.names))


@pytest.mark.parametrize("op_name,arg,view", CASES)
def test_strided_argument(op_name, arg, view):
    """The operation gives the same result through a strided view of ``arg``, or refuses it
    with a ValueError (or KernelUnavailable, for a limit of one implementation) and writes nothing."""
    op = OPS[op_name]
    device = torch.device("cuda") if op.gpu else runtime.DEVICE
    expected = op.make(device)
    expected_result = _run(op, expected)

    a = op.make(device)
    names = ("key_cache", "value_cache") if arg == "kv_caches" else (arg,)
    for name in names:
        a[name] = restride(a[name], view, _fill(op, a, name, a[name]))
    assert any(not a[n].is_contiguous() or a[n].stride() != expected[n].stride() for n in names), "not a new layout"
    before = {n: a[n].clone() for n in op.written}

    match = op.refused.get((arg, view))
    if match is not None:
        # A layout only one implementation cannot read is that implementation's limit
        # (KernelUnavailable: verify lists it as skipped); one no implementation takes is a ValueError.
        error = KernelUnavailable if match in (_CUDA_NOT_CONTIGUOUS, _CUDA_ROWS) else ValueError
        with pytest.raises(error, match=match):
            _run(op, a)
        for n in op.written:
            assert torch.equal(a[n], before[n]), f"a refused call wrote into {n}"
        return
    result = _run(op, a)
    for n in op.written:
        if op.exact:
            assert torch.equal(a[n], expected[n]), f"{n} differs through a {view} view of {arg}"
        else:
            torch.testing.assert_close(a[n], expected[n], rtol=1e-5, atol=1e-6, equal_nan=False)
        if n in names:
            assert gaps_untouched(a[n], WRITTEN_FILL), f"{op_name} wrote outside the view of {n}"
    if expected_result is not None:
        torch.testing.assert_close(result, expected_result, rtol=1e-6, atol=1e-9)


def test_every_tensor_argument_is_tried():
    """Each operation is tried with a strided view of every tensor it takes."""
    for op_name, op in OPS.items():
        a = op.make(torch.device("cpu")) if not op.gpu else _make_args_on_cpu(op_name)
        tensors = {n for n in op.names if isinstance(a[n], torch.Tensor)}
        missing = tensors - set(VIEWS[op_name])
        if op_name.endswith("(2 splits)"):          # the caches and query: as without splits
            missing -= {"query", "key_cache", "value_cache"}
        assert not missing, f"{op_name}: no strided view of {sorted(missing)}"


def _make_args_on_cpu(op_name: str) -> dict:
    """A GPU operation's arguments as its reference twin builds them (same names)."""
    return OPS["ref." + op_name.split(".", 1)[1]].make(torch.device("cpu"))


# --------------------------------------------------------------------------------------------
# The defects, as they were reported
# --------------------------------------------------------------------------------------------

def _issue_problem(device):
    return make_decode_problem([20, 9], num_heads=4, num_kv_heads=2, head_size=32, block_size=8, device=device)


def test_decode_block_table_with_strided_columns(device):
    # Every other column of a table whose other columns hold an id far outside the cache: read
    # as contiguous, the kernel looked those ids up and the process died.
    p = _issue_problem(device)
    expected = ref.ref_decode_attention(*p.decode_args())
    b = torch.full((2, 6), 10 ** 6, dtype=torch.int32, device=device)
    b[:, ::2] = p.block_tables
    for table in (b[:, ::2], p.block_tables.t().contiguous().t()):
        out = torch.empty_like(p.query)
        tk.paged_attention_decode(out, p.query, p.key_cache, p.value_cache, table, p.seq_lens, p.scale)
        assert_close_to_oracle(out, expected)


def test_cache_write_with_strided_slot_mapping(device):
    # Every other slot of a longer mapping whose other entries are far outside the cache.
    key, value, slots = _tokens(device)
    s = torch.full((2 * slots.numel(),), 10 ** 9, dtype=torch.int64, device=device)
    s[::2] = slots
    caches = [torch.zeros(6, 8, 2, 16, device=device) for _ in range(2)]
    expected = [c.clone() for c in caches]
    one = torch.ones(1, device=device)
    ref.reshape_and_cache_flash(key, value, *expected, slots, "auto", one, one)
    tk.reshape_and_cache_flash(key, value, *caches, s[::2], "auto", one, one)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])


def test_decode_strided_seq_lens_and_alibi_slopes(device):
    p = make_decode_problem([20, 9], num_heads=4, num_kv_heads=2, head_size=32, block_size=8, device=device,
                            alibi=True)
    expected = ref.ref_decode_attention(*p.decode_args())
    lens = every_other(p.seq_lens, 0, 10 ** 6)
    slopes = every_other(p.alibi_slopes, 0, float("nan"))
    for seq_lens, alibi in ((lens, p.alibi_slopes), (p.seq_lens, slopes), (lens, slopes)):
        out = torch.empty_like(p.query)
        tk.paged_attention_decode(out, p.query, p.key_cache, p.value_cache, p.block_tables, seq_lens, p.scale, alibi)
        assert_close_to_oracle(out, expected)


def test_decode_max_seq_len_contract(device):
    # A positive int; checked against the lengths when they are read (check_ids=True), and an
    # upper bound the caller promises otherwise. The kernel never drops a token either way.
    p = _issue_problem(device)
    expected = ref.ref_decode_attention(*p.decode_args())
    out = torch.full_like(p.query, 7.0)
    for bad, error, match in [(1, ValueError, r"max_seq_len \(1\) must be >= the longest of seq_lens \(20\)"),
                              (19, ValueError, "longest"), (0, ValueError, "max_seq_len must be >= 1"),
                              (-3, ValueError, "max_seq_len must be >= 1"), (True, TypeError, "must be an int"),
                              (20.0, TypeError, "must be an int"), ("20", TypeError, "must be an int")]:
        with pytest.raises(error, match=match):
            tk.paged_attention_decode(out, *p.decode_args(), max_seq_len=bad)
        assert (out == 7.0).all()
    for max_seq_len, check_ids, splits in [(20, True, None), (64, True, None), (20, False, 3), (1, False, None),
                                           (9, False, 2)]:
        out = torch.empty_like(p.query)
        tk.paged_attention_decode(out, *p.decode_args(), max_seq_len=max_seq_len, check_ids=check_ids,
                                  num_splits=splits)
        assert_close_to_oracle(out, expected)
    with pytest.raises(TypeError, match="num_splits must be an int"):
        tk.paged_attention_decode(out, *p.decode_args(), num_splits=True)


def test_v0_attention_max_seq_len_zero_is_a_value_error():
    a = _v0_args(torch.device("cpu"), lens=(20, 9))
    a.pop("_fills")
    for bad, error in ((0, ValueError), (19, ValueError), (True, TypeError)):
        a["max_seq_len"] = bad
        with pytest.raises(error, match="max_seq_len"):
            ref.paged_attention_v1(*_args(a, *V1))
    assert (a["out"] == 0).all()


def test_decode_empty_batch_with_unchecked_ids(device, monkeypatch):
    # No sequence: nothing is launched and nothing written (a launch on an empty grid fails on a
    # GPU), checked or not; the arguments are still checked.
    from paged_attention import triton_launch
    launches = []
    for method in ("__call__", "pinned"):
        real = getattr(triton_launch.Launcher, method)
        monkeypatch.setattr(triton_launch.Launcher, method,
                            lambda self, *a, _real=real: launches.append(self.kernel) or _real(self, *a))
    p = _issue_problem(device)
    caches = p.key_cache.clone(), p.value_cache.clone()
    empty = (p.query[:0], p.key_cache, p.value_cache, p.block_tables[:0], p.seq_lens[:0], p.scale)
    for kwargs in (dict(check_ids=False), dict(max_seq_len=4), dict(check_ids=False, max_seq_len=4), {}):
        out = torch.empty_like(p.query[:0])
        assert tk.paged_attention_decode(out, *empty, **kwargs) is None
        assert out.shape == (0, *p.query.shape[1:])
    assert launches == []
    assert torch.equal(p.key_cache, caches[0]) and torch.equal(p.value_cache, caches[1])
    with pytest.raises(ValueError):                      # an empty batch checks its arguments all the same
        tk.paged_attention_decode(torch.empty_like(p.query[:0]), *empty, check_ids=False, max_seq_len=0)
    with pytest.raises(TypeError):
        tk.paged_attention_decode(torch.empty_like(p.query[:0]).double(), *empty, check_ids=False, max_seq_len=4)
    # The same calls with one sequence do launch (what the counter would miss if it counted nothing).
    tk.paged_attention_decode(torch.empty_like(p.query[:1]), p.query[:1], p.key_cache, p.value_cache,
                              p.block_tables[:1], p.seq_lens[:1], p.scale, check_ids=False, max_seq_len=20)
    assert launches


# --------------------------------------------------------------------------------------------
# The scale, and what is not a tensor
# --------------------------------------------------------------------------------------------

def _scaled_v0(v2: bool):
    def call(scale):
        a = _v0_args(torch.device("cpu"), lens=(20, 9), v2=v2)
        a["scale"] = scale
        (ref.paged_attention_v2 if v2 else ref.paged_attention_v1)(*_args(a, *(V2 if v2 else V1)))
        return a["out"]
    return call


def _scaled_decode(decoder):
    def call(scale):
        p = _issue_problem(runtime.DEVICE)
        out = torch.zeros_like(p.query)
        decoder(out, *p.decode_args()[:5], scale)
        return out
    return call


SCALE_FRONT_ENDS = {
    "reference oracle": _scaled_decode(lambda out, *a: out.copy_(ref.ref_decode_attention(*a))),
    "triton": _scaled_decode(tk.paged_attention_decode),
    "reference v1": _scaled_v0(v2=False),
    "reference v2": _scaled_v0(v2=True),
}


@pytest.mark.parametrize("front_end", list(SCALE_FRONT_ENDS))
@pytest.mark.parametrize("scale,error,match", [
    (float("nan"), ValueError, "scale must be finite, got nan"),
    (float("inf"), ValueError, "scale must be finite, got inf"),
    (-float("inf"), ValueError, "scale must be finite"),
    (torch.tensor(0.17), TypeError, r"scale must be a real number .* torch.Tensor"),
    (torch.tensor([0.17]), TypeError, "scale must be a real number"),
    ("0.17", TypeError, "scale must be a real number such as 0.125, got str"),
    (True, TypeError, "scale must be a real number"),
    (None, TypeError, "got NoneType"),
])
def test_scale_is_a_finite_real_number(front_end, scale, error, match):
    with pytest.raises(error, match=match):
        SCALE_FRONT_ENDS[front_end](scale)


@pytest.mark.parametrize("front_end", list(SCALE_FRONT_ENDS))
def test_scale_as_numpy_or_int_is_accepted(front_end):
    import numpy as np
    a = SCALE_FRONT_ENDS[front_end](np.float32(0.25))
    b = SCALE_FRONT_ENDS[front_end](0.25)
    torch.testing.assert_close(a, b)
    assert torch.isfinite(SCALE_FRONT_ENDS[front_end](1)).all()


def test_refused_scale_leaves_out_untouched(device):
    p = _issue_problem(device)
    out = torch.full_like(p.query, 7.0)
    for scale in (float("nan"), torch.tensor(p.scale)):
        with pytest.raises((ValueError, TypeError), match="scale"):
            tk.paged_attention_decode(out, *p.decode_args()[:5], scale)
    assert (out == 7.0).all()


@pytest.mark.parametrize("writer", [ref.reshape_and_cache_flash, tk.reshape_and_cache_flash])
def test_list_slot_mapping_is_a_type_error_and_writes_nothing(device, writer):
    key, value, slots = _tokens(device)
    caches = [torch.zeros(6, 8, 2, 16, device=device) for _ in range(2)]
    one = torch.ones(1, device=device)
    with pytest.raises(TypeError, match="slot_mapping must be a torch.Tensor, got list"):
        writer(key, value, *caches, slots.tolist(), "auto", one, one)
    assert not caches[0].any() and not caches[1].any()


def test_list_slot_mapping_in_the_v0_write():
    a = _make_v0_write(torch.device("cpu"))
    a["slot_mapping"] = a["slot_mapping"].tolist()
    with pytest.raises(TypeError, match="slot_mapping must be a torch.Tensor, got list"):
        ref.reshape_and_cache(*_args(a, *FLASH_WRITE))
    assert not a["key_cache"].any()


@pytest.mark.parametrize("decoder", [tk.paged_attention_decode,
                                     lambda out, *a: out.copy_(ref.ref_decode_attention(*a))])
@pytest.mark.parametrize("name", ["block_tables", "seq_lens"])
def test_numpy_index_tensors_are_named(decoder, name):
    p = _issue_problem("cpu")
    args = dict(zip(DECODE[1:], p.decode_args()))
    args[name] = args[name].numpy()
    with pytest.raises(TypeError, match=f"{name} must be a torch.Tensor, got numpy.ndarray"):
        decoder(torch.empty_like(p.query), *args.values())


def test_v1_numpy_block_tables_is_named():
    a = _v0_args(torch.device("cpu"), lens=(20, 9))
    a["block_tables"] = a["block_tables"].numpy()
    with pytest.raises(TypeError, match="block_tables must be a torch.Tensor, got numpy.ndarray"):
        ref.paged_attention_v1(*_args(a, *V1))


def test_value_of_another_dtype_is_refused(device):
    a = _make_flash_write(device)
    a["value"] = a["value"].half()
    for writer in (ref.reshape_and_cache_flash, tk.reshape_and_cache_flash):
        with pytest.raises(TypeError, match="value must have the key's dtype"):
            writer(*_args(a, *FLASH_WRITE))
    assert not a["key_cache"].any()


@pytest.mark.parametrize("which", ["out", "key_cache"])
def test_written_tensor_with_shared_elements_is_refused(device, which):
    # An expanded view (stride 0) would be written by several programs at one address.
    if which == "out":
        p = _issue_problem(device)
        out = torch.zeros(1, 4, 32, device=device).expand(2, 4, 32)
        with pytest.raises(ValueError, match="out is written"):
            tk.paged_attention_decode(out, *p.decode_args())
    else:
        a = _make_flash_write(device)
        base = torch.zeros(1, 8, 2, 16, device=device)
        a["key_cache"] = a["value_cache"] = base.expand(6, 8, 2, 16)
        for writer in (ref.reshape_and_cache_flash, tk.reshape_and_cache_flash):
            with pytest.raises(ValueError, match="key_cache is written"):
                writer(*_args(a, *FLASH_WRITE))
        assert not base.any()


# --------------------------------------------------------------------------------------------
# verify: strided structures from a notebook, end to end
# --------------------------------------------------------------------------------------------

def test_verify_decode_with_strided_inputs():
    p = make_decode_problem([20, 9, 33], num_heads=4, num_kv_heads=2, head_size=32, block_size=8,
                            device=runtime.DEVICE, alibi=True, layout="HND", seed=2)
    expected = ref.ref_decode_attention(*p.decode_args())
    table = torch.full((3, 2 * p.block_tables.size(1)), 10 ** 6, dtype=torch.int32, device=runtime.DEVICE)
    table[:, ::2] = p.block_tables
    args = (every_other(p.query, 1, float("nan")), p.key_cache, p.value_cache, table[:, ::2],
            every_other(p.seq_lens, 0, 10 ** 6), p.scale, every_other(p.alibi_slopes, 0, float("nan")))
    oracle, v = verify.verify_decode(*args)
    assert "Triton" in v.verified
    torch.testing.assert_close(oracle, expected)


def test_verify_cache_writes_with_strided_inputs():
    key, value, slots = _tokens(runtime.DEVICE)
    s = torch.full((2 * slots.numel(),), 10 ** 9, dtype=torch.int64, device=runtime.DEVICE)
    s[::2] = slots
    # K and V as views of one (2, N, H, B, D) tensor in HND memory: every stride differs from NHD.
    kv = torch.zeros(2, 6, 2, 8, 16, device=runtime.DEVICE).permute(0, 1, 3, 2, 4)
    plain = [torch.zeros(6, 8, 2, 16, device=runtime.DEVICE) for _ in range(2)]
    one = torch.ones(1, device=runtime.DEVICE)
    ref.reshape_and_cache_flash(every_other(key, 1, float("nan")), value, *plain, slots, "auto", one, one)
    v = verify.verify_cache_writes(every_other(key, 1, float("nan")), value, kv[0], kv[1], s[::2])
    assert "Triton" in v.verified
    assert torch.equal(kv[0], plain[0]) and torch.equal(kv[1], plain[1])


def test_verify_cache_writes_names_a_list_argument():
    key, value, slots = _tokens("cpu")
    caches = [torch.zeros(6, 8, 2, 16) for _ in range(2)]
    with pytest.raises(TypeError, match="slot_mapping must be a torch.Tensor, got list"):
        verify.verify_cache_writes(key, value, *caches, slots.tolist())
    with pytest.raises(TypeError, match="key must be a torch.Tensor, got list"):
        verify.verify_cache_writes(key.tolist(), value, *caches, slots)
    assert not caches[0].any()


# --------------------------------------------------------------------------------------------
# GPU: the CUDA and vLLM front-ends' own checks (their strided views are in the harness above)
# --------------------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("scale,error", [(float("nan"), ValueError), (float("inf"), ValueError),
                                         (torch.tensor(0.17), TypeError)])
def test_cuda_attention_refuses_a_bad_scale(scale, error):
    for v2 in (False, True):
        a = _v0_args(torch.device("cuda"), v2=v2)
        a["scale"] = scale
        with pytest.raises(error, match="scale"):
            (ck.paged_attention_v2 if v2 else ck.paged_attention_v1)(*_args(a, *(V2 if v2 else V1)))
        assert (a["out"] == 0).all()


@pytest.mark.cuda
def test_cuda_attention_max_seq_len_contract():
    a = _v0_args(torch.device("cuda"))
    for bad, error in ((0, ValueError), (100, ValueError), (True, TypeError)):
        a["max_seq_len"] = bad
        with pytest.raises(error, match="max_seq_len"):
            ck.paged_attention_v1(*_args(a, *V1))
    assert (a["out"] == 0).all()


@pytest.mark.cuda
@needs_fa3
def test_vllm_decode_with_strided_index_tensors():
    a, spare = _decode_args(torch.device("cuda"), dtype=torch.float16)
    a["alibi_slopes"] = None
    expected = ref.ref_decode_attention(*_args(a, *DECODE[1:]))
    a["block_tables"] = every_other(a["block_tables"], 1, spare)
    a["seq_lens"] = every_other(a["seq_lens"], 0, 1)
    vllm.paged_attention_decode(*_args(a, *DECODE))
    assert_close_to_oracle(a["out"], expected)
    for scale, error in ((float("nan"), ValueError), (torch.tensor(0.1), TypeError)):
        with pytest.raises(error, match="scale"):
            vllm.paged_attention_decode(*_args(a, *DECODE[:6]), scale)
    with pytest.raises(ValueError, match="max_seq_len"):
        vllm.paged_attention_decode(*_args(a, *DECODE), max_seq_len=1)


@pytest.mark.cuda
@needs_cache_ops
def test_vllm_cache_writes_with_strided_views():
    a = _make_flash_write(torch.device("cuda"))
    a["k_scale"], a["v_scale"] = (torch.ones(1, device="cuda") for _ in range(2))
    expected = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in a.items()}
    ref.reshape_and_cache_flash(*_args(expected, *FLASH_WRITE))
    a["slot_mapping"] = every_other(a["slot_mapping"], 0, -1)
    a["key"] = every_other(a["key"], 0, float("nan"))
    vllm.reshape_and_cache_flash(*_args(a, *FLASH_WRITE))
    assert torch.equal(a["key_cache"], expected["key_cache"]) and torch.equal(a["value_cache"], expected["value_cache"])
    # Caches whose strides differ (vLLM addresses both by the key cache's) are refused.
    before = a["key_cache"].clone()
    hnd = torch.zeros(6, 2, 8, 16, device="cuda").permute(0, 2, 1, 3)
    with pytest.raises(KernelUnavailable, match="same strides"):
        vllm.reshape_and_cache_flash(a["key"], a["value"], a["key_cache"], hnd, *_args(a, *FLASH_WRITE[4:]))
    with pytest.raises(KernelUnavailable, match="contiguous heads"):
        vllm.reshape_and_cache_flash(every_other(a["key"], 1, 0.0), *_args(a, *FLASH_WRITE[1:]))
    assert torch.equal(a["key_cache"], before)
