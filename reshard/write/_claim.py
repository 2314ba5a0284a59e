"""The claim record of an `--overwrite` into a bucket prefix: what is being replaced, and by which write.

S3 has no rename, so a prefix cannot swap a whole old checkpoint for a whole new one at once. reshard keeps the old
one whole while the new one is sent (its parts go into multipart uploads nobody can see), and only then swaps: the
old markers are removed, the uploads completed, the new markers written, the old objects the new one lacks removed.
Before the first byte is sent it writes this record under the prefix (`CLAIM_NAME`), naming every object the prefix
held; before the swap it writes it again naming the new objects too (`state: swapping`); it removes the record once
the new checkpoint is complete, or once a failure before the swap has aborted every upload.

A replacement that ends early thus leaves one of two states, and the next `--overwrite` completes either, since the
record says that every object it names is reshard's to replace:
- `sending`: the old checkpoint is whole and loads (a SIGKILL left the record, and uploads nobody sees);
- `swapping`: the old checkpoint no longer loads; the record names what is there.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from ._replaceable import not_ours, some

CLAIM_NAME = ".reshard-replacing.json"
_FORMAT = "reshard-replacing/1"
_MAX_CLAIM_BYTES = 64 << 20
SENDING, SWAPPING = "sending", "swapping"


@dataclass(frozen=True)
class Claim:
    """A claim record.

    Attributes:
        write_id: the write that made it (a fresh id per command).
        state: `sending` (the old checkpoint is whole) or `swapping` (it is being replaced).
        replacing: the objects the prefix held when the write began.
        new: the objects the new checkpoint has (known once every file is sent; empty while `sending`).
    """

    write_id: str
    state: str
    replacing: tuple[str, ...]
    new: tuple[str, ...] = ()

    @classmethod
    def begin(cls, existing) -> "Claim":
        return cls(uuid.uuid4().hex, SENDING, tuple(sorted(set(existing) - {CLAIM_NAME})))

    def swapping(self, new) -> "Claim":
        return Claim(self.write_id, SWAPPING, self.replacing, tuple(sorted(new)))

    def to_bytes(self) -> bytes:
        return (json.dumps({"format": _FORMAT, "write_id": self.write_id, "state": self.state,
                            "replacing": list(self.replacing), "new": list(self.new)}, indent=1) + "\n").encode()

    @classmethod
    def parse(cls, data: bytes) -> "Claim":
        """The record `data` holds.

        Raises:
            ValueError: it is not one (naming why).
        """
        document = json.loads(data)
        if not isinstance(document, dict) or document.get("format") != _FORMAT:
            raise ValueError(f"not a reshard claim record (format {_FORMAT})")
        names = [document.get("replacing"), document.get("new")]
        if not all(isinstance(n, list) and all(isinstance(x, str) for x in n) for n in names) \
                or document.get("state") not in (SENDING, SWAPPING) or not isinstance(document.get("write_id"), str):
            raise ValueError("its fields are damaged")
        return cls(document["write_id"], document["state"], tuple(names[0]), tuple(names[1]))


def read_claim(store) -> Claim:
    """The claim record under the prefix `store` serves.

    Raises:
        ValueError: it cannot be read as one.
    """
    return Claim.parse(store.read_all(CLAIM_NAME, _MAX_CLAIM_BYTES, "claim record"))


def claim_problem(store, entries: dict[str, bool]) -> str | None:
    """Why a prefix holding a claim record (and `entries`) may not be replaced, or None: every entry is one the
    record names (an interrupted replacement's old and new objects), or the record itself."""
    try:
        claim = read_claim(store)
    except (OSError, ValueError, RecursionError) as e:  # CheckpointError is a ValueError
        return f"its {CLAIM_NAME} cannot be read ({type(e).__name__}: {e})"
    foreign = not_ours(entries, {CLAIM_NAME, *claim.replacing, *claim.new})
    if foreign:
        return (f"it holds an interrupted replacement ({CLAIM_NAME}) but also {some(foreign)}, which that "
                "replacement did not name")
    return None
