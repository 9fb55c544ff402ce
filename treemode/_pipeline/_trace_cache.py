"""What an eager transform builds once per call structure, so that JAX's trace cache hits.

`jax.lax.scan`, `while_loop`, `fori_loop`, `cond` and `switch` cache the jaxpr
of the function they trace on the identity of that function object and the
abstract values of its inputs (``pe.trace_to_jaxpr`` is a weakref LRU cache),
and an eager call then reuses the compiled primitive too. A treemode transform
hands JAX a wrapper around the user function; if the wrapper is new on every
call, every call traces and compiles again.

So each of these transforms keeps one *entry* per (user function, transform
options, `CallKey`, input avals): the `PureFunction` and the wrapper callables
handed to JAX. The current `Call` is bound to the `PureFunction` for the
duration of the JAX call (thread-locally), as `treemode.jit` does. Rules for
an entry:

- it holds structure only (indices, specs, abstract values), never arrays,
  tracers or the caller's objects. Every value the wrapper needs reaches it as
  an input of the JAX transform: a value the wrapper closed over would be
  baked into JAX's cached jaxpr and reused by the next call;
- it does not hold the user function strongly (`call_current_fn`), so an entry
  stored under the function does not keep it (or a bound method's module) alive.

``jax.vmap`` and ``jax.grad`` have no such cache when called eagerly: they run
the function op by op under a batching or JVP trace on every call, plain JAX
included, so there is nothing to hit there.
"""

from __future__ import annotations

import inspect
import threading
import weakref
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Generic, TypeVar

import jax

from .. import _caches
from . import _pure

E = TypeVar("E")


class TraceCache(Generic[E]):
    """Entries by key, each built once (by the first call that needs it)."""

    __slots__ = ("_entries", "__weakref__")

    def __init__(self) -> None:
        self._entries: dict[Hashable, E] = {}
        _caches.track(self)

    def get(self, key: Hashable, build: Callable[[], E]) -> E:
        """The entry for ``key``; ``build()`` makes it on a miss (errors are not cached)."""
        entry = self._entries.get(key)
        if entry is None:
            # Two threads missing at once both build; the first stored entry wins.
            entry = self._entries.setdefault(key, build())
        return entry

    def clear(self) -> None:
        self._entries.clear()

    clear_cache = clear  # what `treemode.clear_caches` calls

    def __len__(self) -> int:
        return len(self._entries)


def avals(values: Sequence[Any]) -> tuple[Any, ...]:
    """The abstract values of the dynamic arrays: part of every entry's key.

    What an entry learns by tracing (e.g. which Variables a loop body changes)
    may depend on shapes and dtypes, so each set of input types gets its own.
    """
    return tuple(map(jax.typeof, values))


def call_current_fn(pure: _pure.PureFunction) -> Callable[..., Any]:
    """A stand-in for ``pure.fn`` that calls the function of the bound `Call`.

    The entry then refers to the user function only while a call is bound.
    """

    def current_fn(*args: Any, **kwargs: Any) -> Any:
        return pure.user_fn(*args, **kwargs)

    return current_fn


# -- caches stored per user function -----------------------------------------------------

_Parts = tuple[Any, ...]


class _FunctionCaches:
    """The caches of one tuple of user functions, one per set of transform options."""

    __slots__ = ("refs", "by_options")

    def __init__(self, refs: tuple[weakref.ref[Any], ...]):
        self.refs = refs
        self.by_options: dict[Hashable, TraceCache[Any]] = {}


_registry: dict[tuple[int, ...], _FunctionCaches] = {}
# Reentrant: a weakref callback may run (garbage collection) while the lock is held.
_registry_lock = threading.RLock()
_caches.register(_registry.clear)


def _identity(fn: Any) -> _Parts:
    """The objects whose identity makes a callable the same one for JAX's caches.

    A bound method is a new object at each attribute access: it is the same
    method while its function and its instance are the same.
    """
    if inspect.ismethod(fn):
        return (fn.__func__, fn.__self__)
    return (fn,)


def _is_plain(x: Any) -> bool:
    """Options that may be stored in a shared key without keeping user objects alive."""
    if x is None or isinstance(x, (bool, int, float, complex, str, type)):
        return True
    if isinstance(x, (tuple, frozenset)):
        return all(map(_is_plain, x))
    return False


def cache_for(fns: Sequence[Callable[..., Any]], options: Any) -> TraceCache[Any]:
    """The cache shared by every call of ``fns`` (the user functions) with ``options``.

    ``options`` holds the transform's own parameters (name, axes, length, ...).
    The cache lives as long as the functions do. A function that cannot be
    weakly referenced, or options that are not plain values (e.g. a
    module-shaped axis prefix), get a fresh private cache: the caller keeps it
    for as long as it lives (a wrapper object), or the call is not cached.
    """
    if not _is_plain(options):
        return TraceCache()
    parts = tuple(p for fn in fns for p in _identity(fn))
    ids = tuple(map(id, parts))
    with _registry_lock:
        caches = _registry.get(ids)
        if caches is None or any(r() is not p for r, p in zip(caches.refs, parts, strict=True)):
            try:
                refs = tuple(weakref.ref(p, _forget(ids)) for p in parts)
            except TypeError:  # not weakly referenceable: nothing to key it on
                return TraceCache()
            caches = _registry[ids] = _FunctionCaches(refs)
        cache = caches.by_options.get(options)
        if cache is None:
            cache = caches.by_options[options] = TraceCache()
        return cache


def _forget(ids: tuple[int, ...]) -> Callable[[Any], None]:
    def forget(ref: weakref.ref[Any]) -> None:
        with _registry_lock:
            caches = _registry.get(ids)
            if caches is not None and any(r is ref for r in caches.refs):
                del _registry[ids]

    return forget


__all__ = ["TraceCache", "avals", "cache_for", "call_current_fn"]
