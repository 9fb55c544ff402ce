"""The package builds into a wheel that installs into a fresh venv and imports.

Marked ``packaging`` (``pytest -m packaging`` runs only this; ``-m "not
packaging"`` skips it when offline: building fetches setuptools into pip's
isolated build environment). The test builds the wheel from the checkout with
the PEP 517 backend (``pip wheel``, what ``python -m build --wheel`` does),
checks its contents and metadata, creates a fresh venv, installs only that
wheel into it and imports it from a working directory outside the checkout.

The venv gets treemode's dependencies (jax, flax, ...) from the test's own
environment through a ``.pth`` line instead of downloading them again. Python
does not run the ``.pth`` files of a directory added that way, so the editable
install of the checkout cannot stand in for the wheel; the test asserts that
``treemode`` is imported from the venv and that the declared requirements are
satisfied by what the venv sees.
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import textwrap
import venv
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.packaging


def _run(args: list[str], cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        args, cwd=cwd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
    )
    assert proc.returncode == 0, f"{' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


def _build_wheel(tmp_path: Path) -> Path:
    dist = tmp_path / "dist"
    _run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "-q", "-w", str(dist)],
        cwd=tmp_path,
    )
    wheels = list(dist.glob("treemode-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def _fresh_venv(tmp_path: Path) -> tuple[Path, Path]:
    """``(python, site-packages)`` of a new venv without pip."""
    env = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False, clear=True).create(env)
    python = env / ("Scripts/python.exe" if sys.platform == "win32" else "bin/python")
    purelib = _run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        cwd=tmp_path,
    ).stdout.strip()
    return python, Path(purelib)


def test_wheel_builds_installs_into_a_fresh_venv_and_imports(tmp_path: Path) -> None:
    wheel = _build_wheel(tmp_path)

    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        metadata_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
        metadata = Parser().parsestr(zf.read(metadata_name).decode())
    assert "treemode/__init__.py" in names
    assert "treemode/py.typed" in names, "the PEP 561 marker must ship in the wheel"
    compiled = [
        n for n in names if n.startswith("treemode/_guard.") and n.endswith((".so", ".pyd"))
    ]
    assert compiled, f"the compiled guard is missing from the wheel: {sorted(names)}"
    assert "treemode/_guard.pyi" in names
    assert not any(n.startswith(("tests/", "docs/", "examples/", "benchmarks/")) for n in names)
    requires = [r.split(";")[0].replace(" ", "") for r in metadata.get_all("Requires-Dist") or []]
    for dep in ("jax", "jaxlib", "flax", "numpy"):
        assert any(r.startswith(dep) for r in requires), f"{dep} missing from {requires}"
    assert metadata["Requires-Python"] == ">=3.11"

    python, site_packages = _fresh_venv(tmp_path)
    _run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
         "--no-index", "-q", str(wheel)],
        cwd=tmp_path,
    )  # fmt: skip
    installed = site_packages / "treemode"
    assert (installed / "__init__.py").is_file() and (installed / "py.typed").is_file()

    # Dependencies from this environment (its .pth files, such as the editable
    # install of the checkout, are not processed when added this way).
    ours = sysconfig.get_paths()["purelib"]
    (site_packages / "_test_dependencies.pth").write_text(ours + "\n", encoding="utf-8")

    check = textwrap.dedent(
        f"""
        import importlib.metadata as md
        import sys

        import os

        from packaging.requirements import Requirement

        import jax.numpy as jnp
        from flax import nnx
        import treemode

        assert treemode.__file__.startswith({str(site_packages)!r}), treemode.__file__
        # The checkout itself must not be importable (its .venv may live inside it).
        assert {str(ROOT)!r} not in [os.path.realpath(p) for p in sys.path if p], sys.path
        dist = md.distribution("treemode")
        assert str(dist.locate_file("")).startswith({str(site_packages)!r})
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate():
                have = md.version(req.name)
                assert req.specifier.contains(have, prereleases=True), (line, have)

        from treemode import _flatten
        assert _flatten._compiled_holds is not None, "the compiled guard did not load"

        model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
        y = treemode.jit(lambda m, x: m(x))(model, jnp.ones((1, 2)))
        assert y.shape == (1, 3)
        print(treemode.__version__)
        """
    )
    proc = _run([str(python), "-I", "-c", check], cwd=tmp_path)
    import treemode

    assert proc.stdout.strip() == treemode.__version__
