"""vLLM's own kernels (``paged_attention.kernels.vllm``) against the reference, Triton and our CUDA.

Without a GPU or without vLLM's libraries, the adapter must import and every call must say why it
cannot run. On a GPU with the libraries (``PAGED_ATTENTION_VLLM_KERNELS``), vLLM's cache writes
must equal the reference bit for bit, and its FA3 decode must match the float64 oracle, Triton
and our CUDA v2 on fragmented block tables.
"""
import pytest
import torch

from paged_attention import runtime
from paged_attention.kernels import KernelUnavailable
from paged_attention.kernels import cuda as ck
from paged_attention.kernels import reference as ref
from paged_attention.kernels import triton as tk
from paged_attention.kernels import vllm
from paged_attention.kernels.workloads import assert_close_to_oracle, make_decode_problem

FOUND = {lib: vllm.available(lib) if runtime.HAS_CUDA else (False, "no GPU") for lib in vllm.LIBRARIES}


def _needs(library):
    ok, why = FOUND[library]

    def mark(test):
        """A GPU test that also needs one of vLLM's libraries: skipped, with the reason, without it."""
        return pytest.mark.cuda(pytest.mark.skipif(not ok, reason=f"vLLM's {library} not available: {why}")(test))
    return mark


needs_fa3, needs_cache_ops = _needs("fa3"), _needs("cache_ops")


def _one():
    return torch.ones(1, dtype=torch.float32, device="cuda")


# --------------------------------------------------------------------------------------------
# Without vLLM's kernels
# --------------------------------------------------------------------------------------------

def test_missing_folder_is_named(monkeypatch, tmp_path):
    monkeypatch.setenv(vllm.ENV_VAR, str(tmp_path))
    path, why = vllm.find_library(vllm.FA3_LIBRARY)
    assert path is None and vllm.ENV_VAR in why and str(tmp_path) in why
    (tmp_path / vllm.FA3_LIBRARY).write_bytes(b"")
    path, why = vllm.find_library(vllm.FA3_LIBRARY)
    assert path == tmp_path / vllm.FA3_LIBRARY and vllm.ENV_VAR in why


@pytest.mark.skipif(runtime.HAS_CUDA, reason="checks the behaviour on a machine without CUDA")
def test_without_a_gpu_every_function_says_why():
    ok, why = vllm.available()
    assert not ok and "GPU" in why
    for library in vllm.LIBRARIES:
        ok, why = vllm.available(library)
        assert not ok and "GPU" in why
    with pytest.raises(ValueError, match="library"):
        vllm.available("flashinfer")
    t = torch.zeros(1)
    calls = {
        "reshape_and_cache": (t,) * 5 + ("auto", t, t),
        "reshape_and_cache_flash": (t,) * 5 + ("auto", t, t),
        "swap_blocks": (t, t, t),
        "paged_attention_decode": (t,) * 6 + (1.0,),
    }
    for name, call_args in calls.items():
        with pytest.raises(vllm.VllmUnavailableError, match="triton"):
            getattr(vllm, name)(*call_args)


# --------------------------------------------------------------------------------------------
# Cache writes and swaps: bit for bit
# --------------------------------------------------------------------------------------------

def _tokens(n, heads, head_size, num_slots, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    key = torch.randn(n, heads, head_size, generator=gen).to("cuda", dtype)
    value = torch.randn(n, heads, head_size, generator=gen).to("cuda", dtype)
    slots = torch.randperm(num_slots, generator=gen)[:n]           # fragmented: anywhere in the cache
    slots[::7] = -1                                                 # padding tokens are skipped
    return key, value, slots.to("cuda")


@needs_cache_ops
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_reshape_and_cache_flash_equals_ours(dtype, layout, block_size):
    num_blocks, heads, head_size = 9, 8, 128
    key, value, slots = _tokens(70, heads, head_size, num_blocks * block_size, dtype, seed=block_size)
    shape = (num_blocks, block_size, heads, head_size) if layout == "NHD" else (num_blocks, heads, block_size, head_size)
    fresh = torch.randn(shape).to("cuda", dtype)
    results = {}
    for name, impl in (("reference", ref), ("triton", tk), ("cuda", ck), ("vllm", vllm)):
        caches = [fresh.clone(), fresh.clone() + 1]
        if layout == "HND":
            caches = [c.permute(0, 2, 1, 3) for c in caches]
        impl.reshape_and_cache_flash(key, value, *caches, slots, "auto", _one(), _one())
        results[name] = caches
    for name in ("triton", "cuda", "vllm"):
        assert all(torch.equal(a, b) for a, b in zip(results[name], results["reference"])), name


@needs_cache_ops
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_reshape_and_cache_v0_equals_ours(dtype):
    num_blocks, block_size, heads, head_size = 7, 16, 4, 128
    x = ref.v0_x(dtype)
    key, value, slots = _tokens(50, heads, head_size, num_blocks * block_size, dtype, seed=3)
    results = {}
    for name, impl in (("reference", ref), ("cuda", ck), ("vllm", vllm)):
        key_cache = torch.zeros(num_blocks, heads, head_size // x, block_size, x, dtype=dtype, device="cuda")
        value_cache = torch.zeros(num_blocks, heads, head_size, block_size, dtype=dtype, device="cuda")
        impl.reshape_and_cache(key, value, key_cache, value_cache, slots, "auto", _one(), _one())
        results[name] = (key_cache, value_cache)
    for name in ("cuda", "vllm"):
        assert all(torch.equal(a, b) for a, b in zip(results[name], results["reference"])), name


@needs_cache_ops
def test_swap_blocks_both_ways():
    gpu = torch.randn(10, 16, 4, 64, device="cuda")
    host = torch.zeros(6, 16, 4, 64, pin_memory=True)
    expected_host = host.clone()
    ref.swap_blocks(gpu.cpu(), expected_host, torch.tensor([[9, 0], [2, 5], [4, 3]]))
    vllm.swap_blocks(gpu, host, torch.tensor([[9, 0], [2, 5], [4, 3]]))
    torch.cuda.synchronize()
    assert torch.equal(host, expected_host)
    back = torch.zeros_like(gpu)
    nbytes = gpu.element_size() * gpu.stride(0)
    vllm.swap_blocks(host, back, nbytes, torch.tensor([[5, 1]]))
    torch.cuda.synchronize()
    assert torch.equal(back[1], gpu[2]) and int((back != 0).sum()) == back[1].numel()


# --------------------------------------------------------------------------------------------
# FA3 decode: against the oracle, Triton and our CUDA v2
# --------------------------------------------------------------------------------------------

@needs_fa3
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 8), (32, 8), (32, 4)])   # GQA 1, 4, 8
@pytest.mark.parametrize("block_size", [16, 32])
def test_fa3_decode_matches_everything_else(dtype, num_heads, num_kv_heads, block_size):
    lengths = [1, block_size, 3 * block_size, 37, 600, 2049]   # 1, exact multiples, ragged, >1 partition
    p = make_decode_problem(lengths, num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=128,
                            block_size=block_size, dtype=dtype, device="cuda", seed=block_size + num_kv_heads)
    oracle = ref.ref_decode_attention(*p.decode_args())
    fa3 = torch.empty_like(p.query)
    vllm.paged_attention_decode(fa3, *p.decode_args())
    assert_close_to_oracle(fa3, oracle, "vLLM FA3")

    triton_out = torch.empty_like(p.query)
    tk.paged_attention_decode(triton_out, *p.decode_args())
    key_v0, value_v0 = ref.flash_to_v0(p.key_cache, p.value_cache)
    v2 = torch.empty_like(p.query)
    ck.paged_attention_v2(v2, *ref.v2_scratch(p.query, max(lengths)), p.query, key_v0, value_v0, num_kv_heads,
                          p.scale, p.block_tables, p.seq_lens, block_size, max(lengths), None, "auto", _one(), _one())
    # Two 16-bit results each within tolerance of the oracle are within twice of each other.
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=4e-3, rtol=4e-3)
    torch.testing.assert_close(fa3, triton_out, **tol)
    torch.testing.assert_close(fa3, v2, **tol)


@needs_fa3
def test_fa3_decode_bad_input_leaves_out_untouched():
    p = make_decode_problem([5, 40], num_heads=8, num_kv_heads=2, head_size=64, block_size=16,
                            dtype=torch.bfloat16, device="cuda", alibi=True, seed=0)
    out = torch.full_like(p.query, 7.0)
    with pytest.raises(KernelUnavailable, match="ALiBi"):
        vllm.paged_attention_decode(out, *p.decode_args())
    bad_tables = p.block_tables.clone()
    bad_tables[0, 0] = p.key_cache.size(0)           # one past the last block
    with pytest.raises(ValueError, match="block_tables"):
        vllm.paged_attention_decode(out, p.query, p.key_cache, p.value_cache, bad_tables, p.seq_lens, p.scale)
    f32 = make_decode_problem([5], num_heads=8, num_kv_heads=2, head_size=64, block_size=16,
                              dtype=torch.float32, device="cuda", seed=0)
    with pytest.raises(KernelUnavailable, match="float16 or bfloat16"):
        vllm.paged_attention_decode(torch.empty_like(f32.query), *f32.decode_args())
    assert torch.all(out == 7.0)


def test_unpack_restores_the_packed_files(tmp_path):
    import lzma
    import subprocess
    import sys
    from pathlib import Path
    packed, dest = tmp_path / "packed", tmp_path / "out"
    packed.mkdir()
    payload = bytes(range(256)) * 1000
    with lzma.open(packed / f"{vllm.FA3_LIBRARY}.xz", "wb") as f:
        f.write(payload)
    tool = Path(__file__).parents[1] / "tools" / "vllm_kernels.py"
    subprocess.run([sys.executable, str(tool), "unpack", str(packed), str(dest)], check=True, capture_output=True)
    assert (dest / vllm.FA3_LIBRARY).read_bytes() == payload
    empty = subprocess.run([sys.executable, str(tool), "unpack", str(dest), str(dest)], capture_output=True, text=True)
    assert empty.returncode != 0 and "no *.xz" in empty.stderr


@needs_fa3
def test_fa3_alone_is_usable(monkeypatch, tmp_path):
    # A folder with FA3's library only (the cache ops travel apart): FA3 runs, the cache ops are
    # skipped with their reason, and `check` reports exactly that.
    from paged_attention import check

    real, _ = vllm.find_library(vllm.FA3_LIBRARY)
    (tmp_path / vllm.FA3_LIBRARY).symlink_to(real)
    monkeypatch.setenv(vllm.ENV_VAR, str(tmp_path))
    assert vllm.available("fa3")[0]
    ok, why = vllm.available("cache_ops")
    assert not ok and vllm.CACHE_LIBRARY in why
    assert vllm.available() == (False, why)          # both: the first missing one says why
    results = check.run_checks()
    assert results["paged_attention_decode", "vllm"][0] == "ok"
    assert results["reshape_and_cache_flash", "vllm"][0] == "skipped"
