"""``treemode.while_loop``, ``fori_loop``, ``cond`` and ``switch``.

The loops keep in their state only the free arrays of the loop value and the
Variables the body changes (see `treemode._transforms._loop`); the branches of
``cond``/``switch`` return the union of the Variables any branch changes, the
others passing their input value through, so a Variable changed by one branch
only is written back correctly.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import jax
import jax.numpy as jnp

from .._errors import StructureError, TreemodeError
from .._pipeline import _call, _core, _pure, _writeback
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
    type_error,
    type_problem,
    variable_specs,
)
from ._names import Stable
from ._signature import UNSPECIFIED, legacy_operand, suggests_keywords

# What the loops and branches return: the body's or branch's result type.
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


# -- cond / switch ---------------------------------------------------------------------


def _branches(
    transform: str,
    branches: Sequence[Callable[..., Any]],
    operands: tuple[Any, ...],
    graph: bool,
    run: Callable[[list[Callable[..., Any]], list[Any]], Any],
) -> Any:
    calls = [_call.prepare(transform, fn, operands, {}, graph=graph) for fn in branches]
    main = calls[0]
    n_arg_dyn = sum(len(f.dynamic) for f in main.arg_flats)
    n_arg_vars = sum(len(f.variables) for f in main.arg_flats)
    # The union of every branch's Variables: operands first, then closures.
    union: list[Any] = list(main.variables[:n_arg_vars])
    union_dyn: list[range] = list(main.variable_dynamic_ranges()[:n_arg_vars])
    dynamic: list[Any] = list(main.dynamic[:n_arg_dyn])
    slot = {id(v): i for i, v in enumerate(union)}
    for c in calls:
        if len(c.variables) == n_arg_vars:
            continue
        ranges = c.variable_dynamic_ranges()
        for k in range(n_arg_vars, len(c.variables)):
            var = c.variables[k]
            if id(var) in slot:
                continue
            slot[id(var)] = len(union)
            union.append(var)
            union_dyn.append(range(len(dynamic), len(dynamic) + len(ranges[k])))
            dynamic.extend(c.dynamic[j] for j in ranges[k])
    to_union = tuple(tuple(slot[id(v)] for v in c.variables) for c in calls)
    cache = cache_for(branches, (transform, graph))
    entry = cache.get(
        (tuple(c.key for c in calls), to_union, avals(dynamic)),
        lambda: _BranchEntry(transform, calls, to_union, union_dyn, n_arg_dyn, n_arg_vars, dynamic),
    )
    pures = entry.pures
    names = cache.get(
        ("names", tuple(c.key for c in calls), to_union),
        lambda: [Stable(fn) for fn in branches],
    )

    def jax_call() -> tuple[Any, Any]:
        with contextlib.ExitStack() as stack:
            fns = [stack.enter_context(n.bound(f)) for n, f in zip(names, entry.fns, strict=True)]
            out, values = run(fns, dynamic)
        metadata = _merged_metadata(transform, calls, pures, to_union)
        by_union = dict(zip(entry.written, values, strict=True))
        done: set[int] = set()
        # One write-back per branch call (their closure Variables differ).
        writes = []
        for b, c in enumerate(calls):
            ups: list[Any] = []
            for u in to_union[b]:
                ups.append(by_union.get(u) if u not in done else None)
                if u in by_union:
                    done.add(u)
            meta = {k: metadata[u] for k, u in enumerate(to_union[b]) if u in metadata}
            writes.append(_writeback.WriteBack(c, ups, meta))
        return out, _core.WriteBacks(writes)

    return _core.run(main, list(zip(pures, calls, strict=True)), jax_call)


class _BranchEntry:
    """The branches of one ``cond``/``switch`` call structure, built once.

    Every branch takes the union of all branches' inputs (the operands' arrays,
    then every branch's closure Variables) and returns its output and the
    values of the Variables any branch changes (``written``, indices into the
    union), its own new value or the input passed through. ``fns`` are handed
    to JAX: the same objects on every call (see `treemode._pipeline._trace_cache`).
    """

    __slots__ = ("pures", "fns", "written")

    def __init__(
        self,
        transform: str,
        calls: list[_call.Call],
        to_union: tuple[tuple[int, ...], ...],
        union_dyn: list[range],
        n_arg_dyn: int,
        n_arg_vars: int,
        dynamic: list[Any],
    ):

        def own_dynamic(b: int, combined: Sequence[Any]) -> list[Any]:
            out = list(combined[:n_arg_dyn])
            for u in to_union[b][n_arg_vars:]:
                out.extend(combined[j] for j in union_dyn[u])
            return out

        # Which Variables does any branch change? (one abstract trace per branch)
        changed: set[int] = set()
        input_avals = [abstract(x) for x in dynamic]
        for b, c in enumerate(calls):
            probe = _pure.PureFunction(c)
            probe.fn = call_current_fn(probe)
            changed |= {
                to_union[b][k] for k in probe_changed(probe, c, own_dynamic(b, input_avals))
            }
        written = sorted(changed)
        pures = [
            _pure.PureFunction(
                c, force_updates=frozenset(k for k, u in enumerate(to_union[b]) if u in changed)
            )
            for b, c in enumerate(calls)
        ]
        for p in pures:
            p.fn = call_current_fn(p)
        specs: dict[int, Any] = {}
        for b, c in enumerate(calls):
            for k, spec in enumerate(variable_specs(c)):
                specs.setdefault(to_union[b][k], spec)

        def make_branch(b: int) -> Callable[..., Any]:
            def branch(*combined: Any) -> tuple[Any, list[Any]]:
                out, updates = pures[b](*own_dynamic(b, combined))
                new = {to_union[b][k]: u for k, u in enumerate(updates) if u is not None}
                values = []
                for u in written:
                    before = specs[u].build([combined[j] for j in union_dyn[u]])
                    after = new.get(u, before)
                    problem = type_problem(before, after)
                    if problem is not None:
                        bound = [p.call for p in pures]
                        path = _path_of(bound, to_union, u)
                        raise type_error(
                            transform, path, f"the {_type_of(bound, to_union, u)}", problem
                        )
                    values.append(after)
                extra = set(new) - changed
                if extra:
                    path = _path_of([p.call for p in pures], to_union, min(extra))
                    raise StructureError(
                        f"treemode.{transform}: the Variable at {path} was left unchanged when "
                        "the branch was first traced but changed when it was traced again."
                    )
                return out, values

            return branch

        self.pures = pures
        self.fns = [make_branch(b) for b in range(len(calls))]
        self.written = written


def _type_of(calls: list[_call.Call], to_union: Sequence[Sequence[int]], u: int) -> str:
    for c, mapping in zip(calls, to_union, strict=True):
        if u in mapping:
            return type(c.variables[mapping.index(u)]).__name__
    raise AssertionError(u)  # pragma: no cover


def _path_of(calls: list[_call.Call], to_union: Sequence[Sequence[int]], u: int) -> str:
    for c, mapping in zip(calls, to_union, strict=True):
        if u in mapping:
            return c.variable_paths()[mapping.index(u)]
    raise AssertionError(u)  # pragma: no cover


def _merged_metadata(
    transform: str,
    calls: list[_call.Call],
    pures: list[_pure.PureFunction],
    to_union: Sequence[Sequence[int]],
) -> dict[int, dict[str, Any]]:
    merged: list[dict[int, dict[str, Any]]] = [
        {to_union[b][k]: m for k, m in p.findings.metadata_updates.items()}
        for b, p in enumerate(pures)
    ]
    first = merged[0]
    for other in merged[1:]:
        if other != first:
            u = min(set(first) ^ set(other) or set(first) | set(other))
            raise StructureError(
                f"treemode.{transform}: the branches change the metadata of the Variable "
                f"at {_path_of(calls, to_union, u)} differently. Metadata is static, so "
                "it cannot depend on which branch runs; change it outside the branch."
            )
    return first


@suggests_keywords
def cond(
    pred: Any,
    true_fun: Callable[..., R],
    false_fun: Callable[..., R],
    *operands: Any,
    operand: Any = UNSPECIFIED,
    graph: bool = False,
) -> R:
    """`jax.lax.cond` over operands that may hold modules, with Variable write-back.

    A Variable changed by one branch only is handled: the other branch passes
    its value through, so after the call it holds the value of the branch that
    ran. Both branches must return outputs of the same structure and types.

    **Arguments:**

    - `pred`: scalar boolean (or integer) selecting `true_fun` when true.
    - `true_fun`, `false_fun`: called as `fn(*operands)`.
    - `*operands`: modules, pytrees, arrays.
    - `operand`: JAX's older keyword form of a single operand.
    - `graph`: if `True`, operands may share Modules/Variables.

    **Returns:**

    The output of the branch that ran.

    ```python
    import jax.numpy as jnp
    import treemode
    from flax import nnx

    class Counter(nnx.Module):
        def __init__(self):
            self.count = nnx.BatchStat(jnp.array(0))

    def bump(c, x):
        c.count[...] += 1
        return x + 1

    counter = Counter()
    y = treemode.cond(jnp.array(True), bump, lambda c, x: x, counter, jnp.array(1.0))
    assert float(y) == 2.0 and int(counter.count[...]) == 1
    treemode.cond(jnp.array(False), bump, lambda c, x: x, counter, jnp.array(1.0))
    assert int(counter.count[...]) == 1
    ```
    """
    operands = legacy_operand("cond", operands, operand)
    return _branches(
        "cond",
        [true_fun, false_fun],
        operands,
        graph,
        lambda fns, dyn: jax.lax.cond(pred, fns[0], fns[1], *dyn),
    )


@suggests_keywords
def switch(
    index: Any,
    branches: Sequence[Callable[..., R]],
    *operands: Any,
    operand: Any = UNSPECIFIED,
    graph: bool = False,
) -> R:
    """`jax.lax.switch` over operands that may hold modules, with Variable write-back.

    Like `treemode.cond` with any number of branches; `index` is clamped
    to the valid range as in JAX.

    **Arguments:**

    - `index`: integer scalar selecting the branch.
    - `branches`: sequence of functions called as `fn(*operands)`.
    - `*operands`: modules, pytrees, arrays.
    - `operand`: JAX's older keyword form of a single operand.
    - `graph`: if `True`, operands may share Modules/Variables.

    **Returns:**

    The output of the selected branch.

    ```python
    import jax.numpy as jnp
    import treemode
    from flax import nnx

    class Acc(nnx.Module):
        def __init__(self):
            self.total = nnx.Variable(jnp.array(0.0))

    def add(k):
        def branch(acc):
            acc.total[...] += k
        return branch

    acc = Acc()
    for i in [0, 2, 2]:
        treemode.switch(jnp.array(i), [add(1.0), add(10.0), add(100.0)], acc)
    assert float(acc.total[...]) == 201.0
    ```
    """
    operands = legacy_operand("switch", operands, operand)
    branches = list(branches)
    if not branches:
        raise ValueError("treemode.switch: branches is empty; give at least one function.")
    return _branches(
        "switch",
        branches,
        operands,
        graph,
        lambda fns, dyn: jax.lax.switch(index, fns, *dyn),
    )


__all__ = ["cond", "fori_loop", "switch", "while_loop"]
