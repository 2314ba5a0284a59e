"""Load a reshard folder wherever `torch.distributed.checkpoint` loads: a DCP storage reader (the FSDP2 placement
function that makes a hand-built model match the folder is `reshard.load._shard_placement`).

    model = ...                                    # meta, EP and fully_shard(..., shard_placement_fn=
    model.to_empty(device="cuda")                  #     reshard.shard_placement_fn(OUT, model))
    dcp.load(model.state_dict(), storage_reader=reshard.StorageReader(OUT))

`StorageReader` is torch's `HuggingFaceStorageReader` (a reshard folder is a DCP-safetensors folder) with two
changes:

- Metadata comes from `reshard.json` (`reshard.load._chunk_map`): every chunk follows from a tensor's placement and a
  coordinate, so no rank opens any file's header to plan, and metadata grows with tensors plus coordinates.
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

import math
import os
import struct

from ..read import FileHeader, MAX_HEADER_BYTES, parse_header, torch_dtype
from ..errors import LoadError, ReshardError
from ._chunk_map import ChunkMap, own_coord
from ._local_read import BackgroundCrc, Staging, fill, read_tensor
from ._progress import current
from ..manifest import MANIFEST_NAME, Manifest, header_problems, read_manifest
from ..runs import row_major_strides
from ..words import plural

import torch
from torch.distributed.checkpoint import HuggingFaceStorageReader  # `import reshard` imports this module lazily
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner


def _open(store, name: str):
    """The one place files are opened for reading data (tests wrap it to audit every byte read): a local file only
    if it is a regular file, and the open never blocks on a FIFO; a remote one read in large ranges
    (`reshard.read._range_file.RangeFile`)."""
    return store.open(name)


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
        from ..read import open_folder

        manifest = path if isinstance(path, Manifest) else None
        if store is None:
            try:
                opened = open_folder(path.where if manifest is not None else path, need_manifest=False)
            except LoadError:
                raise
            except ReshardError as e:
                raise LoadError(str(e)) from e
            store, manifest = opened.store, manifest or opened.manifest
        elif manifest is None and store.exists(MANIFEST_NAME):
            manifest = read_manifest(store)  # a ManifestError is a LoadError
        if manifest is None:
            if store.remote:
                raise LoadError(f"{store.location}: no {MANIFEST_NAME}; from an object store reshard reads reshard "
                                "folders only (`reshard write`). Copy the folder to a file system to read it with "
                                "torch's HuggingFaceStorageReader.")
            # Not a reshard folder (a save_pretrained distributed checkpoint, torch's own DCP-safetensors output):
            # read it as torch's reader does, metadata from the headers. Its files carry no CRC to check.
            super().__init__(os.fspath(path), thread_count)
            self.manifest, self.store, self.chunk_map = None, store, None
            self.check_checksums = False
            self.checked_files, self.unchecked_files = [], []
            return
        super().__init__(getattr(store, "root", None) or store.location, thread_count)
        self.manifest, self.store, self.chunk_map = manifest, store, ChunkMap(manifest)
        self.check_checksums = check_checksums
        self.checked_files: list[str] = []
        self.unchecked_files: list[str] = []
        self._headers: dict[str, tuple[FileHeader, bytes]] = {}

    # ---- metadata, from the manifest ---------------------------------------------------------------------------

    def read_metadata(self):
        """DCP `Metadata` for every tensor of the folder, from `reshard.json` alone (no file is opened)."""
        if self.manifest is None:
            return super().read_metadata()
        return self.chunk_map.metadata(self.store, self.load_id)

    def set_up_storage_reader(self, metadata, is_coordinator, *args, **kwargs) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        if self.manifest is not None:
            self.chunk_map.own = own_coord(self.manifest.mesh)
            self._headers = self._checked_headers()

    def _checked_headers(self) -> dict[str, tuple[FileHeader, bytes]]:
        """The headers this rank reads (its own coordinate's files; every file off the fast path), each compared
        with the manifest before DCP plans anything: a tampered shape or dtype is a `LoadError` here, never a
        planner's size mismatch or a wrong tensor. Kept for `_read_file`, so each header is still read once."""
        headers = {}
        for entry in self.manifest.files:
            if self.chunk_map.own is not None and entry.coord != self.chunk_map.own:
                continue
            try:
                with _open(self.store, entry.name) as fh:
                    headers[entry.name] = self._header(fh, entry.name, entry)
            except OSError as e:
                raise LoadError(f"{entry.name} cannot be read ({e.strerror or e})") from e
            except ReshardError as e:
                raise LoadError(str(e)) from e
        return headers

    # ---- data --------------------------------------------------------------------------------------------------

    def read_data(self, plan, planner):
        """Read the plan's items, file by file, each byte range once; see the class docstring. With
        `thread_count` > 1, that many files are read at once (each thread with its own staging buffer)."""
        from torch.futures import Future

        if self.manifest is None:
            return super().read_data(plan, planner)
        per_file: dict[str, list] = {}
        for item in plan.items:
            per_file.setdefault(self.chunk_map.file_of(item.storage_index.fqn, tuple(item.storage_index.offset)),
                                []).append(item)
        names = sorted(per_file)
        threads = min(max(int(self.thread_count), 1), len(names))
        sizes = {name: sum(math.prod(i.lengths) * torch_dtype(self.manifest.tensors[i.storage_index.fqn].dtype).itemsize
                           for i in per_file[name]) for name in names}
        with current().reading(len(names), sum(sizes.values()), "of tensor data, this rank's") as shown:
            if threads <= 1:
                staging = Staging()
                for done, name in enumerate(names, 1):
                    self._read_checked(name, per_file[name], planner, staging)
                    shown(done, sum(sizes[n] for n in names[:done]))
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
        """File `name`'s header, checked against the manifest: its 8-byte length prefix and the header read through
        `fh`, no more (two ranged requests from an object store: nothing is fetched ahead before `expect`)."""
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
            if hasattr(fh, "expect"):  # a remote file: these ranges fetched ahead, in large requests
                fh.expect(ordered)
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
            raise LoadError(f"{plural(len(on_meta), 'tensor')} of the model are still on the meta device, so nothing "
                            f"can be loaded into them: {', '.join(on_meta[:4])}")
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
