"""A replaced ``__dict__`` or ``__class__`` between two calls is seen by the next call.

A cached call revalidates the flattening it reuses by identity. Replacing an NNX
object's ``__dict__`` (``object.__setattr__(m, "__dict__", d)``) leaves the old
dict unchanged, and replacing a class (``v.__class__ = nnx.BatchStat``) changes
nothing the old snapshot holds, so the guard also compares every object's
``__dict__`` and type: the next call must read the Variables the object holds
now, write its updates there (not into the detached ones) and trace the new
class. Each case runs with the compiled guard and with its Python twin
(``implementation``) and compares with the same program run eagerly on a twin
model given the same replacement.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import treemode


class Inner(nnx.Module):
    factor = 1.0

    def __init__(self):
        self.w = nnx.Param(jnp.ones(2))
        self.count = nnx.BatchStat(jnp.zeros(()))


class Inner5(Inner):
    factor = 5.0


class Outer(nnx.Module):
    factor = 1.0

    def __init__(self):
        self.inner = Inner()
        self.b = nnx.Param(jnp.full(2, 2.0))


class Outer7(Outer):
    factor = 7.0


def step(m: Outer, x: jax.Array) -> jax.Array:
    """Reads and writes Variables; the result depends on every class involved."""
    m.inner.count[...] += 1
    m.b[...] = m.b[...] + x
    kind = 3.0 if isinstance(m.b, nnx.BatchStat) else 1.0
    scale = kind * m.factor * m.inner.factor
    return m.inner.w[...] * m.b[...] * scale + m.inner.count[...]


def read(m: Outer, x: jax.Array) -> jax.Array:
    kind = 3.0 if isinstance(m.b, nnx.BatchStat) else 1.0
    return m.inner.w[...] * x * m.b[...] * kind * m.factor * m.inner.factor


def _jit(m: Outer) -> Callable[[Any], Any]:
    f = treemode.jit(step)
    return lambda x: f(m, x)


def _vmap(m: Outer) -> Callable[[Any], Any]:
    f = treemode.vmap(read, in_axes=(None, 0))
    return lambda x: f(m, x)


# How each transform is called on a model (``x -> result``), and its eager twin.
TRANSFORMS: dict[str, tuple[Callable[[Any], Callable[[Any], Any]], Callable[..., Any]]] = {
    "jit": (_jit, step),
    "jit_partial": (lambda m: treemode.jit_partial(step, m), step),
    "vmap": (_vmap, read),
}


def _state(m: Outer) -> list[tuple[str, type, np.ndarray]]:
    """Every Variable of ``m``: its path, type and value."""
    return [
        (str(path), type(v), np.asarray(v.get_raw_value()))
        for path, v in nnx.iter_graph(m)
        if isinstance(v, nnx.Variable)
    ]


def _renewed(v: Any, value: float) -> Any:
    return v.replace(jnp.full(jnp.shape(v.get_raw_value()), value))


def _replace_dict(obj: Any, **new: float) -> None:
    """Replace ``obj.__dict__`` by a copy whose Variables ``new`` names are new objects."""
    attrs = dict(vars(obj))
    for name, value in new.items():
        attrs[name] = _renewed(attrs[name], value)
    object.__setattr__(obj, "__dict__", attrs)


REPLACEMENTS: dict[str, Callable[[Outer], None]] = {
    "top __dict__": lambda m: _replace_dict(m, b=5.0),
    "submodule __dict__": lambda m: _replace_dict(m.inner, w=3.0, count=10.0),
    "Variable __class__": lambda m: setattr(m.b, "__class__", nnx.BatchStat),
    "module __class__": lambda m: object.__setattr__(m, "__class__", Outer7),
    "submodule __class__": lambda m: object.__setattr__(m.inner, "__class__", Inner5),
}


@pytest.mark.parametrize("replacement", sorted(REPLACEMENTS))
@pytest.mark.parametrize("transform", sorted(TRANSFORMS))
def test_replacement_between_calls_matches_eager(implementation, transform, replacement):
    make, eager = TRANSFORMS[transform]
    m, twin = Outer(), Outer()
    f = make(m)
    x = jnp.ones(2) if transform != "vmap" else jnp.arange(6.0).reshape(3, 2)
    for call in range(3):
        if call == 1:
            detached = [v for _, v in nnx.iter_graph(m) if isinstance(v, nnx.Variable)]
            values = [v.get_raw_value() for v in detached]
            REPLACEMENTS[replacement](m)
            REPLACEMENTS[replacement](twin)
        np.testing.assert_array_equal(f(x), eager(twin, x))
        actual, expected = _state(m), _state(twin)
        assert [(p, t) for p, t, _ in actual] == [(p, t) for p, t, _ in expected]
        for (path, _, a), (_, _, e) in zip(actual, expected, strict=True):
            np.testing.assert_array_equal(a, e, err_msg=path)
    # A Variable no longer in the model was not written after the replacement.
    held = {id(v) for _, v in nnx.iter_graph(m)}
    for v, value in zip(detached, values, strict=True):
        if id(v) not in held:
            assert v.get_raw_value() is value


def test_replaced_dict_update_lands_in_the_held_variable(implementation):
    m = Outer()
    f = treemode.jit(step)
    f(m, jnp.ones(2))
    f(m, jnp.ones(2))  # cached: the call-site memo
    old_b = m.b
    old_value = old_b.get_raw_value()
    _replace_dict(m, b=10.0)
    f(m, jnp.ones(2))
    np.testing.assert_array_equal(m.b[...], jnp.full(2, 11.0))
    assert old_b.get_raw_value() is old_value  # the detached Variable is untouched


def test_replaced_state_dict_is_seen(implementation):
    state = nnx.State({"a": nnx.Param(jnp.ones(2))})

    @treemode.jit
    def bump(s):
        s["a"][...] += 1.0
        return s["a"][...]

    bump(state)
    bump(state)
    new = nnx.Param(jnp.full(2, 10.0))
    object.__setattr__(state, "__dict__", {"_mapping": {"a": new}})
    np.testing.assert_array_equal(bump(state), jnp.full(2, 11.0))
    np.testing.assert_array_equal(new[...], jnp.full(2, 11.0))


class Peculiar(nnx.Module):
    """A class whose attribute lookup is its own (``obj.__dict__`` is read with getattr)."""

    def __init__(self):
        self.w = nnx.Param(jnp.ones(2))

    def __getattribute__(self, name: str) -> Any:
        return super().__getattribute__(name)


def _peculiar_w(a: Any, x: Any) -> Any:
    return (a["p"] if isinstance(a, nnx.Dict) else a).w[...] * x


@pytest.mark.parametrize("where", ["top", "submodule"])
def test_replaced_dict_of_a_class_with_its_own_attribute_lookup(implementation, where):
    p = Peculiar()
    arg = nnx.Dict({"p": p}) if where == "submodule" else p
    f = treemode.jit(_peculiar_w)
    f(arg, 2.0)
    f(arg, 2.0)
    _replace_dict(p, w=4.0)
    np.testing.assert_array_equal(f(arg, 2.0), jnp.full(2, 8.0))


def test_unchanged_objects_still_reuse_the_cached_flattening(implementation):
    from treemode._tree import _flatten

    m = Outer()
    f = treemode.jit(step)
    f(m, jnp.ones(2))
    entry = _flatten._cache[id(m)]
    f(m, jnp.ones(2))
    m.inner.count[...] = 0.0  # a new value, same objects: still the cached flattening
    f(m, jnp.ones(2))
    assert _flatten._cache[id(m)] is entry
    object.__setattr__(m.inner, "__class__", Inner5)
    f(m, jnp.ones(2))
    assert _flatten._cache[id(m)] is not entry


# -- modules read through the closure ------------------------------------------------


class Scaled(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.ones(2))
        self.scale = 2

    def __call__(self, x):
        return self.w[...] * x * self.scale


class Counting(Scaled):
    def __call__(self, x):
        self.w[...] += 1.0
        return self.w[...] * x * 10.0


def test_closure_module_class_replaced_between_calls(implementation):
    m, twin = Scaled(), Scaled()
    f = treemode.jit(lambda x: m(x))
    for call in range(3):
        if call == 1:
            object.__setattr__(m, "__class__", Counting)
            object.__setattr__(twin, "__class__", Counting)
        np.testing.assert_array_equal(f(2.0), twin(2.0))
        np.testing.assert_array_equal(m.w[...], twin.w[...])


def test_module_jitted_as_the_function_class_replaced(implementation):
    m = Scaled()
    f = treemode.jit(m)
    f(2.0)
    f(2.0)
    object.__setattr__(m, "__class__", Counting)
    np.testing.assert_array_equal(f(2.0), jnp.full(2, 40.0))  # Counting.__call__
    np.testing.assert_array_equal(m.w[...], jnp.full(2, 2.0))


@pytest.mark.parametrize("new", [3, 2.0])
def test_closure_module_static_attribute_replaced_between_calls(implementation, new):
    # The trace reads a closure module's static attributes from the live object:
    # a new value (or an equal one of another type) traces again.
    m = Scaled()
    f = treemode.jit(lambda x: m(x))
    f(jnp.ones((), jnp.int32))
    f(jnp.ones((), jnp.int32))
    m.scale = new
    out = f(jnp.ones((), jnp.int32))
    expected = m(jnp.ones((), jnp.int32))
    assert out.dtype == expected.dtype
    np.testing.assert_array_equal(out, expected)


def test_closure_submodule_dict_replaced_between_calls(implementation):
    outer = Outer()
    f = treemode.jit(lambda x: step(outer, x))
    f(jnp.ones(2))
    f(jnp.ones(2))
    old_w = outer.inner.w
    _replace_dict(outer.inner, w=3.0)
    f(jnp.ones(2))
    np.testing.assert_array_equal(outer.b[...], jnp.full(2, 5.0))
    np.testing.assert_array_equal(outer.inner.count[...], 3.0)
    assert outer.inner.w is not old_w
    np.testing.assert_array_equal(f(jnp.zeros(2)), 3.0 * 5.0 + 4.0)
