"""A checkpoint's metadata: `config.json`, the safetensors index and every file's header, never tensor data.

Everything is read from the source's `Store` (`reshard.read.store`: a local folder, a cache snapshot, the Hub or S3),
so a header costs one or two small requests wherever the files are: planning a 665 GiB checkpoint reads kilobytes.
Which kind of source a path or URL is, and which store serves it, is decided once, in `reshard.read.source`.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from dataclasses import dataclass, field, replace
from fnmatch import fnmatchcase
from pathlib import Path, PurePosixPath

from ..errors import CheckpointError
from ..plan.dtypes import DTYPE_BITS
from .store import HEADER_PROBE

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# safetensors refuses headers over 100 MB; a longer length prefix means a corrupt or foreign file.
MAX_HEADER_BYTES = 100_000_000

# The torch dtype of each safetensors dtype torch can hold, by attribute name (a torch without one gets None).
TORCH_DTYPE_NAMES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64", "I8": "int8",
                     "U8": "uint8", "I16": "int16", "I32": "int32", "I64": "int64", "BOOL": "bool",
                     "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}

# Non-weight files `write` copies (and fetches from the Hub): config, generation config, tokenizer and chat-template
# files, docs and licence, at the top level only. Anything else could be a second copy of the weights: a `git clone`
# of a Hub repo keeps one in `.git/lfs/objects`, many repos add `original/` or `consolidated.*` for other runtimes.
METADATA_PATTERNS = ("*.json", "*.txt", "*.model", "*.py", "*.jinja", "*.md", "*.tiktoken", "tokenizer*", "vocab*",
                     "merges*", "LICENSE*", "LICENCE*", "NOTICE*")
NEVER_COPIED = (".*", "*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf", "*.ckpt", "*.h5", "*.msgpack", "*.onnx",
                "consolidated.*", "*.index.json")  # an index would name weight files OUT does not hold


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


@dataclass(frozen=True)
class CheckpointIndex:
    """Everything `plan` needs to know about a checkpoint, read from metadata only.

    Attributes:
        source: what the user passed (a path, a repo id, a URL).
        revision: the Hub revision, or None for other sources.
        store: where the files are (`reshard.read.store`): every byte of the source is read through it.
        config: the parsed `config.json` (empty for a bare `.safetensors` file).
        files: the headers, in file-name order.
        tensors: every tensor by on-disk key.
        other_files: top-level non-weight files to copy as they are (config, tokenizer, ...; see
            `METADATA_PATTERNS`).
        quantization: set on the bf16 view of a quantized checkpoint (`reshard.read.quant.dequantized_view`): which of
            `tensors` are computed from quantized pairs. None for a checkpoint read as it is.
    """

    source: str
    revision: str | None
    store: object  # reshard.read.store.Store
    config: dict
    files: tuple[FileHeader, ...]
    tensors: dict[str, TensorEntry] = field(repr=False)
    other_files: tuple[str, ...] = ()
    quantization: object = None  # reshard.read.quant.Quantization (kept untyped: quant imports this module)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    @property
    def crc32(self) -> dict[str, str] | None:
        """File name -> the CRC-32 the source records for it (a reshard folder's manifest); None: nothing recorded."""
        return None

    @property
    def root(self) -> Path | None:
        """The local folder of the files, or None when they are not on this machine."""
        return getattr(self.store, "root", None)

    def on_disk_layout(self, layout) -> dict | None:
        """Per in-memory tensor of `layout` (a `ModelLayout` of this checkpoint), the on-disk keys that make it, each
        as (key, offset, stacked dim, shape): what the manifest records for `merge --layout original`. A source that
        does not know it (a folder in the distributed-checkpoint layout may not) returns None."""
        return {t.name: [(p.source, p.offset, p.stacked_dim, self.tensors[p.source].shape) for p in t.pieces]
                for t in layout.tensors}

    def path_of(self, file: str) -> Path:
        """The local path of source file `file`: a file copied inside the kernel needs one."""
        path = self.store.local_path(file)
        if path is None:
            raise CheckpointError(f"{self.store.url(file)} is not on this machine.", path=self.source)
        return path


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


def torch_dtype(code: str):
    """The torch dtype of a safetensors dtype code (`BF16` -> torch.bfloat16), or None if this torch has none.
    Imports torch (only then)."""
    import torch

    return getattr(torch, TORCH_DTYPE_NAMES.get(code, ""), None)


def check_dtype(dtype, *, file: str, name: str) -> None:
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
    check_dtype(dtype, file=file, name=name)
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in (*shape, begin, end)) or begin > end:
        raise CheckpointError(f"{file}: entry {name!r} has shape {list(shape)} and offsets [{begin}, {end}], "
                              "which are not valid.", path=file)
    expected = math.ceil(math.prod(shape) * DTYPE_BITS[dtype] / 8)
    if end - begin != expected:
        raise CheckpointError(f"{file}: entry {name!r} holds {end - begin} bytes but {dtype} {list(shape)} needs "
                              f"{expected}; the file is corrupt.", path=file)
    return TensorEntry(name, file, dtype, shape, data_start + begin)


def header_of(store, name: str) -> FileHeader:
    """Read and validate the header of safetensors file `name` of `store`: at most two requests. Remote, the first
    `HEADER_PROBE` bytes hold the length prefix and almost always the whole header (a longer header takes one more);
    local, the prefix and then exactly the header, never a byte of data.

    Raises:
        CheckpointError: the file is missing, truncated, not safetensors, or its header is malformed.
    """
    where = store.url(name)
    try:
        size = store.size(name)
        if size < 8:
            raise CheckpointError(f"{name}: the file has {size} bytes, too few for a safetensors header; it is "
                                  "truncated or not a safetensors file.", path=where)
        head = store.read(name, 0, min(size, HEADER_PROBE if store.remote else 8))  # local: never a byte of data
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
    from .store import LocalStore

    path = Path(path)
    store = LocalStore(path.parent, links_anywhere=True)
    try:
        header = header_of(store, path.name)
    finally:
        store.close()
    return header if name is None or name == path.name else replace(header, name=name, tensors=tuple(
        replace(t, file=name) for t in header.tensors))


def is_metadata_file(name: str) -> bool:
    """Whether a top-level file named `name` is copied into a written folder (see `METADATA_PATTERNS`)."""
    return (any(fnmatchcase(name, p) for p in METADATA_PATTERNS)
            and not any(fnmatchcase(name, p) for p in NEVER_COPIED))


MAX_METADATA_BYTES = 64 << 20  # an index, a config: far above any real one


def weight_names(store, where: str) -> tuple[list[str], dict[str, str] | None]:
    """The safetensors files of a checkpoint: those its index names (validated before any name in it is trusted),
    or, without an index, the top-level `*.safetensors` (not `shard-*` rank files, not `consolidated.*`)."""
    names = store.names()
    if INDEX_NAME not in names:
        # `consolidated.safetensors` (Mistral's own format) repeats the weights under other names
        return [n for n in names if n.endswith(".safetensors") and not n.startswith(("shard-", "consolidated."))], None
    index = json_document(store.read_all(INDEX_NAME, MAX_METADATA_BYTES, "safetensors index"),
                          f"{INDEX_NAME}: not a valid safetensors index: it", "download or copy it again", path=where)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{INDEX_NAME}: not a valid safetensors index (no weight_map object).", path=where)
    first_key: dict = {}
    for key, name in weight_map.items():
        if not isinstance(name, str):
            raise CheckpointError(f"{INDEX_NAME}: entry {key!r} -> {name!r}: not a file name.", path=where)
        first_key.setdefault(name, key)
    for name, key in first_key.items():  # each file once: an index lists ~500 keys per file
        entry = f"{INDEX_NAME}: entry {key!r} -> {name!r}"
        if not name.endswith(".safetensors"):
            raise CheckpointError(f"{entry}: only .safetensors files are supported (convert .bin checkpoints with "
                                  "transformers' save_pretrained first).", path=where)
        if name.startswith("/") or ".." in PurePosixPath(name).parts:
            raise CheckpointError(f"{entry}: the path leaves the checkpoint folder; refusing it. Fix the index.",
                                  path=where)
        try:
            exists = store.exists(name)
        except CheckpointError as e:  # a link out of the folder, a FIFO: say which entry of the index names it
            raise CheckpointError(f"{entry}: {e}", path=store.url(name)) from e
        if not exists:
            raise CheckpointError(f"{entry}: the file does not exist. Download or copy the missing shard.",
                                  path=store.url(name))
    return sorted(first_key), weight_map


def read_config(store) -> dict:
    """`config.json` of `store` as a dict ({} when there is none)."""
    if "config.json" not in store.names():
        return {}
    where = store.url("config.json")
    try:
        text = store.read_all("config.json", MAX_METADATA_BYTES, "config.json")
    except OSError as e:
        raise CheckpointError(f"config.json: cannot be read ({e}).", path=where) from e
    config = json_document(text, "config.json", "fix or replace it", path=where)
    if not isinstance(config, dict):
        raise CheckpointError(f"{where}: config.json is not a JSON object.", path=where)
    return config


def _index_tensors(files: list[FileHeader], weight_map: dict[str, str] | None, where: str) -> dict[str, TensorEntry]:
    tensors: dict[str, TensorEntry] = {}
    for header in files:
        for entry in header.tensors:
            if entry.name in tensors:
                raise CheckpointError(f"{where}: tensor {entry.name!r} appears in both {tensors[entry.name].file} and "
                                      f"{entry.file}.", path=where)
            tensors[entry.name] = entry
    if weight_map is not None:
        for key, name in weight_map.items():
            if key not in tensors or tensors[key].file != name:
                raise CheckpointError(f"{INDEX_NAME}: entry {key!r} says {name!r}, but that file's header does not "
                                      "hold it; the index and the files disagree.", path=where)
    return tensors


def headers_of(store, names: list[str]) -> list[FileHeader]:
    """Every named file's header, in order; a remote store's are fetched 8 at a time (each takes one or two
    requests, and a 700 GB checkpoint has about a hundred files)."""
    if not store.remote:
        return [header_of(store, name) for name in names]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=8, thread_name_prefix="reshard-headers") as pool:
        return list(pool.map(lambda name: header_of(store, name), names))


def checkpoint_index(store, *, source: str, revision: str | None = None, only: str | None = None) -> CheckpointIndex:
    """The `CheckpointIndex` of a checkpoint in `store` (a folder with or without an index): headers, config and the
    files a write copies, read from metadata only. `only`: the one `.safetensors` file given instead of a folder
    (nothing beside it is copied).

    Raises:
        CheckpointError: no weight files, an index that lies or leaves the folder, a malformed header, a special
            file among the metadata files.
    """
    names, weight_map = ([only], None) if only is not None else weight_names(store, source)
    if not names:
        raise CheckpointError(f"{source}: no .safetensors files and no {INDEX_NAME}. Pass a checkpoint folder, a "
                              "Hugging Face cache snapshot, a Hub repo id, an s3:// URL, a reshard folder or a folder "
                              "saved with save_pretrained(..., distributed_checkpoint=True).", path=source)
    headers = headers_of(store, names)
    return CheckpointIndex(source, revision, store, read_config(store), tuple(headers),
                           _index_tensors(headers, weight_map, source),
                           () if only is not None else copied_files(store, set(names)))


def copied_files(store, skip: set[str]) -> tuple[str, ...]:
    """The top-level non-weight files of `store` a write copies as they are (config, tokenizer, ...), sorted.

    Each is checked as a source's files are (a link must stay inside the folder, a FIFO or a device is refused and
    named), so no file is dropped or read from outside the source in silence.

    Raises:
        CheckpointError: such a file is a link out of the folder or not a regular file (nothing was read or changed).
    """
    names = tuple(n for n in store.names() if n not in skip and is_metadata_file(n))
    for name in names:
        store.check_inside(name)  # a link out of the folder
        store.size(name)  # a FIFO, a device
    return names
