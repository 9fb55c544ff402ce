"""`Wrapped`: what every treemode wrapper of a user function shares.

``treemode.jit``, ``scan``, ``vmap``/``pmap``/``shard_map`` and ``custom_vjp``
return an object that stands for the user's function: it carries its name and
docstring (``functools.update_wrapper``), keeps it as ``fn``, becomes a bound
call when it is a class attribute read through an instance (a method), and
reads as ``<treemode.jit of <function f ...>>``.

`make_wrapper` is the end of every factory that makes one of them (``jit``,
``jit_partial``, ``vmap``, ``pmap``, ``scan``, ``shard_map``): the Flax lift
objects of its specifications are refused where the wrapper is made, then
the wrapper is made, or a decorator that makes it is returned.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from ._lifts import refuse_lifts

W = TypeVar("W")


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


def make_wrapper(
    wrapper: Callable[..., W],
    fn: Callable[..., Any] | None,
    options: dict[str, Any],
    *,
    transform: str,
    specs: tuple[str, ...],
    variables: bool = False,
    shardings: bool = False,
) -> Any:
    """``wrapper(fn, **options)``, or without ``fn`` the decorator that makes it.

    First each option named in ``specs`` is checked by `refuse_lifts` (with the
    ``graph`` option, and ``variables``/``shardings`` as there), so a Flax
    lift object is refused where the transform is made, decorator form or not.
    ``transform`` is the public name the messages give.
    """
    for what in specs:
        refuse_lifts(
            options[what],
            transform=transform,
            what=what,
            graph=options["graph"],
            variables=variables,
            shardings=shardings,
        )
    if fn is None:
        return lambda f: wrapper(f, **options)
    return wrapper(fn, **options)


__all__ = ["Wrapped", "make_wrapper"]
