"""Allocation, reshape, binding, budgets, KV sharing and metadata."""
import pytest
import torch

from paged_attention.kv_cache.attn_utils import (
    AttentionGroup, CommonAttentionMetadata, _allocate_kv_cache, _reshape_kv_cache,
    bind_kv_cache, build_attn_metadata, get_kv_cache_config, get_kv_cache_spec,
    get_shared_kv_cache_layers, init_kv_cache)
from paged_attention.kv_cache.backends import (
    FlashAttentionBackend, FlashInferBackend, TritonAttentionBackend)
from paged_attention.kv_cache.interface import (
    FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor, SlidingWindowSpec)
from paged_attention.kv_cache.layer import Attention
from paged_attention.runtime import DEVICE

GiB = 1 << 30


def model(n=2, heads=8, head_size=128, backend=FlashAttentionBackend, per_layer=None):
    per_layer = per_layer or {}
    return {f"layer{i}": Attention(heads, head_size, 1.0, backend=backend,
                                   **per_layer.get(i, {}))
            for i in range(n)}


# ---- a worked example: a model's layers to a budget ------------------------------------------------------------------------
def test_worked_example_config():
    specs = get_kv_cache_spec(model(), 16, torch.bfloat16)
    assert list(specs) == ["layer0", "layer1"]
    assert specs["layer0"] == FullAttentionSpec(16, 8, 128, torch.bfloat16)
    assert specs["layer0"].page_size_bytes == 65536
    cfg = get_kv_cache_config(specs, GiB)
    assert cfg.num_blocks == 8192
    assert cfg.kv_cache_tensors == [KVCacheTensor(536870912, ["layer0"]),
                                    KVCacheTensor(536870912, ["layer1"])]
    assert len(cfg.kv_cache_groups) == 1
    assert cfg.kv_cache_groups[0].layer_names == ["layer0", "layer1"]
    assert cfg.kv_cache_groups[0].kv_cache_spec == specs["layer0"]


EXAMPLE = [
    (FlashAttentionBackend, "NHD", (2, 8192, 16, 8, 128), (134217728, 16384, 1024, 128, 1)),
    (FlashAttentionBackend, "HND", (2, 8192, 16, 8, 128), (134217728, 16384, 128, 2048, 1)),
    (FlashInferBackend, "NHD", (8192, 2, 16, 8, 128), (32768, 16384, 1024, 128, 1)),
    (FlashInferBackend, "HND", (8192, 2, 16, 8, 128), (32768, 16384, 128, 2048, 1)),
    (TritonAttentionBackend, "NHD", (8192, 2, 16, 8, 128), (32768, 16384, 1024, 128, 1)),
    (TritonAttentionBackend, "HND", (8192, 2, 16, 8, 128), (32768, 16384, 128, 2048, 1)),
]


@pytest.mark.parametrize("backend,layout,shape,strides", EXAMPLE)
def test_worked_example_strides(backend, layout, shape, strides):
    # the "meta" device gives the real shapes and strides without 1 GiB of memory
    cfg = get_kv_cache_config(get_kv_cache_spec(model(), 16, torch.bfloat16), GiB)
    raw = _allocate_kv_cache(cfg, "meta")
    assert [t.numel() for t in raw.values()] == [536870912, 536870912]
    assert all(t.dtype == torch.int8 for t in raw.values())
    views = _reshape_kv_cache(cfg, raw, {n: backend for n in raw}, layout)
    for v in views.values():
        assert v.dtype == torch.bfloat16 and v.numel() == 268435456
        assert tuple(v.shape) == shape and v.stride() == strides
        assert v.is_contiguous() == (layout == "NHD")


def test_worked_example_kernel_block_split():
    specs = get_kv_cache_spec(model(), 32, torch.bfloat16)
    cfg = get_kv_cache_config(specs, GiB)
    assert specs["layer0"].page_size_bytes == 131072 and cfg.num_blocks == 4096
    raw = _allocate_kv_cache(cfg, "meta")
    views = _reshape_kv_cache(cfg, raw, {n: FlashAttentionBackend for n in raw},
                              kernel_block_sizes=[16])
    assert tuple(views["layer0"].shape) == (2, 8192, 16, 8, 128)
    assert views["layer0"].stride() == (134217728, 16384, 1024, 128, 1)


# ---- real CPU tensors: storage sharing, contiguity, byte offsets --------------------------------
N, B, H, D = 3, 16, 2, 4


def expected_element_offset(backend, layout, kv, n, b, h, d):
    """Where element (kv, block n, token b, head h, dim d) lies, counted in elements."""
    if backend is FlashAttentionBackend:   # physical (2, N, B, H, D) or (2, N, H, B, D)
        if layout == "NHD":
            return (((kv * N + n) * B + b) * H + h) * D + d
        return (((kv * N + n) * H + h) * B + b) * D + d
    if layout == "NHD":                    # physical (N, 2, B, H, D) or (N, 2, H, B, D)
        return (((n * 2 + kv) * B + b) * H + h) * D + d
    return (((n * 2 + kv) * H + h) * B + b) * D + d


@pytest.mark.parametrize("backend", [FlashAttentionBackend, FlashInferBackend,
                                     TritonAttentionBackend])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_views_share_storage_and_land_at_the_predicted_offset(backend, layout):
    layers = model(n=2, heads=H, head_size=D, backend=backend)
    specs = get_kv_cache_spec(layers, B, torch.float16)
    page = specs["layer0"].page_size_bytes
    assert page == 2 * B * H * D * 2
    cfg = get_kv_cache_config(specs, 2 * N * page + page - 1)   # leftover bytes are dropped
    assert cfg.num_blocks == N
    raw = _allocate_kv_cache(cfg, DEVICE)
    views = _reshape_kv_cache(cfg, raw, {n: backend for n in layers}, layout)
    for name, v in views.items():
        r = raw[name]
        assert v.data_ptr() == r.data_ptr()
        assert v.untyped_storage().data_ptr() == r.untyped_storage().data_ptr()
        assert tuple(v.shape) == backend.get_kv_cache_shape(N, B, H, D)
        assert v.is_contiguous() == (layout == "NHD")
    assert raw["layer0"] is not raw["layer1"]
    for kv, n, b, h, d in [(1, 2, 5, 1, 3), (0, 1, 15, 0, 2), (1, 0, 0, 1, 0)]:
        for t in raw.values():
            t.zero_()
        idx = (kv, n, b, h, d) if backend is FlashAttentionBackend else (n, kv, b, h, d)
        views["layer1"][idx] = 1.5
        off = expected_element_offset(backend, layout, kv, n, b, h, d) * 2   # bytes
        bytes_ = raw["layer1"]
        nonzero = torch.nonzero(bytes_).flatten().tolist()
        assert nonzero and all(off <= i < off + 2 for i in nonzero)
        assert bytes_[off:off + 2].view(torch.float16).item() == 1.5
        assert torch.count_nonzero(raw["layer0"]) == 0


def test_allocation_is_zeroed_int8_and_shared_tensor_is_one_object():
    spec = FullAttentionSpec(16, 1, 4, torch.float32)
    cfg = KVCacheConfig(2, [KVCacheTensor(2 * spec.page_size_bytes, ["a0", "b0"])],
                        [KVCacheGroupSpec(["a0"], spec), KVCacheGroupSpec(["b0"], spec)])
    raw = _allocate_kv_cache(cfg, DEVICE)
    assert raw["a0"] is raw["b0"]
    assert raw["a0"].dtype == torch.int8 and raw["a0"].numel() == 2 * spec.page_size_bytes
    assert torch.count_nonzero(raw["a0"]) == 0


def test_allocate_rejects_uncovered_layers():
    spec = FullAttentionSpec(16, 1, 4, torch.float32)
    cfg = KVCacheConfig(1, [KVCacheTensor(spec.page_size_bytes, ["a0"])],
                        [KVCacheGroupSpec(["a0", "a1"], spec)])
    with pytest.raises(AssertionError, match="not correctly initialized"):
        _allocate_kv_cache(cfg, DEVICE)
    with pytest.raises(ValueError):
        _allocate_kv_cache(cfg, DEVICE)


def test_reshape_rejects_size_not_multiple_of_page():
    spec = FullAttentionSpec(16, 1, 4, torch.float32)
    cfg = KVCacheConfig(1, [KVCacheTensor(spec.page_size_bytes + 4, ["l0"])],
                        [KVCacheGroupSpec(["l0"], spec)])
    raw = _allocate_kv_cache(cfg, DEVICE)
    with pytest.raises(ValueError, match="not a multiple of the page size"):
        _reshape_kv_cache(cfg, raw, {"l0": FlashAttentionBackend})
    with pytest.raises(TypeError):
        _reshape_kv_cache(cfg, {"l0": torch.zeros(10, dtype=torch.float32)},
                          {"l0": FlashAttentionBackend})


# ---- memory budget ------------------------------------------------------------------------------
def test_budget_arithmetic_and_too_small():
    specs = get_kv_cache_spec(model(), 16, torch.bfloat16)
    assert get_kv_cache_config(specs, 2 * 65536).num_blocks == 1
    assert get_kv_cache_config(specs, 4 * 65536 - 1).num_blocks == 1
    assert get_kv_cache_config(specs, GiB, num_gpu_blocks_override=10).num_blocks == 10
    with pytest.raises(ValueError, match="Not enough memory"):
        get_kv_cache_config(specs, 2 * 65536 - 1)
    with pytest.raises(ValueError):
        get_kv_cache_config(specs, 0)


def test_hybrid_groups_share_tensors():
    layers = model(n=3, heads=8, head_size=128, per_layer={1: {"sliding_window": 64}})
    specs = get_kv_cache_spec(layers, 16, torch.bfloat16)
    assert isinstance(specs["layer1"], SlidingWindowSpec)
    cfg = get_kv_cache_config(specs, 4 * 65536)
    assert [g.layer_names for g in cfg.kv_cache_groups] == [["layer0", "layer2"], ["layer1"]]
    assert cfg.num_blocks == 2      # 4 pages // 2 layers in the largest group
    assert [t.shared_by for t in cfg.kv_cache_tensors] == [["layer0", "layer1"], ["layer2"]]
    raw = _allocate_kv_cache(cfg, "meta")
    assert raw["layer0"] is raw["layer1"] and raw["layer2"] is not raw["layer0"]


# ---- KV sharing and binding ---------------------------------------------------------------------
def test_kv_sharing_yields_the_same_tensor_and_binds_in_layer_order():
    layers = model(n=3, heads=2, head_size=4,
                   per_layer={2: {"kv_sharing_target_layer_name": "layer0"}})
    specs = get_kv_cache_spec(layers, 16, torch.float16)
    assert list(specs) == ["layer0", "layer1"]
    shared = get_shared_kv_cache_layers(layers)
    assert shared == {"layer2": "layer0"}
    cfg = get_kv_cache_config(specs, 2 * 4 * specs["layer0"].page_size_bytes,
                              shared_kv_cache_layers=shared)
    assert cfg.num_blocks == 4 and len(cfg.kv_cache_tensors) == 2
    assert cfg.kv_cache_groups[0].layer_names == ["layer0", "layer1", "layer2"]
    runner: list = []
    caches = init_kv_cache(runner, layers, cfg, {n: FlashInferBackend for n in layers}, DEVICE)
    assert caches["layer2"] is caches["layer0"]
    assert caches["layer1"] is not caches["layer0"]
    assert layers["layer2"].kv_cache is layers["layer0"].kv_cache is caches["layer0"]
    assert layers["layer1"].kv_cache is caches["layer1"]
    assert len(runner) == 3
    assert runner[0] is caches["layer0"] and runner[1] is caches["layer1"]
    assert runner[2] is caches["layer2"]
    with pytest.raises(ValueError, match="empty"):
        bind_kv_cache(caches, layers, runner)


def test_bind_orders_by_layer_index():
    layers = {name: Attention(1, 4, 1.0) for name in ["model.layers.10.attn",
                                                     "model.layers.2.attn"]}
    caches = {name: torch.zeros(1) for name in layers}
    runner: list = []
    bind_kv_cache(caches, layers, runner)
    assert runner[0] is caches["model.layers.2.attn"]
    assert runner[1] is caches["model.layers.10.attn"]


@pytest.mark.parametrize("target,match", [("layer2", "before"), ("layer9", "not an attention"),
                                          ("layer1", "own")])
def test_bad_sharing_targets(target, match):
    layers = model(n=3, per_layer={1: {"kv_sharing_target_layer_name": target}})
    with pytest.raises(ValueError, match=match):
        get_kv_cache_spec(layers, 16, torch.bfloat16)


def test_bad_model_description():
    with pytest.raises(TypeError):
        get_kv_cache_spec({"layer0": object()}, 16, torch.bfloat16)
    with pytest.raises(TypeError):
        get_kv_cache_spec(model(), 16, "bf16")
    with pytest.raises(ValueError):
        Attention(6, 4, 1.0, num_kv_heads=4)


# ---- metadata -----------------------------------------------------------------------------------
def test_build_attn_metadata():
    spec = FullAttentionSpec(16, 1, 4, torch.float32)
    cfg = KVCacheConfig(4, [KVCacheTensor(4 * spec.page_size_bytes, ["l0", "l1"])],
                        [KVCacheGroupSpec(["l0"], spec), KVCacheGroupSpec(["l1"], spec)])
    groups = [[AttentionGroup(FlashAttentionBackend, ["l0"], spec, 0)],
              [AttentionGroup(FlashAttentionBackend, ["l1"], spec, 1)]]
    qsl = torch.tensor([0, 3, 5, 5])
    seq_lens = torch.tensor([7, 2, 9, 9])
    bts = (torch.zeros(4, 2, dtype=torch.int32), torch.ones(4, 2, dtype=torch.int32))
    sms = [torch.arange(5), torch.arange(5) + 16]
    md = build_attn_metadata(groups, 2, 5, qsl, qsl, 3, seq_lens, 9, bts, sms, cfg)
    assert set(md) == {"l0", "l1"}
    m0, m1 = md["l0"], md["l1"]
    assert isinstance(m0, CommonAttentionMetadata) and m0 is not m1
    assert m0.block_table_tensor is bts[0] and m1.block_table_tensor is bts[1]
    assert m0.slot_mapping is sms[0] and m1.slot_mapping is sms[1]
    assert m0.seq_lens.tolist() == [7, 2] and m0.num_reqs == 2
    assert m0.num_actual_tokens == 5 and m0.causal is True and m0.max_seq_len == 9
    with pytest.raises(ValueError):
        build_attn_metadata(groups, 2, 5, qsl, qsl, 3, seq_lens, 9, bts[:1], sms, cfg)


@pytest.mark.parametrize("backend", [FlashAttentionBackend, FlashInferBackend, TritonAttentionBackend])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_padded_pages_keep_every_block_apart(backend, layout):
    # A padded page (320 bytes for 256 of K and V): the block dimension steps by the padded
    # page, whichever dimension it is, and no two elements of the view share bytes.
    spec = FullAttentionSpec(16, 1, 4, torch.float16, page_size_padded=320)
    cfg = KVCacheConfig(3, [KVCacheTensor(3 * 320, ["l0"])], [KVCacheGroupSpec(["l0"], spec)])
    raw = _allocate_kv_cache(cfg, DEVICE)
    view = _reshape_kv_cache(cfg, raw, {"l0": backend}, layout)["l0"]
    assert tuple(view.shape) == backend.get_kv_cache_shape(3, 16, 1, 4)
    block_dim = 1 if backend is FlashAttentionBackend else 0
    assert view.stride(block_dim) == 320 // 2
    flat = torch.arange(1, view.numel() + 1, dtype=torch.float16, device=view.device)
    view.copy_(flat.reshape(view.shape))                   # a distinct value in every element...
    assert torch.equal(view.reshape(-1), flat)             # ...all still there: nothing overlaps
    for n in range(3):                                      # and each block inside its own page
        lo, hi = n * 320, n * 320 + 256
        assert lo <= view.select(block_dim, n).data_ptr() - raw["l0"].data_ptr() < hi
