"""Specs, structure keys and `rebuild`: what a flattened pytree's static part is made of.

A pytree flattened with Variables as leaves is described by its treedef and one
spec per leaf: a `VarSpec` (the Variable's type, metadata and value layout),
`DYNAMIC` (a traced array outside any Variable) or a `StaticLeaf` (a value
compared by equality). `StructureKey` holds the two, hashable; `rebuild` makes
a new tree (with new Variables) from a key and the traced leaves. The
flattening cache (``_flatten``), the pure function (``_pure``) and the
`treemode.Pytree` proxy (``_pytree``) share them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.tree_util import PyTreeDef

from ._hashed import HashedKey
from ._leaves import is_variable_value_leaf


class _Dynamic:
    """Spec of a traced non-Variable leaf (an array in a plain container)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "DYNAMIC"

    def __reduce__(self):
        return "DYNAMIC"


DYNAMIC = _Dynamic()


@dataclasses.dataclass(frozen=True, slots=True)
class StaticLeaf:
    """Spec of a non-array leaf: compared by value, part of the cache key."""

    value: Any


@dataclasses.dataclass(frozen=True, slots=True)
class VarSpec:
    """Spec of a Variable leaf: its type, metadata and the layout of its value.

    ``value_def`` is ``None`` when the value is a single array (the common case);
    otherwise it is the value's treedef, and ``value_static`` holds, per value
    leaf, ``None`` for a traced leaf or a ``StaticLeaf``.
    """

    var_type: type
    metadata: tuple[tuple[str, Any], ...]
    value_def: PyTreeDef | None = None  # pyright: ignore[reportInvalidTypeForm]
    value_static: tuple[StaticLeaf | None, ...] = ()

    @property
    def num_dynamic(self) -> int:
        if self.value_def is None:
            return 1
        return sum(1 for s in self.value_static if s is None)

    def build(self, dynamic: Sequence[Any]) -> Any:
        """Rebuild a raw value from this spec's dynamic leaves."""
        if self.value_def is None:
            return dynamic[0]
        it = iter(dynamic)
        leaves = [next(it) if s is None else s.value for s in self.value_static]
        return self.value_def.unflatten(leaves)


Spec = VarSpec | StaticLeaf | _Dynamic


def variable_spec(var: Any) -> tuple[VarSpec, list[Any]]:
    """The spec of a Variable and its dynamic value leaves."""
    return value_spec(type(var), var._var_metadata, var._raw_value)


def value_spec(var_type: type, metadata: dict[str, Any], value: Any) -> tuple[VarSpec, list[Any]]:
    """The spec of a Variable of ``var_type`` holding ``value``, and its dynamic leaves."""
    metadata_key = tuple(sorted(metadata.items()))
    if is_variable_value_leaf(value):
        return VarSpec(var_type, metadata_key), [value]
    leaves, value_def = jax.tree_util.tree_flatten(value)
    static: list[StaticLeaf | None] = []
    dynamic: list[Any] = []
    for leaf in leaves:
        if is_variable_value_leaf(leaf):
            static.append(None)
            dynamic.append(leaf)
        else:
            static.append(StaticLeaf(leaf))
    return VarSpec(var_type, metadata_key, value_def, tuple(static)), dynamic


def variable_dynamic(var: Any, spec: VarSpec) -> list[Any]:
    """The dynamic leaves of ``var``'s current value (laid out as ``spec``)."""
    if spec.value_def is None:
        return [var._raw_value]
    leaves = jax.tree_util.tree_leaves(var._raw_value)
    return [x for x, s in zip(leaves, spec.value_static, strict=True) if s is None]


def dynamic_count(spec: Spec) -> int:
    """How many traced leaves one spec stands for."""
    if type(spec) is VarSpec:
        return spec.num_dynamic
    return 1 if spec is DYNAMIC else 0


class StructureKey(HashedKey):
    """A pytree's structure with Variables as leaves: its treedef and one spec per leaf.

    Hashable, with the hash computed once: the cache key of a flattened argument
    (and the base of a `treemode.Pytree` proxy's static part).
    """

    __slots__ = ("treedef", "specs")
    _fields = ("treedef", "specs")

    def __init__(
        self,
        treedef: PyTreeDef,  # pyright: ignore[reportInvalidTypeForm]
        specs: tuple[Spec, ...],
    ):
        self.treedef = treedef
        self.specs = specs
        self._hash_fields()


def rebuild(
    flat_key: StructureKey,
    dynamic: Sequence[Any],
    wrap: Callable[[Any], Any] | None = None,
) -> tuple[Any, list[Any], list[Any]]:
    """Rebuild a pytree from a structure key and its dynamic leaves.

    Returns ``(tree, variables, leaves)``.

    Every Variable is a new object of the same type and metadata holding the new
    value, so it belongs to the current trace and can be mutated there.
    ``wrap``, if given, is applied to a Variable's value when it is one leaf.
    """
    leaves: list[Any] = []
    variables: list[Any] = []
    i = 0
    for spec in flat_key.specs:
        if type(spec) is VarSpec:
            n = spec.num_dynamic
            if wrap is not None and spec.value_def is None:
                value = wrap(dynamic[i])
            else:
                value = spec.build(dynamic[i : i + n])
            i += n
            var = spec.var_type.from_metadata(value, dict(spec.metadata))
            variables.append(var)
            leaves.append(var)
        elif spec is DYNAMIC:
            leaves.append(dynamic[i])
            i += 1
        else:
            assert isinstance(spec, StaticLeaf)
            leaves.append(spec.value)
    return flat_key.treedef.unflatten(leaves), variables, leaves


__all__ = [
    "DYNAMIC",
    "Spec",
    "StaticLeaf",
    "StructureKey",
    "VarSpec",
    "dynamic_count",
    "rebuild",
    "value_spec",
    "variable_dynamic",
    "variable_spec",
]
