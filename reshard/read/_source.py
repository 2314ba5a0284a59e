"""One place that decides what a source is: `locate` and `open_source`, used by every command and the loader, and
`open_folder`, the one way a reshard folder is opened (its store and its manifest, together).

SRC (and a folder to load) may be:

| given | where | read through |
|---|---|---|
| a local folder or `.safetensors` file | `local` | `LocalStore` (links must stay inside the folder) |
| a Hugging Face cache snapshot (`models--org--name/snapshots/<rev>`) | `hf-cache` | `LocalStore`, links into the repo's `blobs/` followed |
| a Hub repo id (`org/name`) | `hub` | downloaded into the cache first, then as a cache snapshot |
| a Hub repo id with `stream` | `hub-stream` | ranged requests at the commit (`HubFiles`), cached files read there |
| `s3://bucket/prefix` or an object in it | `s3` | ranged requests (`s3fs`: endpoint, credentials from the AWS environment) |

and, whatever the store, the folder is a checkpoint (safetensors, maybe quantized), a reshard folder (`reshard.json`)
or a folder saved by `save_pretrained(..., distributed_checkpoint=True)` (`shard-*` files). Every rule about sources
(which links are followed, what a repo id or a URL is, which special files are refused) lives here, in the store,
or, for the Hub and its cache, in `reshard.read._hub`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from ..errors import CheckpointError, UsageError
from ..manifest import MANIFEST_NAME, Manifest, SHARD_FILE_NAME, read_manifest
from ._checkpoint import CheckpointIndex, SourceKind, checkpoint_index
from ._hub import cache_repo_of, hub_store
from ._places import REPO_ID, s3_prefix
from ._remote import CONNECT_TIMEOUT_S, READ_TIMEOUT_S, S3Store
from ._store import LocalStore, Store

S3_SCHEMES = ("s3://", "s3a://")
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_REPO_ID = REPO_ID  # a Hub repo id, where no such path exists


class Where(str, Enum):
    """Where a source's bytes are."""

    LOCAL = "local"
    HF_CACHE = "hf-cache"
    HUB = "hub"
    HUB_STREAM = "hub-stream"
    S3 = "s3"


@dataclass(frozen=True)
class _Location:
    """Where a source is and what it holds, decided from the argument and a listing, before any header is read.

    Attributes:
        spec: the argument as given (a path, a repo id, a URL): what messages and the manifest name.
        where: the kind of storage.
        kind: checkpoint, reshard folder or saved distributed checkpoint.
        store: serves its files' bytes.
        revision: the Hub revision asked for (Hub sources), else None.
        single_file: the one `.safetensors` file given instead of a folder, else None.
    """

    spec: str
    where: Where
    kind: SourceKind
    store: Store
    revision: str | None = None
    single_file: str | None = None

    @property
    def remote(self) -> bool:
        return self.where in (Where.HUB_STREAM, Where.S3)

    @property
    def absolute(self) -> str:
        """The source as another process, in another folder, can open it again: a local path made absolute."""
        return os.path.abspath(self.spec) if self.where in (Where.LOCAL, Where.HF_CACHE) else self.spec


@dataclass(frozen=True)
class Folder:
    """A reshard folder opened once: where it is and its validated manifest (None: a folder without one, opened with
    `need_manifest=False`). Commands and the loader open a folder here and pass this value down."""

    location: _Location
    manifest: Manifest | None

    @property
    def store(self) -> Store:
        return self.location.store

    def as_source(self) -> "_Source":
        """This folder read as a source, through the store it was opened with (a merged folder that `verify` checks
        has no manifest: its headers are its index).

        Raises:
            CheckpointError: as `open_source`.
        """
        return _read_source(self.location)


def open_folder(spec, *, need_manifest: bool = True) -> Folder:
    """Open the reshard folder (or node's copy) `spec`, local or remote: its links may point anywhere the user chose.

    Raises:
        ReshardError: the folder cannot be found or listed.
        ManifestError: its `reshard.json` is missing (unless `need_manifest` is False), unreadable or unsound.
    """
    location = locate(spec, outside_links=True)
    if not need_manifest and not location.store.exists(MANIFEST_NAME):
        return Folder(location, None)
    return Folder(location, read_manifest(location.store))


@dataclass(frozen=True)
class _Source:
    """A source opened: its location and its index (for a quantized checkpoint, the index of the bf16 checkpoint it
    stands for), and, for a folder in the distributed-checkpoint layout, the model layout the folder itself records.

    Attributes:
        location: where it is and what it holds.
        index: every tensor's bytes (`CheckpointIndex`, or `reshard.read.DcpIndex` for a reshard or saved
            folder, whose tensors are its chunks).
        layout: the in-memory layout of a reshard or saved folder; None for a checkpoint (`model_layout` maps it
            with transformers' tables).
    """

    location: _Location
    index: CheckpointIndex
    layout: object = None  # reshard.plan.ModelLayout

    @property
    def spec(self) -> str:
        return self.location.spec

    @property
    def kind(self) -> SourceKind:
        return self.location.kind

    @property
    def store(self) -> Store:
        return self.location.store

    @property
    def quantization(self):
        return self.index.quantization

    @property
    def crc32(self) -> dict[str, str] | None:
        """File name -> the CRC-32 the source records (a reshard folder), or None."""
        return self.index.crc32

    def model_layout(self):
        """The model's tensors and where each comes from (`reshard.plan.ModelLayout`)."""
        if self.layout is not None:
            return self.layout
        from ._experts import find_experts

        return find_experts(self.index)


# ---- the argument -------------------------------------------------------------------------------------------------

def is_url(spec) -> bool:
    """Whether `spec` is a URL (`s3://...`, `gs://...`) rather than a path or a repo id."""
    return isinstance(spec, str) and bool(_URL.match(spec))


def _repo_id_problem(spec: str) -> str | None:
    """Why `spec` is not a valid Hub repo id, or None (huggingface_hub's own rules)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(spec)
    except HFValidationError as e:
        return str(e).splitlines()[0]
    return None


def _not_found(spec: str) -> CheckpointError:
    return CheckpointError(f"{spec}: no such file or folder. Pass a checkpoint folder or .safetensors file, a Hugging "
                           "Face cache snapshot folder, a Hub repo id (org/name), an s3://bucket/prefix URL, a reshard "
                           "folder, or a folder saved with save_pretrained(..., distributed_checkpoint=True).",
                           path=spec)


def locate(spec, *, revision: str | None = None, stream: bool = False, data: bool = True,
           outside_links: bool = False) -> _Location:
    """Where `spec` is and what it holds (see the module docstring); reads a listing, never a header.

    Args:
        spec: a local path, a Hub repo id or an `s3://` URL.
        revision: a Hub branch, tag or commit (Hub sources only).
        stream: read a Hub repo in ranges instead of downloading it into the cache first.
        data: the weights will be read (a Hub repo is downloaded unless `stream`); False for headers only (`plan`).
        outside_links: a local folder's links may point anywhere (a reshard folder to load or verify, which a user may
            assemble from links: its manifest says what each file must hold); a source's must stay inside it.

    Raises:
        CheckpointError: nothing there, an invalid repo id, an unreachable or empty store.
        UsageError: a URL of a scheme reshard does not read.
    """
    spec = os.fspath(spec)
    if is_url(spec):
        if not spec.startswith(S3_SCHEMES):
            raise UsageError(f"{spec}: reshard reads local folders and files, Hugging Face cache snapshots, Hub repo "
                             "ids (org/name) and s3://bucket/prefix URLs; not this scheme. Nothing was read.")
        return _s3_object(spec) or _located(spec, Where.S3, _s3_store(spec))
    path = Path(spec)
    if path.exists():
        return _local(spec, path, outside_links)
    if not _REPO_ID.match(spec):
        raise _not_found(spec)
    if why := _repo_id_problem(spec):
        raise CheckpointError(f"{spec}: no local folder of that name, and not a valid Hub repo id ({why}). Check the "
                              "path or the repo id. Nothing was read.", path=spec)
    return _hub(spec, revision, stream=stream, data=data)


def _local(spec: str, path: Path, outside_links: bool = False) -> _Location:
    if path.is_file() or (path.exists() and not path.is_dir()):
        if path.suffix != ".safetensors":
            raise CheckpointError(f"{path}: not a .safetensors file or a folder.", path=str(path))
        return _Location(spec, Where.LOCAL, SourceKind.CHECKPOINT, LocalStore(path.parent), single_file=path.name)
    repo = cache_repo_of(path)
    if repo is not None:
        return _located(spec, Where.HF_CACHE, LocalStore(path, cache_repo=repo))
    return _located(spec, Where.LOCAL, LocalStore(path, links_anywhere=outside_links))


def _kind_of(names) -> SourceKind:
    """A folder's kind from its file names: a manifest makes a reshard folder, rank files a saved one."""
    if MANIFEST_NAME in names:
        return SourceKind.RESHARD
    if any(SHARD_FILE_NAME.match(n) for n in names):
        return SourceKind.SAVED
    return SourceKind.CHECKPOINT


def _located(spec: str, where: Where, store: Store, revision: str | None = None) -> _Location:
    kind = _kind_of(store.names())
    if kind is not SourceKind.CHECKPOINT and isinstance(store, LocalStore):
        # a distributed checkpoint's rank files may be links (a node's copy assembled from another disk): what each
        # must hold is checked against the manifest or the headers; copied files must still be inside
        store.links_anywhere = True
    return _Location(spec, where, kind, store, revision)


# ---- remote stores --------------------------------------------------------------------------------------------------

def _s3_endpoint() -> str | None:
    """The S3 endpoint of the standard AWS environment (None: AWS's own)."""
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")


def s3_filesystem(s3fs):
    """An `s3fs.S3FileSystem` for the standard AWS environment, with one try per request: reshard retries each
    request itself, bounded (`reshard.read.ATTEMPTS`), where s3fs's and botocore's own nested retries would
    multiply into minutes; the instance is fresh, so the environment of this call decides."""
    fs = s3fs.S3FileSystem(endpoint_url=_s3_endpoint(), skip_instance_cache=True, config_kwargs={
        "connect_timeout": CONNECT_TIMEOUT_S, "read_timeout": READ_TIMEOUT_S, "retries": {"total_max_attempts": 1}})
    fs.retries = 1
    fs.loop.set_exception_handler(_quiet_orphaned_sends)
    return fs


def _quiet_orphaned_sends(loop, context) -> None:
    """The loop's handler for errors nobody awaited: a connection error is dropped, anything else is shown.

    When a server goes away mid-request, aiohttp's task that sends the body dies with the connection after the
    request itself has failed; reshard has retried or reported that request already, and asyncio would print the
    orphaned task's traceback at exit over the one line that says what to do."""
    error = context.get("exception")
    if isinstance(error, OSError) or type(error).__module__.startswith("aiohttp"):
        return
    loop.default_exception_handler(context)


def _s3_store(url: str) -> S3Store:
    """The prefix of `url` on S3, with the endpoint and credentials of the standard AWS environment."""
    try:
        import s3fs
    except ImportError as e:
        raise UsageError(f"{url}: reading s3:// needs the s3 extra: `pip install -e '.[s3]'` (s3fs). Nothing was "
                         "read.") from e
    bucket, prefix = s3_prefix(url)  # spelled as a bucket output spells it: `s3://b//rs/` is `s3://b/rs`
    if len(bucket) < 3:
        raise UsageError(f"{url}: not an s3://bucket/prefix URL. Nothing was read.")
    base = f"{bucket}/{prefix}" if prefix else bucket
    store = S3Store(s3_filesystem(s3fs), base, f"s3://{base}")
    if not store.names():
        raise CheckpointError(f"{url}: no objects under this prefix (or the bucket cannot be listed at "
                              f"{_s3_endpoint() or 'the default AWS endpoint'}). Check the URL, AWS_ENDPOINT_URL_S3 / "
                              "AWS_ENDPOINT_URL and the credentials. Nothing was read.", path=url)
    return store


def _s3_object(url: str) -> _Location | None:
    """`s3://bucket/prefix/x.safetensors` naming an object: a one-file source, as a local `.safetensors` file is (its
    prefix serves the config); None when the URL names no such object (a prefix, read as one)."""
    parent, _, name = url.rstrip("/").rpartition("/")
    if not name.endswith(".safetensors") or parent.endswith(":/"):
        return None
    try:
        store = _s3_store(parent)
    except CheckpointError:
        return None
    return _Location(url, Where.S3, SourceKind.CHECKPOINT, store, single_file=name) if name in store.names() else None


def _hub(repo_id: str, revision: str | None, *, stream: bool, data: bool) -> _Location:
    """A Hub repo (`reshard.read._hub`): a cache snapshot, or read in ranges."""
    store = hub_store(repo_id, revision, stream=stream, data=data)
    if isinstance(store, LocalStore):
        return _Location(repo_id, Where.HUB, _kind_of(store.names()), store, revision)
    return _Location(repo_id, Where.HUB_STREAM, SourceKind.CHECKPOINT, store, revision)


# ---- opening --------------------------------------------------------------------------------------------------------

DISTRIBUTED = (SourceKind.RESHARD, SourceKind.SAVED)


def open_source(spec, *, revision: str | None = None, stream: bool = False, data: bool = True,
                kinds: tuple[SourceKind, ...] | None = None, store: Store | None = None) -> _Source:
    """Open any source: locate it (`locate`), read its index from metadata, and for a quantized checkpoint take the
    bf16 view (`reshard.read._quant.dequantized_view`). What `plan`, `write`, `verify --against`, `merge` (and its
    `--extras-from`) run.

    Args:
        spec, revision, stream, data: as for `locate`.
        kinds: the kinds the caller takes (`DISTRIBUTED` for a merge), refused before any header is read; None: any.
        store: the files, served by this store instead of the one `spec` names (a merge across nodes reads a folder
            joined from every node's disk); `spec` then only names them.

    Returns:
        A `_Source`.

    Raises:
        CheckpointError: the source is missing, unreachable or malformed; for a reshard or saved folder, a file
            missing, truncated or unlike its manifest, chunks that leave a gap or overlap.
        UsageError: a URL of a scheme reshard does not read; `s3://` without the s3 extra.

    Example:
        >>> source = open_source("s3://models/GLM-4.6")  # doctest: +SKIP
        >>> source.kind, len(source.index.files)  # doctest: +SKIP
        (<SourceKind.CHECKPOINT: 'checkpoint'>, 93)
    """
    location = (locate(spec, revision=revision, stream=stream, data=data) if store is None else
                _located(os.fspath(spec), Where.LOCAL, store))
    if kinds is not None and location.kind not in kinds:
        raise CheckpointError(f"{spec}: neither a reshard folder (`reshard write`) nor a folder saved by transformers' "
                              "save_pretrained(..., distributed_checkpoint=True): no reshard.json and no "
                              "shard-RRRRR-model-PPPPP-of-NNNNN.safetensors; pass one of those. To write a checkpoint "
                              "for a mesh instead: `reshard write SRC OUT --fsdp N`. Nothing was written.", path=spec)
    return _read_source(location)


def _read_source(location: _Location) -> _Source:
    """The source at `location`, already located: its index read through the location's store."""
    if location.kind is not SourceKind.CHECKPOINT:
        from ._dcp_source import read_dcp_source

        index, layout = read_dcp_source(location)
        return _Source(location, index, layout)
    index = _checkpoint(location)
    from ._quant import dequantized_view, detect_quantization

    quantization = detect_quantization(index)
    return _Source(location, index if quantization is None else dequantized_view(index, quantization))


def _checkpoint(location: _Location) -> CheckpointIndex:
    return checkpoint_index(location.store, source=location.spec, revision=location.revision,
                            only=location.single_file)


def read_checkpoint(spec, *, revision: str | None = None, need_data: bool = False) -> CheckpointIndex:
    """The index of a checkpoint as it is stored: for a quantized one its quantized tensors (`open_source` gives the
    bf16 checkpoint it stands for). `need_data`: a Hub repo is downloaded (else its headers are read in ranges).

    Raises:
        CheckpointError: as `open_source`; also for a reshard or saved folder, which is no checkpoint of its own.
    """
    location = locate(spec, revision=revision, data=need_data)
    if location.kind is not SourceKind.CHECKPOINT:
        raise CheckpointError(f"{spec}: a {location.kind.value} folder, not a checkpoint in its own layout; open it "
                              "with open_source.", path=str(spec))
    return _checkpoint(location)
