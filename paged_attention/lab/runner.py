"""The grading child: runs one lab of one submission and reports what the function returned.

This file is run as a script (``python -I -S runner.py``) in a fresh temporary folder, never
imported by the student's code, and it imports nothing of ``paged_attention``: the student's code
runs without the library it re-implements. It reads its job (the program, the inputs of every
case, where to answer) from stdin, then

1. puts the site-packages folders the grader gave it on ``sys.path`` (``-S`` skipped the ``.pth``
   files, ``-I`` the current folder and every ``PYTHON*`` variable),
2. imports the heavy libraries the lab needs (numpy, torch, triton), creates the GPU's context if the
   lab runs on one, then limits its address space (on the CPU), the size of any file it writes and,
   with Landlock, where it may write (``writable_paths``),
3. runs the program and calls the lab's function on every case's inputs,
4. sends back each answer as plain JSON (ints, floats, strings, lists, None) on the file
   descriptor the grader opened, each line carrying the grader's nonce.

It holds no expected value and no verdict: the grader compares the answers in its own process, so
nothing the submission does in here (patching this module, printing, an object whose ``__eq__``
is always true) can turn a wrong answer into a right one. The functions ``to_plain``,
``convert_args`` and ``call_case`` are also imported by the in-notebook ``check`` when it has no
notebook history to read (a plain Python session).
"""
from __future__ import annotations

import enum
import json
import linecache
import os
import sys
import traceback

PLAIN_LIMIT = 1_000_000          # list items an answer may hold in all
LIBRARY = "paged_attention"


class NotPlain(TypeError):
    """An answer that is not plain data (a custom class, a dict, a generator ...)."""


def to_plain(x, _budget=None):
    """``x`` as JSON-ready builtins of exact types: a numpy array or torch tensor becomes a list, a
    numpy scalar its Python value, an Enum its name, a tuple a list. Anything else (a subclass of
    int, an object with its own ``__eq__``, a dict) raises ``NotPlain``."""
    budget = _budget if _budget is not None else [PLAIN_LIMIT]
    t = type(x)
    if x is None or t in (bool, int, float, str):
        return x
    if t in (list, tuple):
        budget[0] -= len(x)
        if budget[0] < 0:
            raise NotPlain(f"an answer of more than {PLAIN_LIMIT} items")
        return [to_plain(e, budget) for e in x]
    mod = t.__module__.split(".")[0]
    if mod == "numpy":
        np = sys.modules["numpy"]
        if isinstance(x, np.ndarray):
            return to_plain(x.tolist(), budget)
        if isinstance(x, np.generic):
            return to_plain(x.item(), budget)
    if mod == "torch":
        torch = sys.modules["torch"]
        if isinstance(x, torch.Tensor):
            return to_plain(x.detach().cpu().tolist(), budget)
    if isinstance(x, enum.Enum):
        return to_plain(x.name, budget)
    raise NotPlain(f"an object of type {t.__name__}, not plain data (ints, floats, strings, lists)")


def convert_args(args: list, arg_types: list, device: str) -> list:
    """The case's plain inputs as the lab hands them over: lists, numpy arrays or torch tensors."""
    out = []
    for value, kind in zip(args, list(arg_types) + [None] * (len(args) - len(arg_types))):
        if kind is None:
            out.append(value)
        elif kind.startswith("np."):
            import numpy as np
            out.append(np.array(value, dtype=getattr(np, kind[3:])))
        elif kind.startswith("torch."):
            import torch
            out.append(torch.tensor(value, dtype=getattr(torch, kind[6:]), device=device))
        else:
            raise ValueError(f"unknown argument kind {kind!r}")
    return out


def _error(e: BaseException, filename: str) -> dict:
    """An exception as the grader shows it: type, message and the line of the submission it came
    from (the deepest frame in the submission's file)."""
    line = None
    for frame, lineno in traceback.walk_tb(e.__traceback__):
        if frame.f_code.co_filename == filename:
            line = lineno
    if isinstance(e, SyntaxError) and e.filename == filename:
        line = e.lineno
    name = getattr(e, "name", None) if isinstance(e, NameError) else None
    return {"type": type(e).__name__, "message": str(e)[:500], "line": line, "name": name}


def call_case(fn, args_json: str, arg_types: list, returns_args: list, device: str, filename: str) -> dict:
    """Call ``fn`` on one case; the answer: ``{"out": [returned, *the arguments it changes]}``,
    or ``{"stub": True}``, ``{"raised": ...}``, ``{"not_plain": ...}``."""
    args = convert_args(json.loads(args_json), arg_types, device)
    try:
        got = fn(*args)
    except NotImplementedError:
        return {"stub": True}
    except BaseException as e:                      # SystemExit too: it is the function's answer
        return {"raised": _error(e, filename)}
    try:
        return {"out": [to_plain(got)] + [to_plain(args[i]) for i in returns_args]}
    except NotPlain as e:
        return {"not_plain": str(e)}
    except Exception as e:                          # a tensor that cannot be read back, ...
        return {"raised": _error(e, filename)}


class _NoLibrary:
    """An import hook: ``paged_attention`` cannot be imported by the graded code."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name == LIBRARY or name.startswith(LIBRARY + "."):
            raise ImportError(f"the lab is graded without the {LIBRARY} library (it is what you re-implement)")
        return None


def _limit(memory_bytes: int | None, file_bytes: int) -> None:
    import resource
    if memory_bytes is not None:
        with open("/proc/self/status") as f:
            size = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
        resource.setrlimit(resource.RLIMIT_AS, (size + memory_bytes, size + memory_bytes))
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_bytes, file_bytes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


# Landlock (Linux >= 5.13): the kernel's unprivileged sandbox. Reading and executing stay allowed
# everywhere (Triton runs ``ldconfig``, a C compiler and ``ptxas``, and reads libcuda); ioctl on
# devices is not handled either (CUDA drives the GPU through it). Creating, writing, removing or
# renaming files is allowed only inside the run's folder and, for a run on a GPU, in /dev/shm
# (CUDA's driver keeps small files there); writing, not creating, to /dev/null, /dev/zero,
# /dev/full and, on a GPU, the NVIDIA device files. Device nodes cannot be made anywhere (as root,
# one would open a raw disk). From ABI 6, no signal to a process outside and no abstract socket.
_SYSCALLS = {"x86_64": (444, 445, 446), "aarch64": (444, 445, 446)}
_WRITE_FILE, _MAKE_CHAR, _MAKE_BLOCK = 1 << 1, 1 << 6, 1 << 11
_CHANGE = sum(1 << b for b in (1, 4, 5, 6, 7, 8, 9, 10, 11, 12))   # write, remove, make_*
_REFER, _TRUNCATE, _SCOPE_SIGNAL, _SCOPE_UNIX = 1 << 13, 1 << 14, 1 << 1, 1 << 0
_PLAIN_DEVICES = ("null", "zero", "full")


def writable_paths(folder: str, device: str, dev: str = "/dev") -> list[tuple[str, str]]:
    """Where a run on ``device`` may change files: ``(path, "tree")`` (create, write and remove
    beneath it) or ``(path, "file")`` (write an existing file, or the files beneath a folder).
    ``dev`` is where the device files are (a test points it elsewhere)."""
    paths = [(folder, "tree")] + [(os.path.join(dev, name), "file") for name in _PLAIN_DEVICES]
    if device != "cpu":
        paths += [(os.path.join(dev, name), "file") for name in sorted(os.listdir(dev)) if name.startswith("nvidia")]
        paths.append((os.path.join(dev, "shm"), "tree"))
    return [(path, kind) for path, kind in paths if os.path.exists(path)]


def confine_writes(paths: list[tuple[str, str]]) -> bool:
    """Allow file changes only at ``paths`` (see ``writable_paths``; the first one must take its
    rule, the others are skipped if the kernel refuses them) for this process and all it starts;
    True if the kernel applied it."""
    import ctypes
    import platform
    nums = _SYSCALLS.get(platform.machine())
    if nums is None:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    abi = libc.syscall(nums[0], None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    if abi < 1:
        return False
    handled = _CHANGE | (_REFER if abi >= 2 else 0) | (_TRUNCATE if abi >= 3 else 0)
    access = {"tree": handled & ~(_MAKE_CHAR | _MAKE_BLOCK), "file": _WRITE_FILE | (_TRUNCATE if abi >= 3 else 0)}
    attr = (ctypes.c_uint64 * 3)(handled, 0, (_SCOPE_SIGNAL | _SCOPE_UNIX) if abi >= 6 else 0)
    ruleset = libc.syscall(nums[0], ctypes.byref(attr), ctypes.c_size_t(24 if abi >= 6 else 8), ctypes.c_uint32(0))
    if ruleset < 0:
        return False

    class PathBeneath(ctypes.Structure):
        _pack_ = 1
        _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]

    try:
        for k, (path, kind) in enumerate(paths):
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                if k == 0:
                    return False
                continue
            try:
                rule = PathBeneath(access[kind], fd)
                if libc.syscall(nums[1], ctypes.c_int(ruleset), ctypes.c_int(1), ctypes.byref(rule),
                                ctypes.c_uint32(0)) < 0 and k == 0:
                    return False
            finally:
                os.close(fd)
        if libc.prctl(38, 1, 0, 0, 0) != 0:                 # PR_SET_NO_NEW_PRIVS
            return False
        return libc.syscall(nums[2], ctypes.c_int(ruleset), ctypes.c_uint32(0)) == 0
    finally:
        os.close(ruleset)


def start_device(device: str) -> None:
    """Create the GPU's context before the program runs and before the writes are confined: CUDA
    opens its device files and /dev/shm here, and its memory counts in the run's starting size."""
    if device != "cpu" and "torch" in sys.modules:
        torch = sys.modules["torch"]
        torch.ones(1, device=device).add_(1)
        torch.cuda.synchronize()


def main() -> None:
    job = json.loads(sys.stdin.read())
    answer = os.fdopen(job["result_fd"], "w", buffering=1)
    nonce = job["nonce"]

    def send(**message):
        answer.write(json.dumps(dict(message, nonce=nonce)) + "\n")
        answer.flush()

    sys.path[:0] = job["site_dirs"]
    sys.meta_path.insert(0, _NoLibrary)
    for name in job["preimport"]:
        try:
            __import__(name)
        except Exception:
            pass                                    # the program's own import reports it
    try:
        start_device(job["device"])
    except Exception as e:                          # the grading machine's problem, not the program's
        send(event="setup", error=_error(e, ""), device=job["device"])
        send(event="done")
        os._exit(0)
    _limit(job["memory_bytes"], job["file_bytes"])
    try:
        confined = confine_writes(writable_paths(os.getcwd(), job["device"]))
    except (OSError, AttributeError):
        confined = False
    with open("/proc/self/status") as f:
        rss = next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:")), 0)
    send(event="ready", rss=rss, confined=confined)

    filename, program = job["filename"], job["program"]
    # The program is also a real file (Triton reads a kernel's source through ``inspect``); the
    # cache entry makes that read return this text even if something rewrites the file.
    linecache.cache[filename] = (len(program), None, program.splitlines(True), filename)
    namespace = {"__name__": "__lab__", "__file__": filename, "__builtins__": __builtins__}
    try:
        exec(compile(program, filename, "exec"), namespace)
    except BaseException as e:
        send(event="error", error=_error(e, filename))
        send(event="done")
        os._exit(0)
    fn = namespace.get(job["function"])
    if not callable(fn):
        send(event="missing")
        send(event="done")
        os._exit(0)
    for i, cases in enumerate(job["cases"]):
        for j, args_json in enumerate(cases):
            try:
                result = call_case(fn, args_json, job["arg_types"], job["returns_args"], job["device"], filename)
            except Exception as e:                  # the inputs could not be made on the device
                send(event="setup", error=_error(e, filename), device=job["device"])
                send(event="done")
                os._exit(0)
            send(event="case", check=i, case=j, **result)
    send(event="done")
    os._exit(0)                                     # no atexit handler of the submission runs


if __name__ == "__main__":
    main()
