"""Case 4: compiled memory of treemode against the same computation written by hand.

``compiled.memory_analysis()`` of:

- scan over layers, forward: ``treemode.scan`` over a stack of blocks inside
  ``treemode.jit`` vs. ``jax.lax.scan`` over the stacked arrays in ``jax.jit``;
- scan over layers, train step (Adam through ``nnx.Optimizer`` vs. optax on the
  arrays);
- a donated train step (an 8-layer MLP; ``treemode.jit(donate_argnums=(0, 1))``
  on model and optimizer vs. ``jax.jit(donate_argnums=(0, 1))`` on the arrays).

Every field must be equal: the ratio is exactly 1.0. A ratio other than 1.0 is
printed as a failure line (and the run exits non-zero with ``--check``).

Run: ``python benchmarks/memory.py``.
"""

from __future__ import annotations

import sys
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
DONATE_DEPTH = 8
FIELDS = {
    "argument": "argument_size_in_bytes",
    "output": "output_size_in_bytes",
    "alias": "alias_size_in_bytes",
    "temp": "temp_size_in_bytes",
}


def footprint(stats: Any) -> dict[str, int]:
    out = {name: int(getattr(stats, attr)) for name, attr in FIELDS.items()}
    out["total"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
    return out


Pair = tuple[Callable[[], Any], Callable[[], Any]]


def pairs() -> dict[str, Pair]:
    """Per case: (treemode compiled, hand-written compiled), as thunks."""
    x = jnp.ones((BATCH, WIDTH))

    def scan_forward() -> Pair:
        model = ScanMLP(SCAN_DEPTH, nnx.Rngs(0))
        params = stacked_params(model.blocks)
        ours = lambda: treemode.jit(lambda m, x: m(x)).lower(model, x).compile()
        hand = lambda: jax.jit(scan_flat_forward).lower(params, x).compile()
        return ours, hand

    def scan_train() -> Pair:
        model, opt = with_optimizer(ScanMLP(SCAN_DEPTH, nnx.Rngs(0)))
        arrays = raw_arrays(model)
        step, init = flat_train_step(scan_flat_forward)
        ours = lambda: treemode.jit(train_step).lower(model, opt, x).compile()
        hand = lambda: jax.jit(step).lower(arrays, init(arrays), x).compile()
        return ours, hand

    def donated_train() -> Pair:
        model, opt = with_optimizer(MLP(DONATE_DEPTH, nnx.Rngs(0)))
        arrays = raw_arrays(model)
        step, init = flat_train_step(mlp_flat_forward)
        ours = lambda: (
            treemode.jit(train_step, donate_argnums=(0, 1)).lower(model, opt, x).compile()
        )
        hand = lambda: jax.jit(step, donate_argnums=(0, 1)).lower(arrays, init(arrays), x).compile()
        return ours, hand

    return {
        f"scan over {SCAN_DEPTH} layers, forward": scan_forward(),
        f"scan over {SCAN_DEPTH} layers, train step": scan_train(),
        f"{DONATE_DEPTH}-layer MLP, donated train step": donated_train(),
    }


def run(config: Config) -> list[Table]:
    del config  # compiled sizes are deterministic: one measurement each
    rows, data, failures = [], {}, []
    for label, (ours, hand) in pairs().items():
        a = footprint(ours().memory_analysis())
        b = footprint(hand().memory_analysis())
        ratios = {k: (a[k] / b[k] if b[k] else (1.0 if a[k] == 0 else float("inf"))) for k in a}
        data[label] = {"treemode": a, "hand": b, "ratio": ratios}
        exact = a == b
        if not exact:
            failures.append(label)
        rows.append(
            (
                label,
                [f"{a[k]:,} / {b[k]:,}" for k in a]
                + [f"{ratios['total']:.4f}", "yes" if exact else "**NO**"],
            )
        )
    note = "Bytes, treemode / hand-written, from `jit(...).lower(...).compile().memory_analysis()`."
    if failures:
        note += " **Not equal:** " + "; ".join(failures) + "."
    return [
        Table(
            key="memory",
            title="Compiled memory: treemode / hand-written JAX",
            columns=[*(f"{k} bytes" for k in FIELDS), "total bytes", "ratio", "exactly 1.0"],
            rows=rows,
            note=note,
            data={"memory": data, "failures": failures},
        )
    ]


def main() -> None:
    args, tables = case_main(
        __doc__,
        run,
        lambda parser: parser.add_argument(
            "--check", action="store_true", help="exit 1 unless every ratio is 1.0"
        ),
    )
    if args.check and tables[0].data["failures"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
