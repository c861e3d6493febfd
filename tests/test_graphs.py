"""Compiled graphs held per key (src/attnlab/graphs.py): each key a dynamo cache of its own, so
one process compiles past dynamo's recompile limit (8 graphs of one code object) without
FailOnRecompileLimitHit; a key whose guards still vary past the limit is renewed once and then
kept; the table is bounded (least recently used dropped first, dead models' keys purged), and
compiles are counted. dynamo's "eager" backend: the bookkeeping is dynamo's, not inductor's."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch._dynamo.exc import FailOnRecompileLimitHit

from attnlab.graphs import Graphs, bucket, compiled_graphs, describe, fresh_copy


def double(x: torch.Tensor) -> torch.Tensor:
    return x * 2 + 1


def holder(**kw) -> Graphs:
    return Graphs(double, fullgraph=True, dynamic=False, backend="eager", **kw)


def test_one_function_compiled_past_the_recompile_limit_by_key():
    """The same function, one torch.compile for every shape, fails at the 9th; held per key, 12
    shapes are 12 graphs, each counted once, and calling a shape again compiles nothing."""
    shared = torch.compile(fresh_copy(double), fullgraph=True, dynamic=False, backend="eager")
    with pytest.raises(FailOnRecompileLimitHit):
        for n in range(1, 13):
            shared(torch.ones(n))
    graphs = holder()
    for n in range(1, 13):
        assert torch.equal(graphs(n, torch.ones(n)), torch.full((n,), 3.0))
    assert graphs.compiles == 12 and len(graphs) == 12
    before = compiled_graphs()
    for n in range(1, 13):
        graphs(n, torch.ones(n))
    assert compiled_graphs() == before and graphs.compiles == 12


def test_a_key_past_the_limit_is_renewed_once_and_kept():
    """Shapes that vary within one key: past the limit (2 here) the key's copy is replaced by a
    new generation, which then serves its shapes without compiling again."""
    graphs = holder()
    with torch._dynamo.config.patch(recompile_limit=2):
        graphs("k", torch.ones(1))
        graphs("k", torch.ones(2))
        assert graphs.generation("k") == 0
        graphs("k", torch.ones(3))  # the 3rd graph of the key: a new generation compiles it
        assert graphs.renewed == 1 and graphs.generation("k") == 1
        compiles = graphs.compiles
        graphs("k", torch.ones(3))  # kept: no compile, no renewal
        assert graphs.compiles == compiles and graphs.generation("k") == 1


def test_the_table_is_bounded_and_forgets_dead_models():
    graphs = holder(capacity=3)
    for n in range(1, 6):
        graphs(n, torch.ones(n))
    assert len(graphs) == 3 and 1 not in graphs and 5 in graphs  # oldest use dropped first
    graphs(3, torch.ones(3))  # used again: now the newest
    graphs(6, torch.ones(6))
    assert 3 in graphs and 4 not in graphs
    for n in (3, 5, 6):  # graphs compiled up front are not dropped for later ones
        graphs.pin(n)
    for n in range(7, 11):
        graphs(n, torch.ones(n))
    assert all(n in graphs for n in (3, 5, 6, 10)) and len(graphs) == 4
    graphs.drop(10)
    assert 10 not in graphs

    model = torch.nn.Linear(2, 2)
    by_model = Graphs(lambda m, x: m(x), fullgraph=True, dynamic=False, backend="eager")
    by_model((weakref.ref(model), 2), model, torch.ones(1, 2))
    by_model((weakref.ref(model), 3), model, torch.ones(1, 2))
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None  # dynamo's guards do not keep a model alive
    other = torch.nn.Linear(2, 2)
    by_model((weakref.ref(other), 2), other, torch.ones(1, 2))  # a miss purges the dead keys
    assert len(by_model) == 1


def test_helpers():
    assert [bucket(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 16]
    err = RuntimeError("first line\nsecond")
    assert describe(err) == "RuntimeError: first line"
    assert fresh_copy(double).__code__ is not double.__code__
