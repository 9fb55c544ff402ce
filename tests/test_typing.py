"""Type checkers see what the transforms return: pyright on a checked-in snippet.

``tests/typing/transforms_keep_signatures.py`` calls ``reveal_type`` on every
public transform, in its function and decorator forms, and makes wrong calls.
Pyright must reveal the wrapped function's parameters (``f``'s, or those left
after ``self`` or after `jit_partial`'s bound arguments) and, where the transform
keeps it, its result type, as for ``jax.vmap``; and report each wrong call
(and nothing else). Skipped only where pyright is not installed (it is in the
``dev`` extra).
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


def _wrapper(name: str) -> str:
    return f"{name}[{SIGNATURE}, Array]"


@pytest.mark.parametrize(
    ("marker", "revealed"),
    [
        ("jit", _wrapper("JitWrapped")),
        ("jit decorator", _wrapper("JitWrapped")),
        ("jit_partial", "JitWrapped[(lr: float, x: Array), float]"),
        ("jit_partial, two bound", "JitWrapped[(x: Array), float]"),
        ("vmap", _wrapper("VmapWrapped")),
        ("vmap decorator", _wrapper("VmapWrapped")),
        ("pmap", _wrapper("PmapWrapped")),
        ("pmap decorator", _wrapper("PmapWrapped")),
        ("shard_map", _wrapper("ShardMapWrapped")),
        ("shard_map decorator", _wrapper("ShardMapWrapped")),
        ("scan", _wrapper("ScanWrapped")),
        ("scan decorator", _wrapper("ScanWrapped")),
        ("scan, called at once", "tuple[Array, str]"),
        ("custom_vjp", _wrapper("CustomVjp")),
        ("custom_vjp decorator", _wrapper("CustomVjp")),
        ("remat", f"{SIGNATURE} -> Array"),
        ("checkpoint decorator", f"{SIGNATURE} -> Array"),
        ("checkify", f"{SIGNATURE} -> tuple[Error, Array]"),
        ("grad", f"{SIGNATURE} -> Any"),
        ("grad decorator", f"{SIGNATURE} -> Any"),
        ("value_and_grad", f"{SIGNATURE} -> tuple[Any, Any]"),
        ("capture decorator", f"{SIGNATURE} -> Any"),
        ("transform_metadata", f"{SIGNATURE} -> Array"),
        ("eval_shape", "Model"),
        ("vjp", "tuple[Array, (Any) -> tuple[Any, ...]]"),
        ("vjp with aux", "tuple[Array, (Any) -> tuple[Any, ...], str]"),
        ("jvp", "tuple[Array, Any]"),
        ("jvp with aux", "tuple[Array, Any, str]"),
        ("cond", "Array"),
        ("switch", "Array"),
        ("fori_loop", "Array"),
        ("while_loop", "Array"),
        ("split_rngs", "Rngs"),
        ("fork_rngs", "Rngs"),
        ("a jitted method", "(x: Array) -> Array"),
        ("a vmapped method", "(x: Array) -> Array"),
        ("jax.vmap, for comparison", f"{SIGNATURE} -> Array"),
    ],
)
def test_transform_keeps_the_signature(diagnostics, marker: str, revealed: str) -> None:
    messages = diagnostics.get(_line(marker), [])
    assert [m for _, m in messages] and all(s == "information" for s, _ in messages), messages
    (message,) = [m for _, m in messages]
    assert message.endswith(f'is "{revealed}"'), message


def test_wrong_calls_are_reported(diagnostics) -> None:
    lines = SNIPPET.read_text().splitlines()
    wrong = {i for i, text in enumerate(lines, 1) if "  # error: " in text}
    assert len(wrong) >= 10
    for line in sorted(wrong):
        found = diagnostics.get(line, [])
        assert any(s == "error" for s, _ in found), (lines[line - 1], found)
    errors = {line for line, ms in diagnostics.items() for s, _ in ms if s == "error"}
    assert errors == wrong, diagnostics  # nothing else in the snippet is an error
