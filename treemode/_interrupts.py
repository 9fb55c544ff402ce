"""Hold a Ctrl-C back while a donated call's results are not yet written back.

A call that donates its inputs deletes their buffers when the executable runs:
from then on the only whole state is the new one, and it exists only until it
is written into the caller's Variables. A ``KeyboardInterrupt`` raised by the
SIGINT handler in that window would leave the module holding deleted buffers.
`held_interrupts` replaces a Python-level SIGINT handler by one that only
records the signal, and calls the original handler (which raises) once the
block is done: the interrupt still arrives, after the write.

Only the main thread runs signal handlers, so elsewhere this does nothing;
a handler that is not a Python callable (ignored, or the default action) is
left alone.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

_main = threading.main_thread()


class held_interrupts:
    """``with held_interrupts():`` defers SIGINT's Python handler to the block's end."""

    __slots__ = ("_original", "_pending")

    def __enter__(self) -> None:
        self._original: Any = None
        self._pending: tuple[int, Any] | None = None
        if threading.current_thread() is not _main:
            return
        original = signal.getsignal(signal.SIGINT)
        if not callable(original):
            return
        self._original = original
        signal.signal(signal.SIGINT, self._hold)

    def _hold(self, signum: int, frame: Any) -> None:
        if self._pending is None:
            self._pending = (signum, frame)

    def __exit__(self, kind: Any, error: Any, traceback: Any) -> None:
        original = self._original
        if original is None:
            return
        signal.signal(signal.SIGINT, original)
        pending = self._pending
        if pending is not None:
            original(*pending)


__all__ = ["held_interrupts"]
