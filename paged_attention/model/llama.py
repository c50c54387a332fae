"""The Llama forward pass over a paged KV cache (SmolLM2-135M-Instruct is one).

One step takes the new tokens of every scheduled request, packed into one flat batch
(``input_ids``, ``positions``), the step's :class:`ForwardBatch` (where each request's tokens are,
their cache slots, block tables and lengths) and the per-layer caches, and returns the logits of
each request's last new token, the one the engine samples from.

Per layer, as in Hugging Face's and vLLM's Llama::

    x = x + o_proj(attention(rope(q), rope(k), v))      q, k, v = split(qkv_proj(rms_norm(x)))
    x = x + down_proj(silu(gate) * up)                  gate, up = split(gate_up_proj(rms_norm(x)))

The attention (``model/attention.py``) reads each request's whole sequence back from the paged
cache; the step's keys and values go into it with the rotary embedding. The small operations
between the projections (the residual add with its norm, the rotary embedding with the cache
write, SwiGLU's product) are chosen once, when the model is built: plain torch, or one fused
Triton launch each (``model/layer_ops.py``), where at a small batch the norm also joins the
projection that follows it (QKV, gate-up with SwiGLU). So the forward pass is one loop.

For speed, work that does not depend on the step is done once at load time: the Q, K and V
projections are fused into one matrix (``qkv_proj``, vLLM's ``QKVParallelLinear``) and gate and up
into another (``gate_up_proj``), and the rotary tables are precomputed for every position. The
decode path reads nothing back to the host and branches on nothing but Python ints, so that an
engine can capture a decode step in a CUDA graph.
"""
from __future__ import annotations

import operator

import torch
import torch.nn.functional as F

from paged_attention.kernels import KernelUnavailable, args
from paged_attention.model.attention import KVCache, PagedAttention, read_layout, resolve_attention, split_batch
from paged_attention.model.batch import ForwardBatch
from paged_attention.model.config import LlamaConfig
from paged_attention.model.layer_ops import FusedLayerOps, ResidualStream, TorchLayerOps, can_fuse
from paged_attention.model.layer_ops import RotaryEmbedding, rms_norm  # noqa: F401  (their old home)
from paged_attention.model.weights import check_weights
from paged_attention.utils import check_device

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


def resolve_dtype(dtype: object) -> torch.dtype:
    """``torch.float32``/``bfloat16``/``float16``, or their names; TypeError for anything else."""
    if isinstance(dtype, str) and dtype in _DTYPES:
        return _DTYPES[dtype]
    if dtype in (torch.float32, torch.bfloat16, torch.float16):
        return dtype
    raise TypeError(f"dtype must be torch.float32, torch.bfloat16 or torch.float16 (or one of "
                    f"{', '.join(map(repr, _DTYPES))}), got {dtype!r}")


def resolve_device(device: object) -> torch.device:
    """The model's device, ``"cpu"``, ``"cuda"``, ``"cuda:0"`` or a ``torch.device``: the one device
    check (``utils.check_device``), for the two kinds of device the model runs on."""
    return check_device("device", device, types=("cpu", "cuda"))


# --------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------

class LlamaForCausalLM:
    """A Llama decoder reading and writing a paged KV cache.

    ``weights`` uses Hugging Face names (``load_gguf`` and ``random_weights`` give them).
    ``attention`` picks the kernels: ``"auto"``, ``"reference"``, ``"triton"``, ``"cuda"``,
    ``"vllm"`` (see ``model/attention.py``). Every argument is checked here, before any weight is
    copied: an unknown attention name is a ValueError, a dtype that is not a float type a TypeError,
    a kernel that cannot run on this device ``KernelUnavailable``.
    """

    def __init__(self, config: LlamaConfig, weights: dict[str, torch.Tensor], *,
                 dtype: torch.dtype | str = torch.float32, device: torch.device | str = "cpu",
                 attention: str = "auto", fused: bool | None = None) -> None:
        if not isinstance(config, LlamaConfig):
            raise TypeError(f"config must be a LlamaConfig, got {type(config).__name__}")
        if fused is not None and not isinstance(fused, bool):
            raise TypeError(f"fused must be None or a bool, got {fused!r}")
        self.config = config
        self.dtype = resolve_dtype(dtype)
        self.device = resolve_device(device)
        self.attention_impl = resolve_attention(attention, self.device, self.dtype)
        if fused and self.device.type != "cuda" and self.dtype == torch.bfloat16:
            raise KernelUnavailable("the fused kernels run in Triton's interpreter on a CPU, which has no bfloat16")
        check_weights(config, weights)

        def w(name: str) -> torch.Tensor:
            return weights[name].to(self.device, self.dtype)

        self.embed_tokens = w("model.embed_tokens.weight")
        self.layers = []
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}."
            self.layers.append({
                "input_layernorm": w(p + "input_layernorm.weight"),
                # rows: the q_size query rows, then kv_size key rows, then kv_size value rows
                "qkv_proj": torch.cat([w(p + f"self_attn.{x}_proj.weight") for x in "qkv"]).contiguous(),
                "o_proj": w(p + "self_attn.o_proj.weight"),
                "post_attention_layernorm": w(p + "post_attention_layernorm.weight"),
                # rows: intermediate_size gate rows, then intermediate_size up rows
                "gate_up_proj": torch.cat([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")]).contiguous(),
                "down_proj": w(p + "mlp.down_proj.weight"),
            })
        self.norm = w("model.norm.weight")
        self.lm_head = self.embed_tokens if config.tie_word_embeddings else w("lm_head.weight")
        self.rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta, self.device)
        self.attn = PagedAttention(self.attention_impl, config.num_attention_heads, config.num_key_value_heads,
                                   config.head_dim, self.device)
        # The layers' small operations, chosen once: fused Triton kernels on a GPU; plain torch on
        # a CPU, where Triton only interprets (``fused=True`` forces the kernels there, for tests).
        self.fused = (self.device.type == "cuda" and can_fuse(config)) if fused is None else fused

    @property
    def kv_cache_layout(self) -> str:
        """``"flash"`` or ``"v0"``: the cache layout this model's kernels read (``allocate_kv_caches`` follows it)."""
        return self.attn.layout

    @property
    def attn(self) -> PagedAttention:
        """The attention kernels (``model/attention.py``); settable (a test swaps in another
        implementation), which picks the layer operations again for its cache layout."""
        return self._attn

    @attn.setter
    def attn(self, value: PagedAttention) -> None:
        self._attn = value
        if hasattr(self, "ops"):
            self.fused = self.fused

    # ---- the forward pass ------------------------------------------------------------------
    @property
    def fused(self) -> bool:
        """Whether the layers run the fused Triton operations (``model/layer_ops.py``); settable,
        which picks the operations again (the tests compare both on one model)."""
        return isinstance(self.ops, FusedLayerOps)

    @fused.setter
    def fused(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"fused must be a bool, got {value!r}")
        if value and not can_fuse(self.config):
            raise ValueError(f"the fused kernels need a head size of twice a power of two, got {self.config.head_dim}")
        ops = FusedLayerOps if value else TorchLayerOps
        self.ops = ops(self.config, self.rotary, self.attn)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch,
                kv_caches: list[KVCache], *, check: bool = True) -> torch.Tensor:
        """Logits ``[num_reqs, vocab_size]`` (float32) of each request's last new token.

        ``check`` validates the inputs first (token ids within the vocabulary, positions within
        the context): one read of a few numbers to the host. It is skipped during a CUDA-graph
        capture, where host reads are not allowed (the engine checks its requests when they
        arrive).
        """
        return self.compute_logits(self.hidden_states(input_ids, positions, batch, kv_caches, check=check))

    @torch.inference_mode()
    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch,
                      kv_caches: list[KVCache], *, check: bool = True) -> torch.Tensor:
        """The final hidden state ``[num_reqs, hidden_size]`` (after the last norm) of each
        request's last new token: ``forward`` without the output projection. A CUDA graph of a
        decode step ends here, so that its output stays small whatever the vocabulary."""
        if check and not (self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            self.check_inputs(input_ids, positions, batch, kv_caches)
        cfg, ops = self.config, self.ops
        # A batch with prefills reads its layout once, here (from the host copy when the batch
        # carries one); a decode batch reads nothing back.
        split = None
        if not batch.is_decode_only:
            if self.attn.needs_split:
                split = split_batch(batch, self.block_size_of(kv_caches))
            else:
                read_layout(batch)   # checked once here; the prefill kernel then reads no host data

        stream = ResidualStream(self.embed_tokens[input_ids])               # [T, hidden]
        rope = ops.rope_inputs(positions)                                    # once for all layers
        decode = batch.is_decode_only
        for layer, kv_cache in zip(self.layers, kv_caches):
            # The QKV and o projections ask the L2 cache for the MLP's weights (gate-up, then down)
            # while they wait for their inputs (FusedLayerOps.prefetch_rows says when).
            qkv, residual = ops.norm_linear(stream, layer["input_layernorm"], layer["qkv_proj"], decode=decode,
                                            prefetch=layer["gate_up_proj"])
            if decode:
                o = ops.decode_attention(qkv, rope, kv_cache, batch)
            else:
                q = ops.rope_and_cache(qkv, rope, kv_cache, batch.slot_mapping)
                o = self.attn.mixed(q, kv_cache, batch, split)
            stream = ops.linear_add(o.reshape(-1, cfg.q_size), layer["o_proj"], residual, decode=decode,
                                    prefetch=layer["down_proj"])
            act, residual = ops.norm_linear_silu_mul(stream, layer["post_attention_layernorm"], layer["gate_up_proj"],
                                                     decode=decode)
            stream = ops.linear_add(act, layer["down_proj"], residual, decode=decode)
        if not batch.is_decode_only:
            # Only each request's last new token is sampled from: request i's is row query_start_loc[i+1] - 1.
            stream = stream.rows(batch.query_start_loc[1:].long() - 1)
        return ops.norm(stream, self.norm)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits of final hidden states: the output projection (tied to the embedding in SmolLM2)."""
        return F.linear(hidden, self.lm_head).float()

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """The most likely next token of each final hidden state (int64): the argmax of
        ``compute_logits`` without its float32 copy (the cast is exact, so the order, ties
        included, is the same). The fused operations compare the logits inside the output
        projection for a decode batch's few rows (``kernels/triton/lm_head.py``)."""
        return self.ops.greedy_head(hidden, self.lm_head)

    __call__ = forward

    # ---- checks ----------------------------------------------------------------------------
    @staticmethod
    def block_size_of(kv_caches: list[KVCache]) -> int:
        """Tokens per block of these caches (flash: dimension 1; v0 value cache: the last)."""
        key_cache, value_cache = kv_caches[0]
        return key_cache.size(1) if key_cache.dim() == 4 else value_cache.size(3)

    def check_token_ids(self, token_ids: torch.Tensor | list[int], *, plain_ints: bool = False) -> None:
        """ValueError unless every id is in ``[0, vocab_size)``; TypeError unless they are ints.
        ``plain_ints``: the caller has already found ``token_ids`` to be a list of plain ints (no
        bools), as ``LLM`` does for every token-id prompt; then only their range is checked."""
        if isinstance(token_ids, torch.Tensor):
            if token_ids.dtype not in (torch.int64, torch.int32):
                raise TypeError(f"token ids must be int64 (or int32), got {token_ids.dtype}")
            if token_ids.numel() == 0:
                return
            lo, hi = torch.stack([token_ids.min(), token_ids.max()]).tolist()
        else:
            # A list or tuple is read as it is (nothing here changes it); anything else is
            # listed first, since it may be an iterator that can be read only once.
            ids = token_ids if type(token_ids) in (list, tuple) else list(token_ids)
            # All plain ints (the usual prompt) is counted in C; anything else is looked at.
            # A list the caller vouches for is not counted again (the promise is only taken
            # for a list, the one kind of sequence its caller makes).
            vouched = plain_ints and type(token_ids) is list
            if not vouched and operator.countOf(map(type, ids), int) != len(ids) and \
                    not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise TypeError("token ids must be ints")
            if not ids:
                return
            lo, hi = min(ids), max(ids)
        if lo < 0 or hi >= self.config.vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {self.config.vocab_size})")

    def check_inputs(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch,
                     kv_caches: list[KVCache]) -> None:
        """Typed errors for inputs that would fail, or silently compute nonsense, inside the step."""
        if not isinstance(batch, ForwardBatch):
            raise TypeError(f"batch must be a ForwardBatch, got {type(batch).__name__}")
        args.tensor("input_ids", input_ids, ndim=1, dtypes=(torch.int64, torch.int32), device=self.device)
        args.tensor("positions", positions, ndim=1, dtypes=(torch.int64, torch.int32), device=self.device)
        if positions.numel() != input_ids.numel() or batch.num_tokens != input_ids.numel():
            raise ValueError(f"input_ids ({input_ids.numel()}), positions ({positions.numel()}) and "
                             f"batch.slot_mapping ({batch.num_tokens}) must have one entry per token")
        if batch.query_start_loc.numel() != batch.num_reqs + 1:
            raise ValueError(f"batch.query_start_loc must have num_reqs + 1 = {batch.num_reqs + 1} entries, "
                             f"got {batch.query_start_loc.numel()}")
        if not isinstance(kv_caches, (list, tuple)) or len(kv_caches) != self.config.num_hidden_layers:
            raise ValueError(f"kv_caches must be a list of {self.config.num_hidden_layers} (key_cache, value_cache) "
                             f"pairs, one per layer")
        key_cache = kv_caches[0][0]
        if key_cache.dtype != self.dtype or key_cache.device.type != self.device.type:
            raise TypeError(f"the KV caches must be {self.dtype} on {self.device.type} like the model, "
                            f"got {key_cache.dtype} on {key_cache.device}")
        if input_ids.numel() == 0:
            return
        # The block-table entries each request reads (the first cdiv(seq_len, block_size) of its
        # row) must be block ids of these caches: a kernel trusts them, and a wrong one read in
        # Triton's interpreter ends the process.
        block_size, num_blocks = self.block_size_of(kv_caches), kv_caches[0][0].size(0)
        tables, seq_lens = batch.block_tables, batch.seq_lens.long()
        used = torch.arange(tables.size(1), device=tables.device)[None, :] < (seq_lens[:, None] + block_size - 1) // block_size
        bad_ids = (used & ((tables < 0) | (tables >= num_blocks))).any()
        # One read back for every check (the cache writes then skip theirs: one per layer otherwise).
        lo, hi, pmin, pmax, smin, smax, bad, slot_max = torch.stack([
            input_ids.min(), input_ids.max(), positions.min(), positions.max(),
            seq_lens.min(), seq_lens.max(), bad_ids.long(), batch.slot_mapping.max().long()]).tolist()
        if slot_max >= num_blocks * block_size:
            raise ValueError(f"batch.slot_mapping holds slot {slot_max}, but the caches have only "
                             f"{num_blocks * block_size} slots (num_blocks * block_size)")
        if smin < 1 or smax > batch.max_seq_len:
            raise ValueError(f"batch.seq_lens must be in [1, max_seq_len={batch.max_seq_len}], got {smin} .. {smax}")
        if (smax + block_size - 1) // block_size > tables.size(1):
            raise ValueError(f"a sequence of {smax} tokens needs {(smax + block_size - 1) // block_size} blocks of "
                             f"{block_size}, but batch.block_tables has {tables.size(1)} columns")
        if bad:
            raise ValueError(f"batch.block_tables holds a block id outside [0, {num_blocks}) (the caches' blocks)")
        if lo < 0 or hi >= self.config.vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {self.config.vocab_size})")
        if pmin < 0 or pmax >= self.config.max_position_embeddings:
            raise ValueError(f"positions must be in [0, {self.config.max_position_embeddings}) (the model's "
                             f"context), got {pmin if pmin < 0 else pmax}")
