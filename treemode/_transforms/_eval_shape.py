"""``treemode.eval_shape``: abstract evaluation that never mutates its inputs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import jax
from flax import nnx

from .. import _compat
from .._pipeline import _call, _core, _pure
from .._tree._leaves import is_variable

# As for `nnx.eval_shape`: the abstract result has the result's type (a Module comes
# back as a Module holding `jax.ShapeDtypeStruct` values).
R = TypeVar("R")


@_compat.api_boundary
def eval_shape(fun: Callable[..., R], *args: Any, graph: bool = False, **kwargs: Any) -> R:
    """Shapes and dtypes of ``fun(*args, **kwargs)`` without running it.

    Arguments may hold `jax.ShapeDtypeStruct` in place of arrays. Variables the
    function would change are left exactly as they are, and no Variable ever ends
    up holding a tracer. Modules created by `fun` come back with
    `jax.ShapeDtypeStruct` values: the usual way to build an abstract model.

    Under a mesh (``jax.set_mesh(mesh)``, or a ``mesh`` in a Variable's
    metadata), as with Flax's ``nnx.eval_shape``, each returned Variable whose
    abstract value has no sharding gets the one its metadata names:
    ``NamedSharding(mesh, P(...))`` from ``sharding_names`` /
    ``nnx.with_partitioning`` (``P()`` without one), logical axis rules
    applied. The abstract model is then a restore target that keeps the
    sharding each Variable is meant to have (e.g. for Orbax:
    ``nnx.state(abstract)`` as the target of a restore, then
    ``nnx.update(abstract, restored)``).

    **Arguments:**

    - `fun`: the function to evaluate.
    - `*args`, `**kwargs`: its arguments (modules, pytrees, arrays).
    - `graph`: if `True`, arguments may share Modules/Variables.

    **Returns:**

    The output of `fun` with every array replaced by a `jax.ShapeDtypeStruct`.

    ```python
    import jax
    import treemode
    from flax import nnx

    abstract = treemode.eval_shape(lambda: nnx.Linear(2, 3, rngs=nnx.Rngs(0)))
    assert isinstance(abstract.kernel.get_raw_value(), jax.ShapeDtypeStruct)
    assert abstract.kernel.shape == (2, 3)
    ```
    """
    call = _call.prepare("eval_shape", fun, args, kwargs, graph=graph, abstract=True)
    pure = _pure.PureFunction(call)
    # The updates' shapes are dropped: nothing is written back.
    out = _core.run(call, pure, lambda: (jax.eval_shape(pure, *call.dynamic)[0], None))
    return _with_metadata_sharding(out)


def _with_metadata_sharding(out: Any) -> Any:
    """Give each abstract value of ``out``'s Variables the sharding its metadata names.

    Only values without a sharding (JAX gives one under a mesh of explicit
    axes), and only where there is a mesh: the Variable's ``mesh`` metadata or
    the current one. The Variables are the ones `eval_shape` made, so they are
    set in place (a Variable returned twice is set once).
    """
    current = jax.sharding.get_abstract_mesh()
    global_mesh = None if current.empty else current
    for var in jax.tree_util.tree_leaves(out, is_leaf=is_variable):
        if not is_variable(var):
            continue
        value = _compat.raw_value_of(var)
        if not isinstance(value, jax.ShapeDtypeStruct) or value.sharding is not None:
            continue
        mesh = _compat.metadata_of(var).get("mesh") or global_mesh
        if mesh is None:
            continue
        spec = nnx.get_partition_spec(var)
        spec = _compat.raw_value_of(spec) if is_variable(spec) else spec
        if not isinstance(spec, jax.sharding.PartitionSpec):
            continue
        sharding = jax.sharding.NamedSharding(mesh, spec)
        _compat.set_raw_value(
            var,
            jax.ShapeDtypeStruct(
                value.shape, value.dtype, sharding=sharding, weak_type=value.weak_type
            ),
        )
    return out
