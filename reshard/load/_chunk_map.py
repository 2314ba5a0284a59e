"""Where every chunk of a reshard folder is, from `reshard.json` alone: what `StorageReader` tells DCP before it
reads a byte.

Every chunk follows from a tensor's placement and a coordinate (`plan.local_box`), so no rank opens a file's header to
plan. Chunk lists are built once per distinct (shape, placement) and shared by the tensors that have it, and DCP's
`storage_data` is computed on lookup (`_ChunkFiles`), so the metadata grows with tensors plus coordinates, not with
their product.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping

import torch

from ..errors import LoadError
from ..manifest import Manifest
from ..read import torch_dtype


class _KindChunks:
    """The distinct non-empty chunks of one (shape, placement) over every coordinate, and which coordinates hold
    each (a replicated tensor: one chunk, every coordinate)."""

    def __init__(self, shape: tuple[int, ...], placement, mesh):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        from ..plan import coordinate_boxes

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


class ChunkMap:
    """The chunks of a reshard folder's tensors and the file that holds each, this rank's own files first.

    Args:
        manifest: the folder's manifest.

    Attributes:
        own: this rank's coordinate when the job is the mesh the folder was written for, else None (`own_coord`);
            the reader sets it once the process group is up, before DCP asks where a chunk is.
    """

    def __init__(self, manifest: Manifest):
        self.manifest = manifest
        self.own: int | None = None
        self._kinds: dict[tuple, _KindChunks] = {}
        self._position = {name: i for i, name in enumerate(manifest.order)}
        self._runs: dict[int, tuple[list[int], list]] = {}  # coordinate -> (first tensor of each file, its entries)
        for entry in sorted(manifest.files, key=lambda e: (e.coord, e.first)):
            firsts, entries = self._runs.setdefault(entry.coord, ([], []))
            firsts.append(entry.first)
            entries.append(entry)

    def kind(self, name: str) -> _KindChunks:
        """The chunks of tensor `name`, shared with every tensor of its shape and placement."""
        info = self.manifest.tensors[name]
        key = (info.shape, info.placement)
        kind = self._kinds.get(key)
        if kind is None:
            kind = self._kinds[key] = _KindChunks(*key, self.manifest.mesh)
        return kind

    def file_of(self, name: str, offsets: tuple[int, ...]) -> str:
        """The file holding the chunk of `name` at `offsets`: this rank's own when it holds one, else the first."""
        holders = self.kind(name).holders.get(offsets)
        if not holders:
            raise LoadError(f"{self.manifest.where} holds no chunk of {name} at offsets {list(offsets)}.")
        coord = self.own if self.own in holders else holders[0]
        firsts, entries = self._runs[coord]
        entry = entries[bisect.bisect_right(firsts, self._position[name]) - 1]
        return entry.name

    def metadata(self, store, load_id):
        """DCP `Metadata` for every tensor of the folder, its chunks' files named by `store` (no file is opened)."""
        from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorProperties, \
            TensorStorageMetadata

        tensors = {}
        for name in self.manifest.order:
            info = self.manifest.tensors[name]
            dtype = torch_dtype(info.dtype)
            if dtype is None:
                raise LoadError(f"{name} is {info.dtype} in {self.manifest.where}, a dtype torch cannot hold.")
            tensors[name] = TensorStorageMetadata(properties=TensorProperties(dtype=dtype),
                                                  size=torch.Size(info.shape), chunks=self.kind(name).chunks)
        metadata = Metadata(state_dict_metadata=tensors, storage_data=_ChunkFiles(self, store))
        metadata.storage_meta = StorageMeta(load_id=load_id)
        return metadata


class _ChunkFiles(Mapping):
    """`Metadata.storage_data` without a tensors x coordinates table: `MetadataIndex(fqn, offsets)` -> the file
    that holds the chunk, this rank's own coordinate first. Computed on lookup."""

    def __init__(self, chunks: ChunkMap, store):
        self._chunks, self._store = chunks, store

    def __getitem__(self, index):
        from torch.distributed.checkpoint._hf_utils import _HFStorageInfo

        chunks = self._chunks
        info = chunks.manifest.tensors[index.fqn]
        size = chunks.kind(index.fqn).sizes[tuple(index.offset)]
        return _HFStorageInfo(self._store.url(chunks.file_of(index.fqn, tuple(index.offset))),
                              torch.Size(size), torch_dtype(info.dtype))

    def __iter__(self):
        from torch.distributed.checkpoint.metadata import MetadataIndex

        for name in self._chunks.manifest.order:
            for offsets in self._chunks.kind(name).holders:
                yield MetadataIndex(name, offsets)

    def __len__(self):
        return sum(len(self._chunks.kind(n).holders) for n in self._chunks.manifest.order)


def own_coord(mesh) -> int | None:
    """This rank's coordinate when the job is the mesh the folder was written for (global ranks), else None."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() != mesh.world_size:
        return None
    return mesh.coord_of(dist.get_rank())
