"""Case 10: what a cold call and a retrace cost, in fresh processes.

Time to first step: the wall time of the first call of a donated step in a
fresh Python process (imports done, model and arrays built, nothing traced or
compiled yet), waited for; then the retrace: the first call with a new input
signature (a new batch size; for the decode step, the input token in bfloat16),
in the same process. Cases (the real-loops case's steps, donated as there, and
their floors, which donate exactly what they write):

- the donated decode step at 100 layers (1,000 Variables);
- the donated train step of a 64-layer MLP with Adam (``nnx.Optimizer``);
- the LoRA step (100 layers, 200 ``nnx.LoRAParam`` trained).

Peers: ``floor`` (``jax.jit`` on flat tuples), ``treemode.jit`` and
``treemode.jit (no C)`` (``TREEMODE_NO_EXTENSION=1``). Every measurement is its
own subprocess, run with XLA at -O0 for all peers
(``XLA_FLAGS=--xla_backend_optimization_level=0``) and JAX's persistent
compilation cache off, so that the time is tracing, lowering and treemode's
own work more than XLA's optimiser; the peers alternate, rotating, for 5
rounds (3 with ``--quick``) and each cell is the median (the spread is the
range over rounds). A counter in JAX (its ``test_event`` hook) counts, per
call, the top-level traces (a ``jit`` traced outside any other trace), the
nested ones (a ``jit`` traced inside another's trace), the lowerings and
the XLA compilations; a counter in the step counts how often Python ran it.

Run: ``python benchmarks/cold.py [--quick]`` or ``python benchmarks/run.py --only cold``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _common import RESULTS, Config, Table, case_main

PEERS = ["floor", "treemode.jit", "treemode.jit (no C)"]
XLA_O0 = "--xla_backend_optimization_level=0"
COUNTS: tuple[str, ...] = (
    "top-level traces",
    "nested traces",
    "lowerings",
    "compilations",
    "Python runs",
)


def _sizes(config_name: str) -> dict[str, int]:
    if config_name == "smoke":
        return {"decode": 2, "train": 4, "lora": 2}
    return {"decode": 100, "train": 64, "lora": 100}


def labels(config_name: str) -> dict[str, str]:
    n = _sizes(config_name)
    return {
        "decode": f"donated decode, {n['decode']} layers ({10 * n['decode']:,} Variables)",
        "train": f"donated train step, {n['train']}-layer MLP (Adam)",
        "lora": f"LoRA step, {n['lora']} layers ({2 * n['lora']} trained)",
    }


def _rounds(config: Config) -> int:
    return {"smoke": 1, "quick": 3}.get(config.name, 5)


# -- the child process: one peer, one case ----------------------------------------------


class _Counter:
    """Counts JAX's test events (traces, lowerings, compilations) while installed."""

    def __init__(self) -> None:
        from jax._src import core, util

        self.counts: dict[str, int] = dict.fromkeys(COUNTS, 0)
        self._core, self._util = core, util
        self._previous = util.test_event_listener
        util.test_event_listener = self._event

    def _event(self, name: str, *args: Any) -> None:
        if name == "trace_to_jaxpr":
            top = isinstance(self._core.trace_ctx.trace, self._core.EvalTrace)
            self.counts["top-level traces" if top else "nested traces"] += 1
        elif name == "lower_jaxpr_to_module":
            self.counts["lowerings"] += 1
        elif name == "pxla_cached_compilation":
            self.counts["compilations"] += 1
        if self._previous is not None:
            self._previous(name, *args)

    def take(self) -> dict[str, int]:
        out, self.counts = self.counts, dict.fromkeys(COUNTS, 0)
        return out


def _counted(fn: Callable[..., Any], runs: list[int]) -> Callable[..., Any]:
    import functools

    @functools.wraps(fn)
    def counted(*args: Any) -> Any:
        runs[0] += 1
        return fn(*args)

    return counted


def _child_calls(case: str, peer: str, size: int, runs: list[int]) -> tuple[Any, Any]:
    """``(first, retrace)``: zero-argument callables for the first call and for the
    first call with a new signature."""
    import decode
    import jax
    import jax.numpy as jnp
    import loops
    from _models import BATCH, MLP, WIDTH, mlp_flat_forward, raw_arrays, train_step, tx
    from flax import nnx

    import treemode

    if case == "decode":
        x, pos = decode._inputs()
        x16 = x.astype(jnp.bfloat16)
        if peer == "floor":
            graphdef, params, caches = nnx.split(
                decode.Decoder(size, nnx.Rngs(0)), nnx.Param, nnx.Cache
            )
            p_leaves, p_def = jax.tree.flatten(params)
            c_leaves, c_def = jax.tree.flatten(caches)

            def flat(p, c, x, pos):
                model = nnx.merge(
                    graphdef, jax.tree.unflatten(p_def, p), jax.tree.unflatten(c_def, c)
                )
                y = model(x, pos)
                return y, tuple(jax.tree.leaves(nnx.state(model, nnx.Cache)))

            step = jax.jit(_counted(flat, runs), donate_argnums=1)
            state = {"p": tuple(p_leaves), "c": tuple(c_leaves)}

            def call(x):
                y, state["c"] = step(state["p"], state["c"], x, pos)
                return y

            return (lambda: call(x)), (lambda: call(x16))
        model = decode.Decoder(size, nnx.Rngs(0))
        f = treemode.jit(_counted(decode.decode_step, runs), donate_argnums=0)
        return (lambda: f(model, x, pos)), (lambda: f(model, x16, pos))

    x, x2 = jnp.ones((BATCH, WIDTH)), jnp.ones((2 * BATCH, WIDTH))
    if peer == "floor":
        if case == "train":
            trained, frozen = raw_arrays(MLP(size, nnx.Rngs(0))), ()
            forward = lambda p, _, x: mlp_flat_forward(p, x)  # noqa: E731
        else:
            m = loops.LoRAModel(size, nnx.Rngs(0))
            trained = tuple(v.get_raw_value() for ly in m.layers for v in (ly.lora_a, ly.lora_b))
            frozen = tuple(v.get_raw_value() for ly in m.layers for v in (ly.bias, ly.kernel))
            forward = loops._lora_flat_forward
        _, opt = loops._flat_adam_step(forward, donate=(0, 2))
        # The same step as loops._flat_adam_step, its Python runs counted.
        import optax

        def flat_step(trained, frozen, opt_state, x):
            def loss(trained):
                return jnp.mean(forward(trained, frozen, x) ** 2)

            value, grads = jax.value_and_grad(loss)(trained)
            s, count = opt_state
            updates, s = opt.update(grads, s, trained)
            return value, optax.apply_updates(trained, updates), (s, count + 1)

        step = jax.jit(_counted(flat_step, runs), donate_argnums=(0, 2))
        state = {"t": trained, "o": (opt.init(trained), jnp.zeros((), jnp.uint32))}

        def call(x):
            value, state["t"], state["o"] = step(state["t"], frozen, state["o"], x)
            return value

        return (lambda: call(x)), (lambda: call(x2))
    if case == "train":
        model = MLP(size, nnx.Rngs(0))
        opt_ = nnx.Optimizer(model, tx(), wrt=nnx.Param)
        fn = train_step
    else:
        model = loops.LoRAModel(size, nnx.Rngs(0))
        opt_ = nnx.Optimizer(model, tx(), wrt=nnx.LoRAParam)
        fn = loops.lora_step
    f = treemode.jit(_counted(fn, runs), donate_argnums=(0, 1))
    return (lambda: f(model, opt_, x)), (lambda: f(model, opt_, x2))


def _child_main(case: str, peer: str, size: int, out: str) -> None:
    import jax

    from treemode._accel import _compiled

    assert _compiled.ENABLED == (peer == "treemode.jit") or peer == "floor", peer
    runs = [0]
    first, retrace = _child_calls(case, peer, size, runs)
    counter = _Counter()
    result: dict[str, Any] = {}
    for what, call in (("first", first), ("retrace", retrace)):
        runs[0] = 0
        start = time.perf_counter()
        jax.block_until_ready(call())
        result[what] = {"s": time.perf_counter() - start, **counter.take(), "Python runs": runs[0]}
    Path(out).write_text(json.dumps(result))


# -- the parent: fresh processes, rounds, medians ----------------------------------------


def _child_env(peer: str) -> dict[str, str]:
    from treemode._accel import _compiled

    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + XLA_O0).strip()
    env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
    env.pop(_compiled.ENV_VAR, None)
    if peer == "treemode.jit (no C)":
        env[_compiled.ENV_VAR] = "1"
    return env


def _one(case: str, peer: str, size: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "cold.json"
        cmd = [sys.executable, __file__, "--child", case, peer, str(size), str(out)]
        subprocess.run(cmd, env=_child_env(peer), check=True)
        return json.loads(out.read_text())


def measure_cold(config: Config, peers: list[str]) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """Per case and peer, the results of every round (one fresh process each)."""
    sizes = _sizes(config.name)
    results: dict[str, dict[str, list[dict[str, Any]]]] = {c: {p: [] for p in peers} for c in sizes}
    for r in range(_rounds(config)):
        for case, size in sizes.items():
            k = r % len(peers)
            for peer in peers[k:] + peers[:k]:
                results[case][peer].append(_one(case, peer, size))
            print(f"  round {r + 1}: {case}", flush=True)
    return results


def _usable_peers() -> list[str]:
    from treemode._accel import _compiled

    return PEERS if _compiled.ENABLED else [p for p in PEERS if p != "treemode.jit"]


def run(config: Config) -> list[Table]:
    peers = _usable_peers()
    results = measure_cold(config, peers)
    names = labels(config.name)
    data: dict[str, Any] = {}
    for case, per_peer in results.items():
        for what in ("first", "retrace"):
            data.setdefault(names[case], {})[what] = {
                "ms": {p: [run[what]["s"] * 1e3 for run in per_peer[p]] for p in peers},
                "counts": {p: per_peer[p][-1][what] for p in peers},
            }
    return cold_tables(data, peers, _rounds(config))


def paired_ratio(ms: dict[str, list[float]], peer: str) -> float:
    """The median over rounds of ``peer``'s time over the floor's in the same round."""
    return statistics.median(a / b for a, b in zip(ms[peer], ms["floor"], strict=True))


def cold_tables(data: dict[str, Any], peers: list[str], rounds: int) -> list[Table]:
    """The two tables (first step, retrace) from per-case, per-call raw data: ``ms``
    (per peer, one time per round, rounds in order) and ``counts`` (per peer)."""
    tables = []
    for what, title in (("first", "Time to first step"), ("retrace", "Retrace")):
        rows = []
        for label, per_call in data.items():
            ms, counts = per_call[what]["ms"], per_call[what]["counts"]
            med = {p: statistics.median(v) for p, v in ms.items()}
            per_call[what]["median_ms"] = med
            per_call[what]["paired"] = {p: paired_ratio(ms, p) for p in peers if p != "floor"}
            cells = []
            for p in peers:
                spread = f"{min(ms[p]):.0f}–{max(ms[p]):.0f} ms"
                if p == "floor":
                    cells.append(f"{med[p]:.0f} ms ({spread})")
                else:
                    ratio, paired = med[p] / med["floor"], per_call[what]["paired"][p]
                    cells.append(f"{ratio:.2f}× (paired {paired:.2f}×; {spread})")
            cells.append(
                "; ".join(f"{p}: " + "/".join(str(counts[p][c]) for c in COUNTS) for p in peers)
            )
            rows.append((label, cells))
        tables.append(
            Table(
                key=f"cold_{what}",
                title=f"{title} in a fresh process, XLA at -O0 (median of "
                f"{rounds} processes; floor in ms, peers as ratio to the floor)",
                columns=[
                    *peers,
                    "traces top-level/nested, lowerings, compilations, Python runs",
                ],
                rows=rows,
                file="cold",
                note=""
                if what == "retrace"
                else (
                    "Each cell: the ratio of the peer's median to the floor's median over "
                    "fresh processes (one per measurement, the peers rotating round by "
                    "round); in parentheses the median of the per-round ratios (the peer "
                    "and the floor of the same round, which saw the same load) and the "
                    "range. On a shared 2-core machine one process can take twice another's "
                    "time: read differences under about 20% as noise. Time to first step: "
                    "the first call of the donated step, waited for (model and arrays built "
                    "before). Retrace: then the first call with a new input signature (a "
                    "doubled batch; for the decode step, the token in bfloat16). Every "
                    f"process runs with `XLA_FLAGS={XLA_O0}` and "
                    "`JAX_ENABLE_COMPILATION_CACHE=false`. The counts are JAX's (its "
                    "test-event hook) during that call: traces of a `jit` outside any other "
                    "trace / inside one, lowerings to MLIR, XLA compilations; then how "
                    "often the step's Python body ran."
                ),
                data={"cold": data} if what == "first" else {},
            )
        )
    return tables


def render(out: Path) -> None:
    """Rewrite the tables from the raw data of the last run in ``out/results.json``."""
    from _common import CONFIGS, print_tables, write_tables

    saved = json.loads((out / "results.json").read_text())
    data = saved["cold_first"]["cold"]
    peers = list(next(iter(data.values()))["first"]["ms"])
    rounds = len(next(iter(data.values()))["first"]["ms"]["floor"])
    tables = cold_tables(data, peers, rounds)
    print_tables(tables)
    write_tables(tables, out, CONFIGS[saved["_run"]["config"]])


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        case, peer, size, out = sys.argv[2:6]
        _child_main(case, peer, int(size), out)
        return
    if sys.argv[1:2] == ["--render"]:  # the tables again, from the saved raw data
        render(Path(sys.argv[2]) if len(sys.argv) > 2 else RESULTS)
        return
    case_main(__doc__, run)


if __name__ == "__main__":
    main()
