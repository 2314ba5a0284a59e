"""Load a reshard folder wherever `torch.distributed.checkpoint` loads: a DCP storage reader, and the FSDP2
placement function that makes a hand-built model match the folder.

    model = ...                                    # meta, EP and fully_shard(..., shard_placement_fn=
    model.to_empty(device="cuda")                  #     reshard.shard_placement_fn(OUT, model))
    dcp.load(model.state_dict(), storage_reader=reshard.StorageReader(OUT))

`StorageReader` is torch's `HuggingFaceStorageReader` (a reshard folder is a DCP-safetensors folder) with two
changes:

- Metadata comes from `reshard.json`: every chunk follows from a tensor's placement and a coordinate
  (`plan.local_box`), so no rank opens any file's header to plan. Chunk lists are built once per distinct
  (shape, placement) and shared by the tensors that have it, so metadata grows with tensors plus coordinates.
- `read_data` reads, for each requested chunk, only its byte range, from the file of this rank's own coordinate
  whenever that coordinate holds the chunk (every rank holds its replicated buffers, so they come from its own
  file too), with `readinto` into the destination when it is host memory of the file's dtype and the range is
  contiguous, otherwise through a buffer and `copy_` (a dtype conversion, an accelerator, DCP resharding).

CRC-32: the manifest records one CRC per whole file, so it can be checked honestly only over a whole file. When
the requests of one `read_data` call cover every tensor of a file (the case whenever the model's placements match
the folder: each rank reads exactly its own files), the header and every byte pass the CRC as they are read and a
mismatch raises `LoadError`. When they cover part of a file (DCP resharding onto other placements), that file is
not checked: reading the rest only to check it would defeat reading less. `checked_files` / `unchecked_files`
say which was which; `reshard verify OUT` checks everything.
"""

from __future__ import annotations

import bisect
import math
import os
import struct
from collections.abc import Mapping

from ..read.checkpoint import MAX_HEADER_BYTES, FileHeader, parse_header, torch_dtype
from ..errors import LoadError, ReshardError
from .local_read import BackgroundCrc, Staging, fill, read_tensor
from ..manifest import MANIFEST_NAME, Manifest, header_problems, read_manifest
from ..runs.byte_runs import row_major_strides

import torch
from torch.distributed.checkpoint import HuggingFaceStorageReader  # `import reshard` imports this module lazily
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner


def _open(store, name: str):
    """The one place files are opened for reading data (tests wrap it to audit every byte read): a local file only
    if it is a regular file, and the open never blocks on a FIFO; a remote one read in large ranges
    (`reshard.read.store.RangeFile`)."""
    return store.open(name)


class _KindChunks:
    """The distinct non-empty chunks of one (shape, placement) over every coordinate, and which coordinates hold
    each (a replicated tensor: one chunk, every coordinate)."""

    def __init__(self, shape: tuple[int, ...], placement, mesh):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        from ..plan.placement import coordinate_boxes

        self.holders: dict[tuple[int, ...], list[int]] = {}  # offsets -> coordinates holding that chunk
        self.sizes: dict[tuple[int, ...], tuple[int, ...]] = {}
        sizes = self.sizes
        for coord, box in enumerate(coordinate_boxes(shape, placement, mesh)):  # O(coordinates) per kind
            if any(n == 0 for _, n in box) and math.prod(shape):
                continue  # an empty marker: nothing to read from it
            offsets = tuple(o for o, _ in box)
            self.holders.setdefault(offsets, []).append(coord)
            sizes[offsets] = tuple(n for _, n in box)
        self.chunks = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(n)) for o, n in sizes.items()]


class _ChunkFiles(Mapping):
    """`Metadata.storage_data` without a tensors x coordinates table: `MetadataIndex(fqn, offsets)` -> the file
    that holds the chunk, this rank's own coordinate first. Computed on lookup."""

    def __init__(self, reader: "StorageReader"):
        self._reader = reader

    def __getitem__(self, index):
        from torch.distributed.checkpoint._hf_utils import _HFStorageInfo

        reader = self._reader
        info = reader.manifest.tensors[index.fqn]
        size = reader._kind(index.fqn).sizes[tuple(index.offset)]
        return _HFStorageInfo(reader.store.url(reader._file_of(index.fqn, tuple(index.offset))),
                              torch.Size(size), torch_dtype(info.dtype))

    def __iter__(self):
        from torch.distributed.checkpoint.metadata import MetadataIndex

        for name in self._reader.manifest.order:
            for offsets in self._reader._kind(name).holders:
                yield MetadataIndex(name, offsets)

    def __len__(self):
        return sum(len(self._reader._kind(n).holders) for n in self._reader.manifest.order)


class StorageReader(HuggingFaceStorageReader):
    """A `torch.distributed.checkpoint` storage reader for a folder written by `reshard write`, and a drop-in for
    torch's `HuggingFaceStorageReader` (same constructor) on any other DCP-safetensors folder.

    Works with `dcp.load` on any model whose state dict has the folder's tensor names: on the fast path (the
    model's placements are the folder's: `reshard.shard_placement_fn` for a hand-built FSDP2 model, or the
    transformers loader patch) each rank reads exactly its own files, every byte once, and checks their CRC-32; on
    other placements, a world size the folder was not written for, or a single process, DCP reshards and this
    reader reads the byte ranges it asks for (correct, not the fast path; no CRC, see the module docstring).

    A folder without `reshard.json` (saved by `save_pretrained(..., distributed_checkpoint=True)` or torch's
    `HuggingFaceStorageWriter`) is read exactly as torch's reader reads it: metadata from the headers, no CRC.

    Args:
        path: the folder (or a parsed `Manifest`).
        thread_count: files read at once by each rank, as in torch's reader.
        check_checksums: check each file's CRC-32 whenever a rank reads all of it (reshard folders).

    Attributes:
        checked_files: files whose CRC-32 was checked by this reader's reads, in read order.
        unchecked_files: files read in part (not checkable against the manifest's whole-file CRC).

    Raises:
        LoadError: from the constructor, `reshard.json` is there but unreadable; from `read_data` (on every rank,
            through DCP's gathered exception), a file is missing, truncated, corrupt or does not match the manifest.

    Example:
        >>> dcp.load(model.state_dict(), storage_reader=reshard.StorageReader(out))  # doctest: +SKIP
    """

    def __init__(self, path: str | os.PathLike | Manifest, thread_count: int = 1, *, check_checksums: bool = True,
                 store=None):
        from ..read.source import locate

        if store is None:
            try:
                store = locate(path.where if isinstance(path, Manifest) else path, outside_links=True).store
            except ReshardError as e:
                raise LoadError(str(e)) from e
        if not isinstance(path, Manifest) and not store.exists(MANIFEST_NAME):
            if store.remote:
                raise LoadError(f"{store.location}: no {MANIFEST_NAME}; from an object store reshard reads reshard "
                                "folders only (`reshard write`). Copy the folder to a file system to read it with "
                                "torch's HuggingFaceStorageReader.")
            # Not a reshard folder (a save_pretrained distributed checkpoint, torch's own DCP-safetensors output):
            # read it as torch's reader does, metadata from the headers. Its files carry no CRC to check.
            super().__init__(os.fspath(path), thread_count)
            self.manifest, self.store = None, store
            self.check_checksums = False
            self.checked_files, self.unchecked_files = [], []
            return
        manifest = path if isinstance(path, Manifest) else read_manifest(store)  # a ManifestError is a LoadError
        super().__init__(getattr(store, "root", None) or store.location, thread_count)
        self.manifest, self.store = manifest, store
        self.check_checksums = check_checksums
        self.checked_files: list[str] = []
        self.unchecked_files: list[str] = []
        self._kinds: dict[tuple, _KindChunks] = {}
        self._own: int | None = None
        self._headers: dict[str, tuple[FileHeader, bytes]] = {}
        self._position = {name: i for i, name in enumerate(manifest.order)}
        self._runs: dict[int, tuple[list[int], list]] = {}
        for entry in sorted(manifest.files, key=lambda e: (e.coord, e.first)):
            firsts, entries = self._runs.setdefault(entry.coord, ([], []))
            firsts.append(entry.first)
            entries.append(entry)

    # ---- metadata, from the manifest ---------------------------------------------------------------------------

    def _kind(self, name: str) -> _KindChunks:
        info = self.manifest.tensors[name]
        key = (info.shape, info.placement)
        kind = self._kinds.get(key)
        if kind is None:
            kind = self._kinds[key] = _KindChunks(*key, self.manifest.mesh)
        return kind

    def read_metadata(self):
        """DCP `Metadata` for every tensor of the folder, from `reshard.json` alone (no file is opened)."""
        if self.manifest is None:
            return super().read_metadata()
        from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorProperties, \
            TensorStorageMetadata

        tensors = {}
        for name in self.manifest.order:
            info = self.manifest.tensors[name]
            dtype = torch_dtype(info.dtype)
            if dtype is None:
                raise LoadError(f"{name} is {info.dtype} in {self.manifest.where}, a dtype torch cannot hold.")
            tensors[name] = TensorStorageMetadata(properties=TensorProperties(dtype=dtype),
                                                  size=torch.Size(info.shape), chunks=self._kind(name).chunks)
        metadata = Metadata(state_dict_metadata=tensors, storage_data=_ChunkFiles(self))
        metadata.storage_meta = StorageMeta(load_id=self.load_id)
        return metadata

    def set_up_storage_reader(self, metadata, is_coordinator, *args, **kwargs) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        if self.manifest is not None:
            self._own = self._own_coord()
            self._headers = self._checked_headers()

    def _checked_headers(self) -> dict[str, tuple[FileHeader, bytes]]:
        """The headers this rank reads (its own coordinate's files; every file off the fast path), each compared
        with the manifest before DCP plans anything: a tampered shape or dtype is a `LoadError` here, never a
        planner's size mismatch or a wrong tensor. Kept for `_read_file`, so each header is still read once."""
        headers = {}
        for entry in self.manifest.files:
            if self._own is not None and entry.coord != self._own:
                continue
            try:
                with _open(self.store, entry.name) as fh:
                    headers[entry.name] = self._header(fh, entry.name, entry)
            except OSError as e:
                raise LoadError(f"{entry.name} cannot be read ({e.strerror or e})") from e
            except ReshardError as e:
                raise LoadError(str(e)) from e
        return headers

    def _own_coord(self) -> int | None:
        """This rank's coordinate when the job is the mesh the folder was written for (global ranks), else None."""
        import torch.distributed as dist

        mesh = self.manifest.mesh
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() != mesh.world_size:
            return None
        return mesh.coord_of(dist.get_rank())

    def _file_of(self, name: str, offsets: tuple[int, ...]) -> str:
        holders = self._kind(name).holders.get(offsets)
        if not holders:
            raise LoadError(f"{self.manifest.where} holds no chunk of {name} at offsets {list(offsets)}.")
        coord = self._own if self._own in holders else holders[0]
        firsts, entries = self._runs[coord]
        entry = entries[bisect.bisect_right(firsts, self._position[name]) - 1]
        return entry.name

    # ---- data --------------------------------------------------------------------------------------------------

    def read_data(self, plan, planner):
        """Read the plan's items, file by file, each byte range once; see the class docstring. With
        `thread_count` > 1, that many files are read at once (each thread with its own staging buffer)."""
        from torch.futures import Future

        if self.manifest is None:
            return super().read_data(plan, planner)
        per_file: dict[str, list] = {}
        for item in plan.items:
            per_file.setdefault(self._file_of(item.storage_index.fqn, tuple(item.storage_index.offset)),
                                []).append(item)
        names = sorted(per_file)
        threads = min(max(int(self.thread_count), 1), len(names))
        if threads <= 1:
            staging = Staging()
            for name in names:
                self._read_checked(name, per_file[name], planner, staging)
        else:
            self._read_in_threads(names, per_file, planner, threads)
        future = Future()
        future.set_result(None)
        return future

    def _read_in_threads(self, names: list[str], per_file: dict, planner, threads: int) -> None:
        import queue
        import threading

        todo: queue.SimpleQueue = queue.SimpleQueue()
        for name in names:
            todo.put(name)
        failures: list[BaseException] = []

        def work():
            staging = Staging()
            while not failures:
                try:
                    name = todo.get_nowait()
                except queue.Empty:
                    return
                try:
                    self._read_checked(name, per_file[name], planner, staging)
                except BaseException as e:  # re-raised on the calling thread, first failure first
                    failures.append(e)

        pool = [threading.Thread(target=work, name=f"reshard-read-{i}", daemon=True) for i in range(threads)]
        for thread in pool:
            thread.start()
        for thread in pool:
            thread.join()
        if failures:
            raise failures[0]

    def _read_checked(self, name: str, items: list, planner, staging: Staging) -> None:
        try:
            self._read_file(name, items, planner, staging)
        except ReshardError:
            raise
        except OSError as e:
            raise LoadError(f"{name} cannot be read ({e.strerror or e})") from e

    def _header(self, fh, name: str, entry) -> tuple[FileHeader, bytes]:
        size = self.store.size(name)
        if size != entry.bytes:
            raise LoadError(f"{name} has {size} bytes, the manifest says {entry.bytes}")
        prefix = bytearray(8)
        fill(fh, memoryview(prefix), name)
        (length,) = struct.unpack("<Q", prefix)
        if length > min(MAX_HEADER_BYTES, size - 8):
            raise LoadError(f"{name}: the header length prefix says {length} bytes but the file has {size}; it is "
                            "corrupt")
        raw = bytearray(length)
        fill(fh, memoryview(raw), name)
        header = parse_header(bytes(raw), file=name, file_size=size)
        problems = header_problems(entry, self.manifest.chunks(entry), header)
        if problems:
            raise LoadError(f"{'; '.join(problems)}. Run `reshard verify {self.manifest.where}`, or write it again.")
        return header, bytes(prefix) + bytes(raw)

    def _read_file(self, name: str, items: list, planner, staging: Staging) -> None:
        entry = self.manifest.file_entry(name)
        checked = self._headers.pop(name, None)
        with _open(self.store, name) as fh:
            if checked is None:
                header, head = self._header(fh, name, entry)
            else:
                header, head = checked
                fh.seek(header.header_bytes)
            tensors = {t.name: t for t in header.tensors}
            spans: dict[tuple[int, int], list] = {}  # byte range -> the items reading exactly it
            for item in items:
                spans.setdefault(_span(tensors[item.storage_index.fqn], item), []).append(item)
            ordered = sorted(spans)
            whole = [(t.data_start, t.data_start + t.nbytes) for t in header.tensors if t.nbytes]
            crc = BackgroundCrc() if self.check_checksums and [s for s in ordered if s[1] > s[0]] == whole else None
            try:
                if crc:
                    crc.update(head)
                position = header.header_bytes
                for span in ordered:
                    if span[1] == span[0]:
                        for item in spans[span]:
                            planner.commit_tensor(item, planner.resolve_tensor(item).detach())
                        continue
                    if span[0] != position:
                        fh.seek(span[0])
                    self._read_span(fh, name, tensors, span, spans[span], planner, crc, staging)
                    position = span[1]
                if crc:
                    value = crc.hexdigest()
                    if value != entry.crc32:
                        raise LoadError(f"{name} is corrupt (CRC-32 {value}, the manifest says {entry.crc32})")
                    self.checked_files.append(name)
                else:
                    self.unchecked_files.append(name)
            finally:
                if crc:
                    crc.close()

    def _read_span(self, fh, name, tensors, span, items, planner, crc, staging) -> None:
        """Read one byte range into every item that asks for it (tied weights ask twice: read once, copied)."""

        first, *others = items
        stored = tensors[first.storage_index.fqn]
        target = planner.resolve_tensor(first).detach()
        nbytes = span[1] - span[0]
        direct = (torch_dtype(stored.dtype) == target.dtype and target.is_contiguous()
                  and nbytes == target.numel() * target.element_size())
        if direct:  # the range is exactly the target's elements, in order
            read_tensor(fh, nbytes, target, crc, staging, f"{name} ({stored.name})",
                         in_place=target.device.type == "cpu")
            source = target
        else:
            buffer = torch.empty(nbytes, dtype=torch.uint8)
            view = memoryview(buffer.numpy())
            fill(fh, view, f"{name} ({stored.name})")
            if crc:
                crc.update(view)  # the view keeps the buffer alive until its CRC is done
            source = _region(buffer, stored, first)
            target.copy_(source)
        planner.commit_tensor(first, target)
        for item in others:
            other = planner.resolve_tensor(item).detach()
            other.copy_(source)
            planner.commit_tensor(item, other)


def _span(stored, item) -> tuple[int, int]:
    """The smallest byte range of the stored chunk holding the item's region (row-major order)."""
    if 0 in item.lengths:
        return stored.data_start, stored.data_start
    strides = row_major_strides(stored.shape)
    first = sum(o * s for o, s in zip(item.storage_offsets, strides))
    last = sum((o + n - 1) * s for o, n, s in zip(item.storage_offsets, item.lengths, strides))
    return stored.data_start + first * stored.itemsize, stored.data_start + (last + 1) * stored.itemsize


def _region(buffer, stored, item):
    """The item's region as a view of `buffer`, which holds the bytes of `_span(stored, item)`."""
    typed = buffer.view(torch_dtype(stored.dtype))
    return typed.as_strided(tuple(item.lengths), row_major_strides(stored.shape), 0)


class _RealDestinations(DefaultLoadPlanner):
    """Refuses destinations still on meta: DCP's planner would swap each for a new tensor in its own copy of the
    state dict and load there, so not a byte would reach the model, and the rank would fail alone at its first
    forward. Raised while planning, so DCP reports it on every rank."""

    def set_up_planner(self, state_dict, *args, **kwargs):
        on_meta = sorted(fqn for fqn, t in state_dict.items()
                         if isinstance(t, torch.Tensor) and getattr(t, "_local_tensor", t).is_meta)
        if on_meta:
            raise LoadError(f"{len(on_meta)} tensor(s) of the model are still on the meta device, so nothing can be "
                            f"loaded into them: {', '.join(on_meta[:4])}")
        return super().set_up_planner(state_dict, *args, **kwargs)


def load_model_state(model, manifest: Manifest, store, *, checksums: bool = True, strict: bool = True) -> None:
    """`dcp.load` of `model.state_dict()` in place with a `StorageReader`: what the transformers patch runs on the
    distributed-checkpoint path. DCP gathers every rank's failure into one exception on every rank; it is raised
    here as one `LoadError` naming each failing rank and its cause.

    Raises:
        LoadError: on every rank, when any rank's files are missing, truncated, corrupt or unlike the manifest.
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from ..launch import raise_if_any

    try:
        dcp.load(model.state_dict(), storage_reader=StorageReader(manifest, check_checksums=checksums, store=store),
                 planner=_RealDestinations(allow_partial_load=not strict))
    except CheckpointException as e:
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        problems: list = [None] * world
        for rank, (exc, _) in e.failures.items():
            problems[rank] = str(exc) if isinstance(exc, ReshardError) else f"{type(exc).__name__}: {exc}"
        raise_if_any(problems)
        raise  # pragma: no cover  (a CheckpointException always names a failing rank)


# ---- placements for a hand-built FSDP2 model --------------------------------------------------------------------

def shard_placement_fn(out: str | os.PathLike | Manifest, model=None):
    """The `shard_placement_fn` to pass to FSDP2's `fully_shard` so a model gets the placements `out` was written
    for: each tensor the folder splits on a dim other than 0 (balanced expert tensors) gets `Shard(dim)`, every
    other parameter FSDP2's default `Shard(0)`.

    Pass it to every `fully_shard` call (expert modules on the efsdp mesh, the others and the root on the fsdp
    mesh), after expert parallelism, if any, has made the expert parameters `Shard(0)` on the ep mesh.

    Args:
        out: the folder written by `reshard write` (or its parsed `Manifest`).
        model: the model being sharded, to name each parameter exactly. Without it, a parameter is recognised by
            its global shape, which must then name one split dim among the folder's tensors of that shape.

    Returns:
        A function `param -> Shard | None`.

    Raises:
        LoadError: the manifest cannot be read; when called without `model`, a shape with several split dims.

    Example:
        >>> fn = reshard.shard_placement_fn(out, model)  # doctest: +SKIP
        >>> fully_shard(layer.mlp.experts, mesh=expert_mesh["efsdp"], shard_placement_fn=fn)  # doctest: +SKIP
    """
    if not isinstance(out, Manifest):
        from ..read.source import locate

        out = read_manifest(locate(out, outside_links=True).store)  # a ManifestError is a LoadError
    return _SplitDims(out, model)


class _SplitDims:
    """`shard_placement_fn`'s function: a parameter's split dim by its name in `model`, or by its shape alone."""

    def __init__(self, manifest: Manifest, model):
        self.manifest, self.model, self.names = manifest, model, {}
        self.dims = {n: info.placement.shard_dim for n, info in manifest.tensors.items() if not info.is_replicated}
        self.by_shape: dict[tuple[int, ...], set[int]] = {}
        for name, dim in self.dims.items():
            self.by_shape.setdefault(manifest.tensors[name].shape, set()).add(dim)

    def __call__(self, param):
        from torch.distributed.tensor import Shard

        if self.model is not None:
            if id(param) not in self.names:  # EP and earlier fully_shard calls replace parameters: look again
                self.names = {id(p): n for n, p in self.model.named_parameters()}
            dim = self.dims.get(self.names.get(id(param)))
        else:
            found = self.by_shape.get(tuple(param.shape), set())
            if len(found) > 1:
                raise LoadError(f"{self.manifest.where} splits tensors of shape {list(param.shape)} on dims "
                                f"{sorted(found)}: pass the model, reshard.shard_placement_fn(out, model), to tell "
                                "them apart by name.")
            dim = next(iter(found), None)
        return Shard(dim) if dim not in (None, 0) else None
