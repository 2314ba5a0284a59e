"""The manifest's entries, typed: a chunk, a tensor, a file and a coordinate, and the chunks a file entry holds.

A chunk is never stored: its offsets and shape follow from the tensor's placement and the file's coordinate
(`local_box`), so the manifest stays linear in tensors plus coordinates.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from types import MappingProxyType

from ..plan import Kind, MeshSpec, Placement, Role, local_box


@dataclass(frozen=True)
class Chunk:
    """One tensor's chunk in one file, derived from the manifest: its name, global offsets, local shape and dtype."""

    name: str
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: str | None = None  # the manifest's dtype of the tensor (None: not compared)

    @property
    def is_empty(self) -> bool:
        return 0 in self.shape


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the manifest's `tensors`, checked: its global shape, dtype, role, the placement written and, for a
    tensor computed from a quantized pair, what it was dequantized from (`dequantized_from`: method, keys, ...)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    role: Role
    is_param: bool
    placement: Placement
    dequantized_from: Mapping | None = None

    @property
    def is_replicated(self) -> bool:
        return self.placement.kind is Kind.REPLICATED

    def __getstate__(self) -> dict:
        return plain_state(self, "dequantized_from")

    def __setstate__(self, state: dict) -> None:
        set_state(self, state, "dequantized_from")


@dataclass(frozen=True)
class FileEntry:
    """One entry of the manifest's `files`, checked: a plain file name, its fsdp coordinate, the run of `order` it
    holds (`first`, `count`), its size, CRC-32 and empty-marker count."""

    name: str
    coord: int
    first: int
    count: int
    bytes: int
    crc32: str
    empty_markers: int

    def record(self) -> dict:
        """The entry as the manifest's `files` holds it."""
        return asdict(self)


@dataclass(frozen=True)
class CoordEntry:
    """One entry of the manifest's `coords`: the ranks that read this coordinate's files (derived from the mesh,
    `MeshSpec.coord_ranks`: a range, never a list as long as dp_replicate), and those files."""

    coord: int
    ranks: range
    files: tuple[str, ...]
    empty_markers: int


@dataclass(frozen=True)
class ExtrasEntry:
    """One entry of the manifest's optional `extras`: a file of tensors the model does not load, whole under their
    on-disk keys, read by no rank."""

    name: str
    bytes: int
    crc32: str
    keys: tuple[str, ...]

    def record(self) -> dict:
        """The entry as the manifest's `extras` holds it."""
        return {"name": self.name, "bytes": self.bytes, "crc32": self.crc32, "keys": list(self.keys)}


@dataclass(frozen=True)
class SourceRecord:
    """The manifest's `source`: what the folder was written from.

    Attributes:
        source: the source as it was given (a path, a repo id, a URL).
        revision: the Hub revision asked for, or None.
        model_type, architecture: of the model (None when unknown).
        header_sha256: the source's safetensors header digests by file.
        quantization_config: the quantized source's `quantization_config`, or None.
    """

    source: str
    revision: str | None
    model_type: str | None
    architecture: str | None
    header_sha256: Mapping
    quantization_config: Mapping | None = None

    def __getstate__(self) -> dict:
        return plain_state(self, "header_sha256", "quantization_config")

    def __setstate__(self, state: dict) -> None:
        set_state(self, state, "header_sha256", "quantization_config")


def plain_state(value, *views: str) -> dict:
    """The fields of the frozen dataclass `value` as pickle takes them: its read-only views (the fields `views`) as
    plain dicts, since a `MappingProxyType` does not pickle."""
    state = {f.name: getattr(value, f.name) for f in fields(value)}
    return {**state, **{name: None if state[name] is None else dict(state[name]) for name in views}}


def set_state(value, state: dict, *views: str) -> None:
    """`plain_state` undone on `value` as pickle builds it: the fields set, `views` read-only again."""
    for name, field_value in state.items():
        if name in views and field_value is not None:
            field_value = MappingProxyType(field_value)
        object.__setattr__(value, name, field_value)


def placement_of(info: dict) -> Placement:
    """The `Placement` a manifest document's tensor entry records (`{"kind", "shard_dim", "degree", "ep"}`)."""
    return Placement(Kind(info["kind"]), info["shard_dim"], info["degree"], info["ep"])


def chunk_of(info: TensorInfo, mesh: MeshSpec, coord: int) -> Chunk:
    """Tensor `info`'s chunk on coordinate `coord`: its offsets and shape follow from the placement (`local_box`)."""
    box = local_box(info.shape, info.placement, mesh, coord)
    return Chunk(info.name, tuple(o for o, _ in box), tuple(n for _, n in box), info.dtype)
