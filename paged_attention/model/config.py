"""The shape of a Llama model: the handful of numbers the forward pass and the KV cache need.

Field names follow Hugging Face's ``LlamaConfig``. A GGUF file carries the same numbers as
metadata under ``llama.*`` keys (llama.cpp's names); :meth:`LlamaConfig.from_gguf_fields` maps
one onto the other. :meth:`LlamaConfig.tiny` is a two-layer model of the same architecture, small
enough that the tests can run it in the Triton interpreter in a second.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from paged_attention.utils import check_int


@dataclass(frozen=True)
class LlamaConfig:
    """Llama's hyper-parameters (SmolLM2-135M: 30 layers, hidden 576, 9 query heads over 3 KV heads)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int            # width of the SwiGLU MLP
    num_hidden_layers: int
    num_attention_heads: int          # query heads
    num_key_value_heads: int          # KV heads: each serves num_attention_heads / num_key_value_heads queries
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048   # the context the model was trained for (GGUF: context_length)
    tie_word_embeddings: bool = True      # the output projection is the embedding matrix
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            object.__setattr__(self, name, check_int(f"LlamaConfig.{name}", getattr(self, name), 1))
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even (rotary embedding turns pairs), got {self.head_dim}")

    @property
    def q_size(self) -> int:
        """Width of all query heads together: the rows of q_proj."""
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of all KV heads together: the rows of k_proj (and of v_proj)."""
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_gguf_fields(cls, fields: Mapping[str, Any]) -> "LlamaConfig":
        """Build from GGUF metadata (``{key: value}``, values already decoded).

        Only ``general.architecture == "llama"`` is accepted: another architecture would load
        without complaint and compute nonsense.
        """
        arch = fields.get("general.architecture")
        if arch != "llama":
            raise ValueError(f"expected a GGUF file of architecture 'llama', got {arch!r}")

        def get(key: str, default: Any = None) -> Any:
            value = fields.get(f"llama.{key}", default)
            if value is None:
                raise ValueError(f"the GGUF file has no 'llama.{key}' metadata")
            return value

        num_heads = int(get("attention.head_count"))
        hidden = int(get("embedding_length"))
        vocab = fields.get("llama.vocab_size")
        if vocab is None:   # older files: the vocabulary's length
            vocab = len(fields["tokenizer.ggml.tokens"])
        return cls(
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length")),
            num_hidden_layers=int(get("block_count")),
            num_attention_heads=num_heads,
            num_key_value_heads=int(get("attention.head_count_kv", num_heads)),
            head_dim=int(get("rope.dimension_count", hidden // num_heads)),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            max_position_embeddings=int(get("context_length")),
            # llama.cpp stores no output.weight when the output projection is the embedding
            tie_word_embeddings=bool(fields.get("_tied", True)),
            bos_token_id=_opt_int(fields.get("tokenizer.ggml.bos_token_id")),
            eos_token_id=_opt_int(fields.get("tokenizer.ggml.eos_token_id")),
        )

    @classmethod
    def tiny(cls, **overrides: Any) -> "LlamaConfig":
        """A two-layer model for fast tests: hidden 64, 4 query heads over 2 KV heads of 16, vocabulary 128."""
        values = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
                      rope_theta=10000.0, max_position_embeddings=512, tie_word_embeddings=True,
                      bos_token_id=None, eos_token_id=None)
        values.update(overrides)
        return cls(**values)


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)
