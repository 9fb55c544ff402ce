"""Case 1: steady-state cost of a jitted call, every peer side by side.

For each model (2-layer MLP, 64-layer MLP, Linear+BatchNorm+Dropout with an
Rngs stream) and each task (forward, optax train step), the same computation is
run through:

- ``floor``: ``jax.jit`` on a flat tuple of the same arrays (hand-written);
- ``treemode.jit`` and ``treemode.jit_partial``;
- Flax ``nnx.jit`` in graph mode, ``nnx.jit(graph=False)``,
  ``nnx.jit_partial(graph=False)``;
- ``eqx.filter_jit`` on the Equinox twin of the model.

Shapes are tiny so the time is dispatch, not compute. Peers are timed
interleaved in one process, each built ``config.instances`` times over with
the samples pooled (see ``_common.measure_instances``); the tables give the
floor in microseconds and every peer as a ratio to it, from the best sample
and from the median sample.

Two more columns give ``treemode.jit`` and ``treemode.jit_partial`` without
the compiled extension (``TREEMODE_NO_EXTENSION=1``, the pure-Python call
path): they are measured in a subprocess with that variable set, against that
process's own floor, since the extension is chosen once, at import. Their
ratios are to that floor; their microseconds are stored scaled to this
process's floor, so every ratio in the table reads the same way.

Also here: the asynchronous-dispatch check (a call returns before its result
is computed), for a computation heavy enough that XLA's CPU client runs it
asynchronously.

Run: ``make bench`` (whole suite) or ``python benchmarks/dispatch.py [--quick]``.
"""

from __future__ import annotations

import functools
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from _common import (
    CONFIGS,
    Config,
    Table,
    case_main,
    measure_instances,
    ratio_table,
    scaled_to_floor,
    without_extension,
)
from _models import (
    BATCH,
    MLP,
    STATEFUL_PARAMS,
    WIDTH,
    EqxMLP,
    EqxStateful,
    Stateful,
    flat_train_step,
    loss_of,
    mlp_flat_forward,
    raw_arrays,
    stateful_flat_forward,
    stateful_paths_ok,
    train_step,
    tx,
    with_optimizer,
)
from flax import nnx

import treemode
from treemode._accel import _compiled

PEERS = [
    "floor",
    "treemode.jit",
    "treemode.jit_partial",
    "nnx.jit (graph)",
    "nnx.jit(graph=False)",
    "nnx.jit_partial",
    "eqx.filter_jit",
]
# The same two treemode peers without the compiled extension (see the docstring).
PYTHON_PEERS = {"treemode.jit": "treemode.jit (no C)", "treemode.jit_partial": "jit_partial (no C)"}
MODELS: dict[str, int | None] = {"2-layer MLP": 2, "64-layer MLP": 64, "stateful": None}

Peers = dict[str, Callable[[], Any]]


def _nnx_model(depth: int | None) -> nnx.Module:
    if depth is None:
        model = Stateful(nnx.Rngs(0))
        assert stateful_paths_ok(model), "Stateful's flatten order changed: update _models"
        return model
    return MLP(depth, nnx.Rngs(0))


def _eqx_model(depth: int | None):
    key = jax.random.key(0)
    if depth is None:
        return eqx.nn.make_with_state(EqxStateful)(key)
    return EqxMLP(depth, key), None


def _fwd(m, x):
    return m(x)


def forward_peers(depth: int | None) -> Peers:
    """One zero-argument callable per peer, running one forward pass."""
    x = jnp.ones((BATCH, WIDTH))
    peers: Peers = {}

    arrays = raw_arrays(_nnx_model(depth))
    flat = jax.jit(stateful_flat_forward if depth is None else mlp_flat_forward)
    peers["floor"] = lambda: flat(arrays, x)

    jitted = {
        "treemode.jit": treemode.jit(_fwd),
        "nnx.jit (graph)": nnx.jit(_fwd, graph=True),
        "nnx.jit(graph=False)": nnx.jit(_fwd, graph=False),
    }
    for name, f in jitted.items():
        m = _nnx_model(depth)
        peers[name] = lambda f=f, m=m: f(m, x)
    tm_partial = treemode.jit_partial(_fwd, _nnx_model(depth))
    peers["treemode.jit_partial"] = lambda: tm_partial(x)
    nnx_partial = nnx.jit_partial(_fwd, _nnx_model(depth), graph=False)
    peers["nnx.jit_partial"] = lambda: nnx_partial(x)

    emodel, estate = _eqx_model(depth)
    eq = {"state": estate}
    key = jax.random.key(1)

    @eqx.filter_jit
    def eqx_fwd(model, state, x, key):
        return model(x, state, key)

    def eqx_forward():
        y, eq["state"] = eqx_fwd(emodel, eq["state"], x, key)
        return y

    peers["eqx.filter_jit"] = eqx_forward
    return {name: peers[name] for name in PEERS}


def train_peers(depth: int | None) -> Peers:
    """One zero-argument callable per peer, running one optax (Adam) train step."""
    x = jnp.ones((BATCH, WIDTH))
    peers: Peers = {}

    if depth is None:
        flat_step, flat_init = flat_train_step(stateful_flat_forward, STATEFUL_PARAMS)
    else:
        flat_step, flat_init = flat_train_step(mlp_flat_forward)
    flat_jit = jax.jit(flat_step)
    arrays = raw_arrays(_nnx_model(depth))
    floor_state = {"arrays": arrays, "opt": flat_init(arrays)}

    def floor():
        value, floor_state["arrays"], floor_state["opt"] = flat_jit(
            floor_state["arrays"], floor_state["opt"], x
        )
        return value

    peers["floor"] = floor

    def nnx_step(m, opt, x):
        value, grads = nnx.value_and_grad(loss_of)(m, x)
        opt.update(m, grads)
        return value

    def nnx_tree_step(m, opt, x):
        value, grads = nnx.value_and_grad(loss_of, graph=False, allow_int=True)(m, x)
        opt.update(m, grads)
        return value

    jitted = {
        "treemode.jit": treemode.jit(train_step),
        "nnx.jit (graph)": nnx.jit(nnx_step, graph=True),
        "nnx.jit(graph=False)": nnx.jit(nnx_tree_step, graph=False),
    }
    for name, f in jitted.items():
        m, opt = with_optimizer(_nnx_model(depth))
        peers[name] = lambda f=f, m=m, opt=opt: f(m, opt, x)
    tm_partial = treemode.jit_partial(train_step, *with_optimizer(_nnx_model(depth)))
    peers["treemode.jit_partial"] = lambda: tm_partial(x)
    nnx_partial = nnx.jit_partial(nnx_tree_step, *with_optimizer(_nnx_model(depth)), graph=False)
    peers["nnx.jit_partial"] = lambda: nnx_partial(x)

    emodel, estate = _eqx_model(depth)
    opt = tx()
    eq = {
        "model": emodel,
        "state": estate,
        "opt": opt.init(eqx.filter(emodel, eqx.is_inexact_array)),
    }
    key = jax.random.key(1)

    @eqx.filter_jit
    def eqx_train(model, state, opt_state, x, key):
        def loss(model):
            y, new_state = model(x, state, key)
            return jnp.mean(y**2), new_state

        (value, state), grads = eqx.filter_value_and_grad(loss, has_aux=True)(model)
        updates, opt_state = opt.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
        return value, eqx.apply_updates(model, updates), state, opt_state

    def eqx_step():
        value, eq["model"], eq["state"], eq["opt"] = eqx_train(
            eq["model"], eq["state"], eq["opt"], x, key
        )
        return value

    peers["eqx.filter_jit"] = eqx_step
    return {name: peers[name] for name in PEERS}


def _subset(make: Callable[[], Peers], names: list[str]) -> Peers:
    peers = make()
    return {name: peers[name] for name in names}


def measure_cases(config: Config, names: list[str] | None = None) -> list[tuple[str, Any]]:
    """``(case, timings)`` per dispatch case, for every peer or only ``names``."""
    rows = []
    for label in config.dispatch_models:
        depth = MODELS[label]
        for task, make in (("forward", forward_peers), ("train step", train_peers)):
            build = functools.partial(make, depth)
            if names is not None:
                build = functools.partial(_subset, build, names)
            timings = measure_instances(build, config)
            rows.append((f"{label}, {task}", timings))
            print(f"  measured {rows[-1][0]}", flush=True)
    return rows


def python_path_timings(config: Config) -> dict[str, dict[str, list[float]]]:
    """Per case, ``{peer: [best, median]}`` of the floor and the treemode peers, measured
    in a subprocess without the compiled extension."""
    return without_extension(__file__, config)


def _python_path_main(config_name: str, out: str) -> None:
    assert not _compiled.ENABLED, f"run with {_compiled.ENV_VAR}=1"
    names = ["floor", *PYTHON_PEERS]
    rows = measure_cases(CONFIGS[config_name], names)
    data = {case: {p: [t[p].best, t[p].median] for p in names} for case, t in rows}
    Path(out).write_text(json.dumps(data))


def run(config: Config) -> list[Table]:
    rows = measure_cases(config)
    peers = list(PEERS)
    if _compiled.ENABLED:  # the pure-Python columns, side by side
        print("  measuring the pure-Python path (TREEMODE_NO_EXTENSION=1)", flush=True)
        python = python_path_timings(config)
        for case, timings in rows:
            floor, other = timings["floor"], python[case]
            for peer, column in PYTHON_PEERS.items():
                timings[column] = scaled_to_floor(floor, other, peer)
        peers += list(PYTHON_PEERS.values())
    note = "Lower is better; 1.00× is the hand-written `jax.jit` on a flat tuple."
    if _compiled.ENABLED:
        note += (
            " The (no C) columns run without the compiled extension, in a subprocess "
            "with TREEMODE_NO_EXTENSION=1, as ratios to that process's floor."
        )
    else:
        note += " This run had no compiled extension: treemode ran its pure-Python path."
    return ratio_table("dispatch", "Dispatch: microseconds per call", peers, "floor", rows, note)


# -- asynchronous dispatch --------------------------------------------------------------


class Heavy(nnx.Module):
    def __init__(self, n: int):
        self.w = nnx.Param(jnp.eye(n) * 0.5)
        self.calls = nnx.BatchStat(jnp.array(0))


def _heavy(w, x):
    return jax.lax.fori_loop(0, 8, lambda _, h: jnp.tanh(h @ w), x)


def async_dispatch(config: Config, n: int = 384) -> Table:
    """Time for a call to return vs. time until its result is ready."""
    model = Heavy(n)
    x = jnp.ones((n, n))

    def fwd(m, x):
        return _heavy(m.w[...], x)

    def counting(m, x):
        m.calls[...] += 1
        return _heavy(m.w[...], x)

    w = model.w[...]
    floor = jax.jit(_heavy)
    eqx_fn = eqx.filter_jit(lambda w, x: _heavy(w, x))
    tm_fwd, tm_counting = treemode.jit(fwd), treemode.jit(counting)
    tm_partial = treemode.jit_partial(fwd, model)
    nnx_tree = nnx.jit(fwd, graph=False)
    peers: Peers = {
        "floor (jax.jit)": lambda: floor(w, x),
        "treemode.jit": lambda: tm_fwd(model, x),
        "treemode.jit (updates a Variable)": lambda: tm_counting(model, x),
        "treemode.jit_partial": lambda: tm_partial(x),
        "nnx.jit(graph=False)": lambda: nnx_tree(model, x),
        "eqx.filter_jit": lambda: eqx_fn(w, x),
    }
    rows = []
    data = {}
    for name, fn in peers.items():
        jax.block_until_ready(fn())
        returned, ready = [], []
        for _ in range(max(3, config.repeats // 4)):
            start = time.perf_counter()
            out = fn()
            mid = time.perf_counter()
            jax.block_until_ready(out)
            end = time.perf_counter()
            returned.append((mid - start) * 1e6)
            ready.append((end - start) * 1e6)
        r, d = min(returned), statistics.median(ready)
        data[name] = {"returned_us": r, "ready_us": d}
        rows.append((name, [f"{r:.0f} µs", f"{d / 1e3:.1f} ms", "yes" if r < 0.25 * d else "NO"]))
    return Table(
        key="async",
        title=f"Asynchronous dispatch ({n}x{n} matmul chain)",
        columns=["call returns after", "result ready after", "async"],
        rows=rows,
        note="A call returns as soon as the computation is queued; "
        "`jax.block_until_ready` waits for the result.",
        data={"async": data},
    )


def run_all(config: Config) -> list[Table]:
    """The dispatch tables and the asynchronous-dispatch check: the whole case."""
    return [*run(config), async_dispatch(config)]


def main() -> None:
    if sys.argv[1:2] == ["--python-path"]:
        _python_path_main(sys.argv[2], sys.argv[3])
        return
    case_main(__doc__, run_all)


if __name__ == "__main__":
    main()
