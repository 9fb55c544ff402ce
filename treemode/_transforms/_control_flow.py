"""``treemode.while_loop`` and ``fori_loop``.

The loops keep in their state only the free arrays of the loop value and the
Variables the body changes (see `treemode._transforms._loop`). The branches,
``cond`` and ``switch``, are `treemode._transforms._cond`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import jax
import jax.numpy as jnp

from .._errors import StructureError, TreemodeError
from .._pipeline import _call, _core, _pure
from .._pipeline._trace_cache import avals, cache_for, call_current_fn
from ._loop import (
    LoopState,
    abstract,
    carry_structure,
    check_carry_out,
    inner_arrays,
    probe_changed,
    rebuild_carry,
    scalars_to_arrays,
)
from ._names import Stable
from ._signature import suggests_keywords

# What the loops return: the body's result type.
R = TypeVar("R")


@contextlib.contextmanager
def _init_val_paths() -> Iterator[None]:
    """Name the loop value ``init_val`` (not ``args[0]``) in error messages."""
    try:
        yield
    except TreemodeError as e:
        if e.args and isinstance(e.args[0], str):
            e.args = (e.args[0].replace("args[0]", "init_val"), *e.args[1:])
        raise


def _loop_call(
    transform: str, body_fun: Callable[..., Any], init_val: Any, graph: bool
) -> tuple[_call.Call, Any]:
    init_val = scalars_to_arrays(init_val)
    return _call.prepare(transform, body_fun, (init_val,), {}, graph=graph), init_val


class _LoopEntry:
    """What a loop over one call structure needs, built once (see
    `treemode._pipeline._trace_cache`).

    ``step(state)`` (``while_loop``) and ``indexed_step(i, state)``
    (``fori_loop``) are handed to JAX: the same objects on every call, functions
    of their inputs only. The loop index reaches the user function through a
    thread-local slot, set around each call of ``pure``.
    """

    __slots__ = ("pure", "loop", "structure", "step", "indexed_step", "cond", "cond_extra")

    def __init__(self, transform: str, call: _call.Call, index_aval: Any = None):
        structure = carry_structure(call, 0, "init_val")
        index = threading.local()

        def make_body(pure: _pure.PureFunction) -> Callable[..., Any]:
            fn = call_current_fn(pure)

            def body(val: Any) -> list[Any]:
                i, index.value = getattr(index, "value", None), None  # never keep a tracer
                inner = inner_arrays(structure, val)
                out = fn(val) if index_aval is None else fn(i, val)
                return check_carry_out(transform, structure, val, out, inner)

            return body

        def set_index(extra: Sequence[Any]) -> None:
            if extra:
                index.value = extra[0]

        state_vars: frozenset[int] = frozenset()
        if call.variables:
            probe = _pure.PureFunction(call)
            probe.fn = make_body(probe)
            avals_ = [abstract(x) for x in call.dynamic]
            extra = [] if index_aval is None else [index_aval]
            try:
                state_vars = probe_changed(probe, call, avals_, extra=extra, before=set_index)
            finally:
                index.value = None
        pure = _pure.PureFunction(call, force_updates=state_vars)
        pure.fn = make_body(pure)
        loop = LoopState(transform, call, structure.free, state_vars)

        def step(state: Any, i: Any = None) -> Any:
            index.value = i
            try:
                free_out, updates = pure(*loop.assemble(state))
            finally:
                index.value = None
            return loop.next_state(pure.call, state, free_out, updates)

        def indexed_step(i: Any, state: Any) -> Any:
            return step(state, i)

        self.pure = pure
        self.loop = loop
        self.structure = structure
        self.step = step
        self.indexed_step = indexed_step
        self.cond: Callable[..., Any] | None = None
        self.cond_extra: list[int] = []

    def run(
        self,
        call: _call.Call,
        init_val: Any,
        run: Callable[[Any], Any],
        others: Sequence[tuple[_pure.PureFunction, _call.Call]] = (),
    ) -> Any:
        """Run the JAX loop (``run(initial state)`` returns the final state), write back.

        ``others`` are the further pure functions the loop traces (its condition).
        """

        def jax_call() -> tuple[Any, Any]:
            _, free, values, *_ = run(self.loop.init(call.dynamic))
            return free, self.loop.final_updates(values)

        free = _core.run(call, [(self.pure, call), *others], jax_call, finish=False)
        return rebuild_carry(init_val, self.structure, free)


@suggests_keywords
def while_loop(
    cond_fun: Callable[[Any], Any],
    body_fun: Callable[[Any], R],
    init_val: Any,
    *,
    graph: bool = False,
) -> R:
    """`jax.lax.while_loop` over values that may hold modules, with Variable write-back.

    `body_fun(val)` changes the Variables of `val` in place and returns `val`
    (the same modules and Variables; arrays in plain containers may be new).
    Variables of modules that `body_fun` or `cond_fun` reach through their
    closure work too. Only the Variables that `body_fun` changes are carried
    through the loop; after it, they hold their final values.

    **Arguments:**

    - `cond_fun`: `val -> bool scalar`; must not change Variables.
    - `body_fun`: `val -> val`.
    - `init_val`: the initial value (modules, pytrees, arrays).
    - `graph`: if `True`, `init_val` may share Modules/Variables.

    **Returns:**

    The final value: the same modules as `init_val`, updated, with the final
    free arrays.

    **Raises:**

    `AliasError` when a Variable is reachable twice from `init_val` (Flax's tree
    mode silently loses one of the updates there), `StructureError` when
    `body_fun` returns different objects, another structure or other types.

    ```python
    import jax.numpy as jnp
    import treemode
    from flax import nnx

    class Counter(nnx.Module):
        def __init__(self):
            self.count = nnx.BatchStat(jnp.array(0))

    def body(val):
        counter, x = val
        counter.count[...] += 1
        return counter, x * 2

    counter = Counter()
    out, x = treemode.while_loop(lambda v: v[1] < 100, body, (counter, 1))
    assert out is counter and int(counter.count[...]) == 7 and int(x) == 128
    ```
    """
    with _init_val_paths():
        return _while_loop(cond_fun, body_fun, init_val, graph)


def _while_loop(
    cond_fun: Callable[[Any], Any], body_fun: Callable[[Any], Any], init_val: Any, graph: bool
) -> Any:
    call, init_val = _loop_call("while_loop", body_fun, init_val, graph)
    cond_call = _call.prepare("while_loop", cond_fun, (init_val,), {}, graph=graph)
    # cond_fun's closure Variables: the body's (their index) or its own (-1).
    body_index = {id(v): i for i, v in enumerate(call.variables)}
    n_arg_vars = sum(len(f.variables) for f in call.arg_flats)
    shared = tuple(body_index.get(id(v), -1) for v in cond_call.variables[n_arg_vars:])
    cache = cache_for([cond_fun, body_fun], ("while_loop", graph))
    entry = cache.get(
        (call.key, cond_call.key, shared, avals(call.dynamic), avals(cond_call.dynamic)),
        lambda: _while_entry(call, cond_call, shared),
    )
    cond = entry.cond
    assert cond is not None
    extra = [cond_call.dynamic[j] for j in entry.cond_extra]
    # What JAX traces: named like the user's functions, the same objects for every
    # input type of this structure (`treemode._transforms._names.Stable`).
    names = cache.get(
        ("names", call.key, cond_call.key, shared),
        lambda: (Stable(cond_fun), Stable(body_fun)),
    )

    def run(state: Any) -> Any:
        with names[0].bound(cond) as cond_fn, names[1].bound(entry.step) as step:
            return jax.lax.while_loop(cond_fn, step, (*state, extra))

    return entry.run(call, init_val, run, [(entry.cond_pure, cond_call)])


class _WhileEntry(_LoopEntry):
    """A `_LoopEntry` with ``cond_fun``: its inputs are the body's plus ``cond_extra``.

    ``cond_extra`` (indices into the condition call's dynamic arrays) are the
    arrays of the condition's own closure Variables; they ride in the loop
    state after the body's entries.
    """

    __slots__ = ("cond_pure",)


def _while_entry(call: _call.Call, cond_call: _call.Call, shared: tuple[int, ...]) -> _WhileEntry:
    entry = _WhileEntry("while_loop", call)
    cond_pure = _pure.PureFunction(cond_call)
    cond_pure.fn = call_current_fn(cond_pure)
    loop = entry.loop
    n_arg_dyn = sum(len(f.dynamic) for f in call.arg_flats)
    n_arg_vars = len(cond_call.variables) - len(shared)
    cond_ranges = cond_call.variable_dynamic_ranges()
    # Per array of the condition's inputs: (True, index into the body's
    # dynamic arrays) or (False, index into the extra arrays).
    sources: list[tuple[bool, int]] = [(True, j) for j in range(n_arg_dyn)]
    for k, i in enumerate(shared):
        rng = cond_ranges[n_arg_vars + k]
        if i >= 0:
            sources += [(True, j) for j in loop.ranges[i]]
        else:
            sources += [(False, len(entry.cond_extra) + m) for m in range(len(rng))]
            entry.cond_extra.extend(rng)

    def cond(state: Any) -> Any:
        body_dynamic = loop.assemble(state)
        extra = state[3]
        dynamic = [body_dynamic[j] if own else extra[j] for own, j in sources]
        out, updates = cond_pure(*dynamic)
        changed = [i for i, u in enumerate(updates) if u is not None]
        if changed:
            bound = cond_pure.call
            path = bound.variable_paths()[changed[0]]
            raise StructureError(
                f"treemode.while_loop: cond_fun changed the "
                f"{type(bound.variables[changed[0]]).__name__} at {path}. The "
                "condition of a loop must only read state; change it in body_fun."
            )
        return out

    entry.cond = cond
    entry.cond_pure = cond_pure
    return entry


@suggests_keywords
def fori_loop(
    lower: Any,
    upper: Any,
    body_fun: Callable[[Any, Any], R],
    init_val: Any,
    *,
    unroll: int | bool | None = None,
    graph: bool = False,
) -> R:
    """`jax.lax.fori_loop` over values that may hold modules, with Variable write-back.

    `body_fun(i, val)` changes the Variables of `val` (or of modules in its
    closure) in place and returns `val`. Like `jax.lax.fori_loop`, static
    bounds give a scan (reverse-mode differentiable).

    **Arguments:**

    - `lower`, `upper`: loop bounds (`i` runs over `lower <= i < upper`).
    - `body_fun`: `(i, val) -> val`.
    - `init_val`: the initial value (modules, pytrees, arrays).
    - `unroll`: as in `jax.lax.fori_loop`.
    - `graph`: if `True`, `init_val` may share Modules/Variables.

    **Returns:**

    The final value (the same modules as `init_val`, updated).

    **Raises:**

    As `treemode.while_loop`.

    ```python
    import jax.numpy as jnp
    import treemode
    from flax import nnx

    class Acc(nnx.Module):
        def __init__(self):
            self.total = nnx.Variable(jnp.array(0.0))

    def body(i, acc):
        acc.total[...] += i
        return acc

    acc = Acc()
    assert treemode.fori_loop(0, 5, body, acc) is acc
    assert float(acc.total[...]) == 10.0
    ```
    """
    index_aval = jax.ShapeDtypeStruct((), jnp.result_type(lower, upper))
    with _init_val_paths():
        call, init_val = _loop_call("fori_loop", body_fun, init_val, graph)
        cache = cache_for([body_fun], ("fori_loop", graph))
        entry = cache.get(
            (call.key, index_aval, avals(call.dynamic)),
            lambda: _LoopEntry("fori_loop", call, index_aval),
        )

        name = cache.get(("name", call.key), lambda: Stable(body_fun))

        def run(state: Any) -> Any:
            with name.bound(entry.indexed_step) as step:
                return jax.lax.fori_loop(lower, upper, step, state, unroll=unroll)

        return entry.run(call, init_val, run)


__all__ = ["fori_loop", "while_loop"]
