"""``paged_attention.verify``: the one call notebooks use to run their structures through every kernel."""
import pytest
import torch

from paged_attention import runtime, verify
from paged_attention.kernels import KernelUnavailable
from paged_attention.kernels import reference as ref
from paged_attention.kernels import triton as tk
from paged_attention.kernels.workloads import make_decode_problem

from conftest import PLANTED, planted


def _problem(**kw):
    return make_decode_problem([1, 16, 37], num_heads=4, num_kv_heads=2, head_size=32, block_size=16,
                               dtype=torch.float32, device=runtime.DEVICE, seed=5, **kw)


def test_decode_runs_triton_and_says_why_others_did_not():
    p = _problem()
    oracle, v = verify.verify_decode(*p.decode_args())
    torch.testing.assert_close(oracle, ref.ref_decode_attention(*p.decode_args()))
    names = [name for name, _, _ in v.rows]
    assert names == ["reference", "Triton", "CUDA v1 (ours)", "CUDA v2 (ours)", "vLLM FA3"]
    assert "Triton" in v.verified
    for name, status, detail in v.rows:
        assert status in ("ok", "skipped") and (status == "ok" or detail), (name, status, detail)
    assert not v.failed
    if not runtime.HAS_CUDA:
        assert v.verified == ["reference", "Triton"]
        assert "GPU" in dict((n, d) for n, _, d in v.rows)["vLLM FA3"]
    assert "Triton" in str(v) and "float64 oracle" in str(v)


def test_decode_catches_a_wrong_kernel(monkeypatch):
    p = _problem()

    def off(out, query, *rest, **kw):
        tk_decode(out, query * 1.05, *rest, **kw)
    tk_decode = tk.paged_attention_decode
    monkeypatch.setattr(tk, "paged_attention_decode", off)
    with pytest.raises(AssertionError, match="Triton"):
        verify.verify_decode(*p.decode_args())


def test_cache_writes_reference_writes_the_given_caches_and_others_must_agree(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    key, value = (torch.randn(6, 2, 16, generator=gen).to(runtime.DEVICE) for _ in range(2))
    slots = torch.tensor([5, 0, -1, 9, 30, 17], device=runtime.DEVICE)
    caches = [torch.zeros(4, 8, 2, 16, device=runtime.DEVICE) for _ in range(2)]
    v = verify.verify_cache_writes(key, value, *caches, slots)
    assert "Triton" in v.verified
    assert torch.equal(caches[0][30 // 8, 30 % 8], key[4]) and torch.equal(caches[1][0, 5], value[0])
    assert int((caches[0] != 0).any(-1).any(-1).sum()) == 5          # five real tokens, padding skipped

    def shifted(key, value, key_cache, value_cache, slot_mapping, *rest):
        tk_write(key, value, key_cache, value_cache, torch.where(slot_mapping >= 0, (slot_mapping + 1) % 32, slot_mapping), *rest)
    tk_write = tk.reshape_and_cache_flash
    monkeypatch.setattr(tk, "reshape_and_cache_flash", shifted)
    with pytest.raises(AssertionError, match="Triton"):
        verify.verify_cache_writes(key, value, *(torch.zeros(4, 8, 2, 16, device=runtime.DEVICE) for _ in range(2)), slots)


# ---- only KernelUnavailable is a skip: anything else an implementation raises is a failure ----

def _details(v: verify.Verification) -> dict[str, str]:
    return {name: detail for name, _, detail in v.rows}


def test_decode_error_on_good_input_is_a_failure(monkeypatch):
    monkeypatch.setattr(tk, "paged_attention_decode", planted(ValueError))
    with pytest.raises(verify.VerificationFailed) as caught:
        verify.verify_decode(*_problem().decode_args())
    v = caught.value.verification
    assert v.failed == ["Triton"] and "Triton" not in v.verified
    assert _details(v)["Triton"] == f"ValueError: {PLANTED}"
    assert len(v.rows) == 5                                 # the others were still tried
    assert "FAILED" in str(caught.value) and PLANTED in str(caught.value)


def test_decode_wrong_result_is_a_failure_and_the_others_still_run(monkeypatch):
    monkeypatch.setattr(tk, "paged_attention_decode", lambda out, *a, **kw: out.zero_())
    with pytest.raises(AssertionError, match="Triton") as caught:
        verify.verify_decode(*_problem().decode_args())
    v = caught.value.verification
    assert v.failed == ["Triton"] and _details(v)["Triton"].startswith("AssertionError: Triton")
    assert [name for name, _, _ in v.rows][2:] == ["CUDA v1 (ours)", "CUDA v2 (ours)", "vLLM FA3"]


def test_cache_write_error_on_good_input_is_a_failure(monkeypatch):
    key, value = (torch.ones(2, 2, 16, device=runtime.DEVICE) for _ in range(2))
    caches = [torch.zeros(4, 8, 2, 16, device=runtime.DEVICE) for _ in range(2)]
    monkeypatch.setattr(tk, "reshape_and_cache_flash", planted(ValueError))
    with pytest.raises(verify.VerificationFailed) as caught:
        verify.verify_cache_writes(key, value, *caches, torch.tensor([3, 9], device=runtime.DEVICE))
    assert caught.value.verification.failed == ["Triton"]
    assert _details(caught.value.verification)["Triton"] == f"ValueError: {PLANTED}"


def test_kernel_unavailable_is_skipped_with_its_whole_message(monkeypatch):
    monkeypatch.setattr(tk, "paged_attention_decode", planted(KernelUnavailable))
    monkeypatch.setattr(tk, "reshape_and_cache_flash", planted(KernelUnavailable))
    _, decode = verify.verify_decode(*_problem().decode_args())
    key, value = (torch.ones(2, 2, 16, device=runtime.DEVICE) for _ in range(2))
    caches = [torch.zeros(4, 8, 2, 16, device=runtime.DEVICE) for _ in range(2)]
    writes = verify.verify_cache_writes(key, value, *caches, torch.tensor([3, 9], device=runtime.DEVICE))
    for v in (decode, writes):
        assert "Triton" in v.skipped and not v.failed
        assert _details(v)["Triton"] == PLANTED
