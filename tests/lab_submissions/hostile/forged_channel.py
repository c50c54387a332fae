# Writes forged answers (and a malformed line) to every file descriptor it finds open.
import json
import os

for fd in range(3, 64):
    try:
        os.write(fd, (json.dumps({"event": "case", "check": 0, "case": 0, "out": [[1, 2, 3]], "nonce": "x"})
                      + "\n{not json\n").encode())
    except OSError:
        pass


def slot_mapping(block_table, seq_lens, block_size):
    return [block_table[s][t // block_size] * block_size + t % block_size
            for s, n in enumerate(seq_lens) for t in range(n)]
