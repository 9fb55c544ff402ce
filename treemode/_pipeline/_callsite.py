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
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from .._accel import _compiled
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

if TYPE_CHECKING:
    from ._call import Call


class CallSite:
    """What `prepare` concluded for one call, reusable for the same objects.

    Built by `CallSite.record` from a prepared `Call`, or not at all when the
    call has anything the memo cannot revalidate by identity: static or graph
    arguments, an argument whose flattening is not cached (a tuple, a plain
    dict, an Equinox module, a module holding tracers), or closure objects the
    closure cache does not answer for.
    """

    __slots__ = (
        "transform",
        "fn",
        "n_args",
        "kw_names",
        "slots",
        "snapshot",
        "lifted_slots",
        "_rebuild",
    )

    transform: str
    fn: Callable[..., Any]
    n_args: int
    kw_names: tuple[str, ...]
    slots: tuple[weakref.ref[ArgFlat] | None, ...]  # per argument: its flattening; None: an array
    snapshot: Any  # the closure cache entry the lifted objects came from
    lifted_slots: tuple[weakref.ref[ArgFlat], ...]
    _rebuild: weakref.WeakMethod[Callable[[tuple[Any, ...], dict[str, Any]], Call]]

    @classmethod
    def record(
        cls, call: Call, rebuild: Callable[[tuple[Any, ...], dict[str, Any]], Call]
    ) -> CallSite | None:
        """The memo of ``call``, or ``None`` if it cannot be revalidated by identity.

        ``rebuild(args, kwargs)``, a bound method (held weakly, so the memo
        makes no reference cycle with its owner), prepares a call of the same
        transform in full; it is used when a matched call needs its `Call`.
        """
        if call.graph or call.static_positional or call.static_keywords:
            return None
        slots: list[weakref.ref[ArgFlat] | None] = []
        for flat in call.arg_flats:
            if flat.key is ARRAY_KEY:
                slots.append(None)
                continue
            entry = _cached_entry(flat)
            if entry is None:
                return None
            slots.append(weakref.ref(entry))
        # ``sources`` are the argument flattenings with Variables, then the closure
        # objects' ones; a closure object without Variables has no cache entry.
        n_lifted = len(call.sources) - sum(1 for f in call.arg_flats if f.variables)
        snapshot = closure_snapshot(call.fn)
        lifted = [_cached_entry(f) for f in call.sources[len(call.sources) - n_lifted :]]
        if (
            snapshot is None
            or n_lifted != len(call.lifted_roots)
            or any(entry is None for entry in lifted)
        ):
            return None
        site = cls()
        site.transform = call.transform
        site.fn = call.fn
        site.n_args = len(call.args)
        site.kw_names = call.kw_names
        site.slots = tuple(slots)
        site.snapshot = snapshot
        site.lifted_slots = tuple(map(weakref.ref, lifted))
        site._rebuild = weakref.WeakMethod(rebuild)  # type: ignore[arg-type]
        return site

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
        if not match_into(self.slots, roots, dynamic, sources, CONCRETE_ARRAY_TYPES, _match_slow):
            return None
        lifted = unchanged_closure_objects(self.fn, self.snapshot)
        if lifted is None:
            return None
        if (lifted or self.lifted_slots) and not match_into(
            self.lifted_slots, lifted, dynamic, sources, CONCRETE_ARRAY_TYPES, _match_slow
        ):
            return None
        return SiteCall(self, args, kwargs, dynamic, sources)


def _match_slow(entry: ArgFlat | None, obj: Any) -> list[Any] | None:
    """The arrays ``obj`` contributes to a matched call (``None``: no match).

    ``entry`` is its slot's flattening, or ``None`` for a slot that held a bare
    array. The compiled match calls this only for what it does not decide
    itself: an array of a type not seen yet, or a flattening without a
    compiled guard or with dynamic leaves other than Variable values.
    """
    if entry is None:
        return [obj] if is_traced(obj) else None
    return current_dynamic(entry) if still_flattens(entry, obj) else None  # None: a layout changed


def _match_into_python(
    slots: tuple[weakref.ref[ArgFlat] | None, ...],
    objs: Sequence[Any],
    dynamic: list[Any],
    sources: list[ArgFlat],
    array_types: set[type],
    slow: Callable[[ArgFlat | None, Any], list[Any] | None],
) -> bool:
    """What ``_guard.match_into`` does, where it is not built."""
    if len(objs) != len(slots):
        return False
    for slot, obj in zip(slots, objs, strict=True):
        if slot is None:
            if type(obj) in array_types:
                dynamic.append(obj)
                continue
            found = slow(None, obj)
        else:
            entry = slot()
            if entry is None:
                return False
            sources.append(entry)
            ref = entry._ref
            if entry.values_only and ref is not None and ref() is obj:
                # The compiled match's fast case, inline: `still_flattens`, then the values.
                guard = entry._guard
                if guard is None or not guard.holds(entry.variables, obj):
                    return False
                values = list(map(_raw_value_of, entry.variables))
                if not one_leaf_values(values):
                    return False  # a Variable's value changed layout: flattened again
                dynamic += values
                continue
            found = slow(entry, obj)
        if found is None:
            return False
        dynamic += found
    return True


match_into = _compiled.match_into or _match_into_python


def _cached_entry(flat: ArgFlat) -> ArgFlat | None:
    """The flattening-cache entry ``flat`` comes from (``None`` if it is not cached)."""
    entry = flat.origin or flat
    return entry if entry._ref is not None and entry._guard is not None else None


class _PythonSiteCallFields:
    """What ``_guard.SiteCallFields`` holds, where it is not built."""

    __slots__ = ("site", "args", "kwargs", "dynamic", "sources", "_full")

    def __init__(
        self,
        site: CallSite,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        dynamic: Sequence[Any],
        sources: list[ArgFlat],
    ):
        self.site = site
        self.args = args
        self.kwargs = kwargs
        self.dynamic = dynamic
        self.sources = sources
        self._full: Call | None = None


if TYPE_CHECKING:
    _SiteCallFields = _PythonSiteCallFields
else:  # the compiled fields, which the compiled call path makes without a Python frame
    _SiteCallFields = _compiled.SiteCallFields or _PythonSiteCallFields


class SiteCall(_SiteCallFields):
    """A call matched to a `CallSite`: the site's bookkeeping and this call's arrays.

    ``SiteCall(site, args, kwargs, dynamic, sources)``: ``args`` include the
    bound arguments of a `jit_partial`; ``dynamic`` is a list, or a tuple
    when the compiled call path made it (the tuple it hands to JAX);
    ``sources`` are the flattenings the Variables come from, in order.
    Offers what running and writing back need (``dynamic``, ``sources``,
    ``variables``, ``transform``, ``graph``); `full` prepares the whole
    `Call` once, for a retrace or an error message.
    """

    __slots__ = ()

    graph = False

    @property
    def transform(self) -> str:
        return self.site.transform

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


def memo_plan(
    site: CallSite, partial_args: tuple[Any, ...], entry: _compiled.EntryPlan
) -> _compiled.MemoPlan | None:
    """The plan that calls matching ``site`` run: by the compiled ``MemoCall``, or by
    its Python twin `run_plan` where the extension is off.

    ``entry`` says how to run a matched call (see `treemode._accel._compiled.EntryPlan`):
    the executable, the per-thread binding its `PureFunction` reads the current
    call from, the compiled entry (called for ``write_back(call, updates)``
    when a call has updates the C write does not make), the trace record
    (its ``metadata_updates``), and ``None`` or, for an entry with donated
    arrays, ``(donated indices, kept indices, check)``: the executable takes
    the two tuples, and ``check(call)`` raises the shared-buffer error when two
    of them are the same device buffer. ``None`` when the site was recorded
    with keyword arguments: those calls take the `CallSite.match` path.
    """
    if site.kw_names:
        return None
    # The snapshot's reads and answer never change once it is made.
    snapshot = site.snapshot
    matching = _compiled.SitePlan(
        site, site.slots, partial_args, snapshot.reads, snapshot.found, site.lifted_slots
    )
    return _compiled.MemoPlan(matching, entry)


MISS: Any = object()  # `run_plan`: the arguments do not match the memo


def run_plan(plan: _compiled.MemoPlan, args: tuple[Any, ...]) -> Any:
    """A call through a memo's plan, in Python: what the compiled ``MemoCall`` runs in C.

    Matches ``args`` (after the plan's bound arguments) and the closure's objects
    against the plan's flattenings, runs the executable with the call bound,
    has a failure explained and writes back. Returns the call's output, or
    `MISS` when something does not match: the caller then prepares the call
    in full, which decides everything again.
    """
    site_plan, entry_plan = plan
    partial = site_plan.partial_args
    roots = partial + args if partial else args
    dynamic: list[Any] = []
    sources: list[ArgFlat] = []
    if not match_into(site_plan.slots, roots, dynamic, sources, CONCRETE_ARRAY_TYPES, _match_slow):
        return MISS
    if not _closure.reads_hold(site_plan.closure_reads):
        return MISS
    found = site_plan.closure_found
    if found or site_plan.lifted_slots:
        lifted = _closure.held_objects(found)
        if lifted is None or not match_into(
            site_plan.lifted_slots, lifted, dynamic, sources, CONCRETE_ARRAY_TYPES, _match_slow
        ):
            return MISS  # an object died, or changed
    call = SiteCall(site_plan.site, roots, {}, dynamic, sources)
    jitted, binding, entry, _, donation = entry_plan
    if donation is None:
        return _execute(jitted, binding, call, dynamic, entry)
    donated, kept, check = donation
    check(call)
    arrays = (tuple(map(dynamic.__getitem__, donated)), tuple(map(dynamic.__getitem__, kept)))
    # Once the executable consumed the donated buffers, the new values are the only
    # whole state until written: a signal's handler waits for the write
    # (treemode._pipeline._interrupts, as the compiled ``MemoCall`` does).
    token = _interrupts.hold(arrays[0])
    try:
        return _execute(jitted, binding, call, arrays, entry)
    finally:
        if token is not None:
            _interrupts.close()
            _interrupts.release(token)


def _execute(jitted: Any, binding: Any, call: SiteCall, arrays: Sequence[Any], entry: Any) -> Any:
    binding.call = call
    try:
        out, updates = jitted(*arrays)
    except BaseException as error:
        binding.call = None
        _compiled.call_path().raise_failure(call, error)
        raise  # raise_failure raises; this line is never reached
    binding.call = None
    if updates is not None:
        entry.write_back(call, updates)
    return out


def call_path_config(
    raise_failure: Callable[[SiteCall, BaseException], Any],
    store_owner: Any,
    store_name: str,
    default_store: Callable[..., Any],
) -> _compiled.CallPath:
    """The `treemode._accel._compiled.CallPath` of the call-site match.

    ``raise_failure(call, error)`` raises the error a failed executable call
    should raise; the C write runs while ``getattr(store_owner, store_name)``
    is ``default_store`` (the write-back hook has not been replaced).
    """
    kinds, ignore, empty, ignored = _closure.read_check_args()
    return _compiled.CallPath(
        CONCRETE_ARRAY_TYPES,
        _match_slow,
        kinds,
        ignore,
        empty,
        ignored,
        SiteCall,
        raise_failure,
        store_owner,
        store_name,
        default_store,
    )


__all__ = ["MISS", "CallSite", "SiteCall", "memo_plan", "run_plan"]
