"""Cost of ``treemode.Pytree`` as a pytree, side by side with the floor and Equinox.

Model: a 64-layer MLP (width 8) as an NNX module wrapped in ``treemode.Pytree``,
its Equinox twin, and the raw arrays (a plain tuple, and a dict keyed by the same
paths). Measured:

1. ``jax.tree_util.tree_flatten`` and ``treedef.unflatten``, and
   ``tree_flatten_with_path``, of the proxy vs. the tuple/dict of its arrays and
   vs. the bare NNX module.
2. One ``eqx.filter_jit`` call (forward; and a call that returns the model, the
   Equinox convention for state) on an ``eqx.Module`` holding the proxy vs. the
   pure Equinox model, with ``jax.jit`` on the tuple of arrays as the floor.

Each number is the best over repeats of the mean time per call; the tables
print microseconds and ratios. Targets: the proxy flattens within 1.5x of the
plain tuple, and ``eqx.filter_jit`` on the mixed model costs no more than on the
pure Equinox model.

Run: ``python benchmarks/pytree_proxy.py [--quick]``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from _models import BATCH, MLP, WIDTH
from flax import nnx

import treemode

DEPTH = 64


class Mixed(eqx.Module):
    """An Equinox model whose body is an NNX module behind a proxy."""

    body: treemode.Pytree

    def __call__(self, x):
        return self.body(x)


class EqxMLP(eqx.Module):
    layers: list

    def __init__(self, depth: int, key):
        keys = jax.random.split(key, depth)
        self.layers = [eqx.nn.Linear(WIDTH, WIDTH, key=k) for k in keys]

    def __call__(self, x):
        for layer in self.layers:
            x = jnp.tanh(jax.vmap(layer)(x))
        return x


def per_call(fn: Callable[[], Any], number: int, repeat: int) -> float:
    """Best over ``repeat`` runs of the mean seconds per call of ``fn``.

    The best run is the least disturbed by other processes on a shared machine.
    """
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(number):
            out = fn()
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / number)
    return min(times)


def table(title: str, rows: list[tuple[str, float]], base: str) -> None:
    ref = dict(rows)[base]
    print(f"\n{title}")
    print(f"  {'':<40}{'µs':>10}{'ratio':>10}")
    for name, t in rows:
        print(f"  {name:<40}{t * 1e6:>10.2f}{t / ref:>9.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    args = parser.parse_args()
    number, repeat = (200, 5) if args.quick else (2000, 15)

    module = MLP(DEPTH, nnx.Rngs(0))
    proxy = treemode.Pytree(module)
    paths_leaves, _ = jax.tree_util.tree_flatten_with_path(proxy)
    arrays = tuple(leaf for _, leaf in paths_leaves)
    by_path = {jax.tree_util.keystr(p): leaf for p, leaf in paths_leaves}

    flatten = jax.tree_util.tree_flatten
    with_path = jax.tree_util.tree_flatten_with_path
    proxy_def = flatten(proxy)[1]
    tuple_def = flatten(arrays)[1]
    dict_def = flatten(by_path)[1]
    module_leaves, module_def = flatten(module)

    rows = [
        ("tuple of arrays (floor)", per_call(lambda: flatten(arrays), number, repeat)),
        ("dict keyed by the same paths", per_call(lambda: flatten(by_path), number, repeat)),
        ("treemode.Pytree", per_call(lambda: flatten(proxy), number, repeat)),
        ("bare NNX module", per_call(lambda: flatten(module), number, repeat)),
    ]
    table(f"tree_flatten, {DEPTH}-layer MLP ({len(arrays)} arrays)", rows, rows[0][0])
    flatten_ratio = rows[2][1] / rows[0][1]

    rows = [
        ("tuple of arrays (floor)", per_call(lambda: tuple_def.unflatten(arrays), number, repeat)),
        (
            "dict keyed by the same paths",
            per_call(lambda: dict_def.unflatten(arrays), number, repeat),
        ),
        ("treemode.Pytree", per_call(lambda: proxy_def.unflatten(arrays), number, repeat)),
        ("bare NNX module", per_call(lambda: module_def.unflatten(module_leaves), number, repeat)),
    ]
    table("treedef.unflatten", rows, rows[0][0])

    rows = [
        ("tuple of arrays (floor)", per_call(lambda: with_path(arrays), number, repeat)),
        ("dict keyed by the same paths", per_call(lambda: with_path(by_path), number, repeat)),
        ("treemode.Pytree", per_call(lambda: with_path(proxy), number, repeat)),
        ("bare NNX module", per_call(lambda: with_path(module), number, repeat)),
    ]
    table("tree_flatten_with_path", rows, rows[0][0])

    # -- eqx.filter_jit calls -----------------------------------------------------
    x = jnp.ones((BATCH, WIDTH))
    mixed = Mixed(proxy)
    pure = EqxMLP(DEPTH, jax.random.key(0))

    @jax.jit
    def floor_forward(arrays, x):
        for i in range(0, len(arrays), 2):
            x = jnp.tanh(x @ arrays[i + 1] + arrays[i])
        return x

    @jax.jit
    def floor_step(arrays, x):
        return floor_forward(arrays, x), arrays

    @eqx.filter_jit
    def forward(model, x):
        return model(x)

    @eqx.filter_jit
    def step(model, x):
        return model(x), model

    rows = [
        (
            "jax.jit, tuple of arrays (floor)",
            per_call(lambda: floor_forward(arrays, x), number, repeat),
        ),
        ("eqx.filter_jit, pure Equinox", per_call(lambda: forward(pure, x), number, repeat)),
        ("eqx.filter_jit, Equinox + Pytree", per_call(lambda: forward(mixed, x), number, repeat)),
    ]
    table("one call, forward", rows, rows[0][0])
    forward_ratio = rows[2][1] / rows[1][1]

    state = {"mixed": mixed, "pure": pure, "arrays": arrays}

    def run_mixed():
        out, state["mixed"] = step(state["mixed"], x)
        return out

    def run_pure():
        out, state["pure"] = step(state["pure"], x)
        return out

    def run_floor():
        out, state["arrays"] = floor_step(state["arrays"], x)
        return out

    rows = [
        ("jax.jit, tuple of arrays (floor)", per_call(run_floor, number, repeat)),
        ("eqx.filter_jit, pure Equinox", per_call(run_pure, number, repeat)),
        ("eqx.filter_jit, Equinox + Pytree", per_call(run_mixed, number, repeat)),
    ]
    table("one call returning the model", rows, rows[0][0])
    step_ratio = rows[2][1] / rows[1][1]

    print("\nTargets")
    print(f"  Pytree flatten / tuple flatten:             {flatten_ratio:.2f}x  (target <= 1.5x)")
    print(f"  filter_jit forward, mixed / pure Equinox:   {forward_ratio:.2f}x  (target <= 1.0x)")
    print(f"  filter_jit step, mixed / pure Equinox:      {step_ratio:.2f}x  (target <= 1.0x)")


if __name__ == "__main__":
    main()
