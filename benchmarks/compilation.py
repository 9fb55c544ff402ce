"""Case 5: trace counts and compile time, treemode against hand-written ``jax.jit``.

Trace count: a Python counter inside the function counts how often JAX traces
it, over repeated calls, a call on a new model of the same structure (new
arrays for the floor), and a call with a new batch size (the one call that
must retrace).

Compile time: the best over repeats of tracing + lowering (``.lower()``) and of
XLA compilation (``.compile()``), each repeat on a fresh function so that no
cache is hit; the two spellings alternate repeat by repeat.

Run: ``python benchmarks/compilation.py [--quick]``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from _common import Config, Table, case_main
from _models import (
    BATCH,
    MLP,
    WIDTH,
    ScanMLP,
    flat_train_step,
    mlp_flat_forward,
    raw_arrays,
    scan_flat_forward,
    stacked_params,
    train_step,
    with_optimizer,
)
from flax import nnx

import treemode

SCAN_DEPTH = 16


class Case:
    """A computation in two spellings, each built fresh by a factory.

    ``ours(counter)`` returns ``(fn, make_args)``: a function to pass to
    ``treemode.jit`` that bumps ``counter[0]`` when traced, and a factory of its
    arguments (a new model each time). ``hand(counter)`` is the same for
    ``jax.jit`` on flat arrays.
    """

    def __init__(self, label: str, ours: Callable[..., Any], hand: Callable[..., Any]):
        self.label, self.ours, self.hand = label, ours, hand


def _mlp_train() -> Case:
    def ours(counter):
        def step(m, opt, x):
            counter[0] += 1
            return train_step(m, opt, x)

        def args(batch=BATCH):
            return (*with_optimizer(MLP(2, nnx.Rngs(0))), jnp.ones((batch, WIDTH)))

        return step, args

    def hand(counter):
        flat, init = flat_train_step(mlp_flat_forward)

        def step(arrays, opt_state, x):
            counter[0] += 1
            return flat(arrays, opt_state, x)

        def args(batch=BATCH):
            arrays = raw_arrays(MLP(2, nnx.Rngs(0)))
            return arrays, init(arrays), jnp.ones((batch, WIDTH))

        return step, args

    return Case("2-layer MLP, train step", ours, hand)


def _scan_forward() -> Case:
    def ours(counter):
        def fwd(m, x):
            counter[0] += 1
            return m(x)

        return fwd, lambda batch=BATCH: (ScanMLP(SCAN_DEPTH, nnx.Rngs(0)), jnp.ones((batch, WIDTH)))

    def hand(counter):
        def fwd(params, x):
            counter[0] += 1
            return scan_flat_forward(params, x)

        def args(batch=BATCH):
            params = stacked_params(ScanMLP(SCAN_DEPTH, nnx.Rngs(0)).blocks)
            return params, jnp.ones((batch, WIDTH))

        return fwd, args

    return Case(f"scan over {SCAN_DEPTH} layers, forward", ours, hand)


CASES = [_mlp_train, _scan_forward]


def _traces(build: Callable[..., Any], wrap: Callable[..., Any], partial: bool) -> list[int]:
    """Trace counts after: 5 calls; a call on new arguments; a call with a new batch size."""
    counter = [0]
    fn, make_args = build(counter)
    args = make_args()
    if partial:
        bound = wrap(fn, *args[:-1])
        call = lambda a: bound(a[-1])  # noqa: E731
    else:
        jitted = wrap(fn)
        call = lambda a: jitted(*a)  # noqa: E731
    counts = []
    for _ in range(5):
        jax.block_until_ready(call(args))
    counts.append(counter[0])
    if partial:
        counts.append(-1)  # the bound arguments cannot change
    else:
        jax.block_until_ready(call(make_args()))
        counts.append(counter[0])
    jax.block_until_ready(call((*args[:-1], make_args(BATCH * 2)[-1])))
    counts.append(counter[0])
    return counts


def _lower_and_compile(build: Callable[..., Any], wrap: Callable[..., Any]) -> tuple[float, float]:
    """Milliseconds of ``.lower()`` and of ``.compile()`` on a fresh function."""
    fn, make_args = build([0])
    args = make_args()
    start = time.perf_counter()
    lowered = wrap(fn).lower(*args)
    mid = time.perf_counter()
    lowered.compile()
    end = time.perf_counter()
    return (mid - start) * 1e3, (end - mid) * 1e3


def _compile_times(case: Case, repeats: int) -> dict[str, tuple[float, float]]:
    """Best lower and compile times of both spellings, interleaved repeat by repeat."""
    spellings = {"jax.jit": (case.hand, jax.jit), "treemode.jit": (case.ours, treemode.jit)}
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in spellings}
    for _ in range(max(1, repeats)):
        for name, (build, wrap) in spellings.items():
            times[name].append(_lower_and_compile(build, wrap))
    return {name: (min(t[0] for t in ts), min(t[1] for t in ts)) for name, ts in times.items()}


def run(config: Config) -> list[Table]:
    trace_rows, time_rows, data = [], [], {}
    for make in CASES[:1] if config.name == "smoke" else CASES:
        case = make()
        counts = {
            "jax.jit": _traces(case.hand, jax.jit, False),
            "treemode.jit": _traces(case.ours, treemode.jit, False),
            "treemode.jit_partial": _traces(case.ours, treemode.jit_partial, True),
        }
        fmt = lambda c: " → ".join("–" if n < 0 else str(n) for n in c)  # noqa: E731
        same = all(
            c[i] == counts["jax.jit"][i] for c in counts.values() for i in range(3) if c[i] >= 0
        )
        trace_rows.append(
            (case.label, [fmt(c) for c in counts.values()] + ["yes" if same else "**NO**"])
        )
        times = _compile_times(case, config.compile_repeats)
        hand_lower, hand_compile = times["jax.jit"]
        ours_lower, ours_compile = times["treemode.jit"]
        time_rows.append(
            (
                case.label,
                [
                    f"{hand_lower:.1f}",
                    f"{ours_lower:.1f}",
                    f"{ours_lower / hand_lower:.2f}×",
                    f"{hand_compile:.1f}",
                    f"{ours_compile:.1f}",
                    f"{ours_compile / hand_compile:.2f}×",
                ],
            )
        )
        data[case.label] = {
            "traces": counts,
            "same_traces": same,
            "lower_ms": {"jax.jit": hand_lower, "treemode.jit": ours_lower},
            "compile_ms": {"jax.jit": hand_compile, "treemode.jit": ours_compile},
        }
        print(f"  measured {case.label}", flush=True)
    return [
        Table(
            key="traces",
            title="Trace count after 5 calls → a new model of the same structure → a new batch",
            columns=["jax.jit", "treemode.jit", "treemode.jit_partial", "same as jax.jit"],
            rows=trace_rows,
            note="A Python counter in the function body counts traces; "
            "only the new batch size may retrace. `–`: jit_partial's bound model cannot change.",
            data={"compilation": data},
            file="compilation",
        ),
        Table(
            key="compile_time",
            title="Compile time in ms (best of repeats, fresh function each time)",
            columns=[
                "trace+lower, jax.jit",
                "trace+lower, treemode",
                "ratio",
                "compile, jax.jit",
                "compile, treemode",
                "ratio",
            ],
            rows=time_rows,
            note="`.lower()` includes tracing the Python function; `.compile()` is XLA.",
            file="compilation",
        ),
    ]


def main() -> None:
    case_main(__doc__, run)


if __name__ == "__main__":
    main()
