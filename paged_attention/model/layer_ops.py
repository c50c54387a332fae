"""The operations a layer repeats besides its attention, chosen once per model.

A Llama layer (``model/llama.py``) is two sub-layers, each a norm, then work, then a projection
added back into the residual stream. The stream travels between them as a ``ResidualStream``:
``hidden + residual``, where the add may still be owed (the next norm does it, in the same
kernel), plus, when the kernel that wrote the stream already summed its squares, those sums.
The operations:

* ``norm_linear(stream, norm_weight, weight)``: the stream (its add done) RMS-normalised, then
  projected (the QKV projection); returns ``(out, stream tensor)``, the stream for the next add;
* ``norm_linear_silu_mul(stream, norm_weight, gate_up_weight)``: the same with the gate-up
  projection and SwiGLU's ``silu(gate) * up`` after it;
* ``linear_add(x, weight, residual)``: a projection ending a sub-layer (o_proj, down_proj): the
  new stream ``residual + F.linear(x, weight)``;
* ``rope_and_cache(qkv, rope, kv_cache, slot_mapping)``: rotate the queries and keys of the fused
  QKV projection's output, and store each token's key and value in its cache slot; returns the
  queries, which the attention reads;
* ``decode_attention(qkv, rope, kv_cache, batch)``: for a decode-only batch, ``rope_and_cache``
  then the decode attention (one Triton launch on a GPU: the decode kernel rotates and writes);
* ``norm(stream, weight)``: the final norm;
* ``argmax(logits)``: greedy sampling's pick, each row's first index of its largest logit;

and, as building blocks, ``add_norm(x, residual, weight)`` (``(rms_norm(x + residual), x +
residual)``) and ``silu_and_mul(gate_up)``.

Two sets: :class:`TorchLayerOps`, the torch lines of Hugging Face's Llama (six kernels for a norm,
about ten for the rotary embedding, a cache write after it; the add left to the norm), and
:class:`FusedLayerOps`, Triton launches (``kernels/triton/layer_ops.py``: the residual add with
the norm, the rotary embedding with the cache write; ``kernels/triton/fused_linear.py``: for a
small batch, each projection with what surrounds it: the norm in front, SwiGLU or the residual
add behind; in a decode step the rotary embedding and the cache write go into the attention
kernel, so that a small-batch decode layer is five launches: four projections and the attention). The model picks one when it is built, so its forward pass is one loop with no
per-call branching; the tests run both on the same inputs and compare.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from paged_attention.model.attention import KVCache, PagedAttention
from paged_attention.model.batch import ForwardBatch
from paged_attention.model.config import LlamaConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)``, the mean taken in float32 whatever ``x``'s dtype,
    then cast back before the weight, as Hugging Face's Llama does. (``F.rms_norm`` is one fused
    kernel on a GPU where the same lines written out would be six.)"""
    return weight * F.rms_norm(x.float(), (x.size(-1),), eps=eps).to(x.dtype)


class RotaryEmbedding:
    """Rotate-half RoPE (Hugging Face's Llama; vLLM's ``is_neox_style=True``), tables precomputed.

    Dimension ``j < D/2`` of a head is paired with dimension ``j + D/2``; at position ``p`` the pair
    turns by the angle ``p * theta^(-2j / D)``. (The GGUF's Q/K rows were un-permuted at load time
    to make this the right pairing: see ``model/weights.py``.) A step looks its positions' angles
    up once (``angles``), and every layer rotates its queries and keys together with them.
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


class ResidualStream(NamedTuple):
    """The residual stream between two sub-layers: ``hidden + residual`` (``residual`` None:
    ``hidden`` is the whole stream). ``sum_sq``: float32 ``[tokens, pieces]``, the squares of the
    stream's rows summed in pieces, when the kernel that wrote it had them in hand (the fused
    ``linear_add``); the next norm adds them up instead of reading the stream twice."""
    hidden: torch.Tensor
    residual: torch.Tensor | None = None
    sum_sq: torch.Tensor | None = None

    def rows(self, index: torch.Tensor) -> "ResidualStream":
        """The stream of the tokens ``index`` only (a prefill step samples each request's last)."""
        return ResidualStream(*(None if t is None else t[index] for t in self))


class TorchLayerOps:
    """The operations in plain torch (any device, any cache layout)."""

    def __init__(self, config: LlamaConfig, rotary: RotaryEmbedding, attn: PagedAttention) -> None:
        self.eps = config.rms_norm_eps
        self.rotary, self.attn = rotary, attn
        self.heads, self.kv_heads, self.head_dim = (config.num_attention_heads, config.num_key_value_heads,
                                                    config.head_dim)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            x = x + residual
        return rms_norm(x, weight, self.eps), x

    def rope_inputs(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What every layer's rotation needs, looked up once a step: the positions' angles."""
        return self.rotary.angles(positions)

    def rope_and_cache(self, qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_cache: KVCache,
                       slot_mapping: torch.Tensor) -> torch.Tensor:
        d = self.head_dim
        qk, v = qkv.split([(self.heads + self.kv_heads) * d, self.kv_heads * d], dim=-1)
        # Queries and keys turn alike: as one tensor of query heads then key heads.
        qk = self.rotary.rotate(qk.view(-1, self.heads + self.kv_heads, d), *rope)
        q, k = qk.split([self.heads, self.kv_heads], dim=1)
        self.attn.write(k, v.view(-1, self.kv_heads, d), kv_cache, slot_mapping)
        return q

    def decode_attention(self, qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_cache: KVCache,
                         batch: ForwardBatch) -> torch.Tensor:
        return self.attn.decode(self.rope_and_cache(qkv, rope, kv_cache, batch.slot_mapping), kv_cache, batch)

    @staticmethod
    def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def norm_linear(self, stream: ResidualStream, norm_weight: torch.Tensor, weight: torch.Tensor, *,
                    decode: bool = True, prefetch: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        # prefetch (a later projection's weights, a hint for the fused kernels) has no use here.
        x, residual = self.add_norm(stream.hidden, stream.residual, norm_weight)
        return F.linear(x, weight), residual

    def norm_linear_silu_mul(self, stream: ResidualStream, norm_weight: torch.Tensor, gate_up_weight: torch.Tensor,
                             *, decode: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = self.add_norm(stream.hidden, stream.residual, norm_weight)
        return self.silu_and_mul(F.linear(x, gate_up_weight)), residual

    @staticmethod
    def linear_add(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, *,
                   decode: bool = True, prefetch: torch.Tensor | None = None) -> ResidualStream:
        # The add is left to the next norm (Hugging Face adds, then norms: the same arithmetic).
        return ResidualStream(F.linear(x, weight), residual)

    def norm(self, stream: ResidualStream, weight: torch.Tensor) -> torch.Tensor:
        return self.add_norm(stream.hidden, stream.residual, weight)[0]

    @staticmethod
    def argmax(logits: torch.Tensor) -> torch.Tensor:
        return logits.argmax(dim=-1)

    def greedy_head(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Each row's most likely token: the argmax of ``F.linear(hidden, weight)``."""
        return self.argmax(F.linear(hidden, weight))


class FusedLayerOps:
    """The operations as Triton launches (a GPU; the interpreter runs them on a CPU, slowly, for
    the tests). The rotary embedding carries the cache write when the cache is in the flash
    layout; the v0 layout's writer (``attention="cuda"``) follows an in-place rotation. Launches go
    through ``Launcher``s made once: an eager step makes some two hundred.

    In a decode step of up to ``small_batch`` requests (``takes_fused``), where a GEMM library's
    fixed cost dominates, each projection is one ``fused_linear`` launch with its
    neighbours fused in: the norm in front of QKV and gate-up (from the sums of squares the
    previous ``linear_add`` handed over), SwiGLU behind gate-up, the residual add behind o_proj
    and down. Above it: cuBLAS's projections, with the add and the norm in one kernel between
    them, and SwiGLU in another. Measured on an H200 (``benchmarks/bench_fused_linear.py --layer``,
    bf16, SmolLM2-135M's 30 layers, each with its own weights as in the model, their projections
    and norms in a CUDA graph, graph us per layer, the PDL sweep's tiles at every row count):

    ======  ======  =====  ========================
    rows    cuBLAS  fused  fused, launched with PDL
    ======  ======  =====  ========================
    1       21.6    13.4   10.9
    8       24.0    23.5   20.4
    16      24.2    26.3   21.2
    64      25.2    26.4   23.0
    128     25.9    28.4   23.1
    ======  ======  =====  ========================

    Without programmatic dependent launch each kernel waits for the one before to end, then for
    its weights, and cuBLAS's tensor-core kernels win from 16 rows on. With it (``pdl.py``: a GPU
    of compute capability 9.0 or later) the next kernel's weights are on their way while this one
    finishes, and the fused layer wins at every count measured here. In the engine's decode steps
    it did up to 64 requests, not at 128 (1.10 against 1.04-1.06 ms of GPU time a step, the
    attention kernel included). Hence the default
    ``small_batch``: ``fused_linear.PDL_ROWS`` (64) where kernels launch with PDL, else
    ``fused_linear.CUDA_CORE_ROWS`` (4), the rows where the kernels multiply on
    the CUDA cores. The tiles are ``fused_linear.default_config``'s unless ``linear_config`` is
    set (a ``FusedLinearConfig``, or a function ``(M, N, K, silu_and_mul) -> FusedLinearConfig``).

    A projection given ``prefetch=`` (the model's QKV gives its layer's gate-up weights, o_proj
    gives down's) asks the L2 cache for those weights while it waits for its own input, so that
    the MLP's kernels, which start too late to bring their weights from memory in time, find them
    there: at ``prefetch_rows`` rows only, where it was measured to pay."""

    prefetch_rows: tuple[int, int] = (9, 32)
    """The token rows, both ends included, at which projections prefetch the weights they are given,
    where ``staged_linear`` does not take the shape (from ``staged_rows`` on it copies its own weights
    early). Measured before it, in the engine's decode steps (SmolLM2's shape, H100, alternating): GPU
    time a step -6 % at 16 requests, -3 % at 32; at 1, 4, 8 and 64 within 1 % either way."""

    def __init__(self, config: LlamaConfig, rotary: RotaryEmbedding, attn: PagedAttention) -> None:
        import triton

        from paged_attention.kernels.triton import layer_ops as k
        from paged_attention.triton_launch import Launcher
        from paged_attention.utils import next_power_of_2

        self.attn, self.cos_sin = attn, rotary.cos_sin
        self.heads, self.kv_heads, self.head_dim = (config.num_attention_heads, config.num_key_value_heads,
                                                    config.head_dim)
        hidden, inter = config.hidden_size, config.intermediate_size
        names = ("x_ptr", "residual_ptr", "weight_ptr", "out_ptr")
        self._norm = [Launcher(k._add_rms_norm_kernel, names, hidden=hidden, eps=float(config.rms_norm_eps),
                               HAS_RESIDUAL=has, BLOCK=next_power_of_2(hidden)) for has in (False, True)]
        self._act_block = min(1024, next_power_of_2(inter))
        self._act_cols = triton.cdiv(inter, self._act_block)
        self._act = Launcher(k._silu_and_mul_kernel, ("x_ptr", "out_ptr"), inter=inter, BLOCK=self._act_block)
        self._rotary = Launcher(k._rotary_kernel, ("x_ptr", "pos_ptr"), cos_sin_ptr=rotary.cos_sin,
                                row_stride=(self.heads + 2 * self.kv_heads) * self.head_dim, num_heads=self.heads
                                + self.kv_heads, HALF=self.head_dim // 2,
                                HEADS=next_power_of_2(self.heads + self.kv_heads))
        self._with_cache = attn.layout == "flash"
        self._rope_cache: dict[tuple, Launcher] = {}        # by the caches' strides and block size
        self._kernels, self._launcher, self._next_power_of_2 = k, Launcher, next_power_of_2
        from paged_attention.kernels.triton import argmax, fused_linear, pdl
        self._fused_linear, self._pdl, self._eps = fused_linear, pdl, float(config.rms_norm_eps)
        self._argmax = argmax.argmax
        from paged_attention.kernels.triton import lm_head
        self._lm_head = lm_head
        self._linear_launchers: dict[tuple, object] = {}     # Launchers; staged: (config, Launcher) or None
        self.small_batch = fused_linear.PDL_ROWS if pdl.enabled(rotary.cos_sin.device) else fused_linear.CUDA_CORE_ROWS
        self.linear_config = None

    @property
    def small_batch(self) -> int:
        """The most token rows that take the fused projection kernels (``fused_linear.PDL_ROWS`` or
        ``CUDA_CORE_ROWS`` by default, see the class docstring)."""
        return self._small_batch

    @small_batch.setter
    def small_batch(self, value: int) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"small_batch must be an int >= 0, got {value!r}")
        self._small_batch = value

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        out = torch.empty_like(x)
        if x.size(0):
            self._norm[residual is not None]((x.size(0),), x, x if residual is None else residual, weight, out)
        # Without a residual the input becomes the stream; with one, the kernel stored the sum into it.
        return out, x if residual is None else residual

    @staticmethod
    def rope_inputs(positions: torch.Tensor) -> torch.Tensor:
        return positions                      # the kernel looks the angles up itself

    def rope_and_cache(self, qkv: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache,
                       slot_mapping: torch.Tensor) -> torch.Tensor:
        tokens, d = qkv.size(0), self.head_dim
        q = qkv[:, :self.heads * d].view(tokens, self.heads, d)
        if not self._with_cache:
            if tokens:
                self._rotary((tokens,), qkv, positions)
            kv = qkv[:, self.heads * d:].view(tokens, 2, self.kv_heads, d)
            self.attn.write(kv[:, 0], kv[:, 1], kv_cache, slot_mapping)
            return q
        key_cache, value_cache = kv_cache
        key = (key_cache.stride(), value_cache.stride(), key_cache.size(1))
        launch = self._rope_cache.get(key)
        if launch is None:
            launch = self._rope_cache[key] = self._launcher(
                self._kernels._rotary_and_cache_kernel,
                ("qkv_ptr", "pos_ptr", "slot_ptr", "key_cache_ptr", "value_cache_ptr"),
                cos_sin_ptr=self.cos_sin, qkv_stride=qkv.stride(0), num_heads=self.heads,
                num_kv_heads=self.kv_heads, block_size=key_cache.size(1),
                kc_stride_blk=key_cache.stride(0), kc_stride_tok=key_cache.stride(1),
                kc_stride_head=key_cache.stride(2), vc_stride_blk=value_cache.stride(0),
                vc_stride_tok=value_cache.stride(1), vc_stride_head=value_cache.stride(2), HALF=d // 2,
                HEADS=self._next_power_of_2(self.heads), KV_HEADS=self._next_power_of_2(self.kv_heads))
        if tokens:
            launch((tokens,), qkv, positions, slot_mapping, key_cache, value_cache)
        return q

    def decode_attention(self, qkv: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache,
                         batch: ForwardBatch) -> torch.Tensor:
        if not self.attn.fuses_rope:
            return self.attn.decode(self.rope_and_cache(qkv, positions, kv_cache, batch.slot_mapping), kv_cache, batch)
        # One launch: Triton's decode kernel rotates the queries and the new keys, writes the keys
        # and values to their slots, then attends.
        q = qkv[:, :self.heads * self.head_dim].view(qkv.size(0), self.heads, self.head_dim)
        # With PDL only between fused projections (Triton's, which wait for it): cuBLAS's next
        # kernel would gain nothing from an early start.
        return self.attn.decode(q, kv_cache, batch, rope=(self.cos_sin, positions, batch.slot_mapping),
                                pdl=self.takes_fused(qkv.size(0), True))

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        out = gate_up.new_empty(gate_up.size(0), gate_up.size(1) // 2)
        if gate_up.size(0):
            self._act((gate_up.size(0), self._act_cols), gate_up, out)
        return out

    def takes_fused(self, rows: int, decode: bool) -> bool:
        """Whether a projection of ``rows`` token rows takes the fused kernels: a decode step
        (``decode``, one token a request) of up to ``small_batch`` requests. A step with prompt
        tokens takes cuBLAS's whatever its size, so that a prompt's numbers do not depend on
        whether its step was small (a request alone and in a batch then agree, as they did
        before ``small_batch`` reached prompt sizes)."""
        return decode and rows <= self._small_batch

    def norm_linear(self, stream: ResidualStream, norm_weight: torch.Tensor, weight: torch.Tensor, *,
                    decode: bool = True, prefetch: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.takes_fused(stream.hidden.size(0), decode):
            x, residual = self._add_norm_any_strides(stream, norm_weight)
            return F.linear(x, weight), residual
        out, residual, _ = self._fused(stream.hidden, weight, stream.residual, norm_weight, stream.sum_sq,
                                       prefetch=self._prefetch(stream.hidden.size(0), prefetch))
        return out, residual

    def norm_linear_silu_mul(self, stream: ResidualStream, norm_weight: torch.Tensor, gate_up_weight: torch.Tensor,
                             *, decode: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.takes_fused(stream.hidden.size(0), decode):
            x, residual = self._add_norm_any_strides(stream, norm_weight)
            return self.silu_and_mul(F.linear(x, gate_up_weight)), residual
        out, residual, _ = self._fused(stream.hidden, gate_up_weight, stream.residual, norm_weight, stream.sum_sq,
                                       silu=True)
        return out, residual

    def linear_add(self, x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, *,
                   decode: bool = True, prefetch: torch.Tensor | None = None) -> ResidualStream:
        if not self.takes_fused(x.size(0), decode):
            # cuBLAS's projection; the add is left to the next norm kernel, which does it too.
            return ResidualStream(F.linear(x, weight), residual)
        out, _, sum_sq = self._fused(x, weight, add=residual, prefetch=self._prefetch(x.size(0), prefetch))
        return ResidualStream(out, None, sum_sq)

    def _prefetch(self, rows: int, weight: torch.Tensor | None) -> torch.Tensor | None:
        """``weight`` where a projection of ``rows`` rows is to ask the L2 cache for it (a
        contiguous tensor, ``prefetch_rows`` rows), else None. ``_fused`` drops it where kernels
        launch without PDL."""
        low, high = self.prefetch_rows
        if weight is None or not low <= rows <= high or not weight.is_contiguous():
            return None
        return weight

    def norm(self, stream: ResidualStream, weight: torch.Tensor) -> torch.Tensor:
        return self._add_norm_any_strides(stream, weight)[0]

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        # Many programs read each row at once, then their winners are compared
        # (kernels/triton/argmax.py). In an H100's decode steps, against torch's reduction (three
        # rounds alternating, medians): GPU time a step 12 us less at 1 request, 21 at 16, 11 at
        # 64, 44 at 256.
        return self._argmax(logits)

    def greedy_head(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # Up to lm_head.MAX_ROWS rows the projection compares its own logits and never stores
        # them (kernels/triton/lm_head.py: 5.6 us less than cuBLAS and argmax() at 64 rows on an
        # H100); larger batches take the GEMM library and argmax().
        if self._lm_head.takes(hidden.size(0), weight.size(0)):
            return self._lm_head.lm_head_argmax(hidden, weight)
        return self.argmax(F.linear(hidden, weight))

    def _add_norm_any_strides(self, stream: ResidualStream, norm_weight: torch.Tensor
                              ) -> tuple[torch.Tensor, torch.Tensor]:
        # The norm kernel reads contiguous rows (what the model passes): copy a view first.
        residual = stream.residual
        return self.add_norm(stream.hidden.contiguous(), None if residual is None else residual.contiguous(),
                             norm_weight.contiguous())

    def _fused(self, x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None,
               norm_weight: torch.Tensor | None = None, sum_sq: torch.Tensor | None = None, *,
               silu: bool = False, add: torch.Tensor | None = None, prefetch: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """One ``fused_linear`` launch: ``(out, stream, sum_sq pieces of out)``. A norm in front
        (``norm_weight``; from ``sum_sq`` when given, else from a pass over ``x + residual``),
        SwiGLU (``silu``) or the residual add (``add``) behind; ``prefetch``, a contiguous tensor
        (``_prefetch``'s), asked of the L2 cache before the kernel waits."""
        fl = self._fused_linear
        M, K = x.shape
        N = weight.size(0) // 2 if silu else weight.size(0)
        config = self.linear_config
        if config is None:
            config = fl.default_config(M, N, K, silu)
        elif not isinstance(config, fl.FusedLinearConfig):
            config = config(M, N, K, silu)
        has_norm = norm_weight is not None
        tensors = [t for t in (x, weight, norm_weight, residual, sum_sq, add) if t is not None]
        if not all(t.is_contiguous() for t in tensors):
            # Views the fixed strides below do not describe: the checked front-ends, which honour strides.
            if add is not None:
                out, sums = fl.linear_add(x, weight, add, config=config)
                return out, x, sums
            act = "silu_and_mul" if silu else None
            if not has_norm:
                return fl.linear(x, weight, act=act, config=config), x, None
            return (*fl.norm_linear(x, norm_weight, weight, self._eps, residual, act=act, config=config,
                                    sum_sq=sum_sq), None)
        pieces = 0 if sum_sq is None else sum_sq.size(1)
        pdl_on = self._pdl.enabled(x.device)
        if pdl_on and M >= self.staged_rows and residual is None and (add is not None or sum_sq is not None):
            staged = self._staged(x, weight, norm_weight, sum_sq, add, silu, N, K, pieces)
            if staged is not None:
                return staged
        # The prefetch is issued while a kernel waits: only under PDL (Triton's interpreter has none).
        prefetch_numel = prefetch.numel() if prefetch is not None and pdl_on else 0
        key = (has_norm, residual is not None, silu, pieces, add is not None, pdl_on, N, K, prefetch_numel, config)
        launch = self._linear_launchers.get(key)
        if launch is None:
            # With PDL a launch may start before the previous kernel ends and read its weights
            # meanwhile: in a model's step no kernel writes a weight.
            launch = self._linear_launchers[key] = self._launcher(
                fl._fused_linear_kernel, ("x_ptr", "residual_ptr", "norm_weight_ptr", "weight_ptr", "out_ptr",
                                          "stream_ptr", "sum_sq_ptr", "add_ptr", "sums_out_ptr", "prefetch_ptr", "M"),
                N=N, K=K, eps=self._eps, num_sums=max(1, pieces), stride_xm=K, stride_xk=1, stride_rm=K,
                stride_rk=1, stride_nw=1, stride_wn=K, stride_wk=1, stride_sm=max(1, pieces), stride_sk=1,
                stride_am=N, stride_an=1, HAS_NORM=has_norm, HAS_RESIDUAL=residual is not None,
                SILU_AND_MUL=silu, NORM_FROM_SUMS=sum_sq is not None,
                BLOCK_S=fl._pieces_block(max(1, pieces)), ADD_RESIDUAL=add is not None,
                BLOCK_M=config.BLOCK_M, BLOCK_N=config.BLOCK_N, BLOCK_K=config.BLOCK_K, BLOCK_K2=config.BLOCK_K2,
                PREFETCH_NUMEL=prefetch_numel, num_warps=config.num_warps, num_stages=config.num_stages,
                **self._pdl.launch_options(pdl_on))
        out = x.new_empty(M, N)
        stream = x if residual is None else x.new_empty(M, K)
        col_tiles = -(-N // config.BLOCK_N)
        sums_out = None if add is None else torch.empty(M, col_tiles, dtype=torch.float32, device=x.device)
        if M:
            launch((col_tiles, -(-M // config.BLOCK_M)), x, x if residual is None else residual,
                   norm_weight if has_norm else x, weight, out, stream, out if sum_sq is None else sum_sq,
                   x if add is None else add, out if sums_out is None else sums_out,
                   prefetch if prefetch_numel else x, M)
        return out, stream, sums_out

    # The fewest token rows whose projections take ``staged_linear`` (its weights staged in shared
    # memory before the PDL wait) where it fits; fewer rows keep fused_linear's CUDA-core products.
    # GPU time a decode step of SmolLM2 on an H100, the four projections staged against not, three
    # rounds each: 0.543-0.548 against 0.559-0.584 ms at 16 requests, 0.578-0.633 against
    # 0.689-0.712 at 32, 0.760-0.819 against 0.861-0.908 at 64.
    staged_rows = 9

    def _staged(self, x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None,
                sum_sq: torch.Tensor | None, add: torch.Tensor | None, silu: bool, N: int, K: int, pieces: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
        """``_fused``'s launch by ``staged_linear`` (its tensors contiguous, a norm from sums or the
        residual add), or None where that kernel does not take the shape (then ``fused_linear``).
        A ``prefetch=`` region is not asked for here: this kernel copies its own weights early."""
        from paged_attention.kernels.triton import staged_linear as sl
        key = ("staged", norm_weight is not None, silu, pieces, add is not None, N, K, x.dtype)
        launch = self._linear_launchers.get(key, False)
        if launch is False:
            config = sl.supported(N, K, silu, x.dtype, x.device)
            launch = self._linear_launchers[key] = None if config is None else (config, self._launcher(
                sl._staged_linear_kernel, ("x_ptr", "weight_ptr", "norm_weight_ptr", "sum_sq_ptr", "add_ptr",
                                           "out_ptr", "sums_out_ptr", "M"),
                eps=self._eps, num_sums=max(1, pieces), **sl.kernel_constants(
                    N, K, config, norm=norm_weight is not None, silu_and_mul=silu, add=add is not None,
                    num_sums=max(1, pieces), pdl_on=True)))
        if launch is None:
            return None
        config, launch = launch
        out, sums_out, grid, tensors = sl.launch_tensors(x, weight, norm_weight, sum_sq, add, N, config)
        launch(grid, *tensors, x.size(0))
        return out, x, sums_out


def can_fuse(config: LlamaConfig) -> bool:
    """The fused rotary kernels handle a head size of twice a power of two (64 for SmolLM2)."""
    half = config.head_dim // 2
    return half & (half - 1) == 0


__all__ = ["rms_norm", "RotaryEmbedding", "TorchLayerOps", "FusedLayerOps", "can_fuse"]
