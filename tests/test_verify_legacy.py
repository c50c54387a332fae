"""verify.PagedCacheCheck: legacy block tables drive real cache writes, copies and paged attention.

It must pass when the tables, the writes and the copies are right, and fail with an
AssertionError when a table is wrong or a copy-on-write is not applied.
"""
import pytest
import torch

from paged_attention import runtime, verify
from paged_attention.kernels import KernelUnavailable
from paged_attention.kernels import triton as tk
from paged_attention.legacy.block_table import BlockTable
from paged_attention.legacy.cpu_gpu_block_allocator import CpuGpuBlockAllocator
from paged_attention.utils import Device

from conftest import PLANTED, planted

BS = 8


def two_sequences(kind="naive", num_blocks=16):
    allocator = CpuGpuBlockAllocator.create(kind, num_blocks, 0, BS)
    tokens = {"A": list(range(100, 119)), "B": list(range(200, 219))}     # the same length: 19
    tables = {name: BlockTable(BS, allocator) for name in tokens}
    for name, table in tables.items():
        table.allocate(tokens[name])
    return allocator, tables, tokens


def written(num_blocks=16, **kw):
    allocator, tables, tokens = two_sequences(num_blocks=num_blocks)
    kv = verify.PagedCacheCheck(num_blocks, BS, **kw)
    for name, table in tables.items():
        kv.write(name, table, tokens[name])
    return allocator, tables, tokens, kv


def test_token_kv_depends_on_the_prefix():
    k1, v1 = verify.token_kv([5, 6, 7, 8], 2, 16)
    k2, v2 = verify.token_kv([5, 6, 9, 8], 2, 16)
    assert k1.shape == (4, 2, 16) and v1.dtype == torch.float32
    assert torch.equal(k1[:2], k2[:2]) and torch.equal(v1[:2], v2[:2])
    assert not torch.equal(k1[2], k2[2]) and not torch.equal(k1[3], k2[3])   # the same token 8 after a different prefix
    assert torch.equal(verify.token_kv([5, 6, 7, 8], 2, 16)[0], k1)
    assert not torch.equal(verify.token_kv([5, 6, 7, 8], 2, 16, seed=1)[0], k1)


def test_correct_tables_pass_on_every_implementation_here():
    _, tables, _, kv = written()
    v = kv.check(tables)
    assert [name for name, _, _ in v.rows] == ["reference v1", "Triton", "CUDA v1 (ours)", "CUDA v2 (ours)"]
    assert "Triton" in v.verified
    if runtime.HAS_CUDA:
        assert {"CUDA v1 (ours)", "CUDA v2 (ours)"} <= set(v.verified)
    else:
        assert v.verified == ["reference v1", "Triton"]
        assert "GPU" in dict((n, d) for n, _, d in v.rows)["CUDA v1 (ours)"]
    assert "cache identical to the reference's" in dict((n, d) for n, _, d in v.rows)["Triton"]
    assert "A, B" in str(v)


def test_swapped_tables_fail():
    _, tables, _, kv = written()
    with pytest.raises(AssertionError, match="reference"):
        kv.check({"A": tables["B"], "B": tables["A"]})


def test_one_swapped_block_id_fails():
    _, tables, _, kv = written()
    ids_a, ids_b = tables["A"]._blocks._block_ids, tables["B"]._blocks._block_ids   # corrupt the id lists only
    ids_a[1], ids_b[1] = ids_b[1], ids_a[1]
    with pytest.raises(AssertionError, match="sequence 'A'"):
        kv.check(tables)


def fork_and_append(kv, allocator, tables, tokens, apply_copies=True):
    tables["C"] = tables["A"].fork()
    kv.fork("A", "C")
    tokens["C"] = tokens["A"] + [7]
    tables["C"].append_token_ids([7])               # writes into the shared last block: copy on write
    pairs = allocator.clear_copy_on_writes()
    assert pairs == [(tables["A"].physical_block_ids[-1], tables["C"].physical_block_ids[-1])]
    if apply_copies:
        kv.copy_blocks(pairs)
    kv.write("C", tables["C"], tokens["C"])
    tokens["A"] = tokens["A"] + [8]
    tables["A"].append_token_ids([8])               # A's block is its own again: no copy
    assert allocator.clear_copy_on_writes() == []
    kv.write("A", tables["A"], tokens["A"])


def test_fork_and_copy_on_write_pass_when_the_copies_are_applied():
    allocator, tables, tokens, kv = written()
    fork_and_append(kv, allocator, tables, tokens)
    v = kv.check(tables)
    assert "Triton" in v.verified


def test_a_missed_copy_on_write_fails():
    allocator, tables, tokens, kv = written()
    fork_and_append(kv, allocator, tables, tokens, apply_copies=False)
    with pytest.raises(AssertionError, match="sequence 'C'"):
        kv.check(tables)


def test_prefix_cache_hits_are_not_written_again():
    allocator = CpuGpuBlockAllocator.create("prefix_caching", 16, 0, BS)
    shared = list(range(2 * BS))
    tokens = {"A": shared + [1, 2, 3], "B": shared + [9] * 11}
    tables = {name: BlockTable(BS, allocator) for name in tokens}
    kv = verify.PagedCacheCheck(16, BS)
    tables["A"].allocate(tokens["A"])
    kv.write("A", tables["A"], tokens["A"])
    tables["B"].allocate(tokens["B"])
    assert tables["B"].physical_block_ids[:2] == tables["A"].physical_block_ids[:2]
    kv.write("B", tables["B"], tokens["B"], start=2 * BS)    # B's first two blocks are A's, already written
    assert "Triton" in kv.check(tables).verified

    # Had nobody written the shared blocks, B would read garbage there.
    lone = verify.PagedCacheCheck(16, BS)
    lone.write("B", tables["B"], tokens["B"], start=2 * BS)
    with pytest.raises(AssertionError, match="sequence 'B'"):
        lone.check({"B": tables["B"]})


def test_a_wrong_triton_write_is_caught(monkeypatch):
    write = tk.reshape_and_cache_flash

    def shifted(key, value, key_cache, value_cache, slot_mapping, *rest):
        write(key, value, key_cache, value_cache, (slot_mapping + 1) % (key_cache.size(0) * key_cache.size(1)), *rest)
    monkeypatch.setattr(tk, "reshape_and_cache_flash", shifted)
    _, tables, _, kv = written()
    with pytest.raises(AssertionError, match="Triton"):
        kv.check(tables)


def test_verify_block_tables_one_call():
    _, tables, tokens = two_sequences()
    v = verify.verify_block_tables(tables, tokens, 16, BS, head_size=64, dtype=torch.float16)
    assert "Triton" in v.verified and "float16" in str(v)
    with pytest.raises(ValueError, match="same names"):
        verify.verify_block_tables(tables, {"A": tokens["A"]}, 16, BS)


def test_bad_input():
    allocator, tables, tokens = two_sequences()
    kv = verify.PagedCacheCheck(16, BS)
    with pytest.raises(ValueError, match="holds 19 tokens"):
        kv.write("A", tables["A"], tokens["A"][:-1])
    with pytest.raises(TypeError, match="BlockTable"):
        kv.write("A", [0, 1, 2], tokens["A"])
    with pytest.raises(ValueError, match="start"):
        kv.write("A", tables["A"], tokens["A"], start=40)
    with pytest.raises(ValueError, match="been written"):
        kv.check(tables)
    with pytest.raises(KeyError):
        kv.fork("nobody", "C")
    with pytest.raises(ValueError, match="pair"):
        kv.copy_blocks([(0, 16)])
    with pytest.raises(TypeError):
        kv.check([tables["A"]])
    with pytest.raises(ValueError, match="outside"):
        verify.PagedCacheCheck(2, BS).write("B", tables["B"], tokens["B"])
    with pytest.raises(ValueError, match="head_size"):
        verify.PagedCacheCheck(16, BS, head_size=30)
    with pytest.raises(ValueError, match="num_heads"):
        verify.PagedCacheCheck(16, BS, num_heads=3, num_kv_heads=2)
    kv.write("A", tables["A"], tokens["A"])
    with pytest.raises(ValueError, match="differ from those written"):
        kv.write("A", tables["A"], list(range(19)))

    window = CpuGpuBlockAllocator.create("naive", 16, 0, BS)
    w = BlockTable(BS, window, max_block_sliding_window=1)
    w.allocate(list(range(20)))
    w.append_token_ids([20], num_computed_slots=20)
    assert window.get_num_free_blocks(Device.GPU) < 16
    kv_w = verify.PagedCacheCheck(16, BS)
    kv_w.write("w", w, list(range(21)), start=20)
    with pytest.raises(ValueError, match="sliding-window"):
        kv_w.check({"w": w})


# ---- swapping through the block manager -------------------------------------------------------

def swapped_round_trip(corrupt=None, fill_freed=False):
    """Two groups decode; group A goes to the CPU and comes back to other GPU blocks."""
    from paged_attention.legacy.block_manager import SelfAttnBlockSpaceManager
    from paged_attention.legacy.sequence import Sequence, SequenceGroup, SequenceStatus
    mgr = SelfAttnBlockSpaceManager(BS, 12, 8, watermark=0)
    kv = verify.PagedCacheCheck(12, BS, num_cpu_blocks=8)
    seqs = {"A": Sequence(1, list(range(100, 119)), BS), "B": Sequence(2, list(range(200, 211)), BS)}
    groups = {name: SequenceGroup(name, [seq]) for name, seq in seqs.items()}
    for name, seq in seqs.items():
        mgr.allocate(groups[name])
        seq.status = SequenceStatus.RUNNING
        kv.write(name, mgr.block_tables[seq.seq_id], seq.get_token_ids())
    gpu_ids = mgr.get_block_table(seqs["A"])
    out_pairs = mgr.swap_out(groups["A"])
    seqs["A"].status = SequenceStatus.SWAPPED
    assert [g for g, _ in out_pairs] == gpu_ids
    assert kv.swap_out(out_pairs) == len(gpu_ids)
    if fill_freed:     # B grows into A's old blocks, overwriting them in every cache
        for t in range(20):
            seqs["B"].append_token_id(300 + t)
        mgr.append_slots(seqs["B"], 0)
        kv.write("B", mgr.block_tables[2], seqs["B"].get_token_ids())
        assert set(gpu_ids) & set(mgr.get_block_table(seqs["B"]))
    if corrupt is not None:
        corrupt(kv, out_pairs)
    in_pairs = mgr.swap_in(groups["A"])
    seqs["A"].status = SequenceStatus.RUNNING
    checked = kv.swap_in(in_pairs)
    return mgr, kv, seqs, in_pairs, checked


def test_swapped_blocks_come_back_bit_identical_and_attention_still_matches():
    mgr, kv, seqs, in_pairs, checked = swapped_round_trip(fill_freed=True)
    assert checked == 3 and len(in_pairs) == 3
    tables = {name: mgr.block_tables[seq.seq_id] for name, seq in seqs.items()}
    assert set(mgr.get_block_table(seqs["A"])) == {g for _, g in in_pairs}
    v = kv.check(tables)
    assert "Triton" in v.verified


def test_a_block_changed_on_the_cpu_is_caught():
    def scribble(kv, out_pairs):
        for copy in kv._copies:
            copy.cpu_key_cache[out_pairs[1][1]] += 1      # the second block's CPU copy, in every implementation
    with pytest.raises(AssertionError, match="came back"):
        swapped_round_trip(corrupt=scribble)


def test_a_swap_that_was_not_applied_is_caught():
    mgr, kv, seqs, in_pairs, _ = swapped_round_trip()
    kv2 = verify.PagedCacheCheck(12, BS, num_cpu_blocks=8)       # a cache that never saw the swap out
    with pytest.raises(ValueError, match="not swapped out"):
        kv2.swap_in(in_pairs)


def test_swap_bad_input_and_forget():
    kv = verify.PagedCacheCheck(12, BS, num_cpu_blocks=4)
    with pytest.raises(ValueError, match="CPU block id in \\[0, 4\\)"):
        kv.swap_out([(0, 4)])
    with pytest.raises(ValueError, match="GPU block id in \\[0, 12\\)"):
        kv.swap_out([(12, 0)])
    with pytest.raises(ValueError, match="pair"):
        kv.swap_in([(0, 1, 2)])
    with pytest.raises(ValueError, match="num_cpu_blocks"):
        verify.PagedCacheCheck(12, BS, num_cpu_blocks=-1)
    assert kv.swap_out([]) == 0 and kv.swap_in([]) == 0
    with pytest.raises(KeyError):
        kv.forget("A")
    _, tables, tokens = two_sequences()
    kv.write("A", tables["A"], tokens["A"])
    kv.forget("A")
    with pytest.raises(ValueError, match="been written"):
        kv.check({"A": tables["A"]})


def test_two_groups_sharing_a_cached_cpu_block_both_come_back():
    from paged_attention.legacy.block_manager import SelfAttnBlockSpaceManager
    from paged_attention.legacy.sequence import Sequence, SequenceGroup, SequenceStatus
    mgr = SelfAttnBlockSpaceManager(BS, 8, 8, watermark=0, enable_caching=True)
    kv = verify.PagedCacheCheck(8, BS, num_cpu_blocks=8)
    system = list(range(100, 100 + 2 * BS))
    groups = [SequenceGroup(name, [Sequence(i, system + [i], BS)]) for i, name in enumerate("XY")]
    for g in groups:
        (s,) = g.get_seqs()
        mgr.allocate(g)
        kv.write(g.request_id, mgr.block_tables[s.seq_id], s.get_token_ids(), start=mgr.get_num_cached_tokens(s))
        mgr.mark_blocks_as_computed(g, 0)
        s.status = SequenceStatus.RUNNING
    outs = []
    for g in groups:
        outs.append(mgr.swap_out(g))
        kv.swap_out(outs[-1])
        g.seqs[0].status = SequenceStatus.SWAPPED
    assert outs[0][:2] == outs[1][:2]                    # the system prompt went to the same CPU blocks
    for g in groups:
        assert kv.swap_in(mgr.swap_in(g)) == 3
        g.seqs[0].status = SequenceStatus.RUNNING
    assert "Triton" in kv.check({g.request_id: mgr.block_tables[g.seqs[0].seq_id] for g in groups}).verified


# ---- only KernelUnavailable is a skip: anything else an implementation raises is a failure ----

@pytest.mark.parametrize("kernel", ["paged_attention_decode", "reshape_and_cache_flash"])
def test_an_error_on_good_input_fails_the_check(monkeypatch, kernel):
    # Planted in the decode, the error comes from check itself; in the cache write, from an
    # earlier write(), and check reports it then.
    monkeypatch.setattr(tk, kernel, planted(ValueError))
    _, tables, _, kv = written()
    with pytest.raises(verify.VerificationFailed) as caught:
        kv.check(tables)
    v = caught.value.verification
    assert v.failed == ["Triton"] and "Triton" not in v.verified
    assert dict((n, d) for n, _, d in v.rows)["Triton"].endswith(f"ValueError: {PLANTED}")


def test_a_wrong_decode_fails_the_check(monkeypatch):
    monkeypatch.setattr(tk, "paged_attention_decode", lambda out, *a, **kw: out.zero_())
    _, tables, _, kv = written()
    with pytest.raises(verify.VerificationFailed) as caught:
        kv.check(tables)
    assert caught.value.verification.failed == ["Triton"]


@pytest.mark.parametrize("kernel", ["paged_attention_decode", "reshape_and_cache_flash"])
def test_kernel_unavailable_skips_with_its_whole_message(monkeypatch, kernel):
    monkeypatch.setattr(tk, kernel, planted(KernelUnavailable))
    _, tables, _, kv = written()
    v = kv.check(tables)
    assert "Triton" in v.skipped and not v.failed
    assert dict((n, d) for n, _, d in v.rows)["Triton"] == PLANTED


# --- check_scheduled_run: a whole scheduler run with real keys and values ------------------------

def _scheduled(seed=25):
    from paged_attention.legacy.block_manager import SelfAttnBlockSpaceManager
    from paged_attention.legacy.workload import SimulatedEngine, synthetic_workload
    work = synthetic_workload(4, seed=seed, n=(1, 2, 3), arrival_every=1.0, mean_prompt_len=12, mean_output_len=12,
                              max_len=32)
    mgr = SelfAttnBlockSpaceManager(8, num_gpu_blocks=8, num_cpu_blocks=8, watermark=0.1)
    return mgr, SimulatedEngine(mgr, work), verify.PagedCacheCheck(8, 8, num_cpu_blocks=8, head_size=32)


def test_a_scheduled_run_with_swaps_and_copies_passes_and_frees_everything():
    mgr, engine, kv = _scheduled()
    run = verify.check_scheduled_run(engine, kv)
    assert run.steps == len(engine.history) and len(run.checks) > 0
    assert run.blocks_swapped_in == sum(len(r.blocks_to_swap_in) for r in engine.history) > 0
    assert run.copies == sum(len(r.blocks_to_copy) for r in engine.history) > 0
    assert all("Triton" in c.verified for c in run.checks)
    assert mgr.get_num_free_gpu_blocks() == 8 and mgr.get_num_free_cpu_blocks() == 8


@pytest.mark.parametrize("dropped", ["blocks_to_copy", "blocks_to_swap_out"])
def test_a_scheduled_run_that_drops_a_block_move_fails(dropped):
    """An engine that forgets one kind of block move (a planted bug) is stopped: a missed copy by the
    attention check, a missed swap-out when its blocks are asked back (swap_in refuses them)."""
    _, engine, kv = _scheduled()
    schedule = engine.schedule

    def lossy():
        record = schedule()
        getattr(record, dropped).clear()
        return record
    engine.schedule = lossy
    with pytest.raises(AssertionError if dropped == "blocks_to_copy" else ValueError):
        verify.check_scheduled_run(engine, kv)
