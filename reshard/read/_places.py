"""Where a source or an output is, as the store holding it sees it: one place, however it is spelled.

`write`, `merge` and mesh to mesh compare OUT or DEST with every source here and nowhere else (`refuse_overlap`), and
the bucket output and the S3 source both spell a prefix as `s3_prefix` does, so what is compared is what is read and
written. A refusal costs the user a new name, a wrong "different place" their only copy: where a spelling could mean
either, the comparison says "the same place".

- `s3://bucket/prefix` (or `s3a://`): the bucket and the prefix's segments, empty and `.` segments dropped
  (`s3://b//rs/./x/` is `s3://b/rs/x`), `..` refused; the bucket name folded to lower case (S3 refuses upper case in
  new bucket names) and the endpoint of the AWS environment.
- a local path: the resolved path (links and `..` followed), and the identity (device, inode) of it and of every
  folder above it that exists, so a case-folding file system or a second mount of one folder is the same place too.
- a Hub repo id: the id folded to lower case, as the Hub resolves it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import OutputError, UsageError

_S3_SCHEMES = ("s3://", "s3a://")
REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # what may be a Hub repo id where no such path exists


@dataclass(frozen=True)
class Place:
    """Where a source or an output is.

    Attributes:
        store: what holds it: `local`, `s3 ENDPOINT` or `hub`.
        parts: its path in that store, outermost first (for S3 the bucket, then the prefix's segments).
        ids: for a local path, the (device, inode) of the path and of each folder above it that exists, innermost
            first; empty elsewhere.
        own: for a local path that exists, its own (device, inode); None otherwise.
        spelled: as it was given, for messages.
    """

    store: str
    parts: tuple[str, ...]
    ids: tuple[tuple[int, int], ...] = ()
    own: tuple[int, int] | None = None
    spelled: str = ""

    def holds(self, other: "Place") -> bool:
        """Whether `other` is this place or lies inside it."""
        if self.store != other.store:
            return False
        if other.parts[:len(self.parts)] == self.parts:
            return True
        # the same folder under another spelling (case folded, a bind mount): this place's own identity is
        # `other`'s or that of a folder above it; only a place that exists has one
        return self.own is not None and self.own in other.ids


def s3_prefix(url: str) -> tuple[str, str]:
    """`(bucket, prefix)` of an `s3://` URL as reshard reads and writes it: empty and `.` segments dropped, so
    `s3://b//rs/` is bucket `b`, prefix `rs`; the prefix may be empty (a whole bucket).

    Raises:
        UsageError: a `..` segment (S3 keys do not go up; reshard will not guess which prefix is meant).
    """
    bucket, _, rest = url.split("://", 1)[1].partition("/")
    segments = [s for s in rest.split("/") if s not in ("", ".")]
    if ".." in segments:
        raise UsageError(f"{url}: a prefix with `..` is ambiguous in a bucket (S3 keys do not go up a level). Spell "
                         "the prefix without it. Nothing was read or written.")
    return bucket, "/".join(segments)


def _s3_endpoint() -> str:
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or "aws"


def _local_ids(path: Path) -> tuple[tuple[int, int], ...]:
    """The (device, inode) of `path` and of each folder above it that exists, innermost first."""
    ids = []
    for folder in (path, *path.parents):
        try:
            st = os.stat(folder)
        except OSError:
            continue
        ids.append((st.st_dev, st.st_ino))
    return tuple(ids)


def local_place(path) -> Place:
    """The place of a local path (it need not exist yet)."""
    resolved = Path(os.fspath(path)).resolve()  # links first, then `..`: `link/..` is the link target's parent
    ids = _local_ids(resolved)
    return Place("local", resolved.parts, ids, ids[0] if os.path.exists(resolved) else None, os.fspath(path))


def place_of(spec, *, output: bool = False) -> Place:
    """The place `spec` names: an `s3://` URL, a local path, or (`output` False: a source) a Hub repo id, which is
    what a source spelled `org/name` is where no such path exists (as `reshard.read.locate` reads it).

    Raises:
        UsageError: an S3 prefix with `..`; an output that is a whole bucket.
    """
    spec = os.fspath(spec)
    if spec.startswith(_S3_SCHEMES):
        bucket, prefix = s3_prefix(spec)
        if output and not (bucket and prefix):
            raise UsageError(f"{spec}: an output in a bucket is a prefix, s3://bucket/prefix, not a whole bucket. "
                             "Nothing was read or written.")
        return Place(f"s3 {_s3_endpoint()}", (bucket.lower(), *(prefix.split("/") if prefix else ())),
                     spelled=spec)
    if not output and REPO_ID.match(spec) and not os.path.exists(spec):
        return Place("hub", tuple(spec.lower().split("/")), spelled=spec)
    return local_place(spec)


def refuse_overlap(out, what: str, sources) -> None:
    """Refuse an output that is one of `sources` or lies inside one, or holds one: replacing it would delete them.

    Args:
        out: the output (OUT or DEST), as given.
        what: its name in messages (`OUT`, `DEST`).
        sources: `(name, spec or Place)` pairs (`SRC`, `--extras-from`); a None spec is skipped.

    Raises:
        OutputError: they overlap; nothing was changed.
    """
    here = out if isinstance(out, Place) else place_of(out, output=True)
    for name, source in sources:
        if source is None:
            continue
        there = source if isinstance(source, Place) else place_of(source)
        if here.holds(there) or there.holds(here):
            relation = "is" if here.holds(there) and there.holds(here) else (
                "holds" if here.holds(there) else "is inside")
            raise OutputError(f"{what} {here.spelled} {relation} {name} {there.spelled} (compared as places in "
                              f"{_store_name(here.store)}, whatever the spelling); writing there would replace "
                              f"that source. Nothing was changed. Choose another {what}.")


def _store_name(store: str) -> str:
    if store == "local":
        return "the file system"
    return "the Hub" if store == "hub" else f"S3 ({store.split(' ', 1)[1]})"
