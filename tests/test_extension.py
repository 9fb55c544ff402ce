"""Which call path runs is visible: ``treemode.extension_status()`` and one warning.

The compiled extension is optional. Where it is off for a reason other than
the user's choice (not built, built for another Python, a Flax/JAX layout it
cannot read), importing treemode warns once (``treemode.ExtensionWarning``)
and ``extension_status()`` says why; ``TREEMODE_NO_EXTENSION=1`` turns it off
silently, and ``TREEMODE_NO_EXTENSION_WARNING=1`` or a warnings filter set
before the import silences the warning. A build without the compiled module is
simulated in subprocesses: once by copying the package without its ``.so``,
once by refusing the import of ``treemode._accel._guard``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from types import ModuleType

import pytest

import treemode
from treemode import _versions
from treemode._accel import _compiled

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = Path(treemode.__file__).resolve().parent

# Run in a subprocess: imports treemode recording every warning, prints them
# and the status as JSON.
REPORT = textwrap.dedent(
    """
    import json, sys, warnings
    {setup}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        {filters}
        import treemode
    status = treemode.extension_status()
    print(json.dumps({{
        "file": treemode.__file__,
        "active": status.active,
        "reason": status.reason,
        "warnings": [[w.category.__name__, str(w.message), w.filename] for w in caught],
    }}))
    """
)

BLOCK_GUARD = textwrap.dedent(
    """
    class _NoGuard:  # as if treemode had been installed without a C compiler
        def find_spec(self, name, path=None, target=None):
            if name == "treemode._accel._guard":
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None
    sys.meta_path.insert(0, _NoGuard())
    """
)

# An editable install (``pip install -e``, as ``make test`` makes) finds the
# children of ``treemode`` in its own checkout, whatever package was imported:
# it would lend its compiled module to the copy below. A user's installation
# without a compiler has no such finder.
NO_EDITABLE_FINDER = (
    "sys.meta_path[:] = [f for f in sys.meta_path"
    " if not str(getattr(f, '__module__', '')).startswith('__editable__')]"
)


def _env(**changes: str | None) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in (_compiled.ENV_VAR, _compiled.QUIET_ENV_VAR, "TREEMODE_SKIP_VERSION_CHECK")
    }
    for key, value in changes.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def _import_report(
    setup: str = "",
    path: Path = PACKAGE.parent,
    flags: tuple[str, ...] = (),
    filters: str = "",
    **env: str | None,
) -> dict:
    proc = subprocess.run(
        [sys.executable, *flags, "-c", REPORT.format(setup=setup, filters=filters)],
        env=_env(PYTHONPATH=str(path), **env),
        cwd=path,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _extension_warnings(report: dict) -> list[list[str]]:
    return [w for w in report["warnings"] if w[0] == "ExtensionWarning"]


def _other_than_versions(report: dict) -> list[list[str]]:
    """The warnings of an import but the `VersionWarning`, which must be there exactly
    where the installed JAX/Flax are outside the tested ranges (a newer JAX, say)."""
    untested = bool(_versions.problems()[1])
    version = [w for w in report["warnings"] if w[0] == "VersionWarning"]
    assert len(version) == untested, report["warnings"]
    return [w for w in report["warnings"] if w[0] != "VersionWarning"]


def test_extension_status_is_public_and_frozen() -> None:
    status = treemode.extension_status()
    assert isinstance(status, treemode.ExtensionStatus)
    assert status is _compiled.STATUS
    assert status.active is _compiled.ENABLED
    with pytest.raises(dataclasses.FrozenInstanceError):
        status.active = not status.active  # type: ignore[misc]
    assert issubclass(treemode.ExtensionWarning, RuntimeWarning)
    if os.environ.get(_compiled.ENV_VAR, "") not in ("", "0"):  # `make test-python`
        assert status == treemode.ExtensionStatus(False, "disabled by TREEMODE_NO_EXTENSION")
    else:  # the test environments build the extension (make test, make wheels, make compat)
        assert status == treemode.ExtensionStatus(True, "active")


OFF = "disabled by TREEMODE_NO_EXTENSION"


def _fake_guard() -> ModuleType:
    return ModuleType("treemode._accel._guard")


def _not_built() -> ModuleType:
    raise ModuleNotFoundError(
        "No module named 'treemode._accel._guard'", name="treemode._accel._guard"
    )


def _wrong_python() -> ModuleType:
    raise ImportError("undefined symbol: _PyType_Lookup")


@pytest.mark.parametrize(
    ("environ", "layout", "importer", "expected"),
    [
        ({}, "", _fake_guard, (True, "active")),
        ({"TREEMODE_NO_EXTENSION": "0"}, "", _fake_guard, (True, "active")),
        ({"TREEMODE_NO_EXTENSION": "1"}, "", _fake_guard, (False, OFF)),
        ({"TREEMODE_NO_EXTENSION": "1"}, "odd", _not_built, (False, OFF)),
        ({}, "", _not_built, (False, "not built")),
        ({}, "", _wrong_python, (False, "failed to load: undefined symbol: _PyType_Lookup")),
        ({}, "Variable._raw_value is not a __slots__ member", _fake_guard,
         (False, "layout not supported: Variable._raw_value is not a __slots__ member")),
    ],
)  # fmt: skip
def test_each_reason(environ, layout, importer, expected) -> None:
    module, status = _compiled.resolve(environ, layout, importer)
    assert status == _compiled.ExtensionStatus(*expected)
    assert (module is not None) is status.active


@pytest.mark.parametrize(
    ("reason", "says", "never"),
    [
        (
            "failed to load: undefined symbol: _PyType_Lookup",
            "reinstall treemode from its "
            "source with this Python, rebuilding it: pip install --force-reinstall",
            "C compiler",
        ),
        (
            "layout not supported: Variable._raw_value is not a __slots__ member",
            "A reinstall cannot help",
            "pip install",
        ),
    ],
)
def test_the_warning_advises_what_helps_for_its_reason(reason, says, never) -> None:
    message = _compiled.warning_text(_compiled.ExtensionStatus(False, reason))
    assert f"not active ({reason})." in message
    assert says in message and never not in message, message


def test_a_missing_dependency_of_the_module_is_not_called_not_built() -> None:
    def missing_dependency() -> ModuleType:
        raise ModuleNotFoundError("No module named 'numpy'", name="numpy")

    _, status = _compiled.resolve({}, "", missing_dependency)
    assert status == _compiled.ExtensionStatus(False, "failed to load: No module named 'numpy'")


def test_announce_warns_once_unless_chosen_or_silenced() -> None:
    not_built = _compiled.ExtensionStatus(False, "not built")
    with pytest.warns(treemode.ExtensionWarning) as caught:
        _compiled.announce(not_built, environ={})
    assert len(caught) == 1
    message = str(caught[0].message)
    assert message.startswith(
        "treemode's compiled extension is not active (this installation of treemode has no "
        "compiled module: it was installed from source without a C compiler)."
    ), message
    # Advice that works today: treemode is not on the package index yet, so no
    # `pip install treemode`; a C compiler and a rebuilding reinstall from source.
    assert "pip install treemode" not in message
    assert "install a C compiler" in message
    assert f"rebuilding it: {_compiled.REBUILD}." in message
    assert _compiled.REBUILD.startswith("pip install --force-reinstall --no-deps --no-cache-dir ")
    assert message.endswith("Set TREEMODE_NO_EXTENSION_WARNING=1 to silence this warning.")
    assert message.endswith("Set TREEMODE_NO_EXTENSION_WARNING=1 to silence this warning.")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _compiled.announce(_compiled.ExtensionStatus(True, "active"), environ={})
        _compiled.announce(
            _compiled.ExtensionStatus(False, "disabled by TREEMODE_NO_EXTENSION"), environ={}
        )
        _compiled.announce(not_built, environ={"TREEMODE_NO_EXTENSION_WARNING": "1"})
    with pytest.warns(treemode.ExtensionWarning):
        _compiled.announce(not_built, environ={"TREEMODE_NO_EXTENSION_WARNING": "0"})


@pytest.fixture(scope="module")
def package_without_extension(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the treemode package without its compiled module (a build without a compiler)."""
    root = tmp_path_factory.mktemp("no_compiler")
    shutil.copytree(
        PACKAGE,
        root / "treemode",
        ignore=shutil.ignore_patterns("*.so", "*.pyd", "__pycache__"),
    )
    assert not list((root / "treemode").glob("_guard*.so"))
    return root


def test_a_build_without_the_extension_warns_once_and_says_why(package_without_extension) -> None:
    report = _import_report(NO_EDITABLE_FINDER, path=package_without_extension)
    assert report["file"] == str(package_without_extension / "treemode" / "__init__.py")
    assert (report["active"], report["reason"]) == (False, "not built")
    extension_warnings = _extension_warnings(report)
    assert len(extension_warnings) == 1, report["warnings"]
    category, message, filename = extension_warnings[0]
    assert message.startswith("treemode's compiled extension is not active (this installation")
    assert filename == "<string>", "the warning points at the importing line"
    # ... and it works: a jit call runs the Python path.
    check = textwrap.dedent(
        """
        import sys
        {NO_EDITABLE_FINDER}
        import jax.numpy as jnp, treemode
        from flax import nnx
        assert treemode.extension_status().reason == "not built"
        m = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
        f = treemode.jit(lambda m, x: m(x))
        print(f(m, jnp.ones((1, 2))).shape, f(m, jnp.ones((1, 2))).shape)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", check.format(NO_EDITABLE_FINDER=NO_EDITABLE_FINDER)],
        env=_env(PYTHONPATH=str(package_without_extension), TREEMODE_NO_EXTENSION_WARNING="1"),
        cwd=package_without_extension,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0 and proc.stdout.split() == ["(1,", "3)", "(1,", "3)"], proc.stderr


def test_the_blocked_module_warns_once_and_the_switches_silence_it() -> None:
    report = _import_report(BLOCK_GUARD)
    assert report["file"] == str(PACKAGE / "__init__.py")
    assert (report["active"], report["reason"]) == (False, "not built")
    assert len(_extension_warnings(report)) == 1, report["warnings"]

    # The user's choice: no warning at all, even under -W error.
    chosen = _import_report(BLOCK_GUARD, flags=("-W", "error"), TREEMODE_NO_EXTENSION="1")
    assert (chosen["active"], chosen["reason"]) == (False, "disabled by TREEMODE_NO_EXTENSION")
    assert _other_than_versions(chosen) == []
    # The documented switches.
    quiet = _import_report(BLOCK_GUARD, TREEMODE_NO_EXTENSION_WARNING="1")
    assert (quiet["active"], quiet["reason"]) == (False, "not built")
    assert _extension_warnings(quiet) == []
    filtered = _import_report(
        BLOCK_GUARD,
        filters="warnings.filterwarnings('ignore', message=\"treemode's compiled extension\")",
    )
    assert (filtered["active"], filtered["reason"]) == (False, "not built")
    assert _extension_warnings(filtered) == []


def test_a_built_extension_imports_silently_under_w_error() -> None:
    report = _import_report(flags=("-W", "error"))
    assert (report["active"], report["reason"]) == (True, "active")
    assert _other_than_versions(report) == []
