"""Case 11: the repeated call through ``nnx.cached_partial``, and where its time goes.

google/tunix's trainers call their donated train step as
``functools.partial(nnx.cached_partial(jit(step), model, optimizer))(x)``.
``nnx.cached_partial`` binds clones of the model and the optimizer and runs
every call inside Flax's ``static_cache`` context, which leaves a cache for the
Flax transform it calls to take; ``treemode.jit``'s executor takes it (and
needs none). The peers, side by side in one process, on the 2-layer donated
train step of the real-loops case (``loops.train_peers``):

- ``floor``: ``jax.jit`` over flat tuples, donating what it writes;
- ``treemode.jit``: the direct call ``step(model, optimizer, x)``;
- ``Flax's context + treemode.jit``: the direct call of the same wrapper on the
  clones ``nnx.cached_partial`` made, inside Flax's ``static_cache`` context:
  what ``nnx.cached_partial`` does around the call, without its partial;
- ``cached_partial(treemode.jit)``: the call as tunix makes it;
- ``cached_partial(nnx.jit)``: the same over ``nnx.jit`` (graph mode).

If ``cached_partial(treemode.jit)`` costs what ``Flax's context +
treemode.jit`` costs, treemode adds nothing to the call: the rest is Flax's.

Run: ``python benchmarks/cached_partial.py [--quick]`` or
``python benchmarks/run.py --only cached_partial``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np
from _common import Config, Table, case_main, measure, ratio_table
from _models import BATCH, MLP, WIDTH, train_step, tx
from flax import nnx
from flax.nnx import graphlib
from loops import _nnx_train_step, train_peers

import treemode

PEERS = [
    "floor",
    "treemode.jit",
    "Flax's context + treemode.jit",
    "cached_partial(treemode.jit)",
    "cached_partial(nnx.jit)",
]
LABEL = "donated train step, 2-layer MLP"


def _bound_cells(bound: Callable[..., Any]) -> dict[str, Any]:
    """The objects ``nnx.cached_partial``'s wrapper closes over (its cache, clones)."""
    code, cells = bound.__code__, bound.__closure__ or ()  # type: ignore[attr-defined]
    return {name: cell.cell_contents for name, cell in zip(code.co_freevars, cells, strict=True)}


def cached_partial_peers() -> dict[str, Callable[[], Any]]:
    x = jnp.ones((BATCH, WIDTH))
    peers = train_peers(2, ["floor", "treemode.jit"])

    def bound_over(wrapper: Callable[..., Any]) -> Callable[..., Any]:
        m = MLP(2, nnx.Rngs(0))
        return nnx.cached_partial(wrapper, m, nnx.Optimizer(m, tx(), wrt=nnx.Param))

    inner = treemode.jit(train_step, donate_argnums=(0, 1))
    cells = _bound_cells(bound_over(inner))
    cache, (model_clone, opt_clone) = cells["cache"], cells["cached_args"]

    def in_flax_context() -> Any:
        with graphlib.static_cache(cache):
            return inner(model_clone, opt_clone, x)

    peers["Flax's context + treemode.jit"] = in_flax_context
    tunix_call = functools.partial(bound_over(treemode.jit(train_step, donate_argnums=(0, 1))))
    peers["cached_partial(treemode.jit)"] = lambda: tunix_call(x)
    flax_call = functools.partial(
        bound_over(nnx.jit(_nnx_train_step, graph=True, donate_argnums=(0, 1)))
    )
    peers["cached_partial(nnx.jit)"] = lambda: flax_call(x)
    for name in PEERS:  # every peer trains (the values: tests/test_cached_partial.py)
        losses = [float(np.asarray(peers[name]())) for _ in range(3)]
        assert all(np.isfinite(losses)) and losses[-1] < losses[0], (name, losses)
    return {name: peers[name] for name in PEERS}


def run(config: Config) -> list[Table]:
    timings = measure(cached_partial_peers(), config)
    print(f"  measured {LABEL}", flush=True)
    tables = ratio_table(
        "cached_partial",
        "Through nnx.cached_partial: microseconds per call",
        PEERS,
        "floor",
        [(LABEL, timings)],
    )
    tables[0].note = (
        "Lower is better; 1.00× is the hand-written `jax.jit` over flat tuples that donates "
        "exactly what it writes. Flax's context + treemode.jit calls the same treemode.jit "
        "wrapper on the clones nnx.cached_partial made, inside Flax's static_cache "
        "context (what nnx.cached_partial runs around the call); cached_partial(...) is the "
        "call as google/tunix's trainers make it, "
        "functools.partial(nnx.cached_partial(wrapper, model, optimizer))(x)."
    )
    return tables


def main() -> None:
    case_main(__doc__, run)


if __name__ == "__main__":
    main()
