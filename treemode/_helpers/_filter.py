"""``treemode.filter``: a boolean mask that selects Variables by NNX filter.

Equinox selects leaves by dtype (``eqx.is_inexact_array``), which cannot tell a
``nnx.Param`` from a ``nnx.BatchStat``: both are float arrays. The mask built
here has the same structure as the tree, so it can be passed to
``eqx.partition``, ``eqx.filter_grad(..., arg=mask)``-style APIs or
``optax.masked``, and it decides each Variable's leaves by the Variable's type,
tag or path, like any NNX filter.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx import filterlib

from .. import _compat
from .._tree._leaves import ARRAY_TYPES, is_variable
from .._tree._paths import nnx_path
from .._tree._pytree import Pytree, from_parts


def is_inexact_array(x: Any) -> bool:
    """Whether ``x`` is a floating-point or complex array (Equinox's parameter rule)."""
    return isinstance(x, ARRAY_TYPES) and jnp.issubdtype(x.dtype, jnp.inexact)


# NNX filters whose answer depends only on a Variable's type, metadata and path;
# their mask is computed once per proxy structure and cached.
_STRUCTURAL = (
    filterlib.OfType,
    filterlib.WithTag,
    filterlib.PathContains,
    filterlib.PathIn,
    filterlib.Everything,
    filterlib.Nothing,
)


def _is_structural(predicate: Any) -> bool:
    if isinstance(predicate, _STRUCTURAL):
        return True
    if isinstance(predicate, (filterlib.Any, filterlib.All)):
        return all(_is_structural(p) for p in predicate.predicates)
    if isinstance(predicate, filterlib.Not):
        return _is_structural(predicate.predicate)
    return False


@_compat.api_boundary  # treemode's frames are left out of tracebacks
def filter(  # noqa: A001 - the public name mirrors nnx filters
    tree: Any,
    variables: nnx.filterlib.Filter,
    /,
    *,
    others: bool | Callable[[Any], bool] = is_inexact_array,
) -> Any:
    """A boolean mask of ``tree`` that selects Variables by an NNX filter.

    Every leaf of ``tree`` is replaced by ``True`` or ``False``: leaves that hold
    the value of an NNX Variable (inside a `treemode.Pytree` proxy or a plain NNX
    module) by the answer of the NNX filter ``variables`` for that Variable;
    every other leaf (Equinox arrays, plain arrays, activation functions) by
    ``others``. The mask has the structure of ``tree``, so
    `eqx.partition(tree, mask)` splits it, and optimizers and gradients built on
    the selected half skip BatchNorm statistics, RNG keys and counters.

    **Arguments:**

    - `tree`: any pytree: Equinox modules, `treemode.Pytree` proxies, NNX
      modules, dicts of arrays.
    - `variables`: an NNX filter (`nnx.Param`, `(nnx.Param, nnx.BatchStat)`,
      `'tag'`, `nnx.PathContains('bn')`, `nnx.Not(...)`, a `(path, variable) ->
      bool` callable, `...`, `None`).
    - `others`: for leaves that are not inside an NNX Variable: a bool, or a
      predicate on the leaf. The default selects floating-point arrays, the
      Equinox convention for parameters, so Equinox layers next to NNX modules
      are trained too. Pass `False` to select NNX Variables only.

    **Returns:**

    A pytree of the same structure as `tree` with a `bool` at every leaf.

    ```python
    import equinox as eqx
    import jax
    import treemode
    from flax import nnx

    model = treemode.Pytree(nnx.BatchNorm(3, rngs=nnx.Rngs(0)))
    mask = treemode.filter(model, nnx.Param)
    params, rest = eqx.partition(model, mask)
    assert len(jax.tree.leaves(params)) == 2      # scale and bias
    assert len(jax.tree.leaves(rest)) == 2        # running mean and var
    ```
    """
    predicate = filterlib.to_predicate(variables)
    other = (lambda _: others) if isinstance(others, bool) else others
    structural = _is_structural(predicate)
    cache_key = variables if structural else None
    if cache_key is not None:
        try:
            hash(cache_key)
        except TypeError:
            cache_key = None

    def mask_leaf(path: tuple[Any, ...], x: Any) -> Any:
        if isinstance(x, Pytree):
            return _mask_proxy(x, path, predicate, other, cache_key)
        if is_variable(x):
            flag = bool(predicate(nnx_path(path), x))
            return jax.tree_util.tree_map(lambda _: flag, x)
        return bool(other(x))

    return jax.tree_util.tree_map_with_path(
        mask_leaf, tree, is_leaf=lambda x: isinstance(x, Pytree) or is_variable(x)
    )


def _mask_proxy(
    proxy: Pytree[Any],
    prefix: tuple[Any, ...],
    predicate: Callable[[Any, Any], bool],
    other: Callable[[Any], bool],
    cache_key: Any,
) -> Pytree[Any]:
    pdef, leaves = proxy._pt_flatten()
    infos = pdef.leaf_infos()
    flags: tuple[bool | None, ...] | None = None
    if cache_key is not None:
        flags = pdef._masks.get((cache_key, prefix))
    if flags is None:
        computed: list[bool | None] = []
        decided: dict[int, bool] = {}
        for info, leaf in zip(infos, leaves, strict=True):
            if info.spec is None:
                computed.append(None)
                continue
            flag = decided.get(info.var_index)
            if flag is None:
                # Leaves of one pytree-valued Variable share its answer.
                var = info.spec.var_type.from_metadata(leaf, dict(info.spec.metadata))
                flag = bool(predicate(nnx_path((*prefix, *info.var_path)), var))
                decided[info.var_index] = flag
            computed.append(flag)
        flags = tuple(computed)
        if cache_key is not None:
            pdef._masks[(cache_key, prefix)] = flags
    out = [bool(other(leaf)) if f is None else f for f, leaf in zip(flags, leaves, strict=True)]
    return from_parts(pdef, out)
