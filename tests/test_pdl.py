"""Programmatic dependent launch (``kernels.triton.pdl``): the switch, the ``pdl=`` arguments of
the kernels' front-ends, and, on a GPU that has it, that launching early changes no result: a
chain of fused projections and a decode step, captured in CUDA graphs, give the same bits with
PDL as without."""
import pytest
import torch

from paged_attention import runtime
from paged_attention.kernels.triton import fused_linear, paged_attention_decode, pdl
from paged_attention.kernels.triton.fused_linear import linear, linear_add, norm_linear
from paged_attention.model import LlamaConfig
from paged_attention.model.attention import PagedAttention
from paged_attention.model.layer_ops import FusedLayerOps, RotaryEmbedding
from tests.test_triton_decode import _rope_problem

DEV = runtime.DEVICE


def _has_pdl() -> bool:
    return pdl.enabled(DEV)


def test_not_on_a_cpu_and_the_switch_is_typed():
    assert not pdl.enabled(torch.device("cpu"))
    before = pdl._enabled
    for bad in (1, None, "yes"):
        with pytest.raises(TypeError):
            pdl.set_enabled(bad)
        assert pdl._enabled is before                      # unchanged by a refused call
    with pytest.raises(RuntimeError):
        with pdl.disabled():
            assert pdl._enabled is False
            raise RuntimeError("inside")
    assert pdl._enabled is before                          # restored, even after an error


def _projection_inputs(M=3, K=32, N=24, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, res = (torch.randn(M, K, generator=g).to(DEV, dtype) for _ in range(2))
    nw = (1 + 0.1 * torch.randn(K, generator=g)).to(DEV, dtype)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(DEV, dtype)
    add = torch.randn(M, N, generator=g).to(DEV, dtype)
    return x, res, nw, w, add


@pytest.mark.parametrize("bad", [1, None, "True"])
def test_front_ends_refuse_a_pdl_that_is_not_a_bool(bad):
    x, res, nw, w, add = _projection_inputs()
    res_before = res.clone()
    with pytest.raises(TypeError, match="pdl"):
        norm_linear(x, nw, w, 1e-5, res, pdl=bad)
    with pytest.raises(TypeError, match="pdl"):
        linear(x, w, pdl=bad)
    with pytest.raises(TypeError, match="pdl"):
        linear_add(x, w, add, pdl=bad)
    assert torch.equal(res, res_before)
    p, (H, KV, D) = _rope_problem(DEV, torch.float32)
    q = p["qkv"][:, :H * D].view(-1, H, D)
    out = torch.full_like(q, 7.0)
    kc = p["kc"].clone()
    with pytest.raises(TypeError, match="pdl"):
        paged_attention_decode(out, q, kc, p["vc"], p["table"], p["seq_lens"], D ** -0.5,
                               rope=(p["cos_sin"], p["pos"], p["slots"]), pdl=bad)
    assert torch.equal(out, torch.full_like(q, 7.0)) and torch.equal(kc, p["kc"])   # nothing launched


def test_pdl_true_gives_the_same_results_where_it_is_off():
    """On a CPU (or a GPU without PDL) ``pdl=True`` is accepted and launches as usual."""
    x, res, nw, w, add = _projection_inputs()
    for fn in (lambda f: norm_linear(x, nw, w, 1e-5, res, pdl=f)[0], lambda f: linear(x, w, pdl=f),
               lambda f: linear_add(x, w, add, pdl=f)[0]):
        assert torch.equal(fn(True), fn(False))


def _graph(fn):
    """``fn`` captured in a CUDA graph and replayed; its output after the replay."""
    fn()                                                    # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    graph.replay()
    torch.cuda.synchronize()
    return out.clone()


@pytest.mark.cuda
@pytest.mark.skipif(not _has_pdl(), reason="needs a GPU with programmatic dependent launch (compute capability 9+)")
def test_a_chain_of_fused_projections_is_the_same_with_pdl():
    """Twelve projections, each reading the one before's output right after its wait: with PDL a
    kernel that read its input before the previous kernel had written it would differ."""
    torch.manual_seed(0)
    M, H, dtype = 8, 256, torch.bfloat16
    ws = [(torch.randn(H, H) / H ** 0.5).to(DEV, dtype) for _ in range(12)]
    nw = torch.ones(H, device=DEV, dtype=dtype)
    x0 = torch.randn(M, H, device=DEV, dtype=dtype)

    def chain(on):
        def run():
            h, sums = x0, None
            for i, w in enumerate(ws):
                if i % 2:
                    h, sums = linear_add(h, w, x0, pdl=on)
                else:
                    h = norm_linear(h, nw, w, 1e-5, sum_sq=sums, pdl=on)[0] if sums is not None else \
                        linear(h, w, pdl=on)
            return h
        return run
    got, want = _graph(chain(True)), _graph(chain(False))
    assert torch.equal(got, want)
    assert got.abs().sum() > 0


@pytest.mark.cuda
@pytest.mark.skipif(not _has_pdl(), reason="needs a GPU with programmatic dependent launch (compute capability 9+)")
def test_decode_after_a_projection_is_the_same_with_pdl():
    """The decode kernel with rope, launched with PDL right after the projection that writes its
    QKV rows (it prefetches its keys and values before waiting): the same output and caches."""
    p, (H, KV, D) = _rope_problem(DEV, torch.bfloat16, lens=(70, 1, 300, 129), H=6, KV=2, D=64, B=16)
    g = torch.Generator().manual_seed(3)
    width = p["qkv"].size(1)
    x = torch.randn(p["qkv"].size(0), 128, generator=g).to(DEV, torch.bfloat16)
    w = (torch.randn(width, 128, generator=g) / 128 ** 0.5).to(DEV, torch.bfloat16)

    def step(on):
        kc, vc = p["kc"].clone(), p["vc"].clone()

        def run():
            qkv = linear(x, w, pdl=on)
            q = qkv[:, :H * D].view(-1, H, D)
            out = torch.empty_like(q)
            paged_attention_decode(out, q, kc, vc, p["table"], p["seq_lens"], D ** -0.5, check_ids=False,
                                   max_seq_len=300, rope=(p["cos_sin"], p["pos"], p["slots"]), pdl=on)
            return out
        return _graph(run), kc, vc
    got, want = step(True), step(False)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_the_model_takes_the_fused_projections_up_to_pdl_rows_where_pdl_is():
    cfg = LlamaConfig.tiny()
    rope = RotaryEmbedding(cfg.head_dim, 64, cfg.rope_theta, DEV)
    attn = PagedAttention("triton", cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, DEV)
    ops = FusedLayerOps(cfg, rope, attn)
    want = fused_linear.PDL_ROWS if pdl.enabled(DEV) else fused_linear.CUDA_CORE_ROWS
    assert ops.small_batch == want
    with pdl.disabled():
        assert FusedLayerOps(cfg, rope, attn).small_batch == fused_linear.CUDA_CORE_ROWS


# ---- The compiled code's order, checked without a GPU ------------------------------------------

@pytest.fixture(scope="module")
def ptx_facts():
    """``tests/pdl_ptx.py``'s report: the kernels compiled for sm_90 with and without PDL."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path
    script = Path(__file__).with_name("pdl_ptx.py")
    env = dict(os.environ, TRITON_INTERPRET="0")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


_COMPILER_CHECKED = pytest.mark.skipif(
    not __import__("triton").__version__.startswith("3.9"),
    reason="the compile-only check drives Triton's compiler API as Triton 3.9 has it")


@_COMPILER_CHECKED
@pytest.mark.parametrize("kernel", ["fused_linear", "fused_linear_two_chunks", "fused_linear_prefetch", "decode"])
def test_compiled_kernels_wait_before_they_write(ptx_facts, kernel):
    """With PDL: one wait, every global store after it, the launch of the next kernel after it
    too (so at most one kernel runs ahead), loads before it (the weights, or the lengths and
    tables), and L2 prefetches; without PDL none of these instructions."""
    on, off = ptx_facts[f"{kernel}/pdl"], ptx_facts[f"{kernel}/plain"]
    assert on["waits"] == 1 and on["launch_dependents"] == 1 and on["launch_after_wait"]
    assert on["stores"] > 0 and on["stores_after_wait"] == on["stores"]
    assert on["loads_before_wait"] > 0 and on["prefetches"] > 0
    assert off["waits"] == off["launch_dependents"] == off["prefetches"] == 0


@_COMPILER_CHECKED
def test_a_projection_given_weights_to_prefetch_asks_for_them_before_waiting(ptx_facts):
    """``PREFETCH_NUMEL``: the region's pointer is read (the same tile without leaves it unread),
    every prefetch comes before the wait (every store still after it), and none without PDL."""
    plain, more = ptx_facts["fused_linear/pdl"], ptx_facts["fused_linear_prefetch/pdl"]
    param = ptx_facts["fused_linear/prefetch_ptr"]
    assert param in more["params_read"] and param not in plain["params_read"]
    assert more["waits"] == 1 and more["prefetches"] > 0 and more["prefetches_after_wait"] == 0
    assert more["stores_after_wait"] == more["stores"]
    off = ptx_facts["fused_linear_prefetch/plain"]
    assert off["prefetches"] == 0 and param not in off["params_read"]


@_COMPILER_CHECKED
@pytest.mark.parametrize("kernel, weight_copies, row_copies", [("staged_linear", 48, 24),
                                                               ("staged_linear_gate_up", 2 * 18, 9)])
def test_staged_projections_copy_their_weights_before_waiting_and_their_rows_after(
        ptx_facts, kernel, weight_copies, row_copies):
    """``staged_linear``'s Gluon kernel (SmolLM2's down projection, and its gate/up projection
    with the norm and SwiGLU): every 16-byte ``cp.async`` piece of the weights is issued before
    the wait, every piece of the rows (the previous kernel's output) after it, nothing is loaded
    into registers before it (the norm's sums, its weight and the residual come after), and
    every store comes after it; without PDL the same copies and no wait."""
    on, off = ptx_facts[f"{kernel}/pdl"], ptx_facts[f"{kernel}/plain"]
    assert on["waits"] == 1 and on["launch_dependents"] == 1 and on["launch_after_wait"]
    assert on["copies_before_wait"] == weight_copies and on["copies_after_wait"] == row_copies
    assert on["loads_before_wait"] == 0 and on["stores"] > 0 and on["stores_after_wait"] == on["stores"]
    assert off["waits"] == off["launch_dependents"] == 0
    assert off["copies_before_wait"] == weight_copies + row_copies


@_COMPILER_CHECKED
def test_the_check_catches_a_kernel_that_writes_before_waiting(ptx_facts):
    planted = ptx_facts["planted/pdl"]
    assert planted["waits"] == 1 and planted["stores_after_wait"] < planted["stores"]
