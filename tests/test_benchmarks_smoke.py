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
    "eager": ("eager", ["vmap (eager)", "scan (eager)", "grad (eager)", "nnx (graph=False)"]),
    "memory": ("memory", ["donated train step", "exactly 1.0"]),
    "compilation": ("compilation", ["Trace count", "Compile time"]),
    "stages": (
        "stages",
        ["match arguments", "JAX dispatch", "closure", "write back", "whole call"],
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


@pytest.mark.parametrize("case", [c for c in CASES if c != "memory"])
def test_case_runs_end_to_end(tmp_path: Path, case: str) -> None:
    _check_case(tmp_path, case)


def test_memory_case_and_ratio_is_one(tmp_path: Path) -> None:
    """The one exact claim of the suite: treemode compiles to the hand-written memory."""
    data = _check_case(tmp_path, "memory")
    assert data["memory"]["failures"] == []
    for row in data["memory"]["memory"].values():
        assert row["treemode"] == row["hand"]
