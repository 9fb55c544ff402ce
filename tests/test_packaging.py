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

import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import textwrap
import tomllib
import venv
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from treemode import _versions

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.packaging


def _run(
    args: list[str], cwd: Path, timeout: float = 180, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        args,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        env=env,
    )
    assert proc.returncode == 0, f"{' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


def _build_wheel(tmp_path: Path) -> Path:
    dist = tmp_path / "dist"
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(_source_copy(tmp_path)),
            "--no-deps",
            "-q",
            "-w",
            str(dist),
        ],
        cwd=tmp_path,
    )
    wheels = list(dist.glob("treemode-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def _source_copy(tmp_path: Path) -> Path:
    """The checkout's sources, copied: builds write build/ and *.egg-info/ into the
    tree they build, so two builds of one tree (two test workers) would collide."""
    target = tmp_path / "source"
    shutil.copytree(
        ROOT,
        target,
        ignore=shutil.ignore_patterns(
            ".git",
            ".venv",
            ".compat",
            "build",
            "dist",
            "site",
            "*.egg-info",
            "__pycache__",
            ".hypothesis",
            ".pytest_cache",
            ".ruff_cache",
            "*.so",
            ".cache",
        ),
    )
    return target


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]


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


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel built from the checkout, once for this module."""
    return _build_wheel(tmp_path_factory.mktemp("wheel"))


def test_wheel_builds_installs_into_a_fresh_venv_and_imports(tmp_path: Path, wheel: Path) -> None:

    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        metadata_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
        metadata = Parser().parsestr(zf.read(metadata_name).decode())
    assert "treemode/__init__.py" in names
    assert "treemode/py.typed" in names, "the PEP 561 marker must ship in the wheel"
    compiled = [
        n for n in names if n.startswith("treemode/_accel/_guard.") and n.endswith((".so", ".pyd"))
    ]
    assert compiled, f"the compiled guard is missing from the wheel: {sorted(names)}"
    assert "treemode/_accel/_guard.pyi" in names
    assert not any(n.startswith(("tests/", "docs/", "examples/", "benchmarks/")) for n in names)
    requires = [r.split(";")[0].replace(" ", "") for r in metadata.get_all("Requires-Dist") or []]
    for dep in ("jax", "jaxlib", "flax", "numpy"):
        assert any(r.startswith(dep) for r in requires), f"{dep} missing from {requires}"
    declared = {
        Requirement(r).name: Requirement(r).specifier
        for r in metadata.get_all("Requires-Dist") or []
        if "extra ==" not in r
    }
    for name in _versions.REQUIRED:
        assert declared[name] == SpecifierSet(_versions.specifier(name)), (name, declared)
    assert not [r for r in requires if "==" in r], f"exact pins in {requires}"
    assert not [r for r in requires if r.startswith("jaxtyping")], "treemode never imports it"
    assert metadata["Requires-Python"] == ">=3.11"
    assert metadata["License-Expression"] == "Apache-2.0"
    licenses = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
    assert licenses, f"the LICENSE file is missing from the wheel: {sorted(names)}"
    with zipfile.ZipFile(wheel) as zf:
        assert zf.read(licenses[0]) == (ROOT / "LICENSE").read_bytes()
    assert metadata["Version"] == _pyproject()["version"]

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

        from treemode._tree import _flat_guard
        assert _flat_guard._compiled_holds is not None, "the compiled guard did not load"

        model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
        y = treemode.jit(lambda m, x: m(x))(model, jnp.ones((1, 2)))
        assert y.shape == (1, 3)
        print(treemode.__version__)
        """
    )
    # The wheel's extension must load whatever mode this suite runs in
    # (`make test-python` sets TREEMODE_NO_EXTENSION=1).
    env = {k: v for k, v in os.environ.items() if k != "TREEMODE_NO_EXTENSION"}
    proc = _run([str(python), "-I", "-c", check], cwd=tmp_path, env=env)
    import treemode

    assert proc.stdout.strip() == treemode.__version__


def test_version_is_declared_once_and_read_from_the_metadata() -> None:
    import treemode

    assert treemode.__version__ == _pyproject()["version"]
    init = (ROOT / "treemode" / "__init__.py").read_text(encoding="utf-8")
    assert _pyproject()["version"] not in init, "the version belongs in pyproject.toml only"


def _fake_distribution(site_packages: Path, name: str, version: str) -> None:
    info = site_packages / f"{name}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n", encoding="utf-8"
    )
    (info / "RECORD").write_text("", encoding="utf-8")
    (info / "INSTALLER").write_text("pip\n", encoding="utf-8")


def test_installing_the_wheel_keeps_a_supported_environment_as_it_is(
    tmp_path: Path, wheel: Path
) -> None:
    """A venv already holding jax 0.9.2 and flax 0.12.6 gets treemode and nothing else.

    The distributions are metadata only and no index is reachable (``--no-index``):
    a requirement they did not satisfy (an exact pin, as before) would make pip
    try to download a replacement and fail. ``tools/compat.py``'s ``middle`` case
    does the same with the real packages and runs the test suite there.
    """
    python, site_packages = _fresh_venv(tmp_path)
    held = {"jax": "0.9.2", "jaxlib": "0.9.2", "flax": "0.12.6", "numpy": "2.3.5"}
    for name, version in held.items():
        _fake_distribution(site_packages, name, version)
    proc = _run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-index",
         "--no-build-isolation", str(wheel)],
        cwd=tmp_path,
    )  # fmt: skip
    assert "Uninstalling" not in proc.stdout, proc.stdout
    listed = _run(
        [sys.executable, "-m", "pip", "--python", str(python), "list", "--format=freeze"],
        cwd=tmp_path,
    ).stdout.split()
    assert sorted(listed) == sorted(
        [f"{n}=={v}" for n, v in held.items()] + [f"treemode=={_pyproject()['version']}"]
    )


def _sdist_build(tmp_path: Path) -> Path:
    dist = tmp_path / "dist"
    source = _source_copy(tmp_path)
    _run(
        [sys.executable, "-m", "build", "--sdist", "--outdir", str(dist), str(source)], cwd=tmp_path
    )
    (sdist,) = dist.glob("treemode-*.tar.gz")
    return sdist


# What the tests of an unpacked sdist read besides treemode/: every file of these
# folders that the checkout holds (results of benchmark runs excepted, but for
# results.json, from which tests/test_docs.py checks a table of docs/choosing.md).
_TEST_INPUTS = ("tests", "docs", "examples", "benchmarks", "tools")


def _wanted_in_sdist() -> set[str]:
    wanted = {"LICENSE", "README.md", "pyproject.toml", "setup.py", "mkdocs.yml"}
    wanted |= {"constraints.txt", "treemode/py.typed"}
    # The compiled extension's every C file and header (setup.py builds from them).
    wanted |= {p.relative_to(ROOT).as_posix() for p in (ROOT / "treemode/_accel").glob("*.[ch]")}
    wanted.add("benchmarks/results/results.json")
    wanted |= {".ci/run", ".github/workflows/wheels.yml"}
    for folder in _TEST_INPUTS:
        for path in (ROOT / folder).rglob("*"):
            rel = path.relative_to(ROOT).as_posix()
            if (
                path.is_file()
                and "__pycache__" not in path.parts
                and not rel.startswith("benchmarks/results/")
            ):
                wanted.add(rel)
    wanted |= {p.relative_to(ROOT).as_posix() for p in (ROOT / "treemode").rglob("*.py")}
    return wanted


def test_sdist_carries_everything_its_tests_need(tmp_path: Path) -> None:
    sdist = _sdist_build(tmp_path)
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    missing = sorted(_wanted_in_sdist() - names)
    assert not missing, f"missing from the sdist: {missing}"
    assert "tests/helpers.py" in names and "tests/conftest.py" in names
    assert not [n for n in names if n.endswith((".so", ".pyc")) or n.startswith(".compat/")]


# -- Binary wheels: the cibuildwheel configuration, the release workflow, make wheels --


def _cibuildwheel() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"][
        "cibuildwheel"
    ]


def test_cibuildwheel_covers_three_platforms_and_cpython_3_11_to_3_13() -> None:
    config = _cibuildwheel()
    low, high = _versions.PYTHON
    assert config["build"] == [f"cp3{minor}-*" for minor in range(low[1], high[1])]
    assert config["linux"]["archs"] == ["x86_64", "aarch64"]
    assert config["macos"]["archs"] == ["arm64", "x86_64"]
    assert config["windows"]["archs"] == ["AMD64"]
    assert config["test-extras"] == ["test"]
    first, tests = config["test-command"]
    # The installed wheel's extension must be active, or the build fails ...
    assert "treemode.extension_status()" in first and "assert s.active" in first
    assert "-W error::RuntimeWarning" in first  # ... and its ExtensionWarning is an error
    # ... then a part of the suite runs against it, from the copied test sources.
    named = [t for t in tests.split() if t.startswith("tests/")]
    assert "tests/test_extension.py" in named and "tests/test_callsite.py" in named
    for path in named:
        assert (ROOT / path).is_file(), path
    for source in config["test-sources"]:
        assert (ROOT / source).exists(), source


def test_release_workflow_builds_tests_and_publishes_with_trusted_publishing() -> None:
    workflow = (ROOT / ".github" / "workflows" / "wheels.yml").read_text(encoding="utf-8")
    for runner in ("ubuntu-24.04", "ubuntu-24.04-arm", "macos-14", "macos-15-intel", "windows"):
        assert f"os: {runner}" in workflow, runner
    assert workflow.count("uses: pypa/cibuildwheel@") == 2  # 3.11-3.13, and 3.14 apart
    assert 'CIBW_BUILD: "cp314-*"' in workflow and "continue-on-error: true" in workflow
    assert "python -m build --sdist" in workflow
    assert workflow.count("uses: actions/upload-artifact@") == 3
    publish = workflow.split("\n  publish:\n")[1]
    assert "startsWith(github.ref, 'refs/tags/v')" in publish
    assert "id-token: write" in publish
    assert "uses: pypa/gh-action-pypi-publish@" in publish
    assert "password" not in publish and "token:" not in publish.replace("id-token:", "")


def test_make_wheels_and_ci_check_the_manylinux_wheel() -> None:
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "\nwheels: $(STAMP)\n" in makefile and "\nwheel-check: $(STAMP)\n" in makefile
    assert "tools/wheels.py $(WHEEL_TESTS)" in makefile
    assert "make wheel-check\n" in ci
    checked = makefile.split("WHEEL_CHECK_TESTS :=")[1].split("\nwheel-check:")[0]
    for path in checked.replace("\\", " ").split():
        assert (ROOT / path).is_file(), path
    assert 'echo "make test: the whole suite, about' in makefile  # announced before it runs


def _load_wheels_tool():
    spec = importlib.util.spec_from_file_location("_wheels_tool", ROOT / "tools" / "wheels.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _fake_wheel(path: Path, tags: list[str], with_extension: bool = True) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("treemode/__init__.py", "")
        if with_extension:
            zf.writestr("treemode/_accel/_guard.cpython-311-x86_64-linux-gnu.so", b"\x7fELF")
        wheel_info = "Wheel-Version: 1.0\n" + "".join(f"Tag: {t}\n" for t in tags)
        zf.writestr("treemode-0.1.0.dist-info/WHEEL", wheel_info)
    return path


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="make wheels runs on Linux")
def test_the_wheel_tag_check_refuses_a_plain_linux_wheel(tmp_path: Path) -> None:
    tool = _load_wheels_tool()
    py = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    machine = os.uname().machine
    good = _fake_wheel(
        tmp_path / f"treemode-0.1.0-{py}-{py}-manylinux2014_{machine}.manylinux_2_17_{machine}.whl",
        [f"{py}-{py}-manylinux_2_17_{machine}", f"{py}-{py}-manylinux2014_{machine}"],
    )
    tool.check_tag(good)
    plain = _fake_wheel(
        tmp_path / f"treemode-0.1.0-{py}-{py}-linux_{machine}.whl", [f"{py}-{py}-linux_{machine}"]
    )
    with pytest.raises(SystemExit, match="is not a .* manylinux_2_17"):
        tool.check_tag(plain)
    other = tmp_path / "other"
    other.mkdir()
    no_extension = _fake_wheel(other / good.name, [f"{py}-{py}-manylinux_2_17_{machine}"], False)
    with pytest.raises(SystemExit, match="has no compiled extension"):
        tool.check_tag(no_extension)


def _make_plan(target: str, venv_dir: Path) -> str:
    """The commands ``make TARGET`` would run with ``VENV=venv_dir`` (``make -n``)."""
    proc = subprocess.run(
        ["make", "-n", target, f"VENV={venv_dir}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return proc.stdout


@pytest.mark.skipif(shutil.which("make") is None, reason="no make on PATH")
def test_make_demo_installs_only_what_the_demo_needs_and_make_test_the_rest(tmp_path):
    """A first `make demo` installs treemode with its runtime dependencies (and optax),
    not the test extra; `make test` in the venv `make demo` made still installs the
    test extra; after `make test`, `make demo` installs nothing."""
    venv_dir = tmp_path / "venv"
    demo = _make_plan("demo", venv_dir)
    assert "-m venv" in demo and "-e . optax" in demo, demo
    assert "[test]" not in demo and "--upgrade pip" not in demo, demo
    assert "examples/train_mlp.py" in demo

    # The venv as `make demo` leaves it: its stamp newer than every source.
    (venv_dir / "bin").mkdir(parents=True)
    future = 4_000_000_000  # 2096: newer than any file of the checkout
    for path in (venv_dir / "bin" / "python", venv_dir / ".installed-demo"):
        path.touch()
        os.utime(path, (future, future))
    assert "pip install" not in _make_plan("demo", venv_dir)
    test = _make_plan("test", venv_dir)
    assert "-e '.[test]'" in test and "pytest" in test, test

    # After `make test` (both stamps): neither reinstalls.
    (venv_dir / ".installed").touch()
    os.utime(venv_dir / ".installed", (future, future))
    assert "pip install" not in _make_plan("demo", venv_dir)
    assert "pip install" not in _make_plan("test", venv_dir)
