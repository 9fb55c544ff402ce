"""``treemode.pmap``: ``jax.pmap`` with per-Variable axes and write-back."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, ParamSpec, TypeVar, overload

import jax

from .._pipeline import _call, _pure
from ._axes import CallAxes, call_axes, check_axes_spec, check_mapped
from ._signature import suggests_keywords
from ._vmap import (
    MappedEntry,
    MappedWrapper,
    find_batched_update,
    per_example_trace,
    translate_axis_error,
)
from ._wrapped import make_wrapper

P = ParamSpec("P")
R = TypeVar("R")


def _as_set(x: int | Iterable[int] | None) -> frozenset[int]:
    if x is None:
        return frozenset()
    if isinstance(x, int):
        return frozenset({x})
    return frozenset(x)


class PmapWrapped(MappedWrapper[P, R]):
    """A function parallelized with `treemode.pmap`."""

    transform = "pmap"
    warn_broadcast_rngs = True

    def __init__(
        self,
        fn: Callable[P, R],
        *,
        axis_name: Any = None,
        in_axes: Any = 0,
        out_axes: Any = 0,
        static_broadcasted_argnums: int | Iterable[int] = (),
        devices: Sequence[Any] | None = None,
        backend: str | None = None,
        axis_size: int | None = None,
        donate_argnums: int | Iterable[int] = (),
        transform_metadata: Mapping[str, Any] | None = None,
        graph: bool = False,
    ):
        super().__init__(
            fn,
            in_axes=in_axes,
            out_axes=out_axes,
            graph=graph,
            static_argnums=_as_set(static_broadcasted_argnums),
            donate_argnums=_as_set(donate_argnums),
            transform_metadata=transform_metadata,
        )
        check_axes_spec(self.out_axes, transform=self.transform, what="out_axes")
        self.axis_name = axis_name
        self.devices = devices
        self.backend = backend
        self.axis_size = axis_size

    def resolve(self, call: _call.Call) -> CallAxes:
        return call_axes(call, self.in_axes)

    def check(self, call: _call.Call, axes: CallAxes) -> None:
        check_mapped(call, axes.dynamic, axis_size=self.axis_size)

    def build(self, pure: _pure.PureFunction, call: _call.Call, axes: CallAxes, names: Any) -> Any:
        return jax.pmap(
            self.for_jax(pure, call, names),
            axis_name=self.axis_name,
            in_axes=axes.dynamic,
            out_axes=(self.jax_out_axes, axes.variables),
            devices=self.devices,
            backend=self.backend,
            axis_size=self.axis_size,
            donate_argnums=self.donated_dynamic(call),
        )

    def first_call_check(self, entry: MappedEntry, call: _call.Call) -> None:
        # jax.pmap silently keeps one device's value of an unmapped output; check
        # under vmap once that no broadcast Variable gets a per-device value.
        find_batched_update(
            entry.traced,
            call,
            entry.axes,
            self.jax_out_axes,
            axis_name=self.axis_name,
            axis_size=self.axis_size,
            check_first=True,
        )

    def translate(self, error: Exception, call: _call.Call, entry: MappedEntry) -> None:
        translate_axis_error(error, call, entry, self.jax_out_axes, self.axis_name, self.axis_size)

    def abstract_trace(self, entry: MappedEntry, call: _call.Call) -> None:
        # jax.pmap traces the function inside a function of its own, `_fun(*flat_args)`,
        # whose names its messages give (`the argument flat_args[2]`): the same trace,
        # of a function named by the user's paths, names the user's argument.
        per_example_trace(entry, call, self.transform, self.axis_name, self.axis_size)


# The function's parameters and result type are kept for type checkers, as for `vmap`.
@overload
def pmap(
    fun: Callable[P, R],
    axis_name: Any = ...,
    *,
    in_axes: Any = ...,
    out_axes: Any = ...,
    static_broadcasted_argnums: int | Iterable[int] = ...,
    devices: Sequence[Any] | None = ...,
    backend: str | None = ...,
    axis_size: int | None = ...,
    donate_argnums: int | Iterable[int] = ...,
    transform_metadata: Mapping[str, Any] | None = ...,
    graph: bool = ...,
) -> PmapWrapped[P, R]: ...


@overload
def pmap(
    fun: None = None,
    axis_name: Any = ...,
    *,
    in_axes: Any = ...,
    out_axes: Any = ...,
    static_broadcasted_argnums: int | Iterable[int] = ...,
    devices: Sequence[Any] | None = ...,
    backend: str | None = ...,
    axis_size: int | None = ...,
    donate_argnums: int | Iterable[int] = ...,
    transform_metadata: Mapping[str, Any] | None = ...,
    graph: bool = ...,
) -> Callable[[Callable[P, R]], PmapWrapped[P, R]]: ...


@suggests_keywords
def pmap(
    fun: Callable[..., Any] | None = None,
    axis_name: Any = None,
    *,
    in_axes: Any = 0,
    out_axes: Any = 0,
    static_broadcasted_argnums: int | Iterable[int] = (),
    devices: Sequence[Any] | None = None,
    backend: str | None = None,
    axis_size: int | None = None,
    donate_argnums: int | Iterable[int] = (),
    transform_metadata: Mapping[str, Any] | None = None,
    graph: bool = False,
) -> Any:
    """Parallelize ``f`` over devices with ``jax.pmap``, writing Variable updates back.

    The arguments are split along their `in_axes` over devices, exactly as in
    `jax.pmap`; Variables may be given per-Variable axes with a module-shaped
    prefix. A Variable the function changes comes back on its input axis (a
    replicated Variable, `in_axes=None`, must be changed identically on every
    device, e.g. through `jax.lax.pmean`; otherwise `AxisError` names it).

    **Arguments:**

    - `fun`: the function; omit it to use `pmap(...)` as a decorator factory.
    - `axis_name`, `in_axes`, `out_axes`, `static_broadcasted_argnums`,
      `devices`, `backend`, `axis_size`, `donate_argnums`: as in `jax.pmap`
      (`in_axes` entries may be module-shaped; keyword arguments use axis 0).
    - `transform_metadata`: as in `treemode.vmap`.
    - `graph`: if `True`, arguments may share Modules/Variables.

    **Returns:**

    The parallelized function.

    ```python
    import jax
    import jax.numpy as jnp
    import treemode
    from flax import nnx

    n = jax.local_device_count()

    class Stats(nnx.Module):
        def __init__(self):
            self.total = nnx.BatchStat(jnp.zeros(()))

    stats = Stats()

    @treemode.pmap(axis_name="d", in_axes=(None, 0))
    def accumulate(stats, x):
        stats.total[...] += jax.lax.psum(x.sum(), "d")
        return x * 2

    accumulate(stats, jnp.ones((n, 3)))
    assert stats.total[...] == 3 * n
    ```
    """
    options: dict[str, Any] = dict(
        axis_name=axis_name,
        in_axes=in_axes,
        out_axes=out_axes,
        static_broadcasted_argnums=static_broadcasted_argnums,
        devices=devices,
        backend=backend,
        axis_size=axis_size,
        donate_argnums=donate_argnums,
        transform_metadata=transform_metadata,
        graph=graph,
    )
    specs = ("in_axes", "out_axes")
    return make_wrapper(PmapWrapped, fun, options, transform="pmap", specs=specs, variables=True)


__all__ = ["PmapWrapped", "pmap"]
