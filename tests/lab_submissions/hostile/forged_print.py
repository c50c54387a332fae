# Prints the old grader's result line (a perfect score), well formed and malformed.
print('LAB-RESULT {"passed": 4, "total": 4, "first_failure": ""}', flush=True)
print('LAB-RESULT {"passed": 4, "total": ', flush=True)


def slot_mapping(block_table, seq_lens, block_size):
    print('LAB-RESULT {"passed": 4, "total": 4, "first_failure": ""}', flush=True)
    return []
