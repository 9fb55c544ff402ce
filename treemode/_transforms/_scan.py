"""``treemode.scan``.

The ``treemode.Carry`` marker and what `in_axes`/`out_axes` say about the carry are
`treemode._transforms._scan_axes`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, ParamSpec, TypeVar, overload

import jax
import jax.numpy as jnp

from .. import _compat
from .._errors import AxisError
from .._pipeline import _call, _core, _pure
from .._pipeline._trace_cache import TraceCache, avals, cache_for, call_current_fn
from .._tree._leaves import is_variable
from ._axes import call_axes, check_mapped, is_int_axis
from ._loop import (
    CarryStructure,
    LoopState,
    abstract,
    carry_structure,
    check_carry_out,
    inner_arrays,
    probe_changed,
    rebuild_carry,
    scalars_to_arrays,
)
from ._metadata import _split_metadata, with_axis_metadata
from ._names import Stable
from ._prefix import broadcast_to_leaves, decode_flax_prefixes, graph_output_prefix
from ._scan_axes import (
    Carry,
    OutSpec,
    check_out_axes,
    is_carry,
    is_spec_leaf,
    reject_nested_carry,
    top_carry,
)
from ._signature import UNSPECIFIED, suggests_keywords
from ._wrapped import Wrapped, make_wrapper

P = ParamSpec("P")
R = TypeVar("R")


def _ys(out: tuple[Any, Any]) -> Any:
    return out[1]


_MISSING: Any = UNSPECIFIED


class _ScanEntry:
    """What one call structure needs, built once; holds no arrays (see `_trace_cache`)."""

    __slots__ = ("pure", "loop", "structure", "scanned", "scanned_vars", "length", "step")

    def __init__(
        self,
        pure: _pure.PureFunction,
        loop: LoopState,
        structure: CarryStructure | None,
        scanned: list[tuple[int, int]],
        scanned_vars: list[tuple[int, int]],
        length: int,
        step: Callable[..., Any],
    ):
        self.pure = pure
        self.loop = loop
        self.structure = structure
        self.scanned = scanned  # (index into call.dynamic, axis) of the scanned arrays
        self.scanned_vars = scanned_vars  # (index into call.variables, axis)
        self.length = length
        self.step = step  # handed to jax.lax.scan: the same object on every call


class ScanWrapped(Wrapped[P, R]):
    """A function scanned with `treemode.scan`."""

    transform = "scan"

    def __init__(
        self,
        fn: Callable[P, R],
        *,
        length: int | None,
        reverse: bool,
        unroll: int | bool,
        in_axes: Any,
        out_axes: Any,
        transform_metadata: Mapping[str, Any] | None,
        graph: bool,
    ):
        self._wrap(fn)
        self.length = length
        self.reverse = reverse
        self.unroll = unroll
        # Flax's graph-mode prefixes (nnx.prefix(..., graph=True)) made module-shaped.
        in_axes = decode_flax_prefixes(in_axes, transform="scan", what="in_axes")
        out_axes = decode_flax_prefixes(out_axes, transform="scan", what="out_axes")
        self.in_axes = in_axes
        self.out_axes = out_axes
        self.graph = graph
        self.metadata = dict(transform_metadata) if transform_metadata else None
        if self.metadata is not None:
            _split_metadata(self.metadata, "scan")
        # in_axes
        if isinstance(in_axes, list) or isinstance(out_axes, list):
            raise AxisError(
                "treemode.scan: in_axes/out_axes is a list; use a tuple with one entry per "
                "argument (or returned value), e.g. in_axes=(Carry, 0)."
            )
        if is_carry(in_axes):
            self.in_carry: int | None = 0
        elif isinstance(in_axes, tuple):
            self.in_carry = top_carry(in_axes, "in_axes")
        else:
            reject_nested_carry(in_axes, "in_axes")
            self.in_carry = None
        # out_axes: "carry" (f returns the carry), "tuple" (one entry per output,
        # Carry among them) or "ys" (no carry: a prefix of the outputs).
        check_out_axes(out_axes)
        if is_carry(out_axes):
            self.out_kind, self.out_carry = "carry", 0
        elif isinstance(out_axes, tuple):
            self.out_carry = top_carry(out_axes, "out_axes")
            self.out_kind = "ys" if self.out_carry is None else "tuple"
        else:
            reject_nested_carry(out_axes, "out_axes")
            self.out_kind, self.out_carry = "ys", None
        self.out = OutSpec(self.out_kind, self.out_carry, out_axes)
        # The prefix of the stacked outputs; with graph=True they are `to_tree`'s form.
        ys_axes = self.out.ys_axes()
        self._ys_axes = graph_output_prefix(ys_axes) if graph else ys_axes
        if (self.in_carry is None) != (self.out_carry is None):
            where, other = (
                ("in_axes", "out_axes") if self.in_carry is not None else ("out_axes", "in_axes")
            )
            raise AxisError(
                f"treemode.scan: {where} has a treemode.Carry but {other} does not "
                f"(in_axes={in_axes!r}, out_axes={out_axes!r}). If one of in_axes or "
                "out_axes has Carry, the other must also have Carry: the function receives "
                "the carry and returns its new value. Mark it in both, e.g. "
                "in_axes=(Carry, 0), out_axes=(Carry, 0)."
            )
        # Entries by (structure, input types); `Stable` step functions by structure.
        self._cache: TraceCache[Any] = cache_for(
            [fn],
            (
                "scan",
                length,
                reverse,
                unroll,
                in_axes,
                out_axes,
                tuple(sorted(self.metadata.items())) if self.metadata else None,
                graph,
            ),
        )

    def clear_cache(self) -> None:
        """Drop the traced steps of this function (shared by its scan wrappers with
        the same options); the next call traces again."""
        self._cache.clear()

    # -- the pieces of one call ---------------------------------------------------

    def _entries(self, num_args: int) -> Any:
        if is_carry(self.in_axes):
            if num_args != 1:
                raise AxisError(
                    f"treemode.scan: When in_axes=Carry, the function must take exactly one "
                    f"argument (the carry), but it was called with {num_args}. Use a tuple, "
                    "e.g. in_axes=(Carry, 0), to scan over further arguments."
                )
            return (Carry,)
        return self.in_axes

    def _move_out_axes(self, ys: Any) -> Any:
        if ys is None:
            return None
        try:
            axes = broadcast_to_leaves(
                self._ys_axes,
                ys,
                is_prefix_leaf=is_int_axis,
                where="the outputs",
                what="treemode.scan: out_axes",
            )
        except ValueError as e:
            raise AxisError(str(e)) from None
        leaves, treedef = jax.tree_util.tree_flatten(ys, is_leaf=is_variable)
        moved = [
            leaf
            if axis == 0
            else jax.tree_util.tree_map(lambda a, axis=axis: jnp.moveaxis(a, 0, axis), leaf)
            for leaf, axis in zip(leaves, axes, strict=True)
        ]
        return treedef.unflatten(moved)

    # -- calling ---------------------------------------------------------------------

    @_compat.api_boundary
    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        entries = self._entries(len(args))
        carry_pos = self.in_carry
        if isinstance(entries, tuple) and len(entries) != len(args):
            carry_pos = None  # call_axes reports the length mismatch
        if carry_pos is not None:
            # The carry's Python numbers as arrays (a plain tuple now, not P.args).
            args = (  # pyright: ignore[reportAssignmentType]
                *args[:carry_pos],
                scalars_to_arrays(args[carry_pos]),
                *args[carry_pos + 1 :],
            )
        call = _call.prepare("scan", self.fn, args, kwargs, graph=self.graph)
        entry = self._cache.get(
            (call.key, avals(call.dynamic)), lambda: self._build(call, entries, carry_pos)
        )
        xs = [
            call.dynamic[j] if ax == 0 else jnp.moveaxis(call.dynamic[j], ax, 0)
            for j, ax in entry.scanned
        ]

        # The function JAX traces: named like the user's and the same object for
        # every input type of this structure (`treemode._transforms._names.Stable`).
        stable: Stable = self._cache.get(("step", call.key), lambda: Stable(self.fn))

        def jax_call() -> tuple[Any, Any]:
            init = entry.loop.init(call.dynamic)
            # JAX keeps one trace of the step per input types, whatever the length:
            # entries of this structure that differ in length only share it, and
            # share what it records (`_core.run` writes its metadata updates back).
            entry.pure.findings = stable.share(_step_types(init, xs), entry.pure.findings)
            with stable.bound(entry.step) as step:
                (_, free, values), (ys, stacked) = jax.lax.scan(
                    step,
                    init,
                    xs,
                    length=entry.length,
                    reverse=self.reverse,
                    unroll=self.unroll,
                )
            updates = entry.loop.final_updates(values)
            for (i, ax), u in zip(entry.scanned_vars, stacked, strict=True):
                if u is not None:
                    updates[i] = (
                        u
                        if ax == 0
                        else jax.tree_util.tree_map(lambda a, ax=ax: jnp.moveaxis(a, 0, ax), u)
                    )
            return (free, ys), updates

        free, ys = _core.run(call, entry.pure, jax_call, finish=False)
        ys = _core.finish(call, self._move_out_axes(ys))
        carry = None
        if carry_pos is not None and entry.structure is not None:
            carry = rebuild_carry(args[carry_pos], entry.structure, free)
        return self.out.join(carry, ys)

    def _build(self, call: _call.Call, entries: Any, carry_pos: int | None) -> _ScanEntry:
        """What a call structure needs, built once (see `treemode._pipeline._trace_cache`)."""
        axes = call_axes(
            call,
            entries,
            kwargs_axis=None,
            closure_axis=None,
            is_leaf=is_spec_leaf,
            valid=is_spec_leaf,
            expected="an int, None or treemode.Carry",
        )
        length = self._length(call, axes.dynamic)
        structure = None
        if carry_pos is not None:
            structure = carry_structure(call, carry_pos, f"args[{carry_pos}]")
        scanned = [(j, ax) for j, ax in enumerate(axes.dynamic) if is_int_axis(ax)]
        scanned_vars = [(i, ax) for i, ax in enumerate(axes.variables) if is_int_axis(ax)]
        candidates = {i for i, ax in enumerate(axes.variables) if not is_int_axis(ax)}
        state_vars: frozenset[int] = frozenset()
        if candidates:
            probe = _pure.PureFunction(call)
            probe.fn = self._body(probe, entries, structure, carry_pos)
            probe_avals = [
                abstract(x, ax if is_int_axis(ax) else None)
                for x, ax in zip(call.dynamic, axes.dynamic, strict=True)
            ]
            state_vars = probe_changed(probe, call, probe_avals) & candidates
        pure = _pure.PureFunction(call, force_updates=state_vars)
        pure.fn = self._body(pure, entries, structure, carry_pos)
        if self.graph:  # one out_axes per shared Variable of the stacked outputs
            pure.output_spec = ("out_axes", self.out.ys_axes(), _ys, is_spec_leaf, "ys")
        loop = LoopState(
            "scan", call, structure.free if structure else [], state_vars, (j for j, _ in scanned)
        )
        allowed = frozenset(i for i, _ in scanned_vars)
        scanned_positions = [j for j, _ in scanned]
        scanned_indices = [i for i, _ in scanned_vars]

        # Handed to jax.lax.scan: a function of its inputs only (see _trace_cache).
        def step(state: Any, x: list[Any]) -> Any:
            dynamic = loop.assemble(state, dict(zip(scanned_positions, x, strict=True)))
            (free_out, ys), updates = pure(*dynamic)
            new_state = loop.next_state(pure.call, state, free_out, updates, allowed)
            return new_state, (ys, [updates[i] for i in scanned_indices])

        return _ScanEntry(pure, loop, structure, scanned, scanned_vars, length, step)

    def _body(
        self,
        pure: _pure.PureFunction,
        entries: Any,
        structure: CarryStructure | None,
        carry_pos: int | None,
    ) -> Callable[..., Any]:
        """``pure``'s function: the user function, its outputs split into carry and ys.

        Refers to the user function through the bound call and to nothing of
        ``self`` but the output specification.
        """
        fn = call_current_fn(pure)
        if self.metadata is not None:
            fn = with_axis_metadata(
                fn,
                entries,
                self.out_axes,
                self.metadata,
                transform="scan",
                kwargs_axis=None,
                is_leaf=is_spec_leaf,
            )
        out = self.out

        def body(*args: Any, **kwargs: Any) -> tuple[list[Any], Any]:
            inner = (
                inner_arrays(structure, args[carry_pos])
                if structure and carry_pos is not None
                else []
            )
            carry_out, ys = out.split(fn(*args, **kwargs))
            if structure is None or carry_pos is None:
                return [], ys
            return check_carry_out("scan", structure, args[carry_pos], carry_out, inner), ys

        return body

    def _length(self, call: _call.Call, axes: tuple[Any, ...]) -> int:
        size = check_mapped(call, axes, what="in_axes", require_size=False)
        if size is None:
            if self.length is None:
                raise AxisError(
                    "treemode.scan: no argument is scanned (no int in in_axes reaches an "
                    "array), so the number of steps is unknown. Pass length=n."
                )
            return self.length
        if self.length is not None and self.length != size:
            raise AxisError(
                f"treemode.scan: length={self.length} but the scanned arguments have "
                f"{size} entries along their scanned axes. Drop length= or make them agree."
            )
        return size


def _step_types(init: Any, xs: Sequence[Any]) -> tuple[Any, ...]:
    """The types of the step's inputs: the carried state's, and one slice of each ``xs``."""
    state = tuple(map(jax.typeof, jax.tree_util.tree_leaves(init)))
    slices = tuple((tuple(x.shape[1:]), x.dtype, jax.typeof(x).weak_type) for x in xs)
    return state, slices


# The function's parameters and result type are kept for type checkers, as for
# `vmap` (the scanned arguments and the stacked outputs have their step's types).
@overload
def scan(
    f: Callable[P, R],
    *,
    length: int | None = ...,
    reverse: bool = ...,
    unroll: int | bool = ...,
    in_axes: Any = ...,
    out_axes: Any = ...,
    transform_metadata: Mapping[str, Any] | None = ...,
    graph: bool = ...,
) -> ScanWrapped[P, R]: ...


@overload
def scan(
    f: Callable[..., R],
    init: Any,
    xs: Any = ...,
    length: int | None = ...,
    reverse: bool = ...,
    unroll: int | bool = ...,
    *,
    in_axes: Any = ...,
    out_axes: Any = ...,
    transform_metadata: Mapping[str, Any] | None = ...,
    graph: bool = ...,
) -> R: ...


@overload
def scan(
    f: None = None,
    *,
    length: int | None = ...,
    reverse: bool = ...,
    unroll: int | bool = ...,
    in_axes: Any = ...,
    out_axes: Any = ...,
    transform_metadata: Mapping[str, Any] | None = ...,
    graph: bool = ...,
) -> Callable[[Callable[P, R]], ScanWrapped[P, R]]: ...


@suggests_keywords
def scan(
    f: Callable[..., Any] | None = None,
    init: Any = UNSPECIFIED,
    xs: Any = None,
    length: int | None = None,
    reverse: bool = False,
    unroll: int | bool = 1,
    *,
    in_axes: Any = (Carry, 0),
    out_axes: Any = (Carry, 0),
    transform_metadata: Mapping[str, Any] | None = None,
    graph: bool = False,
) -> Any:
    """Scan a function over the leading (or given) axis of some of its arguments.

    `in_axes` says what each positional argument is: `Carry` (threaded from
    step to step; the function returns its new value), `None` (broadcast: the
    same in every step) or an int (scanned: step `i` sees slice `i` of that
    axis). An entry may be a module-shaped prefix mixing `None` and ints per
    Variable; keyword arguments are broadcast. `out_axes` says what the function
    returns: `Carry` marks the new carry, ints stack the other outputs along
    that axis.

    Variables are handled by what the function does with them, not by copying
    whole modules around:

    - a carried Variable must stay the same object (change it in place, return
      the same module); its final value is written back;
    - a broadcast Variable that the function changes is threaded through the
      loop and its final value written back; read-only ones are loop constants;
    - a scanned Variable that the function changes comes back stacked on its
      input axis; read-only scanned parameters are never copied or returned.

    With the defaults `in_axes=(Carry, 0)`, `out_axes=(Carry, 0)` this is
    `jax.lax.scan`: `f(carry, x) -> (carry, y)`, and the short form
    `treemode.scan(f, init, xs)` calls it right away, like `jax.lax.scan(f,
    init, xs)`.

    **Arguments:**

    - `f`: the function to scan. Omit it to use `scan(...)` as a decorator.
    - `init`, `xs`: if `init` is given, call the scanned function on `(init,
      xs)` at once (`xs=None`: nothing scanned, `length` steps).
    - `length`, `reverse`, `unroll`: as in `jax.lax.scan` (positional or
      keyword, in JAX's order).
    - `in_axes`: `Carry`, an int or `None` for all arguments, or a tuple with one
      entry per positional argument.
    - `out_axes`: `Carry`, an int (or prefix) for all outputs, or a tuple with
      one entry per returned value (`None` is not allowed: outputs are stacked).
    - `transform_metadata`: `{nnx.PARTITION_NAME: name}`: inside the scan, the
      scanned Variables' `out_sharding` loses the scanned axis; Variables created
      and stacked by the scan gain it.
    - `graph`: if `True`, arguments may share Modules/Variables.

    **Returns:**

    The scanned function, or its result if `init` was given: the outputs in the
    shape of `out_axes`, with the new carry at the `Carry` position.

    **Raises:**

    `AxisError` for a wrong `in_axes`/`out_axes` (Carry twice or nested, wrong
    number of entries, mismatched lengths), `StructureError` when the function
    replaces a carried object or changes the carry's structure or types,
    `AliasError` when a Variable is reachable twice. Inputs are left unchanged
    when an error is raised.

    ```python
    import jax
    import jax.numpy as jnp
    import treemode
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(4, 4, rngs=rngs)

        def __call__(self, x):
            return jax.nn.relu(self.linear(x))

    @treemode.vmap(in_axes=0, out_axes=0)
    def create(key):
        return Block(nnx.Rngs(key))

    blocks = create(jax.random.split(jax.random.key(0), 3))
    assert blocks.linear.kernel.shape == (3, 4, 4)

    @treemode.scan(in_axes=(treemode.Carry, 0), out_axes=treemode.Carry)
    def forward(x, block):
        return block(x)

    y = forward(jnp.ones((2, 4)), blocks)
    assert y.shape == (2, 4)

    # jax.lax.scan's form
    total, cumsum = treemode.scan(lambda c, x: (c + x, c + x), 0.0, jnp.arange(4.0))
    assert total == 6.0 and cumsum.tolist() == [0.0, 1.0, 3.0, 6.0]
    ```
    """
    options: dict[str, Any] = dict(
        length=length,
        reverse=reverse,
        unroll=unroll,
        in_axes=in_axes,
        out_axes=out_axes,
        transform_metadata=transform_metadata,
        graph=graph,
    )
    specs = ("in_axes", "out_axes")
    wrapped = make_wrapper(ScanWrapped, f, options, transform="scan", specs=specs, variables=True)
    if f is None or init is _MISSING:
        return wrapped
    return wrapped(init, xs)


__all__ = ["ScanWrapped", "scan"]
