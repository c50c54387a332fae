"""From a model's layers to bound, shaped KV-cache tensors.

The path, as in ``vllm/v1/worker/gpu/attn_utils.py``:

1. ``get_kv_cache_spec``: one spec per layer (layers that reuse another layer's cache have none);
2. ``get_kv_cache_config``: a memory budget becomes a number of blocks, raw buffers and groups;
3. ``_allocate_kv_cache``: one zeroed int8 tensor per buffer, the same object for every layer
   that shares it;
4. ``_reshape_kv_cache``: each layer's view of its bytes, in the backend's logical shape, with
   the memory order of the backend's stride order;
5. ``bind_kv_cache``: each view is set on its layer object and appended to the runner's list.

``init_kv_cache`` runs 3 to 5. ``build_attn_metadata`` builds the per-step metadata.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from paged_attention.kv_cache.backends import AttentionBackend, FlashInferBackend
from paged_attention.kv_cache.interface import (
    AttentionSpec, FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheSpec, KVCacheTensor, get_dtype_size)
from paged_attention.kv_cache.layer import Attention
from paged_attention.utils import VllmAssertion, check_device, check_int


class KVCacheInitError(ValueError, VllmAssertion):
    """The config and the tensors do not fit together (vLLM asserts these)."""


def _check_config(kv_cache_config: object) -> KVCacheConfig:
    """``kv_cache_config`` if it is a well-formed ``KVCacheConfig`` (its fields are re-checked:
    they can be edited after construction); TypeError/ValueError otherwise."""
    if not isinstance(kv_cache_config, KVCacheConfig):
        raise TypeError(f"kv_cache_config must be a KVCacheConfig, got {kv_cache_config!r}")
    kv_cache_config.validate()
    return kv_cache_config


def _check_shared_layers(shared_kv_cache_layers: object) -> dict[str, str]:
    """``{sharing layer: target layer}`` (None: no sharing); TypeError for anything else."""
    if shared_kv_cache_layers is None:
        return {}
    if not isinstance(shared_kv_cache_layers, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in shared_kv_cache_layers.items()):
        raise TypeError("shared_kv_cache_layers must be a dict of layer name -> target layer "
                        f"name, got {shared_kv_cache_layers!r}")
    return shared_kv_cache_layers


# ---- specs ---------------------------------------------------------------------------------------
def _check_layers(attn_layers: object) -> None:
    """TypeError unless ``attn_layers`` is a dict of layer name -> ``Attention``."""
    if not isinstance(attn_layers, dict):
        raise TypeError(f"attn_layers must be a dict of name -> Attention, got "
                        f"{type(attn_layers).__name__}")
    for name, layer in attn_layers.items():
        if not isinstance(layer, Attention):
            raise TypeError(f"layer {name!r} is not an Attention, got {type(layer).__name__}")


def _validate_kv_sharing(attn_layers: dict[str, Attention]) -> dict[str, str]:
    """``{sharing layer: the layer whose cache it really uses}``; targets must come earlier."""
    names = list(attn_layers)
    shared: dict[str, str] = {}
    for pos, (name, layer) in enumerate(attn_layers.items()):
        target = layer.kv_sharing_target_layer_name
        if target is None:
            continue
        if target == name:
            raise ValueError(f"kv_sharing_target_layer_name {target!r} is not valid: a layer "
                             "cannot share its own KV cache.")
        if target not in attn_layers:
            raise ValueError(f"kv_sharing_target_layer_name {target!r} of layer {name!r} is "
                             "not an attention layer of the model.")
        if names.index(target) > pos:
            raise ValueError(f"kv_sharing_target_layer_name {target!r} must come before the "
                             f"layer that shares it ({name!r}).")
        t = attn_layers[target]
        if (t.num_kv_heads, t.head_size, t.sliding_window) != \
                (layer.num_kv_heads, layer.head_size, layer.sliding_window):
            raise ValueError(f"layer {name!r} cannot share the KV cache of {target!r}: their "
                             "KV heads, head size or sliding window differ.")
        # a target that shares too: follow it to the layer that owns the cache
        shared[name] = shared.get(target, target)
    return shared


def get_kv_cache_spec(attn_layers: dict[str, Attention], block_size: int,
                      kv_cache_dtype: torch.dtype) -> dict[str, KVCacheSpec]:
    """One spec per layer, in layer order; KV-sharing layers (spec None) are skipped.

    Sharing targets are checked: they must exist and come before the layer (ValueError).
    """
    _check_layers(attn_layers)
    if not isinstance(kv_cache_dtype, torch.dtype):
        raise TypeError(f"kv_cache_dtype must be a torch.dtype, got {kv_cache_dtype!r}")
    check_int("block_size", block_size, 1)
    _validate_kv_sharing(attn_layers)
    specs: dict[str, KVCacheSpec] = {}
    for name, layer in attn_layers.items():
        spec = layer.get_kv_cache_spec(block_size, kv_cache_dtype)
        if spec is not None:
            specs[name] = spec
    return specs


def get_shared_kv_cache_layers(attn_layers: dict[str, Attention]) -> dict[str, str]:
    """``{sharing layer: target layer}`` for the layers that reuse another layer's cache."""
    _check_layers(attn_layers)
    return _validate_kv_sharing(attn_layers)


# ---- memory budget -> config ----------------------------------------------------------------------
def get_kv_cache_config(kv_cache_spec: dict[str, KVCacheSpec], available_memory: int,
                        num_gpu_blocks_override: int | None = None,
                        shared_kv_cache_layers: dict[str, str] | None = None) -> KVCacheConfig:
    """Turn a memory budget in bytes into a ``KVCacheConfig``.

    * All layers with one spec: one group, one tensor per layer,
      ``num_blocks = available_memory // page_size // num_layers``.
    * Several specs with one page size (hybrid): one group per spec (first-seen order), tensor
      ``i`` shared by layer ``i`` of every group, ``num_blocks = available // page // max
      layers per group``.
    * ``shared_kv_cache_layers`` (``{layer: target}``): each sharing layer joins its target's
      group; it has no tensor of its own (``_reshape_kv_cache`` aliases it to its target).
    """
    if not isinstance(kv_cache_spec, dict) or not kv_cache_spec:
        raise ValueError("kv_cache_spec must be a non-empty dict of layer name -> spec")
    check_int("available_memory", available_memory, 0)
    shared_kv_cache_layers = _check_shared_layers(shared_kv_cache_layers)
    groups: list[tuple[KVCacheSpec, list[str]]] = []
    for name, spec in kv_cache_spec.items():
        if not isinstance(spec, KVCacheSpec):
            raise TypeError(f"spec of layer {name!r} is not a KVCacheSpec: {spec!r}")
        for g_spec, names in groups:
            if g_spec == spec:
                names.append(name)
                break
        else:
            groups.append((spec, [name]))
    page_sizes = {spec.page_size_bytes for spec, _ in groups}
    if len(page_sizes) != 1:
        raise NotImplementedError(
            f"layers with different page sizes ({sorted(page_sizes)}) are not supported")
    page_size = page_sizes.pop()
    # Specs check their fields, but a subclass computes its own page size: refuse a page that
    # is not a positive int here rather than divide by it.
    check_int("page_size_bytes of the specs", page_size, 1)
    group_size = max(len(names) for _, names in groups)
    if num_gpu_blocks_override is not None:
        num_blocks = check_int("num_gpu_blocks_override", num_gpu_blocks_override, 1)
    else:
        num_blocks = available_memory // page_size // group_size
    if num_blocks < 1:
        raise ValueError(
            f"Not enough memory for the KV cache: {available_memory} bytes available, but one "
            f"block for each of {group_size} layer(s) needs {page_size * group_size} bytes "
            f"(page size {page_size}).")
    tensors = [KVCacheTensor(size=page_size * num_blocks,
                             shared_by=[names[i] for _, names in groups if i < len(names)])
               for i in range(group_size)]
    kv_groups = [KVCacheGroupSpec(layer_names=list(names),
                                  kv_cache_spec=type(spec).merge([kv_cache_spec[n]
                                                                  for n in names]))
                 for spec, names in groups]
    for layer, target in shared_kv_cache_layers.items():
        for group in kv_groups:
            if target in group.layer_names:
                group.layer_names.append(layer)
                break
        else:
            raise ValueError(f"KV sharing target {target!r} of layer {layer!r} has no KV "
                             "cache spec.")
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors,
                         kv_cache_groups=kv_groups)


# ---- allocate, reshape, bind ---------------------------------------------------------------------
def _allocate_kv_cache(kv_cache_config: KVCacheConfig, device: torch.device | str,
                       *, shared_kv_cache_layers: dict[str, str] | None = None
                       ) -> dict[str, torch.Tensor]:
    """One zero-filled int8 tensor of ``size`` bytes per ``KVCacheTensor``; every layer in its
    ``shared_by`` maps to that same tensor object."""
    kv_cache_config = _check_config(kv_cache_config)
    device = check_device("device", device)
    shared_kv_cache_layers = _check_shared_layers(shared_kv_cache_layers)
    raw: dict[str, torch.Tensor] = {}
    for kv_tensor in kv_cache_config.kv_cache_tensors:
        size = check_int("KVCacheTensor.size", kv_tensor.size, 1)
        tensor = torch.zeros(size, dtype=torch.int8, device=device)
        for name in kv_tensor.shared_by:
            if name in raw:
                raise KVCacheInitError(f"layer {name!r} is in more than one KVCacheTensor")
            raw[name] = tensor
    expected = {name for group in kv_cache_config.kv_cache_groups
                for name in group.layer_names} - set(shared_kv_cache_layers)
    if set(raw) != expected:
        raise KVCacheInitError(
            "Some layers are not correctly initialized: tensors cover "
            f"{sorted(raw)}, groups name {sorted(expected)}")
    return raw


def _reshape_kv_cache(kv_cache_config: KVCacheConfig,
                      kv_cache_raw_tensors: dict[str, torch.Tensor],
                      attn_backends: dict[str, type[AttentionBackend]],
                      layout: str = "NHD", *, cache_dtype: str = "auto",
                      kernel_block_sizes: list[int] | None = None,
                      shared_kv_cache_layers: dict[str, str] | None = None
                      ) -> dict[str, torch.Tensor]:
    """Each layer's typed view of its raw bytes.

    The view has the backend's logical shape (``get_kv_cache_shape``); in memory its
    dimensions lie in the order ``get_kv_cache_stride_order(layout)`` gives: the bytes are
    viewed in that physical shape and the view is permuted back. Sharing layers get their
    target's view object.
    """
    kv_cache_config = _check_config(kv_cache_config)
    shared = dict(_check_shared_layers(shared_kv_cache_layers))
    for what, mapping in (("kv_cache_raw_tensors", kv_cache_raw_tensors),
                          ("attn_backends", attn_backends)):
        if not isinstance(mapping, dict):
            raise TypeError(f"{what} must be a dict keyed by layer name, got {mapping!r}")
    if kernel_block_sizes is not None:
        if not isinstance(kernel_block_sizes, (list, tuple)):
            raise TypeError(f"kernel_block_sizes must be a list of ints (one per KV-cache "
                            f"group) or None, got {kernel_block_sizes!r}")
        if len(kernel_block_sizes) != len(kv_cache_config.kv_cache_groups):
            raise ValueError(f"kernel_block_sizes has {len(kernel_block_sizes)} entries for "
                             f"{len(kv_cache_config.kv_cache_groups)} KV-cache groups")
        kernel_block_sizes = [check_int(f"kernel_block_sizes[{i}]", k, 1)
                              for i, k in enumerate(kernel_block_sizes)]
    kv_caches: dict[str, torch.Tensor] = {}
    for g, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        if not isinstance(spec, AttentionSpec):
            raise NotImplementedError(f"unsupported KV cache spec {type(spec).__name__}")
        page_size = spec.page_size_bytes
        for name in group.layer_names:
            if name in shared:
                continue
            if name not in kv_cache_raw_tensors:
                raise KVCacheInitError(f"no raw tensor for layer {name!r}")
            if name not in attn_backends:
                raise KVCacheInitError(f"no attention backend for layer {name!r}")
            raw = kv_cache_raw_tensors[name]
            if not isinstance(raw, torch.Tensor):
                raise TypeError(f"raw KV cache of {name!r} must be a torch.Tensor, got "
                                f"{type(raw).__name__}")
            if raw.dtype != torch.int8 or raw.dim() != 1:
                raise TypeError(f"raw KV cache of {name!r} must be a 1-D int8 tensor, got "
                                f"{raw.dtype} with shape {tuple(raw.shape)}")
            if raw.numel() % page_size != 0:
                raise KVCacheInitError(
                    f"raw KV cache of {name!r} has {raw.numel()} bytes, not a multiple of "
                    f"the page size {page_size}")
            num_blocks = raw.numel() // page_size
            kbs = spec.block_size if kernel_block_sizes is None else kernel_block_sizes[g]
            if kbs != spec.block_size:
                if spec.block_size % kbs != 0:
                    raise ValueError(f"kernel block size {kbs} does not divide block size "
                                     f"{spec.block_size}")
                num_blocks *= spec.block_size // kbs
            shape_bs = spec.storage_block_size if spec.storage_block_size != spec.block_size \
                else kbs
            backend = attn_backends[name]
            shape = backend.get_kv_cache_shape(num_blocks, shape_bs, spec.num_kv_heads,
                                               spec.head_size, cache_dtype_str=cache_dtype)
            try:
                order = tuple(backend.get_kv_cache_stride_order(layout))
            except (AttributeError, NotImplementedError):
                order = tuple(range(len(shape)))
            if sorted(order) != list(range(len(shape))):
                raise KVCacheInitError(f"stride order {order} does not fit shape {shape}")
            physical = tuple(shape[i] for i in order)
            inverse = [order.index(i) for i in range(len(order))]
            typed = raw.view(spec.dtype)
            if spec.page_size_padded is None:
                view = typed.view(physical)
            else:
                # A padded page: each block's page starts page_size bytes after the previous
                # one, so the *block* dimension gets that stride and every other dimension is
                # laid out contiguously inside the page, in physical order. The block dimension
                # is the one that changes with num_blocks (not always the outermost: it is the
                # second in FlashAttention's (2, N, B, H, D), where giving the padded stride to
                # dimension 0 made K and V pages overlap).
                grown = backend.get_kv_cache_shape(num_blocks + 1, shape_bs, spec.num_kv_heads,
                                                   spec.head_size, cache_dtype_str=cache_dtype)
                block_dim = order.index(next(i for i, (a, b) in enumerate(zip(shape, grown)) if a != b))
                strides = [0] * len(physical)
                inner = 1
                for d in range(len(physical) - 1, -1, -1):
                    if d != block_dim:
                        strides[d] = inner
                        inner *= physical[d]
                strides[block_dim] = page_size // get_dtype_size(spec.dtype)
                view = torch.as_strided(typed, physical, strides)
            kv_caches[name] = view.permute(*inverse)
    for name, target in shared.items():
        while target in shared:
            target = shared[target]
        if target not in kv_caches:
            raise KVCacheInitError(f"KV sharing target {target!r} of layer {name!r} has no "
                                   "KV cache")
        kv_caches[name] = kv_caches[target]
    return kv_caches


def extract_layer_index(layer_name: str) -> int:
    """The one integer in a layer name ("model.layers.3.attn" -> 3)."""
    if not isinstance(layer_name, str):
        raise TypeError(f"a layer name must be a str, got {layer_name!r}")
    found = re.findall(r"\d+", layer_name)
    if len(found) != 1:
        raise ValueError(f"layer name {layer_name!r} must contain exactly one integer, "
                         f"found {found}")
    return int(found[0])


_UNBOUND = object()     # a layer that had no ``kv_cache`` attribute before a bind


def _check_bind_targets(names: list[str], forward_context: Any,
                        runner_kv_caches: Any) -> list[str]:
    """Everything a bind of ``names`` needs, checked before anything is bound: an empty runner
    list, a layer object in ``forward_context`` for every name, names with one layer index.
    Returns the names in binding order (ascending layer index; ties keep their order)."""
    if not isinstance(runner_kv_caches, list):
        raise TypeError(f"runner_kv_caches must be a list, got {runner_kv_caches!r}")
    if runner_kv_caches:
        raise ValueError("runner_kv_caches must be empty before binding")
    if not isinstance(forward_context, Mapping):
        raise TypeError("forward_context must be a dict of layer name -> layer, got "
                        f"{forward_context!r}")
    missing = [name for name in names if name not in forward_context]
    if missing:
        raise KeyError(f"layer(s) {missing} not in forward_context: nothing was bound")
    for name in names:
        if forward_context[name] is None:
            raise TypeError(f"forward_context[{name!r}] is None, not a layer")
    return sorted(names, key=extract_layer_index)    # sorted() is stable


def bind_kv_cache(kv_caches: dict[str, torch.Tensor], forward_context: dict[str, Any],
                  runner_kv_caches: list[torch.Tensor], num_attn_module: int = 1) -> None:
    """Append the caches to ``runner_kv_caches`` in ascending layer index (ties keep their
    order) and set ``forward_context[layer].kv_cache`` to the same object.

    All or nothing: the arguments are checked first, and a layer object that refuses the
    attribute undoes the layers bound before it, so a refused call leaves every layer and the
    runner list as they were and can simply be retried.
    """
    if not isinstance(kv_caches, dict):
        raise TypeError(f"kv_caches must be a dict of layer name -> tensor, got {kv_caches!r}")
    for name, kv_cache in kv_caches.items():
        if not isinstance(kv_cache, torch.Tensor):
            raise TypeError(f"kv_caches[{name!r}] must be a torch.Tensor, got "
                            f"{type(kv_cache).__name__}")
    order = _check_bind_targets(list(kv_caches), forward_context, runner_kv_caches)
    bound: list[tuple[Any, Any]] = []
    for name, kv_cache in kv_caches.items():
        layer = forward_context[name]
        before = getattr(layer, "kv_cache", _UNBOUND)
        try:
            layer.kv_cache = kv_cache
        except (AttributeError, TypeError) as e:
            for done, old in reversed(bound):
                if old is _UNBOUND:
                    del done.kv_cache
                else:
                    done.kv_cache = old
            raise TypeError(f"cannot bind the KV cache of layer {name!r}: its "
                            f"{type(layer).__name__} object refuses .kv_cache ({e}); nothing "
                            "was bound") from e
        bound.append((layer, before))
    runner_kv_caches.extend(kv_caches[name] for name in order)


def init_kv_cache(runner_kv_caches: list[torch.Tensor], forward_context: dict[str, Any],
                  kv_cache_config: KVCacheConfig,
                  attn_backends: dict[str, type[AttentionBackend]],
                  device: torch.device | str, layout: str = "NHD", *,
                  cache_dtype: str = "auto", kernel_block_sizes: list[int] | None = None,
                  shared_kv_cache_layers: dict[str, str] | None = None
                  ) -> dict[str, torch.Tensor]:
    """Allocate, reshape and bind; returns ``{layer: view}``.

    ``shared_kv_cache_layers`` defaults to the sharing targets of the layers in
    ``forward_context`` (``Attention.kv_sharing_target_layer_name``). Every argument is checked
    before anything is allocated or bound: a refused call changes no layer and no list.
    """
    kv_cache_config = _check_config(kv_cache_config)
    device = check_device("device", device)
    if not isinstance(forward_context, Mapping):
        raise TypeError("forward_context must be a dict of layer name -> layer, got "
                        f"{forward_context!r}")
    if shared_kv_cache_layers is None:
        shared_kv_cache_layers = {
            name: layer.kv_sharing_target_layer_name
            for name, layer in forward_context.items()
            if getattr(layer, "kv_sharing_target_layer_name", None) is not None}
    shared_kv_cache_layers = _check_shared_layers(shared_kv_cache_layers)
    # The layers the bind will touch: every layer of a group, and every sharing layer.
    names = list(dict.fromkeys([name for group in kv_cache_config.kv_cache_groups
                                for name in group.layer_names] + list(shared_kv_cache_layers)))
    _check_bind_targets(names, forward_context, runner_kv_caches)
    raw = _allocate_kv_cache(kv_cache_config, device,
                             shared_kv_cache_layers=shared_kv_cache_layers)
    kv_caches = _reshape_kv_cache(kv_cache_config, raw, attn_backends, layout,
                                  cache_dtype=cache_dtype,
                                  kernel_block_sizes=kernel_block_sizes,
                                  shared_kv_cache_layers=shared_kv_cache_layers)
    bind_kv_cache(kv_caches, forward_context, runner_kv_caches)
    return kv_caches


# ---- attention metadata --------------------------------------------------------------------------
@dataclass
class CommonAttentionMetadata:
    """What every backend's metadata builder starts from, for one KV-cache group."""

    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens: torch.Tensor
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    block_table_tensor: torch.Tensor
    slot_mapping: torch.Tensor
    causal: bool = True
    seq_lens_cpu_upper_bound: torch.Tensor | None = None
    dcp_local_seq_lens: torch.Tensor | None = None
    positions: torch.Tensor | None = None


class CommonMetadataBuilder:
    """A builder that hands the common metadata through unchanged (real backends add their
    own fields here)."""

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              **kwargs: Any) -> CommonAttentionMetadata:
        return common_attn_metadata

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata
                                    ) -> CommonAttentionMetadata:
        return common_attn_metadata


@dataclass
class AttentionGroup:
    """Layers of one KV-cache group that share a backend and a spec, and their builder."""

    backend: type[AttentionBackend]
    layer_names: list[str]
    kv_cache_spec: KVCacheSpec
    kv_cache_group_id: int = 0
    metadata_builders: list = field(default_factory=lambda: [CommonMetadataBuilder()])

    def get_metadata_builder(self, ubatch_id: int = 0):
        return self.metadata_builders[ubatch_id]


def _check_rows(name: str, tensor: Any, need: int, what: str, dims: int | None = None) -> None:
    """TypeError unless ``tensor`` is a tensor (of ``dims`` dimensions if given); ValueError
    unless it has at least ``need`` rows (``what`` says where that number comes from)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() == 0 or (dims is not None and tensor.dim() != dims):
        raise ValueError(f"{name} must have {dims or 'at least 1'} dimension(s), got shape "
                         f"{tuple(tensor.shape)}")
    if tensor.shape[0] < need:
        raise ValueError(f"{name} has {tensor.shape[0]} entries, fewer than {what} = {need}")


def build_attn_metadata(attn_groups: list[list[AttentionGroup]], num_reqs: int,
                        num_tokens: int, query_start_loc_gpu: torch.Tensor,
                        query_start_loc_cpu: torch.Tensor, max_query_len: int,
                        seq_lens: torch.Tensor, max_seq_len: int,
                        block_tables: list[torch.Tensor] | tuple[torch.Tensor, ...],
                        slot_mappings: list[torch.Tensor] | torch.Tensor,
                        kv_cache_config: KVCacheConfig,
                        seq_lens_cpu_upper_bound: torch.Tensor | None = None,
                        dcp_local_seq_lens: torch.Tensor | None = None,
                        positions: torch.Tensor | None = None,
                        model_specific_attn_metadata: dict[str, Any] | None = None,
                        for_cudagraph_capture: bool = False) -> dict[str, Any]:
    """``{layer: metadata}``: one ``CommonAttentionMetadata`` per KV-cache group (its block
    table and slot mapping, ``causal=True``, ``num_actual_tokens=num_tokens``), passed through
    each attention group's builder; every layer of an attention group gets the same object."""
    if not isinstance(kv_cache_config, KVCacheConfig):   # once per step: no deep check here
        raise TypeError(f"kv_cache_config must be a KVCacheConfig, got {kv_cache_config!r}")
    num_groups = len(kv_cache_config.kv_cache_groups)
    check_int("num_reqs", num_reqs, 0)
    check_int("num_tokens", num_tokens, 0)
    check_int("max_query_len", max_query_len, 0)
    check_int("max_seq_len", max_seq_len, 0)
    for name, value in (("attn_groups", attn_groups), ("block_tables", block_tables)):
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"{name} must be a list with one entry per KV-cache group, "
                            f"got {type(value).__name__}")
    if not isinstance(slot_mappings, (list, tuple, torch.Tensor)):
        raise TypeError("slot_mappings must be a list of tensors or a [num_groups, num_tokens] "
                        f"tensor, got {type(slot_mappings).__name__}")
    if len(attn_groups) != num_groups or len(block_tables) != num_groups or \
            len(slot_mappings) != num_groups:
        raise ValueError(
            f"expected one entry per KV-cache group ({num_groups}): got {len(attn_groups)} "
            f"attention-group lists, {len(block_tables)} block tables, "
            f"{len(slot_mappings)} slot mappings")
    # Every per-request tensor must cover num_reqs requests and every per-token one num_tokens
    # tokens (they may be longer: buffers are padded), or the metadata would describe
    # requests or tokens that are not there.
    _check_rows("query_start_loc_gpu", query_start_loc_gpu, num_reqs + 1, "num_reqs + 1")
    _check_rows("query_start_loc_cpu", query_start_loc_cpu, num_reqs + 1, "num_reqs + 1")
    _check_rows("seq_lens", seq_lens, num_reqs, "num_reqs")
    for i in range(num_groups):
        _check_rows(f"block_tables[{i}]", block_tables[i], num_reqs, "num_reqs", dims=2)
        _check_rows(f"slot_mappings[{i}]", slot_mappings[i], num_tokens, "num_tokens")
    for name, value, need, what in (
            ("seq_lens_cpu_upper_bound", seq_lens_cpu_upper_bound, num_reqs, "num_reqs"),
            ("dcp_local_seq_lens", dcp_local_seq_lens, num_reqs, "num_reqs"),
            ("positions", positions, num_tokens, "num_tokens")):
        if value is not None:
            _check_rows(name, value, need, what)
    seq_lens = seq_lens[:num_reqs]
    if seq_lens_cpu_upper_bound is not None:
        seq_lens_cpu_upper_bound = seq_lens_cpu_upper_bound[:num_reqs]
    if dcp_local_seq_lens is not None:
        dcp_local_seq_lens = dcp_local_seq_lens[:num_reqs]
    extra = dict(model_specific_attn_metadata or {})
    metadata: dict[str, Any] = {}
    for i in range(num_groups):
        common = CommonAttentionMetadata(
            query_start_loc=query_start_loc_gpu, query_start_loc_cpu=query_start_loc_cpu,
            seq_lens=seq_lens, num_reqs=num_reqs, num_actual_tokens=num_tokens,
            max_query_len=max_query_len, max_seq_len=max_seq_len,
            block_table_tensor=block_tables[i], slot_mapping=slot_mappings[i], causal=True,
            seq_lens_cpu_upper_bound=seq_lens_cpu_upper_bound,
            dcp_local_seq_lens=dcp_local_seq_lens, positions=positions)
        for attn_group in attn_groups[i]:
            builder = attn_group.get_metadata_builder()
            if for_cudagraph_capture:
                md = builder.build_for_cudagraph_capture(common)
            else:
                md = builder.build(common_prefix_len=0, common_attn_metadata=common, **extra)
            for name in attn_group.layer_names:
                metadata[name] = md
    return metadata


# ---- Where a page's elements lie, as the reshape lays them out ---------------------------------------
def element_order(block_size: int, num_kv_heads: int, head_size: int, layout: str) -> np.ndarray:
    """``[block_size, num_kv_heads, head_size]``: the position in memory (in elements, from the
    start of the page) of each element of block 0's K page, for FlashInfer's view (any block
    size; FlashAttention orders a page the same way) under
    ``layout``, as the library's ``_reshape_kv_cache`` lays it out."""
    for name, value in (("block_size", block_size), ("num_kv_heads", num_kv_heads),
                        ("head_size", head_size)):
        check_int(name, value, 1)
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=num_kv_heads,
                             head_size=head_size, dtype=torch.float32)
    config = KVCacheConfig(1, [KVCacheTensor(spec.page_size_bytes, ["layer.0"])],
                           [KVCacheGroupSpec(["layer.0"], spec)])
    raw = torch.zeros(spec.page_size_bytes, dtype=torch.int8)
    view = _reshape_kv_cache(config, {"layer.0": raw}, {"layer.0": FlashInferBackend},
                             layout)["layer.0"]
    page = view[0, 0]                                      # block 0, K: [block_size, H, D]
    idx = [torch.arange(n).view(*[-1 if i == d else 1 for i in range(3)])
           for d, n in enumerate(page.shape)]
    offsets = sum(i * s for i, s in zip(idx, page.stride()))
    return (offsets + (page.data_ptr() - raw.data_ptr()) // page.element_size()).numpy()
