"""The orchestrator every treemode transform runs through: steps 2 and 6 of the pipeline.

The pipeline of one transform call, each step in its own module:

1. prepare the call, outside JAX (`treemode._pipeline._call.prepare`): flatten the
   arguments, lift closure Variables, reject aliases, build the cache key;
2. bind the call to its pure function and call the JAX transform (`run`);
3. inside JAX, the pure function (`treemode._pipeline._pure.PureFunction`) rebuilds the
   arguments, calls the user function, checks structure and outputs and
   returns ``(output, updates)``;
4. explain a JAX failure in the caller's terms (`treemode._pipeline._explain`);
5. check that every target may be written and write back, all or nothing
   (`treemode._pipeline._writeback`);
6. finish: ``from_tree`` of the output in graph mode.

A transform file only says what is special about its JAX transform: it
prepares its call, builds (and caches) its `PureFunction`, and hands `run` a
function that calls the JAX transform.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .._tree import _graph
from ._call import PreparedCall
from ._explain import EXPLAINED, EXPLAINED_OR_NAMING, raise_explained
from ._pure import PureFunction
from ._writeback import WriteBack, write_back, write_back_all


class WriteBacks(tuple[WriteBack, ...]):
    """Several candidate write-backs, made all or nothing (the branches of ``cond``)."""

    __slots__ = ()


Bindings = PureFunction | Sequence[tuple[PureFunction, PreparedCall]]


def run(
    call: PreparedCall,
    pure: Bindings,
    jax_call: Callable[[], tuple[Any, Any]],
    *,
    finish: bool = True,
    split: tuple[Sequence[int], Sequence[int]] | None = None,
) -> Any:
    """Run one prepared call: bind, call JAX, explain a failure, write back, finish.

    ``pure`` is the `PureFunction` the JAX transform traces (``call`` is bound
    to it), or ``(pure function, call)`` pairs when it traces several (a
    loop's condition and body, the branches of ``cond``). ``jax_call()`` calls
    the JAX transform and returns ``(out, writes)``, ``writes`` being ``None``
    (nothing to write), the updates of ``call.variables`` (written with the
    metadata updates the first pure function's trace recorded), a `WriteBack`
    or `WriteBacks`. Returns ``out``, through ``from_tree`` in graph mode
    unless ``finish`` is false (the transform then finishes what it returns).
    ``split`` says how an executable with donated arrays takes them (see
    `raise_explained`).
    """
    single = isinstance(pure, PureFunction)  # one trace (most transforms): bound directly
    if single:
        pure.binding.call = call
    else:
        for p, c in pure:
            p.bind(c)
    try:
        out, writes = jax_call()
    except EXPLAINED_OR_NAMING as e:
        raise_explained(call, e, split)
    finally:
        if single:
            pure.binding.call = None
        else:
            for p, _ in pure:
                p.bind(None)
    if writes is not None:
        kind = type(writes)
        if kind is WriteBack:
            write_back(*writes)
        elif kind is WriteBacks:
            write_back_all(writes)
        else:
            first = pure if single else pure[0][0]
            write_back(call, writes, first.findings.metadata_updates)
    return _graph.from_tree(out) if finish and call.graph else out


class bound:
    """``with bound(pure, call):`` binds ``call`` to ``pure`` and explains a failure.

    For the traces a transform runs besides its main one (the abstract probe of
    a loop body, the rules of ``custom_vjp`` traced by an outer transform).
    """

    __slots__ = ("pure", "call")

    def __init__(self, pure: PureFunction, call: PreparedCall):
        self.pure = pure
        self.call = call

    def __enter__(self) -> None:
        self.pure.bind(self.call)

    def __exit__(self, kind: Any, error: Any, traceback: Any) -> None:
        self.pure.bind(None)
        if error is not None and isinstance(error, EXPLAINED):
            raise_explained(self.call, error)


def finish(call: PreparedCall, out: Any) -> Any:
    """Turn a transform's output tree back into objects (graph mode)."""
    return _graph.from_tree(out) if call.graph else out


__all__ = ["WriteBacks", "bound", "finish", "run"]
