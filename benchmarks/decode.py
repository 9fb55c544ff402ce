"""Case 7: one decode step of an LLM-shaped model, at thousands of Variables.

A decoder of ``L`` layers; each layer holds 6 kernels (query, key, value,
output, MLP up and down), 2 norm scales and 2 KV-cache Variables
(``nnx.Cache``), 10 Variables a layer, and every call writes both caches of
every layer, as a decode step does. The arrays are tiny (width 8, a cache of 4
positions) so the time is dispatch, not compute. ``L`` is 8, 100 and 400 (80,
1,000 and 4,000 Variables).

Peers, side by side in one process, interleaved:

- ``floor``: ``jax.jit`` over flat tuples of the state's leaves (parameters and
  caches), the model merged inside the trace and only the caches returned; the
  hand-written fix that serving stacks apply to an NNX model whose per-Variable
  flattening makes decode host-bound;
- ``treemode.jit``;
- Flax ``nnx.jit`` in graph mode and ``nnx.jit(graph=False)``;
- ``treemode.jit (no C)``: ``treemode.jit`` without the compiled extension,
  measured in a subprocess with ``TREEMODE_NO_EXTENSION=1`` against that
  process's own floor (as in the dispatch case) and stored scaled to this
  process's floor.

Every peer's caches are checked after the warm-up: they must hold what the
floor's hold (so no peer skips the write).

Two tables: microseconds per call (floor) and ratios to the floor per ``L``; and
the marginal cost, in nanoseconds per Variable (best samples), between consecutive ``L``:
each peer's own, and its extra over the floor's.

Run: ``make bench`` (whole suite) or ``python benchmarks/decode.py [--quick] [--layers 8 100]``
(``--layers`` replaces the configuration's sizes: 400 layers take minutes to compile).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from _common import (
    CONFIGS,
    Config,
    Table,
    case_main,
    measure,
    ratio_table,
    scaled_to_floor,
    without_extension,
)
from flax import nnx

import treemode
from treemode._accel import _compiled

WIDTH = 8
CACHE = 4  # cache positions
VARIABLES_PER_LAYER = 10

PEERS = ["floor", "treemode.jit", "nnx.jit (graph)", "nnx.jit(graph=False)"]
PYTHON_PEER = "treemode.jit (no C)"

Peers = dict[str, Callable[[], Any]]


class DecodeLayer(nnx.Module):
    """Attention over a KV cache and an MLP: 6 kernels, 2 norm scales, 2 caches."""

    def __init__(self, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.3)

        def kernel() -> nnx.Param:
            return nnx.Param(init(rngs.params(), (WIDTH, WIDTH)))

        self.wq, self.wk, self.wv, self.wo = kernel(), kernel(), kernel(), kernel()
        self.w_up, self.w_down = kernel(), kernel()
        self.attn_norm = nnx.Param(jnp.ones((WIDTH,)))
        self.mlp_norm = nnx.Param(jnp.ones((WIDTH,)))
        self.k_cache = nnx.Cache(jnp.zeros((CACHE, WIDTH)))
        self.v_cache = nnx.Cache(jnp.zeros((CACHE, WIDTH)))

    def __call__(self, x: jax.Array, pos: jax.Array) -> jax.Array:
        h = x * self.attn_norm[...]
        q, k, v = h @ self.wq[...], h @ self.wk[...], h @ self.wv[...]
        keys = jax.lax.dynamic_update_slice(self.k_cache[...], k[None], (pos, 0))
        values = jax.lax.dynamic_update_slice(self.v_cache[...], v[None], (pos, 0))
        self.k_cache[...] = keys
        self.v_cache[...] = values
        attention = jax.nn.softmax(keys @ q) @ values
        x = x + attention @ self.wo[...]
        h = x * self.mlp_norm[...]
        return x + jnp.tanh(h @ self.w_up[...]) @ self.w_down[...]


class Decoder(nnx.Module):
    def __init__(self, layers: int, rngs: nnx.Rngs):
        self.layers = nnx.List([DecodeLayer(rngs) for _ in range(layers)])

    def __call__(self, x: jax.Array, pos: jax.Array) -> jax.Array:
        for layer in self.layers:
            x = layer(x, pos)
        return x


def decode_step(model: Decoder, x: jax.Array, pos: jax.Array) -> jax.Array:
    """The function every peer but the floor jits: one step, caches written."""
    return model(x, pos)


def _inputs() -> tuple[jax.Array, jax.Array]:
    return jnp.linspace(-1.0, 1.0, WIDTH), jnp.asarray(1, jnp.int32)


def _caches(model: Decoder) -> list[np.ndarray]:
    return [np.asarray(v) for v in jax.tree.leaves(nnx.state(model, nnx.Cache))]


def floor_peer(layers: int) -> tuple[Callable[[], Any], Callable[[], list[np.ndarray]]]:
    """The hand-written ``jax.jit``: flat tuples in, the model merged inside the trace."""
    graphdef, params, caches = nnx.split(Decoder(layers, nnx.Rngs(0)), nnx.Param, nnx.Cache)
    p_leaves, p_def = jax.tree.flatten(params)
    c_leaves, c_def = jax.tree.flatten(caches)
    x, pos = _inputs()

    @jax.jit
    def step(p: tuple, c: tuple, x: jax.Array, pos: jax.Array):
        model = nnx.merge(graphdef, jax.tree.unflatten(p_def, p), jax.tree.unflatten(c_def, c))
        y = model(x, pos)
        return y, tuple(jax.tree.leaves(nnx.state(model, nnx.Cache)))

    state = {"p": tuple(p_leaves), "c": tuple(c_leaves)}

    def call():
        y, state["c"] = step(state["p"], state["c"], x, pos)
        return y

    return call, lambda: [np.asarray(c) for c in state["c"]]


def decode_peers(layers: int, names: list[str] | None = None) -> Peers:
    """One zero-argument callable per peer (all of ``PEERS``, or ``names``), each
    running one decode step; checks that every peer wrote the floor's caches."""
    names = names or PEERS
    x, pos = _inputs()
    floor, floor_caches = floor_peer(layers)
    peers: Peers = {"floor": floor}
    models: dict[str, Decoder] = {}
    jitted = {
        "treemode.jit": lambda: treemode.jit(decode_step),
        "nnx.jit (graph)": lambda: nnx.jit(decode_step, graph=True),
        "nnx.jit(graph=False)": lambda: nnx.jit(decode_step, graph=False),
    }
    for name in names:
        if name == "floor":
            continue
        f, m = jitted[name](), Decoder(layers, nnx.Rngs(0))
        models[name] = m
        peers[name] = lambda f=f, m=m: f(m, x, pos)
    expected_y = np.asarray(floor())
    expected = floor_caches()
    assert any(np.any(c != 0) for c in expected), "the floor wrote no cache"
    for name, m in models.items():
        y = np.asarray(peers[name]())
        np.testing.assert_allclose(y, expected_y, rtol=1e-5, atol=1e-6, err_msg=name)
        for got, want in zip(_caches(m), expected, strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=name)
    return {name: peers[name] for name in names}


def measure_layers(config: Config, names: list[str] | None = None) -> list[tuple[int, Any]]:
    """``(L, timings)`` for each number of layers of the configuration."""
    rows = []
    for layers in config.decode_layers:
        timings = measure(decode_peers(layers, names), config)
        rows.append((layers, timings))
        print(f"  measured {layers} layers", flush=True)
    return rows


def python_path_timings(config: Config) -> dict[str, dict[str, list[float]]]:
    """Per ``L``, ``{peer: [best, median]}`` of the floor and ``treemode.jit``, measured in
    a subprocess without the compiled extension."""
    return without_extension(__file__, config, *(str(n) for n in config.decode_layers))


def _python_path_main(config_name: str, out: str, layers: list[int]) -> None:
    assert not _compiled.ENABLED, f"run with {_compiled.ENV_VAR}=1"
    names = ["floor", "treemode.jit"]
    config = CONFIGS[config_name]
    if layers:
        config = dataclasses.replace(config, decode_layers=tuple(layers))
    rows = measure_layers(config, names)
    data = {str(L): {p: [t[p].best, t[p].median] for p in names} for L, t in rows}
    Path(out).write_text(json.dumps(data))


def _label(layers: int) -> str:
    plural = "s" if layers != 1 else ""
    return f"{layers} layer{plural} ({layers * VARIABLES_PER_LAYER:,} Variables)"


def marginal(nvars: list[int], us: list[float]) -> list[float]:
    """Nanoseconds per Variable between consecutive sizes (the slope of each segment)."""
    return [(us[i] - us[i - 1]) * 1e3 / (nvars[i] - nvars[i - 1]) for i in range(1, len(nvars))]


def run(config: Config) -> list[Table]:
    rows = measure_layers(config)
    peers = list(PEERS)
    if _compiled.ENABLED:  # the pure-Python column, side by side
        print("  measuring the pure-Python path (TREEMODE_NO_EXTENSION=1)", flush=True)
        python = python_path_timings(config)
        for layers, timings in rows:
            timings[PYTHON_PEER] = scaled_to_floor(
                timings["floor"], python[str(layers)], "treemode.jit"
            )
        peers.append(PYTHON_PEER)
    note = (
        "Lower is better; 1.00× is the hand-written `jax.jit` over flat tuples of the "
        "state's leaves. Every call writes the 2 caches of every layer."
    )
    if _compiled.ENABLED:
        note += (
            " The (no C) column runs without the compiled extension, in a subprocess "
            "with TREEMODE_NO_EXTENSION=1, as a ratio to that process's floor."
        )
    else:
        note += " This run had no compiled extension: treemode ran its pure-Python path."
    labelled = [(_label(L), t) for L, t in rows]
    tables = ratio_table("decode", "Decode step: microseconds per call", peers, "floor", labelled)
    tables[0].note = note

    nvars = [L * VARIABLES_PER_LAYER for L, _ in rows]
    best = {peer: [t[peer].best for _, t in rows] for peer in peers}
    return [*tables, marginal_table(nvars, best)]


def marginal_table(nvars: list[int], best: dict[str, list[float]]) -> Table:
    """The marginal cost table from each peer's best microseconds at each size."""
    segments = [f"{a:,}→{b:,}" for a, b in zip(nvars[:-1], nvars[1:], strict=True)]
    cells = []
    data: dict[str, Any] = {"nvars": nvars}
    for peer, own in best.items():
        mine = marginal(nvars, own)
        extra = marginal(nvars, [a - b for a, b in zip(own, best["floor"], strict=True)])
        data[peer] = {"own_ns": mine, "extra_ns": extra}
        if peer == "floor":
            cells.append(("floor (its own cost)", [f"{v:.0f}" for v in mine] + ["—"] * len(extra)))
        else:
            cells.append((peer, [f"{v:.0f}" for v in mine] + [f"{v:.0f}" for v in extra]))
    return Table(
        key="decode_marginal",
        title="Decode step: marginal nanoseconds per Variable (best samples)",
        columns=[f"ns / Variable, {s}" for s in segments] + [f"over floor, {s}" for s in segments],
        rows=cells,
        note="The slope of each segment between two sizes: a peer's own time per added "
        "Variable, then its time per added Variable beyond the floor's, from best samples "
        "as in the per-Variable case. A negative cost over the floor is noise: the run's "
        "spread is larger than the cost.",
        file="decode",
        data={"marginal": data},
    )


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--layers",
        type=int,
        nargs="+",
        help="numbers of layers to run instead of the configuration's (8 100 400 in full)",
    )


def _with_layers(config: Config) -> Config:
    layers = _LAYERS.get("layers")
    return dataclasses.replace(config, decode_layers=tuple(layers)) if layers else config


_LAYERS: dict[str, list[int]] = {}


def main() -> None:
    if sys.argv[1:2] == ["--python-path"]:
        layers = [int(n) for n in sys.argv[4:]]
        _python_path_main(sys.argv[2], sys.argv[3], layers)
        return
    if "--layers" in sys.argv:  # read before the run: `run` takes only a Config
        i = sys.argv.index("--layers")
        _LAYERS["layers"] = [int(n) for n in sys.argv[i + 1 :] if n.isdigit()]
    case_main(__doc__, lambda config: run(_with_layers(config)), _add_arguments)


if __name__ == "__main__":
    main()
