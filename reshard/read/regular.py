"""A source's own files, read safely: opened only when they are regular files, and JSON refused with one error.

A FIFO, a device or a folder where a source has a file would block the open or never end; JSON nested deeper than
the parser goes would be a traceback. Every reader of a source (its headers, its index, its `config.json`) comes
through here, so each refusal is worded once, with what is wrong and the remedy.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from ..errors import CheckpointError


def json_document(raw, what: str, remedy: str, *, path: str):
    """`json.loads(raw)`, every failure a `CheckpointError` saying `what` is wrong and `remedy`.

    Nesting is bounded by the parser's own recursion limit: a header nested 200,000 deep (a safetensors header is 3
    deep) is refused with this error, not a `RecursionError` traceback.
    """
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{what} is not valid JSON ({e}); {remedy}.", path=path) from e
    except RecursionError as e:
        raise CheckpointError(f"{what} is JSON nested deeper than reshard reads (a safetensors header or config is "
                              f"nested a few levels); {remedy}.", path=path) from e


def open_regular(path: Path, name: str):
    """Open the source file `path` (`name` in messages) for reading, unbuffered, only if it is a regular file.

    A FIFO, a device or a folder in a source (`config.json` a FIFO, a weight file linked to /dev/zero) would block
    the open or never end; it is refused before opening, and the open cannot block (O_NONBLOCK, then fstat refuses
    a FIFO swapped in after the check).

    Raises:
        CheckpointError: not a regular file (nothing was read or changed).
        OSError: missing or unreadable.
    """
    _refuse_irregular(path, name, os.stat(path).st_mode)

    def opener(file, flags: int) -> int:
        fd = os.open(file, flags | os.O_NONBLOCK)
        try:
            _refuse_irregular(path, name, os.fstat(fd).st_mode)
            os.set_blocking(fd, True)
        except BaseException:
            os.close(fd)
            raise
        return fd

    return open(path, "rb", buffering=0, opener=opener)  # by path: callers and audits see which file it is


def _refuse_irregular(path: Path, name: str, mode: int) -> None:
    if not stat.S_ISREG(mode):
        kind = ("a FIFO" if stat.S_ISFIFO(mode) else "a folder" if stat.S_ISDIR(mode)
                else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file")
        raise CheckpointError(f"{name}: {kind}, not a regular file; reshard reads only regular files from a "
                              "checkpoint. Replace it with the real file. Nothing was read or changed.", path=str(path))


def read_regular_text(path: Path, name: str) -> str:
    """The whole of a small regular file (an index, a config) as text (`open_regular`'s refusals)."""
    with open_regular(path, name) as f:
        return f.read().decode()
