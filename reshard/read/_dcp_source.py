"""Read a folder in the distributed-checkpoint layout as a source: its chunks, placed in the model's tensors.

Two kinds of folder hold the same layout (per-rank safetensors files whose headers carry `DCP_SHARDING_INFO`, each
tensor under its in-memory name at its `saved_offsets`):

- a reshard folder (`reshard write`): `reshard.json` says which chunk each file holds, and every tensor's role;
- a folder saved by transformers 5.23 `model.save_pretrained(dir, distributed_checkpoint=True)`: rank-local
  `shard-RRRRR-model-00001-of-00001.safetensors` files from any mesh; `config.json` says which model it is (its
  meta model gives every tensor's global shape, role and whether it is a parameter).

`read_dcp_source` (which `reshard.read.open_source` calls for these kinds) turns either into the two things
the byte-run machinery needs: a `CheckpointIndex` whose tensors are the input chunks (one `TensorEntry` each, under
a unique synthetic key), and a `ModelLayout` whose tensors are the in-memory tensors, each with one `Piece` per
non-empty chunk at its global offset. `reshard.write._shards` then writes any mesh from it, and `reshard.write._merge`
any HF layout, both by copying byte runs. Coverage is checked first, exactly: a tensor whose chunks overlap, leave a
gap, or disagree on dtype is an error naming the region, never zeros.

The on-disk layout of the checkpoint a folder came from (which on-disk keys, at which offsets, make each in-memory
tensor) is what `reshard merge --layout original` writes back: a reshard folder records it in its manifest
(`source_layout`; folders written before it was recorded can be merged with `--layout fused` only); for a saved
folder it is what transformers' `save_pretrained` would write for that model type (its reverse conversion), mapped
to offsets with the same forward machinery `write` uses.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..errors import CheckpointError
from ..manifest import (DCP_SHARDING_INFO_KEY, MANIFEST_NAME, SAVED_OFFSETS_KEY, SHARD_FILE_NAME, coverage_problem,
                        header_problems, read_manifest, region_text, tied_from_record)
from ..plan import ModelLayout, Piece, RankSpans, TargetTensor, ranks_text, role_of, whole_tensor
from ..words import plural
from ._checkpoint import CheckpointIndex, SourceKind, copied_files, read_config
from ._config_bounds import check_config_bounds
from ._safetensors_header import FileHeader, TensorEntry, header_of

@dataclass(frozen=True)
class DcpIndex(CheckpointIndex):
    """A `CheckpointIndex` over a distributed-checkpoint folder: `tensors` are its chunks under synthetic keys.

    Attributes:
        kind: `SourceKind.RESHARD` (a `reshard write` folder) or `SourceKind.SAVED` (`save_pretrained(...,
            distributed_checkpoint=True)`).
        original: per in-memory tensor, the on-disk keys of the source layout that make it
            (`reshard.manifest._source_layout.OnDisk` tuples), or None when unknown (`original_error` says why).
        original_error: why `original` is None.
        tied: in-memory tensors that are tied to another one and are not written into a merged checkpoint.
        crc32: file name -> the CRC-32 its manifest records (a reshard folder); None for a saved folder, which
            records none (the engine checks the files a write reads against it).
        manifest: a reshard folder's manifest (`reshard.manifest.Manifest`), None for a saved folder.
    """

    kind: SourceKind = SourceKind.SAVED
    original: dict | None = None
    original_error: str | None = None
    tied: tuple[str, ...] = ()
    crc32: dict | None = None
    manifest: object = None

    def on_disk_layout(self, layout: ModelLayout) -> dict | None:
        """What this folder knows of its source's on-disk layout (`original`): its chunks' keys are not it."""
        return self.original


def read_dcp_source(location) -> tuple[DcpIndex, ModelLayout]:
    """Read a reshard folder or a `save_pretrained(..., distributed_checkpoint=True)` folder as a source.

    Args:
        location: where the folder is (`reshard.read._source._Location`, of kind reshard or saved).

    Returns:
        (the chunk index, the in-memory layout whose pieces are the chunks).

    Raises:
        CheckpointError: a file is missing, truncated or holds what it should not; a tensor's chunks overlap, leave
            a gap, or have mixed dtypes (each named with the region or the files).
        ArchitectureError: a saved folder's model type is unknown to transformers.
    """
    if location.kind is SourceKind.RESHARD:
        return _read_reshard_folder(location.store, location.spec)
    if location.kind is SourceKind.SAVED:
        return _read_saved_folder(location.store, location.spec)
    raise CheckpointError(f"{location.spec}: no reshard.json and no shard-RRRRR-model-PPPPP-of-NNNNN.safetensors. This "
                          "is neither a reshard folder (`reshard write`) nor a folder saved by transformers' "
                          "save_pretrained(..., distributed_checkpoint=True); pass one of those. Nothing was written.",
                          path=location.spec)


def _chunk_key(file: str, name: str) -> str:
    return f"{file}:{name}"


# ---- a reshard folder ------------------------------------------------------------------------------------------

def _checked_header(store, entry, spec: str, manifest, holds: str) -> FileHeader:
    """File `entry` of a reshard folder: present, of its recorded size, its header what the manifest derives."""
    where = store.url(entry.name)
    if not store.exists(entry.name):
        raise CheckpointError(f"{where}: missing ({holds}); the folder is incomplete. Copy the file back, or write "
                              "the folder again. Nothing was written.", path=where)
    header = header_of(store, entry.name)  # a FIFO or a device: refused before it is opened
    if header.size != entry.bytes:
        raise CheckpointError(f"{where}: {header.size} bytes, the manifest says {entry.bytes}; the file is "
                              "truncated or replaced. Copy it again. Nothing was written.", path=where)
    if manifest is not None and (problems := header_problems(entry, manifest.chunks(entry), header)):
        raise CheckpointError(f"{where}: its header does not match reshard.json ({'; '.join(problems[:3])}). "
                              "Nothing was written.", path=where)
    return header


def _read_reshard_folder(store, spec: str) -> tuple[DcpIndex, ModelLayout]:
    manifest = read_manifest(store)  # a ManifestError names the key and the value
    if manifest.holds is not None:  # joined copies (`--node-local`) hold every rank's files: their manifest no `holds`
        raise CheckpointError(
            f"{spec} is a node's copy: it holds the files of ranks {RankSpans(manifest.holds)} only, not the whole "
            f"checkpoint. Compare with the checkpoint it was written from ({manifest.source.source}), check the copy "
            f"itself with `reshard verify {spec}`, or merge every node's copy with `torchrun ... -m reshard merge "
            f"{spec} DEST --node-local`.", path=spec)
    headers: list[FileHeader] = []
    chunks: dict[str, list[tuple[TensorEntry, tuple[int, ...]]]] = {name: [] for name in manifest.order}
    for entry in manifest.files:
        holds = f"the file of {ranks_text(manifest.coords[entry.coord].ranks)}"
        header = _checked_header(store, entry, spec, manifest, holds)
        headers.append(header)
        by_name = {t.name: t for t in header.tensors}
        for chunk in manifest.chunks(entry):
            chunks[chunk.name].append((by_name[chunk.name], chunk.offsets))
    tensors, entries = [], {}
    for name in manifest.order:
        info = manifest.tensors[name]
        target = _place(name, info.shape, chunks[name], entries, spec, dtype=info.dtype)
        tensors.append(TargetTensor(name, target[0], target[1], info.role, info.is_param, target[2]))
    extra_headers, extras = _recorded_extras(store, manifest, entries, spec)
    headers += extra_headers
    layout = ModelLayout(manifest.source.model_type, manifest.source.architecture, tuple(tensors),
                         tuple(t.name for t in extras), extras=extras)
    original, error = manifest.original_layout()
    crc32 = {**{e.name: e.crc32 for e in manifest.files}, **{e.name: e.crc32 for e in manifest.extras}}
    index = DcpIndex(spec, None, store, read_config(store), tuple(headers), entries,
                     copied_files(store, {h.name for h in headers} | {MANIFEST_NAME}), kind=SourceKind.RESHARD,
                     original=original, original_error=error, tied=tied_from_record(original), crc32=crc32,
                     manifest=manifest)
    return index, layout


def _recorded_extras(store, manifest, entries: dict, spec: str) -> tuple[list[FileHeader], tuple[TargetTensor, ...]]:
    """The extras files the manifest lists (tensors the model does not load, whole under their on-disk keys),
    checked like the rank files: present, of the recorded size, holding exactly the recorded keys.

    Returns:
        (their headers, one whole tensor per key with its bytes registered in `entries`).
    """
    headers, extras = [], []
    for entry in manifest.extras:
        holds = f"it holds {plural(len(entry.keys), 'tensor')} the model does not load, e.g. {entry.keys[0]}"
        header = _checked_header(store, entry, spec, None, holds)
        by_name = {t.name: t for t in header.tensors}
        if sorted(by_name) != sorted(entry.keys):
            raise CheckpointError(f"{store.url(entry.name)}: holds {len(by_name)} tensor(s); reshard.json says "
                                  f"{len(entry.keys)}. The file is replaced; copy it again. Nothing was written.",
                                  path=spec)
        for key in entry.keys:
            t = by_name[key]
            chunk = _chunk_key(entry.name, key)
            entries[chunk] = TensorEntry(chunk, t.file, t.dtype, t.shape, t.data_start)
            extras.append(whole_tensor(key, t.shape, t.dtype, chunk))
        headers.append(header)
    return headers, tuple(extras)


# ---- a save_pretrained(distributed_checkpoint=True) folder -------------------------------------------------------

def _saved_files(names, where: str) -> list[str]:
    """The rank files, checked complete: ranks 1..R without a hole, each with parts 1..N of the N it names."""
    found: dict[int, dict[int, int]] = {}
    for name in names:
        m = SHARD_FILE_NAME.match(name)
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
        raise CheckpointError(f"{where}: {plural(len(missing), 'rank file')} missing: {', '.join(missing[:4])}"
                              f"{' ...' if len(missing) > 4 else ''}. Every rank of the saving job writes one; copy "
                              "each missing file back. Nothing was written.", path=where)
    return sorted(name for name in names if SHARD_FILE_NAME.match(name))


def _saved_offsets(header: FileHeader, where: str) -> dict[str, tuple[int, ...]]:
    try:
        info = json.loads(header.metadata[DCP_SHARDING_INFO_KEY])
        offsets = {name: tuple(info[name][SAVED_OFFSETS_KEY]) for name in (t.name for t in header.tensors)}
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{where}/{header.name}: no {DCP_SHARDING_INFO_KEY} saved_offsets for every tensor "
                              f"({type(e).__name__}: {e}); it was not written by save_pretrained(..., "
                              "distributed_checkpoint=True). Nothing was written.", path=where) from e
    return offsets


def _read_saved_folder(store, spec: str) -> tuple[DcpIndex, ModelLayout]:
    from ..errors import ArchitectureError
    from ._experts import build_meta_model, expert_param_names, ignore_patterns

    names = _saved_files(store.names(), spec)
    config = read_config(store)
    if not config.get("model_type"):
        raise ArchitectureError(f"{spec}: config.json is missing or has no model_type; save_pretrained writes it "
                                "beside the rank files. Copy it back. Nothing was written.")
    headers = [header_of(store, name) for name in names]
    chunks: dict[str, list[tuple[TensorEntry, tuple[int, ...]]]] = {}
    for header in headers:
        offsets = _saved_offsets(header, spec)
        for t in header.tensors:
            chunks.setdefault(t.name, []).append((t, offsets[t.name]))
    check_config_bounds(config, ((name, tuple(o + n for (o, n) in zip(at, t.shape))) for name, found in chunks.items()
                                 for t, at in found), where=spec, rank_files=len(names))  # far corners of chunks
    model = build_meta_model(config)
    meta_state = model.state_dict()
    buffers = {name for name, _ in model.named_buffers()}
    experts, expert_parallel = expert_param_names(model)
    tied_map = dict(getattr(model, "all_tied_weights_keys", None) or {})
    unknown = sorted(set(chunks) - set(meta_state))
    if unknown:
        raise CheckpointError(f"{spec}: the files hold {unknown[:3]}, which the {config['model_type']} model of "
                              "config.json does not have; config.json and the files disagree. Nothing was written.",
                              path=spec)
    tensors, entries, tied = [], {}, []
    for name, meta in meta_state.items():
        found = chunks.get(name)
        if not found and tied_map.get(name) in chunks:
            found = chunks[tied_map[name]]  # a tied weight saved once
            tied.append(name)
        if not found:
            raise CheckpointError(f"{spec}: no file holds any chunk of {name}; a rank file is missing or the save did "
                                  "not finish. Nothing was written.", path=spec)
        shape, dtype, pieces = _place(name, tuple(meta.shape), found, entries, spec)
        tensors.append(TargetTensor(name, shape, dtype, role_of(name, name in experts), name not in buffers,
                                    pieces))
    # no extras (save_pretrained keeps only what the model loads); the patterns say what `merge` leaves out
    layout = ModelLayout(config["model_type"], type(model).__name__, tuple(tensors), (), expert_parallel,
                         ignore_patterns=ignore_patterns(model))
    try:
        original, error = _reverse_conversion(model, layout, set(tied)), None
    except Exception as e:  # noqa: BLE001 - any failure of transformers' reverse conversion: original unavailable
        original, error = None, (f"{config['model_type']}: transformers' save_pretrained layout cannot be written by "
                                 f"slicing ({e}); use --layout fused")
    index = DcpIndex(spec, None, store, config, tuple(headers), entries, copied_files(store, set(names)),
                     kind=SourceKind.SAVED, original=original, original_error=error, tied=tuple(tied))
    return index, layout


def _reverse_conversion(model, layout: ModelLayout, tied: set[str]) -> dict:
    """The keys and shapes transformers' `save_pretrained` writes for this model (its reverse weight conversion, on
    the meta model), placed in the in-memory tensors with the forward mapping `write` uses (`layout_from_model`).

    Raises:
        ReshardError: a converter uses an op that is not a slicing (named by `layout_from_model`).
    """
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    from ._experts import layout_from_model

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
            raise CheckpointError(f"{where}: {entry.file} holds {name}[{region_text(offsets, entry.shape)}], outside "
                                  f"its shape {list(shape)}. Nothing was written.", path=where)
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
