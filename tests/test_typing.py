"""Type checkers see what the transforms return: pyright on a checked-in snippet.

``tests/typing/transforms_keep_signatures.py`` calls ``reveal_type`` on
``treemode.vmap(f)``, ``treemode.grad(f)`` and their decorator forms, and makes
two wrong calls. Pyright must reveal ``f``'s parameters (and, for vmap, its result
type, as for ``jax.vmap``) and report both wrong calls. Skipped only where pyright is
not installed (it is in the ``dev`` extra).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SNIPPET = ROOT / "tests" / "typing" / "transforms_keep_signatures.py"
SIGNATURE = "(x: Array, scale: float)"


def _pyright() -> str | None:
    local = Path(sys.executable).parent / "pyright"
    return str(local) if local.exists() else shutil.which("pyright")


@pytest.fixture(scope="module")
def diagnostics() -> dict[int, list[tuple[str, str]]]:
    pyright = _pyright()
    if pyright is None:
        pytest.skip("pyright is not installed (pip install -e '.[dev]')")
    proc = subprocess.run(
        [pyright, "--outputjson", "--pythonpath", sys.executable, str(SNIPPET)],
        cwd=ROOT,  # the checkout's treemode, not an installed one
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    try:
        report = json.loads(proc.stdout)
    except json.JSONDecodeError:  # pyright did not run (no Node.js, say): its own words
        pytest.fail(f"{pyright} did not run (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    found: dict[int, list[tuple[str, str]]] = {}
    for d in report["generalDiagnostics"]:
        found.setdefault(d["range"]["start"]["line"] + 1, []).append((d["severity"], d["message"]))
    return found


def _line(marker: str) -> int:
    lines = SNIPPET.read_text().splitlines()
    return next(i for i, text in enumerate(lines, 1) if text.endswith(f"# {marker}"))


@pytest.mark.parametrize(
    ("marker", "result"),
    [
        ("vmap", "Array"),
        ("vmap decorator", "Array"),
        ("grad", "Any"),
        ("grad decorator", "Any"),
        ("value_and_grad", "tuple[Any, Any]"),
        ("jax.vmap, for comparison", "Array"),
    ],
)
def test_transform_keeps_the_signature(diagnostics, marker: str, result: str) -> None:
    messages = diagnostics.get(_line(marker), [])
    assert [m for _, m in messages] and all(s == "information" for s, _ in messages), messages
    (message,) = [m for _, m in messages]
    assert message.endswith(f'is "{SIGNATURE} -> {result}"'), message


def test_wrong_calls_are_reported(diagnostics) -> None:
    wrong_type = diagnostics.get(_line("error: wrong argument type"), [])
    assert any(s == "error" and '"scale"' in m for s, m in wrong_type), wrong_type
    missing = diagnostics.get(_line("error: missing argument"), [])
    assert any(s == "error" and 'parameter "scale"' in m for s, m in missing), missing
    errors = [line for line, ms in diagnostics.items() for s, _ in ms if s == "error"]
    assert len(errors) == 2, diagnostics  # nothing else in the snippet is an error
