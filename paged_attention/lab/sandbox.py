"""Running one graded program contained: its own folder, session, limits, and nothing left behind.

``run_job`` starts ``runner.py`` in a fresh temporary folder (its working directory and HOME), in a
new session (so its whole process group can be killed), with an environment that carries a marker
of this run. It reads two pipes at once until the runner exits or the time limit passes: the
answers (a pipe whose write end only the runner was given, every line tagged with a nonce) and the
output (stdout and stderr, of which only the last few KiB are kept; the rest is read and dropped).
Then it kills the process group, every process that carries the run's marker (a daemon that left
the session keeps its environment) and, where the grader is a subreaper, every orphan that was
handed to it; only then is the folder removed.

Memory: on the CPU the runner limits its own address space (RLIMIT_AS) after its imports; a run on
a GPU cannot (CUDA reserves far more address space than it uses), so there the parent watches the
resident memory of the run's session (every process in it, the C compiler and ``ptxas`` that
Triton starts included) and kills it past the runner's size once its imports and CUDA's context
are made, plus the limit, plus 2 GiB for Triton's compiler. Linux only (``/proc``).

Time: the limit covers the whole run, imports included. On a GPU a run also starts CUDA and
compiles its kernels from nothing (Triton's cache is the run's own folder, so that no run can plant
a compiled kernel for another): that gets ``GPU_ALLOWANCE`` seconds on top of the limit.
"""
from __future__ import annotations

import json
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

RUNNER = Path(__file__).with_name("runner.py")
MARKER_VAR = "PAGED_ATTENTION_LAB_RUN"
OUTPUT_TAIL = 4096              # bytes of a run's output kept for its row
ANSWER_LIMIT = 32 << 20         # bytes of answers read at most
FILE_LIMIT = 64 << 20           # the largest file a run may write
PR_SET_CHILD_SUBREAPER = 36
CUDA_HEADROOM = 2 << 30         # on a GPU, what Triton's compiler (LLVM, cc, ptxas) adds to a run
GPU_ALLOWANCE = 30.0            # seconds added on a GPU: CUDA's context, compiling kernels from nothing
_lock = threading.Lock()
_children: set[int] = set()     # pids of runners alive now (never treated as orphans)


@dataclass
class RunResult:
    messages: list[dict] = field(default_factory=list)
    returncode: int | None = None
    timed_out: bool = False
    over_memory: bool = False
    answers_too_long: bool = False
    malformed: int = 0          # answer lines that were not JSON of this run
    output_tail: str = ""
    output_bytes: int = 0
    seconds: float = 0.0
    time_allowed: float = 0.0   # the limit the run had (on a GPU, with GPU_ALLOWANCE)


def site_dirs() -> list[str]:
    """The folders the runner may import from: this interpreter's path, minus any folder that holds
    the ``paged_attention`` package (the graded code runs without it) and minus the current folder."""
    out = []
    for p in sys.path[1:]:
        if p and os.path.isdir(p) and not os.path.isdir(os.path.join(p, "paged_attention")) \
                and os.path.abspath(p) != os.getcwd():
            out.append(os.path.abspath(p))
    return out


def child_env(marker: str, workdir: str, device: str) -> dict:
    """A small environment: no PYTHON* variable, one thread, and HOME, TMPDIR, Triton's cache and
    CUDA's JIT cache in the run's folder (the only place it may write; a cache shared between runs
    would let one submission plant compiled code for the next)."""
    keep = ("PATH", "LANG", "LC_ALL", "LD_LIBRARY_PATH", "CUDA_HOME", "CUDA_PATH", "TRITON_PTXAS_PATH",
            "TRITON_LIBCUDA_PATH")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env.update({MARKER_VAR: marker, "HOME": workdir, "TMPDIR": workdir, "OMP_NUM_THREADS": "1",
                "MKL_NUM_THREADS": "1", "MALLOC_ARENA_MAX": "2", "PYTHONHASHSEED": "0",
                "TRITON_HOME": workdir, "TRITON_CACHE_DIR": os.path.join(workdir, ".triton", "cache"),
                "CUDA_CACHE_PATH": os.path.join(workdir, ".nv", "ComputeCache")})
    if device == "cpu":
        env.update({"TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""})
    elif "CUDA_VISIBLE_DEVICES" in os.environ:
        env["CUDA_VISIBLE_DEVICES"] = os.environ["CUDA_VISIBLE_DEVICES"]
    return env


def become_subreaper() -> bool:
    """Make orphans of this process's descendants (a daemon that double-forked) its children, so
    that ``reap_orphans`` can end them. Linux only; False where it is not possible."""
    try:
        import ctypes
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _proc_pids() -> list[int]:
    try:
        return [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return []


def _stat(pid: int) -> tuple[int, int, int] | None:
    """(ppid, process group, session) of a process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return int(fields[1]), int(fields[2]), int(fields[3])
    except (OSError, IndexError, ValueError):
        return None


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def kill_marked(marker: str) -> int:
    """Kill every process whose environment carries ``marker`` (this run's, or a prefix of a grading
    session's markers); returns how many there were."""
    needle = f"{MARKER_VAR}={marker}".encode()
    n = 0
    for pid in _proc_pids():
        if pid == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        if any(item.startswith(needle) for item in env.split(b"\0")):
            _kill(pid)
            n += 1
    return n


def reap_orphans() -> int:
    """Kill and reap the processes handed to this (subreaper) process that it did not start."""
    me, n = os.getpid(), 0
    with _lock:                 # no runner is being started meanwhile (it is ours before it is known)
        orphans = [pid for pid in _proc_pids() if pid not in _children and (_stat(pid) or (0,))[0] == me]
    for pid in orphans:
        _kill(pid)
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass
        n += 1
    return n


def _session_rss(sid: int) -> int:
    total = 0
    for pid in _proc_pids():
        st = _stat(pid)
        if st and st[2] == sid:
            try:
                with open(f"/proc/{pid}/status") as f:
                    total += next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:")), 0)
            except OSError:
                pass
    return total


def run_job(job: dict, program: str, time_limit: float, memory_bytes: int, device: str,
            marker_prefix: str) -> RunResult:
    """Run ``runner.py`` on ``job`` (see runner.py for its fields), contained as described above."""
    result = RunResult()
    nonce = secrets.token_hex(16)
    marker = f"{marker_prefix}-{secrets.token_hex(6)}"
    workdir = tempfile.mkdtemp(prefix="lab-grade-")
    filename = os.path.join(workdir, "submission.py")
    with open(filename, "w", encoding="utf-8") as f:
        f.write(program)
    read_answers, write_answers = os.pipe()
    job = dict(job, nonce=nonce, result_fd=write_answers, site_dirs=site_dirs(), filename=filename,
               program=program, device=device, file_bytes=FILE_LIMIT,
               memory_bytes=memory_bytes if device == "cpu" else None)
    result.time_allowed = time_limit + (GPU_ALLOWANCE if device != "cpu" else 0.0)
    start = time.monotonic()
    try:
        with _lock:
            child = subprocess.Popen([sys.executable, "-I", "-S", str(RUNNER)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=workdir,
                                     env=child_env(marker, workdir, device), pass_fds=(write_answers,),
                                     start_new_session=True)
            _children.add(child.pid)
    except OSError as e:
        os.close(read_answers)
        os.close(write_answers)
        shutil.rmtree(workdir, ignore_errors=True)
        result.output_tail = f"could not start the grader's child: {e}"
        return result
    os.close(write_answers)
    threading.Thread(target=_feed, args=(child.stdin, json.dumps(job).encode()), daemon=True).start()
    answers, tail = bytearray(), deque()
    tail_bytes = 0
    sel = selectors.DefaultSelector()
    sel.register(read_answers, selectors.EVENT_READ, "answers")
    sel.register(child.stdout, selectors.EVENT_READ, "output")
    deadline, next_rss, base_rss, drain_until = start + result.time_allowed, start + 0.5, None, None
    try:
        while True:
            now = time.monotonic()
            if drain_until is None and child.poll() is not None:
                drain_until = now + 0.2      # what it wrote before exiting; a grandchild may hold the pipes
            if drain_until is not None and now >= drain_until:
                break
            if now >= deadline:
                result.timed_out = True
                break
            exited = drain_until is not None
            events = sel.select(timeout=0.02 if exited else min(0.1, deadline - now))
            for key, _ in events:
                fd = key.fileobj if isinstance(key.fileobj, int) else key.fileobj.fileno()
                data = os.read(fd, 1 << 16)
                if not data:
                    sel.unregister(key.fileobj)
                elif key.data == "answers":
                    if len(answers) + len(data) > ANSWER_LIMIT:
                        result.answers_too_long = True
                    else:
                        answers += data
                else:
                    result.output_bytes += len(data)
                    tail.append(data)
                    tail_bytes += len(data)
                    while tail_bytes - len(tail[0]) >= OUTPUT_TAIL:
                        tail_bytes -= len(tail.popleft())
            if result.answers_too_long or (exited and not events) or not sel.get_map():
                break
            if base_rss is None and b'"ready"' in answers:
                base_rss = _first_rss(answers, nonce)
            if device != "cpu" and now >= next_rss:     # no RLIMIT_AS with CUDA: watch the session
                next_rss = now + 0.5
                if _session_rss(child.pid) > (base_rss or 0) + memory_bytes + CUDA_HEADROOM:
                    result.over_memory = True
                    break
    finally:
        sel.close()
        try:
            os.killpg(child.pid, signal.SIGKILL)       # the runner and whatever it left in its group
        except (ProcessLookupError, PermissionError):
            pass
        kill_marked(marker)
        child.wait()
        with _lock:
            _children.discard(child.pid)
        os.close(read_answers)
        child.stdout.close()
        result.returncode = child.returncode
        result.seconds = time.monotonic() - start
        shutil.rmtree(workdir, ignore_errors=True)
    result.output_tail = b"".join(tail)[-OUTPUT_TAIL:].decode(errors="replace")
    for line in bytes(answers).split(b"\n"):
        if not line.strip():
            continue
        try:
            message = json.loads(line)
        except (ValueError, RecursionError):
            result.malformed += 1
            continue
        if isinstance(message, dict) and message.get("nonce") == nonce:
            result.messages.append(message)
        else:
            result.malformed += 1
    return result


def _first_rss(answers: bytearray, nonce: str) -> int | None:
    try:
        first = json.loads(bytes(answers).split(b"\n", 1)[0])
        return int(first["rss"]) if first.get("nonce") == nonce and first.get("event") == "ready" else None
    except (ValueError, KeyError, TypeError):
        return None


def _feed(pipe, data: bytes) -> None:
    try:
        pipe.write(data)
        pipe.close()
    except (BrokenPipeError, OSError, ValueError):
        pass
