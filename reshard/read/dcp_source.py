"""Read a folder in the distributed-checkpoint layout as a source: its chunks, placed in the model's tensors.

Two kinds of folder hold the same layout (per-rank safetensors files whose headers carry `DCP_SHARDING_INFO`, each
tensor under its in-memory name at its `saved_offsets`):

- a reshard folder (`reshard write`): `reshard.json` says which chunk each file holds, and every tensor's role;
- a folder saved by transformers 5.23 `model.save_pretrained(dir, distributed_checkpoint=True)`: rank-local
  `shard-RRRRR-model-00001-of-00001.safetensors` files from any mesh; `config.json` says which model it is (its
  meta model gives every tensor's global shape, role and whether it is a parameter).

`read_dcp_source` turns either into the two things the byte-run machinery needs: a `CheckpointIndex` whose tensors
are the input chunks (one `TensorEntry` each, under a unique synthetic key), and a `ModelLayout` whose tensors are
the in-memory tensors, each with one `Piece` per non-empty chunk at its global offset. `write_shards` then writes
any mesh from it, and `reshard.write.merge` any HF layout, both by copying byte runs. Coverage is checked first,
exactly: a tensor whose chunks overlap, leave a gap, or disagree on dtype is an error naming the region, never
zeros.

The on-disk layout of the checkpoint a folder came from (which on-disk keys, at which offsets, make each in-memory
tensor) is what `reshard merge --layout original` writes back: a reshard folder records it in its manifest
(`source_layout`; folders written before it was recorded can be merged with `--layout fused` only); for a saved
folder it is what transformers' `save_pretrained` would write for that model type (its reverse conversion), mapped
to offsets with the same forward machinery `write` uses.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from .checkpoint import CheckpointIndex, FileHeader, TensorEntry, copied_files, read_config, read_header
from ..errors import CheckpointError
from ..plan.layout import ModelLayout, Piece, Role, TargetTensor, whole_tensor
from ..plan.mesh import ranks_text
from ..manifest import (DCP_SHARDING_INFO_KEY, MANIFEST_NAME, SAVED_OFFSETS_KEY, check_member, coverage_problem,
                        header_problems, read_manifest, recorded_source_layout, region_text, tied_from_record)

SAVED_FILE = re.compile(r"^shard-(\d{5})-model-(\d{5})-of-(\d{5})\.safetensors$")
RESHARD, SAVED = "reshard", "saved"


@dataclass(frozen=True)
class DcpIndex(CheckpointIndex):
    """A `CheckpointIndex` over a distributed-checkpoint folder: `tensors` are its chunks under synthetic keys.

    Attributes:
        kind: `reshard` (a `reshard write` folder) or `saved` (`save_pretrained(..., distributed_checkpoint=True)`).
        original: per in-memory tensor, the on-disk keys of the source layout that make it
            (`reshard.manifest.OnDisk` tuples), or None when unknown (`original_error` says why).
        original_error: why `original` is None.
        tied: in-memory tensors that are tied to another one and are not written into a merged checkpoint.
        crc32: file name -> the CRC-32 its manifest records (a reshard folder); None for a saved folder, which
            records none (`reshard.runs.source_check` checks the files a write reads against it).
    """

    kind: str = SAVED
    original: dict | None = None
    original_error: str | None = None
    tied: tuple[str, ...] = ()
    crc32: dict | None = None

    def on_disk_layout(self, layout: ModelLayout) -> dict | None:
        """What this folder knows of its source's on-disk layout (`original`): its chunks' keys are not it."""
        return self.original


def dcp_kind(source) -> str | None:
    """`reshard`, `saved`, or None when `source` is not a local folder in the distributed-checkpoint layout."""
    path = Path(os.fspath(source))
    if not path.is_dir():
        return None
    if (path / MANIFEST_NAME).is_file():
        return RESHARD
    if any(SAVED_FILE.match(p.name) for p in path.iterdir()):
        return SAVED
    return None


def read_dcp_source(source) -> tuple[DcpIndex, ModelLayout]:
    """Read a reshard folder or a `save_pretrained(..., distributed_checkpoint=True)` folder as a source.

    Args:
        source: the folder.

    Returns:
        (the chunk index, the in-memory layout whose pieces are the chunks).

    Raises:
        CheckpointError: the folder is neither kind; a file is missing, truncated or holds what it should not; a
            tensor's chunks overlap, leave a gap, or have mixed dtypes (each named with the region or the files).
        ArchitectureError: a saved folder's model type is unknown to transformers.
    """
    path = Path(os.fspath(source))
    kind = dcp_kind(path)
    if kind == RESHARD:
        return _read_reshard_folder(path)
    if kind == SAVED:
        return _read_saved_folder(path)
    what = ("no such folder" if not path.is_dir()
            else "no reshard.json and no shard-RRRRR-model-PPPPP-of-NNNNN.safetensors")
    raise CheckpointError(f"{path}: {what}. This is neither a reshard folder (`reshard write`) nor a folder saved by "
                          "transformers' save_pretrained(..., distributed_checkpoint=True); pass one of those. Nothing "
                          "was written.", path=str(path))


def _other_files(path: Path, weights: set[str]) -> tuple[str, ...]:
    return copied_files(path, {*weights, MANIFEST_NAME})  # links out of the folder refused, as for any source


def _chunk_key(file: str, name: str) -> str:
    return f"{file}:{name}"


# ---- a reshard folder ------------------------------------------------------------------------------------------

def _read_reshard_folder(path: Path) -> tuple[DcpIndex, ModelLayout]:
    manifest = read_manifest(path)
    data = manifest.data
    headers: list[FileHeader] = []
    chunks: dict[str, list[tuple[TensorEntry, tuple[int, ...]]]] = {name: [] for name in data["order"]}
    for entry in manifest.files:
        file = path / entry.name
        if not os.path.exists(file):
            ranks = ranks_text(manifest.coords[entry.coord].ranks)
            raise CheckpointError(f"{file}: missing (the file of {ranks}); the folder is incomplete. Copy the "
                                  "file back, or write the folder again. Nothing was written.", path=str(file))
        check_member(path, entry.name)  # a FIFO or a device: refused before it is opened
        header = read_header(file)
        if header.size != entry["bytes"]:
            raise CheckpointError(f"{file}: {header.size} bytes, the manifest says {entry['bytes']}; the file is "
                                  "truncated or replaced. Copy it again. Nothing was written.", path=str(file))
        expected = manifest.chunks(entry)
        problems = header_problems(entry, expected, header)
        if problems:
            raise CheckpointError(f"{file}: its header does not match reshard.json ({'; '.join(problems[:3])}). "
                                  "Nothing was written.", path=str(file))
        headers.append(header)
        by_name = {t.name: t for t in header.tensors}
        for chunk in expected:
            chunks[chunk.name].append((by_name[chunk.name], chunk.offsets))
    tensors, entries = [], {}
    for name in data["order"]:
        info = data["tensors"][name]
        target = _place(name, tuple(info["shape"]), chunks[name], entries, str(path), dtype=info["dtype"])
        tensors.append(TargetTensor(name, target[0], target[1], Role(info["role"]), info["is_param"], target[2]))
    source = data["source"]
    extra_headers, extras, extra_crc32 = _recorded_extras(path, data, entries)
    headers += extra_headers
    layout = ModelLayout(source["model_type"], source["architecture"], tuple(tensors),
                         tuple(t.name for t in extras), extras=extras)
    original, error = recorded_source_layout(data)
    index = DcpIndex(str(path), None, path, read_config(path), tuple(headers), entries,
                     _other_files(path, {h.name for h in headers}), kind=RESHARD, original=original,
                     original_error=error, tied=tied_from_record(original),
                     crc32={**{entry["name"]: entry["crc32"] for entry in data["files"]}, **extra_crc32})
    return index, layout


def _recorded_extras(path: Path, data: dict, entries: dict) -> tuple[list[FileHeader], tuple[TargetTensor, ...], dict]:
    """The extras files the manifest lists (its optional `extras`: tensors the model does not load, whole under their
    on-disk keys), checked like the rank files: present, of the recorded size, holding exactly the recorded keys.

    Returns:
        (their headers, one whole tensor per key with its bytes registered in `entries`, file name -> CRC-32).
    """
    headers, extras, crc32 = [], [], {}
    for entry in data.get("extras") or ():
        file = path / entry["name"]
        if not file.is_file():
            raise CheckpointError(f"{file}: missing (it holds {len(entry['keys'])} tensor(s) the model does not load, "
                                  f"e.g. {entry['keys'][0]}); copy the file back, or write the folder again. Nothing "
                                  "was written.", path=str(file))
        header = read_header(file)
        by_name = {t.name: t for t in header.tensors}
        if header.size != entry["bytes"] or sorted(by_name) != sorted(entry["keys"]):
            raise CheckpointError(f"{file}: {header.size} bytes holding {len(by_name)} tensor(s); reshard.json says "
                                  f"{entry['bytes']} bytes holding {len(entry['keys'])}. The file is truncated or "
                                  "replaced; copy it again. Nothing was written.", path=str(file))
        for key in entry["keys"]:
            t = by_name[key]
            chunk = _chunk_key(entry["name"], key)
            entries[chunk] = TensorEntry(chunk, t.file, t.dtype, t.shape, t.data_start)
            extras.append(whole_tensor(key, t.shape, t.dtype, chunk))
        headers.append(header)
        crc32[entry["name"]] = entry["crc32"]
    return headers, tuple(extras), crc32


# ---- a save_pretrained(distributed_checkpoint=True) folder -------------------------------------------------------

def _saved_files(path: Path) -> list[str]:
    """The rank files, checked complete: ranks 1..R without a hole, each with parts 1..N of the N it names."""
    found: dict[int, dict[int, int]] = {}
    for p in path.iterdir():
        m = SAVED_FILE.match(p.name)
        if m:
            found.setdefault(int(m[1]), {})[int(m[2])] = int(m[3])
    missing = [f"shard-{r:05d}-model-*" for r in range(1, max(found) + 1) if r not in found]
    for r, parts in sorted(found.items()):
        counts = set(parts.values())
        n = max(counts)
        missing += [f"shard-{r:05d}-model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1) if k not in parts]
        if len(counts) > 1:
            missing.append(f"shard-{r:05d}: files say both {sorted(counts)} parts")
    if missing:
        raise CheckpointError(f"{path}: rank file(s) missing: {', '.join(missing[:4])}"
                              f"{' ...' if len(missing) > 4 else ''}. Every rank of the saving job writes one; copy "
                              "the missing file(s) back. Nothing was written.", path=str(path))
    return sorted(p.name for p in path.iterdir() if SAVED_FILE.match(p.name))


def _saved_offsets(header: FileHeader, path: Path) -> dict[str, tuple[int, ...]]:
    try:
        info = json.loads(header.metadata[DCP_SHARDING_INFO_KEY])
        offsets = {name: tuple(info[name][SAVED_OFFSETS_KEY]) for name in (t.name for t in header.tensors)}
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path / header.name}: no {DCP_SHARDING_INFO_KEY} saved_offsets for every tensor "
                              f"({type(e).__name__}: {e}); it was not written by save_pretrained(..., "
                              "distributed_checkpoint=True). Nothing was written.", path=str(path / header.name)) from e
    return offsets


def _read_saved_folder(path: Path) -> tuple[DcpIndex, ModelLayout]:
    from ..errors import ArchitectureError
    from .experts import build_meta_model, expert_param_names, ignore_patterns, tensor_role

    names = _saved_files(path)
    config = read_config(path)
    if not config.get("model_type"):
        raise ArchitectureError(f"{path}: config.json is missing or has no model_type; save_pretrained writes it "
                                "beside the rank files. Copy it back. Nothing was written.")
    headers = [read_header(path / name) for name in names]
    chunks: dict[str, list[tuple[TensorEntry, tuple[int, ...]]]] = {}
    for header in headers:
        offsets = _saved_offsets(header, path)
        for t in header.tensors:
            chunks.setdefault(t.name, []).append((t, offsets[t.name]))
    model = build_meta_model(config)
    meta_state = model.state_dict()
    buffers = {name for name, _ in model.named_buffers()}
    experts, expert_parallel = expert_param_names(model)
    tied_map = dict(getattr(model, "all_tied_weights_keys", None) or {})
    unknown = sorted(set(chunks) - set(meta_state))
    if unknown:
        raise CheckpointError(f"{path}: the files hold {unknown[:3]}, which the {config['model_type']} model of "
                              "config.json does not have; config.json and the files disagree. Nothing was written.",
                              path=str(path))
    tensors, entries, tied = [], {}, []
    for name, meta in meta_state.items():
        found = chunks.get(name)
        if not found and tied_map.get(name) in chunks:
            found = chunks[tied_map[name]]  # a tied weight saved once
            tied.append(name)
        if not found:
            raise CheckpointError(f"{path}: no file holds any chunk of {name}; a rank file is missing or the save did "
                                  "not finish. Nothing was written.", path=str(path))
        shape, dtype, pieces = _place(name, tuple(meta.shape), found, entries, str(path))
        tensors.append(TargetTensor(name, shape, dtype, tensor_role(name, name in experts), name not in buffers,
                                    pieces))
    # no extras (save_pretrained keeps only what the model loads); the patterns say what `merge` leaves out
    layout = ModelLayout(config["model_type"], type(model).__name__, tuple(tensors), (), expert_parallel,
                         ignore_patterns=ignore_patterns(model))
    try:
        original, error = _reverse_conversion(model, layout, set(tied)), None
    except Exception as e:  # noqa: BLE001 - any failure of transformers' reverse conversion: original unavailable
        original, error = None, (f"{config['model_type']}: transformers' save_pretrained layout cannot be written by "
                                 f"slicing ({e}); use --layout fused")
    index = DcpIndex(str(path), None, path, config, tuple(headers), entries, _other_files(path, set(names)),
                     kind=SAVED, original=original, original_error=error, tied=tuple(tied))
    return index, layout


def _reverse_conversion(model, layout: ModelLayout, tied: set[str]) -> dict:
    """The keys and shapes transformers' `save_pretrained` writes for this model (its reverse weight conversion, on
    the meta model), placed in the in-memory tensors with the forward mapping `write` uses (`layout_from_model`).

    Raises:
        ReshardError: a converter uses an op that is not a slicing (named by `layout_from_model`).
    """
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    from .experts import layout_from_model

    state = model.state_dict()
    for key in getattr(model, "_keys_to_ignore_on_save", None) or ():
        state.pop(key, None)
    state = remove_tied_weights_from_state_dict(state, model)
    reverted = revert_weight_conversion(model, state)
    fake = {key: TensorEntry(key, "<save_pretrained>", "F32", tuple(t.shape), 0) for key, t in reverted.items()}
    synthetic = CheckpointIndex("<save_pretrained>", None, None, {"model_type": layout.model_type}, (), fake)
    mapped = layout_from_model(model, synthetic, by_template=False)
    if mapped.ignored_sources:
        raise CheckpointError(f"the reverse conversion writes {list(mapped.ignored_sources[:3])}, which loading "
                              "would not use")
    return {t.name: [(p.source, p.offset, p.stacked_dim, fake[p.source].shape) for p in t.pieces]
            for t in mapped.tensors if t.name not in tied}


# ---- coverage ---------------------------------------------------------------------------------------------------

def _place(name, shape, found, entries, where, *, dtype=None):
    """Check one tensor's chunks (`(entry, offsets)` pairs) and register its non-empty ones in `entries`.

    Returns:
        (shape, dtype, pieces).
    """
    dtypes = {}
    distinct: dict[tuple, TensorEntry] = {}  # box -> the first chunk holding it (replicated copies are one)
    for entry, offsets in found:
        dtypes.setdefault(entry.dtype, entry.file)
        if len(offsets) != len(shape) or len(entry.shape) != len(shape):
            raise CheckpointError(f"{where}: {entry.file} holds {name} as {list(entry.shape)} at offsets "
                                  f"{list(offsets)}, which does not fit its shape {list(shape)}. Nothing was "
                                  "written.", path=where)
        if 0 in entry.shape:
            continue  # an explicit empty marker
        if any(o + n > s for o, n, s in zip(offsets, entry.shape, shape)):
            raise CheckpointError(f"{where}: {entry.file} holds {name}[{region_text(offsets, entry.shape)}], outside its "
                                  f"shape {list(shape)}. Nothing was written.", path=where)
        distinct.setdefault(tuple(zip(offsets, entry.shape)), entry)
    if dtype is not None:
        dtypes.setdefault(dtype, "reshard.json")
    if len(dtypes) > 1:
        raise CheckpointError(f"{where}: the chunks of {name} disagree on its dtype ("
                              f"{', '.join(f'{d} in {f}' for d, f in dtypes.items())}); they come from different "
                              "saves. Nothing was written.", path=where)
    problem = coverage_problem(shape, list(distinct), gap_hint=" (a rank file is missing or incomplete)")
    if problem:
        raise CheckpointError(f"{where}: {name} {list(shape)}: {problem}. Nothing was written.", path=where)
    pieces = []
    for box, entry in distinct.items():
        key = _chunk_key(entry.file, name)
        entries[key] = TensorEntry(key, entry.file, entry.dtype, entry.shape, entry.data_start)
        pieces.append(Piece(key, tuple(o for o, _ in box)))
    if not dtypes:
        raise CheckpointError(f"{where}: no chunk of {name}. Nothing was written.", path=where)
    return shape, dtype or next(iter(dtypes)), tuple(pieces)
