"""The output format: per-coordinate safetensors files in the distributed-checkpoint layout, and `reshard.json`.

Files are named `shard-SSSSS-model-PPPPP-of-NNNNN.safetensors`: `SSSSS` is the 1-based fsdp coordinate (ranks
`c, c + fsdp, ...` of each replica read it), `PPPPP-of-NNNNN` the part among that coordinate's files. This is the
pattern transformers 5.23 recognises as a distributed checkpoint (`distributed/checkpoint.py`), and each header's
`__metadata__` carries what torch's `HuggingFaceStorageReader` needs: `DCP_SHARDING_INFO` (per tensor
`saved_offsets`), `DCP_VERSION` and `format`. The names mirror a private PyTorch module, so they are our own
constants here, pinned by a golden test.

An empty local shard is written as an explicit zero-size tensor whose offset is the dim's size (torch's
convention for empty shards) and listed in the manifest's `empty` per coordinate: nothing is silently missing.

Replicated tensors (persistent buffers such as `e_score_correction_bias`, which FSDP does not shard) are written
whole into every coordinate's first file, so each coordinate's files hold everything its ranks load: they can be
copied to node-local disks on their own (`reshard files`).
"""

from __future__ import annotations

import json
import math
import zlib
from dataclasses import dataclass
from pathlib import Path

from .errors import VerifyError
from .mesh import MeshSpec

MANIFEST_NAME = "reshard.json"
MANIFEST_FORMAT = "reshard"
MANIFEST_VERSION = 1
SHARD_FILE = "shard-{coord:05d}-model-{part:05d}-of-{parts:05d}.safetensors"
DCP_SHARDING_INFO_KEY = "DCP_SHARDING_INFO"
DCP_VERSION_KEY = "DCP_VERSION"
DCP_VERSION = "1.0"
SAVED_OFFSETS_KEY = "saved_offsets"


def shard_file_name(coord: int, part: int, parts: int) -> str:
    """File name of part `part` (0-based) of `parts` for fsdp coordinate `coord` (0-based)."""
    return SHARD_FILE.format(coord=coord + 1, part=part + 1, parts=parts)


def dcp_metadata(offsets: dict[str, list[int]]) -> dict[str, str]:
    """The safetensors `__metadata__` torch's HuggingFaceStorageReader reads chunk offsets from."""
    info = {name: {SAVED_OFFSETS_KEY: list(off)} for name, off in offsets.items()}
    return {DCP_SHARDING_INFO_KEY: json.dumps(info, separators=(",", ":")), DCP_VERSION_KEY: DCP_VERSION,
            "format": "pt"}


@dataclass(frozen=True)
class Manifest:
    """`reshard.json`, parsed. See README.md, "The manifest", for every field.

    Attributes:
        data: the whole JSON document.
        path: the folder it was read from.
    """

    data: dict
    path: Path

    @property
    def mesh(self) -> MeshSpec:
        return MeshSpec(**self.data["mesh"])

    @property
    def files(self) -> list[dict]:
        return self.data["files"]

    def files_of_rank(self, rank: int) -> list[str]:
        """The files rank `rank` reads its shards from (its coordinate's files)."""
        coord = self.mesh.shard_index(rank)
        return [f["name"] for f in self.files if f["coord"] == coord]

    def empty_of_rank(self, rank: int) -> list[str]:
        return list(self.data["coords"][self.mesh.shard_index(rank)]["empty"])

    def files_for_ranks(self, ranks) -> list[str]:
        """Every file the ranks `ranks` need to load, relative to the folder: the manifest, the copied non-weight
        files (config, tokenizer, ...) and each rank's shard files, in that order.

        Raises:
            MeshError: a rank outside the mesh.
        """
        shard_names = {f["name"] for f in self.files}
        copied = self.data.get("copied")
        if copied is None:  # a manifest from before `copied` was recorded: every other file in the folder
            copied = sorted(str(p.relative_to(self.path)) for p in self.path.rglob("*")
                            if p.is_file() and p.name != MANIFEST_NAME and p.name not in shard_names)
        coords = sorted({self.mesh.shard_index(r) for r in ranks})
        shards = [f["name"] for c in coords for f in self.files if f["coord"] == c]
        return [MANIFEST_NAME, *copied, *shards]


def read_manifest(folder: str | Path) -> Manifest:
    """Read and sanity-check `reshard.json` in `folder`.

    Raises:
        VerifyError: the manifest is missing, not JSON, or of an unknown format/version.
    """
    folder = Path(folder)
    path = folder / MANIFEST_NAME
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError as e:
        raise VerifyError([f"{path}: no manifest; this folder was not written by `reshard write` (or the write "
                           "did not finish). Write it again."]) from e
    except (OSError, ValueError) as e:
        raise VerifyError([f"{path}: unreadable manifest ({e})."]) from e
    if data.get("format") != MANIFEST_FORMAT or data.get("version") != MANIFEST_VERSION:
        raise VerifyError([f"{path}: format {data.get('format')!r} version {data.get('version')!r}; this reshard "
                           f"reads {MANIFEST_FORMAT!r} version {MANIFEST_VERSION}."])
    return Manifest(data, folder)


def _tiles(intervals: list[tuple[int, int]], size: int) -> bool:
    """Whether distinct `(offset, length)` intervals tile `[0, size)` exactly once."""
    cursor = 0
    for offset, length in sorted(intervals):
        if offset != cursor:
            return False
        cursor += length
    return cursor == size


def coverage_problems(data: dict) -> list[str]:
    """Tensors the manifest's non-empty chunks do not tile exactly once; pure, O(chunks log chunks).

    Every layout reshard writes is a grid (each dim split on its own), so a tensor is covered exactly when, on every
    dim, the distinct chunk intervals tile the dim, and the distinct chunks are all the cells of that grid. Identical
    chunks are allowed only for replicated tensors (a full copy in every coordinate).
    """
    boxes: dict[str, list[tuple]] = {name: [] for name in data["tensors"]}
    for entry in data["files"]:
        for name, info in entry["tensors"].items():
            if name in boxes and 0 not in info["shape"]:
                boxes[name].append(tuple(zip(info["offsets"], info["shape"])))
    problems = []
    for name, info in data["tensors"].items():
        shape, found = info["shape"], boxes[name]
        distinct = set(found)
        if len(distinct) != len(found) and info["placement"]["kind"] != "replicated":
            problems.append(f"{name}: a chunk is stored twice")
        if 0 in shape:
            continue  # nothing to cover
        per_dim = [sorted({box[d] for box in distinct}) for d in range(len(shape))]
        cells = math.prod(len(intervals) for intervals in per_dim)
        if (not distinct or any(not _tiles(iv, n) for iv, n in zip(per_dim, shape)) or len(distinct) != cells):
            covered = sum(math.prod(n for _, n in box) for box in distinct)
            problems.append(f"{name}: the chunks do not tile the tensor {list(shape)} exactly once "
                            f"({covered} of {math.prod(shape)} elements in {len(distinct)} distinct chunk(s))")
    return problems


def file_crc32(path: str | Path) -> str:
    """CRC-32 of a whole file as the manifest records it (8 hex digits), read through one reused 1 MiB buffer."""
    crc, buffer = 0, bytearray(1 << 20)  # a fresh block per read would cost page faults on every block
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            crc = zlib.crc32(view[:n], crc)
    return f"{crc:08x}"


def dump_manifest(data: dict) -> str:
    """Deterministic JSON: sorted keys, two-space indent, trailing newline."""
    return json.dumps(data, indent=2, sort_keys=True) + "\n"
