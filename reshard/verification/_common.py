"""What both checkers share: how an error of a source read for a check is worded, and how many bytes are compared at a
time."""

from __future__ import annotations

import copy
from typing import Callable, TypeVar

from ..errors import ReshardError

T = TypeVar("T")

COMPARE_BLOCK = 1 << 20  # bytes compared at a time: one buffer per side


def reworded(opening: Callable[[], T]) -> T:
    """`opening()` (a source opened or read for a check), its errors worded for verify: verify writes nothing, so an
    error worded for write and merge ("Nothing was written.") says what is true here ("Nothing was changed.")."""
    try:
        return opening()
    except ReshardError as e:
        if "Nothing was written." not in str(e):
            raise
        changed = copy.copy(e)  # the same class (and exit code), path and fields
        changed.args = (str(e).replace("Nothing was written.", "Nothing was changed."),)
        raise changed from e
