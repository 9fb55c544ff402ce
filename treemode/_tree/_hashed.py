"""A value object whose hash is computed once: the keys of treemode's caches."""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any, ClassVar


class HashedKey:
    """Compared by the values of ``_fields``; hashed once, when built.

    Cache keys are built on every transform call and looked up right away, so a
    subclass computes its hash in ``__init__`` (with `_hash_fields`) and equality
    compares the hashes before the fields.
    """

    __slots__ = ("_hash",)
    _fields: ClassVar[tuple[str, ...]] = ()
    _values: ClassVar[Callable[[Any], tuple[Any, ...]]]

    def __init_subclass__(cls, **kwargs: Any):
        super().__init_subclass__(**kwargs)
        getter = operator.attrgetter(*cls._fields)
        cls._values = getter if len(cls._fields) > 1 else lambda self: (getter(self),)

    def _hash_fields(self) -> None:
        self._hash = hash(type(self)._values(self))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        return (
            type(other) is type(self)
            and self._hash == other._hash  # pyright: ignore[reportAttributeAccessIssue]
            and type(self)._values(self) == type(self)._values(other)
        )

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in self._fields)
        return f"{type(self).__name__}({fields})"
