"""Merge a distributed checkpoint into a standard Hugging Face checkpoint, by copying byte runs.

The input is a reshard folder or a folder saved by `save_pretrained(..., distributed_checkpoint=True)`
(`reshard.read._dcp_source`); the output is what the Hub, vLLM, SGLang and `from_pretrained` expect:
`model-0000N-of-0000M.safetensors` files of at most `max_shard_size`, `model.safetensors.index.json` with
`metadata.total_size`, and the config and tokenizer files. Every output tensor is a box of an in-memory tensor (a
per-expert key `experts.3.gate_proj.weight` [I, H] is `gate_up_proj[3, 0:I, :]`, the expert dim dropped: the same
bytes), built from the byte runs of the chunks that cover it (`write.chunk_runs`), copied by the kernel; memory
holds the plan and one copy buffer, never a tensor. The folder is written like `write` writes: in a temporary folder
beside DEST, fsynced, renamed into place; the same lock, the same `--overwrite` rules (DEST may be replaced only when
it is empty, a complete merge output or a reshard output), nothing partial on any failure or interruption.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from .. import __version__
from ..errors import CheckpointError
from ..manifest import MANIFEST_NAME
from ..plan import Box, ChunkSpec, DTYPE_BITS, MergeLayout, ModelLayout, TargetTensor, split_parts
from ..read import DcpIndex, INDEX_NAME, SourceKind
from ..runs import Engine, SourceCrcs
from ..words import plural
from ._files import copy_source_file, files_at_once, safetensors_header, write_safetensors, write_safetensors_together
from ._merge_index import MergedFile, MergeIndex
from ._output import headers_digest
from ._replaceable import MERGE_OUTPUT
from ._staged import StagedOutput, fsync_path, staged_output

DEFAULT_MAX_SHARD_SIZE = 5 * 10**9  # 5GB, transformers' and the Hub's default
_MERGE_FILE = "model-{part:05d}-of-{parts:05d}.safetensors"


@dataclass(frozen=True)
class _OutputTensor:
    """One tensor of the merged checkpoint: a box of an in-memory tensor, under its output key.

    Attributes:
        key: the output key (an on-disk key of the source layout, or the in-memory name).
        shape: its shape in the output (the box without a stacked expert dim).
        target: the in-memory tensor whose chunks hold it.
        box: `(offset, length)` per dim of `target`.
    """

    key: str
    shape: tuple[int, ...]
    target: TargetTensor
    box: Box

    @property
    def dtype(self) -> str:
        return self.target.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_BITS[self.dtype] // 8


def _natural_key(key: str):
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", key)]


def merge_tensors(index: DcpIndex, layout: ModelLayout, *, layout_mode: MergeLayout | str = MergeLayout.ORIGINAL
                  ) -> list[_OutputTensor]:
    """The output tensors, in natural key order: the model's tensors named as `layout_mode` names them
    (`OUTPUT_NAMES`), then the tensors the model does not load, back under their own keys.

    Raises:
        CheckpointError: `original` is asked but the source layout is unknown (a reshard folder written before it was
            recorded) or cannot be written by slicing; the message says to use `fused`.
    """
    out = OUTPUT_NAMES[MergeLayout(layout_mode)](index, layout)
    keys = {t.key for t in out}
    for t in layout.extras:  # tensors the model does not load (MTP layers): back under their own keys, either layout
        if t.name in keys:
            raise CheckpointError(f"{index.source}: {t.name} is both a tensor of the model and one it does not load "
                                  "(an extra); the extras would overwrite a trained tensor. Nothing was written.",
                                  path=index.source)
        out.append(_OutputTensor(t.name, t.shape, t, tuple((0, n) for n in t.shape)))
    out.sort(key=lambda t: _natural_key(t.key))
    return out


def _fused_names(index: DcpIndex, layout: ModelLayout) -> list[_OutputTensor]:
    """Every in-memory tensor whole under its own name (tied copies once)."""
    return [_OutputTensor(t.name, t.shape, t, tuple((0, n) for n in t.shape)) for t in layout.tensors
            if t.name not in index.tied]


def _original_names(index: DcpIndex, layout: ModelLayout) -> list[_OutputTensor]:
    """The source checkpoint's on-disk keys, each a box of the in-memory tensor it was composed into."""
    if index.original is None:
        raise CheckpointError(f"{index.source}: the source's on-disk layout is unknown: {index.original_error}. "
                              "Nothing was written.", path=index.source)
    targets, out, seen = layout.by_name(), [], set()
    for name, pieces in index.original.items():
        target = targets.get(name)
        if target is None:
            raise CheckpointError(f"{index.source}: the recorded source layout names {name}, which the folder "
                                  "does not hold; reshard.json is damaged. Nothing was written.", path=index.source)
        for key, offset, stacked, shape in pieces:
            if key in seen:
                continue  # a tied weight stored once
            seen.add(key)
            extent = list(shape)
            if stacked is not None:
                extent.insert(stacked, 1)
            box = tuple(zip(offset, extent))
            if len(box) != len(target.shape) or any(o + n > s for (o, n), s in zip(box, target.shape)):
                raise CheckpointError(f"{index.source}: the recorded {key} {list(shape)} at {list(offset)} does "
                                      f"not fit {name} {list(target.shape)}. Nothing was written.", path=index.source)
            out.append(_OutputTensor(key, tuple(shape), target, box))
    return out


# How each output layout names the model's tensors: the seam where another target's names (torchtitan's FQNs, say)
# would plug in, as a `MergeLayout` value and a function here (docs/development.md).
OUTPUT_NAMES = {MergeLayout.ORIGINAL: _original_names, MergeLayout.FUSED: _fused_names}


# config.json fields a training run or a re-save may change without changing the model (`--extras-from`'s check)
_CONFIG_FIELDS_NOT_COMPARED = frozenset({"transformers_version", "dtype", "torch_dtype", "use_cache", "_name_or_path",
                                        "quantization_config"})


_EXTRAS_FROM = "extras-from/"  # the `--extras-from` source's file names inside the merged index


def _with_extras_from(index: DcpIndex, layout: ModelLayout, other) -> tuple[DcpIndex, ModelLayout]:
    """`index` and `layout` of a trained folder, plus the extras of `other` (a `_Source`): the reshard folder or HF
    checkpoint the training started from (a folder saved with `save_pretrained(..., distributed_checkpoint=True)`
    holds only the tensors the model loads).

    The two become one source: `other`'s files are read through one store with the trained folder's, under the
    prefix `_EXTRAS_FROM` (`reshard.read.JoinedStore`), and a reshard folder's CRC-32s still check them.

    Raises:
        UsageError: `other` is quantized (its extras are not bf16 bytes), holds no extras, or is another model (a
            `config.json` field both have differs, beyond `_CONFIG_FIELDS_NOT_COMPARED`), or the trained folder already
            has extras.
    """
    from dataclasses import replace

    from ..errors import UsageError
    from ..read import JoinedStore

    where = f"--extras-from {other.spec}"
    if layout.extras:
        raise UsageError(f"{where}: {index.source} already holds {plural(len(layout.extras), 'tensor')} the model "
                         "does not load; merge writes those back. Leave out --extras-from. Nothing was written.")
    if other.quantization is not None:
        raise UsageError(f"{where}: a quantized checkpoint; its extras are quantized bytes, not the bf16 tensors "
                         "of the trained model. Pass the reshard folder written from it with --dequantize bf16. "
                         "Nothing was written.")
    source, other_layout = other.index, other.model_layout()
    differ = sorted(k for k in set(index.config) & set(source.config) - _CONFIG_FIELDS_NOT_COMPARED
                    if index.config[k] != source.config[k])
    if not source.config.get("model_type") or differ:
        shown = ", ".join(f"{k}: {source.config[k]!r} there, {index.config[k]!r} here" for k in differ[:3])
        raise UsageError(f"{where}: not the same model as {index.source} ({shown or 'no model_type in its config'}); "
                         "pass the folder the training started from. Nothing was written.")
    if not other_layout.extras:
        raise UsageError(f"{where}: it holds no tensors the model does not load, so there is nothing to take. "
                         "Nothing was written.")
    entries, extras = {}, []
    for t in other_layout.extras:
        entry = source.tensors[t.pieces[0].source]
        key = f"<extras-from>:{entry.name}"
        entries[key] = replace(entry, name=key, file=_EXTRAS_FROM + entry.file)
        extras.append(replace(t, pieces=(replace(t.pieces[0], source=key),)))
    files = {e.file for e in entries.values()}
    crc32 = {_EXTRAS_FROM + name: crc for name, crc in (source.crc32 or {}).items()}
    merged = replace(index, store=JoinedStore(index.store, _EXTRAS_FROM, source.store),
                     tensors={**index.tensors, **entries},
                     files=(*index.files, *(replace(h, name=_EXTRAS_FROM + h.name) for h in source.files
                                            if _EXTRAS_FROM + h.name in files)),
                     crc32={**(index.crc32 or {}), **crc32} if (index.crc32 or crc32) else None)
    return merged, replace(layout, ignored_sources=tuple(t.name for t in extras), extras=tuple(extras))


def left_out(index: DcpIndex, layout: ModelLayout) -> str | None:
    """What a merge of `index` leaves out that its checkpoint may have carried, or None: the tensors the model does
    not load, absent from a saved folder and from a reshard folder written with `--drop-unloaded`."""
    if layout.extras:
        return None
    if index.kind is SourceKind.RESHARD:
        dropped = index.manifest.dropped_unloaded
        if not dropped:
            return None
        return (f"{index.source} was written with --drop-unloaded: {plural(dropped, 'tensor')} its source held "
                "that the model does not load are not in it; pass --extras-from with that source to write them back")
    patterns = layout.ignore_patterns
    dropped = f" (this model class drops {', '.join(patterns)} on load)" if patterns else ""
    return (f"{index.source} was saved with save_pretrained(..., distributed_checkpoint=True), which keeps only the "
            f"tensors the model loads: any its checkpoint carried beside them{dropped}, such as MTP layers, are not "
            "in it; pass --extras-from with the reshard folder or checkpoint the training started from to write them "
            "back")


@dataclass(frozen=True)
class MergeJob:
    """A `merge` as an output job (`reshard.write._output._OutputJob`): its units are the output files.

    Attributes:
        index, layout: the source (a reshard or saved folder, with any `--extras-from` tensors joined in).
        parts: the output tensors of each output file.
        layout_mode: how the tensors are named.
        extras_from: the `--extras-from` source as given, or None.
        checked: every source file read has a CRC-32 in its manifest to check against.
    """

    index: DcpIndex
    layout: ModelLayout
    parts: tuple[tuple[_OutputTensor, ...], ...]
    layout_mode: MergeLayout
    max_shard_size: int | None
    extras_from: str | None = None
    checked: bool = False
    command = "merge"
    compute = False

    @cached_property
    def names(self) -> list[str]:
        return [_MERGE_FILE.format(part=i + 1, parts=len(self.parts)) for i in range(len(self.parts))]

    @cached_property
    def unit_sizes(self) -> list[int]:
        return [sum(t.nbytes for t in part) for part in self.parts]

    @property
    def units(self) -> list[int]:
        return list(range(len(self.parts)))

    @property
    def copied(self) -> list[str]:
        return [name for name in self.index.other_files if name not in self.names and name != INDEX_NAME]

    def staged(self, out, overwrite: bool) -> StagedOutput:
        return staged_output(out, overwrite, self.index, rule=MERGE_OUTPUT, markers=("config.json", INDEX_NAME),
                             what="DEST")

    def needed_bytes(self) -> int:
        return sum(self.unit_sizes) + sum(self.index.store.size(name) for name in self.copied)

    def write_units(self, tmp: Path, units, *, progress=None, fsync: bool = False,
                    source_crcs: SourceCrcs | None = None, on_file=None) -> list[tuple[int, MergedFile]]:
        units = list(units)
        engine = Engine(self.index, progress, source_crcs, planned_bytes=sum(self.unit_sizes[u] for u in units))
        entries, at_once = [], files_at_once(engine, on_file)
        try:
            for first in range(0, len(units), at_once):
                group = units[first:first + at_once]
                self.write_files(tmp, group, engine)
                for unit in group:
                    if fsync:
                        fsync_path(tmp / self.names[unit])
                    if on_file is not None:
                        on_file(tmp / self.names[unit])
                    entries.append(self.entry(unit))
            engine.finish()  # without `source_crcs`: a damaged source file is refused before anything is kept
        finally:
            engine.close()
        return entries

    def write_files(self, tmp: Path, units: list[int], engine: Engine) -> None:
        """Write output files `units` into `tmp`: one by one or, from a remote source, together."""
        if len(units) == 1:
            header, boxes = self.file_layout(units[0])
            write_safetensors(tmp / self.names[units[0]], [], boxes, None, engine, checksum=False, header=header)
            return
        write_safetensors_together([(tmp / self.names[u], *self.file_layout(u)) for u in units], engine,
                                   checksum=False)

    def file_layout(self, unit: int) -> tuple[bytes, list]:
        """Output file `unit`'s safetensors header and its chunks `(nbytes, tensor, box)`, in file order."""
        tensors = self.parts[unit]
        chunks = [ChunkSpec(t.key, t.dtype, t.shape, (), t.nbytes, i) for i, t in enumerate(tensors)]
        return safetensors_header(chunks, {"format": "pt"}), [(t.nbytes, t.target, t.box) for t in tensors]

    def entry(self, unit: int) -> tuple[int, MergedFile]:
        """Output file `unit`'s entry for `finish`: its name and keys."""
        return unit, MergedFile(self.names[unit], tuple(t.key for t in self.parts[unit]))

    def finish(self, tmp: Path, entries: list[MergedFile], out: Path, source_crcs: SourceCrcs) -> MergeIndex:
        """The copied files and the index, last (no weight is read: `source_crcs` is as the writers left it);
        returns the index."""
        for name in self.copied:
            copy_source_file(self.index.store, name, tmp / name)
        index = MergeIndex.of_merge(entries, sum(self.unit_sizes), self.layout_mode, self.copied, self.extras_from,
                                    f"reshard {__version__}")
        (tmp / INDEX_NAME).write_text(index.to_json())
        return index

    def identity(self, out: Path, overwrite: bool) -> dict:
        return {"OUT": str(out), "layout": self.layout_mode.value,
                "options": f"max_shard_size={self.max_shard_size} overwrite={overwrite} "
                           f"extras_from={self.extras_from}",
                "SRC's safetensors headers": headers_digest(self.index)}


def merge_job(source, *, max_shard_size: int | None = DEFAULT_MAX_SHARD_SIZE,
              layout: MergeLayout | str = MergeLayout.ORIGINAL, extras_from=None) -> MergeJob:
    """Plan the merge of `source` (a `reshard.read._source._Source`: a reshard or saved folder), with the tensors the
    model does not load taken from `extras_from` (a `_Source`, or None); checked before anything is written.

    Raises:
        CheckpointError: `source` is a checkpoint, not a folder in the distributed-checkpoint layout.
    """
    if source.kind is SourceKind.CHECKPOINT:
        raise CheckpointError(f"{source.spec}: neither a reshard folder (`reshard write`) nor a folder saved by "
                              "transformers' save_pretrained(..., distributed_checkpoint=True): no reshard.json and no "
                              "shard-RRRRR-model-PPPPP-of-NNNNN.safetensors; pass one of those. To write a checkpoint "
                              "for a mesh instead: `reshard write SRC OUT --fsdp N`. Nothing was written.",
                              path=source.spec)
    index, model_layout = source.index, source.model_layout()
    checked = index.crc32 is not None
    if extras_from is not None:
        index, model_layout = _with_extras_from(index, model_layout, extras_from)
    tensors = merge_tensors(index, model_layout, layout_mode=layout)
    parts = split_parts(tensors, max_shard_size, nbytes=lambda t: t.nbytes)
    return MergeJob(index, model_layout, tuple(tuple(p) for p in parts), MergeLayout(layout), max_shard_size,
                    None if extras_from is None else extras_from.location.absolute, checked)


def _is_merged_folder(folder) -> bool:
    """Whether `folder` is a plain HF checkpoint (an index or `*.safetensors`, no reshard manifest): what `verify`
    checks as a merge output."""
    path = Path(folder)
    if not path.is_dir() or (path / MANIFEST_NAME).exists():
        return False
    return (path / INDEX_NAME).is_file() or any(p.suffix == ".safetensors" and not p.name.startswith("shard-")
                                                 for p in path.iterdir())
