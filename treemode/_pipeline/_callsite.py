"""The call-site memo: a transform called again with the same objects skips `prepare`.

A training loop calls its jitted step with the same model and optimizer objects
and new batches. `prepare` would flatten each argument (a cache hit), copy the
cached flattenings, search the closure (a cache hit), build and hash the call
key and check aliases, only to reach the same conclusion as on the previous
call. A `CallSite` remembers that conclusion, and `CallSite.match` reuses it
for a call whose every argument is the same object as before (an array where
there was an array) and whose every cached flattening still holds: the same
guards `flatten_arg` checks, so the memo is exactly as strict as the cache
behind it. Alias freedom and the call key depend only on those flattenings and
on the closure's answer, which are revalidated, so they carry over.

A matched call is a `SiteCall`: the site's bookkeeping plus this call's
arrays. The full `Call` (argument trees for error paths, closure roots for a
retrace) is built with `prepare` only if something asks for it.

The site holds its flattenings weakly: they belong to the flattening cache,
which drops them with their argument, so a memo never keeps a model alive.

With the compiled extension, `fast_record` turns a site into the record the
extension's executor runs (``_guard.FastRecord``): the same slots, the
closure's reads, the compiled entry and its donation, or ``None`` where a fast
path cannot be trusted. That is the only way the executor learns how a call
runs; whatever it does not match goes back to the pipeline (the transform's
miss), which decides again.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from jax.core import Tracer

from .. import _compat
from .._accel import _border, _compiled
from .._compat import raw_value_of as _raw_value_of
from .._tree import _closure
from .._tree._closure import closure_snapshot, unchanged_closure_objects
from .._tree._flatten import (
    ARRAY_KEY,
    ArgFlat,
    current_dynamic,
    one_leaf_values,
    still_flattens,
    variables_of,
)
from .._tree._leaves import CONCRETE_ARRAY_TYPES, is_traced
from . import _interrupts
from ._writeback import writable_in

if TYPE_CHECKING:
    from ._call import Call, PreparedCall


class CallSite:
    """What `prepare` concluded for one call, reusable for the same objects.

    Built by `CallSite.from_call` from a prepared `Call`, or not at all when the
    call has anything the memo cannot revalidate by identity: static or graph
    arguments, an argument whose flattening is not cached (a tuple, a plain
    dict, an Equinox module, a module holding tracers), or closure objects the
    closure cache does not answer for.
    """

    __slots__ = (
        "transform",
        "fn_ref",
        "n_args",
        "kw_names",
        "slots",
        "snapshot",
        "lifted_slots",
        "_rebuild",
    )

    transform: str
    fn_ref: weakref.ref[Callable[..., Any]]  # weak: a memo never keeps the function alive
    n_args: int
    kw_names: tuple[str, ...]
    # per argument: a weak reference to its flattening's Guarded (or the flattening); None: an array
    slots: tuple[weakref.ref[Any] | None, ...]
    snapshot: Any  # the cached closure search the lifted objects came from
    lifted_slots: tuple[weakref.ref[Any], ...]
    _rebuild: weakref.WeakMethod[Callable[[tuple[Any, ...], dict[str, Any]], Call]]

    @classmethod
    def from_call(
        cls, call: Call, rebuild: Callable[[tuple[Any, ...], dict[str, Any]], Call]
    ) -> CallSite | None:
        """The memo of ``call``, or ``None`` if it cannot be revalidated by identity.

        ``rebuild(args, kwargs)``, a bound method (held weakly, so the memo
        makes no reference cycle with its owner), prepares a call of the same
        transform in full; it is used when a matched call needs its `Call`.
        """
        if call.graph or call.static_positional or call.static_keywords:
            return None
        slots: list[weakref.ref[Any] | None] = []
        for flat in call.arg_flats:
            if flat.key is ARRAY_KEY:
                slots.append(None)
                continue
            cached = _cached_flat(flat)
            if cached is None:
                return None
            slots.append(_slot(cached))
        # ``sources`` are the argument flattenings with Variables, then the closure
        # objects' ones; a closure object without Variables has no cached flattening.
        n_lifted = len(call.sources) - sum(1 for f in call.arg_flats if f.variables)
        snapshot = closure_snapshot(call.fn)
        lifted = [_cached_flat(f) for f in call.sources[len(call.sources) - n_lifted :]]
        if (
            snapshot is None
            or n_lifted != len(call.lifted_roots)
            or call.closure_aliases  # closure objects that are arguments': prepared each call
            or any(cached is None for cached in lifted)
        ):
            return None
        site = cls()
        site.transform = call.transform
        site.fn_ref = snapshot.ref  # the closure cache's weak reference to the function
        site.n_args = len(call.args)
        site.kw_names = call.kw_names
        site.slots = tuple(slots)
        site.snapshot = snapshot
        site.lifted_slots = tuple(map(_slot, lifted))  # type: ignore[arg-type]
        site._rebuild = weakref.WeakMethod(rebuild)  # type: ignore[arg-type]
        return site

    def alive(self) -> bool:
        """Whether every flattening the memo matches against is still cached."""
        return all(slot is None or slot() is not None for slot in self.slots + self.lifted_slots)

    def same_objects(self, other: CallSite) -> bool:
        """Whether ``other`` was recorded for the same objects (a newer memo replaces it)."""
        return (
            self.kw_names == other.kw_names
            and _same_referents(self.slots, other.slots)
            and _same_referents(self.lifted_slots, other.lifted_slots)
        )

    def match(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> SiteCall | None:
        """This call's `SiteCall` if it passes the same objects, still valid; else ``None``."""
        roots = args
        if kwargs or self.kw_names:
            if len(kwargs) != len(self.kw_names):
                return None
            try:
                roots = (*args, *[kwargs[name] for name in self.kw_names])
            except KeyError:
                return None
        dynamic: list[Any] = []
        sources: list[ArgFlat] = []
        if not match_into(self.slots, roots, dynamic, sources, _match_slow):
            return None
        fn = self.fn_ref()
        if fn is None:
            return None
        lifted = unchanged_closure_objects(fn, self.snapshot)
        if lifted is None:
            return None
        if (lifted or self.lifted_slots) and not match_into(
            self.lifted_slots, lifted, dynamic, sources, _match_slow
        ):
            return None
        return SiteCall(self, args, kwargs, dynamic, sources)


def _same_referents(
    a: tuple[weakref.ref[Any] | None, ...], b: tuple[weakref.ref[Any] | None, ...]
) -> bool:
    """Whether two memos' slots hold the same live objects (``None``: a bare array)."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if x is None or y is None:
            if x is not y:
                return False
        elif x() is None or x() is not y():
            return False
    return True


def _slot(flat: ArgFlat) -> weakref.ref[Any]:
    """A memo slot: a weak reference to the cached flattening's ``Guarded`` (what the
    compiled match reads), or to the flattening itself where it has none."""
    return weakref.ref(flat if flat._fast is None else flat._fast)


def _match_slow(flat: ArgFlat | None, obj: Any) -> list[Any] | None:
    """The arrays ``obj`` contributes to a matched call (``None``: no match).

    ``flat`` is its slot's flattening, or ``None`` for a slot that held a bare
    array. The compiled match calls this only for what it does not decide
    itself: an array of a type not seen yet, or a flattening without a
    compiled guard or with dynamic leaves other than Variable values.
    """
    if flat is None:
        return [obj] if is_traced(obj) else None
    # None: the argument's structure changed
    return current_dynamic(flat) if still_flattens(flat, obj) else None


_PYTHON_NUMBERS = frozenset({bool, int, float, complex})


def match_into(
    slots: tuple[weakref.ref[Any] | None, ...],
    objs: Sequence[Any],
    dynamic: list[Any],
    sources: list[ArgFlat],
    slow: Callable[[ArgFlat | None, Any], list[Any] | None],
) -> bool:
    """Whether every object of ``objs`` still matches its memo slot; if so, their
    arrays are appended to ``dynamic`` and their cached flattenings to ``sources``.

    A slot is ``None`` (a bare array: an array of a known type or a Python
    number) or a weak reference to a cached flattening's ``Guarded`` (or to the
    flattening itself). What the fast case cannot decide goes to ``slow(flat or None, obj)``,
    which returns the arrays or ``None``. The executor of the fast-path record
    matches the same slots in C (tests/test_twins.py checks they decide alike).
    """
    if len(objs) != len(slots):
        return False
    for slot, obj in zip(slots, objs, strict=True):
        if slot is None:
            if type(obj) in CONCRETE_ARRAY_TYPES or type(obj) in _PYTHON_NUMBERS:
                dynamic.append(obj)
                continue
            found = slow(None, obj)
        else:
            held = slot()
            cached = held.flat() if held is not None and type(held) is _GUARDED else held
            if cached is None:
                return False
            ref = cached._ref
            if cached.values_only and ref is not None and ref() is obj:
                # The compiled match's fast case, inline: `still_flattens`, then the values.
                guard = cached._guard
                if guard is None or not guard.holds(cached.variables, obj):
                    return False
                values = list(map(_raw_value_of, cached.variables))
                if not one_leaf_values(values):
                    return False  # a Variable's value changed structure: flattened again
                sources.append(cached)
                dynamic += values
                continue
            found = slow(cached, obj)
            if found is not None:
                sources.append(cached)
        if found is None:
            return False
        dynamic += found
    return True


_GUARDED = _compiled.Guarded


def _cached_flat(flat: ArgFlat) -> ArgFlat | None:
    """The cached flattening ``flat`` comes from (``None`` if it is not cached)."""
    cached = flat.origin or flat
    return cached if cached._ref is not None and cached._guard is not None else None


class SiteCall:
    """A call matched to a `CallSite`: the site's bookkeeping and this call's arrays.

    ``SiteCall(site, args, kwargs, dynamic, sources)``: ``args`` include the
    bound arguments of a `jit_partial`; ``sources`` are the flattenings the
    Variables come from, in order.
    Offers what running and writing back need (``dynamic``, ``sources``,
    ``variables``, ``transform``, ``graph``); `full` prepares the whole
    `Call` once, for a retrace or an error message.
    """

    __slots__ = ("site", "args", "kwargs", "dynamic", "sources", "_full")

    graph = False

    def __init__(
        self,
        site: CallSite,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        dynamic: list[Any],
        sources: list[ArgFlat],
    ):
        self.site = site
        self.args = args
        self.kwargs = kwargs
        self.dynamic = dynamic
        self.sources = sources
        self._full: Call | None = None

    @property
    def transform(self) -> str:
        return self.site.transform

    @property
    def fn(self) -> Callable[..., Any]:
        """The function called (alive: the caller's wrapper holds it)."""
        fn = self.site.fn_ref()
        assert fn is not None, "a matched call outlived its function"
        return fn

    @property
    def variables(self) -> list[Any]:
        """Every input Variable, in the order of the updates (a new list)."""
        return variables_of(self.sources)

    def full(self) -> Call:
        """The `Call` that `prepare` makes for these arguments (built once)."""
        if self._full is None:
            rebuild = self.site._rebuild()
            assert rebuild is not None, "a matched call outlived its transform"
            self._full = rebuild(self.args, self.kwargs)
        return self._full


def fast_record(
    site: CallSite | None,
    call: PreparedCall,
    partial_args: tuple[Any, ...],
    jitted: Callable[..., Any],
    donation: tuple[tuple[int, ...], tuple[int, ...]] | None,
    metadata_updates: bool,
) -> Any:
    """The fast-path record of the calls that match ``site``, or ``None``.

    Emitted after ``call`` ran; ``partial_args`` are the arguments a
    `jit_partial` bound (the executor matches them, then the call's own). The
    extension's executor runs ``jitted`` on a matching call's arrays (or on
    ``(donated, kept)``, positions given by ``donation``) and writes the
    updates back. ``None`` (every call runs
    through the pipeline) where a fast path cannot be trusted:

    - the extension is off, or there is no memo (see `CallSite.from_call`);
    - a flattening has no ``Guarded`` (its guard is not compiled, or its arrays
      are not exactly its Variables' values);
    - a trace of the entry recorded metadata updates (the executor writes
      values only);
    - a tracer is among the arrays, or a Variable may not be written in the
      current trace (the record names that trace; another one is a miss).

    A call's shared donated buffers, a retrace, an unusual signal-hold state:
    those vary per call, so the executor checks them and misses.
    """
    if _compiled.FastRecord is None or site is None or metadata_updates:
        return None
    if any(isinstance(x, Tracer) for x in call.dynamic):
        return None
    trace = _compat.current_trace_ref()
    if trace is None:
        return None
    for slot in site.slots + site.lifted_slots:
        if slot is None:
            continue
        held: Any = slot()
        flat = held.flat() if type(held) is _GUARDED else None
        if flat is None or not writable_in(trace, flat):
            return None
    snapshot = site.snapshot
    return _compiled.FastRecord(
        version=_border.RECORD_VERSION,
        slots=site.slots,
        partial_args=partial_args,
        kw_names=site.kw_names,
        closure_reads=snapshot.reads,
        closure_holders=tuple(holder for _, holder in snapshot.found),
        lifted_slots=site.lifted_slots,
        jitted=jitted,
        donated=None if donation is None else donation[0],
        kept=None if donation is None else donation[1],
        trace=trace,
    )


def configure_fields() -> dict[str, Any]:
    """What the extension reads (`treemode._accel._compiled.configure`'s fields)."""
    kinds, ignore, empty, ignored = _closure.read_check_args()
    return {
        "raw_value": _compat.raw_value_member,
        "metadata": _compat.metadata_member,
        "trace_state": _compat.CURRENT_TRACE,
        "trace_attr": "value",
        "array_types": CONCRETE_ARRAY_TYPES,
        "closure_kinds": kinds,
        "closure_ignore": ignore,
        "closure_empty": empty,
        "closure_ignored": ignored,
        **_interrupts.hold_state(),
        "debug_checks": _compat.DEBUG_CHECKS,
    }


_compiled.configure(**configure_fields())  # once, at import


__all__ = ["CallSite", "SiteCall", "configure_fields", "fast_record"]
