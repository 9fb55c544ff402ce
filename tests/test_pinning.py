"""Nothing pinned: after a call returns, the arrays alive are the model's own and
what the caller keeps, as after ``nnx.jit`` (docs/guides/jit.md, "What is cached").

Counted with ``jax.live_arrays()``: a cache, record or flattening that held a
Variable's value of an earlier call would show as the bytes of the written state.
"""

from __future__ import annotations

import gc

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import treemode


def _live_bytes() -> int:
    gc.collect()
    return sum(a.nbytes for a in jax.live_arrays())


class Decoder(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.ones((64, 64)))
        self.cache = nnx.Cache(jnp.full((256, 256), 7.0))  # 256 KiB, written every call


def decode(m: Decoder, x: jax.Array) -> jax.Array:
    m.cache[...] = m.cache[...] + x.sum()
    return (m.w[...] * x).sum()


def decode_each(m: Decoder, x: jax.Array) -> jax.Array:
    m.cache[...] = m.cache[...] + 1.0  # the same for every mapped x
    return (m.w[...] * x).sum()


def _scanned(m: Decoder, xs: jax.Array) -> jax.Array:
    def body(m, x):
        return m, decode(m, x)

    return treemode.scan(body)(m, xs)[1]


# Each transform's step, and the input it maps or scans over.
STEPS = {
    "jit": (lambda: treemode.jit(decode), (64, 64)),
    "jit_donated": (lambda: treemode.jit(decode, donate_argnums=0), (64, 64)),
    "vmap": (lambda: treemode.vmap(decode_each, in_axes=(None, 0)), (2, 64, 64)),
    "scan": (lambda: _scanned, (3, 64, 64)),
    "grad": (lambda: treemode.grad(decode), (64, 64)),
    "value_and_grad": (lambda: treemode.value_and_grad(decode), (64, 64)),
}


@pytest.mark.parametrize("transform", sorted(STEPS))
def test_no_value_of_an_earlier_call_stays_alive(implementation, transform):
    make, shape = STEPS[transform]
    model = Decoder()
    x = jnp.ones(shape)
    step = make()
    base = _live_bytes()  # the model, x and nothing else
    outputs = [step(model, x) for _ in range(4)]
    kept = sum(leaf.nbytes for leaf in jax.tree.leaves(outputs))
    extra = _live_bytes() - base - kept
    assert extra <= 0, f"{extra} bytes of earlier calls' values are alive"


def _train_live_bytes(wrap) -> int:
    """Live bytes after three undonated train steps (an MLP trained with adam)."""
    model = nnx.Sequential(
        nnx.Linear(64, 64, rngs=nnx.Rngs(0)), nnx.relu, nnx.Linear(64, 64, rngs=nnx.Rngs(1))
    )
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

    def train_step(model, optimizer, x):
        loss, grads = nnx.value_and_grad(lambda m: (m(x) ** 2).mean())(model)
        optimizer.update(model, grads)
        return loss

    step = wrap(train_step)
    x = jnp.ones((8, 64))
    base = _live_bytes()
    for _ in range(3):
        step(model, optimizer, x)
    return _live_bytes() - base


def test_an_undonated_train_step_holds_what_nnx_jit_holds(implementation):
    ours = _train_live_bytes(treemode.jit)
    flax = _train_live_bytes(nnx.jit)
    assert ours <= flax, (ours, flax)
