"""The models every case uses, their Equinox twins and hand-written JAX versions.

Shapes are tiny (width 8, batch 4) so that a call costs dispatch, not compute.
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from flax import nnx

import treemode

WIDTH = 8
BATCH = 4


def is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def raw_arrays(model: nnx.Module) -> tuple[jax.Array, ...]:
    """The model's Variable values in flatten order: what the floor passes to ``jax.jit``."""
    return tuple(v.get_raw_value() for v in jax.tree.leaves(model, is_leaf=is_variable))


def n_variables(model: nnx.Module) -> int:
    return len(jax.tree.leaves(model, is_leaf=is_variable))


def loss_of(model: Any, x: jax.Array) -> jax.Array:
    return jnp.mean(model(x) ** 2)


_TX = optax.adam(1e-3)


def tx() -> optax.GradientTransformation:
    """The optimizer, one object: ``nnx.Optimizer`` keeps it as static data, so a
    fresh ``optax.adam`` (new closures, unequal) would change the structure."""
    return _TX


def with_optimizer(model: nnx.Module) -> tuple[nnx.Module, nnx.Optimizer]:
    """``(model, its Adam optimizer over the Params)``: the train step's arguments."""
    return model, nnx.Optimizer(model, tx(), wrt=nnx.Param)


def train_step(m: nnx.Module, opt: nnx.Optimizer, x: jax.Array) -> jax.Array:
    """treemode's train step, to be jitted: the loss's gradient and an optimizer update."""
    value, grads = treemode.value_and_grad(loss_of)(m, x)
    opt.update(m, grads)
    return value


# -- NNX models ----------------------------------------------------------------------


class MLP(nnx.Module):
    def __init__(self, depth: int, rngs: nnx.Rngs):
        self.layers = nnx.List([nnx.Linear(WIDTH, WIDTH, rngs=rngs) for _ in range(depth)])

    def __call__(self, x):
        for layer in self.layers:
            x = jnp.tanh(layer(x))
        return x


class Stateful(nnx.Module):
    """Linear + BatchNorm (running statistics) + Dropout (an Rngs stream)."""

    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
        self.bn = nnx.BatchNorm(WIDTH, rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, x):
        return self.dropout(self.bn(self.linear(x)))


# Flatten order of Stateful, checked by ``stateful_paths_ok``.
STATEFUL_PATHS = [
    ".bn.bias",
    ".bn.mean",
    ".bn.scale",
    ".bn.var",
    ".dropout.rngs.count",
    ".dropout.rngs.key",
    ".linear.bias",
    ".linear.kernel",
]
STATEFUL_PARAMS = (0, 2, 6, 7)  # bn.bias, bn.scale, linear.bias, linear.kernel


def stateful_paths_ok(model: Stateful) -> bool:
    leaves = jax.tree_util.tree_flatten_with_path(model, is_leaf=is_variable)[0]
    return [jax.tree_util.keystr(p) for p, _ in leaves] == STATEFUL_PATHS


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

    def __call__(self, x):
        return jnp.tanh(self.linear(x))


class ScanMLP(nnx.Module):
    """``depth`` Blocks stacked on a leading axis, applied with ``treemode.scan``."""

    def __init__(self, depth: int, rngs: nnx.Rngs):
        @treemode.split_rngs(splits=depth)
        @treemode.vmap(in_axes=(0,), out_axes=0)
        def create(rngs):
            return Block(rngs)

        self.blocks = create(rngs)

    def __call__(self, x):
        @treemode.scan(in_axes=(treemode.Carry, 0), out_axes=treemode.Carry)
        def forward(h, block):
            return block(h)

        return forward(x, self.blocks)


# -- hand-written JAX on flat arrays --------------------------------------------------


def stacked_params(stack: Block) -> tuple[jax.Array, jax.Array]:
    """``(bias, kernel)`` of stacked Blocks (``ScanMLP.blocks``): ``scan_flat_forward``'s params."""
    return stack.linear.bias[...], stack.linear.kernel[...]


def mlp_flat_forward(arrays, x):
    for i in range(0, len(arrays), 2):
        bias, kernel = arrays[i], arrays[i + 1]
        x = jnp.tanh(x @ kernel + bias)
    return x


def _scan_step(h, p):
    bias, kernel = p
    return jnp.tanh(h @ kernel + bias), None


def scan_flat_forward(params, x):
    """``params = (bias, kernel)`` stacked on a leading axis; ``jax.lax.scan`` over it.

    The step is a module-level function, so eager calls reuse JAX's trace and
    compile caches (a new closure per call would recompile every time).
    """
    return jax.lax.scan(_scan_step, x, params)[0]


def stateful_flat_forward(arrays, x):
    (bn_bias, mean, scale, var, count, key, bias, kernel) = arrays
    x = x @ kernel + bias
    m, v = x.mean(0), x.var(0)
    y = (x - m) / jnp.sqrt(v + 1e-5) * scale + bn_bias
    new_mean = 0.99 * mean + 0.01 * m
    new_var = 0.99 * var + 0.01 * v
    mask = jax.random.bernoulli(jax.random.fold_in(key, count), 0.9, y.shape)
    y = jnp.where(mask, y / 0.9, 0.0)
    return y, (new_mean, new_var, count + 1)


def flat_train_step(forward, params_idx=None):
    """A hand-written optax (Adam) train step over a flat tuple of arrays.

    ``forward(arrays, x)`` returns ``y``, or ``(y, (new_mean, new_var, new_count))``
    for the stateful model (its statistics go back to positions 1, 3, 4).
    ``opt_state`` is ``(optax state, step)``: the step counter is the one
    ``nnx.Optimizer`` keeps, so both sides compute exactly the same thing.
    Returns ``(step, init)`` with ``step(arrays, opt_state, x) -> (loss, arrays,
    opt_state)``.
    """
    opt = tx()

    def indices(arrays):
        return range(len(arrays)) if params_idx is None else params_idx

    def step(arrays, opt_state, x):
        idx = indices(arrays)

        def merged(params):
            full = list(arrays)
            for i, p in zip(idx, params, strict=True):
                full[i] = p
            return full

        def loss(params):
            out = forward(tuple(merged(params)), x)
            y, stats = out if params_idx is not None else (out, ())
            return jnp.mean(y**2), stats

        params = tuple(arrays[i] for i in idx)
        (value, stats), grads = jax.value_and_grad(loss, has_aux=True)(params)
        state, count = opt_state
        updates, state = opt.update(grads, state, params)
        full = merged(optax.apply_updates(params, updates))
        if stats:
            full[1], full[3], full[4] = stats
        return value, tuple(full), (state, count + 1)

    def init(arrays):
        params = tuple(arrays[i] for i in indices(arrays))
        return opt.init(params), jnp.zeros((), jnp.uint32)

    return step, init


# -- Equinox twins -------------------------------------------------------------------


class EqxMLP(eqx.Module):
    layers: list

    def __init__(self, depth: int, key):
        keys = jax.random.split(key, depth)
        self.layers = [eqx.nn.Linear(WIDTH, WIDTH, key=k) for k in keys]

    def __call__(self, x, state=None, key=None):
        for layer in self.layers:
            x = jnp.tanh(jax.vmap(layer)(x))
        return x, state


class EqxStateful(eqx.Module):
    linear: eqx.nn.Linear
    bn: eqx.nn.BatchNorm
    dropout: eqx.nn.Dropout

    def __init__(self, key):
        self.linear = eqx.nn.Linear(WIDTH, WIDTH, key=key)
        self.bn = eqx.nn.BatchNorm(WIDTH, axis_name="batch", mode="ema")
        self.dropout = eqx.nn.Dropout(0.1)

    def __call__(self, x, state, key):
        x = jax.vmap(self.linear)(x)
        x, state = jax.vmap(self.bn, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(
            x, state
        )
        keys = jax.random.split(key, x.shape[0])
        return jax.vmap(self.dropout)(x, key=keys), state
