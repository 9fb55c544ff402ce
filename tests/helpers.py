"""Small models shared by the tests."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


class MLP(nnx.Module):
    def __init__(self, n_layers: int, width: int, rngs: nnx.Rngs):
        self.layers = nnx.List([nnx.Linear(width, width, rngs=rngs) for _ in range(n_layers)])

    def __call__(self, x):
        for layer in self.layers:
            x = nnx.relu(layer(x))
        return x


class Stateful(nnx.Module):
    """Linear -> BatchNorm -> Dropout, with an Rngs stream for the dropout."""

    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(3, 4, rngs=rngs)
        self.bn = nnx.BatchNorm(4, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.dropout(self.bn(self.linear(x)))


class Counter(nnx.Module):
    def __init__(self):
        self.count = nnx.BatchStat(jnp.array(0, jnp.int32))
        self.total = nnx.Variable(jnp.zeros(()))

    def __call__(self, x):
        self.count[...] += 1
        self.total[...] += jnp.sum(x)
        return x + 1


def state_arrays(node) -> list[np.ndarray]:
    """The values of every Variable in ``node``, as numpy arrays (for comparisons)."""
    leaves = jax.tree_util.tree_leaves(node, is_leaf=lambda x: isinstance(x, nnx.Variable))
    out = []
    for leaf in leaves:
        if isinstance(leaf, nnx.Variable):
            value = leaf.get_raw_value()
            if jnp.issubdtype(getattr(value, "dtype", jnp.float32), jax.dtypes.prng_key):
                value = jax.random.key_data(value)
            out.append(np.asarray(value))
    return out


def assert_same_state(a, b) -> None:
    xs, ys = state_arrays(a), state_arrays(b)
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys, strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-6)


def variable_buffers(node) -> list:
    """The raw value objects of every Variable (identity comparisons)."""
    return [
        leaf.get_raw_value()
        for leaf in jax.tree_util.tree_leaves(node, is_leaf=lambda x: isinstance(x, nnx.Variable))
        if isinstance(leaf, nnx.Variable)
    ]
