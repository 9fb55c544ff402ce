"""Aliases are rejected with both paths in tree mode and kept with graph=True."""

from __future__ import annotations

import re

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import treemode


class Tied(nnx.Module):
    def __init__(self):
        self.a = nnx.Param(jnp.ones(2))
        self.b = self.a


class SharedSub(nnx.Module):
    def __init__(self):
        self.enc = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
        self.dec = self.enc


@pytest.mark.parametrize(
    "make_call, paths",
    [
        (lambda f, v: f(v, v), (r"args\[0\]", r"args\[1\]")),
        (lambda f, v: f(Tied(), None), (r"args\[0\]\.a", r"args\[0\]\.b")),
        (lambda f, v: f(SharedSub(), None), (r"args\[0\]\.dec\.bias", r"args\[0\]\.enc\.bias")),
        (lambda f, v: f(v, None, extra=v), (r"args\[0\]", r"kwargs\['extra'\]")),
        (lambda f, v: f({"x": v, "y": [v]}, None), (r"args\[0\]\['x'\]", r"args\[0\]\['y'\]\[0\]")),
    ],
    ids=["across-args", "inside-module", "shared-submodule", "in-kwargs", "in-containers"],
)
def test_alias_rejected_with_both_paths(make_call, paths):
    v = nnx.Param(jnp.ones(2))

    @treemode.jit
    def f(a, b, extra=None):
        return 0

    with pytest.raises(treemode.AliasError) as info:
        make_call(f, v)
    message = str(info.value)
    assert message.startswith("treemode.jit:")
    for path in paths:
        assert re.search(path, message), (path, message)
    assert "graph=True" in message


def test_graph_true_keeps_sharing_inside_module():
    tied = Tied()

    @treemode.jit(graph=True)
    def f(m):
        assert m.a is m.b
        m.a[...] += 1
        return m.b[...]

    np.testing.assert_allclose(f(tied), 2 * jnp.ones(2))
    assert tied.a is tied.b
    np.testing.assert_allclose(tied.b[...], 2 * jnp.ones(2))


def test_graph_true_keeps_sharing_across_arguments():
    enc = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    counter = nnx.BatchStat(jnp.array(0))

    @treemode.jit(graph=True)
    def f(a, b, c1, c2):
        assert a is b and c1 is c2
        c1[...] += 1
        c2[...] += 1
        return a(jnp.ones((1, 2)))

    f(enc, enc, counter, counter)
    assert int(counter[...]) == 2


def test_input_variable_returned_as_output():
    m = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    with pytest.raises(treemode.AliasError, match=r"treemode.jit: .*args\[0\]\.kernel.*output"):
        treemode.jit(lambda m: m.kernel)(m)
    with pytest.raises(treemode.AliasError, match="returns the Param"):
        treemode.jit(lambda m: {"out": m})(m)


def test_closure_variable_returned_as_output():
    m = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    with pytest.raises(treemode.AliasError, match=r"closure m\.kernel"):
        treemode.jit(lambda: m.kernel)()


def test_same_new_variable_returned_twice():
    def f():
        v = nnx.Param(jnp.ones(1))
        return v, v

    with pytest.raises(treemode.AliasError, match=r"output\[0\] and output\[1\]"):
        treemode.jit(f)()
    a, b = treemode.jit(f, graph=True)()
    assert a is b


def test_aliases_leave_inputs_unchanged():
    tied = Tied()
    before = tied.a.get_raw_value()

    @treemode.jit
    def f(m):
        m.a[...] += 1

    with pytest.raises(treemode.AliasError):
        f(tied)
    assert tied.a.get_raw_value() is before


def test_check_no_aliases_public_helper():
    v = nnx.Param(jnp.ones(1))
    treemode.check_no_aliases(args=(v,), kwargs={"w": nnx.Param(jnp.ones(1))})
    with pytest.raises(treemode.AliasError, match=r"args\[0\].*kwargs\['w'\]"):
        treemode.check_no_aliases(args=(v,), kwargs={"w": v})


def test_jit_partial_checks_its_bound_arguments_when_made():
    v = nnx.Param(jnp.array(1.0))
    c1, c2 = nnx.Dict(v=v), nnx.Dict(v=v)

    def f(c1, c2, x):
        c1["v"][...] += x
        return c1["v"][...] + c2["v"][...]

    with pytest.raises(
        treemode.AliasError,
        match=r"treemode\.jit_partial: Duplicate Param: .*found at paths args\[0\]\.v "
        r"and args\[1\]\.v",
    ):
        treemode.jit_partial(f, c1, c2)  # refused before any call
    assert float(v[...]) == 1.0
    fast = treemode.jit_partial(f, c1, c2, graph=True)  # the sharing is kept
    np.testing.assert_allclose(fast(jnp.array(1.0)), 4.0)
    np.testing.assert_allclose(v[...], 2.0)


# Each message keeps treemode's form (transform, paths, fix) and carries the term
# Flax users know for the error, so searches and tests written against Flax work.
def _returned_input():
    m = nnx.Dict(a=nnx.Param(jnp.ones(2)))
    treemode.vmap(lambda m: m, in_axes=0)(m)


def _returned_closure():
    m = nnx.Dict(a=nnx.Param(jnp.ones(2)))
    treemode.jit(lambda: m)()


def _inconsistent():
    v = nnx.Param(jnp.ones(3))
    treemode.vmap(lambda a, b: a[...] + b[...], in_axes=(0, None), graph=True)(v, v)


@pytest.mark.parametrize(
    "trigger, term, paths",
    [
        (lambda: treemode.jit(lambda a, b: None)(Tied().a, Tied().a), None, None),
        (lambda: treemode.jit(lambda m: 0)(Tied()), "Duplicate Param", ("args[0].a", "args[0].b")),
        (_returned_input, "Duplicate Param", ("args[0].a", "output.a")),
        (_returned_input, "does not support Variable aliasing", None),
        (_returned_closure, "Cannot return captured Variable", ("closure m.a", "output.a")),
        (_inconsistent, "Inconsistent aliasing detected", ("args[0]: 0", "args[1]: None")),
    ],
    ids=["distinct", "duplicate", "returned", "returned-aliasing", "captured", "inconsistent"],
)  # fmt: skip
def test_alias_messages_carry_the_established_terms(trigger, term, paths):
    if term is None:  # two different Params: no error
        trigger()
        return
    with pytest.raises(treemode.AliasError) as info:
        trigger()
    text = str(info.value)
    assert text.startswith("treemode.") and term in text
    for p in paths or ():
        assert p in text, text
