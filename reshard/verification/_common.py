"""What both checkers share: how a source is opened for a check, and how many bytes are compared at a time."""

from __future__ import annotations

from ..errors import ReshardError
from ..read import open_source

COMPARE_BLOCK = 1 << 20  # bytes compared at a time: one buffer per side


def open_to_check(spec, *, revision: str | None = None):
    """`open_source` for a check. verify writes nothing: a source's error worded for write and merge ("Nothing was
    written.") says what is true here."""
    import copy

    try:
        return open_source(spec, revision=revision)
    except ReshardError as e:
        if "Nothing was written." not in str(e):
            raise
        reworded = copy.copy(e)  # the same class (and exit code), path and fields
        reworded.args = (str(e).replace("Nothing was written.", "Nothing was changed."),)
        raise reworded from e

