"""What `--overwrite` may replace: a complete output of reshard, and nothing beside it, in a folder or a bucket.

A rule reads what the output's own metadata claims (the manifest of a write, with its rank files, extras and copied
files; the index of a merge, with its weight files and copied files) and names every entry it does not claim: a
folder or a bucket prefix holding one is refused by name, and nothing is changed. The same rule answers for a local
folder (`ReplaceRule.why_not`) and for a bucket prefix (`ReplaceRule.problem`, over the prefix's listing), so
`write --overwrite` and `merge --overwrite` replace the same things wherever OUT is.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..manifest import MANIFEST_NAME, claimed_names
from ..read import INDEX_NAME, LocalStore, is_metadata_file
from ._merge_index import MergeIndex

_MAX_INDEX_BYTES = 64 << 20  # a merge's index, read to learn what it may replace


@dataclass(frozen=True)
class ReplaceRule:
    """Which existing output `--overwrite` may replace.

    Attributes:
        problem: `problem(store, entries)`: why the folder or prefix `store` holding `entries` (name -> whether it is
            a plain file; a sub-folder or sub-prefix is not) may not be replaced, or None.
        replaceable: what may be, for messages.
    """

    problem: Callable[..., "str | None"]
    replaceable: str

    def why_not(self, out: Path) -> str | None:
        """Why the local folder `out` may not be replaced, or None: it is empty, or what the rule allows."""
        if not out.is_dir():
            return "it is not a folder"
        entries = {e: (out / e).is_file() for e in os.listdir(out)}
        if not entries:
            return None
        store = LocalStore(out, links_anywhere=True)
        try:
            return self.problem(store, entries)
        finally:
            store.close()


def some(names) -> str:
    """At most five names for a message, and how many more."""
    names = list(names)
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def not_ours(entries: dict[str, bool], ours: set[str]) -> list[str]:
    """The entries its writer did not put there: a name it does not list, or not a plain file."""
    return [e for e in sorted(entries) if e not in ours or not entries[e]]


def reshard_output_problem(store, entries: dict[str, bool]) -> str | None:
    """Why what `store` holds (`entries`) may not be replaced by a write, or None: it holds only what one reshard
    write put there."""
    names = sorted(entries)
    if not names:
        return None
    ours, why = claimed_names(store, names)
    if why is not None:
        return why
    if ours is None:  # a manifest from before `copied` was recorded: top-level files reshard copies today count
        ours = {e for e in names if is_metadata_file(e)} | claimed_names(store, names, with_copied=False)[0]
    foreign = not_ours(entries, ours)
    if foreign:
        return f"it is a reshard output but also holds {some(foreign)}, which reshard did not write"
    return None


def merge_output_problem(store, entries: dict[str, bool]) -> str | None:
    """Why what `store` holds (`entries`) may not be replaced by a merge, or None: empty, a complete merge output, or
    a reshard output."""
    names = sorted(entries)
    if not names or MANIFEST_NAME in entries:
        return reshard_output_problem(store, entries)
    if INDEX_NAME not in entries:
        return f"it holds {some(names)} and neither {INDEX_NAME} nor {MANIFEST_NAME}"
    try:
        index = MergeIndex.from_document(json.loads(store.read_all(INDEX_NAME, _MAX_INDEX_BYTES, "safetensors index")))
    except (OSError, ValueError, RecursionError) as e:  # CheckpointError is a ValueError
        return f"its {INDEX_NAME} cannot be read as a merge output's ({type(e).__name__}: {e})"
    if not index.merged:
        return f"its {INDEX_NAME} was not written by reshard merge"
    foreign = not_ours(entries, {INDEX_NAME, *index.weight_map.values(), *index.copied})
    if foreign:
        return f"it is a merge output but also holds {some(foreign)}, which reshard did not write"
    return None


RESHARD_OUTPUT = ReplaceRule(reshard_output_problem, "a complete reshard output")
MERGE_OUTPUT = ReplaceRule(merge_output_problem, "a complete merge or reshard output")
RULES = {"write": RESHARD_OUTPUT, "merge": MERGE_OUTPUT}  # by command
