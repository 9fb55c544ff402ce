"""Wide and deep modules: treemode's cost grows linearly with size.

Wide: one module holding n scalar Variables (n = 1k, 10k, 100k).
Deep: a chain of n nested modules (n = 100, 300, 1000), each with one Variable.

For each size, prints the time of the first `treemode.jit` call (flatten, trace,
compile), of a steady-state call (cached flattening, compiled function) and of
`treemode.eval_shape`, with the steady-state cost per Variable: a flat column
means linear time. Tests only assert that these sizes work
(tests/test_hostile.py); the timings live here.

    python benchmarks/wide_and_deep.py           # all sizes
    python benchmarks/wide_and_deep.py --quick   # the two smaller sizes
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import treemode  # noqa: E402


class Wide(nnx.Module):
    def __init__(self, n: int):
        values = np.zeros((n, 1), np.float32)
        self.params = nnx.data([nnx.Param(values[i]) for i in range(n)])


class Link(nnx.Module):
    def __init__(self, child: Any):
        self.w = nnx.Param(jnp.zeros(()))
        self.child = child


def deep(n: int) -> Link:
    m = None
    for _ in range(n):
        m = Link(m)
    assert m is not None
    return m


def wide_step(m: Wide) -> jax.Array:
    m.params[-1][...] += 1.0  # one write; everything else passes through
    return m.params[0][...]


def deep_step(m: Link) -> jax.Array:
    m.w[...] += 1.0
    return m.w[...]


def _time(fn: Callable[[], Any], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(kind: str, n: int) -> dict[str, float]:
    module = Wide(n) if kind == "wide" else deep(n)
    step = wide_step if kind == "wide" else deep_step
    f = treemode.jit(step)
    start = time.perf_counter()
    jax.block_until_ready(f(module))
    first = time.perf_counter() - start
    steady = _time(lambda: f(module), repeat=5)
    shape = _time(lambda: treemode.eval_shape(step, module), repeat=1)
    return {"first": first, "steady": steady, "eval_shape": shape}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="skip the largest sizes")
    args = parser.parse_args()
    cases = [("wide", 1_000), ("wide", 10_000), ("wide", 100_000)]
    cases += [("deep", 100), ("deep", 300), ("deep", 1_000)]
    if args.quick:
        cases = [c for c in cases if c not in (("wide", 100_000), ("deep", 1_000))]
    print(
        f"{'module':<8} {'n':>8} {'first call':>12} {'steady call':>12} "
        f"{'per Variable':>13} {'eval_shape':>11}"
    )
    for kind, n in cases:
        t = measure(kind, n)
        print(
            f"{kind:<8} {n:>8} {t['first']:>11.3f}s {t['steady'] * 1e3:>10.2f}ms "
            f"{t['steady'] / n * 1e6:>11.3f}us {t['eval_shape']:>10.3f}s"
        )


if __name__ == "__main__":
    main()
