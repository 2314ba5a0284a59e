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
import re

from ..errors import ManifestError

MANIFEST_NAME = "reshard.json"
MANIFEST_FORMAT = "reshard"
MANIFEST_VERSION = 3  # 2: file entries name a run of `order`; chunks follow from placements. 3: no `ranks` per coord
READ_VERSIONS = (2, 3)  # a version 2 manifest lists each coordinate's ranks: read, and checked against the mesh
SHARD_FILE = "shard-{coord:05d}-model-{part:05d}-of-{parts:05d}.safetensors"
# A name of that pattern (coord, part, parts), as transformers' own distributed-checkpoint save writes it too.
SHARD_FILE_NAME = re.compile(r"^shard-(\d{5})-model-(\d{5})-of-(\d{5})\.safetensors$")
DCP_SHARDING_INFO_KEY = "DCP_SHARDING_INFO"
DCP_VERSION_KEY = "DCP_VERSION"
DCP_VERSION = "1.0"
SAVED_OFFSETS_KEY = "saved_offsets"
# Tensors the model does not load (MTP layers, ...), whole under their on-disk keys: a name transformers' distributed
# loader does not take for a rank file, listed in the manifest's optional `extras` section, read by no rank.
EXTRA_FILE = "extra-{part:05d}-of-{parts:05d}.safetensors"


def extra_file_name(part: int, parts: int) -> str:
    """File name of extras file `part` (0-based) of `parts`."""
    return EXTRA_FILE.format(part=part + 1, parts=parts)


def shard_file_name(coord: int, part: int, parts: int) -> str:
    """File name of part `part` (0-based) of `parts` for fsdp coordinate `coord` (0-based)."""
    return SHARD_FILE.format(coord=coord + 1, part=part + 1, parts=parts)


def dcp_metadata(offsets: dict[str, list[int]]) -> dict[str, str]:
    """The safetensors `__metadata__` torch's HuggingFaceStorageReader reads chunk offsets from."""
    info = {name: {SAVED_OFFSETS_KEY: list(off)} for name, off in offsets.items()}
    return {DCP_SHARDING_INFO_KEY: json.dumps(info, separators=(",", ":")), DCP_VERSION_KEY: DCP_VERSION,
            "format": "pt"}


def dump_manifest(data: dict) -> str:
    """Deterministic JSON: sorted keys, two-space indent, trailing newline."""
    return json.dumps(data, indent=2, sort_keys=True) + "\n"


# The remedy every refusal of a manifest ends with.
REMEDY = ("Nothing was changed. Restore its reshard.json (or its files) from a good copy, or "
          "write the folder again with `reshard write`.")


def show(value) -> str:
    """`repr(value)`, cut to 200 characters: a message names a hostile value without repeating all of it."""
    text = repr(value)
    return text if len(text) <= 200 else text[:197] + "..."


def reject(key: str, value, why: str):
    """Raise the `ManifestError` for `key` holding `value`: why it is wrong, then the remedy."""
    raise ManifestError([f"{MANIFEST_NAME}: {key} is {show(value)}: {why}. {REMEDY}"])
