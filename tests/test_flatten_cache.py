"""The per-argument flattening cache: every change that alters a flattening is seen.

The cache (``treemode._tree._flatten``) revalidates a cached flattening with bulk
identity checks; each test below changes an argument in one way between two calls
and asserts the second call sees the change (a new trace where the structure
differs, the new Variable where one was replaced). Every test runs with the
compiled guard (``treemode/_accel/_guard_kernels.c``, where the extension is on) and with the
pure-Python one that replaces it where it is off.
"""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import treemode
from treemode._accel import _compiled
from treemode._tree import _flat_guard, _flatten


@pytest.fixture(autouse=True)
def guard(implementation, monkeypatch):
    """Which guard new flattenings get (the cache is emptied so none is reused)."""
    monkeypatch.setattr(_flatten, "_cache", {})
    return implementation


def test_the_compiled_guard_is_built():
    # `make install` compiles it wherever a C compiler is available (CI has one);
    # without it treemode is correct but slower, so a failed build must not go unseen
    # (also in `make test-python`, where TREEMODE_NO_EXTENSION only turns it off).
    module = _compiled.load(environ={})
    assert module is not None, "the compiled extension was not built"
    m = nnx.Module()
    m.w = nnx.Param(jnp.ones(2))
    flat = _flatten.flatten_arg(m, treemode._tree._leaves.is_array)
    assert module.holds is not None
    assert module.FastRecord is not None and module.FastCall is not None
    assert flat._guard is not None
    entry = flat.origin or flat
    if _flat_guard._compiled_holds is None:
        assert flat._guard.compiled_state is None and entry._fast is None
    else:  # what the compiled call-site match reads
        fast = entry._fast  # a Guarded: the argument, the guard state, the Variables, the entry
        assert fast.arg is entry._ref and fast.state is flat._guard.compiled_state
        assert fast.variables == (m.w,) and fast.flat() is entry


def _counting(fn):
    traces: list[int] = []

    def wrapped(*args):
        traces.append(1)
        return fn(*args)

    return treemode.jit(wrapped), traces


def test_plain_dict_key_renamed_with_the_same_value_object():
    f, traces = _counting(lambda d: d["w"][...] * len(d))
    shared_static = "static"
    tree = {"w": nnx.Param(jnp.ones(2)), "a": shared_static}
    f(tree)
    del tree["a"]
    tree["b"] = shared_static  # same length, same value object, another key
    f(tree)
    assert len(traces) == 2


def test_list_item_replaced_by_another_variable():
    f, _ = _counting(lambda xs: xs[0][...] + xs[1][...])
    xs = [nnx.Param(jnp.ones(2)), nnx.Param(jnp.ones(2))]
    np.testing.assert_allclose(f(xs), 2 * np.ones(2))
    xs[1] = nnx.Param(jnp.full(2, 5.0))
    np.testing.assert_allclose(f(xs), 6 * np.ones(2))


def test_list_grows_at_the_end():
    f, traces = _counting(lambda xs: sum(x[...] for x in xs))
    xs = [nnx.Param(jnp.ones(2))]
    f(xs)
    xs.append(nnx.Param(jnp.ones(2)))
    np.testing.assert_allclose(f(xs), 2 * np.ones(2))
    assert len(traces) == 2


def test_replaced_variable_with_an_equal_value_is_written_to():
    # Variable.__eq__ compares values: the cache must compare identities.
    @treemode.jit
    def bump(m):
        m.count[...] += 1

    m = nnx.Module()
    m.count = nnx.BatchStat(jnp.array(0))
    bump(m)
    old = m.count
    m.count = nnx.BatchStat(jnp.array(1))  # equal value, another Variable
    bump(m)
    assert int(m.count[...]) == 2 and int(old[...]) == 1


def test_metadata_changed_in_place_retraces():
    f, traces = _counting(lambda m: m.w[...] * 2)
    m = nnx.Module()
    m.w = nnx.Param(jnp.ones(2), tag="a")
    f(m)
    m.w.set_metadata("tag", "b")
    f(m)
    assert len(traces) == 2


def test_attribute_added_to_a_nested_module_is_seen():
    def total(m):
        variables = jax.tree.leaves(m, is_leaf=lambda v: isinstance(v, nnx.Variable))
        return sum(v[...].sum() for v in variables)

    f, traces = _counting(total)
    m = nnx.Module()
    m.inner = nnx.Module()
    m.inner.a = nnx.Param(jnp.ones(2))
    np.testing.assert_allclose(f(m), 2.0)
    m.inner.b = nnx.Param(jnp.ones(3))
    np.testing.assert_allclose(f(m), 5.0)
    assert len(traces) == 2


def test_cached_argument_written_from_an_outer_trace_is_refused():
    # The first call (top level) marks the cached flattening writable there;
    # the same module closed over by jax.jit must still be refused inside it.
    @treemode.jit
    def bump(m, x):
        m.count[...] += 1
        return x

    m = nnx.Module()
    m.count = nnx.BatchStat(jnp.array(0))
    bump(m, jnp.ones(1))
    bump(m, jnp.ones(1))
    with pytest.raises(treemode.TraceContextError, match=r"args\[0\]\.count"):
        jax.jit(lambda x: bump(m, x))(jnp.ones(1))
    assert int(m.count[...]) == 2
    bump(m, jnp.ones(1))
    assert int(m.count[...]) == 3


def test_metadata_replaced_by_an_equal_dict_keeps_the_trace():
    f, traces = _counting(lambda m: m.w[...] * 2)
    m = nnx.Module()
    m.w = nnx.Param(jnp.ones(2), tag="a")
    f(m)
    m.w.set_metadata(dict(m.w.get_metadata()))  # another dict, equal contents
    m.w[...] = jnp.ones(2) * 3.0  # same dtype and weak type: no new trace from JAX
    np.testing.assert_allclose(f(m), np.full(2, 6.0))
    assert len(traces) == 1


def test_metadata_key_swapped_for_another_with_the_same_value_object():
    f, traces = _counting(lambda m: m.w[...] * 2)
    shared = "value"
    m = nnx.Module()
    m.w = nnx.Param(jnp.ones(2), a=shared)
    f(m)
    m.w.del_metadata("a")
    m.w.set_metadata("b", shared)  # same length, same value object, another key
    f(m)
    assert len(traces) == 2


def test_ordered_dict_reordered_is_seen():
    f, traces = _counting(lambda d: list(d.values())[0][...])
    d = collections.OrderedDict(a=nnx.Param(jnp.ones(2)), b=nnx.Param(jnp.zeros(2)))
    np.testing.assert_allclose(f(d), np.ones(2))
    d.move_to_end("a")
    np.testing.assert_allclose(f(d), np.zeros(2))
    assert len(traces) == 2


def test_compiled_guard_reads_metadata_kept_outside_slots(extension):
    # Flax keeps `_var_metadata` in a slot, read directly; any other layout goes
    # through getattr, with the same answers.
    guard = extension

    class Holder:  # `_var_metadata` in the instance __dict__, not a slot
        pass

    v = Holder()
    v._var_metadata = {"tag": "a"}  # type: ignore[attr-defined]
    owner = {"v": v}
    state = (
        (owner,),
        (1,),
        (owner,),
        (v,),
        (owner,),
        ("v",),
        (v._var_metadata,),  # type: ignore[attr-defined]
        (("tag", "a"),),
        (),  # no node whose type is checked but the top-level argument's
        (),
        (),
        (),
        (Holder,),  # the Variable's type
        dict,  # the top-level argument's type, and no __dict__ to check
        None,
    )
    assert guard.holds(state, [v], owner)
    v._var_metadata["tag"] = "b"  # type: ignore[attr-defined]
    assert not guard.holds(state, [v], owner)
    v._var_metadata = {"tag": "a"}  # type: ignore[attr-defined]  # equal, another dict
    assert not guard.holds(state, [v], owner)
    del v._var_metadata  # type: ignore[attr-defined]
    assert not guard.holds(state, [v], owner)  # no metadata: False, and no exception leaks
    with pytest.raises(TypeError, match="15-tuple"):
        guard.holds(state[:3], [v], owner)


def test_version_tags_skip_unmodified_dicts_and_never_hide_a_change(extension):
    # With version tags (CPython 3.11), a dict not modified since the snapshot is
    # not compared; a modified one is compared in full, so a change restored to the
    # same objects still validates and any real change is caught.
    guard = extension
    v = nnx.Param(jnp.ones(2))
    m = nnx.Module()
    m.w = v
    m.label = "a"
    flat = _flatten.flatten_arg(m, treemode._tree._leaves.is_array)
    entry = flat.origin or flat
    state = flat._guard.compiled_state if flat._guard else None
    if state is None:  # the Python guard: no tags
        assert _flat_guard._compiled_holds is None
        return
    tags_built = guard.version_tags([{}]) is not None
    assert len(state) == (18 if tags_built else 15)
    assert guard.holds(state, [v], m)
    m.label = "b"
    m.label = "a"  # modified, then restored: compared in full, still the same objects
    assert guard.holds(state, [v], m)
    assert _flatten.flatten_arg(m, treemode._tree._leaves.is_array).origin is entry
    v.set_metadata("note", "x")  # in place, in the metadata dict
    assert not guard.holds(state, [v], m)
