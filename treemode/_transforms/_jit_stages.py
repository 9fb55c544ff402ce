"""The ahead-of-time stages of a `treemode.jit` function: ``trace``, ``lower``, ``compile``.

Each wraps JAX's stage of the same name (every attribute of it is available)
and remembers the call structure it was made for; a `Compiled` is called with
the user's arguments, flattened, checked and written back as a call of the
wrapper is.
"""

from __future__ import annotations

from typing import Any

from .. import _compat
from .._errors import StructureError
from .._pipeline import _call


class _Stage:
    """A stage of ahead-of-time compilation: wraps the JAX stage of the same name.

    Every attribute of the JAX stage is available; treemode adds the argument
    handling for calls and remembers the call structure it was made for.
    """

    def __init__(
        self,
        wrapped: Any,  # the treemode.jit wrapper (`_jit.JitWrapped`)
        key: _call.CallKey,
        stage: Any,
        split: tuple[tuple[int, ...], tuple[int, ...]] | None,
    ):
        self._wrapped = wrapped
        self._key = key
        self._stage = stage
        self._split = split  # how the stage takes donated arrays (`_donation_split`)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stage, name)


class Traced(_Stage):
    """The result of `JitWrapped.trace` (a ``jax.stages.Traced``): ``.jaxpr``, ``.lower()``."""

    def lower(self, **kwargs: Any) -> Lowered:
        return Lowered(self._wrapped, self._key, self._stage.lower(**kwargs), self._split)


class Lowered(_Stage):
    """The result of `JitWrapped.lower` (a ``jax.stages.Lowered``): ``.compile()``."""

    def compile(self, *args: Any, **kwargs: Any) -> Compiled:
        stage = self._stage.compile(*args, **kwargs)
        return Compiled(self._wrapped, self._key, stage, self._split)


class Compiled(_Stage):
    """A compiled call (a ``jax.stages.Compiled``); calling it runs like the jitted function.

    Arguments are flattened, checked (donation, structure) and the changed
    Variables written back exactly as a call of the `treemode.jit` function does.
    """

    @_compat.api_boundary
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        wrapped = self._wrapped
        call = wrapped._prepare(args, kwargs, abstract=False)
        if call.key != self._key:
            raise StructureError(
                "treemode.jit: this Compiled function was lowered for arguments of "
                "another structure (modules, Variable types or metadata, static values "
                "differ). Lower and compile again for these arguments, or call the "
                "treemode.jit function itself, which compiles per structure."
            )
        return wrapped._run(call, wrapped._entry(call), self)
