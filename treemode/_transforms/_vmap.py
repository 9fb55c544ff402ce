"""``treemode.vmap``, and the wrapper shared by the mapping transforms.

`MappedWrapper` is the pipeline of a transform that maps a function over
an axis of its arguments (``vmap``, ``pmap``, ``shard_map``): prepare the call,
resolve the per-argument specification to one entry per traced array, call the
JAX transform with the updates mapped back on each Variable's input
specification, and write the changed Variables back. Subclasses only say how to
resolve and check the specification and which JAX transform to call.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, ParamSpec, Protocol, TypeVar, overload

import jax

from .. import _compat
from .._errors import AxisError, TreemodeError
from .._pipeline import _call, _core, _explain, _interrupts, _pure, _retrace
from .._pipeline._trace_cache import TraceCache, cache_for, call_current_fn
from ._axes import CallAxes, batched_update_error, call_axes, check_axes_spec, check_mapped
from ._metadata import check_metadata, with_axis_metadata
from ._named_errors import TRACER_ERRORS, raise_named
from ._names import named
from ._prefix import decode_flax_prefixes, graph_output_prefix
from ._rng_hints import warn_broadcast_draws
from ._signature import suggests_keywords
from ._wrapped import Wrapped, make_wrapper

P = ParamSpec("P")
R = TypeVar("R")


class MappedEntry:
    """What is built once per call structure.

    ``traced`` is ``pure`` as handed to JAX: named after the user's function, its
    arrays named by their paths in the call that built the entry (``x``,
    ``model.kernel``), so that JAX's messages about the traced function name them
    (in the transform's trace and in treemode's probes, `find_batched_update`).
    """

    __slots__ = ("pure", "axes", "mapped", "checked", "traced")

    def __init__(
        self, pure: _pure.PureFunction, axes: CallAxes, mapped: Any, traced: Callable[..., Any]
    ):
        self.pure = pure
        self.axes = axes
        self.mapped = mapped
        self.checked = False
        self.traced = traced


def _whole(out: Any) -> Any:
    return out


class MappedWrapper(Wrapped[P, R]):
    """Base of the wrappers returned by ``vmap``, ``pmap`` and ``shard_map``."""

    transform = "vmap"
    # The names of the input and output specifications (for error messages).
    spec_names = ("in_axes", "out_axes")
    # Warn once per trace when a broadcast nnx.Rngs is drawn from (see `_rng_hints`).
    warn_broadcast_rngs = False

    def __init__(
        self,
        fn: Callable[P, R],
        *,
        in_axes: Any,
        out_axes: Any,
        graph: bool,
        static_argnums: frozenset[int] = frozenset(),
        donate_argnums: frozenset[int] = frozenset(),
        transform_metadata: Mapping[str, Any] | None = None,
    ):
        self._wrap(fn)
        in_what, out_what = self.spec_names
        # Flax's graph-mode prefixes (nnx.prefix(..., graph=True)) made module-shaped.
        self.in_axes = decode_flax_prefixes(in_axes, transform=self.transform, what=in_what)
        self.out_axes = decode_flax_prefixes(out_axes, transform=self.transform, what=out_what)
        # What JAX matches against the outputs: with graph=True they are `to_tree`'s form.
        self.jax_out_axes = graph_output_prefix(self.out_axes) if graph else self.out_axes
        self.graph = graph
        self.static_argnums = static_argnums
        self.donate_argnums = donate_argnums
        self.metadata = dict(transform_metadata) if transform_metadata else None
        if self.metadata:
            check_metadata(self.metadata, self.transform)
        # Per wrapper; `VmapWrapped` shares it between wrappers of one function.
        self._cache: TraceCache[MappedEntry] = TraceCache()

    # -- hooks for subclasses -----------------------------------------------------

    def resolve(self, call: _call.Call) -> CallAxes:
        """One specification per dynamic array and per Variable."""
        return call_axes(call, self.in_axes)

    def check(self, call: _call.Call, axes: CallAxes) -> None:
        """Shape checks before calling JAX (raise ``AxisError``)."""

    def build(self, pure: _pure.PureFunction, call: _call.Call, axes: CallAxes, names: Any) -> Any:
        """The JAX-transformed pure function; ``names``: the path of each dynamic
        array, for `for_jax`."""
        raise NotImplementedError

    def for_jax(self, fn: Callable[..., Any], call: _call.Call, names: Any) -> Callable[..., Any]:
        """``fn`` (a function of ``call``'s dynamic arrays) named for JAX: after the
        user's function, each array by its path in ``names`` (``None``: JAX's own
        names), as this transform traces it (see `_names.named`)."""
        return named(fn, call.fn, traced_for=self.transform, arg_names=names)

    def first_call_check(self, entry: MappedEntry, call: _call.Call) -> None:
        """Run once per call structure before the first real call."""

    def translate(self, error: Exception, call: _call.Call, entry: MappedEntry) -> None:
        """Raise a treemode error for a JAX error, or return to re-raise it."""

    def abstract_trace(self, entry: MappedEntry, call: _call.Call) -> None:
        """Trace ``entry``'s function over ``call``'s arrays as the transform does,
        abstractly (nothing compiled or run), as a function whose arrays are named
        by their paths; raise what the trace raises."""
        raise NotImplementedError

    def name_tracer_error(self, error: Exception, call: _call.Call, entry: MappedEntry) -> None:
        """For a tracer misuse in the user's function (``error``), raise JAX's error
        from `abstract_trace`, which names the argument (see `_named_errors`); or
        return to re-raise ``error``."""
        raise_named(error, lambda: self.abstract_trace(entry, call))

    # -- the pipeline ---------------------------------------------------------------

    def _entry(self, call: _call.Call) -> MappedEntry:
        return self._cache.get(call.key, lambda: self._build_entry(call))

    def _build_entry(self, call: _call.Call) -> MappedEntry:
        axes = self.resolve(call)
        force: frozenset[int] = frozenset()
        if self.donate_argnums:
            _explain.note_donation()
            force = frozenset(self._donated_variables(call))
        pure = _pure.PureFunction(call, force_updates=force)
        pure.fn = call_current_fn(pure)  # the entry may outlive this wrapper
        if self.graph:  # one out_axes (out_specs) per shared Variable
            pure.output_spec = (self.spec_names[1], self.out_axes, _whole, None, "output")
        if self.metadata:
            pure.fn = with_axis_metadata(
                pure.fn,
                self.in_axes,
                self.out_axes,
                self.metadata,
                transform=self.transform,
                is_leaf=self.metadata_is_leaf,
            )
        # JAX's messages name the arrays by their paths in this call (as an entry of
        # `treemode.jit` does): computed once per call structure.
        names = _retrace.argument_names(call)
        traced = self.for_jax(pure, call, names)
        return MappedEntry(pure, axes, self.build(pure, call, axes, names), traced)

    @staticmethod
    def metadata_is_leaf(x: Any) -> bool:
        from ._axes import is_axis

        return is_axis(x)

    def _donated_variables(self, call: _call.Call) -> list[int]:
        """Indices into ``call.variables`` of the donated positional arguments."""
        ranges = call.root_variable_ranges()
        return [j for k in call.traced_roots(self.donate_argnums) for j in ranges[k]]

    def donated_dynamic(self, call: _call.Call) -> tuple[int, ...]:
        """Indices into ``call.dynamic`` of the donated positional arguments."""
        ranges = call.root_dynamic_ranges()
        return tuple(j for k in call.traced_roots(self.donate_argnums) for j in ranges[k])

    def prepare(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _call.Call:
        return _call.prepare(
            self.transform,
            self.fn,
            args,
            kwargs,
            graph=self.graph,
            static_argnums=self.static_argnums,
        )

    @_compat.api_boundary
    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        call = self.prepare(args, kwargs)
        entry = self._entry(call)
        self.check(call, entry.axes)

        def jax_call() -> tuple[Any, Any]:
            try:
                if not entry.checked:
                    self.first_call_check(entry, call)
                result = entry.mapped(*call.dynamic)
            except ValueError as e:
                if not isinstance(e, TreemodeError):  # treemode's own errors say it all
                    self.translate(e, call, entry)
                raise
            except TRACER_ERRORS as e:
                self.name_tracer_error(e, call, entry)
                raise
            if not entry.checked and self.warn_broadcast_rngs:
                warn_broadcast_draws(call, entry.axes.variables, result[1], self.in_axes)
            entry.checked = True
            return result

        if not self.donate_argnums:
            return _core.run(call, entry.pure, jax_call)
        # pmap donates: once the executable consumed the buffers, a signal's handler
        # waits for the write-back (treemode._pipeline._interrupts, as for treemode.jit).
        donated = [call.dynamic[i] for i in self.donated_dynamic(call)]
        return _interrupts.run_held(donated, lambda: _core.run(call, entry.pure, jax_call))

    def clear_cache(self) -> None:
        self._cache.clear()


# The mesh axis of `per_example_trace` for a transform without an axis name.
_UNNAMED_AXIS = "treemode_mapped_axis"


def per_example_trace(
    entry: MappedEntry, call: _call.Call, traced_for: str, axis_name: Any, axis_size: Any
) -> None:
    """Trace ``entry``'s function for one example (``vmap``) or one device (``pmap``)
    of ``call``'s arrays, abstractly: each mapped axis removed, the axis name bound
    (collectives trace as under the transform), nothing compiled or run.

    The function JAX traces is named after the user's and its arrays by their
    paths (for ``traced_for``), so JAX's errors name them: a ``shard_map`` over an
    abstract mesh of the mapped axis traces it into a jaxpr, as ``jax.pmap`` does
    (``jax.vmap`` traces eagerly, naming nothing). Raises what the trace raises.
    """
    axes = entry.axes.dynamic
    size = check_mapped(call, axes, axis_size=axis_size)
    if size is None:  # nothing mapped, no axis_size: the transform said so itself
        return
    axis = _UNNAMED_AXIS if axis_name is None else axis_name
    mesh = jax.sharding.AbstractMesh((size,), (axis,), axis_types=(jax.sharding.AxisType.Auto,))
    ndims = [len(getattr(x, "shape", ())) for x in call.dynamic]
    where = [None if a is None else a % max(n, 1) for a, n in zip(axes, ndims, strict=True)]
    unmapped = jax.sharding.PartitionSpec()
    specs = tuple(
        unmapped if a is None else jax.sharding.PartitionSpec(*[None] * a, axis) for a in where
    )

    def one(*dynamic: Any) -> Any:
        pairs = zip(dynamic, where, strict=True)
        blocks = [x if a is None else jax.lax.squeeze(x, (a,)) for x, a in pairs]
        return entry.pure(*blocks)

    traced = named(one, call.fn, traced_for=traced_for, arg_names=_retrace.argument_names(call))
    mapped = jax.shard_map(traced, mesh=mesh, in_specs=specs, out_specs=unmapped, check_vma=False)
    jax.eval_shape(mapped, *call.dynamic)


def find_batched_update(
    traced: Callable[..., Any],
    call: _call.Call,
    axes: CallAxes,
    out_axes: Any,
    *,
    axis_name: Any = None,
    axis_size: int | None = None,
    check_first: bool = False,
) -> None:
    """Raise ``AxisError`` if a broadcast Variable gets a per-example value.

    Called when ``jax.vmap`` failed (or, for ``pmap``, once up front): JAX's own
    message does not say which output was batched, so re-trace abstractly with
    the broadcast Variables' updates mapped, then unmapped one at a time.
    Returns quietly if the problem lies elsewhere. With ``check_first``, first
    trace once with the real axes and return if that succeeds. ``traced``: the
    entry's pure function as named for JAX (`MappedEntry.traced`), so that a
    tracer error in the user's function names the argument as the transform would.
    """
    candidates = [i for i, axis in enumerate(axes.variables) if axis is None]
    if not candidates:
        return
    size = check_mapped(call, axes.dynamic, axis_size=axis_size)

    def probe(var_axes: tuple[Any, ...]) -> Any:
        mapped = jax.vmap(
            traced,
            in_axes=axes.dynamic,
            out_axes=(out_axes, var_axes),
            axis_name=axis_name,
            axis_size=size,
        )
        with _retrace.jax_explanations_off():  # treemode's own trace: nothing to explain
            return jax.eval_shape(mapped, *call.dynamic)

    if check_first:
        try:
            probe(axes.variables)
            return
        except ValueError:
            pass
    relaxed = tuple(0 if axis is None else axis for axis in axes.variables)
    try:
        _, updates = probe(relaxed)
    except Exception:
        return
    for i in candidates:
        if updates[i] is None:
            continue
        trial = list(relaxed)
        trial[i] = None
        try:
            probe(tuple(trial))
        except ValueError:
            raise batched_update_error(call, i, axis_name=axis_name) from None


class VmapWrapped(MappedWrapper[P, R]):
    """A function vectorized with `treemode.vmap`."""

    transform = "vmap"
    warn_broadcast_rngs = True

    def __init__(
        self,
        fn: Callable[P, R],
        *,
        in_axes: Any = 0,
        out_axes: Any = 0,
        axis_name: Any = None,
        axis_size: int | None = None,
        spmd_axis_name: Any = None,
        sum_match: bool = False,
        transform_metadata: Mapping[str, Any] | None = None,
        graph: bool = False,
    ):
        super().__init__(
            fn,
            in_axes=in_axes,
            out_axes=out_axes,
            graph=graph,
            transform_metadata=transform_metadata,
        )
        self.axis_name = axis_name
        self.axis_size = axis_size
        self.spmd_axis_name = spmd_axis_name
        self.sum_match = sum_match
        check_axes_spec(self.out_axes, transform=self.transform, what="out_axes")
        # Wrappers of one function with the same options (e.g. `treemode.vmap(f)(x)`
        # written inside a loop) share their entries.
        self._cache = cache_for(
            [fn],
            (
                "vmap",
                self.in_axes,
                self.out_axes,
                axis_name,
                axis_size,
                spmd_axis_name,
                sum_match,
                tuple(sorted(self.metadata.items())) if self.metadata else None,
                graph,
            ),
        )

    def check(self, call: _call.Call, axes: CallAxes) -> None:
        check_mapped(call, axes.dynamic, axis_size=self.axis_size)

    def build(self, pure: _pure.PureFunction, call: _call.Call, axes: CallAxes, names: Any) -> Any:
        return jax.vmap(
            self.for_jax(pure, call, names),
            in_axes=axes.dynamic,
            out_axes=(self.jax_out_axes, axes.variables),
            axis_name=self.axis_name,
            axis_size=self.axis_size,
            spmd_axis_name=self.spmd_axis_name,
            sum_match=self.sum_match,
        )

    def first_call_check(self, entry: MappedEntry, call: _call.Call) -> None:
        # With sum_match, jax.vmap would sum the per-example updates of a broadcast
        # Variable instead of failing: check once, with the outputs mapped, that
        # no broadcast Variable gets a per-example value.
        if self.sum_match:
            find_batched_update(
                entry.traced,
                call,
                entry.axes,
                0,
                axis_name=self.axis_name,
                axis_size=self.axis_size,
                check_first=True,
            )

    def translate(self, error: Exception, call: _call.Call, entry: MappedEntry) -> None:
        translate_axis_error(error, call, entry, self.jax_out_axes, self.axis_name, self.axis_size)

    def abstract_trace(self, entry: MappedEntry, call: _call.Call) -> None:
        per_example_trace(entry, call, self.transform, self.axis_name, self.axis_size)


def translate_axis_error(
    error: Exception,
    call: _call.Call,
    entry: MappedEntry,
    out_axes: Any,
    axis_name: Any,
    axis_size: int | None,
) -> None:
    """Name the Variable or the spec behind a ``jax.vmap``/``jax.pmap`` ``ValueError``."""
    find_batched_update(
        entry.traced, call, entry.axes, out_axes, axis_name=axis_name, axis_size=axis_size
    )
    if "out_axes" in str(error):
        raise AxisError(
            f"treemode.{call.transform}: out_axes does not fit the function's output (it "
            "must be a prefix of the output, with an int or None per mapped part).\n"
            f"JAX says: {error}"
        ) from None


class _Vmapping(Protocol):
    """What ``treemode.vmap(in_axes=...)`` returns, for type checkers: a decorator
    whose `VmapWrapped` keeps the decorated function's signature."""

    def __call__(self, fun: Callable[P, R], /) -> VmapWrapped[P, R]: ...


# The function's parameters and result type are kept for type checkers, as
# `jax.vmap` does: a `VmapWrapped[P, R]` is called like the function.
@overload
def vmap(
    fun: Callable[P, R],
    in_axes: int | None | Sequence[Any] = ...,
    out_axes: Any = ...,
    axis_name: Any = ...,
    axis_size: int | None = ...,
    spmd_axis_name: Any = ...,
    sum_match: bool = ...,
    *,
    transform_metadata: Mapping[str, Any] | None = ...,
    graph: bool = ...,
) -> VmapWrapped[P, R]: ...


@overload
def vmap(
    fun: None = None,
    in_axes: int | None | Sequence[Any] = ...,
    out_axes: Any = ...,
    axis_name: Any = ...,
    axis_size: int | None = ...,
    spmd_axis_name: Any = ...,
    sum_match: bool = ...,
    *,
    transform_metadata: Mapping[str, Any] | None = ...,
    graph: bool = ...,
) -> _Vmapping: ...


@suggests_keywords
def vmap(
    fun: Callable[..., Any] | None = None,
    in_axes: int | None | Sequence[Any] = 0,
    out_axes: Any = 0,
    axis_name: Any = None,
    axis_size: int | None = None,
    spmd_axis_name: Any = None,
    sum_match: bool = False,
    *,
    transform_metadata: Mapping[str, Any] | None = None,
    graph: bool = False,
) -> Any:
    """Vectorize ``f`` with ``jax.vmap``, writing Variable updates back on their axis.

    Every array of the arguments, Variable values included, is mapped over the
    axis its `in_axes` entry gives (`None`: broadcast). A Variable the function
    changes is written back stacked along the axis it came in on, so a mapped
    `BatchStat` keeps one value per example and a stack of layers keeps its structure.

    **Arguments:**

    - `fun`: the function; omit it to use `vmap(...)` as a decorator factory.
    - `in_axes`: an int, `None`, or a tuple with one entry per positional
      argument. An entry is a prefix of its argument and may be module-shaped
      (see `treemode.prefix`), giving each Variable its own axis. Keyword
      arguments are mapped over axis 0, as in `jax.vmap`.
    - `out_axes`: prefix of the output (may be module-shaped).
    - `axis_name`, `axis_size`, `spmd_axis_name`: as in `jax.vmap`.
    - `sum_match`: as in `jax.vmap`: an output with out axis `None` that
      depends on the mapped axis is summed over it instead of failing. It
      applies to the function's outputs only; a broadcast Variable set to a
      per-example value still raises `AxisError`.
    - `transform_metadata`: `{nnx.PARTITION_NAME: name}` to add `name` to the
      `out_sharding` of the Variables stacked by the transform (and to hide the
      mapped axis from the function), see `treemode.transform_metadata`.
    - `graph`: if `True`, arguments may share Modules/Variables.

    **Returns:**

    The vectorized function (usable as a method decorator).

    **Raises:**

    `AxisError` for an invalid or mismatched axis specification, or when a
    broadcast (`in_axes=None`) Variable is set to a per-example value;
    `AliasError` when a Variable is reachable twice.

    ```python
    import jax.numpy as jnp
    import treemode
    from flax import nnx

    @treemode.vmap
    def create(rngs):
        return nnx.Linear(2, 3, rngs=rngs)

    stack = create(treemode.split_rngs(nnx.Rngs(0), splits=4))
    assert stack.kernel.shape == (4, 2, 3)

    @treemode.vmap(in_axes=(0, None))
    def forward(layer, x):
        return layer(x)

    assert forward(stack, jnp.ones((5, 2))).shape == (4, 5, 3)
    ```
    """
    options: dict[str, Any] = dict(
        in_axes=in_axes,
        out_axes=out_axes,
        axis_name=axis_name,
        axis_size=axis_size,
        spmd_axis_name=spmd_axis_name,
        sum_match=sum_match,
        transform_metadata=transform_metadata,
        graph=graph,
    )
    specs = ("in_axes", "out_axes")
    return make_wrapper(VmapWrapped, fun, options, transform="vmap", specs=specs, variables=True)


__all__ = [
    "MappedWrapper",
    "VmapWrapped",
    "find_batched_update",
    "per_example_trace",
    "translate_axis_error",
    "vmap",
]
