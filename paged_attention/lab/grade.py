"""Grading: every submission, every lab, each in a process of its own with a time limit.

A submission is a notebook (its ``# LAB: <id>`` cells are run) or a ``.py`` file (run whole). Each
(submission, lab) pair runs in a fresh ``python -m paged_attention.lab.grade --one`` process, so a
crash, an endless loop or megabytes of printing in one cannot stall or change the next; the child
prints one JSON line, the parent turns whatever happened into a row.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import io
import json
import os
import subprocess
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

from paged_attention.lab.labs import LABS

RESULT = "LAB-RESULT "          # the child's answer line
OUTPUT_LIMIT = 1 << 20          # bytes of a child's output the parent reads at most


@dataclass
class Row:
    submission: str
    lab: str
    passed: int
    total: int
    first_failure: str

    @property
    def score(self) -> float:
        return self.passed / self.total if self.total else 0.0


def submission_source(path: Path, lab_id: str) -> str:
    """The code of ``path`` that defines a lab: a notebook's ``# LAB: <lab_id>`` cells, or a whole .py."""
    if path.suffix == ".py":
        return path.read_text()
    if path.suffix == ".ipynb":
        import nbformat
        nb = nbformat.read(path, as_version=4)
        marker = f"# LAB: {lab_id}"
        return "\n\n".join(c.source for c in nb.cells if c.cell_type == "code" and c.source.lstrip().startswith(marker))
    raise ValueError(f"a submission is a .ipynb or a .py file, got {path.name}")


def grade_one(path: Path, lab_id: str) -> dict:
    """In this process: run the submission's code for ``lab_id`` and every check of the lab."""
    lab = LABS[lab_id]
    total = len(lab.checks)
    try:
        source = submission_source(path, lab_id)
    except Exception as e:
        return {"passed": 0, "total": total, "first_failure": f"cannot read the submission: {type(e).__name__}: {e}"}
    namespace: dict = {"__name__": "submission"}
    sink = io.StringIO()
    try:
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            exec(compile(source, str(path), "exec"), namespace)
    except BaseException as e:                  # SyntaxError, an error at import time, SystemExit ...
        return {"passed": 0, "total": total, "first_failure": f"the code does not run: {type(e).__name__}: {e}"}
    fn = namespace.get(lab.function)
    if not callable(fn):
        return {"passed": 0, "total": total, "first_failure": f"no function named {lab.function!r}"}
    passed, first = 0, ""
    for check in lab.checks:
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                check.run(fn)
            passed += 1
        except BaseException as e:
            if not first:
                first = check.failure(e)
    return {"passed": passed, "total": total, "first_failure": first[:500]}


def grade(submissions: list[str | Path], labs: list[str] | None = None, time_limit: float = 60.0) -> list[Row]:
    """One row per (submission, lab), each graded in its own process."""
    lab_ids = list(labs) if labs else list(LABS)
    unknown = [lab for lab in lab_ids if lab not in LABS]
    if unknown:
        raise KeyError(f"unknown lab {unknown[0]!r}; the labs are {', '.join(LABS)}")
    rows = []
    for submission in submissions:
        path = Path(submission)
        for lab_id in lab_ids:
            total = len(LABS[lab_id].checks)
            if not path.is_file():
                rows.append(Row(str(path), lab_id, 0, total, "no such file"))
                continue
            rows.append(_run_child(path, lab_id, total, time_limit))
    return rows


def _run_child(path: Path, lab_id: str, total: int, time_limit: float) -> Row:
    cmd = [sys.executable, "-m", "paged_attention.lab.grade", "--one", str(path), lab_id]
    env = dict(os.environ, PYTHONHASHSEED="0")
    try:
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env) as child:
            try:
                out, _ = child.communicate(timeout=time_limit)
            except subprocess.TimeoutExpired:
                child.kill()
                child.communicate()
                return Row(str(path), lab_id, 0, total, f"stopped after {time_limit:g} s (an endless loop?)")
    except OSError as e:
        return Row(str(path), lab_id, 0, total, f"could not start the grader: {e}")
    lines = out[-OUTPUT_LIMIT:].decode(errors="replace").splitlines()
    answer = next((line[len(RESULT):] for line in reversed(lines) if line.startswith(RESULT)), None)
    if answer is None:
        tail = lines[-1] if lines else ""
        return Row(str(path), lab_id, 0, total, f"the grader process ended without a result (exit "
                                                 f"{child.returncode}): {tail[:200]}")
    result = json.loads(answer)
    return Row(str(path), lab_id, result["passed"], result["total"], result["first_failure"])


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m paged_attention lab grade",
                                     description="Grade submissions (notebooks or .py files), one row per lab.")
    parser.add_argument("submissions", nargs="+")
    parser.add_argument("--lab", action="append", help="grade only this lab (repeatable)")
    parser.add_argument("--csv", help="also write the rows to this CSV file")
    parser.add_argument("--time-limit", type=float, default=60.0, help="seconds per submission and lab")
    args = parser.parse_args(argv)
    try:
        rows = grade(args.submissions, args.lab, args.time_limit)
    except (KeyError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    width = max(len(r.submission) for r in rows)
    for r in rows:
        print(f"{r.submission:<{width}}  {r.lab:<26} {r.passed:>2}/{r.total:<2}  {r.first_failure}")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["submission", "lab", "passed", "total", "first_failure"])
            w.writerows([r.submission, r.lab, r.passed, r.total, r.first_failure] for r in rows)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--one"] and len(sys.argv) == 4:
        try:
            result = grade_one(Path(sys.argv[2]), sys.argv[3])
        except BaseException:
            result = {"passed": 0, "total": len(LABS[sys.argv[3]].checks),
                      "first_failure": "the grader failed: " + traceback.format_exc(limit=1)[-300:]}
        print(RESULT + json.dumps(result), flush=True)
    else:
        sys.exit(main(sys.argv[1:]))
