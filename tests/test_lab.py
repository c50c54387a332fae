"""The labs' grader, as a teacher uses it: correct work passes (notebooks written as a student would,
and .py files), plausible wrong answers fail with a hint that names the mistake, cheats score 0 with
a reason, and hostile submissions change no other row, no file of the teacher's and not the CSV.

Two grader runs do most of the work (each through the command line, in a process of its own, as a
teacher runs it): a class (correct notebooks, reference solutions, stubs, wrong answers) and a
hostile batch (every cheat and attack next to correct submissions, with a short time limit).
"""
from __future__ import annotations

import csv
import ctypes
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from paged_attention.lab import LABS, check
from paged_attention.lab.grade import cell, grade, student_of
from paged_attention.lab.labs import exact_equal, lab_cases
from paged_attention.lab.submission import (free_names, imports_binding, library_use, notebook_programs,
                                            program_from_cells)

HERE = Path(__file__).parent
SUBMISSIONS = HERE / "lab_submissions"
SOLUTIONS = SUBMISSIONS / "solutions.py"
STUDENT_CELLS = SUBMISSIONS / "student_cells"
HOSTILE = SUBMISSIONS / "hostile"
ROOT = HERE.parent

TRITON_HEAD = """import torch, triton
import triton.language as tl


@triton.jit
def k(table_ptr, req_ptr, pos_ptr, out_ptr, n, stride, B: tl.constexpr, TILE: tl.constexpr):
    offs = tl.program_id(0) * TILE + tl.arange(0, TILE)
    mask = offs < n
    req = tl.load(req_ptr + offs, mask=mask, other=0)
    pos = tl.load(pos_ptr + offs, mask=mask, other=0)
    block = tl.load(table_ptr + req * stride + pos // B, mask=mask, other=0)
"""
TRITON_LAUNCH = """

def triton_slot_mapping(block_table, req_indices, positions, block_size):
    out = torch.empty(positions.shape[0], dtype=torch.int64, device=positions.device)
    k[(triton.cdiv(positions.shape[0], 128),)](block_table, req_indices, positions, out, positions.shape[0],
                                               block_table.stride(0), B=block_size, TILE=128)
    return out
"""

# (lab, a plausible wrong implementation, words the first failure's message must contain)
WRONG = [
    ("00-slot-mapping", "def slot_mapping(block_table, seq_lens, block_size):\n"
     "    return [block_table[s][t // block_size] * block_size + t % block_size + 1\n"
     "            for s, n in enumerate(seq_lens) for t in range(n)]", "formula"),            # off by one
    ("00-slot-mapping", "def slot_mapping(block_table, seq_lens, block_size):\n"
     "    return [(t // block_size) * block_size + t % block_size\n"
     "            for s, n in enumerate(seq_lens) for t in range(n)]", "formula"),            # table ignored
    ("01-copy-on-write", "def append_token(table, n, bs, rc, free):\n"
     "    table = list(table)\n"
     "    if n % bs == 0:\n"
     "        b = free.pop(0); rc[b] = 1; return table + [b], None\n"
     "    return table, None", "shared"),                                                      # no copy on write
    ("01-copy-on-write", "def append_token(table, n, bs, rc, free):\n"
     "    table = list(table)\n"
     "    if n % bs and rc[table[-1]] == 1:\n"
     "        return table, None\n"
     "    b = free.pop(0); rc[b] = 1\n"
     "    if n % bs == 0:\n"
     "        return table + [b], None\n"
     "    old = table[-1]; table[-1] = b\n"
     "    return table, (old, b)", "one reference moves"),                                   # count not dropped
    ("01-free", "def free_table(table, rc, free):\n"
     "    for b in table:\n"
     "        rc[b] = 0; free.insert(0, b)", "still holds"),                                   # ignores the count
    ("01-free", "def free_table(table, rc, free):\n"
     "    for b in table:\n"
     "        rc[b] -= 1\n"
     "        if rc[b] == 0: free.append(b)", "front of the free list"),                       # to the back
    ("02-can-allocate", "def can_allocate(need, free, total, wm):\n"
     "    return 'NEVER' if need > total else 'OK' if need <= free else 'LATER'",
     "watermark"),                                                                             # watermark ignored
    ("02-can-allocate", "def can_allocate(need, free, total, wm):\n"
     "    return 'NEVER' if free - need < wm else 'OK'", "watermark"),                         # no LATER
    ("02-can-allocate", "def can_allocate(need, free, total, wm):\n"
     "    return 'OK' if free - need >= wm else 'LATER'", "total"),                            # never NEVER
    ("03-compute-slot-mapping", "def compute_slot_mapping(bt, req, pos, bs):\n"
     "    return bt[req, pos % bs] * bs + pos // bs", "positions // block_size"),             # swapped
    ("03-compute-slot-mapping", "import numpy as np\n"
     "def compute_slot_mapping(bt, req, pos, bs):\n"
     "    return bt[np.arange(len(pos)), pos // bs] * bs + pos % bs", "req_indices"),          # batch order
    ("04-triton-slot-mapping", TRITON_HEAD + "    tl.store(out_ptr + offs, block.to(tl.int64) * B + pos % B + 1, "
     "mask=mask)\n" + TRITON_LAUNCH, "slot = table"),                                          # off by one
    ("04-triton-slot-mapping", TRITON_HEAD + "    tl.store(out_ptr + offs, block.to(tl.int64) * B + pos % B, mask=mask)\n"
     + TRITON_LAUNCH.replace("triton.cdiv(positions.shape[0], 128)", "1"), "enough programs"),   # one tile only
    ("04-triton-slot-mapping", TRITON_HEAD + "    tl.store(out_ptr + offs, block * B + pos % B, mask=mask)\n"
     + TRITON_LAUNCH, "int64"),                                                                # int32 overflow
    ("05-kv-cache-strides", "def kv_cache_strides(layout, nb, bs, h, d):\n"
     "    return (nb * bs * h * d, bs * h * d, h * d, d, 1)", "HND"),                          # layout ignored
    ("05-kv-cache-strides", "def kv_cache_strides(layout, nb, bs, h, d):\n"
     "    t, hd = (h * d, d) if layout == 'NHD' else (d, bs * d)\n"
     "    return (bs * h * d, 2 * bs * h * d, t, hd, 1)", "K/V dimension is outermost"),        # K, V per block
    ("08-decode-step", "import math\n"
     "def decode_step(n, bs, free):\n"
     "    q, d, p = list(range(len(n))), [], []\n"
     "    while q:\n"
     "        i = q.pop(0); need = 1 if (n[i] - 1) % bs == 0 else 0\n"
     "        while need > free:\n"
     "            v = q.pop() if q else i; p.append(v); free += math.ceil((n[v] - 1) / bs)\n"
     "            if v == i: break\n"
     "        else:\n"
     "            free -= need; d.append(i)\n"
     "    return d, p", "upper bound"),                                                       # exact count
    ("08-decode-step", "import math\n"
     "def decode_step(n, bs, free):\n"
     "    q, d, p = list(range(len(n))), [], []\n"
     "    while q:\n"
     "        i = q.pop(0)\n"
     "        while free < 1:\n"
     "            v = q.pop(0) if q else i; p.append(v); free += math.ceil((n[v] - 1) / bs)\n"
     "            if v == i: break\n"
     "        else:\n"
     "            free -= 1 if (n[i] - 1) % bs == 0 else 0; d.append(i)\n"
     "    return d, p", "newest"),                                                             # preempts the oldest
    ("07-longest-cache-hit", "def find_longest_cache_hit(hashes, cached, max_length, bs):\n"
     "    hit = [cached[h][0] for h in hashes[:max_length // bs] if h in cached]\n"
     "    return hit, len(hit) * bs", "prefix"),                                           # skips a miss
    ("07-longest-cache-hit", "def find_longest_cache_hit(hashes, cached, max_length, bs):\n"
     "    hit = []\n"
     "    for h in hashes:\n"
     "        if h not in cached: break\n"
     "        hit.append(cached[h][0])\n"
     "    return hit, len(hit) * bs", "max_length // block_size"),                          # no bound
    ("07-longest-cache-hit", "def find_longest_cache_hit(hashes, cached, max_length, bs):\n"
     "    hit = []\n"
     "    for h in hashes[:max_length // bs]:\n"
     "        if h not in cached: break\n"
     "        hit.append(cached[h][-1])\n"
     "    return hit, len(hit) * bs", "the first of its list"),                             # the newest block
    ("06-merge-partitions", "def merge_partitions(m, s, o):\n"
     "    return [sum(si * x[d] for si, x in zip(s, o)) / sum(s) for d in range(len(o[0]))]",
     "rescale"),                                                                               # no rescale
    ("06-merge-partitions", "import math\n"
     "def merge_partitions(m, s, o):\n"
     "    w = [si * math.exp(mi) for mi, si in zip(m, s)]\n"
     "    return [sum(wi * x[d] for wi, x in zip(w, o)) / sum(w) for d in range(len(o[0]))]",
     "maximum"),                                                                               # overflows
]


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _grade_cli(args: list[str], cwd: Path) -> tuple[int, str, int]:
    """Run ``lab grade`` as a teacher does, in its own process; (exit code, stdout, its peak RSS in KiB)."""
    proc = subprocess.Popen([sys.executable, "-m", "paged_attention", "lab", "grade", *args], cwd=cwd,
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out = proc.stdout.read().decode()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, out, usage.ru_maxrss


def _rows(path: Path) -> dict[tuple[str, str], dict]:
    with open(path, newline="") as f:
        return {(r["student"], r["lab"]): r for r in csv.DictReader(f) if r["student"] and r["student"] != "(summary)"}


def _fill_student_edition(student_dir: Path, out: Path, name: str) -> list[Path]:
    """Every lab cell of the student edition filled in as a student would (tests/lab_submissions/
    student_cells: relying on the notebook's own import cells for np, math and torch)."""
    written = []
    for nb_path in sorted(student_dir.glob("*.ipynb")):
        nb = json.loads(nb_path.read_text())
        labs = []
        for c in nb["cells"]:
            src = "".join(c["source"]) if isinstance(c["source"], list) else c["source"]
            if c["cell_type"] == "code" and src.startswith("# LAB: "):
                lab = src.split("\n", 1)[0][len("# LAB: "):].strip()
                c["source"] = f"# LAB: {lab}\n" + (STUDENT_CELLS / f"{lab}.py").read_text()
                labs.append(lab)
        if labs:
            target = out / f"{name}_{nb_path.name}"
            target.write_text(json.dumps(nb))
            written.append(target)
    return written


def _have_nbformat() -> bool:
    try:
        import nbformat  # noqa: F401
        return True
    except ImportError:
        return False


@pytest.fixture(scope="module")
def student_edition(tmp_path_factory) -> Path:
    pytest.importorskip("nbformat", reason="lab build writes notebooks with nbformat")
    from paged_attention.lab.edition import build
    out = tmp_path_factory.mktemp("edition") / "student"
    build(out)
    return out


def _as_py_files(out: Path, name: str) -> list[Path]:
    """Without nbformat (no student edition): each lab as a .py file, the notebook's imports first."""
    imports = {"03-compute-slot-mapping": "import numpy as np\n", "04-triton-slot-mapping": "import torch\n",
               "06-merge-partitions": "import math\n"}
    files = []
    for lab in LABS:
        files.append(out / f"{name}_{lab}.py")
        files[-1].write_text(imports.get(lab, "") + (STUDENT_CELLS / f"{lab}.py").read_text())
    return files


@pytest.fixture(scope="module")
def class_run(tmp_path_factory, request):
    """A class graded in one run: alice's notebooks (every lab, written in the student edition), the
    stubs and the wrong answers as .py files."""
    root = tmp_path_factory.mktemp("class")
    subs, teacher = root / "submissions", root / "teacher"
    subs.mkdir()
    teacher.mkdir()
    if _have_nbformat():
        files = _fill_student_edition(request.getfixturevalue("student_edition"), subs, "alice")
    else:
        files = _as_py_files(subs, "alice")
    for k, lab in enumerate(LABS.values()):
        files.append(subs / f"stub{k}.py")
        files[-1].write_text(lab.stub)
    for k, (_, source, _) in enumerate(WRONG):
        files.append(subs / f"wrong{k:02d}.py")
        files[-1].write_text(source)
    start = time.perf_counter()
    code, out, maxrss = _grade_cli([str(f) for f in files] + ["--csv", "grades.csv", "--time-limit", "300"], teacher)
    assert code == 0, out
    return {"rows": _rows(teacher / "grades.csv"), "out": out, "maxrss": maxrss, "teacher": teacher,
            "seconds": time.perf_counter() - start}


@pytest.mark.parametrize("lab", list(LABS))
def test_a_correct_notebook_scores_everything(class_run, lab):
    """The lab, written in the student edition as a student would (np, math and torch from the
    notebook's own import cells, the Triton kernel in the lab cell, lab 08's lists sorted), scores
    100 %: on a GPU machine lab 04 runs compiled, on the GPU."""
    row = class_run["rows"][("alice", lab)]
    assert row["passed"] == row["total"] and row["first_failure"] == "", \
        f"{lab}: {row['passed']}/{row['total']}: {row['first_failure']}"     # a string: pytest shows it whole


def test_stubs_score_nothing(class_run):
    for k, lab in enumerate(LABS):
        row = class_run["rows"][(f"stub{k}", lab)]
        assert row["passed"] == "0" and "NotImplementedError" in row["first_failure"], row


def test_plausible_wrong_answers_fail_with_a_hint(class_run):
    for k, (lab, _, hint) in enumerate(WRONG):
        row = class_run["rows"][(f"wrong{k:02d}", lab)]
        assert int(row["passed"]) < int(row["total"]) and hint in row["first_failure"], (k, row)


def test_csv_has_a_summary_per_lab(class_run):
    with open(class_run["teacher"] / "grades.csv", newline="") as f:
        summary = [r for r in csv.reader(f) if r and r[0] == "(summary)"]
    assert [r[2] for r in summary] == list(LABS)
    for r in summary:
        students = {s for (s, lab) in class_run["rows"] if lab == r[2]}
        assert int(r[4]) == len(students) and "passed every check" in r[6]


def test_every_lab_has_public_and_hidden_checks_and_two_wrong_answers():
    for lab_id, lab in LABS.items():
        assert any(c.public for c in lab.checks) and any(not c.public for c in lab.checks), lab_id
        assert sum(w[0] == lab_id for w in WRONG) >= 2, lab_id


def test_longest_cache_hit_cases_are_vllms_answers_too():
    """Lab 07's expected answers come from the library's V1 block pool and FullAttentionManager;
    where vLLM's own core files are present, the same scenarios built with vLLM 0.33's classes give
    the same cases, inputs and answers alike."""
    from paged_attention.lab.labs import HIT_SCENARIOS, LONGEST_CACHE_HIT, _hit_cases
    from paged_attention.v1.core import oracle
    ok, why = oracle.available()
    if not ok:
        pytest.skip(f"vLLM's core not available: {why}")
    o = oracle.load()
    for check_, ours in zip(LONGEST_CACHE_HIT.checks, lab_cases(LONGEST_CACHE_HIT.lab_id)):
        theirs = json.loads(json.dumps(_hit_cases(*HIT_SCENARIOS[check_.name], classes=o)()))
        assert theirs == list(ours), check_.name


def test_longest_cache_hit_from_the_library_scores_zero(tmp_path):
    """Handing in the library's own find_longest_cache_hit is caught before it runs."""
    sub = tmp_path / "lib.py"
    sub.write_text("from paged_attention.v1.core.single_type_kv_cache_manager import FullAttentionManager\n\n\n"
                   "def find_longest_cache_hit(block_hashes, cached_blocks, max_length, block_size):\n"
                   "    return FullAttentionManager\n")
    (row,) = grade([sub], ["07-longest-cache-hit"])
    assert row.passed == 0 and "uses the library's implementation" in row.first_failure, row


# ---- hostile submissions -----------------------------------------------------------------------

def _landlock() -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        return libc.syscall(444, None, ctypes.c_size_t(0), ctypes.c_uint32(1)) >= 1
    except (OSError, AttributeError):
        return False


@pytest.fixture(scope="module")
def hostile_run(tmp_path_factory, student_edition):
    """Every hostile submission of tests/lab_submissions/hostile graded in one run with correct
    ones before and after it (labs 00 and 02, a 5 s limit, 512 MiB)."""
    root = tmp_path_factory.mktemp("hostile")
    subs, teacher = root / "submissions", root / "teacher"
    subs.mkdir()
    teacher.mkdir()
    (teacher / "notes.txt").write_text("the teacher's own file\n")
    good = [subs / "aaron.py", subs / "zoe.py"]
    for path in good:
        shutil.copy(STUDENT_CELLS / "00-slot-mapping.py", path)
    hostile = []
    for src in sorted(HOSTILE.glob("*.py")):
        shutil.copy(src, subs / src.name)
        hostile.append(subs / src.name)
    formula = subs / "=HYPERLINK(1).py"
    shutil.copy(STUDENT_CELLS / "00-slot-mapping.py", formula)
    notebook = _fill_student_edition(student_edition, subs, "nina")[0]       # 00_overview
    files = [good[0], *hostile, formula, notebook, good[1]]
    before = {p: p.read_bytes() for p in files}
    code, out, maxrss = _grade_cli([str(f) for f in files] + ["--lab", "00-slot-mapping", "--lab", "02-can-allocate",
                                                              "--csv", "grades.csv", "--time-limit", "5",
                                                              "--memory-limit", "512"], teacher)
    assert code == 0, out
    csv_text = (teacher / "grades.csv").read_text()
    alive = _processes_with("lab-hostile-lingering-7f3a")
    return {"rows": _rows(teacher / "grades.csv"), "out": out, "maxrss": maxrss, "teacher": teacher,
            "csv": csv_text, "alive": alive, "before": before}


def _processes_with(tag: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if tag.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


def _score(run, student):
    row = run["rows"][(student, "00-slot-mapping")]
    return int(row["passed"]), row["first_failure"]


def test_correct_rows_next_to_hostile_ones_are_untouched(hostile_run):
    """Correct work graded before, after and between the attacks scores exactly as alone."""
    for student in ("aaron", "zoe", "nina", "'=HYPERLINK(1)", "writes_around", "lingering", "flood"):
        assert _score(hostile_run, student) == (4, ""), student


@pytest.mark.parametrize("student, reason", [
    ("library_import", "uses the library's implementation"),
    ("library_importlib", "uses the library's implementation"),
    ("always_equal", "not plain data"),
    ("patched_checks", "no answer"),
    ("forged_print", "ended without finishing"),
    ("forged_channel", "did not write"),
    ("malformed", "ended without finishing"),
    ("allocates", "MemoryError"),
    ("endless", "stopped after 5 s"),
    ("crash", "ended without finishing"),
])
def test_cheats_and_crashes_score_zero_with_a_reason(hostile_run, student, reason):
    passed, why = _score(hostile_run, student)
    assert passed == 0 and reason in why, (student, why)


def test_an_object_equal_to_everything_fails(hostile_run):
    row = hostile_run["rows"][("always_equal", "02-can-allocate")]
    assert row["passed"] == "0" and "an object of type Anything, not plain data" in row["first_failure"]


def test_nothing_is_left_behind(hostile_run):
    """No lingering or detached process survives the run (the daemon meant to rewrite the CSV is
    gone), the CSV is what the grader wrote, and the teacher's folder holds only its own files."""
    assert hostile_run["alive"] == []
    time.sleep(0.5)
    assert (hostile_run["teacher"] / "grades.csv").read_text() == hostile_run["csv"]
    assert "evil" not in hostile_run["csv"]
    assert sorted(p.name for p in hostile_run["teacher"].iterdir()) == ["grades.csv", "notes.txt"]
    if _landlock():                # the kernel confines writes: the submissions on disk are unchanged too
        assert all(p.read_bytes() == data for p, data in hostile_run["before"].items())


def test_output_flood_is_not_held(hostile_run, class_run):
    """200 MiB of printing does not grow the grader: its peak memory stays near a run without it."""
    assert hostile_run["maxrss"] < class_run["maxrss"] + 100 * 1024, (hostile_run["maxrss"], class_run["maxrss"])


def test_csv_cells_cannot_start_a_formula(hostile_run):
    assert "'=HYPERLINK(1)" in hostile_run["csv"]
    with open(hostile_run["teacher"] / "grades.csv", newline="") as f:
        for row in csv.reader(f):
            assert not any(c[:1] in ("=", "+", "-", "@", "\t", "\r") for c in row), row
    assert [cell(x) for x in ("=1+1", "+1", "-1", "@SUM(A1)", "\tx", "\rx", "ok", 3)] == \
        ["'=1+1", "'+1", "'-1", "'@SUM(A1)", "'\tx", "'\rx", "ok", 3]


# ---- the lab on this machine's device (on a GPU: compiled, in the contained child) ----------------

def _lab04_program() -> str:
    """A correct lab 04 as a .py file: the notebook's ``import torch``, then the lab cell."""
    return "import torch\n" + (STUDENT_CELLS / "04-triton-slot-mapping.py").read_text()


def test_lab04_alone_on_this_machines_device(tmp_path):
    """Lab 04, correct, graded alone on the device the lab runs on here (on a GPU: CUDA in the
    contained child, Landlock, Triton compiling into the run's own folder). On failure the message
    carries the whole reason and the tail of what the child printed."""
    from paged_attention.lab.grade import _device, grade_program
    from paged_attention.lab.submission import read_submission
    path = tmp_path / "lab04.py"
    path.write_text(_lab04_program())
    program = read_submission(path, {lab_id: lab.function for lab_id, lab in LABS.items()})["04-triton-slot-mapping"]
    verdict = grade_program(program, time_limit=120)
    lab = LABS["04-triton-slot-mapping"]
    assert verdict.passed == len(lab.checks) and verdict.first_failure == "", (
        f"on {_device(lab)}: {verdict.passed}/{len(lab.checks)}\nreason: {verdict.first_failure}\n"
        f"checks: {verdict.results}\nthe child's output (last 4 KiB):\n{verdict.output}")


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="plants a GPU on a machine without one")
def test_a_gpu_the_child_cannot_start_is_the_graders_problem(tmp_path, monkeypatch):
    """A lab sent to a device the child cannot start (here: 'cuda' on a machine without one) scores 0
    with a reason that says so, not a crash blamed on the code; the run had the GPU's allowance."""
    from paged_attention.lab import grade as grade_module
    from paged_attention.lab import sandbox
    from paged_attention.lab.submission import read_submission
    path = tmp_path / "lab04.py"
    path.write_text(_lab04_program())
    program = read_submission(path, {lab_id: lab.function for lab_id, lab in LABS.items()})["04-triton-slot-mapping"]
    runs = []
    real_run_job = sandbox.run_job

    def run_job(*args, **kwargs):
        runs.append(real_run_job(*args, **kwargs))
        return runs[-1]

    monkeypatch.setattr(grade_module, "_device", lambda lab: "cuda")
    monkeypatch.setattr(sandbox, "run_job", run_job)
    verdict = grade_module.grade_program(program, time_limit=60)
    assert verdict.passed == 0 and "the grader could not run the lab on cuda" in verdict.first_failure, verdict
    assert "not of the code" in verdict.first_failure and runs[0].time_allowed == 60 + sandbox.GPU_ALLOWANCE


def test_a_gpu_run_keeps_its_caches_in_its_own_folder(tmp_path, monkeypatch):
    """Triton's and CUDA's caches are the run's (writable under Landlock, never shared with the next
    submission), whatever the grader's environment says; the CPU forces Triton's interpreter."""
    from paged_attention.lab.sandbox import child_env
    monkeypatch.setenv("TRITON_CACHE_DIR", "/somewhere/shared")
    monkeypatch.setenv("CUDA_CACHE_PATH", "/somewhere/else")
    gpu, cpu = child_env("m", str(tmp_path), "cuda"), child_env("m", str(tmp_path), "cpu")
    for key in ("HOME", "TMPDIR", "TRITON_HOME", "TRITON_CACHE_DIR", "CUDA_CACHE_PATH"):
        assert Path(gpu[key]).is_relative_to(tmp_path), key
    assert "TRITON_INTERPRET" not in gpu and cpu["TRITON_INTERPRET"] == "1" and cpu["CUDA_VISIBLE_DEVICES"] == ""


_CONFINED_PROBE = r"""
import importlib.util, json, os, stat, subprocess, sys
spec = importlib.util.spec_from_file_location("runner", sys.argv[1])
runner = importlib.util.module_from_spec(spec)
spec.loader.exec_module(runner)
root, device, dev = sys.argv[2], sys.argv[3], sys.argv[4]
run = os.path.join(root, "run")
assert runner.confine_writes(runner.writable_paths(run, device, dev))

def can(action):
    try:
        action()
        return True
    except PermissionError:
        return False

def write(path, mode="a"):
    def act():
        with open(path, mode) as f:
            f.write("x")
    return act

print(json.dumps({
    "run folder": can(write(os.path.join(run, "new.txt"), "w")),
    "fifo in the run folder": can(lambda: os.mkfifo(os.path.join(run, "fifo"))),
    "device node in the run folder": can(lambda: os.mknod(os.path.join(run, "null2"), stat.S_IFCHR | 0o600,
                                                          os.makedev(1, 3))),
    "null": can(write(os.path.join(dev, "null"))),
    "nvidiactl": can(write(os.path.join(dev, "nvidiactl"))),
    "nvidia-caps": can(write(os.path.join(dev, "nvidia-caps", "nvidia-cap1"))),
    "shm create": can(write(os.path.join(dev, "shm", "cuda.shm.0.1.1"), "w")),
    "shm remove": can(lambda: os.remove(os.path.join(dev, "shm", "old"))),
    "another device": can(write(os.path.join(dev, "sda"))),
    "a new file in dev": can(write(os.path.join(dev, "new"), "w")),
    "outside": can(write(os.path.join(root, "outside.txt"))),
    "read outside": can(lambda: open(os.path.join(root, "outside.txt")).read()),
    "exec": subprocess.run([sys.executable, "-c", "pass"]).returncode == 0,
}))
"""


@pytest.mark.skipif(not _landlock(), reason="the kernel has no Landlock")
@pytest.mark.parametrize("device", ["cuda", "cpu"], ids=["gpu-rules", "cpu-rules"])   # an id "cuda" would be skipped
def test_landlock_rules_for_the_device(tmp_path, device):
    """Under the child's rules (a /dev of our own standing in for the real one): on a GPU, CUDA's
    device files can be written and /dev/shm used; on both, the run's folder and /dev/null; never
    another device, a new file in /dev, a device node, or a file outside. Reading and running
    programs (Triton's ldconfig, cc, ptxas) stay allowed."""
    from paged_attention.lab import runner
    dev, run = tmp_path / "dev", tmp_path / "run"
    for d in (dev / "nvidia-caps", dev / "shm", run):
        d.mkdir(parents=True)
    for f in ("null", "nvidiactl", "nvidia0", "sda", "nvidia-caps/nvidia-cap1", "shm/old"):
        (dev / f).write_text("")
    (tmp_path / "outside.txt").write_text("the teacher's")
    proc = subprocess.run([sys.executable, "-c", _CONFINED_PROBE, runner.__file__, str(tmp_path), device, str(dev)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    gpu = device == "cuda"
    assert got == {"run folder": True, "fifo in the run folder": True, "device node in the run folder": False,
                   "null": True, "nvidiactl": gpu, "nvidia-caps": gpu, "shm create": gpu, "shm remove": gpu,
                   "another device": False, "a new file in dev": False, "outside": False, "read outside": True,
                   "exec": True}
    assert (tmp_path / "outside.txt").read_text() == "the teacher's" and (dev / "sda").read_text() == ""
    assert [p for p, _ in runner.writable_paths(str(run), "cpu")] == [str(run)] + [
        f"/dev/{n}" for n in ("null", "zero", "full") if os.path.exists(f"/dev/{n}")]


# ---- the rule: what is graded, the same in the notebook and in the grader -------------------------

def test_program_takes_the_imports_the_lab_cell_uses():
    cells = ["import numpy as np\nimport matplotlib.pyplot as plt\nfrom paged_attention.viz import refcounts",
             "import math, os\nx = 1", "from paged_attention.lab import check\ncheck('03-compute-slot-mapping')"]
    lab = "# LAB: 03-compute-slot-mapping\ndef f(refcounts):\n    return np.zeros(math.ceil(refcounts))\n"
    program = program_from_cells("03-compute-slot-mapping", lab, cells)
    assert program.imports == ("import numpy as np", "import math")       # not refcounts: a parameter
    assert program.source.endswith(lab) and program.cell_line(3) == 1
    assert free_names("import os\ndef g(a):\n    return a + os.sep + b\n") == {"b"}
    assert imports_binding(["%matplotlib inline\nfrom x import (a, b as c)\nfrom y import *"], {"c"}) == \
        ["from x import b as c"]


def test_notebook_check_and_grader_read_the_same_program(student_edition):
    """For every lab of the student edition: the program the in-notebook check builds from the cells
    a kernel ran in order is the one the grader builds from the saved notebook."""
    from paged_attention.lab.submission import lab_of, notebook_cells
    for path in sorted(student_edition.glob("*.ipynb")):
        cells = notebook_cells(path)
        for lab, program in notebook_programs(cells).items():
            lab_cell = next(c for c in cells if lab_of(c) == lab)
            assert program_from_cells(lab, lab_cell, [c for c in cells if lab_of(c) is None]) == program


@pytest.mark.parametrize("source, used", [
    ("from paged_attention.utils import slot_mapping", "from paged_attention.utils import slot_mapping"),
    ("import paged_attention.utils as u", "import paged_attention.utils"),
    ("def f():\n    import paged_attention\n", "import paged_attention"),
    ("__import__('paged_attention.utils')", "the string 'paged_attention.utils'"),
    ("import numpy as np\ndef f(a):\n    return np.array(a)\n", None),
])
def test_static_check_finds_the_library(source, used):
    assert library_use(source) == used


def test_exact_types():
    assert exact_equal([1, [2, "OK"]], [1, [2, "OK"]])
    assert not exact_equal([1.0], [1]) and not exact_equal([True], [1]) and not exact_equal((1,), [1])


def _fake_notebook(monkeypatch, history, saved=None):
    import paged_attention.lab as lab_module
    monkeypatch.setattr(lab_module, "_history", lambda: history)
    monkeypatch.setattr(lab_module, "_notebook_cells", lambda lab: saved)


def test_in_notebook_check_grades_the_lab_cell_with_the_notebook_imports(monkeypatch, capsys):
    imports = "import numpy as np\nimport torch"
    lab_cell = "# LAB: 03-compute-slot-mapping\n" + (STUDENT_CELLS / "03-compute-slot-mapping.py").read_text()
    _fake_notebook(monkeypatch, [imports, "# LAB: 03-compute-slot-mapping\n# an older version", lab_cell])
    assert check("03-compute-slot-mapping")
    out = capsys.readouterr().out
    assert out.count("passed:") == 2 and "not yet" not in out


def test_after_a_restart_the_check_names_the_cell_to_run(monkeypatch, capsys):
    lab_cell = "# LAB: 03-compute-slot-mapping\n" + (STUDENT_CELLS / "03-compute-slot-mapping.py").read_text()
    saved = ["# intro", "import matplotlib.pyplot as plt\nimport numpy as np", lab_cell]
    _fake_notebook(monkeypatch, [lab_cell, "check('03-compute-slot-mapping')"], saved)   # only the lab cells ran
    assert not check("03-compute-slot-mapping")
    out = capsys.readouterr().out
    assert "code cell 2 (`import numpy as np`): run that cell first" in out, out


def test_a_helper_in_another_cell_is_not_graded_and_the_check_says_so(monkeypatch, capsys):
    helper = "def _slot(row, t, bs):\n    return row[t // bs] * bs + t % bs\n"
    lab_cell = ("# LAB: 00-slot-mapping\ndef slot_mapping(block_table, seq_lens, block_size):\n"
                "    return [_slot(block_table[s], t, block_size) for s, n in enumerate(seq_lens) for t in range(n)]\n")
    _fake_notebook(monkeypatch, [helper, lab_cell], [helper, lab_cell])
    assert not check("00-slot-mapping")
    assert "move the definition into the lab cell" in capsys.readouterr().out


def test_public_check_outside_a_notebook(monkeypatch, capsys):
    _fake_notebook(monkeypatch, None)
    ns = {}
    exec(SOLUTIONS.read_text().split("import torch")[0], ns)
    assert check("06-merge-partitions", ns["merge_partitions"])
    assert not check("06-merge-partitions", lambda m, s, o: o[0])
    assert "not yet" in capsys.readouterr().out
    with pytest.raises(KeyError):
        check("99-nothing", ns["merge_partitions"])


def test_check_in_a_real_notebook_kernel(tmp_path, monkeypatch):
    """A kernel runs an import cell, the lab cell and the check cell; then a restart and only the lab
    cells: the check names the import cell. The grader agrees with the first run."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    lab_cell = "# LAB: 03-compute-slot-mapping\n" + (STUDENT_CELLS / "03-compute-slot-mapping.py").read_text()
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("import numpy as np"), nbformat.v4.new_code_cell(lab_cell),
        nbformat.v4.new_code_cell("from paged_attention.lab import check\ncheck('03-compute-slot-mapping')")])
    path = tmp_path / "03_v1_block_table.ipynb"
    nbformat.write(nb, path)
    client = nbclient.NotebookClient(nb, resources={"metadata": {"path": str(tmp_path)}}, record_timing=False,
                                     kernel_name="python3")
    monkeypatch.setenv("PYTHONPATH", _env()["PYTHONPATH"])
    with client.setup_kernel():
        for c in nb.cells:
            client.execute_cell(c, nb.cells.index(c))
        first = "".join(o.get("text", "") for o in nb.cells[2].outputs)
        from nbclient.util import run_sync
        run_sync(client.km.restart_kernel)(now=True)
        run_sync(client.kc.wait_for_ready)(timeout=60)
        for k in (1, 2):
            nb.cells[k].outputs = []
            client.execute_cell(nb.cells[k], k)
        second = "".join(o.get("text", "") for o in nb.cells[2].outputs)
    assert "passed: a mixed batch" in first and "not yet" not in first, first
    assert "code cell 1 (`import numpy as np`): run that cell first" in second, second
    (row,) = grade([path])
    assert row.passed == row.total, row


# ---- the teacher's side -----------------------------------------------------------------------

def test_student_edition_holds_no_hidden_check_or_solution(student_edition):
    text = "\n".join(p.read_text() for p in student_edition.iterdir())
    assert "### Solutions" not in text
    assert "Student edition" in text and "not in the project's `notebooks/`" in text
    for lab in LABS.values():
        assert f"# LAB: {lab.lab_id}" in text
        for check_, cases in zip(lab.checks, lab_cases(lab.lab_id)):
            if check_.public:
                continue
            assert check_.name not in text and check_.hint not in text, check_.name
            for _, want in cases:
                if len(json.dumps(want)) > 12:
                    assert json.dumps(want) not in text and json.dumps(want)[1:-1] not in text, check_.name
    solutions = SOLUTIONS.read_text()
    for name in ("slot_mapping", "append_token", "free_table", "can_allocate", "compute_slot_mapping",
                 "merge_partitions", "kv_cache_strides", "triton_slot_mapping", "decode_step",
                 "find_longest_cache_hit"):
        start = solutions.index(f"def {name}(")
        body = solutions[start:].split("\n")[1]                   # the first line of the solution's body
        assert json.dumps(body.strip())[1:-1] not in text, name
    for lab_cell in STUDENT_CELLS.glob("*.py"):              # their longest line, the most telling
        body = [line for line in lab_cell.read_text().splitlines() if not line.startswith(("def ", "#"))]
        longest = max(body, key=len).strip()
        assert json.dumps(longest)[1:-1] not in text, lab_cell.name


def test_build_refuses_the_notebooks_folder_and_a_full_one(tmp_path):
    pytest.importorskip("nbformat")
    from paged_attention.lab.edition import build, main
    src = tmp_path / "nbs"
    src.mkdir()
    for name in ("00_overview.ipynb", "03_v1_block_table.ipynb"):
        shutil.copy(ROOT / "notebooks" / name, src / name)
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    with pytest.raises(ValueError, match="read from"):
        build(src, src, force=True)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "mine.txt").write_text("x")
    with pytest.raises(ValueError, match="not empty"):
        build(tmp_path / "full", src)
    assert main([str(tmp_path / "full"), "--notebooks", str(src)]) == 2
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before
    assert len(build(tmp_path / "full", src, force=True)) == 2


@pytest.mark.parametrize("option, value", [("--time-limit", "0"), ("--time-limit", "-5"), ("--time-limit", "inf"),
                                           ("--time-limit", "nan"), ("--time-limit", "x"), ("--memory-limit", "0"),
                                           ("--jobs", "0"), ("--jobs", "-1"), ("--lab", "nope")])
def test_bad_options_are_refused(option, value, capsys):
    from paged_attention.lab.grade import main
    with pytest.raises(SystemExit) as e:
        main([str(SOLUTIONS), option, value])
    assert e.value.code == 2 and option in capsys.readouterr().err


def test_students_from_file_names_and_a_roster(tmp_path):
    assert student_of(Path("subs/alice_00_overview.ipynb")) == "alice"
    assert student_of(Path("subs/bob/03_v1_block_table.ipynb")) == "bob"
    assert student_of(Path("subs/carol.py")) == "carol"
    assert student_of(Path("subs/dave-04-triton-slot-mapping.py")) == "dave"
    sub = tmp_path / "x17.py"
    sub.write_text((STUDENT_CELLS / "05-kv-cache-strides.py").read_text())
    rows = grade([sub, tmp_path / "missing.py"], ["05-kv-cache-strides"],
                 roster={"x17.py": "Dana", str(tmp_path / "missing.py"): "Eve", "y.py": "Finn"})
    assert [(r.student, r.passed, r.first_failure) for r in rows] == [
        ("Dana", 3, ""), ("Eve", 0, "no such file"), ("Finn", 0, "no submission")]


def test_only_the_labs_a_submission_holds_are_graded(tmp_path):
    sub = tmp_path / "gus.py"
    sub.write_text("# LAB: 02-can-allocate\n" + (STUDENT_CELLS / "02-can-allocate.py").read_text())
    assert [(r.lab, r.passed) for r in grade([sub])] == [("02-can-allocate", 5)]
    (empty,) = grade([tmp_path / "gus.py"], ["00-slot-mapping"])
    assert empty.passed == 0 and "no lab cell" in empty.first_failure
    (tmp_path / "hal.ipynb").write_text("not json")
    (tmp_path / "ivy.py").write_text("x = 1\n")
    rows = grade([tmp_path / "hal.ipynb", tmp_path / "ivy.py"])
    assert [(r.student, r.lab, r.total) for r in rows] == [("hal", "-", 0), ("ivy", "-", 0)]
    assert "cannot read the submission" in rows[0].first_failure and "no lab" in rows[1].first_failure
