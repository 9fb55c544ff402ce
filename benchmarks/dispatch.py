"""Steady-state dispatch cost of a jitted call, every peer side by side.

For each model (2-layer MLP, 64-layer MLP, Linear+BatchNorm+Dropout with an
Rngs stream) and each task (forward, optax train step), the same computation is
run through:

- ``floor``: ``jax.jit`` on a flat tuple of the same arrays (hand-written);
- ``treemode.jit`` and ``treemode.jit_partial``;
- Flax ``nnx.jit`` in graph mode, ``nnx.jit(graph=False)``, ``nnx.jit_partial``;
- ``eqx.filter_jit`` on the Equinox twin of the model.

Shapes are tiny so the time is dispatch, not compute. Each number is the median
over repeats of the mean time per call (the last result is blocked on); the
table prints microseconds and the ratio to the floor. Absolute times on shared
machines are noisy; ratios measured in one process are what to compare.

Run: ``make bench`` (or ``python benchmarks/dispatch.py [--quick]``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from flax import nnx

import treemode

WIDTH = 8
BATCH = 4


# -- models -----------------------------------------------------------------------


class MLP(nnx.Module):
    def __init__(self, depth: int, rngs: nnx.Rngs):
        self.layers = nnx.List([nnx.Linear(WIDTH, WIDTH, rngs=rngs) for _ in range(depth)])

    def __call__(self, x):
        for layer in self.layers:
            x = jnp.tanh(layer(x))
        return x


class Stateful(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
        self.bn = nnx.BatchNorm(WIDTH, rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, x):
        return self.dropout(self.bn(self.linear(x)))


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
        self.bn = eqx.nn.BatchNorm(WIDTH, axis_name="batch")
        self.dropout = eqx.nn.Dropout(0.1)

    def __call__(self, x, state, key):
        x = jax.vmap(self.linear)(x)
        x, state = jax.vmap(self.bn, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(
            x, state
        )
        keys = jax.random.split(key, x.shape[0])
        return jax.vmap(self.dropout)(x, key=keys), state


# -- floor: jax.jit over a flat tuple of the same arrays ------------------------------


def mlp_flat_forward(arrays, x):
    for i in range(0, len(arrays), 2):
        bias, kernel = arrays[i], arrays[i + 1]
        x = jnp.tanh(x @ kernel + bias)
    return x


def stateful_flat_forward(arrays, x):
    # Flatten order of Stateful: bn.{bias,mean,scale,var}, dropout.rngs.{count,key},
    # linear.{bias,kernel}.
    (bn_bias, mean, scale, var, count, key, bias, kernel) = arrays
    x = x @ kernel + bias
    m, v = x.mean(0), x.var(0)
    y = (x - m) / jnp.sqrt(v + 1e-5) * scale + bn_bias
    new_mean = 0.99 * mean + 0.01 * m
    new_var = 0.99 * var + 0.01 * v
    mask = jax.random.bernoulli(jax.random.fold_in(key, count), 0.9, y.shape)
    y = jnp.where(mask, y / 0.9, 0.0)
    return y, (new_mean, new_var, count + 1)


# -- timing ----------------------------------------------------------------------------


def time_per_call(fn: Callable[[], Any], calls: int, repeats: int) -> float:
    for _ in range(20):
        out = fn()
    jax.block_until_ready(out)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn()
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(samples)


def loss_of(model, x):
    return jnp.mean(model(x) ** 2)


def make_cases(depth: int | None):
    """Per peer, a zero-argument callable running one forward/train step."""
    x = jnp.ones((BATCH, WIDTH))
    stateful = depth is None

    def nnx_model():
        return Stateful(nnx.Rngs(0)) if stateful else MLP(depth, nnx.Rngs(0))

    forward: dict[str, Callable[[], Any]] = {}
    train: dict[str, Callable[[], Any]] = {}

    # floor
    model = nnx_model()
    leaves = jax.tree.leaves(model, is_leaf=lambda v: isinstance(v, nnx.Variable))
    arrays = tuple(v.get_raw_value() for v in leaves)
    tx = optax.adam(1e-3)
    if stateful:
        flat_fwd = jax.jit(stateful_flat_forward)
        forward["floor"] = lambda: flat_fwd(arrays, x)
        param_idx = (0, 2, 6, 7)  # bn.bias, bn.scale, linear.bias, linear.kernel

        def flat_train(arrays, opt_state, x):
            def loss(params):
                full = list(arrays)
                for i, p in zip(param_idx, params, strict=True):
                    full[i] = p
                y, stats = stateful_flat_forward(tuple(full), x)
                return jnp.mean(y**2), stats

            params = tuple(arrays[i] for i in param_idx)
            (value, stats), grads = jax.value_and_grad(loss, has_aux=True)(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
            full = list(arrays)
            for i, p in zip(param_idx, params, strict=True):
                full[i] = p
            full[1], full[3], full[4] = stats
            return value, tuple(full), opt_state

        opt_state = tx.init(tuple(arrays[i] for i in param_idx))
    else:
        flat_fwd = jax.jit(mlp_flat_forward)
        forward["floor"] = lambda: flat_fwd(arrays, x)

        def flat_train(arrays, opt_state, x):
            value, grads = jax.value_and_grad(lambda a: jnp.mean(mlp_flat_forward(a, x) ** 2))(
                arrays
            )
            updates, opt_state = tx.update(grads, opt_state, arrays)
            return value, optax.apply_updates(arrays, updates), opt_state

        opt_state = tx.init(arrays)
    flat_train_jit = jax.jit(flat_train)
    state = {"arrays": arrays, "opt": opt_state}

    def floor_train():
        value, state["arrays"], state["opt"] = flat_train_jit(state["arrays"], state["opt"], x)
        return value

    train["floor"] = floor_train

    # treemode and Flax
    def fwd(m, x):
        return m(x)

    def step(m, opt, x):
        value, grads = treemode.value_and_grad(loss_of)(m, x)
        opt.update(m, grads)
        return value

    def nnx_step(m, opt, x):
        value, grads = nnx.value_and_grad(loss_of)(m, x)
        opt.update(m, grads)
        return value

    def nnx_tree_step(m, opt, x):
        value, grads = nnx.value_and_grad(loss_of, graph=False, allow_int=True)(m, x)
        opt.update(m, grads)
        return value

    peers = {
        "treemode.jit": (treemode.jit(fwd), treemode.jit(step), False),
        "treemode.jit_partial": (None, None, True),
        "nnx.jit (graph)": (nnx.jit(fwd, graph=True), nnx.jit(nnx_step, graph=True), False),
        "nnx.jit(graph=False)": (
            nnx.jit(fwd, graph=False),
            nnx.jit(nnx_tree_step, graph=False),
            False,
        ),
    }
    for name, (f_fwd, f_train, partial) in peers.items():
        m = nnx_model()
        opt = nnx.Optimizer(m, tx, wrt=nnx.Param)
        if partial:
            pf = treemode.jit_partial(fwd, m)
            pt = treemode.jit_partial(step, m, opt)
            forward[name] = lambda pf=pf: pf(x)
            train[name] = lambda pt=pt: pt(x)
        else:
            forward[name] = lambda f=f_fwd, m=m: f(m, x)
            train[name] = lambda f=f_train, m=m, opt=opt: f(m, opt, x)

    m = nnx_model()
    opt = nnx.Optimizer(m, tx, wrt=nnx.Param)
    nf = nnx.jit_partial(fwd, m, graph=False)
    nt = nnx.jit_partial(nnx_tree_step, m, opt, graph=False)
    forward["nnx.jit_partial"] = lambda: nf(x)
    train["nnx.jit_partial"] = lambda: nt(x)

    # Equinox twin
    key = jax.random.key(0)
    if stateful:
        emodel, estate = eqx.nn.make_with_state(EqxStateful)(key)
    else:
        emodel, estate = EqxMLP(depth, key), None
    eparams = eqx.filter(emodel, eqx.is_inexact_array)
    eopt = tx.init(eparams)
    eq = {"model": emodel, "state": estate, "opt": eopt, "key": key}

    @eqx.filter_jit
    def eqx_fwd(model, state, x, key):
        y, state = model(x, state, key)
        return y, state

    @eqx.filter_jit
    def eqx_train(model, state, opt_state, x, key):
        def loss(model):
            y, new_state = model(x, state, key)
            return jnp.mean(y**2), new_state

        (value, state), grads = eqx.filter_value_and_grad(loss, has_aux=True)(model)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
        return value, eqx.apply_updates(model, updates), state, opt_state

    def eqx_forward():
        y, eq["state"] = eqx_fwd(eq["model"], eq["state"], x, eq["key"])
        return y

    def eqx_train_step():
        value, eq["model"], eq["state"], eq["opt"] = eqx_train(
            eq["model"], eq["state"], eq["opt"], x, eq["key"]
        )
        return value

    forward["eqx.filter_jit"] = eqx_forward
    train["eqx.filter_jit"] = eqx_train_step
    return forward, train


PEERS = [
    "floor",
    "treemode.jit",
    "treemode.jit_partial",
    "nnx.jit (graph)",
    "nnx.jit(graph=False)",
    "nnx.jit_partial",
    "eqx.filter_jit",
]


def run(quick: bool) -> list[tuple[str, dict[str, float]]]:
    calls, repeats = (100, 5) if quick else (300, 9)
    rows = []
    for label, depth in [("2-layer MLP", 2), ("64-layer MLP", 64), ("stateful", None)]:
        forward, train = make_cases(depth)
        for task, cases in (("forward", forward), ("train step", train)):
            # Flax graph mode is ~50x slower on deep models: fewer calls keep runs short.
            times = {}
            for peer in PEERS:
                n = calls if "graph)" not in peer else max(20, calls // 5)
                times[peer] = time_per_call(cases[peer], n, repeats)
            rows.append((f"{label}, {task}", times))
            print(format_row(rows[-1]), flush=True)
    return rows


def format_row(row: tuple[str, dict[str, float]]) -> str:
    name, times = row
    floor = times["floor"]
    cells = [f"{times[p]:8.1f}us {times[p] / floor:5.2f}x" for p in PEERS]
    return f"{name:26s} " + " | ".join(cells)


def markdown(rows: list[tuple[str, dict[str, float]]]) -> str:
    head = "| case | " + " | ".join(PEERS) + " |\n|---|" + "---|" * len(PEERS) + "\n"
    body = ""
    for name, times in rows:
        floor = times["floor"]
        cells = [
            f"{times[p]:.0f} µs" if p == "floor" else f"{times[p] / floor:.2f}×" for p in PEERS
        ]
        body += f"| {name} | " + " | ".join(cells) + " |\n"
    return head + body


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer calls and repeats")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    print(f"{'case':26s} " + " | ".join(f"{p:>18s}" for p in PEERS))
    rows = run(args.quick)
    args.out.mkdir(exist_ok=True)
    table = markdown(rows)
    (args.out / "dispatch.md").write_text(table)
    print()
    print(table)


if __name__ == "__main__":
    main()
