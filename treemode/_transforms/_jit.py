"""``treemode.jit`` and ``treemode.jit_partial``."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence
from types import FunctionType
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

from .. import _caches, _compat
from .._accel import _compiled
from .._accel._border import entry_result
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


class _JitEntry:
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

    **Donation by effect.** An entry with donated arguments donates exactly the
    buffers the function writes: the values of the Variables its trace updates,
    and the donated arrays that are not Variable values (as ``jax.jit`` does).
    Read-only Variables of a donated argument are passed undonated, are not
    outputs, and keep their buffers. What a trace writes is known only once it
    is traced, so a call of a signature not seen yet first traces the user
    function once, without donation (``probe``, a ``jax.jit`` that is never
    compiled), and the donated executable of that write set (``jitted``,
    ``split``) replays the probe's jaxpr (`_Replay`): the user function runs
    once per signature, as under ``jax.jit``. A signature whose trace writes
    another set gets its own executable; the one called last is the entry's
    ``jitted``. The executable of one set raises `_Unprobed` when JAX traces it
    for a signature it was not probed for (new shapes, or another set): nothing
    has run, and the caller probes and calls again.

    Metadata updates are static, so each trace keeps its own in `findings`,
    under the abstract values of its inputs: ``jax.jit`` keeps one executable
    per input shape under this one entry, and a call writes back the metadata
    updates of the trace its executable came from.
    """

    __slots__ = (
        "pure",
        "jitted",
        "split",
        "findings",
        "traced_types",
        "probe",
        "donates",
        "_compact",
        "_candidates",
        "_owner",
        "_in_shardings",
        "_jit_kwargs",
        "_replays",
        "_executables",
    )

    def __init__(
        self,
        pure: _pure.PureFunction,
        jit_kwargs: dict[str, Any],
        donated: list[int],
        n: int,
        owner: Sequence[int] = (),
        in_shardings: Sequence[Any] | None = None,
    ):
        self.pure = pure
        self.findings = _EntryFindings()
        self.traced_types: list[tuple[Any, ...]] = []  # per trace (see `_retrace`)
        self._compact = "out_shardings" not in jit_kwargs
        # Named like the user function: JAX's program (``jit_<name>``), its
        # messages and profiles then read like the user's code (`_names`).
        flat = named(self._call_flat, pure.fn, FLAT_ARGUMENTS)
        if in_shardings is not None:
            jit_kwargs = dict(jit_kwargs, in_shardings=tuple(in_shardings))
        self.probe: Any = None
        self.split: tuple[tuple[int, ...], tuple[int, ...]] | None = None
        self.donates = bool(donated)  # whether the executable is `probe`'s donated one
        if donated:
            _explain.note_donation()
            # Per dynamic array, the Variable whose value it is (-1: another leaf).
            self._owner = owner
            self._candidates = tuple(donated)
            self._in_shardings = in_shardings
            self._jit_kwargs = jit_kwargs
            self._replays: dict[tuple[Any, ...], _Replay] = {}
            self._executables: dict[tuple[tuple[int, ...], tuple[int, ...]], Any] = {}
            self.probe = jax.jit(flat, **jit_kwargs)
            self.jitted: Any = None  # set by the first `probe_call`
        else:
            self.jitted = jax.jit(flat, **jit_kwargs)

    def _call_flat(self, *dynamic: Any) -> Any:
        return self._traced(dynamic)

    def _traced(self, dynamic: Sequence[Any]) -> tuple[Any, tuple[Any, ...] | None]:
        self._note_types(dynamic)
        out, updates = self.pure(*dynamic)
        metadata = self.pure.findings.metadata_updates
        self.findings.note(dynamic, metadata)
        if self._compact and not metadata and all(u is None for u in updates):
            updates = None
        # What the executable returns is what the executor reads (`_border`).
        return entry_result(out, updates)

    def _note_types(self, dynamic: Sequence[Any]) -> None:
        """At trace time (JAX traces again for new shapes/dtypes): explain a retrace."""
        call = getattr(self.pure.binding, "call", None)
        if call is not None:
            _retrace.new_types("jit", self.pure.fn, call, self.traced_types, dynamic)

    def probe_call(
        self, dynamic: Sequence[Any]
    ) -> tuple[Any, tuple[tuple[int, ...], tuple[int, ...]]]:
        """Trace the function for ``dynamic``'s signature (the pure function bound to
        the call) and make the donated executable of what it writes the current one."""
        traced = self.probe.trace(*dynamic)
        out_info, updates_info = traced.out_info
        n = len(dynamic)
        written: set[int] = set()
        if updates_info is not None:
            written = {i for i, u in enumerate(updates_info) if u is not None}
        owner = self._owner
        donated = tuple(j for j in self._candidates if owner[j] < 0 or owner[j] in written)
        split = _donation_split(donated, n) or ((), tuple(range(n)))
        self._replays[_avals_key(traced.jaxpr.in_avals)] = _Replay(
            traced.jaxpr, jax.tree_util.tree_structure(traced.out_info), split
        )
        jitted = self._executables.get(split)
        if jitted is None:
            jitted = self._executables[split] = self._donating(split)
        self.jitted = jitted
        self.split = split
        return jitted, split

    def _donating(self, split: tuple[tuple[int, ...], tuple[int, ...]]) -> Any:
        """The ``jax.jit`` of the replayed traces that donate ``split[0]``."""
        order = [0] * (len(split[0]) + len(split[1]))
        for position, i in enumerate(split[0] + split[1]):
            order[i] = position
        replays = self._replays

        def call_split(donated: tuple[Any, ...], kept: tuple[Any, ...]) -> Any:
            joined = donated + kept
            dynamic = [joined[j] for j in order]
            replay = replays.get(_signature(dynamic))
            if replay is None or replay.split != split:
                raise _Unprobed(self.pure.transform)
            return replay(dynamic)

        kwargs = self._jit_kwargs
        if self._in_shardings is not None:
            kwargs = dict(kwargs, in_shardings=_arrange(self._in_shardings, split))
        return jax.jit(named(call_split, self.pure.fn, SPLIT_ARGUMENTS), donate_argnums=0, **kwargs)

    def metadata_for(self, dynamic: Sequence[Any]) -> dict[int, dict[str, Any]] | None:
        """The metadata updates of the trace whose executable ran on ``dynamic``."""
        if not self.findings.metadata_updates:
            return None  # no trace of this entry recorded one
        return self.findings.by_signature.get(_signature(dynamic))

    def args(self, dynamic: Sequence[Any]) -> tuple[Any, ...]:
        return _arrange(dynamic, self.split)

    def executables(self) -> tuple[Any, ...]:
        """Every ``jax.jit`` function of this entry that compiles."""
        if self.probe is None:
            return (self.jitted,)
        return tuple(self._executables.values())

    def clear(self) -> None:
        for jitted in self.executables():
            jitted.clear_cache()
        if self.probe is not None:
            self.probe.clear_cache()
            self._replays.clear()
            self._executables.clear()
            self.jitted = None
            self.split = None


class _Replay:
    """The jaxpr of one probed trace, replayed by the donated executable of its write set."""

    __slots__ = ("run", "out_tree", "split")

    def __init__(self, jaxpr: Any, out_tree: Any, split: tuple[tuple[int, ...], tuple[int, ...]]):
        self.run = _compat.jaxpr_as_fun(jaxpr)
        self.out_tree = out_tree
        self.split = split

    def __call__(self, dynamic: Sequence[Any]) -> Any:
        return jax.tree_util.tree_unflatten(self.out_tree, self.run(*dynamic))


class _Unprobed(_pure.UnboundTrace):
    """A donated executable was traced for a signature its write set was not probed for.

    Raised while JAX traces, before anything runs or is donated: the caller probes
    (`_JitEntry.probe_call`) and calls again. The compiled executor treats it as any
    `UnboundTrace`: a miss.
    """


def _forget_failed_dispatch(jitted: Any) -> None:
    """Drop the C++ dispatch entries of ``jitted`` after a trace raised inside it.

    When a trace that JAX's C++ dispatch started raises (`UnboundTrace`,
    `_Unprobed`: the call is retried through the pipeline), JAX keeps an entry
    for that signature that sends every later call through its Python path
    (measured: 5 of 5 calls, against 1 for a function whose first trace did not
    raise), several times slower on a large program. Clearing the C++ entries
    (not the traces or executables, which stay cached) lets the next call
    rebuild them.
    """
    clear = getattr(jitted, "_clear_cache", None)
    if clear is not None:
        clear()


def _donation_split(
    donated: Sequence[int], n: int
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """``(donated, kept)`` indices of ``n`` dynamic arrays, or None when none is donated."""
    if not donated:
        return None
    donated_set = set(donated)
    return tuple(donated), tuple(i for i in range(n) if i not in donated_set)


def _arrange(
    per_dynamic: Sequence[Any], split: tuple[tuple[int, ...], tuple[int, ...]] | None
) -> tuple[Any, ...]:
    """One value per dynamic array (the arrays, or their shardings) as the entry's
    executable takes them: positionally, or as the donated and the kept tuples."""
    if split is None:
        return tuple(per_dynamic)
    donated, kept = split
    return tuple(per_dynamic[i] for i in donated), tuple(per_dynamic[i] for i in kept)


# How many sets of objects a wrapper keeps on its fast path (as JAX keeps one
# executable per signature): a train step and an eval of its EMA copy, a teacher
# and a student, the models of an ensemble.
_MEMOS = 8


class _Memo:
    """One set of objects a `JitWrapped` was called with: the call-site memo
    (`CallSite`), the compiled entry, and the fast-path record emitted for them
    (``None``: not yet, or not trustable; ``due``: to emit after the next run)."""

    __slots__ = ("site", "entry", "record", "due")

    def __init__(self, site: CallSite, entry: _JitEntry):
        self.site = site
        self.entry = entry
        self.record: Any = None
        self.due = True


class _SharedJit:
    """What every `treemode.jit` wrapper of one function with the same options
    shares, as ``jax.jit`` caches on the function: the resolved settings, the
    compiled entries and the memos (with their fast-path records).

    Kept in the function's ``__dict__`` (so it lives exactly as long as the
    function, and keeps nothing else alive), by options.
    """

    __slots__ = ("fn", "settings", "entries", "memos", "records", "__weakref__")

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn
        self.settings: dict[str, Any] | None = None  # set by the first wrapper
        self.entries: dict[_call.CallKey, _JitEntry] = {}
        self.memos: tuple[_Memo, ...] = ()
        self.records: tuple[Any, ...] = ()

    @staticmethod
    def find(fn: FunctionType, options: tuple[Any, ...]) -> _SharedJit | None:
        """The state shared by ``fn``'s wrappers with ``options`` (``None``: unhashable)."""
        try:
            hash(options)
        except TypeError:
            return None
        table = fn.__dict__.get(_SHARED_ATTRIBUTE)
        if type(table) is not _SharedTable or table.fn is not fn:
            # None yet, or another function's, copied by functools.wraps.
            table = fn.__dict__[_SHARED_ATTRIBUTE] = _SharedTable(fn)
        shared = table.by_options.get(options)
        if shared is None:
            shared = table.by_options[options] = _SharedJit(fn)
            _caches.track(shared)
        return shared

    def prepare_in_full(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _call.Call:
        """`prepare` of a call of these wrappers (they bind no arguments)."""
        settings = self.settings
        assert settings is not None
        return _call.prepare(
            "jit",
            self.fn,
            args,
            kwargs,
            graph=settings["graph"],
            static_argnums=settings["static_argnums"],
            static_argnames=settings["static_argnames"],
            abstract=False,
        )

    def forget_memos(self) -> None:
        self.memos = ()
        self.records = ()

    def clear_cache(self) -> None:
        for entry in self.entries.values():
            entry.clear()
        self.entries.clear()
        self.forget_memos()


_SHARED_ATTRIBUTE = "__treemode_jit__"


class _SharedTable:
    """``fn.__dict__[_SHARED_ATTRIBUTE]``: the `_SharedJit` of each set of options."""

    __slots__ = ("fn", "by_options")

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn
        self.by_options: dict[tuple[Any, ...], _SharedJit] = {}


class _EntryFindings:
    """The metadata updates of every trace of one `_JitEntry`, by input signature.

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
    return _avals_key(map(jax.typeof, dynamic))


def _avals_key(avals: Iterable[Any]) -> tuple[Any, ...]:
    """`_signature` of inputs given by their abstract values (a trace's ``in_avals``)."""
    return tuple((a.shape, a.dtype, a.weak_type) for a in avals)


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
        # A wrapper of a function already wrapped with the same options (one made
        # inline, in a loop) takes that one's settings, entries and memos.
        shared = None
        if not partial_args and type(fn) is FunctionType:
            options = (
                in_shardings,
                out_shardings,
                static_argnums,
                static_argnames,
                donate_argnums,
                donate_argnames,
                keep_unused,
                device,
                backend,
                inline,
                None if compiler_options is None else tuple(sorted(compiler_options.items())),
                graph,
            )
            shared = _SharedJit.find(fn, options)
            if shared is not None and shared.settings is not None:
                self.__dict__.update(shared.settings)
                self._memos = shared.memos
                self._records = shared.records
                if _compiled.FastCall is not None:
                    self._miss = type(self)._on_miss
                _caches.track(self)
                return
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
        self._cache: dict[_call.CallKey, _JitEntry] = {}
        self._shared = shared
        if shared is not None:
            self._cache = shared.entries
            shared.settings = dict(self.__dict__)
        self._start_fast_path()
        _caches.track(self)  # treemode.clear_caches() calls clear_cache()

    def _start_fast_path(self, memos: tuple[_Memo, ...] = ()) -> None:
        # One memo per set of objects called with (see `_Memo`), the most recent
        # first (a tuple replaced whole: threads never see one half-changed), and
        # their fast-path records, which the extension's executor tries in order.
        self._memos = tuple(_Memo(m.site, m.entry) for m in memos)
        self._records: Any = ()
        if _compiled.FastCall is not None:
            # The executor's one callback, called with the wrapper first: a function,
            # not a bound method, so the wrapper makes no reference cycle.
            self._miss = type(self)._on_miss

    def __copy__(self) -> JitWrapped[P, R]:
        """``copy.copy``: a wrapper of the same function sharing its compiled entries."""
        copied = type(self).__new__(type(self))
        copied.__dict__.update(self.__dict__)
        copied._start_fast_path(self._memos)  # records emitted again (the miss is the copy's)
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
            copied._start_fast_path()  # the memos matched the original's bound objects
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

    def _entry(self, call: _call.Call) -> _JitEntry:
        entry = self._cache.get(call.key)
        if entry is None:
            entry = self._cache[call.key] = self._build(call)
        return entry

    def _donated_roots(self, call: _call.Call) -> list[int]:
        """Indices into ``call.arg_flats`` of the donated arguments."""
        return call.traced_roots(self.donate_argnums, self.donate_argnames)

    def _build(self, call: _call.Call) -> _JitEntry:
        donated = self._donated_roots(call)
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
        if self.graph and self.out_shardings is not _UNSET:  # one per shared Variable
            pure.output_spec = ("out_shardings", self.out_shardings, _whole, _is_sharding, "output")
        jit_kwargs: dict[str, Any] = dict(keep_unused=self.keep_unused, inline=self.inline)
        if self.device is not None:
            jit_kwargs["device"] = self.device
        if self.backend is not None:
            jit_kwargs["backend"] = self.backend
        if self.compiler_options is not None:
            jit_kwargs["compiler_options"] = self.compiler_options
        in_shardings = None
        if self.in_shardings is not _UNSET:
            in_shardings = self._flat_in_shardings(call)
        if self.out_shardings is not _UNSET or self.in_shardings is not _UNSET:
            var_shardings = self._variable_shardings(call)
            out = None if self.out_shardings is _UNSET else self._jax_out_shardings
            jit_kwargs["out_shardings"] = (out, tuple(var_shardings))
        return _JitEntry(pure, jit_kwargs, donate_flat, len(call.dynamic), owner, in_shardings)

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
        """A call through the pipeline: a memo's `CallSite.match`, else `prepare`."""
        memos = self._memos
        if memos:
            roots = (*self.partial_args, *args) if self._n_partial else args
            for memo in memos:
                matched = memo.site.match(roots, kwargs)
                if matched is not None:
                    entry = memo.entry
                    out = self._run(matched, entry)
                    record = memo.record
                    if memo.due or (
                        record is not None
                        and (entry.findings.metadata_updates or record.jitted is not entry.jitted)
                    ):
                        self._emit(memo, matched)
                    return out
        call = self._prepare(args, kwargs, abstract=False)
        new = call.key not in self._cache
        entry = self._entry(call)
        # The memo rebuilds a full call through an object that lives as long as the
        # memo may be used: the wrapper, or the state its function's wrappers share.
        rebuild = self._prepare_in_full if self._shared is None else self._shared.prepare_in_full
        site = CallSite.from_call(call, rebuild)
        memo = None
        if site is not None:
            # Emitted once this call ran (its trace may change the entry); the memo
            # of the same objects, if any, is replaced, and the oldest dropped.
            memo = _Memo(site, entry)
            kept = [m for m in memos if m.site.alive() and not site.same_objects(m.site)]
            kept = kept[: _MEMOS - 1]
            self._memos = (memo, *kept)
            self._publish()
        if new and _retrace.enabled():
            # treemode says what changed in the arguments; JAX, which sees a new
            # flat function, would only say that it was never seen.
            _retrace.new_structure("jit", self.fn, call.key, list(self._cache)[:-1])
            with _retrace.jax_explanations_off():
                out = self._run(call, entry)
        else:
            out = self._run(call, entry)
        if memo is not None:
            self._emit(memo, call)
        return out

    def _emit(self, memo: _Memo, call: _call.PreparedCall) -> None:
        """Emit the fast-path record of ``memo`` (`_callsite.fast_record`) after ``call`` ran."""
        entry = memo.entry
        memo.due = False
        memo.record = _callsite.fast_record(
            memo.site,
            call,
            self.partial_args,
            entry.jitted,
            entry.split,
            entry.findings.metadata_updates,
        )
        self._publish()

    def _publish(self) -> None:
        """Hand the executor the records of the current memos, in their order."""
        self._records = tuple(m.record for m in self._memos if m.record is not None)
        shared = self._shared
        if shared is not None:  # the next wrapper of the function starts with them
            shared.memos = self._memos
            shared.records = self._records

    @property
    def _memo(self) -> tuple[CallSite, _JitEntry] | None:
        """The most recent memo's site and entry (``None``: no memo)."""
        return (self._memos[0].site, self._memos[0].entry) if self._memos else None

    @property
    def _record(self) -> Any:
        """The most recent memo's fast-path record (``None``: none)."""
        return self._memos[0].record if self._memos else None

    def _on_miss(self, error: BaseException | None, args: tuple[Any, ...], kwargs: Any) -> Any:
        """The executor's miss: run the call through the pipeline, or explain the
        error its compiled entry raised (``error``)."""
        if error is None:
            return self._call(*args, **(kwargs or {}))
        if isinstance(error, _pure.UnboundTrace):  # `_Unprobed` too: JAX had to trace
            for memo in self._memos:
                if memo.record is not None:
                    _forget_failed_dispatch(memo.record.jitted)
            return self._call(*args, **(kwargs or {}))
        call = self._prepare(args, kwargs or {}, abstract=False)
        entry = self._cache.get(call.key)
        _explain.raise_explained(call, error, None if entry is None else entry.split)
        raise error  # raise_explained raises; this line is never reached

    def _prepare_in_full(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _call.Call:
        """`prepare` for arguments that already include the bound ones (a `SiteCall`'s)."""
        return self._prepare(args[self._n_partial :], kwargs, abstract=False)

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
        jitted, split = entry.jitted, entry.split
        if jitted is None:
            jitted, split = self._probe(call, entry)
        try:
            return self._execute(call, entry, jitted, split)
        except _Unprobed:
            # JAX traced the executable for a signature it was not probed for;
            # nothing ran: probe this one and call its executable.
            _forget_failed_dispatch(jitted)
            jitted, split = self._probe(call, entry)
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
        self._start_fast_path()
        if self._shared is not None:
            self._shared.forget_memos()

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


# The entry points from the user's code (the executor's miss included) are
# boundaries of JAX's traceback filtering: treemode's frames are left out.
for _entry_point in ("_call", "_on_miss", "trace", "lower", "eval_shape"):
    setattr(JitWrapped, _entry_point, _compat.api_boundary(getattr(JitWrapped, _entry_point)))

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
        return tuple(f for entry in self._wrapped._cache.values() for f in entry.executables())

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

    def __init__(
        self,
        wrapped: JitWrapped[Any, Any],
        key: _call.CallKey,
        stage: Any,
        split: tuple[tuple[int, ...], tuple[int, ...]] | None,
    ):
        self._wrapped = wrapped
        self._key = key
        self._stage = stage
        self._split = split  # how the stage takes donated arrays (`_donation_split`)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stage, name)


class Traced(_Stage):
    """The result of `JitWrapped.trace` (a ``jax.stages.Traced``): ``.jaxpr``, ``.lower()``."""

    def lower(self, **kwargs: Any) -> Lowered:
        return Lowered(self._wrapped, self._key, self._stage.lower(**kwargs), self._split)


class Lowered(_Stage):
    """The result of `JitWrapped.lower` (a ``jax.stages.Lowered``): ``.compile()``."""

    def compile(self, *args: Any, **kwargs: Any) -> Compiled:
        stage = self._stage.compile(*args, **kwargs)
        return Compiled(self._wrapped, self._key, stage, self._split)


class Compiled(_Stage):
    """A compiled call (a ``jax.stages.Compiled``); calling it runs like the jitted function.

    Arguments are flattened, checked (donation, structure) and the changed
    Variables written back exactly as a call of the `treemode.jit` function does.
    """

    @_compat.api_boundary
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
        return wrapped._run(call, wrapped._entry(call), self)


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
