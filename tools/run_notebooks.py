"""Execute notebooks in place, so that their saved outputs show this machine's run.

Usage: python tools/run_notebooks.py [notebooks/NAME.ipynb ...]   (default: every notebook)

Committed notebooks are executed on the GPU machine this way, so that a reader sees the CUDA
verification without running anything; nbval then re-runs them on a CPU and compares the
outputs that are not marked machine-dependent. Needs nbclient, nbformat and ipykernel only.
"""
import glob
import os
import sys
import time

import nbformat
from nbclient import NotebookClient


def run(path: str) -> None:
    nb = nbformat.read(path, as_version=4)
    start = time.perf_counter()
    # Run from the notebook's folder (as JupyterLab does); no per-cell timestamps in the file.
    NotebookClient(nb, timeout=900, kernel_name="python3", record_timing=False,
                   resources={"metadata": {"path": os.path.dirname(os.path.abspath(path))}}).execute()
    nbformat.write(nb, path)
    print(f"{path}: executed in {time.perf_counter() - start:.1f} s", flush=True)


if __name__ == "__main__":
    paths = sys.argv[1:] or sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "notebooks", "*.ipynb")))
    for p in paths:
        run(p)
