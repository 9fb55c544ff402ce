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
from typing import Any, Concatenate, Generic, ParamSpec, Self, TypeVar, overload

from ._lifts import refuse_lifts

P = ParamSpec("P")
R = TypeVar("R")
W = TypeVar("W")
# A method's parameters after ``self``, its result and its instance (`Wrapped.__get__`).
_Rest = ParamSpec("_Rest")
_Out = TypeVar("_Out")
_Self = TypeVar("_Self")


class Wrapped(Generic[P, R]):
    """Base of treemode's function wrappers (see the module docstring).

    A subclass names its transform (``transform``) and calls `_wrap` first in
    its ``__init__``. For type checkers a ``Wrapped[P, R]`` wraps a function
    taking ``P`` and returning ``R``; read through an instance, a wrapped method
    takes the parameters after ``self``.
    """

    transform = ""
    fn: Callable[P, R]

    def _wrap(self, fn: Callable[P, R]) -> None:
        functools.update_wrapper(self, fn)  # type: ignore[arg-type]
        self.fn = fn

    @overload
    def __get__(self, obj: None, objtype: Any = None) -> Self: ...

    @overload
    def __get__(
        self: Wrapped[Concatenate[_Self, _Rest], _Out], obj: _Self, objtype: Any = None
    ) -> Callable[_Rest, _Out]: ...

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
