"""The supported versions: one source (treemode/_versions.py), checked at import.

pyproject.toml, README.md and docs/install.md must state exactly the ranges of
``treemode._versions``: minimums, never an upper bound (a newer JAX or Flax is
installed as it is). Importing treemode with a JAX or Flax outside the tested
ranges raises (a version known to break) or warns (an untested one, newer or
older), naming the installed and the supported versions. Installed versions are simulated with a
fixture (in-process) and with a fake ``*.dist-info`` put first on the path (in a
subprocess that really imports treemode).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys
import tomllib
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import treemode
from treemode import _versions

ROOT = Path(__file__).resolve().parent.parent

IN_RANGE = {"jax": "0.10.2", "jaxlib": "0.10.2", "flax": "0.12.8"}


@functools.cache
def _compat_tool() -> Any:
    """tools/compat.py (the compatibility matrix of `make compat`), as a module."""
    spec = importlib.util.spec_from_file_location("_compat_tool", ROOT / "tools" / "compat.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["_compat_tool"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def installed() -> Callable[..., Callable[[str], str | None]]:
    """``installed(flax="0.12.0")``: a version lookup, in range unless overridden."""

    def make(**overrides: str | None) -> Callable[[str], str | None]:
        table = {**IN_RANGE, **overrides}
        return lambda name: table.get(name)

    return make


def test_pyproject_declares_the_ranges_of_versions_py() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    deps = {d.replace(" ", "") for d in project["dependencies"]}
    for name in _versions.REQUIRED:
        assert f"{name}{_versions.specifier(name)}" in deps, (name, sorted(deps))
    test_extra = {d.replace(" ", "") for d in project["optional-dependencies"]["test"]}
    for name in _versions.OPTIONAL:
        assert f"{name}{_versions.specifier(name)}" in test_extra, (name, sorted(test_extra))
    assert not [d for d in deps | test_extra if "==" in d], "declare ranges, never exact pins"
    capped = [d for d in deps | test_extra if "<" in d]
    assert not capped, f"minimums only: an upper bound would downgrade a newer JAX: {capped}"
    assert project["urls"]["Issues"] == _versions.ISSUES_URL  # named in the warnings
    low, high = _versions.PYTHON
    assert project["requires-python"] == ">=" + ".".join(map(str, low))
    classifiers = [c for c in project["classifiers"] if c.startswith("Programming Language")]
    minors = [f"3.{m}" for m in range(low[1], high[1])]
    assert [c.rsplit(" ", 1)[-1] for c in classifiers[1:]] == minors


def test_readme_and_install_page_state_the_supported_versions() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert f"Supported versions: {_versions.summary()}" in readme, (
        "README.md must say: Supported versions: " + _versions.summary()
    )
    page = (ROOT / "docs" / "install.md").read_text(encoding="utf-8")
    section = page.split("<!-- versions:begin -->\n")[1].split("\n<!-- versions:end -->")[0]
    assert section == _versions.table(), (
        "paste treemode._versions.table() between the markers of docs/install.md:\n"
        + _versions.table()
    )


def test_constraints_pin_versions_inside_the_ranges() -> None:
    """The development environment (constraints.txt) is one of the supported ones."""
    pins = dict(
        line.split("==")
        for line in (ROOT / "constraints.txt").read_text(encoding="utf-8").splitlines()
        if line and not line.startswith("#")
    )
    for name, (low, high) in {**_versions.REQUIRED, **_versions.OPTIONAL}.items():
        assert low <= _versions.parse(pins[name]) < high, (name, pins[name])


def test_supported_versions_in_words() -> None:
    assert _versions.specifier("jax") == ">=0.9.2"
    assert _versions.tested_specifier("jax") == ">=0.9.2,<0.13"
    assert _versions.describe("flax") == "0.12.6 or newer (tested to 0.12.x)"
    assert _versions.installed_versions({"jax": "0.11.0", "flax": "0.13.1"}.get) == (
        "jax 0.11.0, jaxlib unknown, flax 0.13.1"
    )
    assert _versions.parse("0.10.2rc1") == (0, 10, 2)
    assert _versions.parse("0.11.0.dev20260101") == (0, 11, 0)
    assert _versions.parse("0.9.0.1") == (0, 9, 0, 1)


def test_supported_versions_pass_silently(installed) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _versions.check_installed(installed())
        _versions.check_installed(installed(jax="0.9.2", jaxlib="0.9.2", flax="0.12.6"))
        _versions.check_installed(installed(jax="0.10.0", jaxlib="0.10.0"))
        # The newest releases the registry serves (`make compat`'s newest cases).
        _versions.check_installed(installed(**_compat_tool().NEWEST))
        _versions.check_installed(installed(jax="0.11.2", jaxlib="0.11.2", flax="0.12.10"))


def test_the_tested_range_is_what_the_compat_matrix_tests() -> None:
    """The top of each tested range is the minor release after the newest that
    `make compat` runs (tools/compat.py's NEWEST); every pinned case lies inside
    the ranges, and the oldest case pins their lower bounds."""
    tool = _compat_tool()
    ranges = {**_versions.REQUIRED, **_versions.OPTIONAL}
    assert set(tool.NEWEST) == set(ranges), sorted(tool.NEWEST)
    for name, (low, high) in ranges.items():
        newest = _versions.parse(tool.NEWEST[name])
        assert low <= newest < high, (name, tool.NEWEST[name], _versions.tested_specifier(name))
        last_minor = (*high[:-1], high[-1] - 1)
        assert newest[: len(high)] == last_minor, (
            f"{name}: compat's newest is {tool.NEWEST[name]} but the tested range is "
            f"{_versions.tested_specifier(name)}: move one to the other"
        )
    cases = {case.name: case for case in tool.CASES}
    assert {n: _versions.parse(v) for n, v in cases["oldest"].pins.items()} == {
        n: ranges[n][0] for n in cases["oldest"].pins
    }
    for case in tool.CASES:
        assert not tool.outside_tested_range(case.pins), (case.name, case.pins)
    assert tool.outside_tested_range(tool.NEWEST) == []
    assert tool.outside_tested_range({"jax": "0.13.0", "flax": "0.12.12"}) == [
        f"jax 0.13.0 (tested: jax{_versions.tested_specifier('jax')})"
    ]


@pytest.mark.parametrize("flax", ["0.12.0", "0.11.2", "0.10.7"])
def test_flax_known_to_break_raises_naming_installed_and_supported(installed, flax) -> None:
    with pytest.raises(ImportError) as info:
        _versions.check_installed(installed(flax=flax))
    assert str(info.value) == (
        "treemode cannot run with the installed versions: "
        f"flax {flax} is installed; treemode supports flax>=0.12.6 "
        "(flax before 0.12.1 does not work with it). To upgrade to supported versions: "
        "pip install --upgrade 'flax>=0.12.6'."
    )


@pytest.mark.parametrize(
    ("name", "version", "says"),
    [
        ("jax", "0.13.0", "treemode was tested with jax>=0.9.2,<0.13"),
        ("jax", "0.13.0.dev20260101", "treemode was tested with jax>=0.9.2,<0.13"),
        ("jax", "1.2.3", "treemode was tested with jax>=0.9.2,<0.13"),
        ("flax", "0.13.0", "treemode was tested with flax>=0.12.6,<0.13"),
        ("jax", "0.8.0", "treemode supports jax>=0.9.2"),
        ("jaxlib", "0.7.2", "treemode supports jaxlib>=0.9.2"),
    ],
)
def test_untested_versions_warn_naming_installed_and_supported(
    installed, name, version, says
) -> None:
    with pytest.warns(_versions.VersionWarning) as record:
        _versions.check_installed(installed(**{name: version}))
    assert len(record) == 1
    message = str(record[0].message)
    assert message.startswith(
        "treemode was not tested with the installed versions: "
        f"{name} {version} is installed; {says}. It may work."
    ), message
    versions = ", ".join(f"{n} {installed(**{name: version})(n)}" for n in _versions.REQUIRED)
    assert (
        f"If something fails, please report it at {_versions.ISSUES_URL} with the installed "
        f"versions ({versions}); to see whether treemode's compiled extension is at fault, "
        "set TREEMODE_NO_EXTENSION=1 (the same checks then run in Python)."
    ) in message
    assert message.endswith(" Set TREEMODE_SKIP_VERSION_CHECK=1 to silence this warning.")
    older = _versions.parse(version) < _versions.REQUIRED[name][0]
    upgrade = f"To upgrade to supported versions: pip install --upgrade '{name}>="
    assert (upgrade in message) == older, message


def _pip_commands(message: str) -> list[list[str]]:
    """The requirement specifiers of every ``pip install`` command in a message."""
    commands = []
    for part in message.split("pip install")[1:]:
        words = part.split(". ")[0].split()
        commands.append([w.strip("'.") for w in words if not w.startswith("--")])
    return commands


@pytest.mark.parametrize(
    "versions",
    [
        {"jax": "0.13.2", "jaxlib": "0.13.2", "flax": "0.12.10"},
        {"jax": "0.11.2", "jaxlib": "0.11.2", "flax": "0.13.0"},
        {"jax": "0.8.0", "jaxlib": "0.8.0"},
        {"jax": "0.12.0", "jaxlib": "0.12.0", "flax": "0.12.0"},  # raises: flax too old
        {"jax": "0.8.0", "jaxlib": "0.11.2"},
    ],
)
def test_no_message_suggests_moving_a_package_down(installed, versions) -> None:
    """A GPU install is pinned to its jaxlib (and CUDA plugin): no message of the
    check may offer a command that would downgrade JAX, jaxlib or Flax."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        try:
            _versions.check_installed(installed(**versions))
            message = str(record[0].message)
        except ImportError as e:
            message = str(e)
    table = installed(**versions)
    for command in _pip_commands(message):
        assert command, message
        for requirement in command:
            assert "<" not in requirement and "==" not in requirement, message
            name, _, low = requirement.partition(">=")
            assert _versions.parse(low) > _versions.parse(table(name) or "0"), message


def test_every_problem_is_named_at_once(installed) -> None:
    errors, warns = _versions.problems(installed(jax="0.13.1", jaxlib="0.13.1", flax="0.12.0"))
    assert errors == [
        "flax 0.12.0 is installed; treemode supports flax>=0.12.6 "
        "(flax before 0.12.1 does not work with it)"
    ]
    assert warns == [
        "jax 0.13.1 is installed; treemode was tested with jax>=0.9.2,<0.13",
        "jaxlib 0.13.1 is installed; treemode was tested with jaxlib>=0.9.2,<0.13",
    ]


def test_missing_metadata_is_not_judged(installed) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _versions.check_installed(installed(jax=None, jaxlib=None, flax=None))


def test_the_check_can_be_switched_off(installed, monkeypatch) -> None:
    monkeypatch.setenv(_versions.SKIP_ENV, "1")
    _versions.check_installed(installed(flax="0.12.0"))
    monkeypatch.setenv(_versions.SKIP_ENV, "0")
    with pytest.raises(ImportError):
        _versions.check_installed(installed(flax="0.12.0"))


_IMPORT_AND_RUN = """
import jax.numpy as jnp
from flax import nnx

import treemode

model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
assert treemode.jit(lambda m, x: m(x))(model, jnp.ones((1, 2))).shape == (1, 3)
print("imported")
"""


def _import_treemode_with(tmp_path: Path, name: str, version: str) -> subprocess.CompletedProcess:
    """``import treemode`` where the package metadata says ``name`` is at ``version``."""
    info = tmp_path / f"{name}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n", encoding="utf-8"
    )
    env = {k: v for k, v in os.environ.items() if k != _versions.SKIP_ENV}
    # The fake metadata first; then the treemode this test imports (a checkout's).
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(Path(treemode.__file__).parent.parent)])
    return subprocess.run(
        [sys.executable, "-c", _IMPORT_AND_RUN],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_import_treemode_with_flax_0_12_0_raises(tmp_path: Path) -> None:
    proc = _import_treemode_with(tmp_path, "flax", "0.12.0")
    assert proc.returncode == 1 and "imported" not in proc.stdout
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "ImportError: treemode cannot run with the installed versions: flax 0.12.0 is installed; "
        "treemode supports flax>=0.12.6"
    ), proc.stderr


@pytest.mark.parametrize(
    ("name", "version"), [("jax", "0.13.0"), ("jaxlib", "0.14.1"), ("flax", "0.13.0")]
)
def test_import_treemode_with_a_newer_release_warns_and_imports(
    tmp_path: Path, name: str, version: str
) -> None:
    """A release newer than the tested ones (faked metadata): one VersionWarning, and
    treemode works (the installed layout is the real one, so the extension stays on
    where it is active in this process). The other installed versions may be
    untested as well (a machine with a newer JAX): the one warning names them all."""
    proc = _import_treemode_with(tmp_path, name, version)
    assert proc.returncode == 0 and proc.stdout.strip() == "imported", proc.stderr
    assert proc.stderr.count("VersionWarning") == 1, proc.stderr
    assert "VersionWarning: treemode was not tested with the installed versions: " in proc.stderr
    assert (
        f"{name} {version} is installed; treemode was tested with "
        f"{name}{_versions.tested_specifier(name)}" in proc.stderr
    ), proc.stderr
    (line,) = [ln for ln in proc.stderr.splitlines() if "VersionWarning" in ln]
    assert "pip install" not in line and _versions.ISSUES_URL in line, line
    # Attributed to the user's `import treemode` (line 5 of the -c program), not to
    # treemode/__init__.py.
    assert line.startswith("<string>:5: VersionWarning: "), line
    if treemode.extension_status().active:
        assert "ExtensionWarning" not in proc.stderr, proc.stderr


def _fake_metadata(root: Path, name: str, version: str) -> None:
    info = root / f"{name}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n", encoding="utf-8"
    )


def test_the_version_warning_points_at_the_line_that_imports_treemode(tmp_path: Path) -> None:
    """Imported by a library through ``importlib.import_module``: the warning names the
    library's line (treemode's frames and importlib's are passed over), and the
    public class is the one warned."""
    _fake_metadata(tmp_path, "jax", "0.13.0")
    (tmp_path / "userlib.py").write_text(
        "import importlib\n\ntreemode = importlib.import_module('treemode')\n",
        encoding="utf-8",
    )
    (tmp_path / "main.py").write_text(
        "import warnings\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    import userlib\n"
        "(w,) = [w for w in caught if w.category is userlib.treemode.VersionWarning]\n"
        "import os\n"
        "print(os.path.basename(w.filename), w.lineno)\n",
        encoding="utf-8",
    )
    env = {k: v for k, v in os.environ.items() if k != _versions.SKIP_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(Path(treemode.__file__).parent.parent)])
    proc = subprocess.run(
        [sys.executable, "main.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["userlib.py", "3"], proc.stdout


def test_the_stack_level_passes_over_treemode_and_importlib() -> None:
    """`check_installed` called from a frame of treemode (as ``treemode/__init__``
    calls it) warns at that frame's caller; called from the user's code, there."""
    fake = {"jax": "0.13.0", "jaxlib": "0.12.0", "flax": "0.12.12"}
    code = compile(
        "def run():\n    check_installed(installed)\n", str(ROOT / "treemode" / "fake.py"), "exec"
    )
    namespace = {
        "__name__": "treemode.fake",
        "check_installed": _versions.check_installed,
        "installed": fake.get,
    }
    exec(code, namespace)
    with pytest.warns(treemode.VersionWarning) as caught:
        namespace["run"]()  # the line the warning must name
    assert len(caught) == 1
    assert caught[0].filename == __file__, caught[0].filename
    with pytest.warns(treemode.VersionWarning) as caught:
        _versions.check_installed(fake.get)
    assert caught[0].filename == __file__ and caught[0].category is treemode.VersionWarning


def test_a_tested_installation_imports_with_warnings_as_errors() -> None:
    """``python -W error -c 'import treemode'`` (what pytest's ``filterwarnings =
    ["error"]`` makes of an import) succeeds on the installed, tested versions.
    (The extension's own warning, where the treemode imported has no compiled
    module, as `make compat`'s unpacked sdist, is another matter: silenced.)"""
    assert not any(_versions.problems())
    env = {k: v for k, v in os.environ.items() if k != _versions.SKIP_ENV}
    env["TREEMODE_NO_EXTENSION_WARNING"] = "1"
    proc = subprocess.run(
        [sys.executable, "-W", "error", "-c", "import treemode; print('imported')"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "imported", proc.stderr
