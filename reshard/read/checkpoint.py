"""Read a checkpoint's metadata: `config.json`, the safetensors index and every file's header, never tensor data.

A source is a local folder, a single `.safetensors` file, or a Hub repo id (`org/name`). Hub sources go through
huggingface-hub, so its cache and `HF_HUB_OFFLINE` are honoured; headers of files that are not cached are fetched
with HTTP range requests (`HfApi.get_safetensors_metadata`), so planning a 665 GiB checkpoint downloads kilobytes.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import struct
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path

from ..errors import CheckpointError
from ..plan.dtypes import DTYPE_BITS
from .regular import json_document, open_regular, read_regular_text

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# safetensors refuses headers over 100 MB; a longer length prefix means a corrupt or foreign file.
MAX_HEADER_BYTES = 100_000_000

# The torch dtype of each safetensors dtype torch can hold, by attribute name (a torch without one gets None).
TORCH_DTYPE_NAMES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64", "I8": "int8",
                     "U8": "uint8", "I16": "int16", "I32": "int32", "I64": "int64", "BOOL": "bool",
                     "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")

# Non-weight files `write` copies (and fetches from the Hub): config, generation config, tokenizer and chat-template
# files, docs and licence, at the top level only. Anything else could be a second copy of the weights: a `git clone`
# of a Hub repo keeps one in `.git/lfs/objects`, many repos add `original/` or `consolidated.*` for other runtimes.
METADATA_PATTERNS = ("*.json", "*.txt", "*.model", "*.py", "*.jinja", "*.md", "*.tiktoken", "tokenizer*", "vocab*",
                     "merges*", "LICENSE*", "LICENCE*", "NOTICE*")
NEVER_COPIED = (".*", "*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf", "*.ckpt", "*.h5", "*.msgpack", "*.onnx",
                "consolidated.*", "*.index.json")  # an index would name weight files OUT does not hold
# Hub paths never downloaded: fnmatch's `*` crosses `/`, so `*/*` keeps the download at the top level.
HUB_IGNORE = ("*/*", "original/*", ".*", "*.pth", "*.pt", "*.bin", "*.gguf", "consolidated.*")


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
        source: what the user passed (a path or a repo id).
        revision: the Hub revision, or None for local sources.
        root: the local folder holding the files, or None when only remote headers were read.
        config: the parsed `config.json` (empty for a bare `.safetensors` file).
        files: the headers, in file-name order.
        tensors: every tensor by on-disk key.
        other_files: top-level non-weight files to copy as they are (config, tokenizer, ...; see
            `METADATA_PATTERNS`), relative to root.
        quantization: set on the bf16 view of a quantized checkpoint (`reshard.read.quant.dequantized_view`): which of
            `tensors` are computed from quantized pairs. None for a checkpoint read as it is.
    """

    source: str
    revision: str | None
    root: Path | None
    config: dict
    files: tuple[FileHeader, ...]
    tensors: dict[str, TensorEntry] = field(repr=False)
    other_files: tuple[str, ...] = ()
    quantization: object = None  # reshard.read.quant.Quantization (kept untyped: quant imports this module)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def on_disk_layout(self, layout) -> dict | None:
        """Per in-memory tensor of `layout` (a `ModelLayout` of this checkpoint), the on-disk keys that make it, each
        as (key, offset, stacked dim, shape): what the manifest records for `merge --layout original`. A source that
        does not know it (a folder in the distributed-checkpoint layout may not) returns None."""
        return {t.name: [(p.source, p.offset, p.stacked_dim, self.tensors[p.source].shape) for p in t.pieces]
                for t in layout.tensors}

    def path_of(self, file: str) -> Path:
        if self.root is None:
            raise CheckpointError(
                f"{self.source}: only the headers are available (the files are not downloaded). Run "
                f"`hf download {self.source}` first, or pass a local folder.",
                path=self.source,
            )
        return self.root / file


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
    entries = []
    for name, info in header.items():
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{file}: entry {name!r} lacks dtype, shape or data_offsets; the file is corrupt.",
                                  path=file) from e
        check_dtype(dtype, file=file, name=name)
        ints = (*shape, begin, end)
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in ints) or begin > end:
            raise CheckpointError(f"{file}: entry {name!r} has shape {list(shape)} and offsets [{begin}, {end}], "
                                  "which are not valid.", path=file)
        expected = math.ceil(math.prod(shape) * DTYPE_BITS[dtype] / 8)
        if end - begin != expected:
            raise CheckpointError(f"{file}: entry {name!r} holds {end - begin} bytes but {dtype} {list(shape)} needs "
                                  f"{expected}; the file is corrupt.", path=file)
        entries.append(TensorEntry(name, file, dtype, shape, data_start + begin))
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


def read_header(path: Path, *, name: str | None = None) -> FileHeader:
    """Read and validate the header of a local safetensors file (at most `MAX_HEADER_BYTES` are read)."""
    name = name or path.name
    try:
        size = path.stat().st_size
        with open_regular(path, name) as f:  # unbuffered: read the header and not a byte of data
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"{name}: the file has {size} bytes, too few for a safetensors header; it is "
                                      "truncated or not a safetensors file.", path=str(path))
            (length,) = struct.unpack("<Q", prefix)
            if length > MAX_HEADER_BYTES:
                raise CheckpointError(f"{name}: the header length prefix says {length} bytes, over the "
                                      f"{MAX_HEADER_BYTES}-byte cap safetensors allows; it is corrupt or not a "
                                      "safetensors file.", path=str(path))
            if 8 + length > size:
                raise CheckpointError(f"{name}: the header length prefix says {length} bytes but the file has {size}; "
                                      "it is truncated or not a safetensors file.", path=str(path))
            raw = f.read(length)
            while len(raw) < length and (more := f.read(length - len(raw))):
                raw += more
    except OSError as e:
        raise CheckpointError(f"{name}: cannot read ({e.strerror or e}).", path=str(path)) from e
    return parse_header(raw, file=name, file_size=size)


def is_metadata_file(name: str) -> bool:
    """Whether a top-level file named `name` is copied into a written folder (see `METADATA_PATTERNS`)."""
    return (any(fnmatchcase(name, p) for p in METADATA_PATTERNS)
            and not any(fnmatchcase(name, p) for p in NEVER_COPIED))


def _inside(root: Path, path: Path) -> bool:
    try:
        path.resolve().relative_to(root.resolve())
    except ValueError:
        return False
    return True


def _checked_file_names(root: Path, index_path: Path, link_root: Path) -> tuple[list[str], dict[str, str]]:
    """Validate `model.safetensors.index.json` before trusting any name in it (links must stay in `link_root`)."""
    try:
        index = json_document(read_regular_text(index_path, index_path.name),
                              f"{index_path.name}: not a valid safetensors index: it", "download or copy it again",
                              path=str(index_path))
        weight_map = index["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
    except (OSError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index_path.name}: not a valid safetensors index ({e}).", path=str(index_path)) from e
    first_key: dict = {}
    for key, name in weight_map.items():
        if not isinstance(name, str):
            raise CheckpointError(f"{index_path.name}: entry {key!r} -> {name!r}: not a file name.",
                                  path=str(index_path))
        first_key.setdefault(name, key)
    for name, key in first_key.items():  # each file once: an index lists ~500 keys per file
        where = f"{index_path.name}: entry {key!r} -> {name!r}"
        if not name.endswith(".safetensors"):
            raise CheckpointError(f"{where}: only .safetensors files are supported (convert .bin checkpoints with "
                                  "transformers' save_pretrained first).", path=str(index_path))
        if os.path.isabs(name) or ".." in Path(name).parts:
            raise CheckpointError(f"{where}: the path leaves the checkpoint folder; refusing it. Fix the index.",
                                  path=str(index_path))
        if not (root / name).exists():
            raise CheckpointError(f"{where}: the file does not exist. Download or copy the missing shard.",
                                  path=str(root / name))
        if not _inside(link_root, root / name):
            raise CheckpointError(f"{where}: the file is a link out of the checkpoint folder; refusing it.",
                                  path=str(root / name))
    return sorted(set(weight_map.values())), weight_map


def read_config(root: Path) -> dict:
    """`root/config.json` as a dict ({} when there is none)."""
    path = root / "config.json"
    if not path.exists():
        return {}
    try:
        text = read_regular_text(path, "config.json")
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"config.json: cannot be read ({e}).", path=str(path)) from e
    config = json_document(text, "config.json", "fix or replace it", path=str(path))
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: config.json is not a JSON object.", path=str(path))
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


def read_local(path: Path, *, source: str | None = None, revision: str | None = None,
               link_root: Path | None = None) -> CheckpointIndex:
    """Read a local folder (with or without an index) or a single `.safetensors` file.

    Weight files that are links must resolve inside `link_root` (default: the folder itself; a Hub cache snapshot
    links into its repo's `blobs/`).
    """
    path = Path(path)
    source = source or str(path)
    link_root = Path(link_root) if link_root is not None else path
    if path.is_file():
        if path.suffix != ".safetensors":
            raise CheckpointError(f"{path}: not a .safetensors file.", path=str(path))
        header = read_header(path)
        return CheckpointIndex(source, revision, path.parent, read_config(path.parent), (header,),
                               _index_tensors([header], None, str(path)))
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such file or folder. Pass a checkpoint folder, a .safetensors file or a "
                              "Hub repo id (org/name).", path=str(path))
    index_path = path / INDEX_NAME
    weight_map = None
    if index_path.exists():
        names, weight_map = _checked_file_names(path, index_path, link_root)
    else:
        # `consolidated.safetensors` (Mistral's own format) repeats the weights under other names
        names = sorted(p.name for p in path.glob("*.safetensors")
                       if not p.name.startswith(("shard-", "consolidated.")))
        for name in names:
            if not _inside(link_root, path / name):
                raise CheckpointError(f"{name}: the file is a link out of the checkpoint folder; refusing it.",
                                      path=str(path / name))
    if not names:
        raise CheckpointError(f"{path}: no .safetensors files and no {INDEX_NAME}. Is this a checkpoint folder?",
                              path=str(path))
    headers = [read_header(path / name, name=name) for name in names]
    weight_names = set(names)
    others = copied_files(path, weight_names, link_root)
    return CheckpointIndex(source, revision, path, read_config(path), tuple(headers),
                           _index_tensors(headers, weight_map, str(path)), others)


def copied_files(path: Path, skip: set[str], link_root: Path | None = None) -> tuple[str, ...]:
    """The top-level non-weight files of `path` a write copies as they are (config, tokenizer, ...), sorted.

    The rule weights follow holds for them too: a file that is a link must resolve inside `link_root` (default the
    folder), or the write would copy a file from outside the source into OUT.

    Raises:
        CheckpointError: such a file is a link out of the folder (nothing was read or changed).
    """
    names = sorted(p.name for p in path.iterdir() if p.name not in skip and is_metadata_file(p.name) and p.is_file())
    for name in names:
        if not _inside(link_root or path, path / name):
            raise CheckpointError(f"{name}: a link out of the checkpoint folder (to {(path / name).resolve()}); "
                                  "reshard copies only files inside it. Copy the file in, or remove the link. "
                                  "Nothing was read or changed.", path=str(path / name))
    return tuple(names)


def looks_like_repo_id(source: str) -> bool:
    return bool(_REPO_ID.match(source)) and not os.path.exists(source)


def read_checkpoint(source: str | os.PathLike, *, revision: str | None = None, need_data: bool = False) -> CheckpointIndex:
    """Read a checkpoint's metadata from a local path or a Hub repo id.

    Args:
        source: a folder, a `.safetensors` file, or `org/name` on the Hub.
        revision: a Hub branch, tag or commit (Hub sources only).
        need_data: also download the tensor files (for `write`); `plan` reads headers only.

    Returns:
        A `CheckpointIndex`.

    Raises:
        CheckpointError: the source is missing, unreachable (offline and not cached), or malformed.

    Example:
        >>> index = read_checkpoint("Qwen/Qwen3-30B-A3B")  # doctest: +SKIP
        >>> index.config["model_type"]  # doctest: +SKIP
        'qwen3_moe'
    """
    source = os.fspath(source)
    if not looks_like_repo_id(source):
        return read_local(Path(source), revision=revision)
    return _read_hub(source, revision=revision, need_data=need_data)


def _read_hub(repo_id: str, *, revision: str | None, need_data: bool) -> CheckpointIndex:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    try:
        # the metadata first (the index among it), then only the weight files the index names: never a repo's
        # `original/`, `*.pth` or `consolidated.*` copies of the same weights
        root = Path(snapshot_download(repo_id, revision=revision, allow_patterns=list(METADATA_PATTERNS),
                                      ignore_patterns=list(HUB_IGNORE)))
        if need_data:
            weights = _hub_weight_names(root)
            pinned = root.name if root.parent.name == "snapshots" else revision  # the commit the index came from
            ignore = [p for p in HUB_IGNORE if p != "*/*" or not any("/" in w for w in weights)]
            root = Path(snapshot_download(repo_id, revision=pinned, allow_patterns=[*METADATA_PATTERNS, *weights],
                                          ignore_patterns=ignore))
    except (LocalEntryNotFoundError, FileNotFoundError) as e:
        # huggingface_hub refuses a partly cached snapshot the same way as a missing one
        hint = ("HF_HUB_OFFLINE is set and the repo is not in the local cache (or only some of the files it needs are)"
                if offline else "it could not be reached and is not in the local cache")
        raise CheckpointError(f"{repo_id}: no local folder of that name, and as a Hub repo id {hint}. Check the "
                              f"path, download it once with network access (`hf download {repo_id}`), or pass a "
                              "local folder.", path=repo_id) from e
    except (RepositoryNotFoundError, HfHubHTTPError, OSError) as e:
        raise CheckpointError(f"{repo_id}: cannot fetch from the Hub ({e}). Check the repo id and --revision, "
                              "or pass a local folder.", path=repo_id) from e
    cached = list(root.glob("*.safetensors"))
    if need_data and not cached:
        why = ("HF_HUB_OFFLINE is set, so only what is already cached can be used" if offline
               else "the repo may hold no safetensors weights")
        raise CheckpointError(f"{repo_id}: the snapshot at {root} holds no .safetensors files ({why}). Download "
                              f"them with `hf download {repo_id}`, or pass a local folder.", path=repo_id)
    if need_data or cached:
        # the cache's snapshots/<commit>/ files are links to ../../blobs/: allow links inside the repo's cache folder
        link_root = root.parents[1] if root.parent.name == "snapshots" else root
        return read_local(root, source=repo_id, revision=revision, link_root=link_root)
    return _read_remote_headers(repo_id, revision, root)


def _hub_weight_names(root: Path) -> list[str]:
    """The weight files a Hub snapshot needs: those its index names, or the top-level `*.safetensors` without one.

    An invalid index yields no names; `read_local` then reports it.
    """
    if not (root / INDEX_NAME).exists():
        return ["*.safetensors"]
    try:
        weight_map = json.loads((root / INDEX_NAME).read_text())["weight_map"]
        names = {name for name in weight_map.values() if isinstance(name, str)}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []
    return sorted(re.sub(r"([*?[])", r"[\1]", name) for name in names)  # exact names, not patterns


def _read_remote_headers(repo_id: str, revision: str | None, root: Path) -> CheckpointIndex:
    """Headers of Hub files not in the cache, fetched with range requests (no tensor data)."""
    from huggingface_hub import HfApi

    try:
        meta = HfApi().get_safetensors_metadata(repo_id, revision=revision)
    except Exception as e:  # huggingface-hub raises several unrelated types here
        raise CheckpointError(f"{repo_id}: cannot read the safetensors headers from the Hub ({e}).",
                              path=repo_id) from e
    headers = []
    for name, file_meta in sorted(meta.files_metadata.items()):
        entries = []
        for key, info in file_meta.tensors.items():
            check_dtype(info.dtype, file=name, name=key)
            begin, _ = info.data_offsets
            entries.append(TensorEntry(key, name, info.dtype, tuple(info.shape), begin))
        headers.append(FileHeader(name, None, 0, dict(file_meta.metadata or {}), tuple(entries), ""))
    return CheckpointIndex(repo_id, revision, None, read_config(root), tuple(headers),
                           _index_tensors(headers, None, repo_id))
