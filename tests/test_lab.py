"""The labs' graders: reference solutions score 100 %, stubs 0 %, plausible wrong answers fail with a
hint that names the mistake, and a broken submission gives a row, never a grader crash."""
import csv
import textwrap
from pathlib import Path

import nbformat
import pytest

from paged_attention.lab import LABS, check
from paged_attention.lab.edition import MARKER, build
from paged_attention.lab.grade import grade, grade_one

HERE = Path(__file__).parent
SOLUTIONS = HERE / "lab_submissions" / "solutions.py"

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
    out = torch.empty(positions.shape[0], dtype=torch.int64)
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
    ("04-triton-slot-mapping", TRITON_HEAD + "    tl.store(out_ptr + offs, block.to(tl.int64) * B + pos % B + 1, mask=mask)\n"
     + TRITON_LAUNCH, "slot = table"),                                                         # off by one
    ("04-triton-slot-mapping", TRITON_HEAD + "    tl.store(out_ptr + offs, block.to(tl.int64) * B + pos % B, mask=mask)\n"
     + TRITON_LAUNCH.replace("triton.cdiv(positions.shape[0], 128)", "1"), "enough programs"),   # one tile only
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
    ("06-merge-partitions", "def merge_partitions(m, s, o):\n"
     "    return [sum(si * x[d] for si, x in zip(s, o)) / sum(s) for d in range(len(o[0]))]",
     "rescale"),                                                                               # no rescale
    ("06-merge-partitions", "import math\n"
     "def merge_partitions(m, s, o):\n"
     "    w = [si * math.exp(mi) for mi, si in zip(m, s)]\n"
     "    return [sum(wi * x[d] for wi, x in zip(w, o)) / sum(w) for d in range(len(o[0]))]",
     "maximum"),                                                                               # overflows
]


def test_reference_solutions_score_everything():
    for lab_id in LABS:
        r = grade_one(SOLUTIONS, lab_id)
        assert r["passed"] == r["total"] and r["first_failure"] == "", (lab_id, r)


def test_stubs_score_nothing(tmp_path):
    stubs = tmp_path / "stubs.py"
    stubs.write_text("\n\n".join(lab.stub for lab in LABS.values()))
    for lab_id in LABS:
        r = grade_one(stubs, lab_id)
        assert r["passed"] == 0 and "NotImplementedError" in r["first_failure"], (lab_id, r)


@pytest.mark.parametrize("lab_id, source, hint", WRONG)
def test_plausible_wrong_answers_fail_with_a_hint(tmp_path, lab_id, source, hint):
    path = tmp_path / "wrong.py"
    path.write_text(source)
    r = grade_one(path, lab_id)
    assert r["passed"] < r["total"] and hint in r["first_failure"], r


def test_every_lab_has_public_and_hidden_checks_and_two_wrong_answers():
    for lab_id, lab in LABS.items():
        assert any(c.public for c in lab.checks) and any(not c.public for c in lab.checks), lab_id
        assert sum(w[0] == lab_id for w in WRONG) >= 2, lab_id


def test_public_check_in_a_notebook(capsys):
    ns = {}
    exec(SOLUTIONS.read_text(), ns)
    assert check("06-merge-partitions", ns["merge_partitions"])
    assert not check("06-merge-partitions", lambda m, s, o: o[0])
    assert "not yet" in capsys.readouterr().out
    with pytest.raises(KeyError):
        check("99-nothing", ns["merge_partitions"])


def test_student_edition_then_grade_as_a_teacher_would(tmp_path):
    written = build(tmp_path / "student")
    assert len(written) == 9
    for path in written:
        nb = nbformat.read(path, as_version=4)
        assert not any("### Solutions" in c.source for c in nb.cells if c.cell_type == "markdown")
        assert not any(c.source.startswith("import paged_attention.exercises") and "assert ex." in c.source
                       for c in nb.cells if c.cell_type == "code"), path.name      # the solution cells are gone
    # A student fills in one lab with the reference solution.
    nb_path = tmp_path / "student" / "00_overview.ipynb"
    nb = nbformat.read(nb_path, as_version=4)
    cell = next(c for c in nb.cells if c.cell_type == "code" and c.source.startswith(MARKER + "00-slot-mapping"))
    ns_source = SOLUTIONS.read_text()
    cell.source = MARKER + "00-slot-mapping\n" + ns_source[ns_source.index("def slot_mapping"):
                                                           ns_source.index("def can_allocate")]
    nbformat.write(nb, nb_path)
    rows = grade([nb_path], time_limit=120)                # every lab, for the filled-in notebook
    rows += grade([tmp_path / "student" / "02_block_manager.ipynb"], ["02-can-allocate"], time_limit=120)
    scores = {(Path(r.submission).stem, r.lab): r.score for r in rows}
    assert scores[("00_overview", "00-slot-mapping")] == 1.0
    assert all(score == 0.0 for key, score in scores.items() if key != ("00_overview", "00-slot-mapping"))
    assert len(scores) == len(LABS) + 1


@pytest.mark.parametrize("source, reason", [
    ("def slot_mapping(:\n", "does not run"),
    ("x = 1\n", "no function named"),
    ("import sys\nsys.exit(3)\n", "does not run"),
    ("def slot_mapping(a, b, c):\n    print('x' * 10_000_000)\n    return []\n", "expected"),
])
def test_bad_submissions_give_a_row(tmp_path, source, reason):
    path = tmp_path / "bad.py"
    path.write_text(source)
    (row,) = grade([path], ["00-slot-mapping"], time_limit=120)
    assert row.passed == 0 and reason in row.first_failure, row


def test_endless_loop_and_crash_are_contained(tmp_path):
    loop, crash = tmp_path / "loop.py", tmp_path / "crash.py"
    loop.write_text("def slot_mapping(a, b, c):\n    while True:\n        pass\n")
    crash.write_text("import os\ndef slot_mapping(a, b, c):\n    os._exit(9)\n")
    rows = grade([loop, crash, SOLUTIONS, tmp_path / "missing.py"], ["00-slot-mapping"], time_limit=15)
    assert [r.passed for r in rows] == [0, 0, 4, 0]
    assert "stopped after" in rows[0].first_failure and "without a result" in rows[1].first_failure
    assert rows[3].first_failure == "no such file"


def test_grade_command_writes_a_csv(tmp_path):
    from paged_attention.lab.grade import main
    out = tmp_path / "grades.csv"
    assert main([str(SOLUTIONS), "--lab", "02-can-allocate", "--csv", str(out)]) == 0
    rows = list(csv.DictReader(out.open()))
    assert rows == [{"submission": str(SOLUTIONS), "lab": "02-can-allocate", "passed": "5", "total": "5",
                     "first_failure": ""}]
    assert main([str(SOLUTIONS), "--lab", "nope"]) == 2
