"""Which code the closure search follows, and what names a code object loads.

Library code (the standard library, installed packages, treemode itself:
`LIBRARY`) is never followed, as it cannot close over the user's modules;
the functions treemode's transforms return (defined under `TRANSFORMS`) and
JAX's traceback boundary around them (`BOUNDARY_CODES`) are seen through.
`global_names` reads the global names a code object loads from its bytecode.
The search itself is `treemode._tree._closure`.
"""

from __future__ import annotations

import dis
import os
import site
import sysconfig
import types
from typing import Any

from .. import _compat


def _library_prefixes() -> tuple[str, ...]:
    """Directories whose code is never followed: the standard library, installed
    packages and treemode itself."""
    paths = {os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}  # treemode/
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        path = sysconfig.get_paths().get(key)
        if path:
            paths.add(path)
    try:
        paths.update(site.getsitepackages())
    except AttributeError:  # pragma: no cover - some embedded interpreters
        pass
    if site.ENABLE_USER_SITE and site.USER_SITE:
        paths.add(site.USER_SITE)
    prefixes = {os.path.join(os.path.abspath(p), "") for p in paths}
    prefixes |= {os.path.join(os.path.realpath(p), "") for p in paths}
    return (*sorted(prefixes), "<frozen ")


LIBRARY = _library_prefixes()
# The functions treemode's transforms return (``treemode.grad``, ``remat``, ...) are
# defined here, and JAX's traceback boundary (``_compat.api_boundary``) wraps them:
# their closure cells hold the user's function, so the search sees through them.
TRANSFORMS = tuple(
    os.path.join(resolve(os.path.dirname(os.path.dirname(__file__))), "_transforms", "")
    for resolve in (os.path.abspath, os.path.realpath)
)


def _boundary_codes() -> frozenset[types.CodeType]:
    """The code objects of the layers `_compat.api_boundary` wraps a function in
    (JAX's boundary, and treemode's filter of chained causes)."""

    def probe() -> None:
        pass

    codes: set[types.CodeType] = set()
    layer: Any = _compat.api_boundary(probe)
    for _ in range(8):  # the layers down to ``probe``, through ``__wrapped__``
        if layer is probe or layer is None:
            break
        code = getattr(layer, "__code__", None)
        if code is not None:
            codes.add(code)
        layer = getattr(layer, "__wrapped__", None)
    return frozenset(codes)


BOUNDARY_CODES = _boundary_codes()


def global_names(code: types.CodeType) -> tuple[str, ...]:
    """Names ``code`` (and the functions/comprehensions nested in it) load as globals.

    ``co_names`` alone also lists attribute names, so the bytecode is read once.
    """
    names: dict[str, None] = {}
    for instruction in dis.get_instructions(code):
        if instruction.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
            names[instruction.argval] = None
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names.update(dict.fromkeys(global_names(const)))
    return tuple(names)
