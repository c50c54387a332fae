"""The loader of vLLM 0.33's own V1 core (``paged_attention.v1.core.oracle``).

Without the files it must say why, naming the command that fetches them. With them, vLLM's
manager must run on a CPU and give the answers measured by hand (hybrid groups, block size 4),
``SamplingParams`` must keep what it is given (a careless msgspec stand-in keeps the defaults),
and no stand-in for a third-party package may stay visible to the rest of the process.
"""
import sys

import pytest

from paged_attention.v1.core import oracle

OK, WHY = oracle.available()
needs_oracle = pytest.mark.skipif(not OK, reason=f"vLLM's core not available: {WHY}")


def test_missing_folder_is_named(monkeypatch, tmp_path):
    monkeypatch.setenv(oracle.ENV_VAR, str(tmp_path))
    ok, why = oracle.available()
    assert not ok and str(tmp_path) in why and "fetch-core" in why
    folder, why = oracle.find_core()
    assert folder is None and oracle.ENV_VAR in why


def test_load_without_files_raises_the_reason(monkeypatch, tmp_path):
    monkeypatch.setenv(oracle.ENV_VAR, str(tmp_path))
    monkeypatch.setattr(oracle, "_loaded", {})
    with pytest.raises(oracle.OracleUnavailableError, match="fetch-core"):
        oracle.load()


def test_stand_ins_accept_what_vllm_does_with_them():
    stand_in = oracle._stand_in("pkg.Thing")
    hint = stand_in | None
    assert hint is stand_in and stand_in[int] is stand_in and list(stand_in) == []

    class Sub(stand_in.Base):
        pass

    assert isinstance(Sub(1, x=2), oracle._Any)

    @stand_in.decorator
    def f():
        return 7

    assert f() == 7


@needs_oracle
def test_vllm_manager_runs_and_gives_the_measured_tables():
    o = oracle.load()
    assert oracle.smoke_test(o) == [[1, 2, 3, 9], [0, 0, 7, 10]]
    assert all(name.startswith("vllm") for name in o.modules)


@needs_oracle
def test_sampling_params_keeps_what_it_is_given():
    o = oracle.load()
    assert o.SamplingParams(max_tokens=3).max_tokens == 3


@needs_oracle
def test_no_third_party_stand_in_is_left_behind():
    oracle.load()
    for name in oracle.THIRD_PARTY_STAND_INS:
        module = sys.modules.get(name)
        assert module is None or not isinstance(module, oracle._StandInModule), name
