"""What a source holds, as a write's identity records it: per weight file its name, size, header digest and a tag of
its data, from which `reshard.manifest.build_manifest` derives the write's id (`write_id` in `reshard.json`).

A tag must be the same for two copies of one file on different machines and differ for another file of the same
shapes (a checkpoint replaced by the next step's), without reading the whole file: a node's `write --ranks` reads
only its share. A reshard folder's manifest records each file's CRC-32: that is the tag. Any other file is sampled:
the CRC-32 of `SAMPLES` blocks of `SAMPLE_BYTES` spread evenly over its data (first and last included), a few
kilobytes per file. Training changes every weight, so a sample tells two steps apart; an edit of a few bytes between
the samples is not seen (docs/format.md says so).
"""

from __future__ import annotations

import zlib
from concurrent.futures import ThreadPoolExecutor

SAMPLES, SAMPLE_BYTES = 4, 4096
_REMOTE_THREADS = 8  # a remote store's samples: a request each, so files are sampled concurrently


def sampled_crc(store, name: str, data_start: int, size: int) -> str:
    """`sample:` and the CRC-32 of `SAMPLES` blocks spread over `name`'s bytes from `data_start` to `size`."""
    span = max(size - data_start, 0)
    block = min(SAMPLE_BYTES, span)
    starts = sorted({data_start + (span - block) * k // max(SAMPLES - 1, 1) for k in range(SAMPLES)}) if block else []
    crc = 0
    for start in starts:
        crc = zlib.crc32(store.read(name, start, block), crc)
    return f"sample:{crc:08x}"


def content_tags(index) -> list[list]:
    """`[name, size, header digest, tag]` for each weight file of `index` (a `CheckpointIndex`), in name order. A store
    that knows a file's tag (a node's listing of another node's file, `reshard.write._peers.PeerStore`) gives it."""
    store, recorded = index.store, index.crc32 or {}
    known = getattr(store, "content_tag", None)

    def tag(header) -> str:
        if header.name in recorded:
            return f"crc32:{recorded[header.name]}"
        if known is not None and (found := known(header.name)) is not None:
            return found
        return sampled_crc(store, header.name, header.header_bytes, store.size(header.name))

    headers = sorted(index.files, key=lambda h: h.name)
    if getattr(store, "remote", False) and len(headers) > 1:
        with ThreadPoolExecutor(_REMOTE_THREADS) as pool:
            tags = list(pool.map(tag, headers))
    else:
        tags = [tag(h) for h in headers]
    return [[h.name, store.size(h.name), h.digest, t] for h, t in zip(headers, tags)]
