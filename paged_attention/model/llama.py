"""The Llama forward pass over a paged KV cache (SmolLM2-135M-Instruct is one).

One step takes the new tokens of every scheduled request, packed into one flat batch
(``input_ids``, ``positions``), the step's :class:`ForwardBatch` (where each request's tokens are,
their cache slots, block tables and lengths) and the per-layer caches, and returns the logits of
each request's last new token, the one the engine samples from.

Per layer, as in Hugging Face's and vLLM's Llama::

    x = x + o_proj(attention(rope(q), rope(k), v))      q, k, v = split(qkv_proj(rms_norm(x)))
    x = x + down_proj(silu(gate) * up)                  gate, up = split(gate_up_proj(rms_norm(x)))

The attention (``model/attention.py``) writes the step's keys and values into the paged cache and
reads each request's whole sequence back from it. Everything else is plain torch.

For speed, work that does not depend on the step is done once at load time: the Q, K and V
projections are fused into one matrix (``qkv_proj``, vLLM's ``QKVParallelLinear``) and gate and up
into another (``gate_up_proj``), and the rotary tables are precomputed for every position. The
decode path reads nothing back to the host and branches on nothing but Python ints, so that an
engine can capture a decode step in a CUDA graph.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from paged_attention.kernels import args
from paged_attention.model.attention import KVCache, PagedAttention, read_layout, resolve_attention, split_batch
from paged_attention.model.batch import ForwardBatch
from paged_attention.model.config import LlamaConfig
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
# Rotary position embedding and RMSNorm
# --------------------------------------------------------------------------------------------

class RotaryEmbedding:
    """Rotate-half RoPE (Hugging Face's Llama; vLLM's ``is_neox_style=True``), tables precomputed.

    Dimension ``j < D/2`` of a head is paired with dimension ``j + D/2``; at position ``p`` the pair
    turns by the angle ``p * theta^(-2j / D)``. (The GGUF's Q/K rows were un-permuted at load time
    to make this the right pairing: see ``model/weights.py``.) A step looks its positions' angles
    up once (``angles``), and every layer rotates its queries and keys together with them: the
    fewer kernels a step launches, the shorter its CUDA graph.
    """

    def __init__(self, head_dim: int, max_position: int, theta: float, device: torch.device) -> None:
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))   # [D/2]
        angles = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]      # [P, D/2]
        # cos and sin side by side, so that one lookup fetches both: [P, 2, D/2]
        self.cos_sin = torch.stack([angles.cos(), angles.sin()], dim=1).to(device)
        self.max_position = max_position

    def angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` of each token's position, ``[T, 1, D/2]`` each (one angle per pair,
        every head alike)."""
        cos, sin = self.cos_sin[positions].unsqueeze(2).unbind(1)
        return cos, sin

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x`` ``[num_tokens, heads, D]`` rotated by the angles (float32 maths)."""
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    def __call__(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.rotate(x, *self.angles(positions))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)``, the mean taken in float32 whatever ``x``'s dtype,
    then cast back before the weight, as Hugging Face's Llama does. (``F.rms_norm`` is one fused
    kernel on a GPU where the same lines written out would be six.)"""
    return weight * F.rms_norm(x.float(), (x.size(-1),), eps=eps).to(x.dtype)


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
                 attention: str = "auto") -> None:
        if not isinstance(config, LlamaConfig):
            raise TypeError(f"config must be a LlamaConfig, got {type(config).__name__}")
        self.config = config
        self.dtype = resolve_dtype(dtype)
        self.device = resolve_device(device)
        self.attention_impl = resolve_attention(attention, self.device, self.dtype)
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
        # On a GPU the norms and the rotary embedding run as fused Triton kernels (see
        # _forward_fused); on a CPU, where Triton only interprets, as plain torch.
        self.fused = self.device.type == "cuda" and (config.head_dim // 2) & (config.head_dim // 2 - 1) == 0

    @property
    def kv_cache_layout(self) -> str:
        """``"flash"`` or ``"v0"``: the cache layout this model's kernels read (``allocate_kv_caches`` follows it)."""
        return self.attn.layout

    # ---- the forward pass ------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch,
                kv_caches: list[KVCache], *, check: bool = True) -> torch.Tensor:
        """Logits ``[num_reqs, vocab_size]`` (float32) of each request's last new token.

        ``check`` validates the inputs first (token ids within the vocabulary, positions within
        the context): one read of a few numbers to the host. It is skipped during a CUDA-graph
        capture, where host reads are not allowed (the engine checks its requests when they
        arrive).
        """
        if check and not (self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            self.check_inputs(input_ids, positions, batch, kv_caches)
        cfg = self.config
        # A batch with prefills reads its layout to the host once, here; a decode batch reads nothing.
        split = None
        if not batch.is_decode_only:
            if self.attn.needs_split:
                split = split_batch(batch, self.block_size_of(kv_caches))
            else:
                read_layout(batch)   # checked once here; the prefill kernel then reads no host data

        if self.fused:
            return self._forward_fused(input_ids, positions, batch, kv_caches, split)
        hidden = self.embed_tokens[input_ids]                               # [T, hidden]
        cos, sin = self.rotary.angles(positions)                            # once for all layers
        num_qk_heads = cfg.num_attention_heads + cfg.num_key_value_heads
        for layer, kv_cache in zip(self.layers, kv_caches):
            # --- attention block ---
            x = rms_norm(hidden, layer["input_layernorm"], cfg.rms_norm_eps)
            qkv = F.linear(x, layer["qkv_proj"])
            qk, v = qkv.split([cfg.q_size + cfg.kv_size, cfg.kv_size], dim=-1)
            # Queries and keys are rotated alike: as one tensor of query heads then key heads.
            qk = self.rotary.rotate(qk.view(-1, num_qk_heads, cfg.head_dim), cos, sin)
            q, k = qk.split([cfg.num_attention_heads, cfg.num_key_value_heads], dim=1)
            v = v.view(-1, cfg.num_key_value_heads, cfg.head_dim)
            o = self._attend(q, k, v, kv_cache, batch, split)
            hidden = hidden + F.linear(o.reshape(-1, cfg.q_size), layer["o_proj"])
            # --- MLP block (SwiGLU) ---
            x = rms_norm(hidden, layer["post_attention_layernorm"], cfg.rms_norm_eps)
            gate, up = F.linear(x, layer["gate_up_proj"]).chunk(2, dim=-1)
            hidden = hidden + F.linear(F.silu(gate) * up, layer["down_proj"])

        # Only each request's last new token is sampled from: request i's is row query_start_loc[i+1] - 1.
        last = batch.query_start_loc[1:].long() - 1
        hidden = rms_norm(hidden[last], self.norm, cfg.rms_norm_eps)
        return F.linear(hidden, self.lm_head).float()

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, batch: ForwardBatch,
                split) -> torch.Tensor:
        """Write the step's keys and values, then attend (the decode kernel for a decode batch)."""
        self.attn.write(k, v, kv_cache, batch.slot_mapping)
        if batch.is_decode_only:
            return self.attn.decode(q, kv_cache, batch)
        return self.attn.mixed(q, kv_cache, batch, split)

    def _forward_fused(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch,
                       kv_caches: list[KVCache], split) -> torch.Tensor:
        """The same layers with fused Triton kernels (on a GPU): each residual add with the RMSNorm
        after it, the rotary embedding in place on the QKV output, and SwiGLU's product. The
        arithmetic is
        the unfused path's, in the same order and precision; a decode step launches about half
        as many kernels."""
        from paged_attention.kernels.triton.layer_ops import add_rms_norm, rotary_, silu_and_mul

        cfg = self.config
        num_qk_heads = cfg.num_attention_heads + cfg.num_key_value_heads
        residual = self.embed_tokens[input_ids]                             # [T, hidden], a fresh tensor
        x = add_rms_norm(residual, self.layers[0]["input_layernorm"], cfg.rms_norm_eps)
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            qkv = F.linear(x, layer["qkv_proj"])
            qk = rotary_(qkv[:, :cfg.q_size + cfg.kv_size].view(-1, num_qk_heads, cfg.head_dim),
                         self.rotary.cos_sin, positions)
            q, k = qk.split([cfg.num_attention_heads, cfg.num_key_value_heads], dim=1)
            v = qkv[:, cfg.q_size + cfg.kv_size:].view(-1, cfg.num_key_value_heads, cfg.head_dim)
            o = self._attend(q, k, v, kv_cache, batch, split)
            # residual += o_proj(o); x = rms_norm(residual)
            x = add_rms_norm(F.linear(o.reshape(-1, cfg.q_size), layer["o_proj"]),
                             layer["post_attention_layernorm"], cfg.rms_norm_eps, residual)
            act = silu_and_mul(F.linear(x, layer["gate_up_proj"]))
            # residual += down_proj(...); x = the next layer's input norm (the final norm after the last)
            next_norm = self.layers[i + 1]["input_layernorm"] if i + 1 < len(self.layers) else self.norm
            x = add_rms_norm(F.linear(act, layer["down_proj"]), next_norm, cfg.rms_norm_eps, residual)
        last = batch.query_start_loc[1:].long() - 1
        return F.linear(x[last], self.lm_head).float()

    __call__ = forward

    # ---- checks ----------------------------------------------------------------------------
    @staticmethod
    def block_size_of(kv_caches: list[KVCache]) -> int:
        """Tokens per block of these caches (flash: dimension 1; v0 value cache: the last)."""
        key_cache, value_cache = kv_caches[0]
        return key_cache.size(1) if key_cache.dim() == 4 else value_cache.size(3)

    def check_token_ids(self, token_ids: torch.Tensor | list[int]) -> None:
        """ValueError unless every id is in ``[0, vocab_size)``; TypeError unless they are ints."""
        if isinstance(token_ids, torch.Tensor):
            if token_ids.dtype not in (torch.int64, torch.int32):
                raise TypeError(f"token ids must be int64 (or int32), got {token_ids.dtype}")
            if token_ids.numel() == 0:
                return
            lo, hi = torch.stack([token_ids.min(), token_ids.max()]).tolist()
        else:
            ids = list(token_ids)
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
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
