"""``LLM``: vLLM's offline interface over this project's engine.

    llm = LLM()                                          # the packaged SmolLM2-135M-Instruct
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=32))
    print(out[0].outputs[0].text)

``generate`` takes raw prompts (text, token-id lists, or ``{"prompt_token_ids": [...]}``);
``chat`` applies the model's chat template first. Every request of a call is checked before any
runs; the outputs come back in input order.
"""
from __future__ import annotations

import itertools
import operator
import os
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import torch

from paged_attention import runtime
from paged_attention.engine.llm_engine import DEFAULT_CORE, LLMEngine
from paged_attention.engine.outputs import RequestOutput
from paged_attention.engine.sampling_params import SamplingParams
from paged_attention.model import LlamaForCausalLM, Tokenizer, kv_cache_bytes_per_block, load_gguf
from paged_attention.model.llama import resolve_device, resolve_dtype
from paged_attention.utils import cdiv, check_int, is_int

PromptType = Union[str, list[int], dict]
_GiB = 1 << 30


def _large_gpu_step(device: torch.device) -> int:
    """vLLM's offline default step on a large GPU (an H100 or H200: 70 GiB or more, not an A100):
    16384 tokens, which prefills a batch of prompts in fewer, fuller steps; 0 elsewhere."""
    if device.type != "cuda":
        return 0
    props = torch.cuda.get_device_properties(device)
    return 16384 if props.total_memory >= 70 * _GiB and "a100" not in props.name.lower() else 0


class LLM:
    """A small inference engine: the model, its paged KV cache, the scheduler, and the sampler.

    ``model``: None (the packaged SmolLM2), a path to a Llama GGUF file, or a ready
    ``LlamaForCausalLM`` (then its device, dtype and attention are used, and ``tokenizer`` may be
    given; without one, prompts must be token ids).

    ``core``: who schedules. ``"v1"`` (the default): vLLM V1's scheduler over its KV-cache manager,
    with ``async_scheduling`` (default on: step n + 1 is scheduled while step n runs);
    ``"v0"``: the legacy scheduler and block manager, synchronous, preempting by ``"swap"`` (its
    default ``preemption_mode``) or ``"recompute"`` (V1 only recomputes).

    Memory: ``num_gpu_blocks`` blocks of ``block_size`` tokens hold every layer's KV (default: what
    ``kv_cache_memory`` bytes hold; by default 512 MiB on a CPU, 80% of the GPU's free memory
    on a GPU; never more than ``max_num_seqs`` requests of ``max_model_len`` tokens need).
    ``num_cpu_blocks`` is V0's swap pool (default: a quarter of that; none for V1).
    ``kv_cache_memory`` is a bound: a budget that holds no block, or ``num_gpu_blocks`` beyond it,
    is refused, as are pools larger than the memory they would live in. A step runs at most
    ``max_num_seqs`` requests and ``max_num_batched_tokens`` tokens (default: the larger of
    ``max_model_len`` and 2048, and vLLM's 16384 on an H100 or H200; for V0 at least
    ``max_model_len``, as vLLM V0 asks without chunked prefill; V1 cuts long prefills into
    chunks). ``block_tables``: which of the project's table classes turns
    the block lists into kernel inputs: ``"auto"`` (v2 on a GPU, v1 on a CPU), ``"v2"``,
    ``"v2-vllm"`` or ``"v1"``.
    ``cuda_graphs``: replay steps from CUDA graphs on a GPU (with an attention whose decode
    reads nothing back to the host: not the reference's; steps with prefills too where the
    prefill kernel reads its batch's layout on the device: Triton's). ``record_block_owners``: every
    step's record says who holds each block, for the pool drawings (a benchmark turns it off: with
    hundreds of requests it is a quarter of the scheduler's time). ``record_gpu_time``: CUDA
    events around each step's device work (the benchmark's idle-time figure).
    """

    def __init__(self, model: Union[None, str, Path, LlamaForCausalLM] = None, *, block_size: int = 16,
                 num_gpu_blocks: Optional[int] = None, num_cpu_blocks: Optional[int] = None,
                 enable_prefix_caching: bool = True, max_num_seqs: int = 256,
                 max_num_batched_tokens: Optional[int] = None, attention: str = "auto",
                 device: Union[None, str, torch.device] = None, dtype: Union[None, str, torch.dtype] = None,
                 max_model_len: Optional[int] = None, preemption_mode: Optional[str] = None,
                 block_tables: str = "auto", cuda_graphs: bool = True, kv_cache_memory: Optional[int] = None,
                 watermark: float = 0.01, record_block_owners: bool = True, tokenizer: Optional[Tokenizer] = None,
                 core: str = DEFAULT_CORE, async_scheduling: Optional[bool] = None,
                 record_gpu_time: bool = False) -> None:
        # Every argument is checked before the weights are read.
        block_size = check_int("block_size", block_size, 1)
        max_num_seqs = check_int("max_num_seqs", max_num_seqs, 1)
        if not isinstance(enable_prefix_caching, bool):
            raise TypeError(f"enable_prefix_caching must be a bool, got {enable_prefix_caching!r}")
        for name, flag in (("cuda_graphs", cuda_graphs), ("record_gpu_time", record_gpu_time)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {flag!r}")
        if async_scheduling is not None and not isinstance(async_scheduling, bool):
            raise TypeError(f"async_scheduling must be None or a bool, got {async_scheduling!r}")
        from paged_attention.engine.llm_engine import CORES
        if core not in CORES:
            raise ValueError(f"core must be one of {', '.join(map(repr, CORES))}, got {core!r}")
        if core == "v0" and async_scheduling:
            raise ValueError("async_scheduling needs core='v1': the V0 scheduler appends each step's tokens "
                             "before it schedules the next")
        if preemption_mode not in (None, "swap", "recompute"):
            raise ValueError(f"preemption_mode must be 'swap' or 'recompute', got {preemption_mode!r}")
        if core == "v1" and is_int(num_cpu_blocks) and num_cpu_blocks > 0:
            raise ValueError(f"num_cpu_blocks={num_cpu_blocks} is a swap pool, which only the V0 core has; pass "
                             f"core='v0' (or no num_cpu_blocks)")
        if core == "v1" and preemption_mode == "swap":
            raise ValueError("the V1 core preempts by recomputation only (it has no swap pool); use core='v0' "
                             "for preemption_mode='swap'")
        from paged_attention.engine.tables import TABLE_IMPLS
        if block_tables not in TABLE_IMPLS:
            raise ValueError(f"block_tables must be one of {', '.join(TABLE_IMPLS)}, got {block_tables!r}")
        if tokenizer is not None and not isinstance(tokenizer, Tokenizer):
            raise TypeError(f"tokenizer must be a paged_attention.model.Tokenizer, got {type(tokenizer).__name__}")

        if isinstance(model, LlamaForCausalLM):
            self.model = model
        else:
            device = resolve_device(runtime.DEVICE if device is None else device)
            dtype = resolve_dtype((torch.bfloat16 if device.type == "cuda" else torch.float32) if dtype is None else dtype)
            if model is not None and not isinstance(model, (str, Path)):
                raise TypeError(f"model must be None, a path to a GGUF file or a LlamaForCausalLM, "
                                f"got {type(model).__name__}")
            from paged_attention.model.attention import resolve_attention
            resolve_attention(attention, device, dtype)        # an unknown name fails before loading
            config, weights = load_gguf(model)
            self.model = LlamaForCausalLM(config, weights, dtype=dtype, device=device, attention=attention)
            if tokenizer is None:
                tokenizer = Tokenizer.from_gguf(model)
        self.tokenizer = tokenizer
        config = self.model.config
        self.config = config

        if max_model_len is None:
            max_model_len = config.max_position_embeddings
        max_model_len = check_int("max_model_len", max_model_len, 2)
        if max_model_len > config.max_position_embeddings:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's context "
                             f"({config.max_position_embeddings} positions)")
        if max_num_batched_tokens is None:
            max_num_batched_tokens = max(max_model_len, 2048, _large_gpu_step(self.model.device))
        max_num_batched_tokens = check_int("max_num_batched_tokens", max_num_batched_tokens, 1)
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(f"max_num_batched_tokens={max_num_batched_tokens} must be at least max_num_seqs="
                             f"{max_num_seqs}: every running request decodes one token a step")
        # vLLM V0's rule without chunked prefill: a prefill runs whole in one step, and a request
        # preempted by recomputation is prefilled again with everything it generated, up to
        # max_model_len tokens; a smaller step could never take it back. (V1 chunks prefills.)
        if core == "v0" and max_num_batched_tokens < max_model_len:
            raise ValueError(f"max_num_batched_tokens={max_num_batched_tokens} is smaller than max_model_len="
                             f"{max_model_len}: a request recomputed after a preemption is prefilled again whole, "
                             f"up to max_model_len tokens, in one step; raise max_num_batched_tokens or lower "
                             f"max_model_len")
        # A block longer than the model's whole context holds nothing a shorter one would not.
        if block_size > config.max_position_embeddings:
            raise ValueError(f"block_size={block_size} exceeds the model's context "
                             f"({config.max_position_embeddings} positions)")

        bytes_per_block = kv_cache_bytes_per_block(config, block_size, self.model.dtype)
        if kv_cache_memory is not None:
            kv_cache_memory = check_int("kv_cache_memory", kv_cache_memory, 1)
        if num_gpu_blocks is None:
            budget = self._default_kv_memory() if kv_cache_memory is None else kv_cache_memory
            if budget < bytes_per_block:
                raise ValueError(f"kv_cache_memory={budget} bytes holds no block of {block_size} tokens "
                                 f"({bytes_per_block} bytes, every layer's keys and values); give it more "
                                 f"memory or use a smaller block_size")
            needed = max_num_seqs * cdiv(max_model_len, block_size)
            num_gpu_blocks = min(budget // bytes_per_block, needed)
        num_gpu_blocks = check_int("num_gpu_blocks", num_gpu_blocks, 1)
        if num_cpu_blocks is None:
            num_cpu_blocks = num_gpu_blocks // 4 if core == "v0" else 0
        num_cpu_blocks = check_int("num_cpu_blocks", num_cpu_blocks, 0)
        _check_pools_fit(self.model.device, num_gpu_blocks, num_cpu_blocks, bytes_per_block, kv_cache_memory)
        self.bytes_per_block = bytes_per_block

        eos = tokenizer.stop_token_ids if tokenizer is not None else frozenset()
        self.engine = LLMEngine(self.model, eos_token_ids=frozenset(eos), block_size=block_size,
                                num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=num_cpu_blocks,
                                enable_prefix_caching=enable_prefix_caching, max_num_seqs=max_num_seqs,
                                max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                                preemption_mode=preemption_mode, block_tables=block_tables,
                                cuda_graphs=cuda_graphs, watermark=watermark,
                                record_block_owners=record_block_owners, core=core,
                                async_scheduling=async_scheduling, record_gpu_time=record_gpu_time)
        if tokenizer is not None:
            self.engine.detokenize = tokenizer.decode
        self._request_counter = itertools.count()

    def _default_kv_memory(self) -> int:
        if self.model.device.type != "cuda":
            return _GiB // 2
        free, _ = torch.cuda.mem_get_info(self.model.device)
        return int(free * 0.8)

    # ---- the interface --------------------------------------------------------------------
    def generate(self, prompts: Union[PromptType, Sequence[PromptType]],
                 sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None, *,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Complete every prompt; the outputs in input order. A prompt is text (tokenized as it
        is: use ``chat`` for the chat template), a list of token ids, or ``{"prompt_token_ids":
        [...]}``. ``sampling_params``: one for all, or one per prompt (default ``SamplingParams()``)."""
        prompts = self._prompt_list(prompts)
        params = self._params_list(sampling_params, len(prompts))
        encoded = [self._encode(p) for p in prompts]
        # Every request checked before any is queued (its params too: a field may have been
        # changed since they were made); each keeps the checked copy. A params object given for
        # many prompts is checked and copied once, with its first prompt (so the errors come in
        # the same order as checking each request whole); the prompts after share its copy.
        # A token-id prompt (no text) is a list of plain ints by now (_encode saw to it), so
        # the prompts after the first are not counted again. A params object equal, field by
        # field, to the one checked just before it (a list of identical params, one per prompt)
        # would get an equal copy and the same errors: it shares that copy.
        engine, checked = self.engine, {}
        last, last_copy = None, None
        for (token_ids, text), p in zip(encoded, params):
            if id(p) not in checked and last is not None and _same_fields(p, last):
                checked[id(p)] = last_copy
            if id(p) in checked:
                engine._check_with_params(token_ids, checked[id(p)], plain_ints=text is None)
            else:
                checked[id(p)] = engine.check_request(token_ids, p)
                last, last_copy = p, checked[id(p)]
        return self._run(encoded, [checked[id(p)] for p in params], use_tqdm)

    def chat(self, messages: Union[list[dict], Sequence[list[dict]]],
             sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None, *,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of ``{"role", "content"}`` dicts) or to
        several (a list of such lists), each rendered with the model's chat template."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer (this LLM was given a model without one)")
        if isinstance(messages, list) and messages and all(isinstance(m, dict) for m in messages):
            conversations = [messages]
        elif isinstance(messages, (list, tuple)) and messages and all(isinstance(c, list) for c in messages):
            conversations = list(messages)
        else:
            raise TypeError("messages must be a conversation (a non-empty list of {'role', 'content'} dicts) "
                            "or a list of conversations")
        texts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=add_generation_prompt)
                 for c in conversations]
        return self.generate(texts, sampling_params, use_tqdm=use_tqdm)

    def get_tokenizer(self) -> Optional[Tokenizer]:
        return self.tokenizer

    # ---- helpers ---------------------------------------------------------------------------
    @staticmethod
    def _prompt_list(prompts: Any) -> list:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        if isinstance(prompts, (list, tuple)):
            if not prompts:
                raise ValueError("no prompts given")
            if all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
                return [list(prompts)]            # one prompt of token ids
            return list(prompts)
        raise TypeError(f"prompts must be a str, a list of token ids, or a list of those, got {type(prompts).__name__}")

    @staticmethod
    def _params_list(params: Any, n: int) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * n
        if isinstance(params, SamplingParams):
            return [params] * n
        if isinstance(params, (list, tuple)) and all(isinstance(p, SamplingParams) for p in params):
            if len(params) != n:
                raise ValueError(f"{len(params)} sampling params for {n} prompts")
            return list(params)
        raise TypeError(f"sampling_params must be a SamplingParams or a list of them, got {type(params).__name__}")

    def _encode(self, prompt: Any) -> tuple[list[int], Optional[str]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer: pass token ids")
            return self.tokenizer.encode(prompt), prompt
        if isinstance(prompt, dict):
            if set(prompt) != {"prompt_token_ids"}:
                raise ValueError(f"a dict prompt must be {{'prompt_token_ids': [...]}}, got keys {sorted(prompt)}")
            prompt = prompt["prompt_token_ids"]
        if isinstance(prompt, (list, tuple)):
            # Plain ints are counted in C (a prompt may have thousands); anything else is looked at.
            if operator.countOf(map(type, prompt), int) != len(prompt) and \
                    not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                raise TypeError("a token-id prompt must hold ints only")
            return list(prompt), None
        raise TypeError(f"a prompt must be a str, a list of token ids or {{'prompt_token_ids': [...]}}, "
                        f"got {type(prompt).__name__}")

    def _run(self, encoded: list[tuple[list[int], Optional[str]]], params: list[SamplingParams],
             use_tqdm: bool) -> list[RequestOutput]:
        engine = self.engine
        if engine.has_unfinished_requests():
            raise RuntimeError("the engine still has requests from an interrupted call")
        ids = []
        outputs: dict[str, RequestOutput] = {}
        bar = _progress(len(encoded)) if use_tqdm else None

        def take(finished: list[RequestOutput]) -> None:
            for out in finished:
                outputs[out.request_id] = out
                if bar is not None:
                    bar.update(1)

        # Under async scheduling the first step launches as soon as the queue holds enough to fill
        # it (its token budget, or max_num_seqs requests), and the rest are queued (their blocks
        # hashed) while the GPU runs it. vLLM's engine core, in a process of its own, likewise
        # starts on the first requests to arrive. A prefix-cache hit can leave that first step
        # room for prompts not yet queued: then it runs fewer tokens, and the outputs are the same.
        launch_early, queued_tokens = engine.async_scheduling, 0
        try:
            for n, ((token_ids, text), p) in enumerate(zip(encoded, params), 1):
                ids.append(str(next(self._request_counter)))
                engine._add_checked_request(ids[-1], token_ids, p, prompt=text)     # generate() checked them
                queued_tokens += len(token_ids)
                if launch_early and n < len(encoded) and (queued_tokens >= engine.max_num_batched_tokens
                                                          or n >= engine.max_num_seqs):
                    launch_early = False
                    take(engine.step())
            while engine.has_unfinished_requests():
                take(engine.step())
            if bar is not None:
                bar.close()
        except BaseException:
            engine.abort_all("generate() was interrupted")
            raise
        return [outputs[i] for i in ids]


def _same_fields(params: SamplingParams, other: SamplingParams) -> bool:
    """Whether two params objects hold equal fields (and are of one class), so that checking one
    gives what checking the other gave. A field that cannot say (a numpy array's ``==``) counts
    as different."""
    try:
        return type(params) is type(other) and bool(params.__dict__ == other.__dict__)
    except Exception:
        return False


def _memory_bytes(device: torch.device) -> Optional[int]:
    """The memory of ``device``: a GPU's, or the host's physical memory (None where unknown)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):        # no sysconf (Windows)
        return None


def _check_pools_fit(device: torch.device, num_gpu_blocks: int, num_cpu_blocks: int, bytes_per_block: int,
                     kv_cache_memory: Optional[int]) -> None:
    """Refuse, before allocating, pools larger than ``kv_cache_memory`` (when given, it bounds
    the GPU pool) or than the memory they would live in (the swap pool is host memory; on a
    CPU machine both pools are)."""
    gpu_bytes, cpu_bytes = num_gpu_blocks * bytes_per_block, num_cpu_blocks * bytes_per_block
    if kv_cache_memory is not None and gpu_bytes > kv_cache_memory:
        raise ValueError(f"num_gpu_blocks={num_gpu_blocks} blocks of {bytes_per_block} bytes need {gpu_bytes} "
                         f"bytes, more than kv_cache_memory={kv_cache_memory}")
    needs = {"the host": cpu_bytes}
    if device.type == "cuda":
        needs[str(device)] = gpu_bytes
    else:
        needs["the host"] += gpu_bytes
    for where, need in needs.items():
        have = _memory_bytes(device if where != "the host" else torch.device("cpu"))
        if have is not None and need > have:
            raise ValueError(f"the KV pools need {need} bytes on {where}, which has {have} "
                             f"({num_gpu_blocks} GPU and {num_cpu_blocks} CPU blocks of {bytes_per_block} bytes): "
                             f"use fewer blocks or a smaller block_size")


def _progress(total: int):
    from tqdm.auto import tqdm
    return tqdm(total=total, desc="Processed prompts", unit="req", dynamic_ncols=True)
