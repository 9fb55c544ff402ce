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

A second table (``--live``, the ``live_memory`` case of ``run.py``) counts the
bytes of ``jax.live_arrays()`` (after ``gc.collect()``) once a few undonated
steps have run, with the model, the optimizer and the wrapper still alive:
a decode step writing 4 MiB of KV cache (1 MiB of weights), an Adam train
step of a 4-layer MLP of width 256 (1 MiB of Params, 3 MiB of training state)
and the LoRA step of the real-loops case. Peers: the floor (``jax.jit`` on the
flat arrays, the old state dropped by the loop), ``treemode.jit``, Flax
``nnx.jit`` (graph mode and ``graph=False``), and ``treemode.jit`` without the
compiled extension (a subprocess with ``TREEMODE_NO_EXTENSION=1``). A wrapper
that pins nothing holds exactly the floor's bytes: the model's own state. The
table also gives the bytes still alive once the model, the optimizer and the
wrapper are dropped (0 for a cache that holds no array).

Run: ``python benchmarks/memory.py [--live]``.
"""

from __future__ import annotations

import gc
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from _common import Config, Table, case_main, without_extension
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
from treemode._accel import _compiled

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


# -- live bytes after undonated steps ---------------------------------------------------

LIVE_STEPS = 3
KV_LAYERS, KV_WIDTH, KV_POSITIONS = 4, 256, 512  # 1 MiB of weights, 4 MiB of caches
WIDE, WIDE_DEPTH = 256, 4  # 1 MiB of Params
LIVE_PEERS = ["floor", "treemode.jit", "nnx.jit (graph)", "nnx.jit(graph=False)"]
LIVE_PYTHON_PEER = "treemode.jit (no C)"


class KVLayer(nnx.Module):
    """A query projection and a key and value cache, both written every step."""

    def __init__(self, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.05)
        self.wq = nnx.Param(init(rngs.params(), (KV_WIDTH, KV_WIDTH)))
        self.k_cache = nnx.Cache(jnp.zeros((KV_POSITIONS, KV_WIDTH)))
        self.v_cache = nnx.Cache(jnp.zeros((KV_POSITIONS, KV_WIDTH)))

    def __call__(self, x: jax.Array, pos: jax.Array) -> jax.Array:
        q = jnp.tanh(x @ self.wq[...])
        keys = jax.lax.dynamic_update_slice(self.k_cache[...], q[None], (pos, 0))
        values = jax.lax.dynamic_update_slice(self.v_cache[...], x[None], (pos, 0))
        self.k_cache[...] = keys
        self.v_cache[...] = values
        return jax.nn.softmax(keys @ q) @ values


class KVDecoder(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.layers = nnx.List([KVLayer(rngs) for _ in range(KV_LAYERS)])

    def __call__(self, x: jax.Array, pos: jax.Array) -> jax.Array:
        for layer in self.layers:
            x = layer(x, pos)
        return x


def kv_step(model: KVDecoder, x: jax.Array, pos: jax.Array) -> jax.Array:
    return model(x, pos)


class WideMLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.layers = nnx.List([nnx.Linear(WIDE, WIDE, rngs=rngs) for _ in range(WIDE_DEPTH)])

    def __call__(self, x):
        for layer in self.layers:
            x = jnp.tanh(layer(x))
        return x


def live_bytes() -> int:
    """Bytes of every live (not deleted) array, after a full collection."""
    gc.collect()
    return sum(a.nbytes for a in jax.live_arrays() if not a.is_deleted())


def _state_bytes(*trees: Any) -> int:
    return sum(a.nbytes for a in jax.tree.leaves(nnx.state(trees)))


def _decode_live(peer: str, x: jax.Array, pos: jax.Array) -> tuple[int, int]:
    """``(live bytes over the baseline after the steps, the model's own bytes)``."""
    model = KVDecoder(nnx.Rngs(0))
    own = _state_bytes(model)
    if peer == "floor":
        graphdef, params, caches = nnx.split(model, nnx.Param, nnx.Cache)
        p_leaves, p_def = jax.tree.flatten(params)
        c_leaves, c_def = jax.tree.flatten(caches)
        del model, params, caches

        @jax.jit
        def flat(p, c, x, pos):
            m = nnx.merge(graphdef, jax.tree.unflatten(p_def, p), jax.tree.unflatten(c_def, c))
            y = m(x, pos)
            return y, tuple(jax.tree.leaves(nnx.state(m, nnx.Cache)))

        p, c = tuple(p_leaves), tuple(c_leaves)
        del p_leaves, c_leaves
        for _ in range(LIVE_STEPS):
            y, c = flat(p, c, x, pos)
            del y
        return live_bytes(), own
    f = {
        "treemode.jit": lambda: treemode.jit(kv_step),
        "nnx.jit (graph)": lambda: nnx.jit(kv_step, graph=True),
        "nnx.jit(graph=False)": lambda: nnx.jit(kv_step, graph=False),
    }[peer]()
    for _ in range(LIVE_STEPS):
        y = f(model, x, pos)
        del y
    return live_bytes(), own


def _train_live(peer: str, x: jax.Array, make: Callable[[], Any], which: str) -> tuple[int, int]:
    """The train or LoRA step (``which``): live bytes over the baseline, own bytes."""
    import loops
    from _models import tx

    model = make()
    wrt = nnx.LoRAParam if which == "lora" else nnx.Param
    if peer == "floor":
        if which == "lora":
            trained = tuple(
                v.get_raw_value() for layer in model.layers for v in (layer.lora_a, layer.lora_b)
            )
            frozen = tuple(
                v.get_raw_value() for layer in model.layers for v in (layer.bias, layer.kernel)
            )
            step, opt = loops._flat_adam_step(loops._lora_flat_forward, donate=())
        else:
            trained, frozen = raw_arrays(model), ()
            step, opt = loops._flat_adam_step(lambda p, _, x: mlp_flat_forward(p, x), donate=())
        del model
        state = (opt.init(trained), jnp.zeros((), jnp.uint32))
        own = sum(a.nbytes for a in jax.tree.leaves((trained, frozen, state)))
        for _ in range(LIVE_STEPS):
            value, trained, state = step(trained, frozen, state, x)
            del value
        return live_bytes(), own
    optimizer = nnx.Optimizer(model, tx(), wrt=wrt)
    own = _state_bytes(model, optimizer)
    if which == "lora":
        fns = {
            "treemode.jit": lambda: treemode.jit(loops.lora_step),
            "nnx.jit (graph)": lambda: nnx.jit(loops._nnx_lora_step, graph=True),
            "nnx.jit(graph=False)": lambda: nnx.jit(loops._nnx_tree_lora_step, graph=False),
        }
    else:
        fns = {
            "treemode.jit": lambda: treemode.jit(train_step),
            "nnx.jit (graph)": lambda: nnx.jit(loops._nnx_train_step, graph=True),
            "nnx.jit(graph=False)": lambda: nnx.jit(loops._nnx_tree_train_step, graph=False),
        }
    f = fns[peer]()
    for _ in range(LIVE_STEPS):
        value = f(model, optimizer, x)
        del value
    return live_bytes(), own


def _live_cases() -> dict[str, Callable[[str], tuple[int, int]]]:
    import loops

    kv_x = jnp.linspace(-1.0, 1.0, KV_WIDTH)
    kv_pos = jnp.asarray(1, jnp.int32)
    wide_x = jnp.ones((BATCH, WIDE))
    lora_x = jnp.ones((BATCH, WIDTH))
    return {
        f"decode step, {KV_LAYERS} layers (4 MiB of KV cache written, 1 MiB of weights)": (
            lambda peer: _decode_live(peer, kv_x, kv_pos)
        ),
        f"train step, {WIDE_DEPTH}-layer MLP of width {WIDE} (Adam; 1 MiB of Params)": (
            lambda peer: _train_live(peer, wide_x, lambda: WideMLP(nnx.Rngs(0)), "train")
        ),
        f"LoRA step, {loops.LORA_LAYERS} layers (Adam over the adapters)": (
            lambda peer: _train_live(
                peer, lora_x, lambda: loops.LoRAModel(loops.LORA_LAYERS, nnx.Rngs(0)), "lora"
            )
        ),
    }


def measure_live(peers: list[str]) -> dict[str, dict[str, dict[str, int]]]:
    """Per case and peer: ``live`` (bytes alive after the steps, over the baseline),
    ``own`` (the state's own bytes) and ``left`` (alive once everything is dropped)."""
    out: dict[str, dict[str, dict[str, int]]] = {}
    for label, case in _live_cases().items():
        out[label] = {}
        for peer in peers:
            base = live_bytes()
            live, own = case(peer)
            out[label][peer] = {"live": live - base, "own": own, "left": live_bytes() - base}
    return out


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def run_live(config: Config) -> list[Table]:
    data = measure_live(LIVE_PEERS)  # deterministic: one measurement each
    peers = list(LIVE_PEERS)
    if _compiled.ENABLED:
        print("  measuring the pure-Python path (TREEMODE_NO_EXTENSION=1)", flush=True)
        python = without_extension(__file__, config)
        for label, row in data.items():
            row[LIVE_PYTHON_PEER] = python[label]["treemode.jit"]
        peers.append(LIVE_PYTHON_PEER)
    rows = []
    for label, row in data.items():
        cells = [_mib(row["floor"]["own"])]
        for peer in peers:
            cells.append(_mib(row[peer]["live"]))
        nnx_live = row["nnx.jit (graph)"]["live"]
        ratio = row["treemode.jit"]["live"] / nnx_live
        cells.append(f"{ratio:.2f}× ({row['treemode.jit']['live'] - nnx_live:+,} bytes)")
        cells.append(", ".join(f"{row[p]['left']:,}" for p in peers))
        rows.append((label, cells))
    return [
        Table(
            key="live_memory",
            title=f"Live bytes after {LIVE_STEPS} undonated steps (`jax.live_arrays()`)",
            columns=[
                "state's own bytes",
                *peers,
                "treemode.jit / nnx.jit (graph)",
                "bytes left once dropped (" + ", ".join(peers) + ")",
            ],
            rows=rows,
            note=(
                "Bytes of every live array after `gc.collect()`, over the bytes alive before "
                "the model was built, with the model, optimizer and wrapper still alive (the "
                "steps' outputs dropped). The floor holds only its state (the flat arrays it "
                "carries from step to step); a wrapper that pins nothing holds the same. The "
                "last column: bytes still alive once model, optimizer and wrapper are "
                "dropped. The (no C) column runs in a subprocess with "
                "TREEMODE_NO_EXTENSION=1."
            ),
            data={"live": data},
        )
    ]


def _python_path_main(out: str) -> None:
    assert not _compiled.ENABLED, f"run with {_compiled.ENV_VAR}=1"
    Path(out).write_text(json.dumps(measure_live(["treemode.jit"])))


def main() -> None:
    if sys.argv[1:2] == ["--python-path"]:
        _python_path_main(sys.argv[3])
        return
    args, tables = case_main(
        __doc__,
        lambda config: run_live(config) if "--live" in sys.argv else run(config),
        lambda parser: (
            parser.add_argument(
                "--check", action="store_true", help="exit 1 unless every ratio is 1.0"
            ),
            parser.add_argument(
                "--live", action="store_true", help="live bytes after undonated steps instead"
            ),
        ),
    )
    if args.check and not args.live and tables[0].data["failures"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
