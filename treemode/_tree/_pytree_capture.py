"""A module taken apart into a proxy's parts, and built again from them.

`capture` splits an NNX module into its static part (a `PytreeDef`), its leaves
and its Variables, reusing the previous static part when the structure did not
change; `materialize` builds a new module from a static part and leaves. A leaf
that is not an array (an Equinox sentinel, ``None``, a mask) sits in a
materialized Variable wrapped (`_Opaque`) and is taken out again by `unwrap`.
The proxy that calls them is `treemode._tree._pytree`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from .. import _compat
from ._graph import from_tree, to_tree
from ._leaves import (
    ARRAY_TYPES,
    SCALAR_TYPES,
    frozen_metadata,
    is_abstract_array,
    is_variable,
    same_static,
    same_treedef,
)
from ._pytree_def import PytreeDef, interned, single_leaf
from ._specs import DYNAMIC, StaticLeaf, VarSpec, rebuild, value_spec

# ----------------------------------------------------------- foreign leaf values


class _Opaque:
    """Holds a leaf that is not an array (an Equinox sentinel, ``None``,
    ``jax.ShapeDtypeStruct``, a boolean mask...) inside a materialized Variable.

    ``variable[...]`` returns the leaf itself (so ``eqx.tree_at`` can select it)
    and other attributes (``shape``, ``dtype``) are read from it.
    """

    __slots__ = ("leaf",)

    def __init__(self, leaf: Any):
        self.leaf = leaf

    def __getitem__(self, index: Any) -> Any:
        if index is Ellipsis:
            return self.leaf
        return self.leaf[index]

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.leaf, name)

    def __repr__(self) -> str:
        return repr(self.leaf)


_PLAIN_VALUES = ARRAY_TYPES + SCALAR_TYPES


def _wrap(leaf: Any) -> Any:
    return leaf if isinstance(leaf, _PLAIN_VALUES) else _Opaque(leaf)


def unwrap(value: Any) -> Any:
    """The leaf a materialized Variable's value stands for (an `_Opaque` unwrapped)."""
    return value.leaf if type(value) is _Opaque else value


# ---------------------------------------------------------------------- capture


def _var_spec(var: Any) -> tuple[VarSpec, list[Any]]:
    return value_spec(type(var), _compat.metadata_of(var), unwrap(_compat.raw_value_of(var)))


def _reuse(flat: list[Any], old: PytreeDef) -> tuple[tuple[Any, ...], list[Any]] | None:
    """Leaves of ``flat`` laid out as ``old``, or None if the structure changed."""
    leaves: list[Any] = []
    variables: list[Any] = []
    for spec, x in zip(old.specs, flat, strict=True):
        if spec is DYNAMIC:
            leaves.append(x)
        elif type(spec) is VarSpec:
            if type(x) is not spec.var_type:
                return None
            if frozen_metadata(_compat.metadata_of(x)) != spec.frozen:
                return None
            variables.append(x)
            value = unwrap(_compat.raw_value_of(x))
            if single_leaf(spec):
                leaves.append(value)
                continue
            parts, value_def = jax.tree_util.tree_flatten(value)
            if not same_treedef(value_def, spec.value_def):
                return None
            for part, static in zip(parts, spec.value_static, strict=True):
                if static is None:
                    leaves.append(part)
                elif not same_static(part, static.value):
                    return None
        elif not same_static(x, spec.value):
            return None
    return tuple(leaves), variables


def capture(
    module: Any, old: PytreeDef | None = None
) -> tuple[PytreeDef, tuple[Any, ...], list[Any]]:
    """Split ``module`` into (static part, leaves, its Variables in leaf order).

    If ``old`` is given and the structure did not change, ``old`` is reused, so
    the static part keeps its identity (cheap jit cache hits) and leaves keep
    their positions even when they are not arrays (masks, ``None``).
    """
    flat, treedef = jax.tree_util.tree_flatten(to_tree(module), is_leaf=is_variable)
    if old is not None and len(flat) == len(old.specs) and treedef == old.treedef:
        reused = _reuse(flat, old)
        if reused is not None:
            return old, reused[0], reused[1]
    specs: list[Any] = []
    leaves: list[Any] = []
    variables: list[Any] = []
    for x in flat:
        if is_variable(x):
            spec, dynamic = _var_spec(x)
            specs.append(spec)
            leaves.extend(dynamic)
            variables.append(x)
        elif is_abstract_array(x):
            specs.append(DYNAMIC)
            leaves.append(x)
        else:
            specs.append(StaticLeaf(x))
    return interned(PytreeDef(treedef, tuple(specs))), tuple(leaves), variables


def materialize(pdef: PytreeDef, leaves: Sequence[Any], *, wrap: bool) -> tuple[Any, list[Any]]:
    """Build a new module (and its Variables, in order) from a static part and leaves."""
    tree, variables, _ = rebuild(pdef, leaves, _wrap if wrap else None)
    return from_tree(tree), variables
