"""The runner's request states: a step's finished requests removed at once leave what one
removal after another leaves (the free rows in the same order: it decides who gets which row)."""
from types import SimpleNamespace

import torch

from paged_attention.engine.model_runner import RequestStates


def _states(names):
    states = RequestStates(8, 16, torch.device("cpu"))
    params = SimpleNamespace(greedy=True)
    states.add_many(names, [[1, 2, 3]] * len(names), [0] * len(names), [params] * len(names))
    states.rows(names)                       # a batch's rows remembered
    return states


def test_removing_many_is_removing_one_after_another():
    names = ["a", "b", "c", "d", "e"]            # rows 0 to 4; rows 7, 6, 5 free
    states = _states(names)
    assert states.index_of == dict(zip(names, range(5))) and states._free == [7, 6, 5]
    rows = states.remove_many(["d", "zz", "a", "d", "c"])   # an unknown id, an id twice
    assert rows == [3, None, 0, None, 2]
    # Each freed row goes to the end of the free list in turn: the last freed is taken first.
    assert states._free == [7, 6, 5, 3, 0, 2]
    assert states.index_of == {"b": 1, "e": 4}
    assert states.req_ids[:5] == [None, "b", None, None, "e"]
    assert [p is None for p in states.params[:5]] == [True, False, True, True, False]
    assert states._rows_key is None
    params = [SimpleNamespace(greedy=True)] * 2
    assert list(states.add_many(["x", "y"], [[1], [2]], [0, 0], params)) == [2, 0]
    assert states.remove("x") == 2 and states.remove("x") is None and states._free[-1] == 2


def test_removing_nobody_keeps_the_last_batch():
    states = _states(["a", "b"])
    assert states.remove_many(["q"]) == [None] and states._rows_key == ["a", "b"]
    assert states.remove_many([]) == [] and states._rows_key == ["a", "b"]
