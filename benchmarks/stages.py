"""Where the time of one `treemode.jit` call goes, stage by stage.

The dispatch case (``dispatch.py``) gives the total time of a call; this script
splits treemode's share of it into the stages of the pipeline, each timed on its
own (interleaved with the others, minimum of many samples, as every benchmark
here), for the dispatch models' forward pass and train step. A call with the
same objects as the previous one takes the compiled call path
(``treemode/_accel/_guard_executor.c``), whose stages are:

- ``floor``: ``jax.jit`` on a flat tuple of the same arrays (the reference);
- ``JAX dispatch``: the compiled entry treemode calls, given the prepared arrays
  directly (JAX's own cost for our calling convention; compare with the floor);
- ``match arguments``: the identity checks of the call-site memo, in C: each
  argument is the same object, its cached flattening still holds (containers
  not modified since the snapshot are vouched for by their version tags), and
  the Variables' current values are read;
- ``closure``: checking that the closure still reaches the same objects;
- ``write back``: storing the changed Variables (skipped outright for a
  function that never updates one, like a forward pass), timed through
  ``_writeback.write_back``, which the compiled path runs without its Python frame;
- ``rest of the call``: the whole call minus the stages above (building the
  matched call, binding it for a retrace, the calls between C and Python); an
  estimate, as the stages are timed separately;
- ``whole call``: a `treemode.jit` call end to end;
- ``prepare (memo miss)``: for comparison, the full ``prepare`` that a call
  runs instead of the memo's match when its arguments are other objects than
  the previous call's (flattening-cache hits, closure search, call key, alias
  check).

With ``--cprofile`` it also prints cProfile's top functions for the Python part of
the 64-layer train step.

Run: ``python benchmarks/stages.py [--quick] [--cprofile]``; writes
``results/stages.md``.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from _common import Config, Table, case_main, measure
from _models import (
    BATCH,
    MLP,
    STATEFUL_PARAMS,
    WIDTH,
    Stateful,
    flat_train_step,
    loss_of,
    mlp_flat_forward,
    raw_arrays,
    stateful_flat_forward,
    tx,
)
from flax import nnx

import treemode
from treemode._pipeline import _executor, _writeback
from treemode._tree import _closure_reads

STAGES = [
    "floor",
    "JAX dispatch",
    "match arguments",
    "closure",
    "write back",
    "rest of the call",
    "whole call",
    "prepare (memo miss)",
]


def _forward(m: Any, x: jax.Array) -> jax.Array:
    return m(x)


def _train(m: Any, opt: Any, x: jax.Array) -> jax.Array:
    value, grads = treemode.value_and_grad(loss_of)(m, x)
    opt.update(m, grads)
    return value


def _model(depth: int | None) -> nnx.Module:
    return Stateful(nnx.Rngs(0)) if depth is None else MLP(depth, nnx.Rngs(0))


def _floor(depth: int | None, train: bool, x: jax.Array) -> Callable[[], Any]:
    forward = stateful_flat_forward if depth is None else mlp_flat_forward
    arrays = raw_arrays(_model(depth))
    if not train:
        flat = jax.jit(forward)
        return lambda: flat(arrays, x)
    step, init = flat_train_step(forward, STATEFUL_PARAMS if depth is None else None)
    step = jax.jit(step)
    state = {"arrays": arrays, "opt": init(arrays)}

    def floor() -> Any:
        value, state["arrays"], state["opt"] = step(state["arrays"], state["opt"], x)
        return value

    return floor


def stage_fns(depth: int | None, train: bool) -> dict[str, Callable[[], Any]]:
    """One zero-argument callable per stage (see the module docstring)."""
    x = jnp.ones((BATCH, WIDTH))
    model = _model(depth)
    args = (model, nnx.Optimizer(model, tx(), wrt=nnx.Param), x) if train else (model, x)
    fn = _train if train else _forward
    jitted = treemode.jit(fn)
    jitted(*args)
    call = jitted._prepare(args, {}, abstract=False)
    entry = jitted._entry(call)
    prepared = entry.args(call.dynamic)
    out, updates = entry.jitted(*prepared)
    jax.block_until_ready(out)
    jitted(*args)  # the executor's table holds the record of these calls
    assert jitted._records, "no fast-path record was made"
    record = jitted._records[0]
    assert _executor.match(record, args, None) is not None

    def dispatch() -> Any:
        entry.pure.bind(call)
        try:
            return entry.jitted(*prepared)[0]
        finally:
            entry.pure.bind(None)

    def write_back() -> None:
        # Writes the values the call just produced (the same arrays each time).
        if updates is not None:  # None: the trace updates no Variable
            _writeback.write_back(call, updates, entry.pure.findings.metadata_updates)

    def match_arguments() -> None:
        assert _executor.match_into(record.slots, args, [], [])

    def closure() -> None:
        assert _closure_reads.reads_hold_python(record.closure_reads)

    def prepare() -> None:
        jitted._prepare(args, {}, abstract=False)

    return {
        "floor": _floor(depth, train, x),
        "JAX dispatch": dispatch,
        "match arguments": match_arguments,
        "closure": closure,
        "write back": write_back,
        "whole call": lambda: jitted(*args),
        "prepare (memo miss)": prepare,
    }


CASES: dict[str, tuple[int | None, bool]] = {
    "2-layer MLP, forward": (2, False),
    "2-layer MLP, train step": (2, True),
    "64-layer MLP, forward": (64, False),
    "64-layer MLP, train step": (64, True),
    "stateful, forward": (None, False),
    "stateful, train step": (None, True),
}


def run(config: Config) -> list[Table]:
    rows: list[tuple[str, list[str]]] = []
    data: dict[str, dict[str, float]] = {}
    for case, (depth, train) in CASES.items():
        if depth == 64 and config.name == "smoke":
            continue
        timings = measure(stage_fns(depth, train), config)
        best = {name: t.best for name, t in timings.items()}
        parts = ("JAX dispatch", "match arguments", "closure", "write back")
        best["rest of the call"] = max(0.0, best["whole call"] - sum(best[p] for p in parts))
        data[case] = best
        floor = best["floor"]
        cells = [f"{floor:.0f} µs"] + [
            f"{best[s]:.1f} µs ({best[s] / floor:.2f}×)" for s in STAGES[1:]
        ]
        rows.append((case, cells))
    table = Table(
        key="stages",
        title="Where a treemode.jit call spends its time (best sample; ratio to the floor)",
        columns=STAGES,
        rows=rows,
        note=(
            "Each stage is timed on its own. `JAX dispatch` is the compiled call with the "
            "arrays already prepared; the stages of the compiled call path add to it. "
            "`match arguments` grows with the number of Variables (one value read each) "
            "and of containers (one version-tag check each); `closure` and `rest of the "
            "call` are a fixed cost per call; `rest of the call` is the whole call minus "
            "the other stages (an estimate). `prepare (memo miss)` is not part of the "
            "call: it is what a call whose arguments are other objects than the previous "
            "call's runs instead of the memo's match."
        ),
        data={"stages": data},
    )
    return [table]


def cprofile_train_step(depth: int = 64, calls: int = 200) -> None:
    """cProfile's top functions (own time) over ``calls`` train steps."""
    fns = stage_fns(depth, True)
    whole = fns["whole call"]
    whole()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        whole()
    profiler.disable()
    jax.block_until_ready(whole())
    pstats.Stats(profiler).sort_stats("tottime").print_stats(15)


def main() -> None:
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--cprofile", action="store_true", help="also print cProfile's top")

    args, _ = case_main(__doc__, run, add_arguments)
    if args.cprofile:
        cprofile_train_step()


if __name__ == "__main__":
    main()
