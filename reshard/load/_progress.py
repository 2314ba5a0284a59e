"""What a load is doing while it runs, shown by the first rank of each node: no silent wait a user takes for a hang.

Each phase (starting, checked, reading N of M files, materializing, loaded) is one line on stderr, or, on a
terminal, the reading phase is a tqdm bar. Other ranks show nothing: one node's lines are enough, and eight copies of
them would be noise.
"""

from __future__ import annotations

import contextvars
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

from ..words import mib, plural

PIPE_EVERY_S = 5.0  # on a pipe, a long read adds a line this often: never a silent stretch longer than this


def shown_here(progress: bool | None) -> bool:
    """Whether this process shows a load's progress: `progress` when given, else on the first rank of its node
    (`LOCAL_RANK` 0, or no launcher)."""
    if progress is not None:
        return progress
    return os.environ.get("LOCAL_RANK", "0") == "0"


@dataclass
class LoadProgress:
    """The phases of one load of `folder`, printed as they begin (mutable: it keeps the start time and the bar).

    Attributes:
        folder: the folder as given (each line names it).
        shown: False makes every call a no-op (ranks other than their node's first).
        stream: where the lines go.
    """

    folder: str
    shown: bool = True
    stream: object = None
    started: float = field(default_factory=time.monotonic)

    def phase(self, text: str) -> None:
        """One line: `reshard load FOLDER: TEXT (T s)`, T counted from the start of the load."""
        if self.shown:
            print(f"reshard load {self.folder}: {text} ({time.monotonic() - self.started:.1f} s)",
                  file=self.stream or sys.stderr, flush=True)

    @contextmanager
    def reading(self, files: int, nbytes: int, what: str = "of tensor data"):
        """Around the reads of `files` files, `nbytes` bytes (`what` they are): yields `update(files, nbytes)`, told
        after each file."""
        if not self.shown:
            yield lambda done_files, done_bytes: None
            return
        stream = self.stream or sys.stderr
        total = f"{plural(files, 'file')}, {mib(nbytes)} {what}"
        if getattr(stream, "isatty", lambda: False)():
            from tqdm.auto import tqdm

            bar = tqdm(total=nbytes, unit="B", unit_scale=True, unit_divisor=1024, file=stream,
                       desc=f"reshard load: reading 0 of {files} files")
            done = [0]

            def update(done_files, done_bytes):
                bar.set_description(f"reshard load: reading {done_files} of {files} files", refresh=False)
                bar.update(done_bytes - done[0])
                done[0] = done_bytes

            try:
                yield update
            finally:
                bar.close()
            self.phase(f"read {total}")
            return
        self.phase(f"reading {total}")
        last = [time.monotonic()]

        def update(done_files, done_bytes):
            if time.monotonic() - last[0] >= PIPE_EVERY_S and done_files < files:
                last[0] = time.monotonic()
                self.phase(f"read {done_files} of {files} files, {mib(done_bytes)} of {mib(nbytes)}")

        yield update
        self.phase(f"read {total}")


_current: contextvars.ContextVar[LoadProgress] = contextvars.ContextVar(
    "reshard_load_progress", default=LoadProgress("", shown=False))


def current() -> LoadProgress:
    """The progress of the load running in this context (a silent one outside any)."""
    return _current.get()


@contextmanager
def showing(progress: LoadProgress):
    """Make `progress` the `current()` one for the block."""
    token = _current.set(progress)
    try:
        yield progress
    finally:
        _current.reset(token)
