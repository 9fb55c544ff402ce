"""The package builds into a wheel that installs on its own and imports.

Marked ``packaging`` (``pytest -m packaging`` runs only this; ``-m "not
packaging"`` skips it when offline). It builds the wheel with ``pip wheel``
(hatchling, in pip's isolated build environment), installs only that wheel with
``--no-deps`` into a temporary target directory, and imports it from there in a
fresh interpreter whose working directory is outside the checkout, so the
editable install and the source tree cannot stand in for the wheel.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.packaging


def _run(args: list[str], cwd: Path, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        args, cwd=cwd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
    )
    assert proc.returncode == 0, f"{' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


def test_wheel_builds_installs_and_imports(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    _run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "-q", "-w", str(dist)],
        cwd=tmp_path,
    )
    wheels = list(dist.glob("treemode-*.whl"))
    assert len(wheels) == 1, wheels

    names = set(zipfile.ZipFile(wheels[0]).namelist())
    assert "treemode/__init__.py" in names
    assert "treemode/py.typed" in names, "the PEP 561 marker must ship in the wheel"
    assert not any(n.startswith(("tests/", "docs/", "examples/")) for n in names)

    target = tmp_path / "site"
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "-q",
            "--target",
            str(target),
            str(wheels[0]),
        ],
        cwd=tmp_path,
    )
    check = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(target)!r})
        import jax.numpy as jnp
        from flax import nnx
        import treemode

        assert treemode.__file__.startswith({str(target)!r}), treemode.__file__
        model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
        y = treemode.jit(lambda m, x: m(x))(model, jnp.ones((1, 2)))
        assert y.shape == (1, 3)
        print(treemode.__version__)
        """
    )
    proc = _run([sys.executable, "-c", check], cwd=tmp_path)
    import treemode

    assert proc.stdout.strip() == treemode.__version__
