"""What each piece of the compiled extension saves per call, against its Python twin.

For the 2-layer and the 64-layer MLP (a ``treemode.jit`` forward pass and an
Adam train step), each piece is timed alone on the very inputs a repeated call
hands it, compiled and in Python, and the whole memo-matched call is timed
against the pipeline's memo path:

- ``holds``: the flattening guard (`treemode._tree._flatten._Guard.holds`);
- ``holds`` without version tags: the same guard state with its dict version
  tags left out (every dict compared, as on Python 3.12+): what the tags save
  (the row reads "n/a" where the interpreter has none);
- ``holds`` without the generic ``__dict__`` read: the same state checked by a
  copy of the extension compiled with ``TM_GENERIC_DICT=0`` (every
  ``obj.__dict__`` read with getattr instead of ``_PyType_Lookup``'s decision
  per type): what that shortcut saves (skipped without a C compiler);
- ``reads_hold``: the closure-read check (`treemode._tree._closure._Snapshot`),
  the compiled kernel against its Python twin ``reads_hold_python``;
- ``write_changed``: the all-or-nothing write of a train step's new values;
- ``FastCall``: the whole call by the executor of the fast-path record,
  against the same call through the pipeline (``JitWrapped._call``: the memo's
  `CallSite.match` and `treemode._pipeline._core.run`) with the compiled kernels:
  what executing the record in C saves on top of them.

Run: ``python benchmarks/c_pieces.py`` (needs the extension; prints a table).
CPU time (``time.process_time``) per call, best of several rounds, so that a
loaded machine changes the numbers less. The last column is each saving's
share of the whole memo-matched call (the ``FastCall`` row of the same model):
docs/contributing.md's rule returns a piece saving under about 2% to Python.
"""

from __future__ import annotations

import importlib.util
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
from _models import BATCH, MLP, WIDTH, train_step, with_optimizer
from flax import nnx

import treemode
from treemode._accel import _compiled
from treemode._pipeline import _callsite, _writeback
from treemode._tree import _closure, _flatten
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
    memo: Any = f._memo
    site, entry = memo
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
    plain = _variant("TM_GENERIC_DICT")
    if plain is not None:
        rows.append(
            (
                "holds with the generic __dict__ read (against getattr)",
                per_call_us(lambda: guard.holds(state, variables, m)),
                per_call_us(lambda: plain.holds(state, variables, m)),
            )
        )

    reads = site.snapshot.reads
    rows.append(
        (
            "reads_hold (closure reads)",
            per_call_us(lambda: guard.reads_hold(reads)),
            per_call_us(lambda: _closure.reads_hold_python(reads)),
        )
    )

    values = [v.get_raw_value() for v in variables]
    rows.append(
        (
            "write_changed (train-step write)",
            per_call_us(lambda: guard.write_changed(variables, values)),
            per_call_us(lambda: list(map(_writeback._setattr, variables, _repeat_raw, values))),
        )
    )

    whole_c = per_call_us(lambda: f(m, x), n=500)
    whole_py = per_call_us(lambda: f._call(m, x), n=500)
    rows.append(("FastCall (whole forward call)", whole_c, whole_py))

    mt, opt = with_optimizer(MLP(depth, nnx.Rngs(0)))
    step = treemode.jit(train_step)
    for _ in range(3):
        jax.block_until_ready(step(mt, opt, x))
    assert step._record is not None
    whole_c = per_call_us(lambda: step(mt, opt, x), n=200)
    whole_py = per_call_us(lambda: step._call(mt, opt, x), n=200)
    rows.append(("FastCall (whole train step)", whole_c, whole_py))
    return rows


class _Repeat:
    def __iter__(self):
        while True:
            yield "_raw_value"


_repeat_raw = _Repeat()


def _python_holds(g: Any, variables: list[Any], top: Any) -> bool:
    state, g.compiled_state = g.compiled_state, None
    try:
        return g.holds(variables, top)
    finally:
        g.compiled_state = state


_variants: dict[str, ModuleType | None] = {}


def _variant(switch: str) -> ModuleType | None:
    """A copy of the extension compiled with ``-D<switch>=0``, configured; ``None``
    (with a note on stderr) where it cannot be built. Built once per switch, with
    setuptools' own flags, into a temporary folder."""
    if switch in _variants:
        return _variants[switch]
    module = None
    try:
        from setuptools import Distribution, Extension
        from setuptools.command.build_ext import build_ext

        folder = Path(_compiled.__file__).parent
        sources = [str(p) for p in sorted(folder.glob("*.c"))]
        out = Path(tempfile.mkdtemp(prefix="treemode-variant-"))
        ext = Extension("_guard", sources, define_macros=[(switch, "0")])
        cmd = build_ext(Distribution({"ext_modules": [ext]}))
        cmd.build_lib, cmd.build_temp = str(out), str(out / "build")
        cmd.ensure_finalized()
        cmd.run()
        spec = importlib.util.spec_from_file_location("_guard", cmd.get_ext_fullpath("_guard"))
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.configure(**_callsite.configure_fields())
    except Exception as e:  # no C compiler, or no setuptools
        print(f"(the {switch}=0 copy of the extension was not built: {e})", file=sys.stderr)
        module = None
    _variants[switch] = module
    return module


def main() -> None:
    print("| piece | model | with it µs | without it µs | saved µs per call | share of the call |")
    print("|---|---|---:|---:|---:|---:|")
    for depth in (2, 64):
        rows = pieces(depth)
        forward = next(c for name, c, _ in rows if name == "FastCall (whole forward call)")
        step = next(c for name, c, _ in rows if name == "FastCall (whole train step)")
        for name, c, py in rows:
            # Each saving against the memo-matched call that pays it: the train
            # step's for its write, the forward call's for the others.
            whole = step if name.startswith("write") else forward
            share = "" if name.startswith("FastCall") else f"{(py - c) / whole:.1%}"
            print(f"| {name} | {depth}-layer MLP | {c:.2f} | {py:.2f} | {py - c:.2f} | {share} |")


if __name__ == "__main__":
    main()
