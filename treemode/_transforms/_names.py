"""The user's function name and source on what treemode hands to JAX.

JAX names a compiled program after the function it traces (``jit_<name>``),
writes that name into jaxprs, HLO dumps and profiles, and points its own
messages (``jax_explain_cache_misses``, tracer errors) at that function's
source. treemode traces functions of its own (the pure function, loop steps,
branches); `named` gives each the name and source location of the user's
function, so everything JAX shows reads like the user's code.

The named function keeps a copy of the name and the user function's code
object only (see `Source`), never the user function itself: a trace-cache
entry that holds it does not keep the user function (or a bound method's
module) alive.

treemode's own files are also registered with JAX as library files, as Flax
and Equinox do with theirs: JAX's "user frame" (the call site of a cache miss,
the source location of each operation in a jaxpr) is then the user's line
that called a treemode transform, not a line inside treemode.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
from jax._src import source_info_util

from .. import _compat

# The whole package (this module sits in its subpackage _transforms/).
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
source_info_util.register_exclusion(_PACKAGE + os.sep)


class Source:
    """What JAX reads of a function for its name and source location.

    ``api_util.fun_sourceinfo`` unwraps ``__wrapped__`` and reads
    ``__name__`` and ``__code__`` (its file and first line); a code object
    refers to no function, closure or module.
    """

    def __init__(self, name: str, qualname: str, module: str | None, code: Any):
        self.__name__ = name
        self.__qualname__ = qualname
        self.__module__ = module  # type: ignore[assignment]
        self.__code__ = code

    def __repr__(self) -> str:
        code = self.__code__
        where = f" at {code.co_filename}:{code.co_firstlineno}" if code is not None else ""
        return f"<source of {self.__qualname__}{where}>"


def _unwrapped(fn: Any) -> Any:
    """The function whose code runs when ``fn`` is called (through partials,
    bound methods, ``functools.wraps`` chains, treemode wrappers and callable objects)."""
    for _ in range(100):  # wrappers of wrappers; bounded in case of a cycle
        if isinstance(fn, functools.partial):
            fn = fn.func
        elif inspect.ismethod(fn):
            fn = fn.__func__
        elif getattr(fn, "__wrapped__", None) is not None:
            fn = fn.__wrapped__
        elif getattr(fn, "__code__", None) is not None or isinstance(fn, Source):
            return fn
        elif callable(fn) and not isinstance(fn, type):
            call = getattr(type(fn), "__call__", None)  # noqa: B004 (the method, not a test)
            if call is None or getattr(call, "__code__", None) is None:
                return fn
            fn = call
        else:
            return fn
    return fn


def source(fn: Any) -> Source:
    """The name, qualified name, module and code of the user function ``fn``.

    The name is the one JAX would give ``fn`` (``__name__``, through partials);
    a callable object without one is named after its class.
    """
    if isinstance(fn, Source):
        return fn
    inner = _unwrapped(fn)
    base = fn
    while isinstance(base, functools.partial):
        base = base.func
    name = getattr(base, "__name__", None)
    qualname = getattr(base, "__qualname__", None)
    if not isinstance(name, str):
        name = getattr(inner, "__name__", None)
        qualname = getattr(inner, "__qualname__", None)
        if not isinstance(name, str) or name == "__call__":
            name = type(base).__name__
            qualname = type(base).__qualname__
    if not isinstance(qualname, str):
        qualname = name
    module = getattr(base, "__module__", None) or getattr(inner, "__module__", None)
    code = getattr(inner, "__code__", None)
    return Source(name, qualname, module if isinstance(module, str) else None, code)


_VARIADIC = inspect.Signature(
    [
        inspect.Parameter("args", inspect.Parameter.VAR_POSITIONAL),
        inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD),
    ]
)


# What `treemode.jit`'s executables take, as JAX names them in its messages;
# `treemode._pipeline._explain` puts the user's paths in their place.
FLAT_ARGUMENTS = inspect.Signature(
    [inspect.Parameter("flat_args", inspect.Parameter.VAR_POSITIONAL)]
)
SPLIT_ARGUMENTS = inspect.Signature(
    [
        inspect.Parameter("donated_args", inspect.Parameter.POSITIONAL_ONLY),
        inspect.Parameter("kept_args", inspect.Parameter.POSITIONAL_ONLY),
    ]
)


def named(
    fn: Callable[..., Any],
    like: Any,
    signature: inspect.Signature = _VARIADIC,
    traced_for: str | None = None,
    arg_names: Sequence[str] | None = None,
) -> Callable[..., Any]:
    """A function calling ``fn``, named for JAX like the user function ``like``.

    **Arguments:**

    - `fn`: what treemode hands to a JAX transform.
    - `like`: the user function (or its `source`).
    - `signature`: the signature JAX reads the arguments' names from (in its
      error messages); ``(*args, **kwargs)`` unless given.
    - `traced_for`, `arg_names`: the JAX transform that traces the function
      (``"jit"``) and the name of each of its flat arrays in the user's terms
      (``x``, ``model.layers[0].kernel``): JAX's messages then name those
      rather than `signature`'s parameters (where the installed JAX allows,
      `treemode._compat.name_arguments`).

    **Returns:**

    A function with ``like``'s ``__name__``, ``__qualname__`` and
    ``__module__``, whose ``__wrapped__`` is ``like``'s `source` (JAX reads its
    file and line) and whose signature is ``(*args, **kwargs)`` (the arguments
    are treemode's, not ``like``'s).
    """
    src = source(like)

    def traced(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    traced.__name__ = src.__name__
    traced.__qualname__ = src.__qualname__
    if src.__module__ is not None:
        traced.__module__ = src.__module__
    traced.__wrapped__ = src  # type: ignore[attr-defined]
    traced.__signature__ = signature  # type: ignore[attr-defined]
    if traced_for is not None and arg_names is not None:
        _compat.name_arguments(traced, traced_for, arg_names)
    return traced


# With JAX 0.9 a shared step fails when a scan is called again with inputs of
# another type (the traced output's structure does not match the new step's;
# tests/test_names.py, `make compat` oldest); with 0.10 it works. Below 0.10,
# each step is handed to JAX as its own named function, as before `Stable`.
STABLE_STEPS = tuple(int(p) for p in jax.__version__.split(".")[:2]) >= (0, 10)


class Stable:
    """One named function per (user function, call structure), handed to JAX on
    every call of that structure.

    JAX caches a trace on the identity of the function it traces and the types
    of its inputs. treemode builds its step functions per input types too (see
    `treemode._pipeline._trace_cache`); handing JAX a new step for new shapes would make
    JAX report a function it has "never seen", and one "maybe being re-defined
    repeatedly". The function of a `Stable` is the same object for every input
    type of the structure: it calls the step bound with `bound` for the call
    under way, so JAX's messages compare the new types with the old ones, as
    for a function the user passes to ``jax.lax.scan`` directly.
    """

    __slots__ = ("fn", "like", "_local", "_shared", "_own")

    def __init__(self, like: Any):
        self.like = source(like)  # its name and code only: never the function itself
        self._own: dict[int, tuple[Any, Callable[..., Any]]] = {}  # without STABLE_STEPS
        self._shared: dict[Any, Any] = {}
        self._local = threading.local()
        local = self._local

        def dispatch(*args: Any, **kwargs: Any) -> Any:
            return local.target(*args, **kwargs)

        self.fn = named(dispatch, like)

    def share(self, types: Any, value: Any) -> Any:
        """The value kept for the input ``types`` of `fn` (``value`` if it is the first).

        JAX traces `fn` once per input types and reuses the trace whatever step is
        bound: what a trace records (e.g. metadata updates) belongs to every step
        bound for those types, so they share one `TraceFindings`.
        """
        if not STABLE_STEPS:
            return value
        return self._shared.setdefault(types, value)

    @contextlib.contextmanager
    def bound(self, target: Callable[..., Any]) -> Iterator[Callable[..., Any]]:
        """Within the block, `fn` calls ``target`` (in this thread); yields `fn`."""
        if not STABLE_STEPS:  # one named function per step, as JAX < 0.10 needs
            own = self._own.get(id(target))
            if own is None or own[0] is not target:
                own = self._own[id(target)] = (target, named(target, self.like))
            yield own[1]
            return
        local = self._local
        previous = getattr(local, "target", None)
        local.target = target
        try:
            yield self.fn
        finally:
            local.target = previous


__all__ = ["Source", "Stable", "named", "source"]
