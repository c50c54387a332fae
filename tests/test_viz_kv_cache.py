"""The drawings of notebook 05 and the facts they are computed from."""
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from paged_attention.kv_cache import attn_utils as au  # noqa: E402
from paged_attention.kv_cache.backends import (  # noqa: E402
    FlashAttentionBackend, FlashInferBackend, TritonAttentionBackend)
from paged_attention.kv_cache.layer import Attention  # noqa: E402
from paged_attention.viz import (  # noqa: E402
    draw_element_order, draw_raw_to_views, draw_shared_tensors, kv_dim_of, kv_pages)


def _one_layer(backend, layout, num_blocks=3, block_size=16, heads=2, head_size=4):
    layers = {"layers.0.attn": Attention(heads, head_size, 1.0)}
    specs = au.get_kv_cache_spec(layers, block_size, torch.float16)
    page = specs["layers.0.attn"].page_size_bytes
    config = au.get_kv_cache_config(specs, num_blocks * page)
    raw = au._allocate_kv_cache(config, "cpu")
    view = au._reshape_kv_cache(config, raw, {"layers.0.attn": backend}, layout)["layers.0.attn"]
    return raw["layers.0.attn"], view, page


def test_element_order_nhd_and_hnd():
    nhd = au.element_order(2, 3, 4, "NHD")
    hnd = au.element_order(2, 3, 4, "HND")
    t, h, d = np.meshgrid(np.arange(2), np.arange(3), np.arange(4), indexing="ij")
    assert nhd.shape == hnd.shape == (2, 3, 4)
    assert (nhd == (t * 3 + h) * 4 + d).all()
    assert (hnd == (h * 2 + t) * 4 + d).all()
    assert sorted(hnd.ravel().tolist()) == list(range(24))      # a permutation of the page
    assert (au.element_order(4, 1, 5, "HND") == au.element_order(4, 1, 5, "NHD")).all()   # one head
    with pytest.raises(ValueError):
        au.element_order(2, 3, 4, "DHN")
    with pytest.raises((TypeError, ValueError)):
        au.element_order(0, 3, 4, "NHD")


def test_kv_dim_of():
    assert kv_dim_of(FlashAttentionBackend) == 0
    assert kv_dim_of(FlashInferBackend) == kv_dim_of(TritonAttentionBackend) == 1


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_kv_pages_flash_all_k_then_all_v(layout):
    raw, view, page = _one_layer(FlashAttentionBackend, layout)
    pages = kv_pages(view, raw, 0)
    half = page // 2
    assert [(p.kv, p.block) for p in pages] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert [p.start for p in pages] == [i * half for i in range(6)]
    assert all(p.nbytes == half for p in pages)


@pytest.mark.parametrize("backend", [FlashInferBackend, TritonAttentionBackend])
def test_kv_pages_flashinfer_k_v_per_block(backend):
    raw, view, page = _one_layer(backend, "HND")
    pages = kv_pages(view, raw, 1)
    assert [(p.kv, p.block) for p in pages] == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]
    assert pages[-1].start + pages[-1].nbytes == raw.numel() == 3 * page
    with pytest.raises(ValueError):
        kv_pages(view[0], raw, 1)


def test_draw_raw_to_views_and_element_order():
    raw, view, _ = _one_layer(FlashAttentionBackend, "HND")
    ax = draw_raw_to_views(raw, {"layers.0.attn": view}, {"layers.0.attn": 0})
    texts = [t.get_text() for t in ax.texts]
    assert "K0" in texts and "V2" in texts and len([t for t in texts if t[:1] in "KV" and t[1:].isdigit()]) == 6
    assert any(str(tuple(view.stride())) in t for t in texts)
    ax = draw_element_order(2, 2, 3, "HND")
    labels = [t.get_text() for t in ax.texts]
    assert labels[:6] == ["0", "1", "2", "6", "7", "8"]          # token 0: head 0, then head 1 a token later
    plt.close("all")


def test_draw_shared_tensors_hybrid_and_sharing():
    layers = {"layers.0.attn": Attention(2, 4, 1.0), "layers.1.attn": Attention(2, 4, 1.0, sliding_window=8),
              "layers.2.attn": Attention(2, 4, 1.0),
              "layers.3.attn": Attention(2, 4, 1.0, kv_sharing_target_layer_name="layers.0.attn")}
    specs = au.get_kv_cache_spec(layers, 16, torch.float16)
    shared = au.get_shared_kv_cache_layers(layers)
    config = au.get_kv_cache_config(specs, 2 * 2 * 512, shared_kv_cache_layers=shared)
    ax = draw_shared_tensors(config, shared)
    texts = [t.get_text() for t in ax.texts]
    assert texts.count("layers.0.attn: views all of tensor 0") == 1
    assert "layers.3.attn (reuses layers.0.attn): views all of tensor 0" in texts
    assert sum(t.startswith("tensor ") for t in texts) == len(config.kv_cache_tensors) == 2
    hatched = [p for p in ax.patches if p.get_hatch()]
    assert len(hatched) == 1
    # Every layer's band spans its whole buffer (the layers share the bytes, they do not split them).
    buffers = [p for p in ax.patches if p.get_facecolor()[:3] == pytest.approx((0xEE / 255,) * 3)]
    bands = [p for p in ax.patches if p not in buffers]
    assert len(buffers) == 2 and len(bands) == 4
    assert all(b.get_x() == buffers[0].get_x() and b.get_width() == buffers[0].get_width() for b in bands)
    plt.close("all")
