"""``treemode.clone``: a copy with new Variables (and optionally new buffers)."""

from __future__ import annotations

from typing import Any, TypeVar

import jax
import jax.numpy as jnp

from .. import _compat
from .._tree._graph import from_tree, to_tree
from .._tree._leaves import is_array

T = TypeVar("T")


@_compat.api_boundary  # treemode's frames are left out of tracebacks
def clone(node: T, *, arrays: bool = False) -> T:
    """Copy a pytree of modules: new Modules and Variables, same sharing.

    **Arguments:**

    - `node`: any pytree of NNX modules, Variables, Equinox modules, arrays.
    - `arrays`: if `False` (default) the copy shares the array buffers with the
      original (cheap; JAX arrays are immutable). If `True` every array is copied
      to a new buffer, so the original and the copy can both be donated.

    **Returns:**

    A copy of `node`. References shared inside `node` are shared in the copy.

    ```python
    import treemode
    from flax import nnx

    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    copy = treemode.clone(model, arrays=True)
    assert copy.kernel is not model.kernel
    assert (copy.kernel[...] == model.kernel[...]).all()
    ```
    """

    def copy_leaf(x: Any) -> Any:
        if arrays and is_array(x):
            return jnp.array(x, copy=True)
        return x

    return from_tree(jax.tree_util.tree_map(copy_leaf, to_tree(node)))
