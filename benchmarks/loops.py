"""Case 8: the calls real loops make, donated, every peer side by side.

The dispatch and decode cases call without donation. Training and decoding
loops donate: the model and optimizer of a train step, the KV caches of a
decode step. Here every case donates, and the floor is the hand-written
``jax.jit`` over flat tuples of the same arrays that **donates exactly what it
writes** (the caches, the parameters and optimizer state it updates) and passes
what it only reads (a decode step's weights, a LoRA step's frozen base)
undonated:

- **donated decode step** (the decode case's model: 10 Variables a layer, both
  caches of every layer written, tiny arrays) at 8, 100 and 400 layers (80,
  1,000 and 4,000 Variables): ``treemode.jit(step, donate_argnums=0)``;
- **donated train step**: an MLP of 2 and 64 layers and its
  ``nnx.Optimizer(adam)``, ``donate_argnums=(0, 1)``;
- **LoRA step**: 100 layers, each a frozen kernel and bias and two trained
  ``nnx.LoRAParam`` (400 Variables, 200 trained), ``treemode.value_and_grad(loss,
  wrt=nnx.LoRAParam)`` and ``nnx.Optimizer(wrt=nnx.LoRAParam)``,
  both donated (the floor donates the adapters and their optimizer state, and
  passes the frozen base undonated);
- **the train step through ``nnx.cached_partial``** (2 layers), as google/tunix's
  trainers call it: ``functools.partial(nnx.cached_partial(wrapper, model,
  optimizer))(x)`` for ``treemode.jit`` and ``nnx.jit`` (graph mode);
  ``nnx.jit(graph=False)``, which Flax refuses there, is called directly;
- **two models in turn through one wrapper** (a model and its EMA copy, a
  teacher and a student): each sample calls the same wrapper on two MLPs of 2
  or 64 layers, one after the other; the floor calls one ``jax.jit`` on the
  two flat tuples;
- **a wrapper made inline**: ``treemode.jit(step)(model, x)`` written inside the
  loop, against ``jax.jit(step_flat)(arrays, x)`` written the same way.

Peers: ``floor``, ``treemode.jit``, Flax ``nnx.jit`` (graph mode) and
``nnx.jit(graph=False)`` with the same donation, and ``treemode.jit`` without
the compiled extension (a subprocess with ``TREEMODE_NO_EXTENSION=1``, as a
ratio to that process's own floor). Every peer's results are checked against
the floor's after the warm-up.

A last table counts the outputs of each compiled donated program: treemode's
must be the floor's (a read-only Variable of a donated argument is not an
output).

Run: ``make bench`` (whole suite) or ``python benchmarks/loops.py [--quick]``.
``--device gpu`` runs on the accelerator (see ``benchmarks/gpu.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import decode
import jax
import jax.numpy as jnp
import numpy as np
import optax
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
from _models import BATCH, MLP, WIDTH, loss_of, mlp_flat_forward, raw_arrays, train_step, tx
from flax import nnx

import treemode
from treemode._accel import _compiled

PEERS = ["floor", "treemode.jit", "nnx.jit (graph)", "nnx.jit(graph=False)"]
PYTHON_PEER = "treemode.jit (no C)"
LORA_LAYERS = 100
LORA_RANK = 2

Peers = dict[str, Callable[[], Any]]
Check = Callable[[Peers], None]


# -- donated decode step ---------------------------------------------------------------


def decode_peers(layers: int, names: list[str]) -> Peers:
    """The decode case's step, donated: the floor donates the caches only."""
    graphdef, params, caches = nnx.split(decode.Decoder(layers, nnx.Rngs(0)), nnx.Param, nnx.Cache)
    p_leaves, p_def = jax.tree.flatten(params)
    c_leaves, c_def = jax.tree.flatten(caches)
    x, pos = decode._inputs()

    @jax.jit
    def _floor(p, c, x, pos):
        model = nnx.merge(graphdef, jax.tree.unflatten(p_def, p), jax.tree.unflatten(c_def, c))
        y = model(x, pos)
        return y, tuple(jax.tree.leaves(nnx.state(model, nnx.Cache)))

    floor_step = jax.jit(_floor.__wrapped__, donate_argnums=1)  # pyright: ignore
    state = {"c": tuple(c_leaves)}

    def floor():
        y, state["c"] = floor_step(tuple(p_leaves), state["c"], x, pos)
        return y

    peers: Peers = {"floor": floor}
    models: dict[str, Any] = {}
    wrappers = {
        "treemode.jit": lambda: treemode.jit(decode.decode_step, donate_argnums=0),
        "nnx.jit (graph)": lambda: nnx.jit(decode.decode_step, graph=True, donate_argnums=0),
        "nnx.jit(graph=False)": lambda: nnx.jit(decode.decode_step, graph=False, donate_argnums=0),
    }
    for name in names:
        if name == "floor":
            continue
        f, m = wrappers[name](), decode.Decoder(layers, nnx.Rngs(0))
        models[name] = m
        peers[name] = lambda f=f, m=m: f(m, x, pos)
    expected_y = np.asarray(floor())
    expected = [np.asarray(c) for c in state["c"]]
    for name, m in models.items():
        np.testing.assert_allclose(np.asarray(peers[name]()), expected_y, rtol=1e-5, atol=1e-6)
        for got, want in zip(decode._caches(m), expected, strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=name)
    return {name: peers[name] for name in names}


# -- donated train step ------------------------------------------------------------------


def _nnx_train_step(m, opt, x):
    value, grads = nnx.value_and_grad(loss_of)(m, x)
    opt.update(m, grads)
    return value


def _nnx_tree_train_step(m, opt, x):
    value, grads = nnx.value_and_grad(loss_of, graph=False)(m, x)
    opt.update(m, grads)
    return value


def _flat_adam_step(forward: Callable[..., Any], donate: tuple[int, ...]) -> Any:
    """``step(trained, frozen, opt_state, x) -> (loss, trained, opt_state)``, jitted,
    donating ``donate``: Adam over ``trained``, ``frozen`` passed through the forward."""
    opt = tx()

    def step(trained, frozen, opt_state, x):
        def loss(trained):
            return jnp.mean(forward(trained, frozen, x) ** 2)

        value, grads = jax.value_and_grad(loss)(trained)
        state, count = opt_state
        updates, state = opt.update(grads, state, trained)
        return value, optax.apply_updates(trained, updates), (state, count + 1)

    return jax.jit(step, donate_argnums=donate), opt


def _check_values(peers: Peers, names: list[str]) -> None:
    expected = np.asarray(peers["floor"]())
    for name in names:
        if name != "floor":
            got = np.asarray(peers[name]())
            np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-6, err_msg=name)


def train_peers(depth: int, names: list[str], cached_partial: bool = False) -> Peers:
    """Model and optimizer donated; the floor donates the parameters and Adam's state.

    ``cached_partial``: the graph-mode peers are called as google/tunix's trainers
    call their step, ``functools.partial(nnx.cached_partial(wrapper, model, opt))(x)``
    (``nnx.jit(graph=False)``, which Flax refuses there, is called directly)."""
    x = jnp.ones((BATCH, WIDTH))
    step, opt = _flat_adam_step(lambda p, _, x: mlp_flat_forward(p, x), donate=(0, 2))
    arrays = raw_arrays(MLP(depth, nnx.Rngs(0)))
    state = {"p": arrays, "o": (opt.init(arrays), jnp.zeros((), jnp.uint32))}

    def floor():
        value, state["p"], state["o"] = step(state["p"], (), state["o"], x)
        return value

    peers: Peers = {"floor": floor}
    wrappers = {
        "treemode.jit": lambda: treemode.jit(train_step, donate_argnums=(0, 1)),
        "nnx.jit (graph)": lambda: nnx.jit(_nnx_train_step, graph=True, donate_argnums=(0, 1)),
        "nnx.jit(graph=False)": lambda: nnx.jit(
            _nnx_tree_train_step, graph=False, donate_argnums=(0, 1)
        ),
    }
    for name in names:
        if name != "floor":
            m = MLP(depth, nnx.Rngs(0))
            o = nnx.Optimizer(m, tx(), wrt=nnx.Param)
            f = wrappers[name]()
            if cached_partial and name != "nnx.jit(graph=False)":
                bound = functools.partial(nnx.cached_partial(f, m, o))
                peers[name] = lambda bound=bound: bound(x)
            else:
                peers[name] = lambda f=f, m=m, o=o: f(m, o, x)
    _check_values(peers, names)
    return {name: peers[name] for name in names}


# -- LoRA step -----------------------------------------------------------------------------


class LoRALayer(nnx.Module):
    """A frozen linear layer (kernel, bias) and a trained low-rank adapter."""

    def __init__(self, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.3)
        self.kernel = nnx.Param(init(rngs.params(), (WIDTH, WIDTH)))
        self.bias = nnx.Param(jnp.zeros((WIDTH,)))
        self.lora_a = nnx.LoRAParam(init(rngs.params(), (WIDTH, LORA_RANK)))
        self.lora_b = nnx.LoRAParam(jnp.full((LORA_RANK, WIDTH), 0.01))

    def __call__(self, x):
        adapted = x @ self.kernel[...] + (x @ self.lora_a[...]) @ self.lora_b[...]
        return jnp.tanh(adapted + self.bias[...])


class LoRAModel(nnx.Module):
    def __init__(self, layers: int, rngs: nnx.Rngs):
        self.layers = nnx.List([LoRALayer(rngs) for _ in range(layers)])

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def lora_step(m: LoRAModel, opt: nnx.Optimizer, x: jax.Array) -> jax.Array:
    """treemode's LoRA step: only the adapters differentiated (``wrt=nnx.LoRAParam``:
    the frozen base is a constant of the gradient, its entries ``float0``), the
    optimizer updating the adapters."""
    value, grads = treemode.value_and_grad(loss_of, wrt=nnx.LoRAParam)(m, x)
    opt.update(m, grads)
    return value


def _nnx_lora_step(m, opt, x):
    diff = nnx.DiffState(0, nnx.LoRAParam)
    value, grads = nnx.value_and_grad(loss_of, argnums=diff)(m, x)
    opt.update(m, grads)
    return value


def _nnx_tree_lora_step(m, opt, x):
    graphdef, lora, rest = nnx.split(m, nnx.LoRAParam, ...)

    def loss(lora):
        return loss_of(nnx.merge(graphdef, lora, rest), x)

    value, grads = jax.value_and_grad(loss)(lora)
    opt.update(m, grads)
    return value


def _lora_flat_forward(trained, frozen, x):
    for i in range(len(frozen) // 2):
        bias, kernel = frozen[2 * i], frozen[2 * i + 1]
        a, b = trained[2 * i], trained[2 * i + 1]
        x = jnp.tanh(x @ kernel + (x @ a) @ b + bias)
    return x


def lora_peers(layers: int, names: list[str]) -> Peers:
    """Adapters and their Adam state donated; the frozen base passed undonated."""
    x = jnp.ones((BATCH, WIDTH))
    model = LoRAModel(layers, nnx.Rngs(0))
    trained = tuple(
        v.get_raw_value() for layer in model.layers for v in (layer.lora_a, layer.lora_b)
    )
    frozen = tuple(v.get_raw_value() for layer in model.layers for v in (layer.bias, layer.kernel))
    step, opt = _flat_adam_step(_lora_flat_forward, donate=(0, 2))
    state = {"t": trained, "o": (opt.init(trained), jnp.zeros((), jnp.uint32))}

    def floor():
        value, state["t"], state["o"] = step(state["t"], frozen, state["o"], x)
        return value

    peers: Peers = {"floor": floor}
    wrappers = {
        "treemode.jit": lambda: treemode.jit(lora_step, donate_argnums=(0, 1)),
        "nnx.jit (graph)": lambda: nnx.jit(_nnx_lora_step, graph=True, donate_argnums=(0, 1)),
        "nnx.jit(graph=False)": lambda: nnx.jit(
            _nnx_tree_lora_step, graph=False, donate_argnums=(0, 1)
        ),
    }
    for name in names:
        if name != "floor":
            m = LoRAModel(layers, nnx.Rngs(0))
            o = nnx.Optimizer(m, tx(), wrt=nnx.LoRAParam)
            f = wrappers[name]()
            peers[name] = lambda f=f, m=m, o=o: f(m, o, x)
    _check_values(peers, names)
    return {name: peers[name] for name in names}


# -- two models through one wrapper ----------------------------------------------------------


def _forward(m, x):
    return m(x)


def two_model_peers(depth: int, names: list[str]) -> Peers:
    """Each call runs the same wrapper on two models in turn (both forwards summed)."""
    x = jnp.ones((BATCH, WIDTH))
    floor_jit = jax.jit(mlp_flat_forward)
    arrays = [raw_arrays(MLP(depth, nnx.Rngs(s))) for s in (0, 1)]

    def floor():
        return floor_jit(arrays[0], x) + floor_jit(arrays[1], x)

    peers: Peers = {"floor": floor}
    wrappers = {
        "treemode.jit": lambda: treemode.jit(_forward),
        "nnx.jit (graph)": lambda: nnx.jit(_forward, graph=True),
        "nnx.jit(graph=False)": lambda: nnx.jit(_forward, graph=False),
    }
    for name in names:
        if name != "floor":
            f = wrappers[name]()
            a, b = MLP(depth, nnx.Rngs(0)), MLP(depth, nnx.Rngs(1))
            peers[name] = lambda f=f, a=a, b=b: f(a, x) + f(b, x)
    _check_values(peers, names)
    return {name: peers[name] for name in names}


# -- a wrapper made inline -------------------------------------------------------------------


def _inline_forward(m, x):
    return m(x)


def _inline_flat(arrays, x):
    return mlp_flat_forward(arrays, x)


def inline_peers(depth: int, names: list[str]) -> Peers:
    """The wrapper made inside the loop, every call (the floor: ``jax.jit`` likewise)."""
    x = jnp.ones((BATCH, WIDTH))
    arrays = raw_arrays(MLP(depth, nnx.Rngs(0)))

    def floor():
        return jax.jit(_inline_flat)(arrays, x)

    peers: Peers = {"floor": floor}
    makers = {
        "treemode.jit": lambda: treemode.jit(_inline_forward),
        "nnx.jit (graph)": lambda: nnx.jit(_inline_forward, graph=True),
        "nnx.jit(graph=False)": lambda: nnx.jit(_inline_forward, graph=False),
    }
    for name in names:
        if name != "floor":
            m = MLP(depth, nnx.Rngs(0))
            peers[name] = lambda make=makers[name], m=m: make()(m, x)
    _check_values(peers, names)
    return {name: peers[name] for name in names}


# -- the cases --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    label: str
    make: Callable[[list[str]], Peers]


def cases(config: Config) -> list[Case]:
    smoke = config.name.endswith("smoke")
    depths = (2, 4) if smoke else (2, 64)
    out = [
        Case(
            f"donated decode, {L} layers ({L * decode.VARIABLES_PER_LAYER:,} Variables)",
            lambda names, L=L: decode_peers(L, names),
        )
        for L in config.decode_layers
    ]
    out += [
        Case(f"donated train step, {d}-layer MLP", lambda names, d=d: train_peers(d, names))
        for d in depths
    ]
    out.append(
        Case(
            "donated train step through nnx.cached_partial, 2-layer MLP",
            lambda names: train_peers(2, names, cached_partial=True),
        )
    )
    lora = 2 if smoke else LORA_LAYERS
    out.append(
        Case(
            f"LoRA step, {lora} layers ({4 * lora} Variables, {2 * lora} trained)",
            lambda names: lora_peers(lora, names),
        )
    )
    out += [
        Case(f"two models in turn, {d}-layer MLP", lambda names, d=d: two_model_peers(d, names))
        for d in depths
    ]
    out.append(Case("a wrapper made inline, 2-layer MLP", lambda names: inline_peers(2, names)))
    return out


def measure_cases(config: Config, names: list[str]) -> list[tuple[str, dict[str, Timing]]]:
    rows = []
    for case in cases(config):
        rows.append((case.label, measure(case.make(names), config)))
        print(f"  measured {case.label}", flush=True)
    return rows


def python_path_timings(config: Config) -> dict[str, dict[str, list[float]]]:
    """Per case, ``{peer: [best, median]}`` of the floor and ``treemode.jit``, measured in
    a subprocess without the compiled extension."""
    return without_extension(__file__, config)


def _python_path_main(config_name: str, out: str) -> None:
    assert not _compiled.ENABLED, f"run with {_compiled.ENV_VAR}=1"
    names = ["floor", "treemode.jit"]
    rows = measure_cases(CONFIGS[config_name], names)
    data = {label: {p: [t[p].best, t[p].median] for p in names} for label, t in rows}
    Path(out).write_text(json.dumps(data))


# -- outputs of the compiled programs -----------------------------------------------------------


def _outputs(compiled: Any) -> int:
    return len(jax.tree_util.tree_leaves(compiled.out_info))


def output_counts(config: Config) -> Table:
    """Outputs of each donated program, treemode's beside the hand-written floor's."""
    rows = []
    data: dict[str, list[int]] = {}
    for layers in config.decode_layers:
        model = decode.Decoder(layers, nnx.Rngs(0))
        x, pos = decode._inputs()
        ours = treemode.jit(decode.decode_step, donate_argnums=0).lower(model, x, pos).compile()
        _, params, caches = nnx.split(model, nnx.Param, nnx.Cache)
        p, c = tuple(jax.tree.leaves(params)), tuple(jax.tree.leaves(caches))

        def flat(p, c, x, pos, model=model):
            graphdef = nnx.graphdef(model)
            _, pd, cd = nnx.split(model, nnx.Param, nnx.Cache)
            merged = nnx.merge(
                graphdef,
                jax.tree.unflatten(jax.tree.structure(pd), p),
                jax.tree.unflatten(jax.tree.structure(cd), c),
            )
            y = merged(x, pos)
            return y, tuple(jax.tree.leaves(nnx.state(merged, nnx.Cache)))

        floor = jax.jit(flat, donate_argnums=1).lower(p, c, x, pos).compile()
        label = f"donated decode, {layers * decode.VARIABLES_PER_LAYER:,} Variables"
        n_ours, n_floor = _outputs(ours), _outputs(floor)
        rows.append((label, [str(n_floor), str(n_ours), "yes" if n_ours == n_floor else "**no**"]))
        data[label] = [n_floor, n_ours]
    return Table(
        key="loops_outputs",
        title="Outputs of the compiled donated programs",
        columns=["floor", "treemode.jit", "same"],
        rows=rows,
        note="A donated argument's read-only Variables are passed undonated and are not "
        "outputs: the program returns the step's output and the written caches, as the "
        "hand-written one does (tests/test_real_loops.py checks the same at 5 layers).",
        file="loops",
        data={"outputs": data},
    )


def run(config: Config) -> list[Table]:
    rows = measure_cases(config, PEERS)
    peers = list(PEERS)
    if _compiled.ENABLED:
        print("  measuring the pure-Python path (TREEMODE_NO_EXTENSION=1)", flush=True)
        python = python_path_timings(config)
        for label, timings in rows:
            timings[PYTHON_PEER] = scaled_to_floor(timings["floor"], python[label], "treemode.jit")
        peers.append(PYTHON_PEER)
    note = (
        "Lower is better; 1.00× is the hand-written `jax.jit` over flat tuples that "
        "donates exactly what it writes. Every peer donates as the case says."
    )
    if _compiled.ENABLED:
        note += (
            " The (no C) column runs without the compiled extension, in a subprocess "
            "with TREEMODE_NO_EXTENSION=1, as a ratio to that process's floor."
        )
    tables = ratio_table("loops", "Real loops: microseconds per call", peers, "floor", rows)
    tables[0].note = note
    return [*tables, output_counts(config)]


def main() -> None:
    if sys.argv[1:2] == ["--python-path"]:
        _python_path_main(sys.argv[2], sys.argv[3])
        return
    case_main(__doc__, run)


if __name__ == "__main__":
    main()
