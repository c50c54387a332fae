"""Compile the PDL kernels for an H100 (sm_90) without a GPU and report what their PTX does in
what order, as JSON on stdout: ``python tests/pdl_ptx.py``. Run by ``tests/test_pdl.py`` in a
process of its own, because the compiler needs ``TRITON_INTERPRET=0`` from the first import on.

For each kernel, compiled with ``PDL`` on and off: how many ``griddepcontrol.wait``,
``griddepcontrol.launch_dependents`` and ``prefetch.global.L2`` instructions it has, how many
global loads come before its first wait, and whether every global store comes after it (the rule
that makes launching early safe: nothing is written before the previous kernel has finished).
"""
import json
import os
import re
import sys

os.environ["TRITON_INTERPRET"] = "0"
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from paged_attention.kernels.triton import pdl  # noqa: E402
from paged_attention.kernels.triton.decode import _paged_decode_kernel  # noqa: E402
from paged_attention.kernels.triton.fused_linear import _fused_linear_kernel  # noqa: E402
from paged_attention.kernels.triton.staged_linear import StagedConfig, _staged_linear_kernel, kernel_constants  # noqa: E402


def facts(ptx: str) -> dict:
    """The order facts of one kernel's PTX (instructions, not comments)."""
    lines = [ln.split("//")[0].strip() for ln in ptx.splitlines()]
    lines = [ln for ln in lines if ln]
    waits = [i for i, ln in enumerate(lines) if ln.startswith("griddepcontrol.wait")]
    first_wait = waits[0] if waits else len(lines)
    loads = [i for i, ln in enumerate(lines) if re.match(r"(@%p\d+\s+)?ld\.global", ln)]
    copies = [i for i, ln in enumerate(lines) if re.match(r"(@%p\d+\s+)?cp\.async\.c[ag]\.shared\.global", ln)]
    stores = [i for i, ln in enumerate(lines) if re.match(r"(@%p\d+\s+)?st\.global", ln)]
    launches = [i for i, ln in enumerate(lines) if ln.startswith("griddepcontrol.launch_dependents")]
    return {"waits": len(waits), "launch_dependents": len(launches),
            "prefetches": sum("prefetch.global.L2" in ln for ln in lines),
            "prefetches_after_wait": sum("prefetch.global.L2" in ln for ln in lines[first_wait:]),
            # the kernel parameters it reads (by position among the non-constexpr arguments)
            "params_read": sorted({int(i) for i in re.findall(r"_param_(\d+)\]", ptx)}),
            "loads_before_wait": sum(i < first_wait for i in loads),
            "stores": len(stores), "stores_after_wait": sum(i > first_wait for i in stores),
            "launch_after_wait": all(i > first_wait for i in launches),
            # cp.async copies global -> shared (16 bytes each): how many before and after the wait
            "copies_before_wait": sum(i < first_wait for i in copies),
            "copies_after_wait": sum(i > first_wait for i in copies)}


def compile_ptx(kernel, types: dict, constants: dict, num_warps: int, num_stages: int, pdl_on: bool,
                source=ASTSource) -> str:
    signature = {name: types.get(name, "constexpr") for name in kernel.arg_names}
    constexprs = {(kernel.arg_names.index(n),): v for n, v in constants.items()}
    # Pointers 16-byte aligned, as torch's allocations are (Triton specialises on it at launch).
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names) if types.get(n, "")[:1] == "*"}
    src = source(fn=kernel, signature=signature, constexprs=constexprs, attrs=aligned)
    options = {"num_warps": num_warps, "num_stages": num_stages, "launch_pdl": pdl_on}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]


def fused_linear(pdl_on: bool, two_chunks: bool = False, prefetch: int = 0) -> str:
    types = {n: "*bf16" for n in ("x_ptr", "residual_ptr", "norm_weight_ptr", "weight_ptr", "out_ptr", "prefetch_ptr",
                                 "stream_ptr", "add_ptr")}
    types.update(sum_sq_ptr="*fp32", sums_out_ptr="*fp32", eps="fp32")
    types.update({n: "i32" for n in _fused_linear_kernel.arg_names if n in ("M", "N", "K", "num_sums")
                  or n.startswith("stride_")})
    # The pipelined tile, or K read in two first chunks (512 + 64) on 8 warps, as the tuned QKV tiles.
    tile = dict(BLOCK_K=512, BLOCK_K2=64) if two_chunks else dict(BLOCK_K=64, BLOCK_K2=0)
    constants = dict(HAS_NORM=True, HAS_RESIDUAL=False, SILU_AND_MUL=True, NORM_FROM_SUMS=True, BLOCK_S=16,
                     ADD_RESIDUAL=False, BLOCK_M=16, BLOCK_N=32, **tile, PDL=pdl_on, PREFETCH_NUMEL=prefetch)
    return compile_ptx(_fused_linear_kernel, types, constants, *((8, 1) if two_chunks else (4, 3)), pdl_on)


def fused_linear_two_chunks(pdl_on: bool) -> str:
    return fused_linear(pdl_on, two_chunks=True)


def runtime_arg_index(kernel, name: str) -> int:
    """``name``'s position among ``kernel``'s arguments that are not constexpr (the PTX parameters)."""
    return [p.name for p in kernel.params if not p.is_constexpr].index(name)


def fused_linear_prefetch(pdl_on: bool) -> str:
    """The pipelined tile asking the L2 cache for a later projection's weights (SmolLM2's gate-up)."""
    return fused_linear(pdl_on, prefetch=3072 * 576)


def decode(pdl_on: bool) -> str:
    types = {n: "*bf16" for n in ("out_ptr", "q_ptr", "k_cache_ptr", "v_cache_ptr", "alibi_ptr")}
    types.update({n: "*fp32" for n in ("part_out_ptr", "part_m_ptr", "part_l_ptr", "lse_ptr", "cos_sin_ptr")})
    types.update({n: "*i32" for n in ("block_tables_ptr", "seq_lens_ptr")})
    types.update(pos_ptr="*i64", slot_ptr="*i64", qk_scale="fp32")
    types.update({n: "i32" for n in _paged_decode_kernel.arg_names if "stride" in n
                  or n in ("tokens_per_split", "num_splits")})
    constants = dict(QUERIES_PER_KV=3, BLOCK_G=16, HEAD_SIZE=64, BLOCK_D=64, BLOCK_SIZE=16, TILE_N=64, SPLIT=False,
                     USE_ALIBI=False, STORE_LSE=False, ROPE=True, DOT_PRECISION="tf32", OFFSETS_64=False, PDL=pdl_on)
    return compile_ptx(_paged_decode_kernel, types, constants, 4, 3, pdl_on)


def staged_linear(pdl_on: bool, mode: str = "down") -> str:
    """``staged_linear``'s kernel for SmolLM2's down projection (K = 1024 + 512, residual add) or
    its gate/up projection (``mode="gate_up"``: K = 512 + 64, norm from sums, SwiGLU), 32 columns
    a program: each thread copies 48 (gate_up: 2 x 18) 16-byte pieces of weights, and 24 (9) of
    the rows."""
    from triton.experimental.gluon._runtime import GluonASTSource
    types = {n: "*bf16" for n in ("x_ptr", "weight_ptr", "norm_weight_ptr", "add_ptr", "out_ptr")}
    types.update(sum_sq_ptr="*fp32", sums_out_ptr="*fp32", M="i32", eps="fp32", num_sums="i32")
    gate_up = mode == "gate_up"
    N, K, config = (1536, 576, StagedConfig(32, 512, 64)) if gate_up else (576, 1536, StagedConfig(32, 1024, 512))
    constants = kernel_constants(N, K, config, norm=gate_up, silu_and_mul=gate_up, add=not gate_up, num_sums=18,
                                 pdl_on=pdl_on)
    options = {k: constants.pop(k) for k in ("num_warps", "launch_pdl") if k in constants}
    return compile_ptx(_staged_linear_kernel, types, constants, options["num_warps"], 1, pdl_on,
                       source=GluonASTSource)


def staged_linear_gate_up(pdl_on: bool) -> str:
    return staged_linear(pdl_on, "gate_up")


@triton.jit
def _stores_before_waiting(x_ptr, y_ptr, PDL: tl.constexpr):
    """A planted bug for the checker: it writes before it waits for the kernel before it."""
    i = tl.arange(0, 128)
    tl.store(y_ptr + i, tl.load(x_ptr + i))
    pdl.wait(PDL)
    tl.store(y_ptr + 128 + i, tl.load(x_ptr + 128 + i))


def planted(pdl_on: bool) -> str:
    return compile_ptx(_stores_before_waiting, {"x_ptr": "*fp32", "y_ptr": "*fp32"}, {"PDL": pdl_on}, 4, 1, pdl_on)


if __name__ == "__main__":
    report = {f"{name}/{'pdl' if on else 'plain'}": facts(fn(on))
              for name, fn in (("fused_linear", fused_linear), ("fused_linear_two_chunks", fused_linear_two_chunks),
                               ("fused_linear_prefetch", fused_linear_prefetch),
                               ("decode", decode), ("staged_linear", staged_linear),
                               ("staged_linear_gate_up", staged_linear_gate_up), ("planted", planted))
              for on in (True, False)}
    report["fused_linear/prefetch_ptr"] = runtime_arg_index(_fused_linear_kernel, "prefetch_ptr")
    print(json.dumps(report))
