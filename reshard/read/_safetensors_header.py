"""A safetensors file's header: read, parsed and validated before any of its data is trusted or read.

The header is the 8-byte length prefix and the JSON after it: each tensor's dtype, shape and byte offsets. Every
entry is checked (a known byte-sized dtype, offsets that hold exactly its bytes, no overlap, nothing past the end of
the file), so a corrupt or hostile file is refused with its name here, and the byte runs built on the entries are
sound. `header_of` reads one from any `Store` in at most two requests; `reshard.read._checkpoint` reads a whole
checkpoint's.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from dataclasses import dataclass, replace
from pathlib import Path

from ..errors import CheckpointError
from ..plan import DTYPE_BITS
from ._store import HEADER_PROBE

# safetensors refuses headers over 100 MB; a longer length prefix means a corrupt or foreign file.
MAX_HEADER_BYTES = 100_000_000


@dataclass(frozen=True)
class TensorEntry:
    """One tensor as its file's header describes it.

    Attributes:
        name: the on-disk key.
        file: the file name, relative to the checkpoint root.
        dtype: the safetensors dtype string, e.g. `BF16`.
        shape: the tensor's shape.
        data_start: absolute byte offset of the first element in the file (header included).
    """

    name: str
    file: str
    dtype: str
    shape: tuple[int, ...]
    data_start: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_BITS[self.dtype] // 8

    @property
    def itemsize(self) -> int:
        return DTYPE_BITS[self.dtype] // 8


@dataclass(frozen=True)
class FileHeader:
    """A parsed safetensors header: where the data starts, its tensors and its `__metadata__`."""

    name: str
    size: int | None
    header_bytes: int
    metadata: dict[str, str]
    tensors: tuple[TensorEntry, ...]
    digest: str



def json_document(raw, what: str, remedy: str, *, path: str):
    """`json.loads(raw)`, every failure a `CheckpointError` saying `what` is wrong and `remedy`.

    Nesting is bounded by the parser's own recursion limit: a header nested 200,000 deep (a safetensors header is 3
    deep) is refused with this error, not a `RecursionError` traceback.
    """
    try:
        return json.loads(raw, parse_constant=_not_a_number)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{what} is not valid JSON ({e}); {remedy}.", path=path) from e
    except ValueError as e:  # NaN, Infinity: Python reads them, JSON has no such numbers
        raise CheckpointError(f"{what} holds {e}, which is no JSON number; {remedy}.", path=path) from e
    except RecursionError as e:
        raise CheckpointError(f"{what} is JSON nested deeper than reshard reads (a safetensors header or config is "
                              f"nested a few levels); {remedy}.", path=path) from e


def _not_a_number(constant: str):
    raise ValueError(constant)



def _check_dtype(dtype, *, file: str, name: str) -> None:
    """Refuse a dtype reshard cannot copy: unknown to safetensors, or packed several elements to a byte.

    A sub-byte element (F4, F6_*) has no byte offset of its own, so a chunk boundary can fall inside a byte and
    the byte runs `write` copies would not add up to what a header claims.
    """
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        raise CheckpointError(f"{file}: entry {name!r} has dtype {dtype!r}, which safetensors does not know "
                              f"(known: {', '.join(sorted(DTYPE_BITS))}).", path=file)
    if DTYPE_BITS[dtype] < 8:
        raise CheckpointError(f"{file}: entry {name!r} has dtype {dtype} ({DTYPE_BITS[dtype]} bits per element); "
                              "reshard cannot split sub-byte packed tensors. Store it packed in a byte-sized dtype "
                              "(U8 blocks and scales, as MXFP4 checkpoints do) or dequantize it first.", path=file)


def parse_header(raw: bytes, *, file: str, file_size: int | None) -> FileHeader:
    """Parse and validate a safetensors header (the bytes after the 8-byte length prefix).

    Args:
        raw: the JSON header bytes.
        file: the file name, for messages and for the entries.
        file_size: the file's size in bytes, to check the offsets against; None when unknown (remote header).

    Returns:
        A `FileHeader` whose tensors are sorted by data offset.

    Raises:
        CheckpointError: malformed JSON, an unknown or sub-byte dtype, offsets that disagree with shapes, overlap,
            or the size.
    """
    data_start = 8 + len(raw)
    if len(raw) > MAX_HEADER_BYTES:  # read_header never passes more; other callers (the reader) are held to it too
        raise CheckpointError(f"{file}: the safetensors header has {len(raw)} bytes, over the {MAX_HEADER_BYTES}-byte "
                              "cap safetensors allows; it is corrupt or not a safetensors file.", path=file)
    header = json_document(raw, f"{file}: the safetensors header", "the file is corrupt, download or copy it again",
                           path=file)
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: the safetensors header is not a JSON object; the file is corrupt.", path=file)
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(f"{file}: the header's __metadata__ is not a string-to-string map; the file is corrupt.",
                              path=file)
    entries = [_entry(name, info, file, data_start) for name, info in header.items()]
    entries.sort(key=lambda t: t.data_start)
    cursor = data_start
    for entry in entries:
        if entry.data_start < cursor:
            raise CheckpointError(f"{file}: entry {entry.name!r} overlaps the previous tensor; the file is corrupt.",
                                  path=file)
        cursor = entry.data_start + entry.nbytes
    if file_size is not None and cursor > file_size:
        raise CheckpointError(f"{file}: the header describes {cursor} bytes but the file has {file_size}; the file "
                              "is truncated, download or copy it again.", path=file)
    return FileHeader(file, file_size, data_start, dict(metadata), tuple(entries), hashlib.sha256(raw).hexdigest())


def _entry(name: str, info, file: str, data_start: int) -> TensorEntry:
    """One header entry, checked: a known byte-sized dtype, natural sizes, and offsets that hold exactly its bytes."""
    try:
        dtype, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{file}: entry {name!r} lacks dtype, shape or data_offsets; the file is corrupt.",
                              path=file) from e
    _check_dtype(dtype, file=file, name=name)
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in (*shape, begin, end)) or begin > end:
        raise CheckpointError(f"{file}: entry {name!r} has shape {list(shape)} and offsets [{begin}, {end}], "
                              "which are not valid.", path=file)
    expected = math.ceil(math.prod(shape) * DTYPE_BITS[dtype] / 8)
    if end - begin != expected:
        raise CheckpointError(f"{file}: entry {name!r} holds {end - begin} bytes but {dtype} {list(shape)} needs "
                              f"{expected}; the file is corrupt.", path=file)
    return TensorEntry(name, file, dtype, shape, data_start + begin)


def header_of(store, name: str, *, exact: bool = False) -> FileHeader:
    """Read and validate the header of safetensors file `name` of `store`: at most two requests. Remote, the first
    `HEADER_PROBE` bytes hold the length prefix and almost always the whole header (a longer header takes one more);
    local, or `exact` (a file whose data is read next in ranges of its own: a rank's file before a load), the prefix
    and then exactly the header, never a byte of data.

    Raises:
        CheckpointError: the file is missing, truncated, not safetensors, or its header is malformed.
    """
    where = store.url(name)
    try:
        size = store.size(name)
        if size < 8:
            raise CheckpointError(f"{name}: the file has {size} bytes, too few for a safetensors header; it is "
                                  "truncated or not a safetensors file.", path=where)
        head = store.read(name, 0, min(size, HEADER_PROBE if store.remote and not exact else 8))
        (length,) = struct.unpack("<Q", head[:8])
        if length > MAX_HEADER_BYTES:
            raise CheckpointError(f"{name}: the header length prefix says {length} bytes, over the {MAX_HEADER_BYTES}"
                                  "-byte cap safetensors allows; it is corrupt or not a safetensors file.", path=where)
        if 8 + length > size:
            raise CheckpointError(f"{name}: the header length prefix says {length} bytes but the file has {size}; it "
                                  "is truncated or not a safetensors file.", path=where)
        raw = head[8:8 + length]
        if len(raw) < length:
            raw += store.read(name, len(head), length - len(raw))
    except FileNotFoundError as e:
        raise CheckpointError(f"{name}: missing ({where}). Copy or download it again.", path=where) from e
    except OSError as e:
        raise CheckpointError(f"{name}: cannot read ({e.strerror or e}).", path=where) from e
    return parse_header(raw, file=name, file_size=size)


def read_header(path: Path, *, name: str | None = None) -> FileHeader:
    """`header_of` for one local file (links followed: the caller decided the file is to be read)."""
    from ._store import LocalStore

    path = Path(path)
    store = LocalStore(path.parent, links_anywhere=True)
    try:
        header = header_of(store, path.name)
    finally:
        store.close()
    return header if name is None or name == path.name else replace(header, name=name, tensors=tuple(
        replace(t, file=name) for t in header.tensors))
