"""The source's on-disk layout as `reshard.json` records it (`source_layout`), for `reshard merge --layout original`.

Which on-disk keys of the checkpoint a folder was written from, at which offsets, make each in-memory tensor: one
compact JSON string per key (key, offset, stacked dim, shape), so the record is linear in the on-disk keys. It is
written and parsed here, beside the rest of the manifest.
"""

from __future__ import annotations

import json

from ..errors import ManifestError

SOURCE_LAYOUT_VERSION = 1

# One on-disk key of the source checkpoint inside an in-memory tensor: (key, offset, stacked_dim, shape).
OnDisk = tuple[str, tuple[int, ...], "int | None", tuple[int, ...]]


def _format_on_disk(piece: OnDisk) -> str:
    key, offset, stacked, shape = piece
    return json.dumps([key, list(offset), stacked, list(shape)], separators=(",", ":"))


def _parse_on_disk(text: str) -> OnDisk:
    key, offset, stacked, shape = json.loads(text)
    return key, tuple(offset), stacked, tuple(shape)


def source_layout_record(layout, index) -> dict | None:
    """What `reshard.json` records of the source's on-disk layout (`source_layout`), for `merge --layout original`.

    What the source knows of it (`index.on_disk_layout(layout)`: a checkpoint's keys as `layout` places them; for a
    source in the distributed-checkpoint layout, a reshard folder's record or a saved folder's reverse conversion),
    one compact JSON string per on-disk key; None when that is unknown.
    """
    tensors = index.on_disk_layout(layout)
    if tensors is None:
        return None
    return {"version": SOURCE_LAYOUT_VERSION,
            "tensors": {name: [_format_on_disk(p) for p in pieces] for name, pieces in tensors.items()}}


def recorded_source_layout(data: dict, source: str) -> tuple[dict | None, str | None]:
    """The on-disk layout a manifest document records (per in-memory tensor, its `OnDisk` tuples), or None and why:
    a folder written before it was recorded, or a record of another version.

    Raises:
        ManifestError: a record that is not (key, offset, stacked dim, shape).
    """
    record = data.get("source_layout")
    if not record:
        return None, (f"{source} was written by `reshard write` before reshard recorded the source's "
                      "on-disk layout in reshard.json; use --layout fused, or write the folder again with this reshard")
    if record.get("version") != SOURCE_LAYOUT_VERSION:
        return None, (f"reshard.json records the source layout in version {record.get('version')}, this reshard reads "
                      f"{SOURCE_LAYOUT_VERSION}; use --layout fused or upgrade reshard")
    try:
        return {name: [_parse_on_disk(text) for text in pieces] for name, pieces in record["tensors"].items()}, None
    except (KeyError, TypeError, ValueError, AttributeError, RecursionError) as e:
        raise ManifestError([f"reshard.json: source_layout.tensors holds a record that is not (key, offset, stacked "
                             f"dim, shape) ({type(e).__name__}: {str(e)[:120]}). Merge with --layout fused, or "
                             "write the folder again. Nothing was written."]) from e


def tied_from_record(original: dict | None) -> tuple[str, ...]:
    """In-memory tensors built from exactly the on-disk keys of another one: tied copies (`lm_head` tied to the
    embeddings), which a checkpoint stores once. Of each such group the one the checkpoint names is kept (else the
    first). `original` maps each tensor to its on-disk pieces, the key first in each."""
    if not original:
        return ()
    groups: dict[frozenset, list[str]] = {}
    for name, pieces in original.items():
        groups.setdefault(frozenset(p[0] for p in pieces), []).append(name)
    tied = []
    for keys, names in groups.items():
        if len(names) > 1:
            keep = next((n for n in names if n in keys), names[0])
            tied += [n for n in names if n != keep]
    return tuple(tied)
