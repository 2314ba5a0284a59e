"""Signals around long writes: SIGTERM unwinds like Ctrl-C, and a few steps hold both until they are done."""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager


@contextmanager
def sigterm_as_interrupt():
    """Let SIGTERM unwind like Ctrl-C, as `KeyboardInterrupt("signal 15")`, so `finally` blocks clean up (the
    temporary folder is removed) and the CLI boundary exits 143. Off the main thread, signals are left alone."""
    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def signals_held():
    """Hold SIGINT and SIGTERM around a step that must not be cut in two (the two renames of a swap, starting the
    worker processes): raised again, to their own handlers, after it.

    Python runs signal handlers in the main thread whichever thread the kernel picked, so recording them there
    (not masking this thread) is what keeps them out of the block. Off the main thread they never interrupt it.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    held = (signal.SIGINT, signal.SIGTERM)
    previous = {s: signal.signal(s, lambda signum, frame: caught.append(signum)) for s in held}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)
        for s in dict.fromkeys(caught):
            signal.raise_signal(s)
