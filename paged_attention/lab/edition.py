"""The student edition: every notebook without its solutions, with an implement-it lab added.

The notebooks in ``notebooks/`` are the teacher's edition, executed. ``build`` writes a copy of each
into a new folder, where the solution cells (the code under the "Solutions" heading) are gone, the
exercise section's outputs are cleared, and each lab of that notebook adds its task (with the rule
of what is graded), a stub cell (marked ``# LAB: <id>``, the cell ``lab grade`` reads back) and a
cell that runs the lab's public checks the way the grader does. Only public material goes in: no
hidden check, expected answer or reference solution. ``build`` never writes into the folder it
reads, nor into a folder that holds anything unless told to (``force``).
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

import nbformat

from paged_attention.lab.labs import LABS, Lab

SOLUTIONS = "### Solutions"
MARKER = "# LAB: "
EXERCISES = re.compile(r"^#{2,3} (\d+\. )?Exercises", re.MULTILINE)


GRADED = (
    "**What is graded:** the cell that starts with `{marker}{lab_id}`, run on its own in a fresh process, "
    "after those `import` lines of this notebook's other cells that it uses, and nothing else: put your "
    "helpers, constants and kernels in that cell. It runs without the `paged_attention` library (it is "
    "what you re-implement): code that imports or uses it scores 0. The next cell runs the public checks "
    "exactly that way; your teacher's grader adds hidden checks of the rules above. Answers are compared "
    "as plain data with exact types: ints where ints are asked for, lists (or tuples, arrays, tensors), "
    "never an object of your own.")
INTRO = ("*Student edition.* Work in this folder's notebooks and hand them in (saved: the grader reads the "
         "file). The labs are at the end of the notebook.")


def lab_cells(lab: Lab) -> list:
    task = nbformat.v4.new_markdown_cell(
        f"## Lab: implement `{lab.function}`\n\n{lab.task}\n\n"
        + GRADED.format(marker=MARKER, lab_id=lab.lab_id), id=f"lab-{lab.lab_id}-task")
    stub = nbformat.v4.new_code_cell(f"{MARKER}{lab.lab_id}\n{lab.stub}", id=f"lab-{lab.lab_id}-code")
    run = nbformat.v4.new_code_cell(f"from paged_attention.lab import check\n\ncheck({lab.lab_id!r})",
                                    id=f"lab-{lab.lab_id}-check")
    return [task, stub, run]


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
    labs = [lab for lab in LABS.values() if lab.notebook == name]
    if labs:
        cells.insert(1 if cells and cells[0].cell_type == "markdown" else 0,
                     nbformat.v4.new_markdown_cell(INTRO, id="lab-student-edition"))
    for lab in labs:
        cells += lab_cells(lab)
    nb.cells = cells
    return nb


README = """# Student edition

Work in these notebooks (not in the project's `notebooks/` folder, which is your teacher's edition
with the solutions). Each lab is at the end of its notebook: write the function in the cell that
starts with `# LAB:`, run it, then run the check cell below it. Save the notebook before handing
it in: the grader reads the saved file.
"""


def build(out_dir: str | Path, notebooks_dir: str | Path | None = None, force: bool = False) -> list[Path]:
    """Write the student edition of every notebook into ``out_dir``; returns the paths written.
    Refuses (ValueError) to write into the folder it reads, or into a folder that holds anything
    unless ``force``."""
    src = Path(notebooks_dir) if notebooks_dir is not None else Path(__file__).resolve().parents[2] / "notebooks"
    paths = sorted(src.glob("[0-9][0-9]_*.ipynb"))
    if not paths:
        raise ValueError(f"no notebooks (NN_name.ipynb) in {src}")
    out = Path(out_dir)
    if out.resolve() == src.resolve():
        raise ValueError(f"{out} is the folder the teacher's notebooks are read from: choose another folder "
                         f"(for example student/)")
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} is a file, not a folder")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ValueError(f"{out} is not empty: choose an empty folder, or pass --force to overwrite its notebooks")
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for path in paths:
        nb = nbformat.read(path, as_version=4)
        target = out / path.name
        nbformat.write(student_notebook(nb, path.stem), target)
        written.append(target)
    (out / "README.md").write_text(README)
    return written


def main(argv: list[str]) -> int:
    """``lab build OUT_DIR [--force] [--notebooks DIR]``."""
    import argparse
    parser = argparse.ArgumentParser(prog="python -m paged_attention lab build",
                                     description="Write the student edition of the notebooks into a new folder.")
    parser.add_argument("out_dir", help="an empty (or new) folder, never the notebooks' own")
    parser.add_argument("--notebooks", default=None, help="the teacher's notebooks (default: the project's)")
    parser.add_argument("--force", action="store_true", help="write into a folder that is not empty")
    args = parser.parse_args(argv)
    try:
        written = build(args.out_dir, args.notebooks, force=args.force)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"student edition: {len(written)} notebooks in {args.out_dir} (hand out this folder)")
    return 0
