"""What each piece of the compiled extension saves per call, against its Python twin.

For the 2-layer and the 64-layer MLP (a ``treemode.jit`` forward pass and an
Adam train step), each piece is timed alone on the very inputs a repeated call
hands it, compiled and in Python, and the whole call the record runs is timed
against the Python executor:

- ``holds``: the flattening guard (`treemode._tree._flat_guard.Guard.holds`);
- ``holds`` without version tags: the same guard state with its dict version
  tags left out (every dict compared, as on Python 3.12+): what the tags save
  (the row reads "n/a" where the interpreter has none);
- ``FastCall``: the whole call by the compiled executor of the fast-path
  record, against the same records run by its Python twin
  (`treemode._pipeline._executor.PyFastCall`) with the compiled kernels: what
  executing the record in C saves on top of them.

Run: ``python benchmarks/c_pieces.py`` (needs the extension; prints a table).
CPU time (``time.process_time``) per call, best of several rounds, so that a
loaded machine changes the numbers less. The last column is each saving's
share of the whole call a record runs (the ``FastCall`` row of the same model):
docs/contributing.md's rule returns a piece saving under about 2% to Python.
Three pieces went back to Python by it (docs/performance.md has their numbers,
measured by this file at commit b2ebe9f): the exported closure-read kernel
``reads_hold``, the generic ``__dict__`` read of the guard, and the exported
bulk write ``write_back`` (the executor still checks the closure reads and
writes in C).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from _models import BATCH, MLP, WIDTH, train_step, with_optimizer
from flax import nnx

import treemode
from treemode._accel import _compiled
from treemode._pipeline import _executor
from treemode._tree import _flatten
from treemode._tree._leaves import is_array


def per_call_us(fn: Callable[[], Any], n: int = 2000, rounds: int = 7) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = time.process_time()
        for _ in range(n):
            fn()
        best = min(best, (time.process_time() - start) / n)
    return best * 1e6


def _fwd(m, x):
    return m(x)


def pieces(depth: int) -> list[tuple[str, float, float]]:
    guard = _compiled.guard
    assert guard is not None, "the compiled extension is off"
    x = jnp.ones((BATCH, WIDTH))
    m = MLP(depth, nnx.Rngs(0))
    f = treemode.jit(_fwd)
    for _ in range(3):
        jax.block_until_ready(f(m, x))
    assert f._records  # the executor's table holds the record of these calls
    rows = []

    flat = _flatten.flatten_arg(m, is_array)
    g: Any = (flat.origin or flat)._guard
    variables = flat.variables
    state = g.compiled_state
    rows.append(
        (
            "holds (flattening guard)",
            per_call_us(lambda: guard.holds(state, variables, m)),
            per_call_us(lambda: _python_holds(g, variables, m)),
        )
    )

    n_untagged = len(guard.GUARD_STATE_FIELDS) - 3  # the fields before the three tags
    if len(state) > n_untagged:
        untagged = state[:n_untagged]
        rows.append(
            (
                "holds with version tags (against without)",
                per_call_us(lambda: guard.holds(state, variables, m)),
                per_call_us(lambda: guard.holds(untagged, variables, m)),
            )
        )
    else:
        rows.append(("holds with version tags (against without)", float("nan"), float("nan")))
    whole_c = per_call_us(lambda: f(m, x), n=500)
    run_python = _executor.PyFastCall.__call__  # the Python executor, on the same records
    whole_py = per_call_us(lambda: run_python(f, m, x), n=500)
    rows.append(("FastCall (whole forward call)", whole_c, whole_py))

    mt, opt = with_optimizer(MLP(depth, nnx.Rngs(0)))
    step = treemode.jit(train_step)
    for _ in range(3):
        jax.block_until_ready(step(mt, opt, x))
    assert step._records
    whole_c = per_call_us(lambda: step(mt, opt, x), n=200)
    whole_py = per_call_us(lambda: run_python(step, mt, opt, x), n=200)
    rows.append(("FastCall (whole train step)", whole_c, whole_py))
    return rows


def _python_holds(g: Any, variables: list[Any], top: Any) -> bool:
    state, g.compiled_state = g.compiled_state, None
    try:
        return g.holds(variables, top)
    finally:
        g.compiled_state = state


def main() -> None:
    print("| piece | model | with it µs | without it µs | saved µs per call | share of the call |")
    print("|---|---|---:|---:|---:|---:|")
    for depth in (2, 64):
        rows = pieces(depth)
        forward = next(c for name, c, _ in rows if name == "FastCall (whole forward call)")
        for name, c, py in rows:
            # Each saving against the call a record runs that pays it (the forward call).
            share = "" if name.startswith("FastCall") else f"{(py - c) / forward:.1%}"
            print(f"| {name} | {depth}-layer MLP | {c:.2f} | {py:.2f} | {py - c:.2f} | {share} |")


if __name__ == "__main__":
    main()
