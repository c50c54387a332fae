"""``python -m paged_attention check``: is every kernel right on this machine?

It prints the machine, then one row per kernel with one column per implementation (plain-torch
reference, Triton, our CUDA, vLLM's own compiled kernels and its Triton attention where they are
found), each ``ok``, ``skipped``
(the implementation raised ``KernelUnavailable``: it cannot run here; its whole message is
printed) or ``FAILED`` (anything else: a wrong result, or an error on good input, with the error),
and exits non-zero if anything failed. A teacher runs it on every lab machine.

Each check is written once, against the functions' common signature, and run against every
implementation that provides the function; the expected values are computed independently
(token-by-token Python loops, or the float64 oracle).
"""
from __future__ import annotations

import importlib
import sys
import traceback
from typing import Callable

import torch

from paged_attention import runtime
from paged_attention.kernels import KernelUnavailable, args
from paged_attention.kernels import reference as ref
from paged_attention.kernels.workloads import assert_close_to_oracle, every_other, make_decode_problem

KERNELS = ("reshape_and_cache", "reshape_and_cache_flash", "copy_blocks", "swap_blocks",
           "paged_attention_v1", "paged_attention_v2", "paged_attention_decode")
IMPLEMENTATIONS = ("reference", "triton", "cuda", "vllm", "vllm-triton")


def _dtypes() -> list[torch.dtype]:
    if runtime.HAS_CUDA:
        return [torch.float32, torch.float16, torch.bfloat16]
    return [torch.float32, torch.float16]


def _one() -> torch.Tensor:
    return torch.ones(1, dtype=torch.float32, device=runtime.DEVICE)


def _new_tokens(num_tokens, num_heads, head_size, num_slots, dtype, seed=0):
    """Random keys/values and distinct slots for them, one of them padding (-1)."""
    gen = torch.Generator().manual_seed(seed)
    key = torch.randn(num_tokens, num_heads, head_size, generator=gen).to(runtime.DEVICE, dtype)
    value = torch.randn(num_tokens, num_heads, head_size, generator=gen).to(runtime.DEVICE, dtype)
    slots = torch.randperm(num_slots, generator=gen)[:num_tokens]
    slots[num_tokens // 2] = -1
    return key, value, slots.to(runtime.DEVICE)


def check_reshape_and_cache(impl) -> None:
    for dtype in _dtypes():
        n_blocks, block_size, heads, head_size = 6, 16, 4, 64
        key, value, slots = _new_tokens(20, heads, head_size, n_blocks * block_size, dtype)
        x = ref.v0_x(dtype)
        key_cache = torch.zeros(n_blocks, heads, head_size // x, block_size, x, dtype=dtype, device=runtime.DEVICE)
        value_cache = torch.zeros(n_blocks, heads, head_size, block_size, dtype=dtype, device=runtime.DEVICE)
        impl.reshape_and_cache(key, value, key_cache, value_cache, slots, "auto", _one(), _one())
        for t, s in enumerate(slots.tolist()):
            if s < 0:
                continue
            blk, off = divmod(s, block_size)
            for d in range(0, head_size, x):
                assert torch.equal(key_cache[blk, :, d // x, off], key[t, :, d:d + x]), f"key of token {t}"
            assert torch.equal(value_cache[blk, :, :, off], value[t]), f"value of token {t}"
        written = (slots >= 0).sum().item() * heads * head_size
        assert (key_cache != 0).sum().item() == written, "wrote outside the given slots"


def check_reshape_and_cache_flash(impl) -> None:
    for dtype in _dtypes():
        for layout in ("NHD", "HND"):
            n_blocks, block_size, heads, head_size = 6, 16, 4, 64
            key, value, slots = _new_tokens(20, heads, head_size, n_blocks * block_size, dtype)
            shape = (n_blocks, block_size, heads, head_size) if layout == "NHD" else (n_blocks, heads, block_size, head_size)
            caches = [torch.zeros(shape, dtype=dtype, device=runtime.DEVICE) for _ in range(2)]
            if layout == "HND":
                caches = [c.permute(0, 2, 1, 3) for c in caches]
            # Only the first 16 tokens have slots: the rest of `key` is padding and must be ignored.
            # HND also takes the slots as a strided view (its gaps say "skip": a kernel that
            # ignores the stride writes too little).
            given = slots[:16] if layout == "NHD" else every_other(slots[:16], 0, -1)
            impl.reshape_and_cache_flash(key, value, caches[0], caches[1], given, "auto", _one(), _one())
            for t, s in enumerate(slots[:16].tolist()):
                if s >= 0:
                    assert torch.equal(caches[0][s // block_size, s % block_size], key[t]), f"{layout} key {t}"
                    assert torch.equal(caches[1][s // block_size, s % block_size], value[t]), f"{layout} value {t}"
            written = (slots[:16] >= 0).sum().item() * heads * head_size
            assert (caches[0] != 0).sum().item() == written, f"{layout}: wrote outside the given slots"


def check_copy_blocks(impl) -> None:
    gen = torch.Generator().manual_seed(1)
    layers = [torch.randn(8, 16, 2, 32, generator=gen).to(runtime.DEVICE) for _ in range(4)]
    before = [c.clone() for c in layers]
    pairs = [(0, 5), (3, 1), (0, 7)]
    mapping = torch.tensor(pairs, dtype=torch.int64, device=runtime.DEVICE)
    impl.copy_blocks(layers[:2], layers[2:], mapping)
    for cache, old in zip(layers, before):
        expected = old.clone()
        for src, dst in pairs:
            expected[dst] = old[src]
        assert torch.equal(cache, expected), "copy_blocks result"


def check_swap_blocks(impl) -> None:
    gen = torch.Generator().manual_seed(2)
    device_cache = torch.randn(8, 16, 2, 32, generator=gen).to(runtime.DEVICE)
    host_cache = torch.zeros(6, 16, 2, 32, pin_memory=runtime.HAS_CUDA)
    out_pairs = [(7, 0), (2, 5)]
    impl.swap_blocks(device_cache, host_cache, torch.tensor(out_pairs))
    for src, dst in out_pairs:
        assert torch.equal(host_cache[dst], device_cache[src].cpu()), "swap out"
    back = torch.zeros_like(device_cache)
    nbytes = device_cache.element_size() * device_cache.stride(0)
    impl.swap_blocks(host_cache, back, nbytes, torch.tensor([(5, 1)]))
    assert torch.equal(back[1], device_cache[2]) and int((back != 0).sum()) == back[1].numel(), "swap in"


def _v0_problem(dtype, alibi):
    """600 tokens at most (two 512-token v2 partitions): the problem, its oracle, v1's arguments."""
    p = make_decode_problem([1, 37, 16, 600], num_heads=8, num_kv_heads=2, head_size=64, block_size=16,
                            dtype=dtype, device=runtime.DEVICE, alibi=alibi, seed=3)
    return p, ref.ref_decode_attention(*p.decode_args()), ref.v0_decode_args(*p.decode_args(), max_seq_len=600)


def check_paged_attention_v1(impl) -> None:
    for dtype in _dtypes():
        for alibi in (False, True):
            p, expected, v0_args = _v0_problem(dtype, alibi)
            out = torch.empty_like(p.query)
            impl.paged_attention_v1(out, *v0_args)
            assert_close_to_oracle(out, expected, "paged_attention_v1")


def check_paged_attention_v2(impl) -> None:
    for dtype in _dtypes():
        for alibi in (False, True):
            p, expected, v0_args = _v0_problem(dtype, alibi)
            out = torch.empty_like(p.query)
            impl.paged_attention_v2(out, *ref.v2_scratch(p.query, 600), *v0_args)
            assert_close_to_oracle(out, expected, "paged_attention_v2")


def check_paged_attention_decode(impl) -> None:
    # vLLM's FA3 runs in 16 bits and has no ALiBi: it declares what it takes.
    dtypes = [d for d in _dtypes() if d in getattr(impl, "DECODE_DTYPES", args.FLOAT_DTYPES)]
    for dtype in dtypes:
        for layout, alibi, splits, strided in (("NHD", False, None, False), ("HND", False, None, False),
                                               ("HND", True, None, True), ("NHD", False, 3, True)):
            if alibi and not getattr(impl, "DECODE_ALIBI", True):
                continue
            p = make_decode_problem([1, 37, 16, 600], num_heads=8, num_kv_heads=2, head_size=64, block_size=16,
                                    dtype=dtype, device=runtime.DEVICE, layout=layout, alibi=alibi, seed=4)
            expected = ref.ref_decode_attention(*p.decode_args())
            if strided:
                # Index tensors as strided views, their gaps holding wrong (but in-range) values.
                p.block_tables = every_other(p.block_tables, 1, 0)
                p.seq_lens = every_other(p.seq_lens, 0, 1)
                if alibi:
                    p.alibi_slopes = every_other(p.alibi_slopes, 0, 0.0)
            out = torch.empty_like(p.query)
            impl.paged_attention_decode(out, *p.decode_args(), num_splits=splits)
            assert_close_to_oracle(out, expected, "paged_attention_decode")


CHECKS: dict[str, Callable] = {name: globals()[f"check_{name}"] for name in KERNELS}


def _load(impl_name: str):
    """The implementation's module, or the reason it is not there. (One that is there but cannot
    run here, our CUDA kernels without a GPU say, raises ``KernelUnavailable`` when called.)"""
    module = {"reference": "paged_attention.kernels.reference",
              "triton": "paged_attention.kernels.triton",
              "cuda": "paged_attention.kernels.cuda",
              "vllm": "paged_attention.kernels.vllm",
              "vllm-triton": "paged_attention.kernels.vllm_triton"}[impl_name]
    try:
        return importlib.import_module(module), None
    except ModuleNotFoundError as e:
        if e.name == module:
            return None, f"{module} is not part of this version"
        raise


def run_checks() -> dict[tuple[str, str], tuple[str, str]]:
    """``{(kernel, implementation): (status, detail)}`` with status ok / FAILED / skipped / -."""
    results = {}
    for impl_name in IMPLEMENTATIONS:
        try:
            impl, why = _load(impl_name)
        except Exception as e:  # a broken build is a failure of every kernel it should provide
            impl, why = None, None
            for kernel in KERNELS:
                results[kernel, impl_name] = ("FAILED", f"import failed: {e!r}")
            continue
        for kernel in KERNELS:
            if impl is None:
                results[kernel, impl_name] = ("skipped", why)
            elif not hasattr(impl, kernel):
                results[kernel, impl_name] = ("-", "not provided")
            else:
                try:
                    CHECKS[kernel](impl)
                    results[kernel, impl_name] = ("ok", "")
                except KernelUnavailable as e:      # cannot run here: no GPU, not built, not found
                    results[kernel, impl_name] = ("skipped", str(e))
                except Exception as e:              # noqa: BLE001  (a wrong result, or an error on good input)
                    detail = "".join(traceback.format_exception_only(type(e), e)).strip()
                    results[kernel, impl_name] = ("FAILED", detail)
    return results


def main() -> int:
    print("paged-attention check")
    for key, value in runtime.describe().items():
        print(f"  {key:<20} {value}")
    print()
    results = run_checks()
    print(f"{'kernel':<26}" + "".join(f"{name:<12}" for name in IMPLEMENTATIONS))
    notes: dict[str, int] = {}
    for kernel in KERNELS:
        cells = []
        for impl_name in IMPLEMENTATIONS:
            status, detail = results[kernel, impl_name]
            if status in ("FAILED", "skipped"):
                number = notes.setdefault(f"{status}: {detail}", len(notes) + 1)
                status = f"{status} [{number}]"
            cells.append(f"{status:<12}")
        print(f"{kernel:<26}" + "".join(cells))
    if notes:
        print()
        for text, number in notes.items():
            print(f"[{number}] {text}")
    failed = sum(status == "FAILED" for status, _ in results.values())
    print()
    print("all verified kernels agree with the reference" if not failed else f"{failed} check(s) FAILED")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
