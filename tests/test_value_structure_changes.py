"""A Variable's value changing structure between two calls of one warm transform.

An array that becomes a dict pytree, a tuple, ``None`` or a string changes the
argument's structure: the warm transform traces again and gives what eager
execution (and a fresh transform) gives, never an internal error. Every test
runs with the compiled call path (where the extension is on) and the Python one.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import treemode


@pytest.fixture(autouse=True)
def _implementation(implementation):
    return implementation


class Model(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.ones(3))
        self.s = nnx.Variable(jnp.zeros(3))


def step(m, x):
    """Reads and updates ``m.s`` whatever its layout."""
    s = m.s.get_value()
    base = x + m.w[...].sum()
    if isinstance(s, dict):
        m.s.set_value({"a": s["a"] + 1})
        return base * 2 + s["a"].sum()
    if isinstance(s, tuple):
        m.s.set_value((s[0] * 2,))
        return base * 4 + s[0].sum()
    if s is None:
        return base * 3
    if isinstance(s, str):
        return base * len(s)
    m.s.set_value(s + 1)
    return base + s.sum()


def layouts(strings=True):
    """New arrays on every call: a donated call deletes the buffers it is given."""
    values = [
        {"a": jnp.ones(2)},
        None,
        jnp.zeros(3),
        (jnp.full(2, 3.0),),
        "abcde",
        jnp.arange(3.0),
    ]
    return [v for v in values if strings or not isinstance(v, str)]


def _run(call, m, strings=True):
    outs = []
    for layout in layouts(strings):
        m.s.set_value(layout)
        outs.append(float(call(m, 1.0)))
        outs.append(float(call(m, 1.0)))  # a second, warm call with the new layout
    return outs


def _state(m):
    return jax.tree.map(np.asarray, nnx.state(m).to_pure_dict())


@pytest.mark.parametrize("graph", [False, True])
def test_jit_retraces_on_a_layout_change_and_matches_eager(graph):
    traces = []

    def counted(m, x):
        traces.append(1)
        return step(m, x)

    eager, jitted = Model(), Model()
    f = treemode.jit(counted, graph=graph)
    f(jitted, 1.0)  # warm: the flattening, the memo and the entry are cached
    step(eager, 1.0)
    assert _run(f, jitted) == _run(step, eager)
    jax.tree.map(np.testing.assert_array_equal, _state(jitted), _state(eager))
    # One trace per layout (the two array layouts share theirs), none on repeats.
    assert len(traces) == 5


def test_keyword_call_and_jit_partial_see_the_layout_change():
    eager, by_keyword, bound = Model(), Model(), Model()
    f = treemode.jit(step)
    g = treemode.jit_partial(step, bound)
    for m, call in ((by_keyword, lambda m, x: f(m=m, x=x)), (bound, lambda m, x: g(x))):
        call(m, 1.0)
    step(eager, 1.0)
    expected = _run(step, eager)
    assert _run(lambda m, x: f(m=m, x=x), by_keyword) == expected
    assert _run(lambda m, x: g(x), bound) == expected


def test_donated_call_sees_the_layout_change():
    eager, m = Model(), Model()
    f = treemode.jit(step, donate_argnums=0)
    f(m, 1.0)
    step(eager, 1.0)
    # (A string value is left out: a donated Variable's value comes back as an
    # output, and a string is no JAX output, whatever the layout history.)
    assert _run(f, m, strings=False) == _run(step, eager, strings=False)
    jax.tree.map(np.testing.assert_array_equal, _state(m), _state(eager))


@pytest.mark.parametrize(
    "transform",
    [
        pytest.param(lambda fn: treemode.grad(fn), id="grad"),
        pytest.param(lambda fn: treemode.vmap(fn, in_axes=(None, 0)), id="vmap"),
    ],
)
def test_other_transforms_see_the_layout_change(transform):
    def loss(m, x):
        s = m.s.get_value()
        extra = sum(jnp.sum(v) for v in jax.tree.leaves(s) if not isinstance(v, str))
        return jnp.sum(m.w[...] * x) + extra

    m = Model()
    f = transform(loss)
    x = jnp.ones(3) if transform.__name__ != "vmap" else jnp.ones((2, 3))
    f(m, x)
    for layout in ({"a": jnp.ones(2)}, None, jnp.zeros(3)):
        m.s.set_value(layout)
        out = f(m, x)
        fresh = transform(loss)(m, x)
        jax.tree.map(np.testing.assert_array_equal, out, fresh)


def test_a_layout_change_is_explained_as_one(caplog):
    m = Model()
    # A function of its own: wrappers of one function share their traces (the
    # other parametrization's would have traced this layout already).
    f = treemode.jit(lambda m, x: step(m, x))
    f(m, 1.0)
    m.s.set_value({"a": jnp.ones(2)})
    with jax.explain_cache_misses(True), caplog.at_level(logging.WARNING, "treemode"):
        f(m, 1.0)
    assert "m.s: the structure of the Variable's value changed" in caplog.text


def test_a_module_read_through_the_closure_sees_the_layout_change():
    m = Model()

    def f(x):
        return x + sum(jnp.sum(v) for v in jax.tree.leaves(m.s.get_value()))

    g = treemode.jit(f)
    for value in (None, {"a": jnp.ones(2)}, jnp.ones(3), (jnp.ones(4),)):
        assert float(g(1.0)) == float(f(1.0))
        m.s.set_value(value)
        assert float(g(1.0)) == float(f(1.0))
        assert float(g(1.0)) == float(f(1.0))  # the memo's closure match
