"""Fetch vLLM's compiled kernels from its wheel, pack them small, and unpack them on a GPU machine.

    python tools/vllm_kernels.py fetch [--dest vllm-kernels]      # on a machine with internet
    python tools/vllm_kernels.py unpack SRC_DIR DEST_DIR           # on the GPU machine

``fetch`` downloads the pinned ``vllm`` wheel (``pip download --no-deps``: no vLLM install, no
dependencies), takes out the two libraries ``paged_attention.kernels.vllm`` loads, strips their
symbol tables where ``strip`` exists, and writes each as ``NAME.xz`` into a git-ignored folder.
The files are built on PyTorch's stable ABI and load into another torch version. Sizes for
vllm 0.33.0: FA3 165 MB -> 7.6 MB, the cache ops 88 MB -> 60.4 MB (xz preset 9e,
after strip; a few minutes on two cores).

``fetch`` also copies two Python files, vLLM's Triton paged attention
(``paged_attention.kernels.vllm_triton`` executes them as a peer of ours), as ``NAME.py.xz``.

``unpack`` decompresses every ``*.xz`` of SRC_DIR into DEST_DIR (Python's lzma: no xz binary
needed); point ``PAGED_ATTENTION_VLLM_KERNELS`` at DEST_DIR.
"""
from __future__ import annotations

import argparse
import lzma
import shutil
import subprocess
import sys
import tempfile
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


def fetch(dest: Path, preset: int, wheel: Path | None = None, libraries: bool = True) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        if wheel is None:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                            "--dest", tmp, f"vllm=={VLLM_VERSION}"], check=True)
            wheel = next(Path(tmp).glob("vllm-*.whl"))
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
    u = sub.add_parser("unpack", help="decompress packed kernels")
    u.add_argument("src", type=Path)
    u.add_argument("dest", type=Path)
    a = parser.parse_args()
    if a.command == "fetch":
        fetch(a.dest, a.preset, a.wheel, libraries=not a.sources_only)
    else:
        unpack(a.src, a.dest)


if __name__ == "__main__":
    main()
