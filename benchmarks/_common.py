"""Shared pieces of the benchmark suite: run settings, the timer, result tables.

Timing method (see docs/performance.md): every peer of a case is timed in the
same process, interleaved round by round (the order rotates each round), in
many short samples. A sample is the mean time per call over a batch of calls
long enough to be well above the timer's resolution (``sample_ms``), blocked
on the last result. Per peer we keep the minimum over samples (the least
disturbed by other processes on a shared machine) and the median. The
dispatch case builds its peers several times over (``instances``: new models,
arrays and compiled functions each time), times them all interleaved and pools
each peer's samples, so that one instance's luck (a compiled function or a
buffer placement that is slower for as long as it lives) does not decide a
ratio.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax

RESULTS = Path(__file__).resolve().parent / "results"


@dataclasses.dataclass(frozen=True)
class Config:
    """How much work a run does; ``FULL`` for ``make bench``, ``QUICK`` for ``--quick``."""

    name: str
    repeats: int  # samples per peer (per instance, where there are several)
    sample_ms: float  # target length of one sample
    dispatch_models: tuple[str, ...]  # which models the dispatch case runs
    depths: tuple[int, ...]  # per-Variable case
    eager_repeats: int
    compile_repeats: int
    instances: int = 1  # independently built sets of peers (dispatch case)
    decode_layers: tuple[int, ...] = (8, 100, 400)  # decode-step case (10 Variables a layer)


FULL = Config(
    name="full",
    repeats=40,
    sample_ms=2.0,
    dispatch_models=("2-layer MLP", "64-layer MLP", "stateful"),
    depths=(8, 64, 256, 1024),
    eager_repeats=30,
    compile_repeats=10,
    instances=5,
)
QUICK = Config(
    name="quick",
    repeats=6,
    sample_ms=1.0,
    dispatch_models=("2-layer MLP", "64-layer MLP", "stateful"),
    depths=(8, 32, 128),
    eager_repeats=5,
    compile_repeats=3,
    decode_layers=(8, 100),
)
# Only checks that everything runs end to end (tests/test_benchmarks_smoke.py).
SMOKE = Config(
    name="smoke",
    repeats=1,
    sample_ms=0.0,
    dispatch_models=("2-layer MLP",),
    depths=(1, 2),
    eager_repeats=1,
    compile_repeats=1,
    instances=2,
    decode_layers=(1, 2),
)
CONFIGS = {c.name: c for c in (FULL, QUICK, SMOKE)}


def add_config_arguments(parser: Any) -> None:
    parser.add_argument("--quick", action="store_true", help="a fast run (under two minutes)")
    parser.add_argument("--smoke", action="store_true", help=argparse.SUPPRESS)


def config_from(args: Any) -> Config:
    if getattr(args, "smoke", False):
        return SMOKE
    return QUICK if args.quick else FULL


# -- timing --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Timing:
    """Microseconds per call of one peer: the best sample and the median sample."""

    best: float
    median: float
    samples: int


def _once(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start


def measure(
    fns: Mapping[str, Callable[[], Any]], config: Config, *, warmup: int = 3
) -> dict[str, Timing]:
    """Time every zero-argument callable of ``fns``, interleaved, in one process."""
    samples = _samples(fns, config, warmup)
    return {name: Timing(min(s), statistics.median(s), len(s)) for name, s in samples.items()}


def measure_instances(
    make: Callable[[], Mapping[str, Callable[[], Any]]], config: Config, *, warmup: int = 3
) -> dict[str, Timing]:
    """`measure` over ``config.instances`` sets of peers built by ``make()``, pooled.

    Every set is timed in the same interleaved rounds; each peer's timing is
    taken over the samples of all its instances.
    """
    sets = [make() for _ in range(config.instances)]
    fns = {(name, i): fn for i, peers in enumerate(sets) for name, fn in peers.items()}
    pooled: dict[str, list[float]] = {}
    for (name, _), s in _samples(fns, config, warmup).items():
        pooled.setdefault(name, []).extend(s)
    return {name: Timing(min(s), statistics.median(s), len(s)) for name, s in pooled.items()}


def _samples(
    fns: Mapping[Any, Callable[[], Any]], config: Config, warmup: int
) -> dict[Any, list[float]]:
    """Microseconds per call of each sample of each callable (see the module docstring)."""
    names = list(fns)
    calls = {}
    for name in names:  # compile, warm up, and size the batch of one sample
        if config.sample_ms <= 0:  # smoke run: one call per sample
            _once(fns[name])
            calls[name] = 1
            continue
        for _ in range(warmup):
            _once(fns[name])
        single = min(_once(fns[name]) for _ in range(3))
        calls[name] = max(1, min(1000, int(config.sample_ms * 1e-3 / max(single, 1e-7))))
    samples: dict[Any, list[float]] = {name: [] for name in names}
    for r in range(config.repeats):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            fn, n = fns[name], calls[name]
            start = time.perf_counter()
            for _ in range(n):
                out = fn()
            jax.block_until_ready(out)  # pyright: ignore[reportPossiblyUnbound]
            samples[name].append((time.perf_counter() - start) / n * 1e6)
    return samples


def without_extension(script: str, config: Config, *extra: str) -> dict[str, Any]:
    """What ``script --python-path CONFIG OUT [extra...]`` measured in a subprocess
    with the compiled extension off (``TREEMODE_NO_EXTENSION=1``): per case,
    ``{peer: [best, median]}``, the floor among them."""
    from treemode._accel import _compiled

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "python.json"
        env = {**os.environ, _compiled.ENV_VAR: "1"}
        cmd = [sys.executable, script, "--python-path", config.name, str(out), *extra]
        subprocess.run(cmd, env=env, check=True)
        return json.loads(out.read_text())


def scaled_to_floor(floor: Timing, measured: Mapping[str, list[float]], peer: str) -> Timing:
    """``peer``'s timing from another process (``measured``, with that process's own
    floor), as the same ratios to this process's ``floor``."""
    best, median = measured[peer]
    return Timing(
        best / measured["floor"][0] * floor.best,
        median / measured["floor"][1] * floor.median,
        floor.samples,
    )


def best_seconds(fn: Callable[[], Any], repeats: int) -> float:
    """Minimum wall time of ``fn()`` over ``repeats`` runs (for long operations)."""
    return min(_once(fn) for _ in range(max(1, repeats)))


# -- tables --------------------------------------------------------------------------


@dataclasses.dataclass
class Table:
    """One result table: printed to the console and written as Markdown.

    ``cells[i][j]`` is the text of row ``i``, column ``j``; ``data`` keeps the raw
    numbers (JSON-serialisable) for the chart and for later comparison.
    """

    key: str  # unique name in results.json
    title: str
    columns: list[str]
    rows: list[tuple[str, list[str]]]
    note: str = ""
    data: dict[str, Any] = dataclasses.field(default_factory=dict)
    file: str = ""  # Markdown file stem under results/; defaults to ``key``

    def console(self) -> str:
        header = ["case", *self.columns]
        body = [[label, *cells] for label, cells in self.rows]
        widths = [max(len(r[j]) for r in [header, *body]) for j in range(len(header))]

        def line(r: list[str]) -> str:
            cells = zip(r, widths, strict=True)
            return "  ".join(c.ljust(w) if j == 0 else c.rjust(w) for j, (c, w) in enumerate(cells))

        out = [f"== {self.title}", line(header), *map(line, body)]
        if self.note:
            out.append(self.note)
        return "\n".join(out)

    def markdown(self) -> str:
        head = "| case | " + " | ".join(map(header_cell, self.columns)) + " |\n"
        head += "|---|" + "---:|" * len(self.columns) + "\n"
        body = "".join(f"| {label} | " + " | ".join(c) + " |\n" for label, c in self.rows)
        note = f"\n{self.note}\n" if self.note else ""
        return f"#### {self.title}\n\n{head}{body}{note}"


def header_cell(text: str) -> str:
    """A column header with line-break opportunities after a dot or an opening
    parenthesis (``nnx.<wbr>jit(<wbr>graph=False)``), so that a narrow column wraps
    a peer's name between its parts, never inside a word."""
    return re.sub(r"(?<=[.(])(?=[A-Za-z_])", "<wbr>", text)


def ratio_table(
    key: str,
    title: str,
    peers: Sequence[str],
    floor: str,
    rows: Sequence[tuple[str, Mapping[str, Timing]]],
    note: str = "",
) -> list[Table]:
    """Two tables from timings: best-sample ratios to the floor, and median ratios."""
    tables = []
    for stat in ("best", "median"):
        cells = []
        for label, times in rows:
            f = getattr(times[floor], stat)
            row = []
            for p in peers:
                v = getattr(times[p], stat)
                row.append(f"{v:.0f} µs" if p == floor else f"{v / f:.2f}×")
            cells.append((label, row))
        what = "best sample" if stat == "best" else "median sample"
        tables.append(
            Table(
                key=key if stat == "best" else f"{key}_median",
                title=f"{title} ({what}; floor in µs, peers as ratio to the floor)",
                columns=list(peers),
                rows=cells,
                note=note if stat == "best" else "",
                file=key,
                data={
                    "floor": floor,
                    "stat": stat,
                    "us": {label: {p: getattr(t[p], stat) for p in peers} for label, t in rows},
                },
            )
        )
    return tables


def environment() -> str:
    import equinox
    import flax

    import treemode

    return (
        f"jax {jax.__version__}, flax {flax.__version__}, equinox {equinox.__version__}, "
        f"treemode {treemode.__version__ if hasattr(treemode, '__version__') else '(dev)'}; "
        f"Python {platform.python_version()}, {jax.devices()[0].platform.upper()}, "
        f"{_cores()} cores"
    )


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 0


def write_tables(tables: Sequence[Table], out: Path, config: Config) -> None:
    """``out/<file>.md`` per case (its tables in order) and all raw data in ``results.json``."""
    out.mkdir(parents=True, exist_ok=True)
    by_file: dict[str, list[Table]] = {}
    for t in tables:
        by_file.setdefault(t.file or t.key, []).append(t)
    for stem, group in by_file.items():
        (out / f"{stem}.md").write_text("\n".join(t.markdown() for t in group))
    data_file = out / "results.json"
    data = json.loads(data_file.read_text()) if data_file.exists() else {}
    data["_run"] = {
        "config": config.name,
        "environment": environment(),
        "date": time.strftime("%Y-%m-%d"),
    }
    for t in tables:
        data[t.key] = {"title": t.title, "columns": t.columns, "rows": t.rows, **t.data}
    data_file.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")


def print_tables(tables: Sequence[Table]) -> None:
    for t in tables:
        print(t.console(), end="\n\n", flush=True)


# -- command line ----------------------------------------------------------------------


def case_main(
    doc: str | None,
    run: Callable[[Config], Sequence[Table]],
    add_arguments: Callable[[argparse.ArgumentParser], object] | None = None,
) -> tuple[argparse.Namespace, Sequence[Table]]:
    """The command line of one case script: ``[--quick] [--out DIR]``.

    Runs ``run`` with the chosen configuration, prints its tables and writes them
    under ``--out`` (``benchmarks/results`` by default). ``add_arguments`` adds a
    script's own options; the parsed arguments and the tables are returned.
    """
    parser = argparse.ArgumentParser(description=(doc or "").split("\n")[0])
    add_config_arguments(parser)
    parser.add_argument("--out", type=Path, default=RESULTS)
    if add_arguments is not None:
        add_arguments(parser)
    args = parser.parse_args()
    config = config_from(args)
    tables = run(config)
    print_tables(tables)
    write_tables(tables, args.out, config)
    return args, tables
