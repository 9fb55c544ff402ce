"""Mixing Flax NNX and Equinox, in both directions.

1. An `eqx.Module` holding an NNX model (Linear + BatchNorm + Dropout) wrapped in
   `treemode.Pytree`, next to an Equinox `Linear` head, trained the Equinox way:
   `eqx.filter_jit`, `eqx.filter_value_and_grad`, optax AdamW. `treemode.filter`
   hands the optimizer the parameters only (never BatchNorm's running
   statistics or the Dropout stream), and the step returns the model it ran, so
   the statistics and the dropout counter advance.

2. An `nnx.Module` holding Equinox layers, trained the NNX way: `treemode.jit`,
   `treemode.value_and_grad` and `nnx.Optimizer`. The trainable Equinox layer's
   arrays are wrapped in `nnx.Param` so that the optimizer updates them in place;
   another Equinox layer keeps plain arrays and stays frozen (treemode reads
   plain arrays but never writes them); the activation function of the
   Equinox MLP is a static field.

    python examples/equinox_mix.py
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import treemode

STEPS = 40


def data() -> tuple[jax.Array, jax.Array]:
    x = jax.random.normal(jax.random.key(0), (64, 2))
    return x, jnp.sin(x[:, :1]) + x[:, 1:] ** 2


# -- 1. NNX inside Equinox --------------------------------------------------------------


class EqxModel(eqx.Module):
    body: treemode.Pytree
    head: eqx.nn.Linear

    def __init__(self) -> None:
        body = nnx.Sequential(
            nnx.Linear(2, 32, rngs=nnx.Rngs(0)),
            nnx.BatchNorm(32, rngs=nnx.Rngs(0)),
            nnx.Dropout(0.1, rngs=nnx.Rngs(1)),
        )
        self.body = treemode.Pytree(body)  # a pytree of raw arrays, state captured on call
        self.head = eqx.nn.Linear(32, 1, key=jax.random.key(2))

    def __call__(self, x: jax.Array) -> jax.Array:
        return jax.vmap(self.head)(jax.nn.gelu(self.body(x)))


def train_equinox_way() -> None:
    opt = optax.adamw(1e-2, weight_decay=1e-2)
    traces = []

    @eqx.filter_jit
    def step(model: EqxModel, opt_state: Any, x: jax.Array, y: jax.Array):
        traces.append(None)
        # True for NNX Params and for the Equinox head's float arrays.
        params, static = eqx.partition(model, treemode.filter(model, nnx.Param))

        def loss_fn(params):
            m = eqx.combine(params, static)
            return jnp.mean((m(x) - y) ** 2), m  # the model that ran: its new state

        (loss, model), grads = eqx.filter_value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return eqx.apply_updates(model, updates), opt_state, loss

    model = initial = EqxModel()
    opt_state = opt.init(eqx.filter(model, treemode.filter(model, nnx.Param)))
    x, y = data()
    losses = []
    for _ in range(STEPS):
        model, opt_state, loss = step(model, opt_state, x, y)
        losses.append(float(loss))

    norm, dropout = model.body.layers[1], model.body.layers[2]
    print(
        f"[eqx.filter_jit] loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
        f"dropout count {int(dropout.rngs.count[...])}, "
        f"BatchNorm mean[:3] {np.round(np.asarray(norm.mean[...][:3]), 3)}"
    )
    assert losses[-1] < losses[0] / 2, "the loss falls"
    assert int(dropout.rngs.count[...]) == STEPS, "a new dropout mask every step"
    assert np.abs(np.asarray(norm.mean[...])).sum() > 0, "running statistics advance"
    assert not np.allclose(model.head.weight, initial.head.weight), "the Equinox head trains"
    assert len(traces) == 1, "the proxy is a stable jit cache key: traced once"


# -- 2. Equinox inside NNX --------------------------------------------------------------


def trainable(layer: Any) -> Any:
    """The Equinox ``layer`` with each array wrapped in an ``nnx.Param``."""
    return jax.tree.map(lambda a: nnx.Param(a) if eqx.is_array(a) else a, layer)


class NnxModel(nnx.Module):
    def __init__(self) -> None:
        # Frozen: plain arrays are read, never written, by treemode transforms.
        self.features = nnx.data(eqx.nn.Linear(2, 4, key=jax.random.key(3)))
        # Trained: the same Equinox MLP class, its arrays as nnx.Param.
        self.mlp = nnx.data(
            trainable(eqx.nn.MLP(6, 16, 32, 1, activation=jax.nn.gelu, key=jax.random.key(4)))
        )
        self.norm = nnx.BatchNorm(16, rngs=nnx.Rngs(5))
        self.dropout = nnx.Dropout(0.1, rngs=nnx.Rngs(6))
        self.head = nnx.Linear(16, 1, rngs=nnx.Rngs(7))

    def __call__(self, x: jax.Array) -> jax.Array:
        h = jnp.concatenate([x, jax.vmap(self.features)(x)], axis=-1)
        h = self.dropout(self.norm(jax.vmap(self.mlp)(h)))
        return self.head(nnx.gelu(h))


@treemode.jit
def nnx_train_step(model: NnxModel, optimizer: nnx.Optimizer, x: jax.Array, y: jax.Array):
    def loss_fn(model: NnxModel) -> jax.Array:
        return jnp.mean((model(x) - y) ** 2)

    loss, grads = treemode.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)  # every nnx.Param, the Equinox MLP's included
    return loss


def train_nnx_way() -> None:
    model = NnxModel()
    frozen = np.asarray(model.features.weight)
    mlp_before = np.asarray(model.mlp.layers[0].weight[...])
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    x, y = data()
    losses = [float(nnx_train_step(model, optimizer, x, y)) for _ in range(STEPS)]

    print(
        f"[treemode.jit]   loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
        f"dropout count {int(model.dropout.rngs.count[...])}, "
        f"optimizer steps {int(optimizer.step[...])}"
    )
    assert losses[-1] < losses[0] / 2, "the loss falls"
    assert int(optimizer.step[...]) == STEPS, "the optimizer state is written back"
    assert int(model.dropout.rngs.count[...]) == STEPS, "the dropout stream advances"
    assert np.abs(np.asarray(model.norm.mean[...])).sum() > 0, "running statistics advance"
    assert not np.allclose(model.mlp.layers[0].weight[...], mlp_before), "the Equinox MLP trains"
    np.testing.assert_array_equal(model.features.weight, frozen)  # the frozen layer does not
    assert model.mlp.activation is jax.nn.gelu, "static Equinox fields are kept"


def main() -> None:
    train_equinox_way()
    train_nnx_way()


if __name__ == "__main__":
    main()
