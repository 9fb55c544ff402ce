"""``treemode.shard_map``: ``jax.shard_map`` over modules, with Variable write-back.

Each traced array gets the ``PartitionSpec`` its ``in_specs`` prefix gives
(keyword arguments and closure Variables are replicated); each changed Variable
comes back with the spec it came in with. With ``check_vma=True`` a Variable
whose new value varies over a mesh axis its spec does not shard over is
reported by path before JAX's own (anonymous) replication error.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Set
from typing import Any, ParamSpec, TypeVar, overload

import jax
from jax.sharding import Mesh, PartitionSpec

from .._errors import AxisError
from .._pipeline import _call, _pure
from ._axes import CallAxes, call_axes, dynamic_paths
from ._signature import suggests_keywords
from ._vmap import MappedEntry, MappedWrapper
from ._wrapped import make_wrapper

P = ParamSpec("P")
R = TypeVar("R")


def _is_spec(x: Any) -> bool:
    return isinstance(x, PartitionSpec)


def _valid_spec(x: Any) -> bool:
    return isinstance(x, PartitionSpec)


def _names(entry: Any) -> tuple[Any, ...]:
    if entry is None or entry is PartitionSpec.UNCONSTRAINED:
        return ()
    if isinstance(entry, tuple):
        return entry
    return (entry,)


def spec_axes(spec: PartitionSpec) -> set[Any]:
    """The mesh axis names a ``PartitionSpec`` shards over."""
    return {name for entry in spec for name in _names(entry)}


class ShardMapWrapped(MappedWrapper[P, R]):
    """A function wrapped with `treemode.shard_map`."""

    transform = "shard_map"
    spec_names = ("in_specs", "out_specs")

    def __init__(
        self,
        fn: Callable[P, R],
        *,
        mesh: Mesh | Any,
        in_specs: Any,
        out_specs: Any,
        axis_names: Set[Any] = frozenset(),
        check_vma: bool = True,
        graph: bool = False,
    ):
        super().__init__(fn, in_axes=in_specs, out_axes=out_specs, graph=graph)
        self.mesh = mesh
        self.axis_names = frozenset(axis_names)
        self.check_vma = check_vma

    def resolve(self, call: _call.Call) -> CallAxes:
        axes = call_axes(
            call,
            self.in_axes,
            what="in_specs",
            kwargs_axis=PartitionSpec(),
            closure_axis=PartitionSpec(),
            is_leaf=_is_spec,
            valid=lambda x: x is None or _valid_spec(x),
            expected="a jax.sharding.PartitionSpec (or None: replicated)",
        )
        fix = tuple(PartitionSpec() if s is None else s for s in axes.dynamic)
        var = tuple(PartitionSpec() if s is None else s for s in axes.variables)
        return CallAxes(fix, var)

    def check(self, call: _call.Call, axes: CallAxes) -> None:
        shape_of = dict(self.mesh.shape)
        for i, (x, spec) in enumerate(zip(call.dynamic, axes.dynamic, strict=True)):
            shape = tuple(getattr(x, "shape", ()))
            if len(spec) > len(shape):
                raise AxisError(
                    f"treemode.shard_map: in_specs gives {spec} to {dynamic_paths(call)[i]}, "
                    f"which has shape {shape}: a spec may not have more entries than the "
                    "array has dimensions."
                )
            for dim, entry in enumerate(spec):
                names = _names(entry)
                unknown = [n for n in names if n not in shape_of]
                if unknown:
                    raise AxisError(
                        f"treemode.shard_map: in_specs gives {spec} to "
                        f"{dynamic_paths(call)[i]}, but the mesh has no axis "
                        f"{unknown[0]!r} (its axes: {tuple(shape_of)})."
                    )
                parts = math.prod(shape_of[n] for n in names)
                if shape[dim] % parts:
                    raise AxisError(
                        f"treemode.shard_map: in_specs shards dimension {dim} of "
                        f"{dynamic_paths(call)[i]} (shape {shape}) over {names} "
                        f"({parts} devices), but {shape[dim]} is not divisible by {parts}."
                    )

    def build(self, pure: _pure.PureFunction, call: _call.Call, axes: CallAxes, names: Any) -> Any:
        var_specs = axes.variables
        check = self.check_vma

        def body(*dynamic: Any) -> Any:
            out, updates = pure(*dynamic)
            if check:
                _check_replication(pure.call, updates, var_specs)
            return out, updates

        # JAX's messages about the traced arrays (a tracer error, a leaked tracer)
        # name them by their paths (`x`, `model.kernel`), as jax.shard_map names the
        # parameters of the function it maps.
        return jax.shard_map(
            self.for_jax(body, call, names),
            mesh=self.mesh,
            in_specs=axes.dynamic,
            out_specs=(self.jax_out_axes, var_specs),
            axis_names=self.axis_names,
            check_vma=self.check_vma,
        )

    def abstract_trace(self, entry: MappedEntry, call: _call.Call) -> None:
        # The same shard_map, traced into a jaxpr (it runs eagerly outside jit, where
        # its tracers name nothing): its function names the arrays by their paths.
        jax.eval_shape(entry.mapped, *call.dynamic)

    def translate(self, error: Exception, call: _call.Call, entry: MappedEntry) -> None:
        if "does not match the specs of the input" not in str(error):
            return
        for i, (x, spec) in enumerate(zip(call.dynamic, entry.axes.dynamic, strict=True)):
            try:
                have = jax.typeof(x).sharding.spec
            except Exception:  # pragma: no cover - abstract inputs
                continue
            if _normalize(have, x) != _normalize(spec, x):
                raise AxisError(
                    f"treemode.shard_map: in_specs gives {spec} to {dynamic_paths(call)[i]}, "
                    f"but the array is sharded as {have} on a mesh with Explicit axes. "
                    "Put the arguments on the mesh first (jax.device_put / jax.reshard), "
                    "or call shard_map inside treemode.jit(in_shardings=...)."
                ) from None


def _normalize(spec: Any, x: Any) -> tuple[Any, ...]:
    entries = [tuple(_names(e)) or None for e in spec]
    entries += [None] * (len(getattr(x, "shape", ())) - len(entries))
    return tuple(entries)


def _varying_axes(x: Any) -> set[Any]:
    """Mesh axes over which a value inside shard_map varies (check_vma typing)."""
    aval = jax.typeof(x)
    vma = getattr(aval, "vma", None)
    if vma is None:
        vma = getattr(getattr(aval, "manual_axis_type", None), "varying", ())
    return set(vma)


def _check_replication(
    call: _call.Call, updates: tuple[Any, ...], var_specs: tuple[Any, ...]
) -> None:
    """A Variable's new value may only vary over the mesh axes its spec shards over."""
    for i, (update, spec) in enumerate(zip(updates, var_specs, strict=True)):
        if update is None:
            continue
        allowed = spec_axes(spec)
        for leaf in jax.tree_util.tree_leaves(update):
            varying = _varying_axes(leaf) - allowed
            if varying:
                var = call.variables[i]
                axis = sorted(map(str, varying))[0]
                raise AxisError(
                    f"treemode.shard_map: the {type(var).__name__} at "
                    f"{call.variable_paths()[i]} has in_specs {spec}, so it is replicated "
                    f"over mesh axis {axis!r}, but the function set it to a value that "
                    f"varies over {axis!r}; it cannot be written back as one value.\n"
                    f"Fix: reduce it first (jax.lax.pmean(x, {axis!r}) or psum), or give "
                    f"it an in_specs entry that shards it over {axis!r}."
                )


# The function's parameters and result type are kept for type checkers, as for `vmap`.
@overload
def shard_map(
    f: Callable[P, R],
    /,
    *,
    out_specs: Any,
    in_specs: Any,
    mesh: Mesh | Any,
    axis_names: Set[Any] = ...,
    check_vma: bool = ...,
    graph: bool = ...,
) -> ShardMapWrapped[P, R]: ...


@overload
def shard_map(
    f: None = None,
    /,
    *,
    out_specs: Any,
    in_specs: Any,
    mesh: Mesh | Any,
    axis_names: Set[Any] = ...,
    check_vma: bool = ...,
    graph: bool = ...,
) -> Callable[[Callable[P, R]], ShardMapWrapped[P, R]]: ...


@suggests_keywords
def shard_map(
    f: Callable[..., Any] | None = None,
    /,
    *,
    out_specs: Any,
    in_specs: Any,
    mesh: Mesh | Any,
    axis_names: Set[Any] = frozenset(),
    check_vma: bool = True,
    graph: bool = False,
) -> Any:
    """Run ``f`` per device shard with ``jax.shard_map``, writing Variable updates back.

    Inside `f` every array is the local shard given by its `in_specs` entry;
    a Variable the function changes comes back with the sharding it came in
    with, as one global array.

    **Arguments:**

    - `f`: the function; omit it to use `shard_map(...)` as a decorator factory.
    - `mesh`: the device mesh.
    - `in_specs`: a `PartitionSpec`, or a tuple with one prefix per positional
      argument; an entry may be module-shaped (see `treemode.partition_specs`).
      `None` means replicated. Keyword arguments and closure Variables are
      replicated.
    - `out_specs`: prefix of the output, as in `jax.shard_map`.
    - `axis_names`, `check_vma`: as in `jax.shard_map`.
    - `graph`: if `True`, arguments may share Modules/Variables.

    **Returns:**

    The wrapped function.

    **Raises:**

    `AxisError` for a spec that does not fit its array or the mesh, or (with
    `check_vma=True`) when a replicated Variable is set to a per-shard value.

    ```python
    import jax
    import jax.numpy as jnp
    import numpy as np
    import treemode
    from flax import nnx
    from jax.sharding import Mesh, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()), ("data",))
    n = len(jax.devices())

    class Counter(nnx.Module):
        def __init__(self):
            self.seen = nnx.BatchStat(jnp.zeros(()))

    counter = Counter()

    @treemode.shard_map(mesh=mesh, in_specs=(P(), P("data")), out_specs=P("data"))
    def step(counter, x):
        counter.seen[...] += jax.lax.psum(x.shape[0], "data")
        return x * 2

    y = step(counter, jnp.ones((2 * n, 3)))
    assert y.shape == (2 * n, 3) and counter.seen[...] == 2 * n
    ```
    """
    options: dict[str, Any] = dict(
        mesh=mesh,
        in_specs=in_specs,
        out_specs=out_specs,
        axis_names=axis_names,
        check_vma=check_vma,
        graph=graph,
    )
    specs = ("in_specs", "out_specs")
    return make_wrapper(ShardMapWrapped, f, options, transform="shard_map", specs=specs)


__all__ = ["ShardMapWrapped", "shard_map", "spec_axes"]
