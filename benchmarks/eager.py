"""Case 3: eager (un-jitted) transforms: ``vmap``, ``scan`` and ``grad`` called directly.

Peers: the plain JAX transform on a flat tuple of the same arrays (the floor),
``treemode.<transform>``, Flax's tree mode (``nnx.<transform>(graph=False)``)
and, for reference, Flax's graph mode.

What an eager call costs differs by transform. ``jax.lax.scan`` caches its trace
on the identity of the body function and the input types, and then reuses the
compiled loop: the floor's step is a module-level function, and
``treemode.scan`` hands JAX the same body for every call of one structure
(``treemode/_pipeline/_trace_cache.py``), so after the first call neither traces again.
``jax.vmap`` and ``jax.grad`` have no such cache: called eagerly they run the
function op by op under a batching or JVP trace on every call, the floor too.
The ``grad`` and ``vmap`` floors run fewer ops than the module peers
(``tanh(x @ kernel + bias)`` against ``nnx.Linear``'s dtype promotion and
reshapes), and op-by-op dispatch dominates these cases, so part of their ratio
is the model's own ops, not the transform's overhead.

- ``vmap``: a 2-layer MLP broadcast (``in_axes=(None, 0)``) over a batch;
- ``scan``: 4 stacked layers scanned over (``in_axes=(Carry, 0)``);
- ``grad``: the gradient of a loss with respect to a 2-layer MLP.

Run: ``python benchmarks/eager.py [--quick]``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from _common import Config, Table, case_main, measure, ratio_table
from _models import (
    BATCH,
    MLP,
    WIDTH,
    Block,
    loss_of,
    mlp_flat_forward,
    raw_arrays,
    scan_flat_forward,
    stacked_params,
)
from flax import nnx

import treemode

PEERS = ["floor", "treemode", "nnx (graph=False)", "nnx (graph)"]
SCAN_DEPTH = 4


def _stack(depth: int) -> Block:
    @nnx.split_rngs(splits=depth)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs):
        return Block(rngs)

    return create(nnx.Rngs(0))


def vmap_peers() -> dict[str, Callable[[], Any]]:
    x = jnp.ones((BATCH, WIDTH))
    arrays = raw_arrays(MLP(2, nnx.Rngs(0)))

    def f(m, x):
        return m(x)

    models = {p: MLP(2, nnx.Rngs(0)) for p in PEERS}
    tm = treemode.vmap(f, in_axes=(None, 0))
    tree = nnx.vmap(f, in_axes=(None, 0), graph=False)
    graph = nnx.vmap(f, in_axes=(None, 0), graph=True)
    return {
        "floor": lambda: jax.vmap(mlp_flat_forward, in_axes=(None, 0))(arrays, x),
        "treemode": lambda: tm(models["treemode"], x),
        "nnx (graph=False)": lambda: tree(models["nnx (graph=False)"], x),
        "nnx (graph)": lambda: graph(models["nnx (graph)"], x),
    }


def scan_peers() -> dict[str, Callable[[], Any]]:
    x = jnp.ones((BATCH, WIDTH))
    stack = _stack(SCAN_DEPTH)
    params = stacked_params(stack)

    def f(h, block):
        return block(h)

    stacks = {p: _stack(SCAN_DEPTH) for p in PEERS}
    tm = treemode.scan(f, in_axes=(treemode.Carry, 0), out_axes=treemode.Carry)
    tree = nnx.scan(f, in_axes=(nnx.Carry, 0), out_axes=nnx.Carry, graph=False)
    graph = nnx.scan(f, in_axes=(nnx.Carry, 0), out_axes=nnx.Carry, graph=True)
    return {
        "floor": lambda: scan_flat_forward(params, x),
        "treemode": lambda: tm(x, stacks["treemode"]),
        "nnx (graph=False)": lambda: tree(x, stacks["nnx (graph=False)"]),
        "nnx (graph)": lambda: graph(x, stacks["nnx (graph)"]),
    }


def grad_peers() -> dict[str, Callable[[], Any]]:
    x = jnp.ones((BATCH, WIDTH))
    arrays = raw_arrays(MLP(2, nnx.Rngs(0)))
    models = {p: MLP(2, nnx.Rngs(0)) for p in PEERS}
    flat_grad = jax.grad(lambda a, x: jnp.mean(mlp_flat_forward(a, x) ** 2))
    tm = treemode.grad(loss_of)
    tree = nnx.grad(loss_of, graph=False)
    graph = nnx.grad(loss_of, graph=True)
    return {
        "floor": lambda: flat_grad(arrays, x),
        "treemode": lambda: tm(models["treemode"], x),
        "nnx (graph=False)": lambda: tree(models["nnx (graph=False)"], x),
        "nnx (graph)": lambda: graph(models["nnx (graph)"], x),
    }


def run(config: Config) -> list[Table]:
    eager_config = dataclasses.replace(config, repeats=config.eager_repeats)
    rows = []
    for name, make in (("vmap", vmap_peers), ("scan", scan_peers), ("grad", grad_peers)):
        rows.append((f"{name} (eager)", measure(make(), eager_config, warmup=2)))
        print(f"  measured {rows[-1][0]}", flush=True)
    return ratio_table(
        "eager",
        "Eager transforms: microseconds per call",
        PEERS,
        "floor",
        rows,
        note="The floor is the plain JAX transform (`jax.vmap`, `jax.lax.scan`, `jax.grad`) "
        "on a flat tuple of the same arrays, also un-jitted. `jax.lax.scan` reuses its cached "
        "trace and compiled loop on every call after the first (the floor and treemode alike); "
        "eager `vmap` and `grad` run the function op by op on every call, plain JAX too, and "
        "their floors run fewer ops than `nnx.Linear`.",
    )


def main() -> None:
    case_main(__doc__, run)


if __name__ == "__main__":
    main()
