"""``BlockTables.append_block_ids_batch``: one call for many requests' new block ids, equal to
``append_block_ids`` called once per request, in order, except that a batch with a bad entry
changes nothing at all (the entries before it included) and raises that entry's error.

Staging is shared by both kernel sets (``FastBlockTables`` inherits it); the tables are applied
and read back so that the kernels see what was staged.
"""
import random

import numpy as np
import pytest

from paged_attention import runtime
from paged_attention.v2 import make_block_tables

DEV = runtime.DEVICE
BLOCK_SIZES = [16, 32]
MAX_REQS, MAX_LEN = 12, 200          # widths: cdiv(200, 16) = 13, cdiv(200, 32) = 7


def make(impl="triton"):
    return make_block_tables(BLOCK_SIZES, MAX_REQS, 16, MAX_LEN, DEV, impl=impl)


def state(bt):
    """Everything staging changes: the counts, and every group's staged writes and ranges."""
    return (bt.num_blocks.np.tolist(), [t.staged_writes() for t in bt.block_tables],
            [{r: list(v) for r, v in t._staged_ranges.items()} for t in bt.block_tables])


def one_by_one(bt, rows, ids, overwrite):
    for r, i in zip(rows, ids):
        bt.append_block_ids(r, i, overwrite)


def fill(bt, rng):
    """Give every row a few blocks, applied, and stage a write in some rows."""
    for r in range(MAX_REQS):
        bt.append_block_ids(r, ([rng.randrange(100) for _ in range(rng.randrange(5))],
                                [rng.randrange(100) for _ in range(rng.randrange(3))]), overwrite=True)
    bt.apply_staged_writes()


def random_batch(rng, overwrite):
    """A batch the one-by-one path accepts: plain lists mostly (the fast check), and now and
    then what only the entry-by-entry path takes (a row twice, numpy ids, numpy row numbers)."""
    rows = rng.sample(range(MAX_REQS), rng.randrange(0, MAX_REQS + 1))
    if not overwrite and rows and rng.random() < 0.2:
        rows.append(rows[0])                                  # a row twice: the second goes after
    limit = 5 if overwrite else 1
    ids = [tuple([rng.randrange(1000) for _ in range(rng.randrange(limit + 1))] for _ in BLOCK_SIZES)
           for _ in rows]
    if ids and rng.random() < 0.2:
        ids[-1] = (np.array(ids[-1][0], dtype=np.int64), tuple(ids[-1][1]))
    if rng.random() < 0.3:
        rows = np.array(rows, dtype=rng.choice([np.int32, np.int64]))
    return rows, ids


@pytest.mark.parametrize("seed", range(6))
def test_a_batch_stages_what_one_call_per_request_stages(seed):
    rng = random.Random(seed)
    batched, single = make(), make()
    fill(batched, random.Random(seed)), fill(single, random.Random(seed))
    for step in range(12):
        overwrite = rng.random() < 0.3
        rows, ids = random_batch(rng, overwrite)
        for bt in (batched, single):     # (a row's writes may overlap those staged earlier)
            bt.apply_staged_writes()
        if not overwrite and rng.random() < 0.3 and len(rows):               # a row with a write staged already
            for bt in (batched, single):
                bt.append_block_ids(int(rows[0]), ([], [7]), overwrite=False)
        before = state(single)
        try:
            one_by_one(single, rows, ids, overwrite)
        except ValueError as e:         # a row filled up: the batch raises that, changing nothing
            with pytest.raises(ValueError) as got:
                batched.append_block_ids_batch(rows, ids, overwrite)
            assert str(got.value) == str(e) and state(batched) == before
            single.num_blocks.np[...] = before[0]           # (one by one, the rows before stay)
            for t, writes in zip(single.block_tables, before[1]):
                t.clear_staged_writes()
                for w in writes:
                    t._stage(w[0], w[1], list(w[2]))
            assert state(single) == before
        else:
            batched.append_block_ids_batch(rows, ids, overwrite)
        assert state(batched) == state(single)
        if step % 3 == 2:
            for bt in (batched, single):
                bt.apply_staged_writes()
            assert all(np.array_equal(a.gpu.cpu(), b.gpu.cpu()) for a, b in zip(batched.block_tables,
                                                                                single.block_tables))


def test_the_runners_boundary_batch_takes_the_fast_check():
    # One new block for every row, plain lists, no row staged: staged as a whole, and
    # append_block_ids is never called.
    bt = make()
    fill(bt, random.Random(0))
    calls = []
    bt.append_block_ids = lambda *a: calls.append(a)
    counts = bt.num_blocks.np.copy()
    bt.append_block_ids_batch(np.arange(MAX_REQS, dtype=np.int32), [([50 + r], []) for r in range(MAX_REQS)],
                              overwrite=False)
    assert calls == [] and (bt.num_blocks.np[0] == counts[0] + 1).all()
    assert [w[0] for w in bt.block_tables[0].staged_writes()] == list(range(MAX_REQS))


BAD_ENTRIES = [
    (MAX_REQS, ([1], [1])),                 # no such request state
    (-1, ([1], [1])),
    (True, ([1], [1])),
    (0.0, ([1], [1])),
    (0, ([1],)),                            # one list for two groups
    (0, [[1], [1]]),                        # a list, not a tuple, of groups: fine one by one
    (0, ([1], [-2])),
    (0, ([1], [2 ** 31])),
    (0, ([1], ["x"])),
    (0, ([1, True], [2])),
    (0, ([1, 2.0], [2])),
    (0, ([1], list(range(8)))),             # past group 1's 7 columns
    (0, (list(range(14)), [1])),            # past group 0's 13 columns
]


@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize("bad", range(len(BAD_ENTRIES)))
def test_a_bad_entry_anywhere_raises_its_error_and_changes_no_row(bad, overwrite):
    rng = random.Random(bad)
    for at in (0, 3, 7):
        batched, single = make(), make()
        fill(batched, random.Random(bad)), fill(single, random.Random(bad))
        for bt in (batched, single):
            bt.append_block_ids(9, ([5], []), overwrite=False)        # staged earlier: must stay
        rows = [r for r in range(8) if r != 0] + [10]
        ids = [([rng.randrange(100)], [rng.randrange(100)]) for _ in rows]
        rows.insert(at, BAD_ENTRIES[bad][0])
        ids.insert(at, BAD_ENTRIES[bad][1])
        try:
            one_by_one(single, rows, ids, overwrite)
        except Exception as e:              # the error one call per request raises
            expected = e
        else:                               # ([1], [1]) lists of groups are fine one by one
            batched.append_block_ids_batch(rows, ids, overwrite)
            assert state(batched) == state(single)
            continue
        before = state(batched)
        with pytest.raises(type(expected)) as got:
            batched.append_block_ids_batch(rows, ids, overwrite)
        assert str(got.value) == str(expected)
        assert state(batched) == before
        batched.apply_staged_writes()                                  # the earlier write still lands
        assert batched.num_blocks.np[0, 9] == single.num_blocks.np[0, 9]


def test_the_first_of_two_bad_entries_is_the_one_reported():
    bt = make()
    rows = [0, 1, MAX_REQS, 2, 3]
    ids = [([1], [1]), ([1], [-1]), ([1], [1]), ([1], [1]), ([1], [1])]
    before = state(bt)
    with pytest.raises(ValueError, match="between 0"):
        bt.append_block_ids_batch(rows, ids, False)
    assert state(bt) == before


def test_an_overlap_inside_a_batch_is_refused_as_one_by_one():
    # Row 2 twice, the second time from column 0 again: staged writes are unordered, so the
    # second overlaps the first, as it would one call at a time, and neither is staged.
    bt = make()
    before = state(bt)
    with pytest.raises(ValueError, match="overlap"):
        bt.append_block_ids_batch([1, 2, 2], [([1], []), ([2], []), ([3], [])], True)
    assert state(bt) == before


def test_too_many_staged_writes_in_a_batch_is_refused_before_any():
    bt = make()
    bt.append_block_ids_batch(list(range(MAX_REQS)), [([r], []) for r in range(MAX_REQS)], True)
    bt.apply_staged_writes()
    rows = list(range(MAX_REQS)) + [0]            # 13 writes to group 0: one more than it holds
    before = state(bt)
    with pytest.raises(ValueError, match="staged writes already"):
        bt.append_block_ids_batch(rows, [([50], []) for _ in rows], False)
    assert state(bt) == before


@pytest.mark.parametrize("call,error,match", [
    (lambda bt: bt.append_block_ids_batch(3, [([1], [1])], True), TypeError, "req_indices"),
    (lambda bt: bt.append_block_ids_batch("01", [([1], [1])] * 2, True), TypeError, "req_indices"),
    (lambda bt: bt.append_block_ids_batch([0], ([1], [1]), True), ValueError, "entries"),
    (lambda bt: bt.append_block_ids_batch([0], {0: ([1], [1])}, True), TypeError, "new_block_ids"),
    (lambda bt: bt.append_block_ids_batch([0, 1], [([1], [1])], True), ValueError, "entries"),
    (lambda bt: bt.append_block_ids_batch([0], [([1], [1])], 1), TypeError, "bool"),
])
def test_a_malformed_batch_is_refused_whole(call, error, match):
    bt = make()
    before = state(bt)
    with pytest.raises(error, match=match):
        call(bt)
    assert state(bt) == before
