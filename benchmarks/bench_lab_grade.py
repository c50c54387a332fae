"""Grading a class: how long ``lab grade`` takes for 30 notebook submissions.

Usage (any machine):  python benchmarks/bench_lab_grade.py [--students 30] [--jobs 2]
Builds the student edition, fills in one lab notebook per student (cycling through the notebooks
that hold labs, so every lab is there, the Triton lab included; every fifth student hands in a
wrong answer or the stub), then times ``python -m paged_attention lab grade`` on them as a teacher
runs it, in a process of its own, and prints the time with the machine it ran on. The target: 30
submissions in under 3 minutes on 2 cores.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CELLS = ROOT / "tests" / "lab_submissions" / "student_cells"


def fill(notebook: Path, target: Path, k: int) -> list[str]:
    """``notebook`` with its lab cells written: correct, except every fifth student (a wrong
    answer: the correct one with its last line changed, or the stub)."""
    nb = json.loads(notebook.read_text())
    labs = []
    for c in nb["cells"]:
        src = "".join(c["source"]) if isinstance(c["source"], list) else c["source"]
        if c["cell_type"] == "code" and src.startswith("# LAB: "):
            lab = src.split("\n", 1)[0][len("# LAB: "):].strip()
            body = (CELLS / f"{lab}.py").read_text()
            if k % 10 == 4:
                body = body.rstrip().rsplit("\n", 1)[0] + "\n    return None\n"
            if k % 10 != 9:                   # student 9, 19, 29: the stub as handed out
                c["source"] = f"# LAB: {lab}\n" + body
            labs.append(lab)
    target.write_text(json.dumps(nb))
    return labs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--students", type=int, default=30)
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()
    from paged_attention.bench import timing
    from paged_attention.lab.edition import build

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        build(tmp / "student")
        notebooks = [p for p in sorted((tmp / "student").glob("*.ipynb")) if "# LAB: " in p.read_text()]
        (tmp / "submissions").mkdir()
        files, labs = [], 0
        for k in range(args.students):
            nb = notebooks[k % len(notebooks)]
            target = tmp / "submissions" / f"student{k:02d}_{nb.name}"
            labs += len(fill(nb, target, k))
            files.append(str(target))
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        start = time.perf_counter()
        out = subprocess.run([sys.executable, "-m", "paged_attention", "lab", "grade", *files, "--csv",
                              str(tmp / "grades.csv"), "--jobs", str(args.jobs)], cwd=tmp, env=env,
                             capture_output=True, text=True)
        seconds = time.perf_counter() - start
        if out.returncode != 0:
            print(out.stdout, out.stderr, file=sys.stderr)
            return 1
        rows = [line for line in out.stdout.splitlines() if not line.startswith("summary")]
        full = sum(1 for line in rows if line.split()[2].split("/")[0] == line.split()[2].split("/")[1])
    print(f"host CPU: {timing.cpu_name()}; {args.jobs} jobs")
    print(f"{args.students} notebook submissions, {labs} labs: graded in {seconds:.1f} s "
          f"({seconds / labs:.2f} s per lab; {full} of {len(rows)} rows full marks)")
    print("\n".join(line for line in out.stdout.splitlines() if line.startswith("summary")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
