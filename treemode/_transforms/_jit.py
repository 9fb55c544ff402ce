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
    TypedDict,
    TypeVar,
    Unpack,
    overload,
)

import jax
from jax.core import Tracer

from .. import _caches
from .._accel import _compiled
from .._errors import DonationError, StructureError
from .._pipeline import _call, _callsite, _core, _explain, _interrupts, _pure, _retrace, _writeback
from .._pipeline._callsite import CallSite
from .._tree._flatten import ArgFlat, check_no_aliases
from .._tree._leaves import is_variable
from .._tree._specs import DYNAMIC, VarSpec
from ._axes import graph_prefix_values
from ._names import FLAT_ARGUMENTS, SPLIT_ARGUMENTS, named
from ._prefix import broadcast_to_dynamic, decode_flax_prefixes, graph_output_prefix
from ._signature import UNSPECIFIED, as_tuple, resolve_argnums, suggests_keywords
from ._wrapped import Wrapped, make_wrapper

P = ParamSpec("P")
R = TypeVar("R")

_UNSET: Any = UNSPECIFIED


def _resolve_argnums(
    fn: Callable[..., Any], argnums: tuple[int, ...], argnames: tuple[str, ...], what: str
) -> tuple[frozenset[int], frozenset[str]]:
    return resolve_argnums("jit", fn, argnums, argnames, what)


class _Entry:
    """The compiled form of one call structure.

    The dynamic arrays reach ``jax.jit`` as positional arguments (JAX's C++
    dispatch parses those with fewer steps than one tuple argument), or as two
    tuples when some are donated: the donated ones, then the kept ones.

    Which Variables a trace updates is fixed in its executable. A trace that
    updates none (no changed value, no metadata update) returns ``(out,
    None)`` instead of a tuple of ``None`` per Variable: its calls skip the
    write-back without looking at their updates, and JAX rebuilds a smaller
    output tree on every call. Not with explicit shardings, whose
    ``out_shardings`` give one entry per Variable.

    Metadata updates are static, so each trace records its own in `record`,
    under the abstract values of its inputs: ``jax.jit`` keeps one executable
    per input shape under this one entry, and a call writes back the metadata
    updates of the trace its executable came from.
    """

    __slots__ = (
        "pure",
        "jitted",
        "layout",
        "record",
        "_order",
        "_compact",
        "traced_types",
    )

    def __init__(
        self, pure: _pure.PureFunction, jit_kwargs: dict[str, Any], donated: list[int], n: int
    ):
        self.pure = pure
        self.record = _EntryRecord()
        self.traced_types: list[tuple[Any, ...]] = []  # per trace (see `_retrace`)
        self._compact = "out_shardings" not in jit_kwargs
        # How the executable takes donated arrays (`_explain`, the fast-path record).
        self.layout = _donation_layout(donated, n)
        # Position of each dynamic array in ``donated + kept`` (the inverse
        # permutation, computed in linear time).
        self._order = [0] * n
        order = self.layout[0] + self.layout[1] if self.layout else range(n)
        for position, i in enumerate(order):
            self._order[i] = position
        # Named like the user function: JAX's program (``jit_<name>``), its
        # messages and profiles then read like the user's code (`_names`).
        if donated:
            _explain.note_donation()
            split = named(self._call_split, pure.fn, SPLIT_ARGUMENTS)
            self.jitted = jax.jit(split, donate_argnums=0, **jit_kwargs)
        else:
            self.jitted = jax.jit(named(self._call_flat, pure.fn, FLAT_ARGUMENTS), **jit_kwargs)

    def _call_flat(self, *dynamic: Any) -> Any:
        return self._traced(dynamic)

    def _call_split(self, donated: tuple[Any, ...], kept: tuple[Any, ...]) -> Any:
        joined = donated + kept
        return self._traced([joined[j] for j in self._order])

    def _traced(self, dynamic: Sequence[Any]) -> tuple[Any, tuple[Any, ...] | None]:
        self._record_types(dynamic)
        result = self.pure(*dynamic)
        out, updates = result
        metadata = self.pure.record.metadata_updates
        self.record.note(dynamic, metadata)
        if not self._compact or any(u is not None for u in updates) or metadata:
            return result
        return out, None

    def _record_types(self, dynamic: Sequence[Any]) -> None:
        """At trace time (JAX traces again for new shapes/dtypes): explain a retrace."""
        call = getattr(self.pure.binding, "call", None)
        if call is not None:
            _retrace.new_types("jit", self.pure.fn, call, self.traced_types, dynamic)

    def metadata_for(self, dynamic: Sequence[Any]) -> dict[int, dict[str, Any]] | None:
        """The metadata updates of the trace whose executable ran on ``dynamic``."""
        if not self.record.metadata_updates:
            return None  # no trace of this entry recorded one
        return self.record.by_signature.get(_signature(dynamic))

    def args(self, dynamic: Sequence[Any]) -> tuple[Any, ...]:
        return _arrange(dynamic, self.layout)


def _donation_layout(
    donated: Sequence[int], n: int
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """``(donated, kept)`` indices of ``n`` dynamic arrays, or None when none is donated."""
    if not donated:
        return None
    donated_set = set(donated)
    return tuple(donated), tuple(i for i in range(n) if i not in donated_set)


def _arrange(
    per_dynamic: Sequence[Any], layout: tuple[tuple[int, ...], tuple[int, ...]] | None
) -> tuple[Any, ...]:
    """One value per dynamic array (the arrays, or their shardings) as the entry's
    executable takes them: positionally, or as the donated and the kept tuples."""
    if layout is None:
        return tuple(per_dynamic)
    donated, kept = layout
    return tuple(per_dynamic[i] for i in donated), tuple(per_dynamic[i] for i in kept)


class _EntryRecord:
    """The metadata updates of every trace of one `_Entry`, by input signature.

    ``metadata_updates`` is true once any trace recorded one (no fast-path
    record is made for the entry from then on: `_callsite.fast_record`).
    """

    __slots__ = ("metadata_updates", "by_signature")

    def __init__(self) -> None:
        self.metadata_updates = False
        self.by_signature: dict[tuple[Any, ...], dict[int, dict[str, Any]] | None] = {}

    def note(self, dynamic: Sequence[Any], metadata: dict[int, dict[str, Any]]) -> None:
        self.by_signature[_signature(dynamic)] = metadata or None
        self.metadata_updates = self.metadata_updates or bool(metadata)


def _signature(dynamic: Sequence[Any]) -> tuple[Any, ...]:
    """What ``jax.jit`` tells traces apart by: each input's shape, dtype and weak type."""
    return tuple((a.shape, a.dtype, a.weak_type) for a in map(jax.typeof, dynamic))


# Calls matching the fast-path record run in C, without a Python frame
# (treemode._accel._compiled); where the extension is off, `JitWrapped.__call__`
# is `JitWrapped._call`, the pipeline.
class _NoExecutor:
    """The base of `JitWrapped` where the extension is off."""

    __slots__ = ()


_FastCall: Any = _NoExecutor if TYPE_CHECKING or _compiled.FastCall is None else _compiled.FastCall


class JitWrapped(_NoExecutor if TYPE_CHECKING else _FastCall, Wrapped[P, R], Generic[P, R]):
    """A function compiled with `treemode.jit`."""

    transform = "jit"

    def __init__(
        self,
        fn: Callable[P, R],
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
        partial_args: tuple[Any, ...] = (),
    ):
        self._wrap(fn)
        self.graph = graph
        # Flax's graph-mode prefixes (nnx.prefix(..., graph=True)) made module-shaped.
        self.in_shardings = decode_flax_prefixes(in_shardings, transform="jit", what="in_shardings")
        self.out_shardings = decode_flax_prefixes(
            out_shardings, transform="jit", what="out_shardings"
        )
        # What JAX matches against the outputs: with graph=True they are `to_tree`'s form.
        self._jax_out_shardings = (
            graph_output_prefix(self.out_shardings) if graph else self.out_shardings
        )
        self.keep_unused = keep_unused
        self.device = device
        self.backend = backend
        self.inline = inline
        self.compiler_options = compiler_options
        self.partial_args = partial_args
        n_partial = len(partial_args)
        static_nums, static_names = _resolve_argnums(
            fn, as_tuple(static_argnums), as_tuple(static_argnames), "static"
        )
        donate_nums, donate_names = _resolve_argnums(
            fn, as_tuple(donate_argnums), as_tuple(donate_argnames), "donate"
        )
        clash = (static_nums & donate_nums) or (static_names & donate_names)
        if clash:
            raise DonationError(
                f"treemode.jit: argument(s) {sorted(clash)} are both static and donated. "
                "A static argument has no buffers to donate; remove it from "
                "donate_argnums/donate_argnames."
            )
        self.static_argnums = static_nums
        self.static_argnames = static_names
        self.donate_argnums = donate_nums
        self.donate_argnames = donate_names
        self._n_partial = n_partial
        self._cache: dict[_call.CallKey, _Entry] = {}
        # The last call's memo (see ``_callsite``) and its compiled entry, set
        # together (one attribute, so threads never pair one call's site with
        # another's entry): a loop calling with the same objects skips ``prepare``.
        self._memo: tuple[CallSite, _Entry] | None = None
        self._start_fast_path()
        _caches.track(self)  # treemode.clear_caches() calls clear_cache()

    def _start_fast_path(self) -> None:
        # The fast-path record the extension executes (None: every call runs
        # `_call`), and whether the memo still has to emit it (after a call ran).
        self._record: Any = None
        self._record_due = False
        if _compiled.FastCall is not None:
            # The executor's one callback, called with the wrapper first: a function,
            # not a bound method, so the wrapper makes no reference cycle.
            self._miss = type(self)._on_miss

    def __copy__(self) -> JitWrapped[P, R]:
        """``copy.copy``: a wrapper of the same function sharing its compiled entries."""
        copied = type(self).__new__(type(self))
        copied.__dict__.update(self.__dict__)
        copied._start_fast_path()  # emitted again for the copy (its miss is its own)
        copied._memo = self._memo
        copied._record_due = self._memo is not None
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
            copied._memo = None  # the memo matched the original's bound objects
            copied._record_due = False
        return copied

    def __reduce__(self) -> Any:
        raise TypeError(
            f"treemode.jit: cannot pickle the jitted function {getattr(self.fn, '__name__', '')!r}"
            " (jax.jit's wrappers cannot be pickled either). Pickle the function itself "
            "and apply treemode.jit again after loading."
        )

    # -- calling -----------------------------------------------------------------

    def _prepare(self, args: tuple[Any, ...], kwargs: dict[str, Any], abstract: bool):
        return _call.prepare(
            "jit",
            self.fn,
            (*self.partial_args, *args),
            kwargs,
            graph=self.graph,
            static_argnums=self.static_argnums,
            static_argnames=self.static_argnames,
            abstract=abstract,
        )

    def _entry(self, call: _call.Call) -> _Entry:
        entry = self._cache.get(call.key)
        if entry is None:
            entry = self._cache[call.key] = self._build(call)
        return entry

    def _donated_roots(self, call: _call.Call) -> list[int]:
        """Indices into ``call.arg_flats`` of the donated arguments."""
        return call.traced_roots(self.donate_argnums, self.donate_argnames)

    def _build(self, call: _call.Call) -> _Entry:
        donated = self._donated_roots(call)
        force: set[int] = set()
        donate_flat: list[int] = []
        var_offset = 0
        dyn_offset = 0
        for k, flat in enumerate(call.arg_flats):
            if k in donated:
                force.update(range(var_offset, var_offset + len(flat.variables)))
                donate_flat.extend(range(dyn_offset, dyn_offset + len(flat.dynamic)))
            var_offset += len(flat.variables)
            dyn_offset += len(flat.dynamic)
        pure = _pure.PureFunction(call, force_updates=frozenset(force))
        if self.graph and self.out_shardings is not _UNSET:  # one per shared Variable
            pure.output_spec = ("out_shardings", self.out_shardings, _whole, _is_sharding, "output")
        jit_kwargs: dict[str, Any] = dict(keep_unused=self.keep_unused, inline=self.inline)
        if self.device is not None:
            jit_kwargs["device"] = self.device
        if self.backend is not None:
            jit_kwargs["backend"] = self.backend
        if self.compiler_options is not None:
            jit_kwargs["compiler_options"] = self.compiler_options
        if self.in_shardings is not _UNSET:
            layout = _donation_layout(donate_flat, len(call.dynamic))
            jit_kwargs["in_shardings"] = _arrange(self._flat_in_shardings(call), layout)
        if self.out_shardings is not _UNSET or self.in_shardings is not _UNSET:
            var_shardings = self._variable_shardings(call)
            out = None if self.out_shardings is _UNSET else self._jax_out_shardings
            jit_kwargs["out_shardings"] = (out, tuple(var_shardings))
        return _Entry(pure, jit_kwargs, donate_flat, len(call.dynamic))

    def _positional_roots(self, call: _call.Call) -> list[tuple[ArgFlat, Any]]:
        trees = [t for _, t in call.arg_roots()]
        return list(zip(call.arg_flats, trees, strict=True))

    def _flat_in_shardings(self, call: _call.Call) -> list[Any]:
        n_traced_pos = len(call.args) - len(call.static_positional)
        spec = self.in_shardings
        if not isinstance(spec, (tuple, list)):
            spec = (spec,) * n_traced_pos
        elif len(spec) != n_traced_pos:
            raise ValueError(
                f"treemode.jit: in_shardings has {len(spec)} entries but the function "
                f"is called with {n_traced_pos} traced positional argument(s). Give one "
                "entry per positional argument (static arguments excluded), or a single "
                "sharding for all."
            )
        if call.graph:
            # Broadcast over the objects as passed (a module-shaped prefix matches
            # them, not their to_tree form); one sharding per shared Variable.
            flat_shardings = graph_prefix_values(
                call, list(spec), _is_sharding, None, "in_shardings"
            )
            return flat_shardings + [None] * (len(call.dynamic) - len(flat_shardings))
        flat_shardings: list[Any] = []
        roots = self._positional_roots(call)
        for k, (flat, tree) in enumerate(roots):
            if k < n_traced_pos:
                flat_shardings += broadcast_to_dynamic(
                    spec[k],
                    flat,
                    tree,
                    is_prefix_leaf=_is_sharding,
                    where=f"args[{k}]",
                    what="treemode.jit: in_shardings",
                )
            else:
                flat_shardings += [None] * len(flat.dynamic)
        flat_shardings += [None] * (len(call.dynamic) - len(flat_shardings))
        return flat_shardings

    def _variable_shardings(self, call: _call.Call) -> list[Any]:
        """Updates come back with the sharding their Variable went in with."""
        if self.in_shardings is _UNSET:
            return [None] * len(call.variables)
        per_dyn = self._flat_in_shardings(call)
        out: list[Any] = []
        k = 0
        for flat in call.arg_flats:
            for spec in flat.specs:
                if type(spec) is VarSpec:
                    n = spec.num_dynamic
                    out.append(per_dyn[k] if n == 1 else None)
                    k += n
                elif spec is DYNAMIC:
                    k += 1
        out += [None] * (len(call.variables) - len(out))
        return out

    if TYPE_CHECKING:  # at run time, the executor's call (or `_call`, see below)

        def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R: ...

    def _call(self, *args: Any, **kwargs: Any) -> Any:
        """A call through the pipeline: the memo's `CallSite.match`, else `prepare`."""
        memo = self._memo
        if memo is not None:
            site, entry = memo
            matched = site.match((*self.partial_args, *args) if self._n_partial else args, kwargs)
            if matched is not None:
                out = self._run(matched, entry, entry.jitted)
                if self._record_due or (self._record is not None and entry.record.metadata_updates):
                    self._emit(matched, entry)
                return out
        call = self._prepare(args, kwargs, abstract=False)
        new = call.key not in self._cache
        entry = self._entry(call)
        site = CallSite.record(call, self._prepare_in_full)
        self._memo = None if site is None else (site, entry)
        self._record = None  # emitted once this call ran: its trace may change the entry
        self._record_due = site is not None
        if new and _retrace.enabled():
            # treemode says what changed in the arguments; JAX, which sees a new
            # flat function, would only say that it was never seen.
            _retrace.new_structure("jit", self.fn, call.key, list(self._cache)[:-1])
            with _retrace.jax_explanations_off():
                out = self._run(call, entry, entry.jitted)
        else:
            out = self._run(call, entry, entry.jitted)
        if self._record_due:
            self._emit(call, entry)
        return out

    def _emit(self, call: _call.PreparedCall, entry: _Entry) -> None:
        """Emit the fast-path record of the memo (`_callsite.fast_record`) after ``call`` ran."""
        memo = self._memo
        if memo is None or memo[1] is not entry:
            return
        self._record_due = False
        self._record = _callsite.fast_record(
            memo[0],
            call,
            self.partial_args,
            entry.jitted,
            entry.layout,
            entry.record.metadata_updates,
        )

    def _on_miss(self, error: BaseException | None, args: tuple[Any, ...], kwargs: Any) -> Any:
        """The executor's miss: run the call through the pipeline, or explain the
        error its compiled entry raised (``error``)."""
        if error is None or type(error) is _pure.UnboundTrace:
            return self._call(*args, **(kwargs or {}))
        call = self._prepare(args, kwargs or {}, abstract=False)
        memo = self._memo
        _explain.raise_explained(call, error, None if memo is None else memo[1].layout)
        raise error  # raise_explained raises; this line is never reached

    def _prepare_in_full(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _call.Call:
        """`prepare` for arguments that already include the bound ones (a `SiteCall`'s)."""
        return self._prepare(args[self._n_partial :], kwargs, abstract=False)

    def _run(self, call: _call.PreparedCall, entry: _Entry, executable: Callable[..., Any]) -> Any:
        """Run ``executable`` (the jitted or an AOT-compiled function) on ``call``'s arrays."""
        if entry.layout is not None:
            _check_donation(call, *entry.layout)
        arrays = entry.args(call.dynamic)

        def jax_call() -> tuple[Any, Any]:
            out, updates = executable(*arrays)
            if updates is None or not entry.record.metadata_updates:
                # No trace of this entry recorded metadata updates (the pure function's
                # last one among them): `run` writes the values.
                return out, updates
            return out, _writeback.WriteBack(call, updates, entry.metadata_for(call.dynamic))

        if entry.layout is not None:
            # Once the executable consumed the donated buffers, the new values are the
            # only whole state until written: a signal's handler waits for the write
            # (treemode._pipeline._interrupts; one raised during the trace or compilation, before
            # anything was consumed, is raised at once).
            token = _interrupts.hold(arrays[0])
            try:
                return _core.run(call, entry.pure, jax_call, layout=entry.layout)
            finally:
                if token is not None:
                    _interrupts.close()
                    _interrupts.release(token)
        return _core.run(call, entry.pure, jax_call)

    # -- AOT ---------------------------------------------------------------------

    def trace(self, *args: Any, **kwargs: Any) -> Traced:
        """Trace without compiling; ``.jaxpr`` and ``.lower()`` are available."""
        call = self._prepare(args, kwargs, abstract=True)
        entry = self._entry(call)
        arrays = entry.args(call.dynamic)
        traced = _core.run(
            call, entry.pure, lambda: (entry.jitted.trace(*arrays), None), finish=False
        )
        return Traced(self, call.key, traced)

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
            jitted: Any = entry.jitted  # a jax.jit function (its stub omits clear_cache)
            jitted.clear_cache()
        self._cache.clear()
        self._memo = None
        self._record = None
        self._record_due = False

    # -- what Flax's and JAX's wrappers offer --------------------------------------

    @property
    def fun(self) -> Callable[P, R]:
        """The function that was compiled (Flax's name for `fn`)."""
        return self.fn

    @property
    def jitted_fn(self) -> JittedFunctions:
        """The ``jax.jit`` functions behind this wrapper (Flax's ``jitted_fn``).

        treemode compiles one ``jax.jit`` function per call structure, so this
        is a view of all of them: ``jitted_fn._cache_size()`` counts their
        executables, as on one ``jax.jit`` function.
        """
        return JittedFunctions(self)

    def _cache_size(self) -> int:
        """How many executables the calls so far compiled (as on a ``jax.jit`` function)."""
        return self.jitted_fn._cache_size()

    def __repr__(self) -> str:
        bound = f" with {len(self.partial_args)} bound argument(s)" if self.partial_args else ""
        return f"<treemode.jit of {self.fn!r}{bound}>"


if _compiled.FastCall is None:
    JitWrapped.__call__ = JitWrapped._call  # type: ignore[method-assign]


class JittedFunctions:
    """The ``jax.jit`` functions of one `treemode.jit` wrapper, one per call structure.

    What Flax's ``nnx.jit(...).jitted_fn`` is read for: ``_cache_size()`` (the
    number of compiled executables) and ``clear_cache()``. The functions take
    treemode's flat arrays, not the user's arguments: call the wrapper itself.
    """

    __slots__ = ("_wrapped",)

    def __init__(self, wrapped: JitWrapped[Any, Any]):
        self._wrapped = wrapped

    @property
    def functions(self) -> tuple[Any, ...]:
        """The ``jax.jit`` functions, in the order their structures were first called."""
        return tuple(entry.jitted for entry in self._wrapped._cache.values())

    def _cache_size(self) -> int:
        """The number of executables compiled so far, over every call structure."""
        return sum(fn._cache_size() for fn in self.functions)

    def clear_cache(self) -> None:
        """As `JitWrapped.clear_cache`."""
        self._wrapped.clear_cache()

    def __len__(self) -> int:
        return len(self._wrapped._cache)

    def __repr__(self) -> str:
        return f"<jax.jit functions of {self._wrapped!r}: {len(self)} call structure(s)>"


def _whole(out: Any) -> Any:
    return out


def _is_sharding(x: Any) -> bool:
    return isinstance(x, (jax.sharding.Sharding, jax.sharding.PartitionSpec))


def _check_donation(call: _call.PreparedCall, donated: Sequence[int], kept: Sequence[int]) -> None:
    """Two donated leaves sharing a buffer fail inside XLA: name them here.

    A donated device buffer must appear once among the call's arrays; arrays
    that are not donated may be shared freely. Python numbers and NumPy arrays
    are copied to the device, and tracers are not donated, so only concrete
    ``jax.Array`` leaves count (two Variables holding the int ``0`` share an
    object, not a buffer).
    """
    dynamic = call.dynamic
    donated_ids = {id(dynamic[i]) for i in donated}
    if len(donated_ids) == len(donated) and donated_ids.isdisjoint(id(dynamic[i]) for i in kept):
        return
    seen: set[int] = set()
    for i in donated:
        if _is_buffer(dynamic[i]):
            if id(dynamic[i]) in seen:
                _raise_shared_buffer(call.full(), dynamic[i])
            seen.add(id(dynamic[i]))
    for i in kept:
        if id(dynamic[i]) in seen:
            _raise_shared_buffer(call.full(), dynamic[i])


def _is_buffer(x: Any) -> bool:
    return isinstance(x, jax.Array) and not isinstance(x, Tracer)


def _raise_shared_buffer(call: _call.Call, array: Any) -> None:
    paths = [
        where
        for where, leaf in call.paths_and_leaves()
        if (leaf.get_raw_value() if is_variable(leaf) else leaf) is array
    ]
    raise DonationError(
        "treemode.jit: the same buffer is reachable at "
        + " and ".join(paths[:2])
        + ", and at least one of them is donated. XLA cannot donate a buffer that is "
        "used twice. If one argument is a copy of the other, make it with "
        "treemode.clone(module, arrays=True) so it has buffers of its own."
    )


class _Stage:
    """A stage of ahead-of-time compilation: wraps the JAX stage of the same name.

    Every attribute of the JAX stage is available; treemode adds the argument
    handling for calls and remembers the call structure it was made for.
    """

    def __init__(self, wrapped: JitWrapped[Any, Any], key: _call.CallKey, stage: Any):
        self._wrapped = wrapped
        self._key = key
        self._stage = stage

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stage, name)


class Traced(_Stage):
    """The result of `JitWrapped.trace` (a ``jax.stages.Traced``): ``.jaxpr``, ``.lower()``."""

    def lower(self, **kwargs: Any) -> Lowered:
        return Lowered(self._wrapped, self._key, self._stage.lower(**kwargs))


class Lowered(_Stage):
    """The result of `JitWrapped.lower` (a ``jax.stages.Lowered``): ``.compile()``."""

    def compile(self, *args: Any, **kwargs: Any) -> Compiled:
        return Compiled(self._wrapped, self._key, self._stage.compile(*args, **kwargs))


class Compiled(_Stage):
    """A compiled call (a ``jax.stages.Compiled``); calling it runs like the jitted function.

    Arguments are flattened, checked (donation, structure) and the changed
    Variables written back exactly as a call of the `treemode.jit` function does.
    """

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        wrapped = self._wrapped
        call = wrapped._prepare(args, kwargs, abstract=False)
        if call.key != self._key:
            raise StructureError(
                "treemode.jit: this Compiled function was lowered for arguments of "
                "another structure (modules, Variable types or metadata, static values "
                "differ). Lower and compile again for these arguments, or call the "
                "treemode.jit function itself, which compiles per structure."
            )
        return wrapped._run(call, wrapped._entry(call), self._stage)


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

    **Arguments:**

    - `fun`: the function to compile (positional only). Omit it to use
      `jit(...)` as a decorator factory; `jit` also decorates methods.
    - `in_shardings`, `out_shardings`: as in `jax.jit`; a prefix may be
      module-shaped (the module with a sharding in place of each Variable).
      Updated Variables come back with their input sharding.
    - `static_argnums`, `static_argnames`: arguments that are part of the cache
      key instead of traced (must be hashable).
    - `donate_argnums`, `donate_argnames`: arguments whose buffers XLA may reuse.
      Their Variables are refreshed with the output buffers, so the modules stay
      usable. An exception a signal handler raises in the main thread (Ctrl-C,
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
    options: dict[str, Any] = dict(
        in_shardings=in_shardings,
        out_shardings=out_shardings,
        static_argnums=static_argnums,
        static_argnames=static_argnames,
        donate_argnums=donate_argnums,
        donate_argnames=donate_argnames,
        keep_unused=keep_unused,
        device=device,
        backend=backend,
        inline=inline,
        compiler_options=compiler_options,
        graph=graph,
    )
    return make_wrapper(JitWrapped, fun, options, transform="jit", specs=_SHARDINGS, shardings=True)


class _JitOptions(TypedDict, total=False):
    """The keyword options of `jit_partial`, for its overloads."""

    in_shardings: Any
    out_shardings: Any
    static_argnums: int | Sequence[int] | None
    static_argnames: str | Iterable[str] | None
    donate_argnums: int | Sequence[int] | None
    donate_argnames: str | Iterable[str] | None
    keep_unused: bool
    device: Any
    backend: str | None
    inline: bool
    compiler_options: dict[str, Any] | None
    graph: bool


# The bound arguments' types, for the overloads of `jit_partial`.
_A1 = TypeVar("_A1")
_A2 = TypeVar("_A2")
_A3 = TypeVar("_A3")


# For type checkers the wrapper takes the parameters after the bound ones (up to
# three bound arguments: a model, an optimizer, metrics); with more, any.
@overload
def jit_partial(fun: Callable[P, R], /, **options: Unpack[_JitOptions]) -> JitWrapped[P, R]: ...


@overload
def jit_partial(
    fun: Callable[Concatenate[_A1, P], R], a1: _A1, /, **options: Unpack[_JitOptions]
) -> JitWrapped[P, R]: ...


@overload
def jit_partial(
    fun: Callable[Concatenate[_A1, _A2, P], R],
    a1: _A1,
    a2: _A2,
    /,
    **options: Unpack[_JitOptions],
) -> JitWrapped[P, R]: ...


@overload
def jit_partial(
    fun: Callable[Concatenate[_A1, _A2, _A3, P], R],
    a1: _A1,
    a2: _A2,
    a3: _A3,
    /,
    **options: Unpack[_JitOptions],
) -> JitWrapped[P, R]: ...


@overload
def jit_partial(
    fun: Callable[..., R], /, *partial_args: Any, **options: Unpack[_JitOptions]
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
    options: dict[str, Any] = dict(
        in_shardings=in_shardings,
        out_shardings=out_shardings,
        static_argnums=static_argnums,
        static_argnames=static_argnames,
        donate_argnums=donate_argnums,
        donate_argnames=donate_argnames,
        keep_unused=keep_unused,
        device=device,
        backend=backend,
        inline=inline,
        compiler_options=compiler_options,
        graph=graph,
        partial_args=tuple(partial_args),
    )
    # The shardings are checked first, then the bound arguments, then it is made.
    make = make_wrapper(
        JitWrapped, None, options, transform="jit_partial", specs=_SHARDINGS, shardings=True
    )
    if not graph:  # the bound arguments are fixed: check them for aliases now
        check_no_aliases("jit_partial", args=tuple(partial_args))
    return make(fun)
