"""The compiled form of one call structure of a `treemode.jit` function (`_JitEntry`).

An entry owns the ``jax.jit`` functions of one call structure: one positional
executable, or, with donation, the undonated ``probe`` and one donated executable
per write set (donation by effect). It refers to the user's function only while
a call is bound (`_pure.PureFunction`), and its ``jax.jit`` functions refer to
the entry's parts, not to the entry: dropping the entry frees them by reference
counting, with no cycle for the collector. `JittedFunctions` is the view of a
wrapper's entries that Flax's ``jitted_fn`` offers.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.core import Tracer

from .. import _compat
from .._accel._border import entry_result
from .._errors import DonationError
from .._pipeline import _call, _explain, _pure, _retrace
from .._tree._leaves import is_variable
from ._names import FLAT_ARGUMENTS, SPLIT_ARGUMENTS, named

Split = tuple[tuple[int, ...], tuple[int, ...]]


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
    is traced. The first call of an entry traces the user function once,
    without donation (``probe``, a ``jax.jit`` that is never compiled), and the
    donated executable of that write set (``jitted``, ``split``) calls ``probe``
    inside its own trace, where JAX's trace cache (keyed as JAX keys it: avals
    with shardings and weak types, and the trace context) hands back the probe's
    trace: the user function runs once per signature, as under ``jax.jit``. A new
    signature is traced by the current executable itself; one whose trace writes
    another set raises `_Unprobed` before anything runs or is donated, and the
    call takes the executable of that set (`known_split`), probing it if needed.
    Every set keeps its executable.

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
        "_owner",
        "_candidates",
        "_in_shardings",
        "_jit_kwargs",
        "_splits",
        "_executables",
        "_arg_names",
    )

    def __init__(
        self,
        pure: _pure.PureFunction,
        jit_kwargs: dict[str, Any],
        donated: list[int],
        n: int,
        owner: Sequence[int] = (),
        in_shardings: Sequence[Any] | None = None,
        arg_names: Sequence[str] | None = None,
    ):
        self.pure = pure
        self.findings = _EntryFindings()
        self.traced_types: list[tuple[Any, ...]] = []  # per trace (see `_retrace`)
        compact = "out_shardings" not in jit_kwargs
        # Named like the user function: JAX's program (``jit_<name>``), its
        # messages and profiles then read like the user's code (`_names`), and
        # JAX names each array by its path in the call that built the entry
        # (``model.kernel``, ``x``: `_retrace.dynamic_paths`).
        self._arg_names = None if arg_names is None else tuple(arg_names)
        explained = _compat.NAMES_ARGUMENTS and self._arg_names is not None
        traced = _traced_function(pure, self.findings, self.traced_types, compact, explained)
        flat = named(traced, pure.fn, FLAT_ARGUMENTS, "jit", self._arg_names)
        pure.fn = None  # the bound call's function: the entry keeps no user function
        if in_shardings is not None:
            jit_kwargs = dict(jit_kwargs, in_shardings=tuple(in_shardings))
        self.probe: Any = None
        self.split: Split | None = None
        self.donates = bool(donated)  # whether the executable is `probe`'s donated one
        if donated:
            _explain.note_donation()
            # Per dynamic array, the Variable whose value it is (-1: another leaf).
            self._owner = tuple(owner)
            self._candidates = tuple(donated)
            self._in_shardings = in_shardings
            self._jit_kwargs = jit_kwargs
            # The donation split of each signature traced (`_signature`), and the
            # donated executable of each split: every write set keeps its program.
            self._splits: dict[tuple[Any, ...], Split] = {}
            self._executables: dict[Split, Any] = {}
            self.probe = jax.jit(flat, **jit_kwargs)
            self.jitted: Any = None  # set by the first `probe_call`
        else:
            self.jitted = jax.jit(flat, **jit_kwargs)

    def probe_call(self, dynamic: Sequence[Any]) -> tuple[Any, Split]:
        """Trace the function for ``dynamic``'s signature (the pure function bound to
        the call) and make the donated executable of what it writes the current one.

        The trace is ``probe``'s: JAX keeps it in its own trace cache, keyed as JAX
        keys it (the abstract values with their shardings and weak types, and the
        trace context), and the donated executable calls ``probe`` inside its own
        trace, where JAX finds it again: the user function runs once per signature.
        """
        traced = self.probe.trace(*dynamic)
        _, updates_info = traced.out_info
        split = _written_split(self._owner, self._candidates, updates_info, len(dynamic))
        self._splits[_signature(dynamic)] = split
        return self._use(split), split

    def _use(self, split: Split) -> Any:
        """Make the donated executable of ``split`` the current one."""
        jitted = self._executables.get(split)
        if jitted is None:
            kwargs = self._jit_kwargs
            if self._in_shardings is not None:
                kwargs = dict(kwargs, in_shardings=_arrange(self._in_shardings, split))
            call_split = _donating_function(
                self.probe, self._owner, self._candidates, split, self._splits, self.pure.transform
            )
            names = self._arg_names
            if names is not None:
                names = tuple(names[i] for i in split[0] + split[1])
            flat = named(call_split, self.probe, SPLIT_ARGUMENTS, "jit", names)
            jitted = self._executables[split] = jax.jit(flat, donate_argnums=0, **kwargs)
        self.jitted = jitted
        self.split = split
        return jitted

    def known_split(self, dynamic: Sequence[Any]) -> tuple[Any, Split] | None:
        """The executable and split of ``dynamic``'s signature if a trace of it is
        known (``None``: probe it)."""
        split = self._splits.get(_signature(dynamic))
        return None if split is None else (self._use(split), split)

    def for_call(self, dynamic: Sequence[Any]) -> tuple[Any, Split] | None:
        """The executable and split to call ``dynamic`` with: the current one, or
        where several write sets were seen, the one of ``dynamic``'s signature."""
        if self.jitted is None or self.split is None:
            return None
        if len(self._executables) > 1:
            known = self.known_split(dynamic)
            if known is not None:
                return known
        return self.jitted, self.split

    def telling_apart(self, dynamic: Sequence[Any]) -> tuple[tuple[int, Any], ...]:
        """What a record of ``dynamic``'s signature checks so that the executor runs
        it on that signature's write set only: ``(position, abstract value)`` for
        each array whose abstract value differs from a known signature of another
        set (none where every signature writes one set)."""
        if self.probe is None or len(self._executables) < 2:
            return ()
        context, avals = _signature(dynamic)
        split = self._splits.get((context, avals))
        positions: set[int] = set()
        for (other_context, other), other_split in self._splits.items():
            if other_split != split and other_context == context and len(other) == len(avals):
                positions.update(
                    i for i, (a, b) in enumerate(zip(avals, other, strict=True)) if a != b
                )
        return tuple((i, avals[i]) for i in sorted(positions))

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
            self._splits.clear()
            self._executables.clear()
            self.jitted = None
            self.split = None


def _traced_function(
    pure: _pure.PureFunction,
    findings: _EntryFindings,
    traced_types: list[tuple[Any, ...]],
    compact: bool,
    jax_explains: bool = False,
) -> Callable[..., Any]:
    """The function of the dynamic arrays that ``jax.jit`` traces: the pure
    function, the trace's metadata updates noted, ``(out, updates)`` returned.
    ``jax_explains``: JAX names the arrays by the user's paths in its own
    explanation of a retrace (treemode logs none)."""

    def call_flat(*dynamic: Any) -> Any:
        call = getattr(pure.binding, "call", None)
        if call is not None:  # at trace time: explain a retrace (`_retrace`)
            _retrace.new_types("jit", call.fn, call, traced_types, dynamic, jax_explains)
        out, updates = pure(*dynamic)
        metadata = pure.findings.metadata_updates
        findings.note(dynamic, metadata)
        if compact and not metadata and all(u is None for u in updates):
            updates = None
        # What the executable returns is what the executor reads (`_border`).
        return entry_result(out, updates)

    return call_flat


def _written_split(owner: Sequence[int], candidates: Sequence[int], updates: Any, n: int) -> Split:
    """The donation split of a trace whose updates are ``updates``: the donated
    candidates that are not Variable values or are values the trace writes."""
    written: set[int] = set()
    if updates is not None:
        written = {i for i, u in enumerate(updates) if u is not None}
    donated = tuple(j for j in candidates if owner[j] < 0 or owner[j] in written)
    return _donation_split(donated, n) or ((), tuple(range(n)))


def _donating_function(
    probe: Any,
    owner: Sequence[int],
    candidates: Sequence[int],
    split: Split,
    splits: dict[tuple[Any, ...], Split],
    transform: str,
) -> Callable[..., Any]:
    """The function the donated executable of ``split`` traces: ``probe`` on the
    arrays in their order, refused (`_Unprobed`) where the trace writes another set.

    Either way the signature's split is noted in ``splits`` (the entry's; a dict,
    not the entry, so the executable refers to no entry): the call then takes the
    executable of that set without probing."""
    order = [0] * (len(split[0]) + len(split[1]))
    for position, i in enumerate(split[0] + split[1]):
        order[i] = position
    n = len(order)

    def call_split(donated: tuple[Any, ...], kept: tuple[Any, ...]) -> Any:
        joined = donated + kept
        dynamic = [joined[j] for j in order]
        # One explanation per retrace: this trace's own (JAX's, naming the user's
        # paths), not a second one for the probe it traces inside.
        with _retrace.jax_explanations_off():
            result = probe(*dynamic)
        written = _written_split(owner, candidates, result[1], n)
        splits[_signature(dynamic)] = written
        if written != split:
            # This signature writes another set: nothing has run or been donated.
            raise _Unprobed(transform)
        return result

    return call_split


class JittedFunctions:
    """The ``jax.jit`` functions of one `treemode.jit` wrapper, one per call structure.

    What Flax's ``nnx.jit(...).jitted_fn`` is read for: ``_cache_size()`` (the
    number of compiled executables) and ``clear_cache()``. The functions take
    treemode's flat arrays, not the user's arguments: call the wrapper itself.
    """

    __slots__ = ("_ref",)

    def __init__(self, wrapped: Any):
        # Weakly: the wrapper holds this view in its __dict__ (no reference cycle).
        self._ref = weakref.ref(wrapped)

    @property
    def _wrapped(self) -> Any:
        wrapped = self._ref()
        if wrapped is None:
            raise ReferenceError("treemode.jit: the jitted function was deleted")
        return wrapped

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
        wrapped = self._ref()
        if wrapped is None:
            return "<jax.jit functions of a deleted treemode.jit function>"
        return f"<jax.jit functions of {wrapped!r}: {len(self)} call structure(s)>"


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
    """What ``jax.jit`` tells traces apart by, read from JAX (`_compat.trace_key`): each
    input's abstract value (shape, dtype, weak type, sharding) and the trace context."""
    return _compat.trace_key(map(jax.typeof, dynamic))


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
