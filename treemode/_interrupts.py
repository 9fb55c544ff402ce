"""Hold every signal's Python handler while a donated call's buffers are consumed.

A call that donates its inputs deletes their buffers when the executable runs:
from then on the only whole state is the new one, and it exists only until it
is written into the caller's Variables. An exception raised by a signal
handler in that window (``KeyboardInterrupt`` from SIGINT, ``SystemExit``
from a SIGTERM handler, anything a SIGALRM timeout raises) would leave the
module holding deleted buffers.

`held` (or `hold` ... `release`, for the compiled call path) brackets the call
of the executable and the write-back. Python runs signal handlers only in the
main thread, between bytecodes, so the hold replaces, for the duration of the
call, every handler that is a Python callable by a deferring one. When a
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
inside a hold (a donated call traced by a donated call) is the outer one's.

If a handler that ran at once raises while the window is open, the window is
abandoned (nothing was consumed: the call is unwinding) and later signals run
their handlers at once. A deferring handler left installed (a second signal
interrupted the restore) behaves as the original and is replaced at the next
hold.
"""

from __future__ import annotations

import importlib
import signal
import threading
from collections.abc import Sequence
from typing import Any

import jax
from jax.core import Tracer

# The C functions behind `signal`, without its enum conversions (no stub: Any).
_signal: Any = importlib.import_module("_signal")
_MAIN_IDENT = threading.main_thread().ident
_get_ident = threading.get_ident
_getsignal = _signal.getsignal
_setsignal = _signal.signal
_SIGNALS = tuple(
    int(s) for s in sorted(signal.valid_signals()) if s not in {signal.SIGKILL, signal.SIGSTOP}
)


class _Window:
    """The open hold's donated arrays (``None``: no hold) and the signals it deferred."""

    __slots__ = ("donated", "deferred")

    def __init__(self) -> None:
        self.donated: Sequence[Any] | None = None
        self.deferred: list[int] = []


_window = _Window()


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
        window = _window
        donated = window.donated
        if donated is not None and _consumed(donated):
            window.deferred.append(signum)
            return None
        try:
            return self.original(signum, frame)
        except BaseException:
            # The call unwinds before anything was consumed: the window is over.
            window.donated = None
            raise

    def __repr__(self) -> str:
        return f"<treemode held signal handler for {self.original!r}>"


# (the handler table, its swaps): the table changes rarely, so does the plan.
_cache: tuple[tuple[Any, ...], tuple[tuple[int, Any, _Deferring], ...]] = ((), ())


def _swaps(handlers: tuple[Any, ...]) -> tuple[tuple[int, Any, _Deferring], ...]:
    global _cache
    cached = _cache
    if cached[0] == handlers:
        return cached[1]
    swaps = []
    for signum, handler in zip(_SIGNALS, handlers, strict=True):
        if type(handler) is _Deferring:
            handler = handler.original  # left installed by an interrupted restore
        if callable(handler):
            swaps.append((signum, handler, _Deferring(handler)))
    _cache = (handlers, tuple(swaps))
    return _cache[1]


def hold(donated: Sequence[Any]) -> Any:
    """Start holding signals for a call donating ``donated``; the token for `release`.

    ``None`` (nothing to release) outside the main thread and inside a hold.
    May raise a pending signal's exception: nothing was consumed yet.
    """
    if _get_ident() != _MAIN_IDENT or _window.donated is not None:
        return None
    swaps = _swaps(tuple(map(_getsignal, _SIGNALS)))
    for signum, _, deferring in swaps:
        _setsignal(signum, deferring)
    _window.donated = donated  # the last step: the window is open
    return swaps


def release(token: Any) -> None:
    """End a hold: put the original handlers back, then deliver what was deferred."""
    if token is None:
        return
    window = _window
    window.donated = None
    deferred = window.deferred
    window.deferred = []
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


class held:
    """``with held(donated):`` holds signals over a call donating ``donated`` (`hold`)."""

    __slots__ = ("_donated", "_token")

    def __init__(self, donated: Sequence[Any]):
        self._donated = donated
        self._token: Any = None

    def __enter__(self) -> None:
        self._token = hold(self._donated)

    def __exit__(self, kind: Any, error: Any, traceback: Any) -> None:
        release(self._token)


__all__ = ["held", "hold", "release"]
