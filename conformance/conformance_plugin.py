"""pytest plugin that routes Flax NNX transform calls to treemode.

Loaded by ``conformance/run.py`` (``-p conformance_plugin``) into a pytest run of
one of Flax's own test files. At configure time, before any test module is
imported, it replaces each ``flax.nnx.<transform>`` attribute by a router, so both
``nnx.jit(...)`` and ``from flax.nnx import jit`` reach it. Each call of a router
resolves the mode the call asks for (``graph=`` / ``graph_updates=``, or Flax's
configured defaults when they are omitted, as Flax itself does) and decides:

- ``tree``: tree-mode calls (Flax would not run its graph-updates machinery, i.e.
  not ``graph and graph_updates``) go to the treemode transform of the same name
  with ``graph=<graph>``; graph-updates calls stay on Flax.
- ``dropin``: every call goes to treemode, with ``graph=<graph>``.
- ``flax-graph``: every call stays on Flax with ``graph_updates=False`` forced and
  ``graph=`` as the call asks (Flax's own graph mode without graph updates: the
  like-for-like reference of the drop-in numbers).
- ``flax-tree``: every call stays on Flax with ``graph=False`` forced (the
  drop-in report's second reference).
- ``flax``: nothing is changed (calls are only counted).

The environment selects the mode (``TREEMODE_CONFORMANCE_MODE``) and the JSON file
the per-test results are written to (``TREEMODE_CONFORMANCE_OUT``): for each test
its outcome, the calls it made (transform, graph, graph_updates, where they went)
and, for a failure, the exception type, its first line, where it was raised and
whether the test expected an error at that point.
"""

from __future__ import annotations

import ast
import functools
import inspect
import json
import os
import re
import traceback
from collections import Counter
from typing import Any

import pytest

MODES = ("flax", "tree", "dropin", "flax-graph", "flax-tree")

# Flax transforms that have a treemode transform of the same name.
TRANSFORMS = (
    "jit",
    "jit_partial",
    "eval_shape",
    "vmap",
    "pmap",
    "scan",
    "while_loop",
    "fori_loop",
    "cond",
    "switch",
    "checkify",
    "grad",
    "value_and_grad",
    "vjp",
    "jvp",
    "custom_vjp",
    "remat",
    "shard_map",
    "transform_metadata",
)

# The name of each transform's function argument in Flax (passed by keyword in a
# few tests); treemode takes it positionally.
_FLAX_FN_KEYWORDS = ("f", "fun", "fn")


class _State:
    mode: str = "flax"
    current: str = "<collection>"
    calls: dict[str, Counter[tuple[str, bool, bool, str]]] = {}
    results: dict[str, dict[str, Any]] = {}
    collection_errors: dict[str, str] = {}
    collected: list[str] = []
    out: str | None = None


def _flax_defaults() -> tuple[bool, bool]:
    from flax.nnx import graphlib

    return (
        bool(graphlib.set_graph_mode.current_value()),
        bool(graphlib.set_graph_updates.current_value()),
    )


def _is_missing(value: Any) -> bool:
    from flax.typing import Missing

    return value is Missing or isinstance(value, Missing)


def _record(name: str, graph: bool, graph_updates: bool, target: str) -> None:
    _State.calls.setdefault(_State.current, Counter())[(name, graph, graph_updates, target)] += 1


def _treemode_kwargs(name: str, tm_fn: Any, kwargs: dict[str, Any], graph: bool) -> dict[str, Any]:
    """Translate Flax's keyword arguments into treemode's for the same call."""
    kwargs = dict(kwargs)
    kwargs.pop("graph", None)
    kwargs.pop("graph_updates", None)
    # Arguments Flax keeps for JAX compatibility: dropped at their no-op value, kept
    # otherwise (so a real use shows up as a failure).
    if kwargs.get("reduce_axes", None) == ():
        del kwargs["reduce_axes"]
    if kwargs.get("_split_transpose", None) is False:
        del kwargs["_split_transpose"]
    if name in ("vmap", "pmap", "scan") and not kwargs.get("transform_metadata", True):
        del kwargs["transform_metadata"]  # Flax's default is an empty FrozenDict
    # `graph` is passed where treemode has it; where it does not, only a graph-mode
    # call passes it (tree mode is treemode's only mode there).
    params = inspect.signature(tm_fn).parameters
    accepts_graph = "graph" in params or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()
    )
    if accepts_graph or graph:
        kwargs["graph"] = graph
    return kwargs


def _call_treemode(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], graph: bool) -> Any:
    import treemode

    tm_fn = getattr(treemode, name)
    args = list(args)
    for key in _FLAX_FN_KEYWORDS:
        if key in kwargs and not args:
            args.append(kwargs.pop(key))
    if args and _is_missing(args[0]):
        args.pop(0)
    return tm_fn(*args, **_treemode_kwargs(name, tm_fn, kwargs, graph))


def _make_router(name: str, flax_fn: Any) -> Any:
    @functools.wraps(flax_fn)
    def router(*args: Any, **kwargs: Any) -> Any:
        default_graph, default_updates = _flax_defaults()
        graph = kwargs.get("graph")
        graph_updates = kwargs.get("graph_updates")
        graph = default_graph if graph is None else bool(graph)
        graph_updates = default_updates if graph_updates is None else bool(graph_updates)
        mode = _State.mode
        tree_call = not (graph and graph_updates)
        if mode in ("flax-tree", "flax-graph"):
            _record(name, graph, graph_updates, mode)
            kwargs["graph"] = graph if mode == "flax-graph" else False
            if "graph_updates" in inspect.signature(flax_fn).parameters:
                kwargs["graph_updates"] = False
            return flax_fn(*args, **kwargs)
        if mode == "dropin" or (mode == "tree" and tree_call):
            _record(name, graph, graph_updates, "treemode")
            return _call_treemode(name, args, kwargs, graph)
        _record(name, graph, graph_updates, "flax")
        return flax_fn(*args, **kwargs)

    router.__conformance_router__ = True  # type: ignore[attr-defined]
    return router


_ORIGINALS: dict[str, Any] = {}


def install(mode: str) -> None:
    """Replace the ``flax.nnx`` transforms by routers for ``mode``."""
    if mode not in MODES:
        raise ValueError(f"unknown conformance mode {mode!r}; expected one of {MODES}")
    from flax import nnx

    _State.mode = mode
    for name in TRANSFORMS:
        flax_fn = getattr(nnx, name)
        if getattr(flax_fn, "__conformance_router__", False):
            continue
        _ORIGINALS[name] = flax_fn
        setattr(nnx, name, _make_router(name, flax_fn))


def uninstall() -> None:
    """Put Flax's own transforms back (used by the harness's tests)."""
    from flax import nnx

    for name, flax_fn in _ORIGINALS.items():
        setattr(nnx, name, flax_fn)
    _ORIGINALS.clear()
    _State.calls.clear()


# --- failure analysis -------------------------------------------------------------

_RAISES_NAMES = {"assertRaises", "assertRaisesRegex", "raises"}


@functools.cache
def _raises_lines(filename: str) -> frozenset[int]:
    """Lines of ``filename`` where the test expects an error (inside a
    ``with self.assertRaises*/pytest.raises`` block or on such a call)."""
    try:
        with open(filename, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError):
        return frozenset()

    def is_raises(node: ast.AST) -> bool:
        return (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in _RAISES_NAMES
        )

    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.With) and any(is_raises(i.context_expr) for i in node.items):
            end = node.end_lineno or node.lineno
            lines.update(range(node.lineno, end + 1))
        elif is_raises(node):
            assert isinstance(node, ast.Call)
            lines.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    return frozenset(lines)


def _origin(filename: str) -> str:
    path = filename.replace(os.sep, "/")
    if "/treemode/" in path:
        return "treemode"
    if "/flax/" in path and "/site-packages/" in path:
        return "flax"
    if "/jax/" in path or "/jaxlib/" in path:
        return "jax"
    if path.endswith("_test.py") or "/tests/nnx/" in path:
        return "test"
    return "other"


_TEXT_MISMATCH = (
    re.compile(r'^".*" does not match ".*"', re.S),  # unittest assertRaisesRegex
    re.compile(r"^Regex pattern did not match", re.S),  # pytest.raises(match=...)
)


def _analyse(item: pytest.Item, excinfo: pytest.ExceptionInfo[BaseException]) -> dict[str, Any]:
    exc = excinfo.value
    message = str(exc).strip()
    first_line = message.splitlines()[0] if message else ""
    frames = traceback.extract_tb(excinfo.tb)
    test_file = str(item.path)
    test_frames = [f for f in frames if f.filename == test_file]
    raised_at = frames[-1] if frames else None
    # The innermost frame outside Python's own libraries says who raised.
    origin = "other"
    for frame in reversed(frames):
        origin = _origin(frame.filename)
        if origin != "other":
            break
    expected_error = bool(test_frames and test_frames[-1].lineno in _raises_lines(test_file))
    text_mismatch = isinstance(exc, AssertionError) and any(
        p.match(message) for p in _TEXT_MISMATCH
    )
    return {
        "type": type(exc).__name__,
        "module": type(exc).__module__,
        "message": first_line[:400],
        "origin": origin,
        "raised_at": f"{raised_at.filename}:{raised_at.lineno}" if raised_at else "",
        "test_line": test_frames[-1].lineno if test_frames else None,
        "inside_expected_raise": expected_error,
        "text_mismatch": text_mismatch,
    }


# --- pytest hooks -----------------------------------------------------------------


def _reset_graph_context() -> None:
    """Each test starts from a clean Flax graph context: ``nnx.cached_partial`` over a
    call that does not consume its cache (one forced into tree mode) leaves
    ``tmp_static_cache`` set after raising, and every later test would then fail."""
    from flax.nnx import graphlib

    context = getattr(graphlib, "GRAPH_CONTEXT", None)
    if getattr(context, "tmp_static_cache", None) is not None:
        context.tmp_static_cache = None


def pytest_configure(config: pytest.Config) -> None:
    _State.out = os.environ.get("TREEMODE_CONFORMANCE_OUT")
    install(os.environ.get("TREEMODE_CONFORMANCE_MODE", "flax"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):  # noqa: ARG001
    _State.current = item.nodeid
    _reset_graph_context()
    yield
    _State.current = "<between tests>"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):
    outcome = yield
    report = outcome.get_result()
    entry = _State.results.setdefault(item.nodeid, {"outcome": "passed"})
    if report.skipped and report.when in ("setup", "call"):
        entry["outcome"] = "skipped"
    elif report.failed:
        if entry["outcome"] != "failed":
            entry["outcome"] = "failed"
            entry["when"] = report.when
            if call.excinfo is not None:
                entry["failure"] = _analyse(item, call.excinfo)
                if call.excinfo.errisinstance(RecursionError):
                    # A RecursionError can break the cleanup of JAX's and Flax's
                    # thread-local contexts, failing every later test of this process:
                    # stop here; run.py runs the rest in a new process.
                    item.session.shouldstop = "RecursionError: the rest runs in a new process"


def pytest_collection_finish(session: pytest.Session) -> None:
    _State.collected = [item.nodeid for item in session.items]


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.failed:
        text = str(report.longrepr).strip().splitlines()
        errors = [line for line in text if line.startswith("E ")] or text[-1:]
        _State.collection_errors[report.nodeid] = errors[-1].removeprefix("E").strip()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:  # noqa: ARG001
    if _State.out is None:
        return
    tests = {}
    for nodeid, entry in _State.results.items():
        calls = _State.calls.get(nodeid, Counter())
        entry = dict(entry)
        entry["calls"] = [
            {"transform": n, "graph": g, "graph_updates": u, "target": t, "count": c}
            for (n, g, u, t), c in sorted(calls.items())
        ]
        tests[nodeid] = entry
    with open(_State.out, "w", encoding="utf-8") as f:
        data = {
            "mode": _State.mode,
            "tests": tests,
            "collection_errors": _State.collection_errors,
            "collected": _State.collected,
        }
        json.dump(data, f, indent=1, sort_keys=True)
