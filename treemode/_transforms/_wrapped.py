"""`Wrapped`: what every treemode wrapper of a user function shares.

``treemode.jit``, ``scan``, ``vmap``/``pmap``/``shard_map`` and ``custom_vjp``
return an object that stands for the user's function: it carries its name and
docstring (``functools.update_wrapper``), keeps it as ``fn``, becomes a bound
call when it is a class attribute read through an instance (a method), and
reads as ``<treemode.jit of <function f ...>>``.

`make_wrapper` is the end of every factory that makes one of them (``jit``,
``jit_partial``, ``vmap``, ``pmap``, ``scan``, ``shard_map``): the Flax lift
objects of its specifications are refused where the wrapper is made, then
the wrapper is made, or a decorator that makes it is returned. It keeps with
the wrapper how it was made, so that a trace can make the same wrapper of
another function.

A wrapper is seen through by the closure search (``treemode._tree._closure``):
`Wrapped._closure_reads` gives what a call reads besides its arguments (the
function, and the arguments ``jit_partial`` bound), and inside the trace of an
outer transform that lifted a module they reach, `Wrapped._closure_remake` gives
the same wrapper of the copies that reach the traced module
(``treemode._pipeline._substitute``): what ``treemode.jit(lambda x:
treemode.grad(f)(x))`` makes inline, per trace.
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
    # How `make_wrapper` made this wrapper: the class with its options, to call
    # with another function (`_closure_remake`).
    _made_by: functools.partial[Any] | None = None
    # Why the search does not see through a wrapper whose `_closure_reads` is None:
    # the report of what it does not lift says it (``_pipeline._unlifted``).
    _closure_refusal = (
        "a treemode wrapper that treemode's own functions did not make (the search "
        "cannot make it again for the trace): make it with treemode's function"
    )

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

    # -- the closure search sees through a wrapper (treemode._tree._closure) ----------

    def _closure_reads(self) -> dict[str, Any] | None:
        """What a call reads besides its arguments: ``{"fn": the function}``, and
        ``"partial_args"`` for the arguments `jit_partial` bound. ``None`` where
        this wrapper cannot be made again for another function (not made by
        `make_wrapper`): the search does not see through it then, and the
        report of what it does not lift names it (``_pipeline._unlifted``)."""
        made_by = self.__dict__.get("_made_by")
        # ``functools.update_wrapper`` copies the wrapped function's ``__dict__``, so
        # a wrapper of a wrapper may hold the inner one's: only its own counts.
        if made_by is None or made_by.func is not type(self):
            return None
        reads: dict[str, Any] = {"fn": self.fn}
        if "partial_args" in made_by.keywords:
            reads["partial_args"] = self.__dict__["partial_args"]
        return reads

    def _closure_remake(self, reads: dict[str, Any]) -> Wrapped[Any, Any]:
        """The same wrapper (same class, same options) of ``reads["fn"]``, with the
        bound arguments ``reads`` gives: `_closure_reads` with what it holds
        replaced by the copies a trace made. It shares no cache with this one."""
        made_by = self.__dict__["_made_by"]
        rest = {k: v for k, v in reads.items() if k != "fn"}
        made = made_by(reads["fn"], **rest)
        made._made_by = functools.partial(made_by.func, **{**made_by.keywords, **rest})
        return made


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
        return lambda f: _made(wrapper, f, options)
    return _made(wrapper, fn, options)


def _made(wrapper: Callable[..., W], fn: Callable[..., Any], options: dict[str, Any]) -> W:
    """``wrapper(fn, **options)``, knowing how it was made (`Wrapped._closure_remake`)."""
    made = wrapper(fn, **options)
    if isinstance(made, Wrapped):
        made._made_by = functools.partial(wrapper, **options)
    return made


__all__ = ["Wrapped", "make_wrapper"]
