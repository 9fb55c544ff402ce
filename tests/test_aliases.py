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
