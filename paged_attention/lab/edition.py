"""The student edition: every notebook without its solutions, with an implement-it lab added.

The notebooks in ``notebooks/`` are the teacher's edition, executed. ``build`` writes a copy of each
where the solution cells (the code under the "Solutions" heading) are gone, the exercise section's
outputs are cleared, and each lab of that notebook adds a stub cell (marked ``# LAB: <id>``, the
cell ``lab grade`` reads back) and a cell that runs the lab's public checks.
"""
from __future__ import annotations

import re
from pathlib import Path

import nbformat

from paged_attention.lab.labs import LABS, Lab

SOLUTIONS = "### Solutions"
MARKER = "# LAB: "
EXERCISES = re.compile(r"^#{2,3} (\d+\. )?Exercises", re.MULTILINE)


def lab_cells(lab: Lab) -> list:
    return [
        nbformat.v4.new_markdown_cell(
            f"## Lab: implement `{lab.function}`\n\n{lab.task}\n\nWrite it in the cell below, then run the "
            "next cell: it runs the public checks. Your teacher's grader runs hidden checks as well."),
        nbformat.v4.new_code_cell(f"{MARKER}{lab.lab_id}\n{lab.stub}"),
        nbformat.v4.new_code_cell(f"from paged_attention.lab import check\n\ncheck({lab.lab_id!r}, {lab.function})"),
    ]


def student_notebook(nb: nbformat.NotebookNode, name: str) -> nbformat.NotebookNode:
    """``nb`` (not changed) as a student gets it."""
    nb = nbformat.from_dict(nb)
    cells, in_solutions, in_exercises, answers = [], False, False, None
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            if EXERCISES.search(cell.source):
                in_exercises = True
            if SOLUTIONS in cell.source:
                cell.source = cell.source[:cell.source.index(SOLUTIONS)].rstrip()
                in_solutions = True
                if cell.source:
                    cells.append(cell)
                answers = nbformat.v4.new_code_cell("# Your answers: call the checkers above with them.\n")
                cells.append(answers)
                continue
            in_solutions = False
        elif in_solutions:
            # A solution cell: gone, but its imports (the checkers' module) go to the answers cell.
            imports = [line for line in cell.source.splitlines() if line.startswith(("import ", "from "))]
            if imports:
                answers.source = "\n".join(imports) + "\n\n" + answers.source
            continue
        elif in_exercises:
            cell.outputs, cell.execution_count = [], None
        cells.append(cell)
    for lab in LABS.values():
        if lab.notebook == name:
            cells += lab_cells(lab)
    nb.cells = cells
    return nb


def build(out_dir: str | Path, notebooks_dir: str | Path | None = None) -> list[Path]:
    """Write the student edition of every notebook into ``out_dir``; returns the paths written."""
    src = Path(notebooks_dir) if notebooks_dir is not None else Path(__file__).resolve().parents[2] / "notebooks"
    paths = sorted(src.glob("[0-9][0-9]_*.ipynb"))
    if not paths:
        raise ValueError(f"no notebooks (NN_name.ipynb) in {src}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for path in paths:
        nb = nbformat.read(path, as_version=4)
        target = out / path.name
        nbformat.write(student_notebook(nb, path.stem), target)
        written.append(target)
    return written
