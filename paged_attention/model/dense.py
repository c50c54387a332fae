"""The same model with a plain contiguous KV cache per request: the check that paging changes nothing.

No blocks, no slots, no block table: each layer keeps one request's keys and values in a tensor
``[tokens so far, num_kv_heads, head_dim]`` that grows by ``torch.cat`` each step, and attention
is written out (scores, causal mask, softmax, weighted sum). It is written apart from
``model/llama.py`` (unfused weights, its own rotary embedding and norm), so that the two agree
only if both compute Llama. In float32 the paged forward's logits match these within 1e-4.
"""
from __future__ import annotations

import torch

from paged_attention.model.config import LlamaConfig
from paged_attention.model.weights import check_weights


class DenseLlama:
    """A Llama over one request, its KV cache a list of contiguous ``(keys, values)`` per layer."""

    def __init__(self, config: LlamaConfig, weights: dict[str, torch.Tensor]) -> None:
        check_weights(config, weights)
        self.config = config
        self.w = {name: t.float() for name, t in weights.items()}
        if config.tie_word_embeddings:
            self.w["lm_head.weight"] = self.w["model.embed_tokens.weight"]
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    @property
    def num_cached(self) -> int:
        return self.keys[0].size(0) if self.keys else 0

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return self.w[name] * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x [n, heads, D]: dims j and j + D/2 turn together by positions * theta^(-2j/D)
        d = self.config.head_dim
        inv_freq = 1.0 / (self.config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        angle = positions.float()[:, None] * inv_freq[None, :]
        cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    @torch.inference_mode()
    def forward(self, token_ids: list[int]) -> torch.Tensor:
        """Append ``token_ids`` to the request; logits ``[len(token_ids), vocab_size]`` of each."""
        cfg, w = self.config, self.w
        start, n = self.num_cached, len(token_ids)
        positions = torch.arange(start, start + n)
        group = cfg.num_attention_heads // cfg.num_key_value_heads
        x = w["model.embed_tokens.weight"][torch.tensor(token_ids, dtype=torch.long)]
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            h = self._norm(x, p + "input_layernorm.weight")
            q = (h @ w[p + "self_attn.q_proj.weight"].T).view(n, cfg.num_attention_heads, cfg.head_dim)
            k = (h @ w[p + "self_attn.k_proj.weight"].T).view(n, cfg.num_key_value_heads, cfg.head_dim)
            v = (h @ w[p + "self_attn.v_proj.weight"].T).view(n, cfg.num_key_value_heads, cfg.head_dim)
            q, k = self._rope(q, positions), self._rope(k, positions)
            if len(self.keys) <= i:
                self.keys.append(k)
                self.values.append(v)
            else:
                self.keys[i] = torch.cat([self.keys[i], k])
                self.values[i] = torch.cat([self.values[i], v])
            keys = self.keys[i].repeat_interleave(group, dim=1)       # [L, heads, D]: KV head h // group
            values = self.values[i].repeat_interleave(group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q, keys) / cfg.head_dim ** 0.5
            # query at position start + a sees keys 0 .. start + a
            visible = torch.arange(keys.size(0))[None, :] <= positions[:, None]
            scores = scores.masked_fill(~visible, float("-inf"))
            o = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).reshape(n, -1)
            x = x + o @ w[p + "self_attn.o_proj.weight"].T
            h = self._norm(x, p + "post_attention_layernorm.weight")
            gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
            x = x + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
        return self._norm(x, "model.norm.weight") @ w["lm_head.weight"].T


def dense_logits(config: LlamaConfig, weights: dict[str, torch.Tensor], token_ids: list[int]) -> torch.Tensor:
    """Logits ``[len(token_ids), vocab_size]`` of one sequence in a single pass."""
    return DenseLlama(config, weights).forward(list(token_ids))


def dense_generate(config: LlamaConfig, weights: dict[str, torch.Tensor], prompt_ids: list[int],
                   max_tokens: int, stop_token_ids: set[int] | None = None) -> list[int]:
    """Greedy decoding with the contiguous cache: the prompt in one step, then one token a step."""
    model = DenseLlama(config, weights)
    logits = model.forward(list(prompt_ids))[-1]
    out: list[int] = []
    for _ in range(max_tokens):
        token = int(logits.argmax())
        out.append(token)
        if stop_token_ids and token in stop_token_ids:
            break
        logits = model.forward([token])[-1]
    return out
