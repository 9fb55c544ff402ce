"""The per-thread binding a `PureFunction` reads its current call from.

A ``threading.local`` with a ``call`` attribute: each thread sees only its own
call, and unbinding one thread leaves the others bound. (A compiled binding
used to replace it; it saved about 0.05 µs per call and was removed, see
docs/performance.md.)"""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import pytest
from flax import nnx

import treemode
from treemode._pipeline import _pure

KINDS: dict[str, Callable[[], Any]] = {"threading.local": threading.local}


@pytest.fixture(params=list(KINDS))
def binding(request: pytest.FixtureRequest) -> Any:
    return KINDS[request.param]()


def _current(binding: Any) -> Any:
    return getattr(binding, "call", None)


def _in_thread(fn: Callable[[], Any]) -> Any:
    result: list[Any] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            result.append(fn())
        except BaseException as e:  # re-raised in the calling thread
            errors.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return result[0]


def test_pure_function_uses_a_thread_local_binding() -> None:
    pure = treemode.jit(lambda x: x)
    pure(jnp.ones(2))
    entry = next(iter(pure._cache.values()))
    assert type(entry.pure.binding) is _pure._Binding is threading.local


def test_unbound_reads_none(binding: Any) -> None:
    assert _current(binding) is None
    binding.call = "a"
    assert binding.call == "a"
    binding.call = None
    assert _current(binding) is None


def test_another_thread_does_not_see_this_threads_call(binding: Any) -> None:
    binding.call = "main"
    assert _in_thread(lambda: _current(binding)) is None
    assert binding.call == "main"


def test_threads_bound_at_once_each_see_their_own(binding: Any) -> None:
    binding.call = "main"  # holds the compiled binding's own slot
    bound = threading.Event()
    release = threading.Event()
    seen: dict[str, Any] = {}

    def worker() -> None:
        binding.call = "worker"  # goes to the other threads' table
        seen["worker"] = binding.call
        bound.set()
        release.wait()
        seen["worker, after main unbound"] = binding.call
        binding.call = None
        seen["worker unbound"] = _current(binding)

    thread = threading.Thread(target=worker)
    thread.start()
    bound.wait()
    seen["main"] = binding.call
    binding.call = None  # frees the slot while the worker is still bound
    seen["main unbound"] = _current(binding)
    release.set()
    thread.join()
    assert seen == {
        "worker": "worker",
        "main": "main",
        "main unbound": None,
        "worker, after main unbound": "worker",
        "worker unbound": None,
    }


def test_rebinding_moves_a_thread_into_the_free_slot(binding: Any) -> None:
    binding.call = "main"
    release = threading.Event()
    bound = threading.Event()

    def worker() -> list[Any]:
        binding.call = "worker"
        bound.set()
        release.wait()
        binding.call = "worker again"  # the slot is free now
        out = [binding.call]
        binding.call = None
        out.append(_current(binding))
        return out

    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(worker()))
    thread.start()
    bound.wait()
    binding.call = None
    release.set()
    thread.join()
    assert result == [["worker again", None]]
    assert _current(binding) is None


def test_deleting_unbinds(binding: Any) -> None:
    binding.call = "a"
    del binding.call
    assert _current(binding) is None


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_bound_cycle_is_collected(kind: str) -> None:
    class Holder:
        pass

    binding = KINDS[kind]()
    holder = Holder()
    holder.binding = binding  # type: ignore[attr-defined]
    binding.call = holder
    alive = weakref.ref(holder)
    del holder, binding
    gc.collect()
    assert alive() is None


def test_a_retrace_on_another_thread_sees_its_own_call() -> None:
    """A call traced on a worker while the main thread's call holds the slot."""

    class Counter(nnx.Module):
        def __init__(self) -> None:
            self.n = nnx.BatchStat(jnp.array(0))

    traced_on: list[str] = []

    @treemode.jit
    def bump(c: Counter, x: jnp.ndarray) -> jnp.ndarray:
        traced_on.append(threading.current_thread().name)
        c.n[...] += 1
        return x + 1

    main, worker = Counter(), Counter()
    bump(main, jnp.ones(2))
    entry = next(iter(bump._cache.values()))
    entry.pure.binding.call = "a call of the main thread"  # occupies the slot

    def run() -> Any:
        return bump(worker, jnp.ones(3))  # a new shape: traced on this thread

    try:
        out = _in_thread(run)
    finally:
        entry.pure.binding.call = None
    assert out.tolist() == [2.0, 2.0, 2.0]
    assert int(worker.n[...]) == 1 and int(main.n[...]) == 1
    assert len(traced_on) == 2
