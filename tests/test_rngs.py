"""treemode.split_rngs / treemode.fork_rngs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import treemode


def key_data(stream):
    return np.asarray(jax.random.key_data(stream.key[...]))


def test_split_returns_copy_and_advances_input_like_eager():
    rngs, eager = nnx.Rngs(params=0, dropout=1), nnx.Rngs(params=0, dropout=1)
    batch = treemode.split_rngs(rngs, splits=5)
    eager_params = eager.params.split(5)
    eager_dropout = eager.dropout.split(5)

    assert batch is not rngs and batch.params is not rngs.params
    assert batch.params.key.shape == (5,) and batch.params.count.shape == (5,)
    np.testing.assert_array_equal(key_data(batch.params), key_data(eager_params))
    np.testing.assert_array_equal(key_data(batch.dropout), key_data(eager_dropout))
    assert (batch.params.count[...] == 0).all()
    # Inputs advanced exactly once, like the eager split.
    assert int(rngs.params.count[...]) == int(eager.params.count[...]) == 1
    assert int(rngs.dropout.count[...]) == int(eager.dropout.count[...]) == 1
    np.testing.assert_array_equal(
        jax.random.key_data(rngs.params()), jax.random.key_data(eager.params())
    )


def test_split_only_filter_and_shape():
    rngs = nnx.Rngs(params=0, dropout=1)
    batch = treemode.split_rngs(rngs, splits=(2, 3), only="params")
    assert batch.params.key.shape == (2, 3) and batch.params.count.shape == (2, 3)
    assert batch.dropout.key.shape == ()
    # The unselected stream is the input's own stream: using it advances the input.
    assert batch.dropout.count is rngs.dropout.count
    assert int(rngs.dropout.count[...]) == 0
    assert int(rngs.params.count[...]) == 1


def test_split_squeeze():
    rngs, eager = nnx.Rngs(0), nnx.Rngs(0)
    fresh = treemode.split_rngs(rngs, splits=1, squeeze=True)
    assert fresh.default.key.shape == ()
    expected = jax.random.split(eager.default(), 1)[0]
    np.testing.assert_array_equal(
        jax.random.key_data(fresh.default.key[...]), jax.random.key_data(expected)
    )
    with pytest.raises(ValueError, match="squeeze=True needs splits=1"):
        treemode.split_rngs(rngs, splits=2, squeeze=True)


def test_split_inside_a_module():
    class Model(nnx.Module):
        def __init__(self):
            self.rngs = nnx.Rngs(dropout=3)
            self.w = nnx.Param(jnp.ones(2))

    model = Model()
    split = treemode.split_rngs(model, splits=4)
    assert split.rngs.dropout.key.shape == (4,)
    assert split.w is model.w  # non-rng Variables are shared, not copied
    assert int(model.rngs.dropout.count[...]) == 1


def test_create_stack_with_only_params_and_prefix_axes():
    class Block(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(2, 2, rngs=rngs)
            self.dropout = nnx.Dropout(0.5, rngs=rngs)

    rngs = nnx.Rngs(params=0, dropout=1)
    batch = treemode.split_rngs(rngs, splits=3, only="params")
    in_axes = treemode.prefix(batch, {"params": 0, ...: None})
    template = treemode.eval_shape(lambda: Block(nnx.Rngs(params=0, dropout=1)))
    out_axes = treemode.prefix(template, {nnx.Param: 0, ...: None})

    @treemode.vmap(in_axes=(in_axes,), out_axes=out_axes)
    def create(r):
        return Block(r)

    blocks = create(batch)
    assert blocks.linear.kernel.shape == (3, 2, 2)
    assert blocks.dropout.rngs.key.shape == ()
    # The broadcast dropout stream was forked once by the Dropout constructor
    # and that advance reached the caller's stream.
    assert int(rngs.dropout.count[...]) == 1


def test_split_alias_and_graph_mode():
    rngs = nnx.Rngs(0)
    pair = {"a": rngs, "b": rngs}
    with pytest.raises(treemode.AliasError, match=r"node\['a'\].*node\['b'\]"):
        treemode.split_rngs(pair, splits=2)
    assert int(rngs.default.count[...]) == 0
    split = treemode.split_rngs(pair, splits=2, graph=True)
    assert split["a"] is split["b"]
    assert split["a"].default.key.shape == (2,)
    assert int(rngs.default.count[...]) == 1  # split once


def test_split_inside_trace_of_outer_stream_names_path():
    rngs = nnx.Rngs(0)

    @jax.jit
    def f(x):
        treemode.split_rngs(rngs, splits=2)
        return x

    with pytest.raises(treemode.TraceContextError, match=r"node\.default"):
        f(jnp.ones(1))
    assert int(rngs.default.count[...]) == 0


def test_split_as_decorator():
    @treemode.split_rngs(splits=4)
    @treemode.vmap
    def create(r):
        return nnx.Linear(2, 2, rngs=r)

    rngs = nnx.Rngs(0)
    assert create(rngs).kernel.shape == (4, 2, 2)
    assert int(rngs.default.count[...]) == 1


def test_fork_default_and_mapping():
    rngs, eager = nnx.Rngs(params=0, dropout=1), nnx.Rngs(params=0, dropout=1)
    forked = treemode.fork_rngs(rngs)
    np.testing.assert_array_equal(key_data(forked.params), key_data(eager.params.fork()))
    assert int(forked.params.count[...]) == 0
    assert int(rngs.params.count[...]) == 1 and int(rngs.dropout.count[...]) == 1

    rngs = nnx.Rngs(params=0, dropout=1)
    forked = treemode.fork_rngs(rngs, split={"dropout": 4, ...: None})
    assert forked.dropout.key.shape == (4,) and forked.dropout.count.shape == (4,)
    assert forked.params.key.shape == ()

    rngs = nnx.Rngs(params=0, dropout=1)
    forked = treemode.fork_rngs(rngs, split={"dropout": 2})
    assert forked.params.count is rngs.params.count  # unmatched: left as is
    assert int(rngs.params.count[...]) == 0 and int(rngs.dropout.count[...]) == 1


def test_fork_int_split_and_decorator():
    rngs = nnx.Rngs(0)
    assert treemode.fork_rngs(rngs, split=3).default.key.shape == (3,)

    @treemode.fork_rngs()
    def draw(r):
        return r.default.key[...]

    rngs = nnx.Rngs(0)
    draw(rngs)
    assert int(rngs.default.count[...]) == 1
