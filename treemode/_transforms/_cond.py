"""``treemode.cond`` and ``switch``.

Every branch is traced on the union of the inputs of all branches: the
operands' arrays, then the Variables each branch reaches through its closure.
Each returns its output and the values of the Variables any branch changes
(`_BranchEntry.written`), its own new value or its input passed through, so a
Variable changed by one branch only is written back correctly. The branches
must change the metadata of a Variable alike (`_merged_metadata`). The loops
are `treemode._transforms._control_flow`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax

from .._errors import StructureError
from .._pipeline import _call, _core, _pure, _writeback
from .._pipeline._trace_cache import avals, cache_for, call_current_fn
from ._loop import abstract, probe_changed, type_error, type_problem, variable_specs
from ._names import Stable
from ._signature import UNSPECIFIED, legacy_operand, suggests_keywords

# What the branches return: the branch's result type.
R = TypeVar("R")


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


__all__ = ["cond", "switch"]
