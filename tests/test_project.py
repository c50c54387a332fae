"""The project's own files: pins agree, CI calls the README's command, the device policy holds."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _pins(lines):
    pins = {}
    for line in lines:
        line = line.split("#")[0].strip().lstrip("- ").strip()
        m = re.fullmatch(r"([A-Za-z0-9_.\-]+)==([^\s]+)", line)
        if m:
            pins[m.group(1).lower()] = m.group(2)
    return pins


def test_requirements_and_environment_agree():
    req = _pins((ROOT / "requirements.txt").read_text().splitlines())
    env = _pins((ROOT / "environment.yml").read_text().splitlines())
    assert req == env
    for name in ("torch", "triton", "numpy", "matplotlib", "jupyterlab", "ipykernel", "nbval", "pytest",
                 "hypothesis", "ninja", "ruff"):
        assert name in req, f"{name} is not pinned"
    # torch exactly, and only once: a range (or a second line) pulls a CUDA build with GBs of packages.
    torch_lines = [line.split("#")[0].strip() for line in (ROOT / "requirements.txt").read_text().splitlines()
                   if re.match(r"torch\b", line.strip())]
    assert len(torch_lines) == 1 and re.fullmatch(r"torch==\d+\.\d+\.\d+", torch_lines[0]), torch_lines


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    assert "make lab" in readme and "make test" in readme
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_every_notebook_is_committed_executed():
    import json
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        nb = json.loads(path.read_text())
        code = [c for c in nb["cells"] if c["cell_type"] == "code" and "".join(c["source"]).strip()]
        assert all(c["execution_count"] is not None for c in code), f"{path.name} has unexecuted cells"
        errors = [o for c in code for o in c["outputs"] if o["output_type"] == "error"]
        assert not errors, f"{path.name} was saved with an error"


def test_interpreter_is_on_without_a_gpu():
    from paged_attention import runtime
    if runtime.HAS_CUDA:
        assert not runtime.TRITON_INTERPRET
    else:
        assert runtime.TRITON_INTERPRET and os.environ["TRITON_INTERPRET"] == "1"


def test_forcing_the_cpu_path_in_a_fresh_process():
    code = "import paged_attention as p, os; print(p.DEVICE, p.TRITON_INTERPRET, os.environ['TRITON_INTERPRET'])"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PAGED_ATTENTION_DEVICE"] = "cpu"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["cpu", "True", "1"]
    env["PAGED_ATTENTION_DEVICE"] = "tpu"
    bad = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert bad.returncode != 0 and "PAGED_ATTENTION_DEVICE must be 'cpu' or 'cuda'" in bad.stderr


def test_utils():
    from paged_attention.utils import PAD_SLOT_ID, Device, cdiv, chunk_list, next_power_of_2
    assert PAD_SLOT_ID == -1 and Device.GPU != Device.CPU
    assert [cdiv(n, 16) for n in (0, 1, 16, 17)] == [0, 1, 1, 2]
    assert [next_power_of_2(n) for n in (0, 1, 3, 8, 9)] == [1, 1, 4, 8, 16]
    assert list(chunk_list(list(range(7)), 3)) == [[0, 1, 2], [3, 4, 5], [6]]
    with pytest.raises(ValueError, match="chunk_size"):
        list(chunk_list([1], 0))


def test_pyproject_license_is_an_spdx_string():
    """``project.license`` as a string (setuptools 77+); the table form warns on every build."""
    tomllib = pytest.importorskip("tomllib")            # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["license"] == "Apache-2.0"
    assert any(r.replace(" ", "").startswith("setuptools>=") and int(r.split(">=")[1].split(".")[0]) >= 77
               for r in project["build-system"]["requires"])


def test_generated_folders_are_git_ignored():
    """What make book, the benchmarks and the lab workflow write stays out of git status."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    paths = ["student/00_overview.ipynb", "submissions/a.py", "grades.csv", "build/book/index.html",
             "bench-out/x.json", "vllm-kernels/x.xz"]
    out = subprocess.run(["git", "check-ignore", *paths], cwd=ROOT, capture_output=True, text=True)
    assert out.stdout.split() == paths
