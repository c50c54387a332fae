"""Bad input to the KV-cache setup, the v1/v2 buffers and the exercise checkers.

Each refused call must raise TypeError/ValueError/KeyError with the library's own message and
leave everything as it was (layer bindings, the runner's list, pool cursors, buffer contents),
so that a retry with good input works.
"""
import numpy as np
import pytest
import torch

from paged_attention import runtime
from paged_attention.kv_cache.attn_utils import (
    AttentionGroup, _allocate_kv_cache, _reshape_kv_cache, bind_kv_cache, build_attn_metadata,
    get_kv_cache_config, init_kv_cache)
from paged_attention.kv_cache.backends import FlashAttentionBackend
from paged_attention.kv_cache.interface import (
    AttentionSpec, FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor,
    SlidingWindowSpec)
from paged_attention.kv_cache.layer import Attention
from paged_attention.v1.block_table import BlockTable, MultiGroupBlockTable
from paged_attention.v1.cpu_gpu_buffer import CpuGpuBuffer
from paged_attention.v2.block_table_fast import FastBlockTables
from paged_attention.v2.buffers import (StagedWriteTensor, UvaBackedTensor, UvaBufferPool,
                                        async_copy_to_gpu)

DEV = runtime.DEVICE
NAMES = ["model.layers.0.attn", "model.layers.1.attn", "model.layers.2.attn"]


def _spec(**kw):
    args = dict(block_size=16, num_kv_heads=1, head_size=4, dtype=torch.float32)
    args.update(kw)
    return FullAttentionSpec(**args)


def _config(names=NAMES):
    return get_kv_cache_config({n: _spec() for n in names}, 4 * len(names) * _spec().page_size_bytes)


def _layers(names=NAMES):
    return {n: Attention(1, 4, 1.0) for n in names}


# ---- binding: all or nothing ---------------------------------------------------------------------
def test_bind_with_a_missing_layer_binds_nothing_and_a_retry_works():
    layers = _layers()
    partial = {n: layers[n] for n in NAMES[:2]}             # the last layer is missing
    caches = {n: torch.zeros(2) for n in NAMES}
    runner: list = []
    with pytest.raises(KeyError, match="model.layers.2.attn"):
        bind_kv_cache(caches, partial, runner)
    assert runner == []
    assert all(layer.kv_cache is None for layer in layers.values())
    bind_kv_cache(caches, layers, runner)                  # the same list, now with every layer
    assert [t is caches[n] for t, n in zip(runner, NAMES)] == [True] * 3
    assert all(layers[n].kv_cache is caches[n] for n in NAMES)


def test_init_kv_cache_with_a_missing_layer_changes_nothing_and_a_retry_works():
    layers = _layers()
    cfg = _config()
    backends = {n: FlashAttentionBackend for n in NAMES}
    runner: list = []
    partial = {n: layers[n] for n in NAMES[1:]}             # the first layer is missing
    with pytest.raises(KeyError, match="model.layers.0.attn"):
        init_kv_cache(runner, partial, cfg, backends, DEV)
    assert runner == []
    assert all(layer.kv_cache is None for layer in layers.values())
    caches = init_kv_cache(runner, layers, cfg, backends, DEV)
    assert len(runner) == 3 and all(layers[n].kv_cache is caches[n] for n in NAMES)


class _Frozen:
    """A layer object that cannot take a ``kv_cache`` attribute."""
    __slots__ = ()


def test_bind_undoes_earlier_layers_when_a_layer_refuses_the_attribute():
    layers = _layers(NAMES[:2])
    old = torch.ones(1)
    layers[NAMES[0]].kv_cache = old
    context = {**layers, NAMES[2]: _Frozen()}
    caches = {n: torch.zeros(2) for n in NAMES}
    runner: list = []
    with pytest.raises(TypeError, match="model.layers.2.attn"):
        bind_kv_cache(caches, context, runner)
    assert runner == []
    assert layers[NAMES[0]].kv_cache is old and layers[NAMES[1]].kv_cache is None


@pytest.mark.parametrize("bad", [
    dict(runner=None), dict(forward_context=None), dict(kv_cache_config=None),
    dict(kv_cache_config=5), dict(device="bogus"), dict(device=None), dict(attn_backends=None),
])
def test_init_kv_cache_bad_arguments_are_typed_and_bind_nothing(bad):
    layers = _layers()
    args = dict(runner=[], forward_context=layers, kv_cache_config=_config(),
                attn_backends={n: FlashAttentionBackend for n in NAMES}, device=DEV)
    args.update(bad)
    with pytest.raises((TypeError, ValueError)) as info:
        init_kv_cache(args["runner"], args["forward_context"], args["kv_cache_config"],
                      args["attn_backends"], args["device"])
    name = next(iter(bad))
    assert ("runner_kv_caches" if name == "runner" else name) in str(info.value)
    assert all(layer.kv_cache is None for layer in layers.values())


# ---- configs and specs ---------------------------------------------------------------------------
@pytest.mark.parametrize("config", [None, 5, "cfg"])
def test_functions_taking_a_config_refuse_a_non_config(config):
    with pytest.raises(TypeError, match="kv_cache_config must be a KVCacheConfig"):
        _allocate_kv_cache(config, DEV)
    with pytest.raises(TypeError, match="kv_cache_config must be a KVCacheConfig"):
        _reshape_kv_cache(config, {}, {})
    with pytest.raises(TypeError, match="kv_cache_config must be a KVCacheConfig"):
        build_attn_metadata([], 0, 0, torch.zeros(1), torch.zeros(1), 0, torch.zeros(0), 0, [], [],
                            config)


def test_config_parts_are_checked_on_construction():
    spec = _spec()
    with pytest.raises(TypeError, match="num_blocks"):
        KVCacheConfig(None, [], [])
    with pytest.raises(TypeError, match="kv_cache_tensors"):
        KVCacheConfig(1, None, [])
    with pytest.raises(TypeError, match="kv_cache_groups"):
        KVCacheConfig(1, [], [5])
    with pytest.raises(TypeError, match="kv_cache_spec"):
        KVCacheGroupSpec(["l0"], None)
    with pytest.raises(TypeError, match="shared_by"):
        KVCacheTensor(spec.page_size_bytes, "l0")
    with pytest.raises(ValueError, match="size"):
        KVCacheTensor(0, ["l0"])


def test_allocation_refuses_a_bogus_device():
    with pytest.raises(ValueError, match="device"):
        _allocate_kv_cache(_config(), "bogus")
    with pytest.raises(TypeError, match="device"):
        _allocate_kv_cache(_config(), 3.5)


@pytest.mark.parametrize("change,error", [
    (dict(block_size=0), ValueError), (dict(block_size=-16), ValueError),
    (dict(block_size=True), TypeError), (dict(block_size=16.0), TypeError),
    (dict(num_kv_heads=2.5), TypeError), (dict(num_kv_heads=0), ValueError),
    (dict(num_kv_heads=False), TypeError), (dict(head_size=0), ValueError),
    (dict(head_size=-4), ValueError), (dict(dtype="float32"), TypeError),
    (dict(dtype=None), TypeError), (dict(head_size_v=0), ValueError),
    (dict(sliding_window=0), ValueError), (dict(attention_chunk_size=-1), ValueError),
    (dict(page_size_padded=8), ValueError), (dict(page_size_padded=1.5), TypeError),
])
def test_specs_refuse_bad_fields(change, error):
    with pytest.raises(error, match=next(iter(change))):
        _spec(**change)


def test_other_specs_refuse_bad_fields_too():
    with pytest.raises(ValueError, match="sliding_window"):
        SlidingWindowSpec(16, 1, 4, torch.float32, 0)
    with pytest.raises(TypeError, match="num_kv_heads"):
        SlidingWindowSpec(16, 2.5, 4, torch.float32, 8)
    with pytest.raises(ValueError, match="block_size"):
        AttentionSpec(-16, 1, 4, torch.float32)
    with pytest.raises(ValueError, match="block_size"):
        _spec().copy_with_new_block_size(0)
    assert _spec(block_size=np.int64(16)) == _spec()        # a numpy int is stored as an int


def test_a_zero_block_size_never_reaches_a_division():
    # It used to be accepted, then divided by in get_kv_cache_config (ZeroDivisionError).
    with pytest.raises(ValueError, match="block_size"):
        get_kv_cache_config({"l0": _spec(block_size=0)}, 1 << 20)


def test_get_kv_cache_config_refuses_a_non_dict_sharing_map():
    with pytest.raises(TypeError, match="shared_kv_cache_layers"):
        get_kv_cache_config({"l0": _spec()}, 1 << 20, shared_kv_cache_layers=["l1"])


# ---- attention metadata --------------------------------------------------------------------------
def _metadata_args(**changes):
    spec = _spec()
    cfg = KVCacheConfig(4, [KVCacheTensor(4 * spec.page_size_bytes, ["l0"])],
                        [KVCacheGroupSpec(["l0"], spec)])
    qsl = torch.tensor([0, 3, 5])
    args = dict(attn_groups=[[AttentionGroup(FlashAttentionBackend, ["l0"], spec, 0)]], num_reqs=2,
                num_tokens=5, query_start_loc_gpu=qsl, query_start_loc_cpu=qsl, max_query_len=3,
                seq_lens=torch.tensor([7, 2]), max_seq_len=7,
                block_tables=[torch.zeros(2, 1, dtype=torch.int32)], slot_mappings=[torch.arange(5)],
                kv_cache_config=cfg)
    args.update(changes)
    return args


def test_build_attn_metadata_accepts_consistent_lengths():
    md = build_attn_metadata(**_metadata_args())
    assert md["l0"].num_reqs == 2 and md["l0"].seq_lens.tolist() == [7, 2]


@pytest.mark.parametrize("changes,match", [
    (dict(num_reqs=5), "seq_lens|query_start_loc"),
    (dict(seq_lens=torch.tensor([7])), "seq_lens"),
    (dict(query_start_loc_cpu=torch.tensor([0, 3])), "query_start_loc_cpu"),
    (dict(block_tables=[torch.zeros(1, 1, dtype=torch.int32)]), "block_tables"),
    (dict(slot_mappings=[torch.arange(3)]), "slot_mappings"),
    (dict(num_tokens=9), "slot_mappings"),
    (dict(positions=torch.arange(2)), "positions"),
    (dict(seq_lens=[7, 2]), "seq_lens"),
])
def test_build_attn_metadata_refuses_lengths_that_disagree(changes, match):
    with pytest.raises((ValueError, TypeError), match=match):
        build_attn_metadata(**_metadata_args(**changes))


# ---- devices -------------------------------------------------------------------------------------
BAD_DEVICES = [("bogus", ValueError), ("", ValueError), (None, TypeError), (3.5, TypeError)]
MAKERS = {
    "CpuGpuBuffer": lambda dev: CpuGpuBuffer(4, dtype=torch.int32, device=dev, pin_memory=False),
    "v1 BlockTable": lambda dev: BlockTable(16, 4, 8, 64, False, dev, 16, 1),
    "v1 MultiGroupBlockTable": lambda dev: MultiGroupBlockTable(4, 64, 64, False, dev, [16], [16]),
    "v2 BlockTables": lambda dev: FastBlockTables([16], 4, 64, 128, dev),
    "StagedWriteTensor": lambda dev: StagedWriteTensor((4, 4), torch.int32, dev),
    "async_copy_to_gpu": lambda dev: async_copy_to_gpu(torch.zeros(3), device=dev),
}


@pytest.mark.parametrize("maker", list(MAKERS))
@pytest.mark.parametrize("device,error", BAD_DEVICES)
def test_bad_devices_get_the_library_s_own_error(maker, device, error):
    if maker == "async_copy_to_gpu" and device is None:
        pytest.skip("device=None there means 'give out= instead'")
    with pytest.raises(error, match="device"):
        MAKERS[maker](device)


def test_a_missing_gpu_is_a_value_error():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    for maker in MAKERS.values():
        with pytest.raises(ValueError, match="no CUDA device"):
            maker("cuda")


def test_cpu_gpu_buffer_pin_memory_must_be_a_bool():
    with pytest.raises(TypeError, match="pin_memory"):
        CpuGpuBuffer(4, dtype=torch.int32, device=DEV, pin_memory="no")


# ---- v2 buffers: a refused copy moves nothing ----------------------------------------------------
def _pool_state(pool):
    return pool._curr, [b.np.copy() for b in pool._uva_bufs]


def _same(a, b):
    return a[0] == b[0] and all(np.array_equal(x, y) for x, y in zip(a[1], b[1]))


@pytest.mark.parametrize("source,error", [
    (["a"], TypeError), ([None], TypeError), ([1.5], TypeError), ([True, "x"], TypeError),
    (np.array([1.5]), TypeError), (torch.tensor([1.5]), TypeError),
    ([2 ** 40], ValueError), (np.array([2 ** 40]), ValueError), (torch.tensor([-2 ** 40]), ValueError),
    ([1, [2]], ValueError), ([[1, 2]], ValueError), ([1, 2, 3, 4, 5], ValueError),
])
def test_pool_refuses_bad_values_before_moving_its_cursor(source, error):
    pool = UvaBufferPool(4, torch.int32)
    pool.copy_to_uva([7, 8])
    before = _pool_state(pool)
    with pytest.raises(error):
        pool.copy_to_uva(source)
    assert _same(_pool_state(pool), before)
    assert pool.copy_to_uva([1, 2, 3]).tolist() == [1, 2, 3]     # and it still works


def test_pool_copy_to_gpu_checks_out_before_copying():
    pool = UvaBufferPool((3, 2), torch.float32)
    before = _pool_state(pool)
    with pytest.raises(TypeError, match="out"):
        pool.copy_to_gpu([[1.0, 2.0]], out=5)
    with pytest.raises(ValueError, match="out"):
        pool.copy_to_gpu([[1.0, 2.0]], out=torch.zeros(3, 3, device=DEV))
    assert _same(_pool_state(pool), before)


def test_pool_accepts_an_empty_list_into_two_dimensional_buffers():
    pool = UvaBufferPool((3, 2), torch.int32)
    assert tuple(pool.copy_to_uva([]).shape) == (0, 2)


def test_uva_backed_tensor_refused_copy_keeps_binding_and_cursor():
    t = UvaBackedTensor((2, 3), torch.int32)
    gpu, state = t.gpu, _pool_state(t.pool)
    for n in (3, -1, 1.0, "1", True):
        with pytest.raises((TypeError, ValueError)):
            t.copy_to_uva(n)
    assert t.gpu is gpu and _same(_pool_state(t.pool), state)


def test_staged_write_tensor_refused_stage_changes_nothing():
    t = StagedWriteTensor((2, 3), torch.int32, DEV)
    t.stage_write(0, 0, [1])
    cursors = [p._curr for p in (t.write_indices, t.write_starts, t.write_cu_lens)]
    for args in ((5, 0, [1]), (0, 2, [1, 2]), (1, 0, ["a"]), (1, 0, [1.5]), (1, 0, [2 ** 40])):
        with pytest.raises((TypeError, ValueError, IndexError)):
            t.stage_write(*args)
    assert t.num_staged_writes == 1
    assert [p._curr for p in (t.write_indices, t.write_starts, t.write_cu_lens)] == cursors
    t.apply_write()
    assert t.gpu.cpu().tolist() == [[1, 0, 0], [0, 0, 0]]


# ---- exercise checkers: one rule for wrong-typed answers -----------------------------------------
def _checkers():
    import paged_attention.exercises.kernels as k
    import paged_attention.exercises.kv_cache as kv
    import paged_attention.exercises.legacy as lg
    import paged_attention.exercises.manager as mg
    import paged_attention.exercises.overview as ov
    import paged_attention.exercises.v1 as v1
    import paged_attention.exercises.v2 as v2
    table, seq_lens = [[3, 1], [0, 2]], [6, 5]
    # (name, call with one answer replaced by `bad`, the right answers): each right answer given
    # as a numpy int must still be accepted.
    return {
        "overview.blocks_for_request": lambda a: ov.blocks_for_request(a, 13),
        "overview.blocks_for_request/2": lambda a: ov.blocks_for_request(32, a),
        "overview.slot_of": lambda a: ov.slot_of(a, table, seq_lens, seq=0, token=5, block_size=4),
        "kernels.key_offset": lambda a: k.key_offset(a),
        "kernels.partition_tokens": lambda a: k.partition_tokens(5, a, 2100),
        "kernels.thread_group": lambda a: k.thread_group(a, 2),
        "kv_cache.bytes_per_token": lambda a: kv.bytes_per_token(a),
        "legacy.window_table": lambda a: lg.window_table([3, 3, 3, 4, 2], a),
        "legacy.next_ids": lambda a: lg.next_ids([1, 0, a]),
        "manager.parallel_sampling": lambda a: mg.parallel_sampling(a, 3),
        "v1.token_slot": lambda a: v1.token_slot(a),
        "v2.block_counts": lambda a: v2.block_counts(a, 3),
    }


RIGHT = {"overview.blocks_for_request": 32, "overview.blocks_for_request/2": 13,
         "overview.slot_of": 5, "kernels.key_offset": 181, "kernels.partition_tokens": 2048,
         "kernels.thread_group": 4, "kv_cache.bytes_per_token": 57344, "legacy.window_table": 13,
         "legacy.next_ids": 4, "manager.parallel_sampling": 7, "v1.token_slot": 645,
         "v2.block_counts": 5}


@pytest.mark.parametrize("name", list(RIGHT))
@pytest.mark.parametrize("bad", ["RIGHT_AS_STR", None, "RIGHT_AS_FLOAT", True])
def test_every_int_checker_raises_type_error_for_a_wrong_typed_answer(name, bad, capsys):
    right = RIGHT[name]
    bad = {"RIGHT_AS_STR": str(right), "RIGHT_AS_FLOAT": float(right)}.get(bad, bad)
    with pytest.raises(TypeError):
        _checkers()[name](bad)
    assert capsys.readouterr().out == ""                    # no verdict printed either


@pytest.mark.parametrize("name", list(RIGHT))
def test_every_int_checker_accepts_numpy_ints(name):
    assert _checkers()[name](np.int64(RIGHT[name]))


def test_list_and_choice_checkers_read_answers_the_same_way():
    import math

    import paged_attention.exercises.kernels as k
    import paged_attention.exercises.legacy as lg
    import paged_attention.exercises.manager as mg
    import paged_attention.exercises.overview as ov
    right = [20 * math.exp(-2), 8.0, 12 * math.exp(-1)]
    for bad in ("2.7", None, [str(right[0]), 8.0, 4.4], [None, 8.0, 4.4], [True, 8.0, 4.4]):
        with pytest.raises(TypeError):
            k.merge_weights(bad)
    assert k.merge_weights(np.array(right))
    for bad in (["1", "0", "4"], [1.0, 0.0, 4.0], [1, 0, None]):
        with pytest.raises(TypeError):
            lg.next_ids(bad)
    with pytest.raises(TypeError):
        lg.cow_after_fork([2, 2, 1, 1], ("2", "3"))          # the pair is read even if counts are wrong
    with pytest.raises(TypeError):
        lg.cow_after_fork([0, 0, 0, 0], (2.0, 3.0))
    for bad in (32, None, 1.0):
        with pytest.raises(TypeError):
            ov.bigger_blocks(bad)
        with pytest.raises(TypeError):
            mg.admission(bad, "NEVER")
    with pytest.raises(TypeError):                            # a word that is none of the choices
        ov.bigger_blocks("sideways")
    with pytest.raises(TypeError):
        mg.admission("MAYBE", "NEVER")
