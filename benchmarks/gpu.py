"""The GPU column: the real-loop cases (``loops.py``) on an accelerator.

Run on a machine with a GPU and JAX installed for it, from the repository root,
after ``pip install --no-build-isolation --no-deps .``::

    python benchmarks/gpu.py --out DIR

It measures, on the default (GPU) backend, every case of ``loops.py`` except
the 4,000-Variable decode (whose compilation alone takes minutes) and the
pure-Python column, plus a compute-bound train step (4 blocks of a 768-wide
MLP with a 3,072-wide hidden layer, a batch of 16 × 512 tokens, Adam, model and
optimizer donated), where dispatch is hidden behind the device's work and every
peer should be at the floor. It writes ``loops_gpu.md`` and ``loops_gpu.json``
into ``DIR``; the committed copy is ``benchmarks/results/loops_gpu.md``, and
docs/performance.md shows it with the date, the device and the JAX version.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import loops
import numpy as np
from _common import QUICK, SMOKE, Config, Table, environment, measure, print_tables, ratio_table
from _models import raw_arrays, tx
from flax import nnx

import treemode

GPU = dataclasses.replace(QUICK, name="gpu", repeats=8, sample_ms=3.0, decode_layers=(8, 100))
D_MODEL, D_HIDDEN, BLOCKS, TOKENS = 768, 3072, 4, 16 * 512


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.02)
        self.b1 = nnx.Param(jnp.zeros((D_HIDDEN,)))
        self.b2 = nnx.Param(jnp.zeros((D_MODEL,)))
        self.w1 = nnx.Param(init(rngs.params(), (D_MODEL, D_HIDDEN)))
        self.w2 = nnx.Param(init(rngs.params(), (D_HIDDEN, D_MODEL)))

    def __call__(self, x):
        return x + jax.nn.gelu(x @ self.w1[...] + self.b1[...]) @ self.w2[...] + self.b2[...]


class Wide(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.blocks = nnx.List([Block(rngs) for _ in range(BLOCKS)])

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def _wide_flat(params, _, x):
    for i in range(0, len(params), 4):
        b1, b2, w1, w2 = params[i : i + 4]
        x = x + jax.nn.gelu(x @ w1 + b1) @ w2 + b2
    return x


def compute_bound_peers(names: list[str]) -> dict[str, Any]:
    x = jax.random.normal(jax.random.key(0), (TOKENS, D_MODEL))
    step, opt = loops._flat_adam_step(_wide_flat, donate=(0, 2))
    arrays = raw_arrays(Wide(nnx.Rngs(0)))
    state = {"p": arrays, "o": (opt.init(arrays), jnp.zeros((), jnp.uint32))}

    def floor():
        value, state["p"], state["o"] = step(state["p"], (), state["o"], x)
        return value

    peers: dict[str, Any] = {"floor": floor}
    wrappers = {
        "treemode.jit": lambda: treemode.jit(loops.train_step, donate_argnums=(0, 1)),
        "nnx.jit (graph)": lambda: nnx.jit(
            loops._nnx_train_step, graph=True, donate_argnums=(0, 1)
        ),
        "nnx.jit(graph=False)": lambda: nnx.jit(
            loops._nnx_tree_train_step, graph=False, donate_argnums=(0, 1)
        ),
    }
    for name in names:
        if name != "floor":
            m = Wide(nnx.Rngs(0))
            o = nnx.Optimizer(m, tx(), wrt=nnx.Param)
            f = wrappers[name]()
            peers[name] = lambda f=f, m=m, o=o: f(m, o, x)
    expected = np.asarray(floor())
    for name in names:
        if name != "floor":
            np.testing.assert_allclose(np.asarray(peers[name]()), expected, rtol=2e-3)
    return {name: peers[name] for name in names}


def run(config: Config) -> list[Table]:
    rows = loops.measure_cases(config, loops.PEERS)
    label = f"compute-bound train step ({BLOCKS} × {D_MODEL}/{D_HIDDEN}, {TOKENS} tokens)"
    rows.append((label, measure(compute_bound_peers(loops.PEERS), config)))
    print(f"  measured {label}", flush=True)
    tables = ratio_table("loops_gpu", "Real loops on the GPU", loops.PEERS, "floor", rows)
    device = jax.devices()[0]
    tables[0].note = (
        f"Measured on {device.device_kind} ({device.platform}), {environment()}. Lower is "
        "better; 1.00× is the hand-written `jax.jit` over flat tuples that donates exactly "
        "what it writes."
    )
    return tables


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: checks the script runs")
    args = parser.parse_args()
    print(f"devices: {jax.devices()}", flush=True)
    config = GPU
    if args.smoke:
        global D_MODEL, D_HIDDEN, TOKENS
        D_MODEL, D_HIDDEN, TOKENS = 8, 16, 4
        config = dataclasses.replace(SMOKE, name="gpu-smoke")
    tables = run(config)
    print_tables(tables)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "loops_gpu.md").write_text("\n".join(t.markdown() for t in tables))
    (args.out / "loops_gpu.json").write_text(
        json.dumps({t.key: t.data for t in tables}, default=str, indent=1)
    )


if __name__ == "__main__":
    main()
