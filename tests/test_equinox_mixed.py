"""Equinox modules inside NNX modules and NNX modules inside Equinox modules."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from helpers import Counter

import treemode


class WithEquinox(nnx.Module):
    def __init__(self, key):
        self.mlp = nnx.data(eqx.nn.MLP(2, 2, 4, 1, activation=jax.nn.gelu, key=key))
        self.steps = nnx.BatchStat(jnp.array(0))

    def __call__(self, x):
        self.steps[...] += 1
        return self.mlp(x)


class Holder(eqx.Module):
    inner: Counter
    linear: eqx.nn.Linear
    name: str = eqx.field(static=True, default="holder")

    def __call__(self, x):
        return self.linear(self.inner(x))


def test_equinox_inside_nnx_under_jit():
    model = WithEquinox(jax.random.key(0))
    traces = []

    @treemode.jit
    def f(m, x):
        traces.append(1)
        return m(x)

    x = jnp.ones(2)
    np.testing.assert_allclose(f(model, x), model.mlp(x), rtol=1e-6)
    f(model, x)
    assert int(model.steps[...]) == 2
    assert len(traces) == 1  # the activation function is static, hashed once


def test_nnx_inside_equinox_under_jit():
    holder = Holder(Counter(), eqx.nn.Linear(2, 2, key=jax.random.key(0)))

    @treemode.jit
    def f(h, x):
        return h(x)

    y = f(holder, jnp.ones(2))
    np.testing.assert_allclose(y, holder.linear(jnp.full(2, 2.0)), rtol=1e-6)
    assert int(holder.inner.count[...]) == 1


def test_mixed_model_under_eval_shape():
    model = WithEquinox(jax.random.key(0))
    out = treemode.eval_shape(lambda m, x: m(x), model, jnp.ones(2))
    assert out.shape == (2,)
    assert int(model.steps[...]) == 0


def test_no_tracer_left_in_variables_after_nesting(tracer_leaks):
    model = Counter()

    @jax.jit
    def outer(m, x):
        return treemode.jit(lambda m, x: m(x))(m, x), m

    y, new_model = outer(model, jnp.ones(2))
    assert isinstance(new_model.count.get_raw_value(), jax.Array)
    assert int(new_model.count[...]) == 1
    assert int(model.count[...]) == 0  # jax.jit is functional: the input is unchanged
    assert isinstance(model.count.get_raw_value(), jax.Array)
