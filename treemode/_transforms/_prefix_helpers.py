"""Building module-shaped prefixes: ``treemode.prefix`` and ``treemode.sharding_of``.

A module-shaped prefix is the module itself with each Variable replaced by a
value (an axis, a sharding). Transforms accept it wherever JAX accepts a prefix
(``in_axes``, ``out_axes``, ``in_shardings``, ``in_specs``), giving each Variable
its own specification.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
from flax.nnx import filterlib
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .. import _compat
from .._tree._leaves import is_graph_node, is_variable, is_variable_or_graph_node
from .._tree._paths import format_path, nnx_path
from .._tree._recursion import below, recursion_headroom


@_compat.api_boundary  # treemode's frames are left out of tracebacks
def prefix(
    node: Any,
    filter_map: Mapping[Any, Any] | Callable[[tuple[Any, ...], Any], Any],
) -> Any:
    """Replace every Variable of ``node`` by a value chosen with NNX filters.

    **Arguments:**

    - `node`: a module (or any pytree of modules and Variables).
    - `filter_map`: a mapping from NNX filters (`nnx.Param`, `'params'`, `...`,
      a predicate `(path, variable) -> bool`) to values; the first matching
      filter gives a Variable's value. Or a function `(path, variable) -> value`.

    **Returns:**

    A copy of `node` with the chosen value in place of each Variable: a
    module-shaped prefix for `in_axes`, `out_axes`, `in_shardings`, `out_shardings`,
    `in_specs` or `out_specs`. An object reachable twice in `node` (a shared
    submodule or Variable) is one object in the copy, its value chosen at its
    first path, so the prefix fits `graph=True` transforms. Arrays outside
    Variables are left in place (they act as prefix leaves only if the
    transform accepts arrays, so give their container a value instead).

    **Raises:**

    `ValueError` naming the Variable when no filter matches.

    ```python
    import jax.numpy as jnp
    import treemode
    from flax import nnx

    bn = nnx.BatchNorm(3, rngs=nnx.Rngs(0))
    axes = treemode.prefix(bn, {nnx.BatchStat: 0, ...: None})
    assert axes.mean == 0 and axes.scale is None
    ```
    """
    if isinstance(filter_map, Mapping):
        pairs = [(filterlib.to_predicate(f), value) for f, value in filter_map.items()]
        filters = list(filter_map)

        def choose(path: tuple[Any, ...], var: Any, where: str) -> Any:
            for predicate, value in pairs:
                if predicate(path, var):
                    return value
            raise ValueError(
                f"treemode.prefix: no filter matches the {type(var).__name__} at {where} "
                f"(filters: {filters}). Add a catch-all entry, e.g. {{..., ...: None}}."
            )
    else:
        fn = filter_map

        def choose(path: tuple[Any, ...], var: Any, where: str) -> Any:
            return fn(path, var)

    return replace_variables(
        node, lambda path, var: choose(nnx_path(path), var, format_path(path, "node"))
    )


def replace_variables(node: Any, replace: Callable[[tuple[Any, ...], Any], Any]) -> Any:
    """A copy of ``node`` with ``replace(key_path, variable)`` in place of each Variable.

    Walked object by object, so that an NNX object reachable twice (a shared
    submodule, with ``graph=True``) is one object of the copy too, built at
    its first path: `treemode.to_tree` encodes the outputs of a ``graph=True``
    transform the same way, so a module-shaped prefix of them keeps their
    sharing. A Variable reachable twice is replaced at each of its paths, so
    that a transform can report two different values for it.
    """
    done: dict[int, Any] = {}
    active: set[int] = set()
    keep: list[Any] = []  # the objects whose ids are keys of ``done`` stay alive

    def walk(path: tuple[Any, ...], x: Any) -> Any:
        if is_variable(x):
            return replace(path, x)
        if not is_graph_node(x):
            return x
        key = id(x)
        if key in done:
            return done[key]
        if key in active:
            raise ValueError(
                f"treemode: reference cycle at {format_path(path, 'node')}: a "
                f"{type(x).__name__} contains itself."
            )
        active.add(key)
        flat, node_def = jax.tree_util.tree_flatten_with_path(x, is_leaf=below(x))
        children = [
            jax.tree_util.tree_map_with_path(
                lambda p, c, k=k: walk((*path, *k, *p), c),
                child,
                is_leaf=is_variable_or_graph_node,
            )
            for k, child in flat
        ]
        active.discard(key)
        new = node_def.unflatten(children)
        done[key] = new
        keep.append(x)
        return new

    with recursion_headroom():
        return jax.tree_util.tree_map_with_path(walk, node, is_leaf=is_variable_or_graph_node)


def partition_spec_of(var: Any) -> PartitionSpec:
    """The ``PartitionSpec`` recorded in a Variable's ``out_sharding`` (``P()`` if none)."""
    sharding = _compat.metadata_of(var).get("out_sharding")
    if not sharding:
        return PartitionSpec()
    if isinstance(sharding, PartitionSpec):
        return sharding
    if isinstance(sharding, NamedSharding):
        return sharding.spec
    return PartitionSpec(*sharding)


@_compat.api_boundary  # treemode's frames are left out of tracebacks
def sharding_of(node: Any, mesh: Mesh) -> Any:
    """The ``NamedSharding`` of every Variable of ``node``, from its metadata.

    Each Variable's `out_sharding` metadata (e.g. `nnx.Param(..., out_sharding=
    (None, 'model'))`, or a `nnx.with_partitioning` initializer) becomes a
    `NamedSharding(mesh, PartitionSpec(*out_sharding))`; Variables without it are
    replicated.

    **Arguments:**

    - `node`: a module or any pytree of modules and Variables.
    - `mesh`: the device mesh the axis names refer to.

    **Returns:**

    A module-shaped prefix holding a `NamedSharding` per Variable, usable as
    `in_shardings`/`out_shardings` of `treemode.jit` or with `jax.device_put`
    (see `treemode.partition_specs` for `shard_map`).

    ```python
    import jax
    import numpy as np
    import treemode
    from flax import nnx

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("model",))
    with nnx.use_eager_sharding(False):
        layer = nnx.Linear(2, 4, rngs=nnx.Rngs(0),
                           kernel_init=nnx.with_partitioning(
                               nnx.initializers.lecun_normal(), (None, "model")))
    shardings = treemode.sharding_of(layer, mesh)
    assert shardings.kernel.spec == jax.sharding.PartitionSpec(None, "model")
    assert shardings.bias.spec == jax.sharding.PartitionSpec()
    ```
    """
    return replace_variables(node, lambda _, x: NamedSharding(mesh, partition_spec_of(x)))


@_compat.api_boundary  # treemode's frames are left out of tracebacks
def partition_specs(node: Any) -> Any:
    """The ``PartitionSpec`` of every Variable of ``node`` (for ``shard_map`` in_specs).

    Like `sharding_of`, without a mesh.

    ```python
    import jax
    import treemode
    from flax import nnx

    layer = nnx.Linear(2, 4, rngs=nnx.Rngs(0))
    specs = treemode.partition_specs(layer)
    assert specs.kernel == specs.bias == jax.sharding.PartitionSpec()
    ```
    """
    return replace_variables(node, lambda _, x: partition_spec_of(x))


__all__ = ["partition_spec_of", "partition_specs", "prefix", "replace_variables", "sharding_of"]
