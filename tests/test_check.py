"""``python -m paged_attention check``: ok on this machine, and it catches a broken kernel."""
import subprocess
import sys
import types

import torch

from paged_attention import check
from paged_attention.kernels import KernelUnavailable
from paged_attention.kernels import reference as ref
from paged_attention.kernels import triton as tk

from conftest import PLANTED, planted


def test_check_command_passes_here():
    out = subprocess.run([sys.executable, "-m", "paged_attention", "check"], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = {line.split()[0]: line.split()[1:] for line in out.stdout.splitlines() if line.split()[:1] and line.split()[0] in check.KERNELS}
    assert set(lines) == set(check.KERNELS)
    assert lines["paged_attention_decode"][1] == "ok" and lines["reshape_and_cache_flash"][:2] == ["ok", "ok"]
    assert "FAILED" not in out.stdout


def test_usage_error():
    out = subprocess.run([sys.executable, "-m", "paged_attention", "chek"], capture_output=True, text=True)
    assert out.returncode == 2 and "usage" in out.stderr


def test_a_wrong_kernel_fails_its_check():
    def off_by_one_slot(key, value, key_cache, value_cache, slot_mapping, *rest):
        ref.reshape_and_cache_flash(key, value, key_cache, value_cache, torch.where(slot_mapping >= 0, slot_mapping + 1, slot_mapping) % (key_cache.size(0) * key_cache.size(1)), *rest)

    def no_epsilon_but_wrong_scale(out, query, *rest):
        ref.paged_attention_v1(out, query * 1.01, *rest)

    broken = types.SimpleNamespace(reshape_and_cache_flash=off_by_one_slot, paged_attention_v1=no_epsilon_but_wrong_scale)
    for name in ("reshape_and_cache_flash", "paged_attention_v1"):
        try:
            check.CHECKS[name](broken)
        except AssertionError:
            continue
        raise AssertionError(f"check_{name} accepted a wrong kernel")


# ---- only KernelUnavailable is a skip: anything else a kernel raises is a failure ------------

def _check_decode_only(monkeypatch, capsys, kernel) -> tuple[int, str, str]:
    """Run ``check`` on the Triton decode alone, with ``kernel`` planted in its place: the exit
    code, the decode row's Triton cell, and the whole output."""
    monkeypatch.setattr(tk, "paged_attention_decode", kernel)
    monkeypatch.setattr(check, "KERNELS", ("paged_attention_decode",))
    monkeypatch.setattr(check, "IMPLEMENTATIONS", ("reference", "triton"))
    code = check.main()
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("paged_attention_decode"))
    return code, row.split()[2], out


def test_an_error_on_good_input_is_failed_and_exits_non_zero(monkeypatch, capsys):
    code, cell, out = _check_decode_only(monkeypatch, capsys, planted(ValueError))
    assert code == 1 and cell == "FAILED"
    assert f"FAILED: ValueError: {PLANTED}" in out and "1 check(s) FAILED" in out


def test_a_wrong_result_is_failed_and_exits_non_zero(monkeypatch, capsys):
    code, cell, _ = _check_decode_only(monkeypatch, capsys, lambda out, *a, **kw: out.zero_())
    assert code == 1 and cell == "FAILED"


def test_kernel_unavailable_is_skipped_with_its_whole_message(monkeypatch, capsys):
    code, cell, out = _check_decode_only(monkeypatch, capsys, planted(KernelUnavailable))
    assert code == 0 and cell == "skipped"
    assert f"skipped: {PLANTED}" in out
