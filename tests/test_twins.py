"""Differential tests: each compiled kernel and its Python twin decide alike.

The compiled extension (``treemode/_accel/_guard*.c``) and the Python code implement the
same kernels: the flattening guard (``holds``); and the executor of the
fast-path record matches what its Python twin matches
(``_executor.match_into``), its closure-read check included
(``_closure_reads.reads_hold_python``), and writes what the pipeline writes
(``_writeback.write_back``). Here both are fed the same hypothesis-generated models,
mutations and call sequences, and must give the same decisions: hit or miss,
what is collected or written, the error raised. The compiled module is loaded
directly, so these tests run in both CI modes (with ``TREEMODE_NO_EXTENSION=1``
too) wherever the extension was built.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given
from hypothesis import strategies as st

from treemode import _compat
from treemode._accel import _compiled
from treemode._pipeline import _callsite, _executor
from treemode._tree import _closure_reads, _flat_guard, _flatten, _leaves

try:
    COMPILED = importlib.import_module("treemode._accel._guard")
except ImportError:  # pragma: no cover - a build without a C compiler
    COMPILED = None

pytestmark = pytest.mark.skipif(COMPILED is None, reason="the C extension is not built")


@pytest.fixture(autouse=True)
def compiled_kernels(monkeypatch):
    """Where the extension is off, configure the loaded module and let new
    flattenings build the compiled guard state and ``Guarded`` too (both twins
    then exist)."""
    assert COMPILED is not None
    COMPILED.configure(**_callsite.configure_fields())
    monkeypatch.setattr(_flat_guard, "_compiled_holds", COMPILED.holds)
    monkeypatch.setattr(_flat_guard, "_version_tags", COMPILED.version_tags)
    monkeypatch.setattr(_flat_guard, "_GUARD_STATE_FIELDS", COMPILED.GUARD_STATE_FIELDS)
    monkeypatch.setattr(_flatten, "_Guarded", COMPILED.Guarded)
    monkeypatch.setattr(_callsite, "_GUARDED", COMPILED.Guarded)
    _flatten._cache.clear()
    yield
    _flatten._cache.clear()


# -- models and mutations -------------------------------------------------------


class Custom(nnx.Variable):
    pass


VAR_TYPES = [nnx.Param, nnx.BatchStat, Custom]


class Node(nnx.Module):
    pass


@st.composite
def variables(draw: Any) -> nnx.Variable:
    cls = draw(st.sampled_from(VAR_TYPES))
    shape = draw(st.sampled_from([(), (2,), (1, 3)]))
    meta = draw(st.dictionaries(st.sampled_from(["tag", "scale"]), st.integers(0, 3), max_size=2))
    return cls(jnp.full(shape, draw(st.integers(-3, 3)), jnp.float32), **meta)


@st.composite
def trees(draw: Any, depth: int = 2) -> Any:
    kind = draw(st.sampled_from(["module", "module", "dict", "list"] if depth else ["module"]))
    n = draw(st.integers(1, 3))
    children = []
    for _ in range(n):
        if depth and draw(st.booleans()):
            children.append(draw(trees(depth - 1)))
        elif draw(st.integers(0, 4)) == 0:
            children.append(draw(st.integers(0, 2)))  # a static leaf
        else:
            children.append(draw(variables()))
    if kind == "dict":
        return {f"k{i}": c for i, c in enumerate(children)}
    if kind == "list":
        return children
    node = Node()
    for i, c in enumerate(children):
        setattr(node, f"a{i}", nnx.data(c) if isinstance(c, (dict, list)) else c)
    return node


def _containers(tree: Any) -> list[Any]:
    """Every module, dict and list in ``tree`` (the places a mutation can hit)."""
    out = [tree]
    values = (
        list(tree.values())
        if isinstance(tree, dict)
        else list(tree)
        if isinstance(tree, list)
        else [v for k, v in vars(tree).items() if not k.startswith("_")]
    )
    for v in values:
        if isinstance(v, (dict, list, nnx.Module)):
            out += _containers(v)
    return out


def _leaf_vars(tree: Any) -> list[nnx.Variable]:
    return [x for x in _flatten.variables_of([_flatten.flatten_arg(tree, _leaves.is_array)])]


MUTATIONS = [
    "none",
    "new value",
    "same static again",
    "replace variable",
    "change class",
    "new metadata",
    "add attribute",
    "delete attribute",
    "replace __dict__",
    "container append",
    "new static",
]


def _mutate(tree: Any, how: str, pick: int) -> None:
    """Apply one mutation to ``tree`` (``pick`` chooses where)."""
    places = _containers(tree)
    place = places[pick % len(places)]
    variables_ = _leaf_vars(tree)
    var = variables_[pick % len(variables_)] if variables_ else None

    def items(c: Any) -> list[tuple[Any, Any]]:
        if isinstance(c, dict):
            return list(c.items())
        if isinstance(c, list):
            return list(enumerate(c))
        return [(k, v) for k, v in vars(c).items() if not k.startswith("_")]

    def assign(c: Any, k: Any, v: Any) -> None:
        if isinstance(c, (dict, list)):
            c[k] = v
        else:
            setattr(c, k, v)

    if how == "new value" and var is not None:
        var[...] = var[...] + 1
    elif how == "same static again":
        for k, v in items(place):
            if isinstance(v, int):
                assign(place, k, v)
    elif how == "replace variable":
        for k, v in items(place):
            if isinstance(v, nnx.Variable):
                assign(place, k, type(v)(v[...]))
                break
    elif how == "change class" and var is not None:
        var.__class__ = nnx.BatchStat if type(var) is not nnx.BatchStat else nnx.Param
    elif how == "new metadata" and var is not None:
        var.set_metadata("tag", 99)
    elif how == "add attribute":
        if isinstance(place, dict):
            place["extra"] = 1
        elif isinstance(place, list):
            place.append(1)
        else:
            place.extra = nnx.Param(jnp.zeros(()))
    elif how == "delete attribute":
        for k, _ in items(place)[:1]:
            if isinstance(place, (dict, list)):
                del place[k]
            else:
                delattr(place, k)
    elif how == "replace __dict__" and isinstance(place, nnx.Module):
        object.__setattr__(place, "__dict__", dict(vars(place)))
    elif how == "container append" and isinstance(place, list):
        place.append(nnx.Param(jnp.zeros(())))
    elif how == "new static":
        for k, v in items(place):
            if isinstance(v, int):
                assign(place, k, v + 1000)
                break


# -- holds ------------------------------------------------------------------------


@given(tree=trees(), steps=st.lists(st.tuples(st.sampled_from(MUTATIONS), st.integers(0, 50))))
def test_holds_decides_as_its_python_twin(tree, steps):
    for how, pick in [("none", 0), *steps]:
        _flatten._cache.clear()
        entry = _flatten.flatten_arg(tree, _leaves.is_array)
        entry = entry.origin or entry
        guard = entry._guard
        if guard is None or guard.compiled_state is None:
            return  # not cacheable (e.g. a dict at the top): no guard to compare
        vars_before = list(entry.variables)
        _mutate(tree, how, pick)
        compiled = COMPILED.holds(guard.compiled_state, vars_before, tree)
        python = guard.holds_python(vars_before, tree)
        assert compiled == python, (how, compiled, python)
        if how in ("none", "new value", "same static again"):
            assert compiled, how


# -- the compiled executor against its Python twin ---------------------------------


@contextlib.contextmanager
def _misses_of(f: Any) -> Iterator[list[Any]]:
    """The misses of ``f``'s executor while the block runs (each goes on to the pipeline)."""
    missed: list[Any] = []
    real_miss = f._miss

    def miss(wrapper: Any, error: Any, args: Any, kwargs: Any) -> Any:
        missed.append(error)
        return wrapper._on_miss(error, args, kwargs)

    f._miss = miss
    try:
        yield missed
    finally:
        f._miss = real_miss


def _add_one(tree: Any) -> None:
    for v in _leaf_vars(tree):
        v[...] = v[...] + 1


@pytest.mark.skipif(not _compiled.ENABLED, reason="the executor's base class is fixed at import")
@given(
    tree=trees(),
    calls=st.lists(st.tuples(st.sampled_from(MUTATIONS), st.integers(0, 50)), max_size=4),
)
def test_the_executor_decides_as_its_python_twin(tree, calls):
    """A call sequence with mutations in between: before each call, the Python
    executor's match (`_executor.match`) says hit or miss for the record; the
    compiled executor must decide the same (a miss reaches `_miss`), and write
    what eager code does."""
    import treemode

    if not _leaf_vars(tree):
        return
    f = treemode.jit(_add_one)
    f(tree)
    for how, pick in calls:
        _mutate(tree, how, pick)
        records = list(f._records)
        python_hit = any(_executor.match(r, (tree,), None) is not None for r in records)
        before = _snapshot_values(tree)
        with _misses_of(f) as missed:
            f(tree)
        executor_hit = bool(records) and not missed
        assert executor_hit == python_hit, (how, missed)
        after = _snapshot_values(tree)
        assert set(after) == set(before)
        for key, value in after.items():  # every Variable's value went up by one
            np.testing.assert_allclose(value, before[key] + 1)


def _snapshot_values(tree: Any) -> dict[int, np.ndarray]:
    return {id(v): np.asarray(v[...]).copy() for v in _leaf_vars(tree)}


# -- the closure reads, through the executor -------------------------------------
#
# The closure-read check has no exported compiled kernel (a copy for the pipeline
# saved under 2% of a call: docs/performance.md); the executor makes it in C on
# every call, bound here to the Python executor's match, which makes it with
# `treemode._tree._closure_reads.reads_hold_python`.


@pytest.mark.skipif(not _compiled.ENABLED, reason="the executor's base class is fixed at import")
@given(
    n_globals=st.integers(0, 3),
    n_cells=st.integers(0, 3),
    changes=st.lists(st.sampled_from(["global", "cell", "code", "new global", "none"])),
)
def test_the_executors_closure_reads_decide_as_reads_hold_python(n_globals, n_cells, changes):
    import treemode

    namespace: dict[str, Any] = {"__builtins__": __builtins__}
    for i in range(n_globals):
        namespace[f"g{i}"] = nnx.Linear(1, 1, rngs=nnx.Rngs(i))
    cell_values = [nnx.Linear(1, 1, rngs=nnx.Rngs(10 + i)) for i in range(n_cells)]
    params = ", ".join(f"c{i}" for i in range(n_cells))
    body = " + ".join([f"g{i}.bias[...].sum()" for i in range(n_globals)] + ["x"])
    body += "".join(f" + c{i}.bias[...].sum()" for i in range(n_cells))
    exec(f"def outer({params}):\n    def f(x):\n        return {body}\n    return f\n", namespace)
    fn = namespace["outer"](*cell_values)
    f = treemode.jit(fn)
    x = jnp.ones(())
    f(x)
    for change in changes:
        if change == "global" and n_globals:
            namespace["g0"] = nnx.Linear(1, 1, rngs=nnx.Rngs(99))
        elif change == "new global":
            namespace["unrelated"] = 1
        elif change == "cell" and n_cells:
            fn.__closure__[0].cell_contents = nnx.Linear(1, 1, rngs=nnx.Rngs(98))
        elif change == "code":
            fn.__code__ = fn.__code__.replace(co_name="f")  # another code object
        records = list(f._records)
        record = records[0] if records else None
        reads_python = record is not None and _closure_reads.reads_hold_python(record.closure_reads)
        python_hit = any(_executor.match(r, (x,), None) is not None for r in records)
        with _misses_of(f) as missed:
            out = f(x)
        executor_hit = bool(records) and not missed
        assert executor_hit == python_hit, change
        if record is not None and not reads_python:
            assert not executor_hit, change  # a changed read is a miss in C too
        np.testing.assert_allclose(out, fn(x), rtol=1e-6)


# -- the write, through the executor ---------------------------------------------
#
# The write has no exported compiled kernel (a copy for the pipeline saved under
# 2% of a call: docs/performance.md); the executor writes in C on every matched
# call, bound here to the pipeline's `_writeback.write_back`.


@pytest.mark.skipif(not _compiled.ENABLED, reason="the executor's base class is fixed at import")
@given(
    tree=trees(),
    updates=st.lists(st.sampled_from(["none", "new", "new"]), min_size=1, max_size=12),
)
def test_the_executors_write_writes_as_write_back(tree, updates):
    """The same step on a tree and on its clone: by the executor of the record
    (the tree) and by the pipeline (the clone, whose wrapper emits no record).
    The same Variables get the same new values; the others keep their very
    value objects."""
    import treemode

    twin = nnx.clone(tree) if isinstance(tree, nnx.Module) else None
    if twin is None or not _leaf_vars(tree):
        return
    chosen = [updates[i % len(updates)] == "new" for i in range(len(_leaf_vars(tree)))]

    def step(t: Any) -> None:
        for i, (v, change) in enumerate(zip(_leaf_vars(t), chosen, strict=True)):
            if change:
                v[...] = v[...] + 7.0 + i

    by_executor, by_pipeline = treemode.jit(step), treemode.jit(step)
    by_executor(tree)
    by_pipeline._call(twin)
    if not by_executor._records:
        return  # no fast path for this tree (e.g. values that are not one array)
    before_c = [_compat.raw_value_of(v) for v in _leaf_vars(tree)]
    before_p = [_compat.raw_value_of(v) for v in _leaf_vars(twin)]
    with _misses_of(by_executor) as missed:
        by_executor(tree)
    by_pipeline._call(twin)
    assert not missed  # the executor ran the call, and wrote
    pairs = zip(_leaf_vars(tree), _leaf_vars(twin), before_c, before_p, chosen, strict=True)
    for a, b, old_a, old_b, change in pairs:
        np.testing.assert_array_equal(_compat.raw_value_of(a), _compat.raw_value_of(b))
        assert (_compat.raw_value_of(a) is old_a) == (not change)
        assert (_compat.raw_value_of(b) is old_b) == (not change)
