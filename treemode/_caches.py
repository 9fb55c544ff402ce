"""Every cache treemode keeps, registered in one place: `treemode.clear_caches`.

A module that keeps a cache registers how to clear it, next to the cache:
``register(_cache.clear)`` for a module-level table, ``track(obj)`` for an
object that owns entries (a jitted wrapper, a trace cache), which must have a
``clear_cache()`` method and is held weakly. `clear_caches` runs them all.

This module imports nothing from treemode: every layer may register here.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any, Protocol


class _Clearable(Protocol):
    def clear_cache(self) -> None: ...


_clearers: list[Callable[[], None]] = []
_tracked: weakref.WeakSet[Any] = weakref.WeakSet()
_lock = threading.Lock()


def register(clear: Callable[[], None]) -> Callable[[], None]:
    """Register ``clear()``, which empties one module-level cache; returns ``clear``."""
    with _lock:
        _clearers.append(clear)
    return clear


def track(owner: _Clearable) -> None:
    """Clear ``owner.clear_cache()`` with the others while ``owner`` lives (held weakly)."""
    with _lock:
        _tracked.add(owner)


def clear_caches() -> None:
    """Clear every cache treemode keeps; the next call of each transform traces again.

    treemode caches what it learnt from the first call of each call structure:
    the flattening of each argument, the closure search of each function, the
    pure function it hands to JAX and the `jax.jit` wrapper built for it, the
    trace caches of the loops and of `scan`, and the fast-path records of a
    `treemode.jit` function's last calls. `jax.clear_caches()` empties JAX's caches, those of
    the `jax.jit` wrappers treemode holds included (so a `treemode.jit`
    function traces again), but none of treemode's own. `treemode.clear_caches()`
    empties treemode's: its wrappers and entries go, and with them the last
    references to their compiled executables (to free memory, or to measure a
    cold call again). It leaves JAX's caches alone: call both to start from
    nothing. Wrapped functions stay usable: their next call traces and compiles
    again, and gives the same values and write-backs as before.

    **Arguments:**

    None.

    **Returns:**

    `None`.

    ```python
    import jax.numpy as jnp
    import treemode
    from flax import nnx

    traces = []

    @treemode.jit
    def step(model, x):
        traces.append(1)  # runs once per trace
        model.count[...] += 1
        return x + 1

    class Model(nnx.Module):
        def __init__(self):
            self.count = nnx.BatchStat(jnp.array(0))

    m = Model()
    step(m, 1.0)
    step(m, 1.0)
    assert len(traces) == 1  # the second call reused the trace
    treemode.clear_caches()
    assert step(m, 1.0) == 2.0
    assert len(traces) == 2 and m.count[...] == 3  # traced again; still written back
    ```
    """
    with _lock:
        clearers = list(_clearers)
        owners = list(_tracked)
    for clear in clearers:
        clear()
    for owner in owners:
        owner.clear_cache()


__all__ = ["clear_caches", "register", "track"]
