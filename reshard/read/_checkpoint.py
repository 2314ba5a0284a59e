"""A checkpoint's metadata: `config.json`, the safetensors index and every file's header, never tensor data.

Each header is read and checked by `reshard.read._safetensors_header` (whose `TensorEntry`, `FileHeader` and `header_of`
are imported from here too); this module puts a checkpoint's together, with its index, config and copied files.
Everything is read from the source's `Store` (`reshard.read._store`: a local folder, a cache snapshot, the Hub or S3),
so a header costs one or two small requests wherever the files are: planning a 665 GiB checkpoint reads kilobytes.
Which kind of source a path or URL is, and which store serves it, is decided once, in `reshard.read._source`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from fnmatch import fnmatchcase
from pathlib import Path, PurePosixPath

from ..errors import CheckpointError
from ._safetensors_header import FileHeader, TensorEntry, header_of, json_document

INDEX_NAME = "model.safetensors.index.json"
_SINGLE_NAME = "model.safetensors"


class SourceKind(str, Enum):
    """What a source holds."""

    CHECKPOINT = "checkpoint"  # safetensors weights under their on-disk keys (an HF checkpoint, maybe quantized)
    RESHARD = "reshard"  # a `reshard write` folder
    SAVED = "saved"  # a `save_pretrained(..., distributed_checkpoint=True)` folder

# The torch dtype of each safetensors dtype torch can hold, by attribute name (a torch without one gets None).
TORCH_DTYPE_NAMES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64", "I8": "int8",
                     "U8": "uint8", "I16": "int16", "I32": "int32", "I64": "int64", "BOOL": "bool",
                     "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}

# Non-weight files `write` copies (and fetches from the Hub): config, generation config, tokenizer and chat-template
# files, docs and licence, at the top level only. Anything else could be a second copy of the weights: a `git clone`
# of a Hub repo keeps one in `.git/lfs/objects`, many repos add `original/` or `consolidated.*` for other runtimes.
METADATA_PATTERNS = ("*.json", "*.txt", "*.model", "*.py", "*.jinja", "*.md", "*.tiktoken", "tokenizer*", "vocab*",
                     "merges*", "LICENSE*", "LICENCE*", "NOTICE*")
_NEVER_COPIED = (".*", "*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf", "*.ckpt", "*.h5", "*.msgpack", "*.onnx",
                "consolidated.*", "*.index.json")  # an index would name weight files OUT does not hold


@dataclass(frozen=True)
class CheckpointIndex:
    """Everything `plan` needs to know about a checkpoint, read from metadata only.

    Attributes:
        source: what the user passed (a path, a repo id, a URL).
        revision: the Hub revision, or None for other sources.
        store: where the files are (`reshard.read._store`): every byte of the source is read through it.
        config: the parsed `config.json` (empty for a bare `.safetensors` file).
        files: the headers, in file-name order.
        tensors: every tensor by on-disk key.
        other_files: top-level non-weight files to copy as they are (config, tokenizer, ...; see
            `METADATA_PATTERNS`).
        quantization: set on the bf16 view of a quantized checkpoint (`reshard.read._quant.dequantized_view`): which of
            `tensors` are computed from quantized pairs. None for a checkpoint read as it is.
    """

    source: str
    revision: str | None
    store: object  # reshard.read.Store
    config: dict
    files: tuple[FileHeader, ...]
    tensors: dict[str, TensorEntry] = field(repr=False)
    other_files: tuple[str, ...] = ()
    quantization: object = None  # reshard.read._quant.Quantization (kept untyped: quant imports this module)

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

    def content_tags(self) -> list[list]:
        """Each weight file's name, size, header digest and data tag: what a write's identity records of its source
        (`reshard.read._content`)."""
        from ._content import content_tags

        return content_tags(self)

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


def torch_dtype(code: str):
    """The torch dtype of a safetensors dtype code (`BF16` -> torch.bfloat16), or None if this torch has none.
    Imports torch (only then)."""
    import torch

    return getattr(torch, TORCH_DTYPE_NAMES.get(code, ""), None)


def is_metadata_file(name: str) -> bool:
    """Whether a top-level file named `name` is copied into a written folder (see `METADATA_PATTERNS`)."""
    return (any(fnmatchcase(name, p) for p in METADATA_PATTERNS)
            and not any(fnmatchcase(name, p) for p in _NEVER_COPIED))


_MAX_METADATA_BYTES = 64 << 20  # an index, a config: far above any real one


def _weight_names(store, where: str) -> tuple[list[str], dict[str, str] | None]:
    """The safetensors files of a checkpoint: those its index names (validated before any name in it is trusted),
    or, without an index, the top-level `*.safetensors` (not `shard-*` rank files, not `consolidated.*`)."""
    names = store.names()
    if INDEX_NAME not in names:
        # `consolidated.safetensors` (Mistral's own format) repeats the weights under other names
        return [n for n in names if n.endswith(".safetensors") and not n.startswith(("shard-", "consolidated."))], None
    index = json_document(store.read_all(INDEX_NAME, _MAX_METADATA_BYTES, "safetensors index"),
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
        text = store.read_all("config.json", _MAX_METADATA_BYTES, "config.json")
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


def _headers_of(store, names: list[str]) -> list[FileHeader]:
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
    names, weight_map = ([only], None) if only is not None else _weight_names(store, source)
    if not names:
        raise CheckpointError(f"{source}: no .safetensors files and no {INDEX_NAME}. Pass a checkpoint folder, a "
                              "Hugging Face cache snapshot, a Hub repo id, an s3:// URL, a reshard folder or a folder "
                              "saved with save_pretrained(..., distributed_checkpoint=True).", path=source)
    headers = _headers_of(store, names)
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
