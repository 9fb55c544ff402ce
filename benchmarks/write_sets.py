"""Case 9: two write sets in turn, donated.

A function whose write set depends on the input's shape (the "branch on a
shape" of docs/guides/jit.md, as in ``tests/test_real_loops.py``): a module of
two ``nnx.BatchStat`` Variables, ``a`` of shape (2,) and ``b`` of shape (3,);
an input of shape (2,) is added to ``a``, one of shape (3,) to ``b``. Each
sample calls the wrapper with the two shapes in turn, so every call changes
both the signature and the set of Variables written. ``treemode.jit`` donates
the module (``donate_argnums=0``): each signature's program donates what its
trace writes and keeps the other Variable's buffer.

Peers, side by side in one process, interleaved:

- ``floor``: ``jax.jit`` on the flat arrays, one per signature, each donating
  exactly what that call writes (``a`` for the first shape, ``b`` for the
  second) and passing the other array undonated;
- ``treemode.jit`` donated; ``treemode.jit (undonated)`` for scale;
- Flax ``nnx.jit`` (graph mode) and ``nnx.jit(graph=False)`` with
  ``donate_argnums=0`` (they donate both Variables);
- ``treemode.jit (no C)``: donated, without the compiled extension (a
  subprocess with ``TREEMODE_NO_EXTENSION=1``, as a ratio to that process's
  own floor).

After the warm-up every peer's Variables are checked against the floor's
arrays. Target: ``treemode.jit`` ≤ 1.10× the floor (median).

Run: ``python benchmarks/write_sets.py [--quick]``
or ``python benchmarks/run.py --only write_sets``.
"""

from __future__ import annotations

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
    Timing,
    case_main,
    measure,
    ratio_table,
    scaled_to_floor,
    without_extension,
)
from flax import nnx

import treemode
from treemode._accel import _compiled

PEERS = [
    "floor",
    "treemode.jit",
    "treemode.jit (undonated)",
    "nnx.jit (graph)",
    "nnx.jit(graph=False)",
]
PYTHON_PEER = "treemode.jit (no C)"
LABEL = "two write sets in turn, donated (a branch on the input's shape)"
LABEL_ONE = "one write set, donated (the first shape every call; for scale)"

Peers = dict[str, Callable[[], Any]]


class TwoStats(nnx.Module):
    """Two statistics of different shapes; a call writes the one its input matches."""

    def __init__(self):
        self.a = nnx.BatchStat(jnp.zeros(2))
        self.b = nnx.BatchStat(jnp.zeros(3))


def branch_on_shape(m: TwoStats, x: jax.Array) -> jax.Array:
    """The function every peer but the floor jits: the write set follows ``x.shape``."""
    if x.shape[0] == 2:
        m.a[...] += x
    else:
        m.b[...] += x
    return x.sum()


def _write_first(written: jax.Array, kept: jax.Array, x: jax.Array):
    del kept  # read by nothing, passed as treemode passes it: undonated
    return x.sum(), written + x


def write_set_peers(names: list[str], alternate: bool = True) -> Peers:
    """One zero-argument callable per peer, each making two calls: with the two shapes
    in turn (``alternate``), or twice with the first shape."""
    xs = (jnp.ones(2), jnp.ones(3) if alternate else jnp.ones(2))
    # One jax.jit per signature, each donating exactly what that call writes.
    floor_jit = jax.jit(_write_first, donate_argnums=0)
    state = {"a": jnp.zeros(2), "b": jnp.zeros(3)}

    def floor():
        y, state["a"] = floor_jit(state["a"], state["b"], xs[0])
        if alternate:
            z, state["b"] = floor_jit(state["b"], state["a"], xs[1])
        else:
            z, state["a"] = floor_jit(state["a"], state["b"], xs[1])
        return y + z

    peers: Peers = {"floor": floor}
    wrappers = {
        "treemode.jit": lambda: treemode.jit(branch_on_shape, donate_argnums=0),
        "treemode.jit (undonated)": lambda: treemode.jit(branch_on_shape),
        "nnx.jit (graph)": lambda: nnx.jit(branch_on_shape, graph=True, donate_argnums=0),
        "nnx.jit(graph=False)": lambda: nnx.jit(branch_on_shape, graph=False, donate_argnums=0),
    }
    models: dict[str, TwoStats] = {}
    for name in names:
        if name == "floor":
            continue
        f, m = wrappers[name](), TwoStats()
        models[name] = m
        peers[name] = lambda f=f, m=m: f(m, xs[0]) + f(m, xs[1])
    for _ in range(3):  # the same number of calls for every peer, then compare
        for name in names:
            peers[name]()
    want_a, want_b = np.asarray(state["a"]), np.asarray(state["b"])
    for name, m in models.items():
        np.testing.assert_allclose(np.asarray(m.a[...]), want_a, err_msg=name)
        np.testing.assert_allclose(np.asarray(m.b[...]), want_b, err_msg=name)
    return {name: peers[name] for name in names}


def measure_cases(config: Config, names: list[str]) -> dict[str, dict[str, Timing]]:
    out = {}
    for label, alternate in ((LABEL, True), (LABEL_ONE, False)):
        out[label] = measure(write_set_peers(names, alternate), config)
        print(f"  measured {label}", flush=True)
    return out


def _python_path_main(config_name: str, out: str) -> None:
    assert not _compiled.ENABLED, f"run with {_compiled.ENV_VAR}=1"
    names = ["floor", "treemode.jit"]
    rows = measure_cases(CONFIGS[config_name], names)
    data = {label: {p: [t[p].best, t[p].median] for p in names} for label, t in rows.items()}
    Path(out).write_text(json.dumps(data))


def run(config: Config) -> list[Table]:
    rows = measure_cases(config, PEERS)
    peers = list(PEERS)
    if _compiled.ENABLED:
        print("  measuring the pure-Python path (TREEMODE_NO_EXTENSION=1)", flush=True)
        python = without_extension(__file__, config)
        for label, timings in rows.items():
            timings[PYTHON_PEER] = scaled_to_floor(timings["floor"], python[label], "treemode.jit")
        peers.append(PYTHON_PEER)
    note = (
        "Lower is better. One sample calls each peer with the two shapes in turn (two "
        "calls); 1.00× is `jax.jit` on the flat arrays, one per signature, donating "
        "exactly what each call writes. treemode.jit donates the module "
        "(`donate_argnums=0`): each signature's program donates the Variable it writes; "
        "the nnx.jit peers donate both. The second row calls with the first shape twice "
        "(one signature, one write set): what a donated call costs without the alternation."
    )
    if _compiled.ENABLED:
        note += (
            " The (no C) column is treemode.jit donated without the compiled extension, "
            "in a subprocess with TREEMODE_NO_EXTENSION=1, as a ratio to that process's floor."
        )
    tables = ratio_table(
        "write_sets",
        "Two write sets in turn: microseconds per sample",
        peers,
        "floor",
        list(rows.items()),
    )
    tables[0].note = note
    return tables


def main() -> None:
    if sys.argv[1:2] == ["--python-path"]:
        _python_path_main(sys.argv[2], sys.argv[3])
        return
    case_main(__doc__, run)


if __name__ == "__main__":
    main()
