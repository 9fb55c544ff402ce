"""``treemode.jit`` and ``treemode.jit_partial``."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence
from typing import (
    TYPE_CHECKING,
    Any,
    Concatenate,
    Generic,
    ParamSpec,
    TypeVar,
    Unpack,
    overload,
)

import jax

from .. import _caches, _compat
from .._accel import _compiled
from .._accel._border import miss_result
from .._pipeline import _call, _callsite, _core, _explain, _interrupts, _pure, _retrace, _writeback
from .._pipeline._callsite import CallSite
from .._pipeline._executor import PyFastCall
from .._tree._flatten import check_no_aliases
from ._jit_entry import (
    JittedFunctions,
    _arrange,
    _check_donation,
    _forget_failed_dispatch,
    _JitEntry,
    _Unprobed,
)
from ._jit_options import JitOptions, JitOptionsDict, is_sharding, options_key, with_defaults
from ._jit_stages import Compiled, Lowered, Traced
from ._jit_table import SharedJit, shared_state
from ._signature import UNSPECIFIED, suggests_keywords
from ._wrapped import Wrapped, make_wrapper

P = ParamSpec("P")
R = TypeVar("R")


# Calls that a record of the executor's table matches run without the pipeline:
# in C where the extension is active (``_guard.FastCall``, without a Python
# frame), else by its Python twin (`_executor.PyFastCall`).
_Executor: Any = PyFastCall if _compiled.FastCall is None else _compiled.FastCall


class JitWrapped(PyFastCall if TYPE_CHECKING else _Executor, Wrapped[P, R], Generic[P, R]):
    """A function compiled with `treemode.jit`."""

    transform = "jit"
    _records: list[Any]  # the executor's table (`_start_fast_path`)
    options: JitOptions

    def __init__(
        self,
        fn: Callable[P, R],
        *,
        partial_args: tuple[Any, ...] = (),
        **options: Unpack[JitOptionsDict],
    ):
        # A wrapper of a function already wrapped with the same options (one made
        # inline, in a loop) takes that one's resolved options, entries and records.
        given = with_defaults(dict(options))
        shared = None if partial_args else shared_state(fn, options_key(given))
        self._wrap(fn)
        self.partial_args = partial_args
        self._n_partial = len(partial_args)
        self._shared: SharedJit | None = shared
        if shared is not None and shared.options is not None:
            self.options = shared.options
        else:
            self.options = JitOptions.resolve(fn, **given)
            if shared is not None:
                shared.options = self.options
        self._cache: dict[_call.CallKey, _JitEntry] = {} if shared is None else shared.entries
        # An instance attribute, as Flax's: functools.wraps copies it (nnx.cached_partial).
        self.jitted_fn = JittedFunctions(self)
        self._start_fast_path([] if shared is None else shared.records)
        _caches.track(self)  # treemode.clear_caches() calls clear_cache()

    def _start_fast_path(self, records: list[Any]) -> None:
        # The executor's table: the records its misses returned, the most recent
        # first (one list, shared by the wrappers of one function and options).
        self._records = records
        # The executor's one callback, called with the wrapper first: a function,
        # not a bound method, so the wrapper makes no reference cycle.
        self._miss = type(self)._on_miss

    def __copy__(self) -> JitWrapped[P, R]:
        """``copy.copy``: a wrapper of the same function sharing its compiled entries."""
        copied = type(self).__new__(type(self))
        copied.__dict__.update(self.__dict__)
        copied.jitted_fn = JittedFunctions(copied)
        copied._start_fast_path(list(self._records))  # a table of its own
        copied._shared = None
        _caches.track(copied)
        return copied

    def __deepcopy__(self, memo: dict[int, Any]) -> JitWrapped[P, R]:
        """``copy.deepcopy``: as ``jax.jit``'s wrapper, a new wrapper of the same function.

        The function and the compiled entries are shared (they hold no state of
        the caller's); the arguments bound by `jit_partial` are deep-copied, so
        the copy updates its own modules.
        """
        copied = self.__copy__()
        if self.partial_args:
            copied.partial_args = copy.deepcopy(self.partial_args, memo)
            copied._start_fast_path([])  # the records matched the original's bound objects
        return copied

    def __reduce__(self) -> Any:
        raise TypeError(
            f"treemode.jit: cannot pickle the jitted function {getattr(self.fn, '__name__', '')!r}"
            " (jax.jit's wrappers cannot be pickled either). Pickle the function itself "
            "and apply treemode.jit again after loading."
        )

    # -- calling -----------------------------------------------------------------

    def _prepare(self, args: tuple[Any, ...], kwargs: dict[str, Any], abstract: bool):
        options = self.options
        return _call.prepare(
            "jit",
            self.fn,
            (*self.partial_args, *args),
            kwargs,
            graph=options.graph,
            static_argnums=options.static_argnums,
            static_argnames=options.static_argnames,
            abstract=abstract,
        )

    def _entry(self, call: _call.Call) -> _JitEntry:
        entry = self._cache.get(call.key)
        if entry is None:
            entry = self._cache[call.key] = self._build(call)
        return entry

    def _build(self, call: _call.Call) -> _JitEntry:
        options = self.options
        donated = call.traced_roots(options.donate_argnums, options.donate_argnames)
        donate_flat: list[int] = []
        dyn_offset = 0
        for k, flat in enumerate(call.arg_flats):
            if k in donated:
                donate_flat.extend(range(dyn_offset, dyn_offset + len(flat.dynamic)))
            dyn_offset += len(flat.dynamic)
        owner = [-1] * len(call.dynamic)
        if donate_flat:
            for i, indices in enumerate(call.variable_dynamic_ranges()):
                for j in indices:
                    owner[j] = i
        pure = _pure.PureFunction(call)
        if options.graph and options.out_shardings is not UNSPECIFIED:  # one per shared Variable
            spec = options.out_shardings
            pure.output_spec = ("out_shardings", spec, _whole, is_sharding, "output")
        jit_kwargs, in_shardings = options.jit_kwargs(call)
        # JAX's messages name each array as the user's call does (`_retrace.dynamic_paths`).
        names = _retrace.argument_names(call)
        return _JitEntry(
            pure, jit_kwargs, donate_flat, len(call.dynamic), owner, in_shardings, names
        )

    if TYPE_CHECKING:  # at run time, the executor's call (or `_call`, see below)

        def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R: ...

    def _call(self, *args: Any, **kwargs: Any) -> Any:
        """A call through the pipeline (no record is added to the executor's table)."""
        return self._pipeline(args, kwargs)[0]

    def _on_miss(
        self, error: BaseException | None, args: tuple[Any, ...], kwargs: Any
    ) -> tuple[Any, Any]:
        """The executor's miss: run the call through the pipeline and return its
        output with the record of how calls like it run (`_border.miss_result`), or
        explain the error a record's compiled entry raised (``error``)."""
        kwargs = kwargs or {}
        if error is not None and not isinstance(error, _pure.UnboundTrace):
            call = self._prepare(args, kwargs, abstract=False)
            entry = self._cache.get(call.key)
            _explain.raise_explained(call, error, None if entry is None else entry.split)
            raise error  # raise_explained raises; this line is never reached
        if error is not None:  # `UnboundTrace` (`_Unprobed` too): JAX had to trace
            for record in list(self._records or ()):
                _forget_failed_dispatch(record.jitted)
        return self._pipeline(args, kwargs)

    def _pipeline(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        """Prepare, run and write back ``args``; returns ``(out, record)``."""
        if _compat.take_flax_static_cache():
            self._through_cached_partial()
        call = self._prepare(args, kwargs, abstract=False)
        new = call.key not in self._cache
        entry = self._entry(call)
        if new and _retrace.enabled():
            # treemode says what changed in the arguments; JAX, which sees a new
            # flat function, would only say that it was never seen.
            _retrace.new_structure("jit", self.fn, call.key, list(self._cache)[:-1])
            with _retrace.jax_explanations_off():
                out = self._run(call, entry)
        else:
            out = self._run(call, entry)
        return miss_result(out, self._record_of(call, entry))

    def _through_cached_partial(self) -> None:
        """Called through ``nnx.cached_partial``, which leaves a cache for the Flax
        transform it calls to take: from now on every call takes it first (the
        executor's calls too: its ``_before_call``) and runs as the plain partial."""
        self._before_call = _compat.FLAX_STATIC_CACHE

    def _record_of(self, call: _call.Call, entry: _JitEntry) -> Any:
        """The fast-path record of calls like ``call``, which just ran (``None``: none
        can be trusted, `_callsite.fast_record`)."""
        if entry.jitted is None:
            return None
        site = CallSite.from_call(call)
        if site is None:
            return None
        return _callsite.fast_record(
            site,
            call,
            self.partial_args,
            entry.jitted,
            entry.split,
            entry.findings.metadata_updates,
            entry.telling_apart(call.dynamic),
        )

    def _run(
        self, call: _call.PreparedCall, entry: _JitEntry, compiled: Compiled | None = None
    ) -> Any:
        """Run ``call`` on its entry's executable (or on ``compiled``, an AOT-compiled one)."""
        if compiled is not None:
            return self._execute(call, entry, compiled._stage, compiled._split)
        if not entry.donates:
            return self._execute(call, entry, entry.jitted, None)
        if _compat.debug_checks_on():  # JAX's re-run of a NaN/Inf needs the inputs alive:
            return self._execute(call, entry, entry.probe, None)  # the undonated probe
        chosen = entry.for_call(call.dynamic)
        jitted, split = chosen if chosen is not None else self._probe(call, entry)
        try:
            return self._execute(call, entry, jitted, split)
        except _Unprobed:
            # JAX traced the executable for a signature that writes another set;
            # nothing ran: take that set's executable (probing it if unknown).
            _forget_failed_dispatch(jitted)
            known = entry.known_split(call.dynamic)
            jitted, split = known if known is not None else self._probe(call, entry)
            return self._execute(call, entry, jitted, split)

    def _probe(self, call: _call.PreparedCall, entry: _JitEntry) -> tuple[Any, Any]:
        """`_JitEntry.probe_call` with the call bound, failures explained as a call's;
        returns the executable of what the trace writes and its donation split."""
        dynamic = call.dynamic
        return _core.run(call, entry.pure, lambda: (entry.probe_call(dynamic), None), finish=False)

    def _execute(
        self,
        call: _call.PreparedCall,
        entry: _JitEntry,
        executable: Callable[..., Any],
        split: tuple[tuple[int, ...], tuple[int, ...]] | None,
    ) -> Any:
        """Run ``executable``, taking ``call``'s arrays as ``split`` says, and write back."""
        if split is not None:
            _check_donation(call, *split)
        arrays = _arrange(call.dynamic, split)

        def jax_call() -> tuple[Any, Any]:
            out, updates = executable(*arrays)
            if updates is None or not entry.findings.metadata_updates:
                # No trace of this entry recorded metadata updates (the pure function's
                # last one among them): `run` writes the values.
                return out, updates
            return out, _writeback.WriteBack(call, updates, entry.metadata_for(call.dynamic))

        if split is not None:
            # Once the executable consumed the donated buffers, the new values are the
            # only whole state until written: a signal's handler waits for the write
            # (treemode._pipeline._interrupts; one raised during the trace or compilation, before
            # anything was consumed, is raised at once).
            return _interrupts.run_held(
                arrays[0], lambda: _core.run(call, entry.pure, jax_call, split=split)
            )
        return _core.run(call, entry.pure, jax_call)

    # -- AOT ---------------------------------------------------------------------

    def trace(self, *args: Any, **kwargs: Any) -> Traced:
        """Trace without compiling; ``.jaxpr`` and ``.lower()`` are available."""
        call = self._prepare(args, kwargs, abstract=True)
        entry = self._entry(call)
        jitted, split = entry.jitted, entry.split
        if entry.donates:  # the donated executable of what this trace writes
            jitted, split = self._probe(call, entry)
        arrays = _arrange(call.dynamic, split)
        traced = _core.run(call, entry.pure, lambda: (jitted.trace(*arrays), None), finish=False)
        return Traced(self, call.key, traced, split)

    def lower(self, *args: Any, **kwargs: Any) -> Lowered:
        """Lower for the given arguments (arrays or ``jax.ShapeDtypeStruct``)."""
        return self.trace(*args, **kwargs).lower()

    def eval_shape(self, *args: Any, **kwargs: Any) -> Any:
        """Output shapes and dtypes of a call; the inputs are never modified."""
        call = self._prepare(args, kwargs, abstract=True)
        pure = self._entry(call).pure
        # The updates' shapes are dropped: nothing is written back.
        return _core.run(call, pure, lambda: (jax.eval_shape(pure, *call.dynamic)[0], None))

    def clear_cache(self) -> None:
        """Drop every compiled entry (as ``jax.jit``'s ``clear_cache``); the next call traces."""
        for entry in self._cache.values():
            entry.clear()
        self._cache.clear()
        self._records.clear()  # in place: every wrapper sharing the table sees it

    # -- what Flax's and JAX's wrappers offer --------------------------------------

    @property
    def fun(self) -> Callable[P, R]:
        """The function that was compiled (Flax's name for `fn`)."""
        return self.fn

    # ``jitted_fn``: the ``jax.jit`` functions behind this wrapper (Flax's
    # ``jitted_fn``), a `JittedFunctions` view set by ``__init__``.
    jitted_fn: JittedFunctions

    # The options as Flax's and JAX's wrappers expose them (read from `options`).
    @property
    def in_shardings(self) -> Any:
        return self.options.in_shardings

    @property
    def out_shardings(self) -> Any:
        return self.options.out_shardings

    @property
    def static_argnums(self) -> frozenset[int]:
        return self.options.static_argnums

    @property
    def static_argnames(self) -> frozenset[str]:
        return self.options.static_argnames

    @property
    def donate_argnums(self) -> frozenset[int]:
        return self.options.donate_argnums

    @property
    def donate_argnames(self) -> frozenset[str]:
        return self.options.donate_argnames

    @property
    def graph(self) -> bool:
        return self.options.graph

    def _cache_size(self) -> int:
        """How many executables the calls so far compiled (as on a ``jax.jit`` function)."""
        return self.jitted_fn._cache_size()

    def __repr__(self) -> str:
        bound = f" with {len(self.partial_args)} bound argument(s)" if self.partial_args else ""
        return f"<treemode.jit of {self.fn!r}{bound}>"


# The entry points from the user's code (the executor's miss included) are
# boundaries of JAX's traceback filtering: treemode's frames are left out.
for _entry_point in ("_call", "_on_miss", "trace", "lower", "eval_shape"):
    setattr(JitWrapped, _entry_point, _compat.api_boundary(getattr(JitWrapped, _entry_point)))

if _compiled.FastCall is None:  # the Python executor's call, a boundary as `_call` is
    JitWrapped.__call__ = _compat.api_boundary(PyFastCall.__call__)  # type: ignore[method-assign]


def _whole(out: Any) -> Any:
    return out


# The options of `jit` and `jit_partial` that may not hold Flax lift objects.
_SHARDINGS = ("in_shardings", "out_shardings")


@overload
def jit(
    fun: Callable[P, R],
    /,
    *,
    in_shardings: Any = ...,
    out_shardings: Any = ...,
    static_argnums: int | Sequence[int] | None = ...,
    static_argnames: str | Iterable[str] | None = ...,
    donate_argnums: int | Sequence[int] | None = ...,
    donate_argnames: str | Iterable[str] | None = ...,
    keep_unused: bool = ...,
    device: Any = ...,
    backend: str | None = ...,
    inline: bool = ...,
    compiler_options: dict[str, Any] | None = ...,
    graph: bool = ...,
) -> JitWrapped[P, R]: ...


@overload
def jit(
    fun: None = None,
    /,
    *,
    in_shardings: Any = ...,
    out_shardings: Any = ...,
    static_argnums: int | Sequence[int] | None = ...,
    static_argnames: str | Iterable[str] | None = ...,
    donate_argnums: int | Sequence[int] | None = ...,
    donate_argnames: str | Iterable[str] | None = ...,
    keep_unused: bool = ...,
    device: Any = ...,
    backend: str | None = ...,
    inline: bool = ...,
    compiler_options: dict[str, Any] | None = ...,
    graph: bool = ...,
) -> Callable[[Callable[P, R]], JitWrapped[P, R]]: ...


@suggests_keywords
def jit(
    fun: Callable[P, R] | None = None,
    /,
    *,
    in_shardings: Any = UNSPECIFIED,
    out_shardings: Any = UNSPECIFIED,
    static_argnums: int | Sequence[int] | None = None,
    static_argnames: str | Iterable[str] | None = None,
    donate_argnums: int | Sequence[int] | None = None,
    donate_argnames: str | Iterable[str] | None = None,
    keep_unused: bool = False,
    device: Any = None,
    backend: str | None = None,
    inline: bool = False,
    compiler_options: dict[str, Any] | None = None,
    graph: bool = False,
) -> Any:
    """Compile ``fn`` with ``jax.jit``, writing Variable updates back to the inputs.

    Modules, Variables, Equinox modules and plain pytrees may be passed freely.
    Arrays, Variable values and Python numbers are traced, as in `jax.jit`; other
    leaves (functions, strings, NNX static attributes, and every non-array field
    of an Equinox module, as in `eqx.filter_jit`) are static; the table in
    the concepts page gives the whole rule. After the call, each input Variable
    that the function changed holds its new value; all other Variables keep
    their buffers.

    Modules the function reaches through its closure (a global, a closure
    cell, a bound method's `self`) are inputs too: their Variables are read
    fresh on every call, never a stale constant, and written back when the
    function changes them; one the closure search cannot lift is reported by
    name (`ClosureWarning`, `ClosureError`; see the concepts page). The
    function is traced and compiled once per call structure (the arguments'
    types and module structure, static values, array shapes, dtypes and
    shardings); new array values reuse that program, a new structure traces
    again (`jax_explain_cache_misses` says why; see the jit guide).

    **Arguments:**

    - `fun`: the function to compile (positional only). Omit it to use
      `jit(...)` as a decorator factory; `jit` also decorates methods.
    - `in_shardings`, `out_shardings`: as in `jax.jit`; a prefix may be
      module-shaped (the module with a sharding in place of each Variable).
      Updated Variables come back with their input sharding.
    - `static_argnums`, `static_argnames`: arguments that are part of the cache
      key instead of traced (must be hashable).
    - `donate_argnums`, `donate_argnames`: arguments whose buffers XLA may reuse,
      donated by effect: a donated module donates the buffers of the Variables
      the function writes (they come back holding the new values, so the module
      stays usable), and its read-only Variables are passed undonated and keep
      their buffers; other array leaves are donated, as in `jax.jit` (the jit
      guide, "Donation"). An exception a signal handler raises in the main thread (Ctrl-C,
      `SystemExit` from a SIGTERM handler, ...) leaves the old values when it
      lands before the executable consumed the buffers (it is raised at once,
      even during a long trace or compilation) and the new values after (it is
      raised once they are written): never deleted buffers.
    - `keep_unused`, `device`, `backend`, `inline`, `compiler_options`: as in
      `jax.jit`.
    - `graph`: if `True`, inputs may share Modules/Variables (see `to_tree`).

    **Returns:**

    A callable with `.lower(...)`, `.trace(...)` and `.eval_shape(...)`.

    **Raises:**

    `AliasError` when a Variable is reachable twice (with `graph=False`),
    `StructureError` when the function changes an input's structure,
    `DonationError` when donated arguments share a buffer.

    ```python
    import jax.numpy as jnp
    import treemode
    from flax import nnx

    class Counter(nnx.Module):
        def __init__(self):
            self.count = nnx.BatchStat(jnp.array(0))

    @treemode.jit
    def step(counter, x):
        counter.count[...] += 1
        return x * 2

    counter = Counter()
    y = step(counter, jnp.ones(3))
    assert counter.count[...] == 1
    ```
    """
    options: dict[str, Any] = {k: v for k, v in locals().items() if k != "fun"}  # as given
    return make_wrapper(JitWrapped, fun, options, transform="jit", specs=_SHARDINGS, shardings=True)


# The bound arguments' types, for the overloads of `jit_partial`.
_A1 = TypeVar("_A1")
_A2 = TypeVar("_A2")
_A3 = TypeVar("_A3")


# For type checkers the wrapper takes the parameters after the bound ones (up to
# three bound arguments: a model, an optimizer, metrics); with more, any.
@overload
def jit_partial(fun: Callable[P, R], /, **options: Unpack[JitOptionsDict]) -> JitWrapped[P, R]: ...


@overload
def jit_partial(
    fun: Callable[Concatenate[_A1, P], R], a1: _A1, /, **options: Unpack[JitOptionsDict]
) -> JitWrapped[P, R]: ...


@overload
def jit_partial(
    fun: Callable[Concatenate[_A1, _A2, P], R],
    a1: _A1,
    a2: _A2,
    /,
    **options: Unpack[JitOptionsDict],
) -> JitWrapped[P, R]: ...


@overload
def jit_partial(
    fun: Callable[Concatenate[_A1, _A2, _A3, P], R],
    a1: _A1,
    a2: _A2,
    a3: _A3,
    /,
    **options: Unpack[JitOptionsDict],
) -> JitWrapped[P, R]: ...


@overload
def jit_partial(
    fun: Callable[..., R], /, *partial_args: Any, **options: Unpack[JitOptionsDict]
) -> JitWrapped[..., R]: ...


@suggests_keywords
def jit_partial(
    fun: Callable[..., R],
    *partial_args: Any,
    in_shardings: Any = UNSPECIFIED,
    out_shardings: Any = UNSPECIFIED,
    static_argnums: int | Sequence[int] | None = None,
    static_argnames: str | Iterable[str] | None = None,
    donate_argnums: int | Sequence[int] | None = None,
    donate_argnames: str | Iterable[str] | None = None,
    keep_unused: bool = False,
    device: Any = None,
    backend: str | None = None,
    inline: bool = False,
    compiler_options: dict[str, Any] | None = None,
    graph: bool = False,
) -> JitWrapped[..., R]:
    """``jit`` with leading arguments bound once; the fast path for training loops.

    The bound arguments (typically the model and the optimizer) are flattened on
    the first call and revalidated cheaply afterwards, so each call pays only for
    the arguments that change (the batch).

    **Arguments:**

    - `fun`: the function to compile.
    - `*partial_args`: leading positional arguments of `fun` to bind.
    - `in_shardings`, ..., `graph`: as in `treemode.jit`; argument indices count
      the bound arguments too.

    **Returns:**

    A `treemode.jit` wrapper taking the remaining arguments.

    **Raises:**

    `AliasError` at once (not at the first call) when, with `graph=False`, the
    bound arguments reach one Variable twice.

    ```python
    import jax.numpy as jnp
    import treemode
    from flax import nnx

    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    forward = treemode.jit_partial(lambda m, x: m(x), model)
    assert forward(jnp.ones((1, 2))).shape == (1, 2)
    ```
    """
    options: dict[str, Any] = {k: v for k, v in locals().items() if k != "fun"}  # as given
    options["partial_args"] = tuple(partial_args)
    # The shardings are checked first, then the bound arguments, then it is made.
    make = make_wrapper(
        JitWrapped, None, options, transform="jit_partial", specs=_SHARDINGS, shardings=True
    )
    if not graph:  # the bound arguments are fixed: check them for aliases now
        check_no_aliases("jit_partial", args=tuple(partial_args))
    return make(fun)
