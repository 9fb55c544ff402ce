"""Mapping errors that involve an ``nnx.Rngs`` say how to split it; broadcast draws warn."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import treemode


class Noisy(nnx.Module):
    def __init__(self):
        self.rngs = nnx.Rngs(dropout=0)
        self.w = nnx.Param(jnp.ones(3))


def noise(m, x):
    return x + jax.random.normal(m.rngs.dropout(), ())


def test_mapping_an_unsplit_rngs_names_split_rngs_and_the_path():
    m = Noisy()
    with pytest.raises(treemode.AxisError) as info:
        treemode.vmap(noise, in_axes=(0, 0))(m, jnp.ones(3))
    message = str(info.value)
    assert message.startswith("treemode.vmap: in_axes maps args[0].rngs.dropout.")
    assert "args[0].rngs.dropout is a stream of an nnx.Rngs" in message
    assert "treemode.split_rngs(rngs, splits=n)" in message
    assert "treemode.fork_rngs" in message
    assert int(m.rngs.dropout.count[...]) == 0  # inputs untouched


def test_rngs_split_to_the_wrong_size_names_split_rngs():
    rngs = treemode.split_rngs(nnx.Rngs(0), splits=4)
    with pytest.raises(treemode.AxisError) as info:
        treemode.vmap(lambda r, x: x + jax.random.normal(r(), ()))(rngs, jnp.ones(3))
    message = str(info.value)
    assert "mapped axes have different sizes" in message
    assert "args[0].default is a stream of an nnx.Rngs" in message
    assert "split_rngs" in message


def test_other_mapping_errors_do_not_mention_rngs():
    with pytest.raises(treemode.AxisError) as info:
        treemode.vmap(lambda x: x)(jnp.ones(()))
    assert "Rngs" not in str(info.value)


def test_drawing_from_a_broadcast_rngs_warns_once_with_the_path():
    m = Noisy()
    f = treemode.vmap(noise, in_axes=(None, 0))
    with pytest.warns(treemode.BroadcastRngsWarning) as record:
        out = f(m, jnp.zeros(3))
    assert len(record) == 1
    message = str(record[0].message)
    assert message.startswith("treemode.vmap: the nnx.Rngs stream(s) args[0].rngs.dropout")
    assert "same random numbers" in message and "split_rngs" in message
    assert record[0].filename == __file__  # points at the call
    assert float(out[0]) == float(out[1]) == float(out[2])  # what the warning says
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        f(m, jnp.zeros(3))  # the same trace: no second warning


def test_split_or_unused_broadcast_rngs_do_not_warn():
    m = Noisy()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        treemode.vmap(lambda m, x: x * m.w[...], in_axes=(None, 0))(m, jnp.ones((2, 3)))
        rngs = treemode.split_rngs(nnx.Rngs(0), splits=3)
        out = treemode.vmap(lambda r, x: x + jax.random.normal(r(), ()))(rngs, jnp.zeros(3))
    assert len(set(out.tolist())) == 3


def test_a_stream_broadcast_through_a_module_shaped_prefix_is_deliberate():
    class Block(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(2, 2, rngs=rngs)
            self.dropout = nnx.Dropout(0.5, rngs=rngs)

    rngs = nnx.Rngs(params=0, dropout=1)
    batch = treemode.split_rngs(rngs, splits=3, only="params")
    in_axes = treemode.prefix(batch, {"params": 0, ...: None})
    template = treemode.eval_shape(lambda: Block(nnx.Rngs(params=0, dropout=1)))
    out_axes = treemode.prefix(template, {nnx.Param: 0, ...: None})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        blocks = treemode.vmap(Block, in_axes=(in_axes,), out_axes=out_axes)(batch)
    assert blocks.linear.kernel.shape == (3, 2, 2)


def test_drawing_from_a_closed_over_rngs_warns():
    rngs = nnx.Rngs(0)
    with pytest.warns(treemode.BroadcastRngsWarning, match=r"closure rngs\.default"):
        treemode.vmap(lambda x: x + jax.random.normal(rngs(), ()))(jnp.zeros(3))
