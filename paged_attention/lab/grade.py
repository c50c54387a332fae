"""Grading a class: every lab a submission holds, each in a contained process, verdicts given here.

For each submission (a notebook or a ``.py`` file, all read into memory before anything runs) the
grader finds its labs (the ``# LAB: <id>`` cells, or the lab functions a .py file defines), builds
each lab's program by the rule of ``submission.py``, refuses a program that uses the library's own
implementation, and runs the rest in ``sandbox.run_job`` (a small pool of them at a time). The
child only calls the function; the checks' expected answers never leave this process, and the
comparison is ``labs.exact_equal``. The rows (one per student and lab), a summary per lab and the
CSV are written by this process alone, after every run's processes are gone.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import secrets
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from paged_attention.lab import sandbox
from paged_attention.lab.labs import LABS, Lab, lab_cases
from paged_attention.lab.submission import Program, library_use, read_submission, top_level_modules

TIME_LIMIT = 60.0          # seconds per submission and lab
MEMORY_LIMIT = 1024        # MiB a lab's code may allocate beyond the grader's own imports
HEAVY = {"numpy", "torch", "triton"}   # imported by the child before its memory limit


@dataclass
class Row:
    student: str
    submission: str
    lab: str
    passed: int
    total: int
    first_failure: str

    @property
    def score(self) -> float:
        return self.passed / self.total if self.total else 0.0


@dataclass
class Verdict:
    results: list[tuple[str, bool, str]]     # (check name, passed, message) for each check run
    reason: str = ""                          # why nothing ran (the whole program failed), or ""
    output: str = ""                          # the last few KiB the child printed (for diagnosing the grader)

    @property
    def passed(self) -> int:
        return sum(ok for _, ok, _ in self.results)

    @property
    def first_failure(self) -> str:
        if self.reason:
            return self.reason
        return next((msg for _, ok, msg in self.results if not ok), "")


def _device(lab: Lab) -> str:
    if not lab.on_device:
        return "cpu"
    from paged_attention import runtime
    return runtime.DEVICE.type


def _error_text(error: dict, program: Program, where_name=None) -> str:
    text = f"{error.get('type')}: {error.get('message')}"
    line = program.cell_line(error.get("line")) if isinstance(error.get("line"), int) else None
    if line is not None:
        text += f" (line {line} of {program.where})"
    name = error.get("name")
    if error.get("type") == "NameError" and isinstance(name, str):
        found = where_name(name) if where_name else None
        if found and found[1]:
            text += f". `{name}` is imported in {found[0]}: run that cell first (after a restart, run the cells above)"
        elif found:
            text += (f". `{name}` is defined in {found[0]}, but the grader runs only the lab cell (with the "
                     f"notebook's import lines): move the definition into the lab cell")
        else:
            text += (f". The lab cell runs on its own, with the notebook's import lines only: import or define "
                     f"`{name}` in the lab cell")
    return text


def grade_program(program: Program, *, public_only: bool = False, time_limit: float = TIME_LIMIT,
                  memory_limit: int = MEMORY_LIMIT, marker: str | None = None, where_name=None) -> Verdict:
    """Grade one lab's program: static check, a contained run, then the comparison of its answers."""
    lab = LABS[program.lab_id]
    checks = [(i, c) for i, c in enumerate(lab.checks) if c.public or not public_only]
    used = library_use(program.source)
    if used:
        return Verdict([], f"uses the library's implementation ({used}): the lab is graded on your own code, "
                           f"which runs without the paged_attention library")
    cases = lab_cases(lab.lab_id)
    job = {"function": lab.function, "arg_types": list(lab.arg_types), "returns_args": list(lab.returns_args),
           "preimport": sorted(set(lab.needs) | (top_level_modules(program.source) & HEAVY)),
           "cases": [[_json(args) for args, _ in cases[i]] if (i, c) in checks else [] for i, c in
                     enumerate(lab.checks)]}
    run = sandbox.run_job(job, program.source, time_limit, memory_limit << 20, _device(lab),
                          marker or f"g{secrets.token_hex(4)}")
    verdict = _verdict(lab, program, checks, cases, run, time_limit, memory_limit, where_name)
    verdict.output = run.output_tail
    return verdict


def _json(x) -> str:
    return json.dumps(x)


def _verdict(lab, program, checks, cases, run, time_limit, memory_limit, where_name) -> Verdict:
    msgs = run.messages
    events = [m.get("event") for m in msgs]
    answers: dict[tuple, dict] = {}
    for m in msgs:
        if m.get("event") == "case":
            key = (m.get("check"), m.get("case"))
            if key in answers:
                return Verdict([], "the answers were tampered with (two answers to one case): 0")
            answers[key] = m
    if run.malformed:
        return Verdict([], "the answer channel carried lines the grader's child did not write (a forged "
                           "result?): 0")
    if any(events.count(e) > 1 for e in ("ready", "done", "error", "missing", "setup")):
        return Verdict([], "the answers were tampered with (a repeated message): 0")
    if "setup" in events:
        m = next(m for m in msgs if m.get("event") == "setup")
        error = m.get("error") or {}
        return Verdict([], f"the grader could not run the lab on {str(m.get('device'))[:20]} (a problem of the "
                           f"grading machine, not of the code): {error.get('type')}: {error.get('message')}")
    if "error" in events:
        error = next(m for m in msgs if m.get("event") == "error").get("error") or {}
        return Verdict([], "the code does not run: " + _error_text(error, program, where_name))
    if "missing" in events:
        return Verdict([], f"no function named {lab.function!r} in the lab's code")
    stopped = None
    if run.answers_too_long:
        stopped = "its answers were too long to read"
    elif run.over_memory:
        stopped = f"stopped: it used more than {memory_limit} MiB of memory"
    elif run.timed_out:
        allowed = run.time_allowed or time_limit
        extra = f" ({time_limit:g} s and {allowed - time_limit:g} s for starting the GPU)" if allowed > time_limit else ""
        stopped = f"stopped after {allowed:g} s{extra} (an endless loop?)"
    elif "done" not in events:
        code = run.returncode
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        tail = run.output_tail.strip().splitlines()[-1:] or [""]
        stopped = f"the grader's child ended without finishing ({how}){': ' + tail[0][:200] if tail[0] else ''}"
    results = []
    for i, check in checks:
        message = ""
        for j, (args, want) in enumerate(cases[i]):
            m = answers.get((i, j))
            what = lab.describe(args)
            if m is None:
                message = f"{check.name}: {what}: {stopped or 'no answer to this case (was the grader tampered with?)'}"
            elif m.get("stub"):
                message = f"{check.name}: the function is still the stub (it raises NotImplementedError)"
            elif "raised" in m:
                message = (f"{check.name}: {what}: raised {_error_text(m['raised'] or {}, program, where_name)}. "
                           f"{check.hint}")
            elif "not_plain" in m:
                message = f"{check.name}: {what}: returned {m['not_plain']}"
            elif not isinstance(m.get("out"), list) or len(m["out"]) != 1 + len(lab.returns_args):
                message = f"{check.name}: {what}: an answer the grader's child did not write"
            else:
                detail = lab.compare(m["out"], want, args)
                if detail:
                    message = f"{check.name}: {what}: {detail}. {check.hint}"
            if message:
                break
        results.append((check.name, not message, message[:600]))
    return Verdict(results)


# ---- a class ---------------------------------------------------------------------------------

def student_of(path: Path) -> str:
    """The student a file belongs to: ``alice_00_overview.ipynb`` and ``alice_00-slot-mapping.py`` ->
    alice; ``alice/00_overview.ipynb`` -> alice; otherwise the file's name without its suffix."""
    notebooks = {lab.notebook for lab in LABS.values()} | set(LABS)
    stem = path.stem
    for nb in sorted(notebooks, key=len, reverse=True):
        if stem == nb:
            return path.resolve().parent.name
        if stem.endswith(nb):
            return stem[:-len(nb)].rstrip("_-. ") or path.resolve().parent.name
    return stem


def read_roster(path: str | Path) -> dict[str, str]:
    """A roster CSV with the columns ``file`` and ``student``: submission file (name or path) -> student."""
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        if not reader.fieldnames or not {"file", "student"} <= set(reader.fieldnames):
            raise ValueError(f"the roster {path} needs the columns 'file' and 'student'")
        return {r["file"].strip(): r["student"].strip() for r in reader if r.get("file") and r.get("student")}


def grade(submissions: list[str | Path], labs: list[str] | None = None, time_limit: float = TIME_LIMIT,
          memory_limit: int = MEMORY_LIMIT, jobs: int = 2, roster: dict[str, str] | None = None,
          reap_orphans: bool = False) -> list[Row]:
    """One row per student and lab: the labs each submission holds (only ``labs`` if given: then
    every submission gets a row for each), graded ``jobs`` at a time. ``reap_orphans`` makes this
    process a subreaper for the run (the command line does; a library caller may have children of
    its own)."""
    wanted = list(labs) if labs else None
    unknown = [lab for lab in wanted or [] if lab not in LABS]
    if unknown:
        raise KeyError(f"unknown lab {unknown[0]!r}; the labs are {', '.join(LABS)}")
    if not (time_limit > 0 and math.isfinite(time_limit)) or memory_limit <= 0 or jobs < 1:
        raise ValueError("time_limit, memory_limit and jobs must be positive and finite")
    functions = {lab_id: lab.function for lab_id, lab in LABS.items()}
    tasks, rows = [], []
    for submission in submissions:                # every file is read before anything runs
        path = Path(submission)
        student = (roster or {}).get(str(submission)) or (roster or {}).get(path.name) or student_of(path)
        try:
            programs = read_submission(path, functions) if path.is_file() else None
            why = "no such file" if programs is None else ""
        except (OSError, ValueError, UnicodeDecodeError) as e:
            programs, why = None, f"cannot read the submission: {type(e).__name__}: {e}"
        if programs is None:
            rows += [Row(student, str(path), lab, 0, len(LABS[lab].checks) if lab in LABS else 0, why)
                     for lab in wanted or ["-"]]
            continue
        found = [lab for lab in LABS if lab in programs and (wanted is None or lab in wanted)]
        rows += [Row(student, str(path), lab, 0, len(LABS[lab].checks),
                     f"no lab cell ({'# LAB: ' + lab}) in this submission") for lab in wanted or [] if lab not in programs]
        if not found and wanted is None:
            rows.append(Row(student, str(path), "-", 0, 0, "no lab in this submission (no '# LAB: <id>' cell "
                                                           "and no lab function)"))
        tasks += [(student, str(path), programs[lab]) for lab in found]
    for lab in {p.lab_id for _, _, p in tasks}:
        lab_cases(lab)                            # the references, once, before the pool starts
    prefix = f"g{secrets.token_hex(4)}"
    if reap_orphans:
        sandbox.become_subreaper()

    def run(task):
        student, path, program = task
        v = grade_program(program, time_limit=time_limit, memory_limit=memory_limit, marker=prefix)
        if reap_orphans:
            sandbox.reap_orphans()
        return Row(student, path, program.lab_id, v.passed, len(LABS[program.lab_id].checks), v.first_failure)

    try:
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            rows += list(pool.map(run, tasks))
    finally:
        sandbox.kill_marked(prefix)               # anything of any run still alive
        if reap_orphans:
            sandbox.reap_orphans()
    for student in sorted(set((roster or {}).values()) - {r.student for r in rows}):
        rows += [Row(student, "", lab, 0, len(LABS[lab].checks) if lab in LABS else 0, "no submission")
                 for lab in wanted or ["-"]]
    return _one_per_student_and_lab(rows)


def _one_per_student_and_lab(rows: list[Row]) -> list[Row]:
    order = {lab: k for k, lab in enumerate(LABS)}
    best: dict[tuple[str, str], Row] = {}
    for r in rows:
        key = (r.student, r.lab)
        if key not in best or r.score > best[key].score:
            best[key] = r
    return sorted(best.values(), key=lambda r: (r.student, order.get(r.lab, -1), r.submission))


def summary(rows: list[Row]) -> list[tuple[str, float, int, int]]:
    """Per lab: (lab, mean score, students who passed every check, students graded)."""
    out = []
    for lab in LABS:
        scores = [r.score for r in rows if r.lab == lab]
        if scores:
            out.append((lab, sum(scores) / len(scores), sum(s == 1.0 for s in scores), len(scores)))
    return out


def cell(value) -> object:
    """A CSV cell that a spreadsheet shows as text: one that could start a formula gets a quote."""
    if isinstance(value, str) and value[:1] in ("=", "+", "-", "@", "\t", "\r"):
        return "'" + value
    return value


def write_csv(rows: list[Row], path: str | Path) -> None:
    """The rows, then a blank line and one summary line per lab."""
    tmp = Path(f"{path}.tmp-{os.getpid()}")
    with open(tmp, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["student", "submission", "lab", "passed", "total", "score", "first_failure"])
        for r in rows:
            w.writerow([cell(x) for x in (r.student, r.submission, r.lab, r.passed, r.total, round(r.score, 3),
                                          r.first_failure)])
        w.writerow([])
        for lab, mean, passed, n in summary(rows):
            w.writerow(["(summary)", "", lab, passed, n, round(mean, 3),
                        f"mean score {mean:.2f}; {passed} of {n} passed every check"])
    os.replace(tmp, path)


# ---- the command line ----------------------------------------------------------------------

def _positive(kind, upper):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not (math.isfinite(value) and 0 < value <= upper):
            raise argparse.ArgumentTypeError(f"must be more than 0 and at most {upper}, got {text}")
        return value
    return parse


def _lab_id(text: str) -> str:
    if text not in LABS:
        raise argparse.ArgumentTypeError(f"unknown lab {text!r}; the labs are {', '.join(LABS)}")
    return text


def _remove_planted(before: set[str]) -> None:
    """Python files that appeared in this folder while grading (only possible where the kernel has
    no Landlock) would be imported by the next ``python -m`` run here: remove them, and say so."""
    for name in sorted(set(os.listdir(".")) - before):
        if name.endswith((".py", ".pth")) and os.path.isfile(name):
            os.remove(name)
            print(f"warning: a submission wrote {name} into this folder during grading; removed it",
                  file=sys.stderr)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m paged_attention lab grade",
        description="Grade submissions (notebooks or .py files): one row per student and lab.")
    parser.add_argument("submissions", nargs="+")
    parser.add_argument("--lab", action="append", type=_lab_id,
                        help="grade only this lab (repeatable); every submission then gets a row for it")
    parser.add_argument("--csv", help="also write the rows and a summary per lab to this CSV file")
    parser.add_argument("--roster", help="a CSV with columns 'file' and 'student' (file name -> student)")
    parser.add_argument("--time-limit", type=_positive(float, 3600), default=TIME_LIMIT,
                        help=f"seconds per submission and lab (default {TIME_LIMIT:g}; a lab that runs on a GPU "
                             f"gets {sandbox.GPU_ALLOWANCE:g} s more to start CUDA and compile its kernels)")
    parser.add_argument("--memory-limit", type=_positive(int, 1 << 20), default=MEMORY_LIMIT,
                        help=f"MiB a lab's code may allocate (default {MEMORY_LIMIT})")
    parser.add_argument("--jobs", type=_positive(int, 64), default=min(2, os.cpu_count() or 1),
                        help="labs graded at the same time (default: 2, or 1 on one core)")
    args = parser.parse_args(argv)
    try:
        roster = read_roster(args.roster) if args.roster else None
        if args.csv and Path(args.csv).resolve() in {Path(s).resolve() for s in args.submissions}:
            raise ValueError(f"--csv {args.csv} is one of the submissions")
        before = set(os.listdir("."))
        rows = grade(args.submissions, args.lab, args.time_limit, args.memory_limit, args.jobs, roster,
                     reap_orphans=True)
    except (KeyError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    _remove_planted(before)
    width = max([len(r.student) for r in rows] + [7])
    for r in rows:
        print(f"{r.student:<{width}}  {r.lab:<24} {r.passed:>2}/{r.total:<2}  {r.first_failure}")
    for lab, mean, passed, n in summary(rows):
        print(f"{'summary':<{width}}  {lab:<24} mean {mean:.2f}, {passed} of {n} passed every check")
    if args.csv:
        try:
            write_csv(rows, args.csv)
        except OSError as e:
            print(f"error: cannot write {args.csv}: {e}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
