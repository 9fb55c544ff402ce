"""The versions of JAX, Flax and the extras that treemode supports: the one source.

``pyproject.toml`` declares the minimums (never an upper bound: a release of JAX
or Flax newer than the tested ones is installed as it is, and warned about);
``README.md`` and ``docs/install.md`` state them; ``tests/test_versions.py``
fails when any of them disagrees with this module. ``tools/compat.py`` (``make
compat``) installs the lower bounds and the newest releases and runs the test
suite on each.

`check_installed` runs when treemode is imported: a version known to break
treemode raises an `ImportError`; any other version below a minimum, or newer
than the tested ones, warns (`VersionWarning`); both messages name the
installed and the supported versions.

Keep this module import-light (``importlib.metadata`` only): it runs before
treemode imports JAX or Flax.
"""

from __future__ import annotations

import os
import re
import sys
import warnings
from collections.abc import Callable
from importlib import metadata
from typing import Any

Version = tuple[int, ...]

# name -> (lowest supported, first untested). The lower bounds are the oldest
# releases the test suite passes on (`make compat`), declared as minimums in
# pyproject.toml. The second bounds are the minor releases after the newest ones
# `make compat` tests (its ``newest`` cases: what the registry serves on Python
# 3.12 and 3.13, recorded in ``NEWEST`` of tools/compat.py; tests/test_versions.py
# fails when the two disagree). They are the next minor releases, not yet tested:
# they are *not* declared (pip installs newer releases as they come), but a
# newer version warns at import, since treemode reads a few private attributes
# of Flax and JAX (treemode/_compat.py) that a minor release may change; where
# it changed them, `treemode._compat` turns the compiled extension off (one
# warning) or raises an ImportError naming the versions.
REQUIRED: dict[str, tuple[Version, Version]] = {
    "jax": ((0, 9, 2), (0, 13)),
    "jaxlib": ((0, 9, 2), (0, 13)),
    "flax": ((0, 12, 6), (0, 13)),
}
# The optional dependencies that the test suite and the examples use (the
# ``test`` extra); treemode itself never imports them unless you do.
OPTIONAL: dict[str, tuple[Version, Version]] = {
    "equinox": ((0, 13, 8), (0, 14)),
    "optax": ((0, 2, 8), (0, 3)),
}
PYTHON: tuple[Version, Version] = ((3, 11), (3, 14))

# name -> the first release that works: below it treemode fails with an internal
# error (Flax 0.12.0 and 0.11.x lack Variable internals treemode reads), so
# importing treemode raises instead of warning.
KNOWN_BROKEN_BELOW: dict[str, Version] = {"flax": (0, 12, 1)}

SKIP_ENV = "TREEMODE_SKIP_VERSION_CHECK"
# Named in the messages: where to report a failure (pyproject.toml's Issues URL,
# checked by tests/test_versions.py), and the switch that turns the compiled
# extension off (treemode/_accel/_compiled.py reads it).
ISSUES_URL = "https://github.com/treemode/treemode/issues"
NO_EXTENSION_ENV = "TREEMODE_NO_EXTENSION"


class VersionWarning(UserWarning):
    """An installed JAX or Flax outside the versions treemode was tested with.

    Warned once, when treemode is imported, at the line that imports it; the
    message names the installed and the tested versions. treemode goes on (a
    newer release may well work); the tested releases never warn. To accept an
    untested release where warnings are errors, set
    ``TREEMODE_SKIP_VERSION_CHECK=1``, or filter the warning by its message
    before importing treemode (the class is not importable before then):

    ```python
    import warnings

    warnings.filterwarnings("ignore", message="treemode was not tested with the installed")
    import treemode  # noqa: E402

    assert issubclass(treemode.VersionWarning, UserWarning)
    ```
    """

    __module__ = "treemode"  # shown as treemode.VersionWarning


def _fmt(version: Version) -> str:
    return ".".join(map(str, version))


def specifier(name: str) -> str:
    """The pip specifier declared for a dependency: its minimum, e.g. ``">=0.9.2"``."""
    low, _ = {**REQUIRED, **OPTIONAL}[name]
    return f">={_fmt(low)}"


def tested_specifier(name: str) -> str:
    """The pip specifier of the tested releases, e.g. ``">=0.9.2,<0.13"``."""
    low, high = {**REQUIRED, **OPTIONAL}[name]
    return f">={_fmt(low)},<{_fmt(high)}"


def _last_tested(name: str) -> str:
    _, high = {**REQUIRED, **OPTIONAL}[name]
    return f"{_fmt((*high[:-1], high[-1] - 1))}.x"


def describe(name: str) -> str:
    """A supported range in words, e.g. ``"0.9.2 or newer (tested to 0.12.x)"``."""
    low, _ = {**REQUIRED, **OPTIONAL}[name]
    return f"{_fmt(low)} or newer (tested to {_last_tested(name)})"


def summary() -> str:
    """One line stating the supported versions (the README's "Supported versions")."""
    py_low, py_high = PYTHON
    py_last = (*py_high[:-1], py_high[-1] - 1)
    return (
        f"Python {_fmt(py_low)} to {_fmt(py_last)}, "
        f"jax and jaxlib {describe('jax')}, flax {describe('flax')}; "
        f"for the test extra, equinox {describe('equinox')} and optax {describe('optax')}."
    )


def table() -> str:
    """The supported versions as a Markdown table (docs/install.md)."""
    rows = ["| Package | Minimum | Tested up to | pip specifier |", "|---|---|---|---|"]
    py_low, py_high = PYTHON
    py_last = (*py_high[:-1], py_high[-1] - 1)
    rows.append(
        f"| Python | {_fmt(py_low)} | {_fmt(py_last)} | `requires-python >={_fmt(py_low)}` |"
    )
    for name in (*REQUIRED, *OPTIONAL):
        extra = " (test extra)" if name in OPTIONAL else ""
        low, _ = {**REQUIRED, **OPTIONAL}[name]
        rows.append(
            f"| `{name}`{extra} | {_fmt(low)} | {_last_tested(name)} | `{name}{specifier(name)}` |"
        )
    return "\n".join(rows)


def parse(version: str) -> Version:
    """The release numbers of a version string: ``"0.10.2rc1"`` -> ``(0, 10, 2)``."""
    numbers = []
    for part in version.split("."):
        match = re.match(r"\d+", part)
        if match is None:
            break
        numbers.append(int(match.group()))
        if match.end() != len(part):
            break
    return tuple(numbers)


def _installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def installed_versions(installed: Callable[[str], str | None] = _installed) -> str:
    """The installed JAX, jaxlib and Flax in words, e.g. ``"jax 0.10.2, jaxlib 0.10.2, ..."``."""
    return ", ".join(f"{name} {installed(name) or 'unknown'}" for name in REQUIRED)


def _below_minimum(installed: Callable[[str], str | None]) -> list[str]:
    """The required packages installed below their minimum (an upgrade fixes those)."""
    out = []
    for name, (low, _) in REQUIRED.items():
        have = installed(name)
        if have is not None and parse(have) < low:
            out.append(name)
    return out


def upgrade_command(names: list[str]) -> str:
    """``pip install --upgrade`` of ``names`` to their minimums: never an upper bound,
    so it can only move a package up (a newer JAX, with its GPU plugin, stays)."""
    return "pip install --upgrade " + " ".join(f"'{n}{specifier(n)}'" for n in names)


def report_advice(installed: Callable[[str], str | None] = _installed) -> str:
    """What to do when treemode fails on versions it was not tested with."""
    return (
        f"If something fails, please report it at {ISSUES_URL} with the installed "
        f"versions ({installed_versions(installed)}); to see whether treemode's "
        f"compiled extension is at fault, set {NO_EXTENSION_ENV}=1 (the same checks "
        "then run in Python)."
    )


def problems(installed: Callable[[str], str | None] = _installed) -> tuple[list[str], list[str]]:
    """``(errors, warnings)``: one line per installed package outside its range.

    **Arguments:**

    - ``installed``: the installed version of a distribution, or ``None``
      (default: read from the package metadata).

    **Returns:** lines naming the installed and the supported versions; a
    package without metadata (a source checkout on ``sys.path``) is not judged.
    """
    errors: list[str] = []
    warns: list[str] = []
    for name, (low, high) in REQUIRED.items():
        have = installed(name)
        if have is None:
            continue
        version = parse(have)
        if low <= version < high:
            continue
        if version >= high:
            warns.append(
                f"{name} {have} is installed; treemode was tested with {name}"
                f"{tested_specifier(name)}"
            )
            continue
        line = f"{name} {have} is installed; treemode supports {name}{specifier(name)}"
        broken_below = KNOWN_BROKEN_BELOW.get(name)
        if broken_below is not None and version < broken_below:
            errors.append(f"{line} ({name} before {_fmt(broken_below)} does not work with it)")
        else:
            warns.append(line)
    return errors, warns


def _is_bootstrap(frame: Any) -> bool:
    """Whether ``frame`` is one of importlib's bootstrap frames, which `warnings.warn`
    steps over without counting them in its ``stacklevel`` (CPython's rule)."""
    filename = frame.f_code.co_filename
    return "importlib" in filename and "_bootstrap" in filename


def _importer_stacklevel() -> int:
    """The ``warnings.warn`` stacklevel, for `check_installed` calling it, of the line
    that imported treemode: the first frame outside treemode and importlib.

    importlib's bootstrap frames are not counted (`warnings.warn` skips them);
    its other frames (``importlib.import_module``) are counted and passed over.
    """
    frame = sys._getframe(1)  # check_installed: stacklevel 1
    level = 1
    frame = frame.f_back
    while frame is not None:
        if not _is_bootstrap(frame):
            level += 1
            package = frame.f_globals.get("__name__", "").partition(".")[0]
            if package not in ("treemode", "importlib"):
                return level
        frame = frame.f_back
    return 2  # no such frame (treemode imported by the interpreter itself): the caller


def check_installed(installed: Callable[[str], str | None] = _installed) -> None:
    """Raise or warn where the installed JAX or Flax is outside the supported ranges.

    Called when treemode is imported; ``TREEMODE_SKIP_VERSION_CHECK=1`` turns it off.
    The messages name the installed and the tested versions; they suggest a
    ``pip install --upgrade`` only for a package below its minimum, never a
    command that would move JAX or Flax down (a newer JAX is often pinned with
    its GPU plugin): for a newer release they say how to report a failure and
    how to turn the compiled extension off.

    **Arguments:**

    - ``installed``: as for `problems`.

    **Raises:** `ImportError` for a version known to break treemode; otherwise
    warns a `VersionWarning` for a version outside the tested range, attributed
    to the line that imported treemode (treemode's and importlib's frames are
    passed over).
    """
    if os.environ.get(SKIP_ENV, "") not in ("", "0"):
        return
    errors, warns = problems(installed)
    old = _below_minimum(installed)
    upgrade = f" To upgrade to supported versions: {upgrade_command(old)}." if old else ""
    if errors:
        raise ImportError(
            "treemode cannot run with the installed versions: "
            + "; ".join(errors + warns)
            + "."
            + upgrade
        )
    if warns:
        warnings.warn(
            "treemode was not tested with the installed versions: "
            + "; ".join(warns)
            + ". It may work."
            + upgrade
            + " "
            + report_advice(installed)
            + f" Set {SKIP_ENV}=1 to silence this warning.",
            VersionWarning,
            stacklevel=_importer_stacklevel(),
        )
