"""`Wrapped`: what every treemode wrapper of a user function shares.

``treemode.jit``, ``scan``, ``vmap``/``pmap``/``shard_map`` and ``custom_vjp``
return an object that stands for the user's function: it carries its name and
docstring (``functools.update_wrapper``), keeps it as ``fn``, becomes a bound
call when it is a class attribute read through an instance (a method), and
reads as ``<treemode.jit of <function f ...>>``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any


class Wrapped:
    """Base of treemode's function wrappers (see the module docstring).

    A subclass names its transform (``transform``) and calls `_wrap` first in
    its ``__init__``.
    """

    transform = ""
    fn: Callable[..., Any]

    def _wrap(self, fn: Callable[..., Any]) -> None:
        functools.update_wrapper(self, fn)  # type: ignore[arg-type]
        self.fn = fn

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        if obj is None:
            return self
        return functools.partial(self, obj)  # pyright: ignore[reportArgumentType]

    def __repr__(self) -> str:
        return f"<treemode.{self.transform} of {self.fn!r}>"


__all__ = ["Wrapped"]
