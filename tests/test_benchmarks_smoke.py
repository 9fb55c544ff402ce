"""The benchmark suite runs end to end (smoke mode: one sample per peer, tiny models).

No timing is asserted: the numbers of a smoke run mean nothing. What is
checked is what a user of ``make bench`` relies on: every case prints its
tables with every peer, writes them as Markdown and JSON, and the docs page's
generated section is rewritten between its markers (on a copy of the page).
Each case runs in its own process, the way ``python benchmarks/run.py`` does.
The PNG charts need matplotlib (the ``bench`` extra) and are not drawn here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
PAGE = ROOT / "docs" / "performance.md"

pytestmark = pytest.mark.bench

# case -> (results file stem, strings its printed tables must contain)
CASES = {
    "dispatch": (
        "dispatch",
        [
            "floor",
            "treemode.jit",
            "treemode.jit_partial",
            "nnx.jit (graph)",
            "nnx.jit(graph=False)",
            "nnx.jit_partial",
            "eqx.filter_jit",
            "2-layer MLP, forward",
            "2-layer MLP, train step",
            "Asynchronous dispatch",
        ],
    ),
    "per_variable": ("per_variable", ["µs / Variable (slope)", "R² of the line"]),
    "cached_partial": (
        "cached_partial",
        ["Through nnx.cached_partial", "Flax's context + treemode.jit", "cached_partial(nnx.jit)"],
    ),
    "eager": ("eager", ["vmap (eager)", "scan (eager)", "grad (eager)", "nnx (graph=False)"]),
    "memory": ("memory", ["donated train step", "exactly 1.0"]),
    "compilation": ("compilation", ["Trace count", "Compile time"]),
    "stages": (
        "stages",
        ["match arguments", "JAX dispatch", "closure", "write back", "whole call"],
    ),
    "decode": (
        "decode",
        [
            "Decode step: microseconds per call",
            "floor",
            "treemode.jit",
            "nnx.jit (graph)",
            "nnx.jit(graph=False)",
            "1 layer (10 Variables)",
            "2 layers (20 Variables)",
            "marginal nanoseconds per Variable",
        ],
    ),
    "loops": (
        "loops",
        [
            "Real loops: microseconds per call",
            "donated decode, 1 layers (10 Variables)",
            "donated train step, 4-layer MLP",
            "LoRA step",
            "two models in turn, 2-layer MLP",
            "a wrapper made inline",
            "Outputs of the compiled donated programs",
        ],
    ),
    "live_memory": ("live_memory", ["Live bytes after", "decode step", "train step", "LoRA step"]),
    "write_sets": (
        "write_sets",
        ["Two write sets in turn", "floor", "treemode.jit", "two write sets in turn"],
    ),
    "cold": (
        "cold",
        ["Time to first step", "Retrace", "donated decode", "donated train step", "LoRA step"],
    ),
}


def _run_suite(tmp_path: Path, *args: str) -> str:
    page = tmp_path / "performance.md"
    page.write_text(PAGE.read_text())
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run(
        [sys.executable, str(BENCH / "run.py"), "--smoke", "--no-chart"]
        + ["--out", str(tmp_path / "results"), "--page", str(page), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def _check_case(tmp_path: Path, case: str) -> dict:
    """Run one case; check its printed tables, result files and the rewritten page."""
    stem, expected = CASES[case]
    out = _run_suite(tmp_path, "--only", case)
    for text in expected:
        assert text in out, f"{text!r} missing from the printed tables of {case}"

    md = (tmp_path / "results" / f"{stem}.md").read_text()
    assert md.startswith("#### ") and "|---|" in md
    data = json.loads((tmp_path / "results" / "results.json").read_text())
    assert data["_run"]["config"] == "smoke"
    assert (tmp_path / "results" / "targets.md").exists()

    page = (tmp_path / "performance.md").read_text()
    section = page.split("<!-- results:begin -->")[1].split("<!-- results:end -->")[0]
    assert md.strip() in section  # the case's tables are embedded in the page
    # The hand-written part of the page is kept.
    assert (
        page.split("<!-- results:begin -->")[0]
        == PAGE.read_text().split("<!-- results:begin -->")[0]
    )
    return data


# The memory, decode and loops cases run (once each, with every check of
# `_check_case`) in their own tests below, which check more of them.
@pytest.mark.parametrize("case", [c for c in CASES if c not in ("memory", "decode", "loops")])
def test_case_runs_end_to_end(tmp_path: Path, case: str) -> None:
    _check_case(tmp_path, case)


def test_memory_case_and_ratio_is_one(tmp_path: Path) -> None:
    """The one exact claim of the suite: treemode compiles to the hand-written memory."""
    data = _check_case(tmp_path, "memory")
    assert data["memory"]["failures"] == []
    for row in data["memory"]["memory"].values():
        assert row["treemode"] == row["hand"]


def test_decode_case_has_every_column(tmp_path: Path) -> None:
    """The decode case (smoke): every peer, the no-extension column when the extension
    is on, and a marginal cost per Variable for every peer."""
    data = _check_case(tmp_path, "decode")
    from treemode._accel import _compiled

    peers = data["decode"]["columns"]
    assert peers[:4] == ["floor", "treemode.jit", "nnx.jit (graph)", "nnx.jit(graph=False)"]
    assert ("treemode.jit (no C)" in peers) == _compiled.ENABLED
    marginal = data["decode_marginal"]["marginal"]
    assert marginal["nvars"] == [10, 20]
    for peer in peers:
        assert len(marginal[peer]["own_ns"]) == 1 and len(marginal[peer]["extra_ns"]) == 1


def test_loops_case_counts_the_floors_outputs(tmp_path: Path) -> None:
    """The real-loops case (smoke) runs end to end, and the donated decode programs
    have the floor's outputs."""
    data = _check_case(tmp_path, "loops")
    outputs = data["loops_outputs"]["outputs"]
    assert outputs and all(ours == floor for floor, ours in outputs.values())


def test_targets_report_a_negative_per_variable_cost_as_noise() -> None:
    """A negative cost per Variable is noise: "below noise", never "met"."""
    sys.path.insert(0, str(BENCH))
    try:
        import targets
    finally:
        sys.path.remove(str(BENCH))

    def fits(ours: float, partial: float, extra: list[float]) -> dict:
        peer = {"nvars": [16, 128, 512], "extra_us": extra}
        return {
            "per_variable": {
                "fits": {
                    "treemode.jit": {"slope_us": ours, **peer},
                    "treemode.jit_partial": {"slope_us": partial},
                    "nnx.jit (graph)": {"slope_us": 37.0},
                    "nnx.jit_partial": {"slope_us": 0.65},
                }
            }
        }

    def verdicts(data: dict) -> list[str]:
        (table,) = targets.check(data)
        return [cells[1] for _, cells in table.rows]

    noisy = verdicts(fits(-0.17, -0.46, [1.0, 3.0, -150.0]))
    assert all(v.startswith("below noise") for v in noisy), noisy
    clean = verdicts(fits(0.05, 0.02, [1.0, 6.6, 26.0]))
    assert clean == ["met", "met", "met"], clean
    slow = verdicts(fits(0.9, 0.8, [1.0, 6.6, 400.0]))
    assert slow == ["met", "**not met**", "**not met**"], slow  # ahead of graph mode only
