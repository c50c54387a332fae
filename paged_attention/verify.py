"""One call per notebook section: run what the reader built through every kernel this machine has.

A notebook builds a slot mapping or a block table, then hands it here. ``verify_cache_writes``
scatters keys and values through the slot mapping with the reference and with every other
implementation present (Triton, our CUDA, vLLM's own), and ``verify_decode`` runs a decode step
over the block table with the float64 oracle, Triton, our CUDA v1/v2 and vLLM's FA3. Every result
must equal the reference (exactly for cache writes, within the dtype's tolerance for attention),
or an ``AssertionError`` says which one differs. An implementation that cannot run here (no GPU,
vLLM's kernels not found) or does not take these arguments (a head size it was not compiled
for, ALiBi for FA3) is listed as skipped, with the reason. The returned ``Verification``
prints as a small table.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from paged_attention.kernels import reference as ref
from paged_attention.kernels.cuda import CudaUnavailableError
from paged_attention.kernels.vllm import VllmUnavailableError
from paged_attention.kernels.workloads import assert_close_to_oracle


@dataclass
class Verification:
    """What was compared: one ``(implementation, status, detail)`` row each; status ok/skipped."""
    what: str
    rows: list[tuple[str, str, str]] = field(default_factory=list)

    @property
    def verified(self) -> list[str]:
        return [name for name, status, _ in self.rows if status == "ok"]

    def __str__(self) -> str:
        width = max(len(name) for name, _, _ in self.rows)
        lines = [self.what] + [f"  {name:<{width}}  {status:<7}  {detail}".rstrip() for name, status, detail in self.rows]
        return "\n".join(lines)

    __repr__ = __str__


def _attempt(v: Verification, name: str, run: Callable[[], str]) -> None:
    """Run one comparison; refusals and absences become 'skipped', mismatches propagate."""
    try:
        v.rows.append((name, "ok", run()))
    except (CudaUnavailableError, VllmUnavailableError) as e:
        v.rows.append((name, "skipped", str(e).split(";")[0]))
    except (ValueError, TypeError) as e:      # the implementation's own checks refused the arguments
        v.rows.append((name, "skipped", f"{type(e).__name__}: {e}"))


def _implementations():
    """(name, module) of every implementation after the reference; GPU ones only on a GPU."""
    from paged_attention.kernels import cuda, triton, vllm
    return [("Triton", triton), ("CUDA (ours)", cuda), ("vLLM", vllm)]


# --------------------------------------------------------------------------------------------
# Cache writes
# --------------------------------------------------------------------------------------------

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
    caches (as the op would), every other implementation into copies of them, which must then be
    equal to it bit for bit. Scales default to 1."""
    one = torch.ones(1, device=key.device)
    k_scale = one if k_scale is None else k_scale
    v_scale = one if v_scale is None else v_scale
    before = key_cache.clone(), value_cache.clone()
    ref.reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale)
    v = Verification(f"reshape_and_cache_flash: {int((slot_mapping >= 0).sum())} tokens through the slot mapping")
    v.rows.append(("reference", "ok", "plain torch, the oracle"))
    for name, impl in _implementations():
        def run(impl=impl) -> str:
            caches = [c.clone() for c in before]
            impl.reshape_and_cache_flash(key, value, *caches, slot_mapping, kv_cache_dtype, k_scale, v_scale)
            for got, want, which in ((caches[0], key_cache, "key"), (caches[1], value_cache, "value")):
                if not torch.equal(got, want):
                    raise AssertionError(f"{name}'s {which} cache differs from the reference's")
            return "identical to the reference"
        _attempt(v, name, run)
    return v


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
    return oracle, v
