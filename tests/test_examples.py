"""Every program in ``examples/`` runs to completion.

Each example runs in its own Python process (the way a user runs it), with 8
virtual CPU devices so the data-parallel example finds its mesh, and must exit
with status 0 within the time limit. The examples print their own metrics and
``assert`` the results they advertise (the loss falls, state advances, the
sharded step matches the single-device one).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
TIMEOUT_S = 120  # each example is meant to finish in well under a minute


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    env["JAX_PLATFORMS"] = "cpu"
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def test_there_are_examples() -> None:
    assert EXAMPLES, "examples/ holds no programs"


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_runs(path: Path) -> None:
    try:
        proc = subprocess.run(
            [sys.executable, str(path)],
            cwd=ROOT,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{path.name} did not finish within {TIMEOUT_S} s:\n{e.stdout or ''}")
    assert proc.returncode == 0, (
        f"{path.name} exited with {proc.returncode}\n"
        f"--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-4000:]}"
    )
