"""Decode context parallelism across real ranks: gloo on CPU processes, nccl where GPUs are.

Every DCP case must give, on every rank, attention over the whole context (the float64 oracle
over each sequence's keys and values as made). Two planted bugs must fail the same check: a
rank that attends over another rank's share, and a merge that averages the ranks' outputs
without rescaling them by their log-sum-exps. Spawning processes costs seconds, so the cases of
one world size run in one group (``_rank_cases``), started once per module.
"""
import pytest
import torch

from paged_attention import runtime
from paged_attention.distributed import (
    DcpDecodePlan, DcpDecodeProblem, PartialsExchange, all_gather_partials, dcp_decode_attention,
    get_dcp_local_seq_lens, merge_rank_partials, partial_decode_attention, run_dcp_rank, spawn,
    write_rank_cache,
)
from paged_attention.distributed.dcp import _local_bound
from paged_attention.kernels import reference as ref
from paged_attention.kernels.workloads import make_decode_problem
from paged_attention.v1.reference import dcp_owner_rank

# Ragged: 1 token (some ranks hold none), shorter than a round of dealing, exact multiples of a
# block column, one past, and longer ones.
LENS = (1, 3, 16, 17, 45, 64)
TRITON_CPU = not runtime.HAS_CUDA      # the interpreter runs Triton on CPU tensors


def _problem(interleave, lens=LENS, **kw):
    return DcpDecodeProblem(lens, num_heads=4, num_kv_heads=2, head_size=16, block_size=8,
                            interleave=interleave, **kw)


def _planted(rank, world, problem, impl, bug):
    """The library's three moves with one of them wrong."""
    cache = write_rank_cache(problem, world, rank, "cpu", impl)
    seq_lens = torch.tensor(problem.seq_lens)
    # "wrong share": the token counts of the next rank, so this rank reads a share of the wrong
    # length (too many tokens: slots that hold another sequence's or no one's numbers).
    share_rank = (rank + 1) % world if bug == "wrong share" else rank
    local = get_dcp_local_seq_lens(seq_lens, world, share_rank, problem.interleave)
    kv = (problem.query(), cache.key_cache, cache.value_cache, cache.block_tables)
    out, lse = partial_decode_attention(*kv, local, problem.scale, impl=impl)
    outs, lses = all_gather_partials(out, lse)
    if bug == "no rescale":
        return outs.mean(dim=0)         # every rank weighs the same, whatever its share's scores
    return merge_rank_partials(outs, lses)[0]


def _other_query(problem):
    """A second step's query for the same caches: the same on every rank."""
    gen = torch.Generator().manual_seed(99)
    return torch.randn(problem.query().shape, generator=gen).to(problem.dtype)


def _plan_runs(rank, world, problem, impl):
    """A ``DcpDecodePlan`` kept and run for two steps' queries (the unchecked path, as a model
    runs it), its partial alone, and the arguments it and ``dcp_decode_attention`` refuse."""
    cache = write_rank_cache(problem, world, rank, "cpu", impl)
    seq_lens = torch.tensor(problem.seq_lens, dtype=torch.int32)
    local = get_dcp_local_seq_lens(seq_lens, world, rank, problem.interleave)
    kv = (cache.key_cache, cache.value_cache, cache.block_tables)
    query = problem.query()
    out_dtype, lse_dtype = (query.dtype, torch.float32) if impl == "triton" else (torch.float64,) * 2
    out = torch.empty(query.shape, dtype=out_dtype)
    lse = torch.empty(query.shape[:2], dtype=lse_dtype)
    bound = _local_bound(max(problem.seq_lens), world, problem.interleave)
    plan = DcpDecodePlan(query, *kv, local, problem.scale, out=out, lse=lse, impl=impl,
                         max_seq_len=bound, check_ids=False)
    runs = []
    for q in (query, _other_query(problem)):
        plan.run(out, q, *kv, local, lse)
        runs.append((out.clone(), lse.clone()))
    partial = tuple(x.clone() for x in plan.run_partial(query, *kv, local))
    # the functional form with the counts given: the same numbers
    again = dcp_decode_attention(query, *kv, seq_lens, problem.scale, interleave=problem.interleave,
                                 impl=impl, local_seq_lens=local)
    refused = []
    for what, call in [
            ("other dtype", lambda: plan.run(out, query.double(), *kv, local, lse)),
            ("no lse", lambda: plan.run(out, query, *kv, local)),
            ("wrong counts", lambda: dcp_decode_attention(
                query, *kv, seq_lens, problem.scale, interleave=problem.interleave, impl=impl,
                local_seq_lens=local + 1)),
            ("bad impl", lambda: DcpDecodePlan(query, *kv, local, problem.scale, impl="cuda")),
            ("expanded out", lambda: DcpDecodePlan(query, *kv, local, problem.scale, impl=impl,
                                                   out=out[:1].expand(out.shape)))]:
        try:
            call()
        except (TypeError, ValueError) as e:
            refused.append((what, type(e).__name__))
    return dict(runs=runs, partial=partial, again=again, refused=refused)


def _rank_cases(rank, world, cases):
    """Run every case on this rank: ``{name: RankResult}`` for the library, ``{name: out}`` for a
    planted bug, a dict for a kept plan."""
    results = {}
    for name, problem, impl, bug in cases:
        if bug is None:
            results[name] = run_dcp_rank(rank, world, problem, impl)
        elif bug == "plan":
            results[name] = _plan_runs(rank, world, problem, impl)
        else:
            results[name] = _planted(rank, world, problem, impl, bug)
    return results


def _cases(world):
    cases = [(f"interleave {i}", _problem(i), "reference", None) for i in (1, 2, 8)]
    cases += [("wrong share", _problem(1), "reference", "wrong share"),
              ("wrong share, interleave 4", _problem(4), "reference", "wrong share"),
              ("no rescale", _problem(2), "reference", "no rescale")]
    if world == 2 and TRITON_CPU:
        fp16 = _problem(1, lens=(2, 33), dtype=torch.float16)
        cases += [("triton, interleave 4", _problem(4, lens=(1, 9, 40)), "triton", None),
                  ("triton fp16, interleave 1", fp16, "triton", None),
                  ("kept plan, triton", _problem(4, lens=(1, 9, 40)), "triton", "plan")]
    cases += [("kept plan, reference", _problem(2, lens=(1, 30)), "reference", "plan")]
    return cases


@pytest.fixture(scope="module", params=[2, 4], ids=["world 2", "world 4"])
def ranks(request):
    world = request.param
    cases = _cases(world)
    return world, {name: (problem, impl, bug) for name, problem, impl, bug in cases}, \
        spawn(_rank_cases, world, cases, backend="gloo")


def _error(out, oracle):
    return float((out.double() - oracle).abs().max())


def _tolerance(problem, impl):
    if impl == "reference":
        return 1e-12
    return 1e-5 if problem.dtype == torch.float32 else 2e-3


def test_every_rank_gets_whole_context_attention(ranks):
    world, cases, results = ranks
    checked = 0
    for name, (problem, impl, bug) in cases.items():
        if bug is not None:
            continue
        oracle, oracle_lse = problem.dense_reference()
        for rank in range(world):
            got = results[rank][name]
            assert got.rank == rank
            assert _error(got.out, oracle) < _tolerance(problem, impl), (name, rank)
            assert _error(got.lse, oracle_lse) < 1e-5, (name, rank)
            # the all-gather gave every rank the same partials, so the same merge
            assert torch.equal(got.out, results[0][name].out)
        checked += 1
    assert checked >= 3


def test_each_rank_holds_its_share_only(ranks):
    world, cases, results = ranks
    for name, (problem, impl, bug) in cases.items():
        if bug is not None:
            continue
        got = [results[r][name] for r in range(world)]
        B = problem.block_size
        for s, n in enumerate(problem.seq_lens):
            stored = torch.stack([torch.from_numpy(g.slots[s]) >= 0 for g in got])
            assert stored.sum(dim=0).tolist() == [1] * n              # every token on one rank
            owners = stored.int().argmax(dim=0).tolist()
            assert owners == [dcp_owner_rank(p, world, problem.interleave) for p in range(n)]
            assert [g.local_seq_lens[s] for g in got] == stored.sum(dim=1).tolist()
            # each rank's slots fill its blocks from the front, in position order
            for r, g in enumerate(got):
                slots = g.slots[s][stored[r].numpy()]
                ids = g.block_ids[s]
                assert slots.tolist() == [ids[i // B] * B + i % B for i in range(len(slots))]


def test_partials_are_the_ranks_own_attention(ranks):
    """A rank's partial is attention over exactly its tokens: the oracle over the positions it
    owns, and -inf (weight 0) where it owns none."""
    world, cases, results = ranks
    problem = cases["interleave 2"][0]
    query = problem.query()
    for rank in range(world):
        got = results[rank]["interleave 2"]
        for s, n in enumerate(problem.seq_lens):
            mine = [p for p in range(n) if dcp_owner_rank(p, world, problem.interleave) == rank]
            if not mine:
                assert torch.isneginf(got.partial_lse[s]).all() and not got.partial_out[s].any()
                continue
            k, v = (x[mine] for x in problem.sequence_kv(s))
            lens = torch.tensor([len(mine)])
            one_block = torch.zeros(1, 1, dtype=torch.int32)
            o, lse = ref.ref_decode_attention(query[s:s + 1], k[None], v[None], one_block, lens,
                                              problem.scale, return_lse=True)
            torch.testing.assert_close(got.partial_out[s], o[0], rtol=0, atol=1e-12)
            torch.testing.assert_close(got.partial_lse[s], lse[0], rtol=0, atol=1e-12)


def _oracle(problem, query):
    """Float64 ``(out, lse)`` of ``query`` over each whole sequence's keys and values as made."""
    outs, lses = [], []
    for s, n in enumerate(problem.seq_lens):
        k, v = problem.sequence_kv(s)
        o, lse = ref.ref_decode_attention(query[s:s + 1], k[None], v[None],
                                          torch.zeros(1, 1, dtype=torch.int32), torch.tensor([n]),
                                          problem.scale, return_lse=True)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def test_a_kept_plan_runs_step_after_step(ranks):
    """``DcpDecodePlan`` made once and run with two steps' queries (new contents, the same
    buffers): each run is the whole context's attention on every rank; its partial alone is the
    rank's share; the functional form gives the same numbers; bad arguments are refused."""
    world, cases, results = ranks
    names = [name for name, (_, _, bug) in cases.items() if bug == "plan"]
    assert names
    for name in names:
        problem, impl, _ = cases[name]
        tol = _tolerance(problem, impl)
        for rank in range(world):
            got = results[rank][name]
            for i, q in enumerate((problem.query(), _other_query(problem))):
                out, lse = got["runs"][i]
                oracle, oracle_lse = _oracle(problem, q)
                assert _error(out, oracle) < tol and _error(lse, oracle_lse) < 1e-5, (name, rank)
                assert torch.equal(out, results[0][name]["runs"][i][0])     # the same everywhere
            assert torch.equal(got["again"], got["runs"][0][0])
            local = get_dcp_local_seq_lens(torch.tensor(problem.seq_lens), world, rank,
                                           problem.interleave)
            out, lse = got["partial"]
            expected, expected_lse = partial_decode_attention(
                problem.query(), *_rank_cache_args(problem, world, rank), local, problem.scale,
                impl="reference")
            assert _error(out, expected) < tol
            assert torch.equal(torch.isneginf(lse), torch.isneginf(expected_lse))  # empty shares
            assert _error(lse.nan_to_num(neginf=0.0), expected_lse.nan_to_num(neginf=0.0)) < 1e-5
            assert got["refused"] == [("other dtype", "ValueError"), ("no lse", "ValueError"),
                                      ("wrong counts", "ValueError"), ("bad impl", "ValueError"),
                                      ("expanded out", "ValueError")]


def _rank_cache_args(problem, world, rank):
    cache = write_rank_cache(problem, world, rank, "cpu", "reference")
    return cache.key_cache, cache.value_cache, cache.block_tables


@pytest.mark.parametrize("bug", ["wrong share", "wrong share, interleave 4", "no rescale"])
def test_planted_bugs_fail_the_check(ranks, bug):
    world, cases, results = ranks
    problem, impl, _ = cases[bug]
    oracle, _ = problem.dense_reference()
    for rank in range(world):
        assert _error(results[rank][bug], oracle) > 1e-3, (bug, rank)


# ---- In one process: the pieces ------------------------------------------------------------

@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("interleave", [1, 2, 8])
def test_local_seq_lens_count_the_owned_positions(world, interleave):
    lens = torch.arange(0, 100)
    counts = [get_dcp_local_seq_lens(lens, world, r, interleave) for r in range(world)]
    assert torch.equal(sum(counts), lens)
    for r in range(world):
        owned = [sum(dcp_owner_rank(p, world, interleave) == r for p in range(n))
                 for n in lens.tolist()]
        assert counts[r].tolist() == owned
    # the bound a rank's kernel gets from a bound on the whole contexts: the largest count
    largest = torch.stack(counts).amax(dim=0)
    assert [_local_bound(n, world, interleave) for n in range(1, 100)] == largest[1:].tolist()


def test_local_seq_lens_refuse_bad_arguments():
    lens = torch.tensor([5])
    with pytest.raises(ValueError):
        get_dcp_local_seq_lens(lens, 2, 2)
    with pytest.raises(ValueError):
        get_dcp_local_seq_lens(lens, 0, 0)
    with pytest.raises(TypeError):
        get_dcp_local_seq_lens([5], 2, 0)
    with pytest.raises(TypeError):
        get_dcp_local_seq_lens(lens.float(), 2, 0)


def test_one_exchange_buffer_carries_output_and_lse():
    """A rank's output and log-sum-exps side by side in one byte buffer (16-byte aligned), and the
    received rows seen as ``[world, ...]`` tensors: each rank's row is its own pair."""
    world, shape = 3, (2, 4, 5)                  # 80 bytes of fp16 output, then 32 of lse
    ex = PartialsExchange(world, shape, torch.float16, torch.float32, torch.device("cpu"))
    assert ex.out.shape == shape and ex.lse.shape == shape[:2] and ex.send.numel() == 112
    assert ex.out.data_ptr() == ex.send.data_ptr() and ex.lse.data_ptr() % 16 == 0
    pairs = [(torch.randn(shape).half(), torch.randn(shape[:2])) for _ in range(world)]
    for r, (o, lse) in enumerate(pairs):         # what the all-gather does, rank by rank
        ex.out.copy_(o)
        ex.lse.copy_(lse)
        ex.recv.view(world, -1)[r] = ex.send
    for r, (o, lse) in enumerate(pairs):
        assert torch.equal(ex.outs[r], o) and torch.equal(ex.lses[r], lse)
    with pytest.raises(ValueError):
        PartialsExchange(0, shape, torch.float16, torch.float32, "cpu")
    with pytest.raises(ValueError):
        PartialsExchange(2, (2, 4), torch.float16, torch.float32, "cpu")
    with pytest.raises(TypeError):
        PartialsExchange(2, shape, "float16", torch.float32, "cpu")


def test_merge_of_parts_is_attention_over_the_whole():
    """Cut every sequence into uneven parts, attend over each with the oracle, merge: the same as
    attention over the whole. And v2's partitions are merged by the same function."""
    p = make_decode_problem([40, 7, 100], num_heads=4, num_kv_heads=2, head_size=16, block_size=8,
                            seed=3)
    whole, whole_lse = ref.ref_decode_attention(*p.decode_args(), return_lse=True)
    query = p.query
    cuts = [0, 3, 4, 30]           # parts [0, 3), [3, 4), [4, 30), [30, n): some empty for n = 7
    outs, lses = [], []
    for lo, hi in zip(cuts, cuts[1:] + [10 ** 6]):
        o = torch.zeros(3, 4, 16, dtype=torch.float64)
        lse = torch.full((3, 4), float("-inf"), dtype=torch.float64)
        for s, n in enumerate(p.seq_lens.tolist()):
            if min(hi, n) <= lo:
                continue
            k, v = ref.gather_kv(p.key_cache, p.value_cache, p.block_tables[s], n)
            k, v = k[lo:min(hi, n)], v[lo:min(hi, n)]
            o[s], lse[s] = (x[0] for x in ref.ref_decode_attention(
                query[s:s + 1], k[None], v[None], torch.zeros(1, 1, dtype=torch.int32),
                torch.tensor([k.size(0)]), p.scale, return_lse=True))
        outs.append(o)
        lses.append(lse)
    merged, merged_lse = ref.merge_partials(torch.stack(outs), torch.stack(lses), dim=0)
    torch.testing.assert_close(merged, whole, rtol=0, atol=1e-12)
    torch.testing.assert_close(merged_lse, whole_lse, rtol=0, atol=1e-12)
    # without the rescale the parts are not on one scale
    assert (torch.stack(outs).mean(0) - whole).abs().max() > 1e-2


def test_merge_with_exp_sums_is_v2s_reduction():
    m = torch.tensor([[3.0, 5.0, 4.0]])
    s = torch.tensor([[20.0, 8.0, 12.0]])
    o = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]]])
    w = [20 * torch.e ** -2, 8.0, 12 * torch.e ** -1]
    expected = torch.tensor([(w[0] + 0.5 * w[2]) / sum(w), (w[1] + 0.5 * w[2]) / sum(w)])
    out, lse = ref.merge_partials(o, m, s)
    torch.testing.assert_close(out[0], expected)
    torch.testing.assert_close(lse[0], torch.tensor(5.0 + float(torch.tensor(sum(w)).log())))
    # A log-sum-exp is the pair (lse, 1); all parts empty gives no NaN in the lse.
    out2, _ = ref.merge_partials(o, m + s.log())
    torch.testing.assert_close(out2, out)
    _, empty = ref.merge_partials(o, torch.full_like(m, float("-inf")))
    assert torch.isneginf(empty).all()


def test_empty_share_weighs_nothing():
    """A rank that holds no token of a sequence: -inf and zeros, whichever implementation."""
    problem = _problem(4, lens=(2, 20))
    cache = write_rank_cache(problem, 2, 1, "cpu", "reference")
    local = get_dcp_local_seq_lens(torch.tensor(problem.seq_lens), 2, 1, 4)
    assert local.tolist() == [0, 8]
    impls = ["reference", "triton"] if TRITON_CPU else ["reference"]
    for impl in impls:
        out, lse = partial_decode_attention(problem.query(), cache.key_cache, cache.value_cache,
                                            cache.block_tables, local, problem.scale, impl=impl)
        assert torch.isneginf(lse[0]).all() and torch.isfinite(lse[1]).all()
        assert not out[0].any()


def test_bad_arguments_are_refused():
    problem = _problem(1, lens=(5,))
    with pytest.raises(ValueError):
        write_rank_cache(problem, 2, 0, "cpu", "cuda")
    cache = write_rank_cache(problem, 2, 0, "cpu", "reference")
    with pytest.raises(ValueError):
        partial_decode_attention(problem.query(), cache.key_cache, cache.value_cache,
                                 cache.block_tables, torch.tensor([3]), problem.scale, impl="vllm")
    with pytest.raises(ValueError):
        DcpDecodeProblem((5,), block_size=8, interleave=3)      # must divide the block size
    with pytest.raises(ValueError):
        DcpDecodeProblem((0,))
    with pytest.raises(ValueError):
        spawn(run_dcp_rank, 2, problem, backend="mpi")
    with pytest.raises(ValueError):
        spawn(run_dcp_rank, 0, problem)
    if torch.cuda.device_count() < 64:
        with pytest.raises(ValueError):
            spawn(run_dcp_rank, 64, problem, backend="nccl")


def _raise_on_rank_1(rank, world):
    if rank == 1:
        raise KeyError("planted on rank 1")
    return rank


def test_an_error_on_one_rank_reaches_the_caller():
    with pytest.raises(Exception, match="planted on rank 1"):
        spawn(_raise_on_rank_1, 2, backend="gloo")


def test_a_single_rank_needs_no_peers():
    """World size 1 through the same code: the group is one process, the merge of one part."""
    problem = _problem(1, lens=(3, 30))
    (got,) = spawn(run_dcp_rank, 1, problem, "reference", backend="gloo")
    oracle, _ = problem.dense_reference()
    assert _error(got.out, oracle) < 1e-12


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_nccl_on_two_gpus():
    for interleave, dtype in ((1, torch.bfloat16), (8, torch.float16)):
        problem = DcpDecodeProblem((1, 17, 300, 2049), num_heads=8, num_kv_heads=2, head_size=64,
                                   block_size=16, interleave=interleave, dtype=dtype)
        results = spawn(run_dcp_rank, 2, problem, "triton", backend="nccl")
        oracle, _ = problem.dense_reference("cuda")
        for got in results:
            assert _error(got.out, oracle.cpu()) < 2e-2
        assert torch.equal(results[0].out, results[1].out)


# ---- The drawings draw what the ranks returned ---------------------------------------------

def test_drawings_show_what_the_ranks_hold_and_merge(ranks):
    from paged_attention.distributed import dcp_merge_weights
    from paged_attention.viz.dcp import draw_dcp_merge, draw_dcp_shares

    world, cases, results = ranks
    problem = cases["interleave 2"][0]
    got = [results[r]["interleave 2"] for r in range(world)]
    s, n = 4, problem.seq_lens[4]
    ax = draw_dcp_shares(got, problem.block_size, seq=s)
    for r in range(world):
        shown = [int(t.get_text()) for t in ax.texts if t.get_gid() == f"rank{r}"]
        assert sorted(shown) == [p for p in range(n)
                                 if dcp_owner_rank(p, world, problem.interleave) == r]
    positions = [t.get_text() for t in ax.texts if t.get_gid() == "position"]
    assert positions == [str(p) for p in range(n)]

    weights = dcp_merge_weights(got, s)
    assert weights.shape == (world, problem.num_heads)
    assert abs(weights.sum(axis=0) - 1).max() < 1e-12
    oracle, _ = problem.dense_reference()
    ax = draw_dcp_merge(got, oracle, seq=s, head=1, num_dims=6)
    lines = {line.get_gid(): line for line in ax.lines}
    assert abs(lines["merged"].get_ydata() - oracle[s, 1, :6].numpy()).max() < 1e-12
    assert abs(lines["average"].get_ydata() - oracle[s, 1, :6].numpy()).max() > 1e-3
    labels = ax.get_legend_handles_labels()[1]
    assert [f"weight {w:.3f}" in label for w, label in zip(weights[:, 1], labels)] == [True] * world

    with pytest.raises(ValueError):
        draw_dcp_shares(got, problem.block_size, seq=len(problem.seq_lens))
    with pytest.raises(TypeError):
        draw_dcp_shares([], problem.block_size)
    with pytest.raises(ValueError):
        draw_dcp_merge(got, oracle[:1], seq=s)
    with pytest.raises(ValueError):
        draw_dcp_merge(got, oracle, head=problem.num_heads)
