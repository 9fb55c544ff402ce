"""Hold every signal's Python handler while a donated call's buffers are consumed.

A call that donates its inputs deletes their buffers when the executable runs:
from then on the only whole state is the new one, and it exists only until it
is written into the caller's Variables. An exception raised by a signal
handler in that window (``KeyboardInterrupt`` from SIGINT, ``SystemExit``
from a SIGTERM handler, anything a SIGALRM timeout raises) would leave the
module holding deleted buffers.

`hold`, then `close` and `release` in a ``finally``, bracket the call of the
executable and the write-back. The compiled executor of the fast-path record
makes the common case in C on this module's state (`hold_state`: the same
handler table, the same swaps, the same deferred list), and misses (leaving the
call to the pipeline, which holds here) in any other.
Python runs signal handlers only in the main thread, between bytecodes, so
the hold replaces, for the duration of the call, every handler that is a
Python callable by a deferring one. When a
signal arrives, the deferring handler looks at the donated arrays:

- none is deleted yet (the executable has not run: JAX is still tracing or
  compiling it, or the call failed before running): the original handler runs
  at once, so a Ctrl-C during a long first trace or compilation is raised
  there, as with ``jax.jit``, and the inputs are untouched;
- some are deleted (the executable ran and consumed them): the signal is
  recorded, and sent again once the new values are written and the original
  handlers are back, so its handler runs right after the call, with the
  step's new values in place.

Why handlers and not ``pthread_sigmask``: a signal sent to the process (``kill``,
a terminal's Ctrl-C, ``setitimer``) that the main thread blocks is delivered
to another thread (JAX runs many), whose C-level handler still schedules the
Python handler in the main thread. Blocking does not keep the handler out of
the window; replacing it does.

Cost: the handler table is read with ``_signal.getsignal`` (the C functions;
the ``signal`` module's enum-converting wrappers cost ten times more) and two
``signal()`` calls per Python handler (SIGINT's alone, usually). Elsewhere
than the main thread the hold does nothing: no handler runs there. A hold
inside a hold (a donated call made while another one traces) adds its arrays
to the open one.

A deferring handler left installed (a second signal cut `release` short)
behaves as the original outside a hold and is replaced at the next hold, which
also delivers any signal that release did not.
"""

from __future__ import annotations

import importlib
import signal
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax
from jax.core import Tracer

from .._accel._border import hold_plan, signal_swap

T = TypeVar("T")

# The C functions behind `signal`, without its enum conversions (no stub: Any).
_signal: Any = importlib.import_module("_signal")
_MAIN_IDENT = threading.main_thread().ident
_get_ident = threading.get_ident
_getsignal = _signal.getsignal
_setsignal = _signal.signal
_SIGNALS = tuple(
    int(s) for s in sorted(signal.valid_signals()) if s not in {signal.SIGKILL, signal.SIGSTOP}
)


# The donated arrays of each open hold (one, or more for a donated call made while
# another traces), and the signals held back meanwhile. A hold opens with a store
# and closes with `close` (``list.pop``, in C): no bytecode between those and the
# caller's ``try``/``finally`` runs a handler, so a hold never stays open.
_open: list[Sequence[Any]] = []
_deferred: list[int] = []
close = _open.pop  # ends the innermost hold: call it first in the ``finally``, then `release`

_NESTED: Any = ()  # the token of a hold inside a hold (the outer one restores the handlers)


def _consumed(donated: Sequence[Any]) -> bool:
    """Whether the executable ran: a donated device buffer is deleted."""
    return any(
        isinstance(x, jax.Array) and not isinstance(x, Tracer) and x.is_deleted() for x in donated
    )


class _Deferring:
    """The handler a hold installs in place of ``original`` (a Python callable)."""

    __slots__ = ("original",)

    def __init__(self, original: Any):
        self.original = original

    def __call__(self, signum: int, frame: Any) -> Any:
        if any(map(_consumed, _open)):
            _deferred.append(signum)
            return None
        return self.original(signum, frame)  # nothing consumed (or no hold): now

    def __repr__(self) -> str:
        return f"<treemode held signal handler for {self.original!r}>"


# [the handler table, its swaps]: the table changes rarely, so does the plan.
# A list changed in place: the compiled hold reads it (`hold_state`).
_plan: list[Any] = hold_plan((), ())


def _swaps(handlers: tuple[Any, ...]) -> tuple[tuple[int, Any, _Deferring], ...]:
    if _plan[0] == handlers:
        return _plan[1]
    swaps = []
    for signum, handler in zip(_SIGNALS, handlers, strict=True):
        if type(handler) is _Deferring:
            handler = handler.original  # left installed by an interrupted restore
        if callable(handler):
            swaps.append(signal_swap(signum, handler, _Deferring(handler)))
    _plan[:] = hold_plan(handlers, tuple(swaps))
    return _plan[1]


def hold_state() -> dict[str, Any]:
    """What the compiled hold reads (`treemode._accel._compiled.configure`'s ``hold_*``
    fields and the others named here)."""
    return {
        "hold_open": _open,
        "hold_deferred": _deferred,
        "hold_plan": _plan,
        "signals": _SIGNALS,
        "getsignal": _getsignal,
        "setsignal": _setsignal,
        "main_thread": _MAIN_IDENT,
    }


def hold(donated: Sequence[Any]) -> Any:
    """Start holding signals for a call donating ``donated``.

    Returns ``None`` outside the main thread (nothing to end), else a token: the
    caller runs the call in ``try`` and, in its ``finally``, `close` then
    ``release(token)``. May raise a pending signal's exception: nothing was
    consumed yet, and no hold is open.
    """
    if _get_ident() != _MAIN_IDENT:
        return None
    if _open:
        token = _NESTED
    else:
        if _deferred:  # left by a release a second signal cut short: deliver them now
            leftover = list(_deferred)
            _deferred.clear()
            _deliver(leftover)
        token = _swaps(tuple(map(_getsignal, _SIGNALS)))
        for signum, _, deferring in token:
            _setsignal(signum, deferring)
    _open[len(_open) :] = (donated,)  # open: a store, no call after it
    return token


def release(token: Any) -> None:
    """End a hold `close` closed: put the original handlers back, then deliver the
    signals it held back (their handlers run here, after the write-back)."""
    if token is None or token is _NESTED:
        return
    deferred = list(_deferred)
    _deferred.clear()
    try:
        for signum, original, _ in token:
            _setsignal(signum, original)
    finally:
        if deferred:
            _deliver(deferred)


def _deliver(deferred: list[int]) -> None:
    """Send the deferred signals again, so their (original) handlers run as usual:
    in Python's order, the first exception raised, the others' handlers after it."""
    signums = set(deferred)
    block = getattr(_signal, "pthread_sigmask", None)
    if block is None:  # no signal masks: run the handlers now, in arrival order
        for signum in dict.fromkeys(deferred):
            handler = _getsignal(signum)
            if callable(handler):
                handler(signum, None)
        return
    old = None
    try:
        old = block(_signal.SIG_BLOCK, signums)
        for signum in signums:
            _signal.raise_signal(signum)  # pending while blocked
    finally:
        # Delivered here: their handlers run (the first exception propagates).
        if old is None:
            block(_signal.SIG_UNBLOCK, signums)
        else:
            block(_signal.SIG_SETMASK, old)


def run_held(donated: Sequence[Any], run: Callable[[], T]) -> T:
    """``run()`` under a signal hold for a call donating ``donated``: the one bracket
    of the pipeline's donated calls (`hold`, then `close` and `release` in the
    ``finally``; the compiled executor makes the same bracket in C)."""
    token = hold(donated)
    try:
        return run()
    finally:
        if token is not None:
            close()
            release(token)


__all__ = ["close", "hold", "hold_state", "release", "run_held"]
