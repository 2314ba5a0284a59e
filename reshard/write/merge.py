"""Merge a distributed checkpoint into a standard Hugging Face checkpoint, by copying byte runs.

The input is a reshard folder or a folder saved by `save_pretrained(..., distributed_checkpoint=True)`
(`reshard.read.dcp_source`); the output is what the Hub, vLLM, SGLang and `from_pretrained` expect:
`model-0000N-of-0000M.safetensors` files of at most `max_shard_size`, `model.safetensors.index.json` with
`metadata.total_size`, and the config and tokenizer files. Every output tensor is a box of an in-memory tensor (a
per-expert key `experts.3.gate_proj.weight` [I, H] is `gate_up_proj[3, 0:I, :]`, the expert dim dropped: the same
bytes), built from the byte runs of the chunks that cover it (`write.chunk_runs`), copied by the kernel; memory
holds the plan and one copy buffer, never a tensor. The folder is written like `write` writes: in a temporary folder
beside DEST, fsynced, renamed into place; the same lock, the same `--overwrite` rules (DEST may be replaced only when
it is empty, a complete merge output or a reshard output), nothing partial on any failure or interruption.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from .. import __version__
from ..errors import CheckpointError
from ..manifest import MANIFEST_NAME
from ..plan.dtypes import DTYPE_BITS
from ..plan.files import ChunkSpec, check_max_shard_size, split_parts
from ..plan.layout import ModelLayout, TargetTensor
from ..plan.placement import Box
from ..read.checkpoint import INDEX_NAME
from ..read.dcp_source import DcpIndex, read_dcp_source
from ..runs.engine import Engine
from .distributed import use_distributed, write_distributed
from .files import write_safetensors
from .output import headers_digest, write_output
from .staged import ReplaceRule, StagedOutput, fsync_path, not_a_reshard_output, not_ours, removes_made_parents

DEFAULT_MAX_SHARD_SIZE = 5 * 10**9  # 5GB, transformers' and the Hub's default
LAYOUTS = ("original", "fused")
MERGE_FILE = "model-{part:05d}-of-{parts:05d}.safetensors"
MERGE_MARK = "reshard merge"  # `metadata.written_by` of the index: tells a merge output from other folders


@dataclass(frozen=True)
class OutputTensor:
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


def merge_tensors(index: DcpIndex, layout: ModelLayout, *, layout_mode: str = "original") -> list[OutputTensor]:
    """The output tensors, in natural key order.

    Raises:
        CheckpointError: `original` is asked but the source layout is unknown (a reshard folder written before it was
            recorded) or cannot be written by slicing; the message says to use `fused`.
    """
    if layout_mode not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, not {layout_mode!r}")
    targets = layout.by_name()
    out: list[OutputTensor] = []
    if layout_mode == "fused":
        for t in layout.tensors:
            if t.name not in index.tied:
                out.append(OutputTensor(t.name, t.shape, t, tuple((0, n) for n in t.shape)))
    else:
        if index.original is None:
            raise CheckpointError(f"{index.source}: the source's on-disk layout is unknown: {index.original_error}. "
                                  "Nothing was written.", path=index.source)
        seen: set[str] = set()
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
                                          f"not fit {name} {list(target.shape)}. Nothing was written.",
                                          path=index.source)
                out.append(OutputTensor(key, tuple(shape), target, box))
    keys = {t.key for t in out}
    for t in layout.extras:  # tensors the model does not load (MTP layers): back under their own keys, either layout
        if t.name in keys:
            raise CheckpointError(f"{index.source}: {t.name} is both a tensor of the model and one it does not load "
                                  "(an extra); the extras would overwrite a trained tensor. Nothing was written.",
                                  path=index.source)
        out.append(OutputTensor(t.name, t.shape, t, tuple((0, n) for n in t.shape)))
    out.sort(key=lambda t: _natural_key(t.key))
    return out


# config.json fields a training run or a re-save may change without changing the model (`--extras-from`'s check)
CONFIG_FIELDS_NOT_COMPARED = frozenset({"transformers_version", "dtype", "torch_dtype", "use_cache", "_name_or_path",
                                        "quantization_config"})


def with_extras_from(index: DcpIndex, layout: ModelLayout, source) -> tuple[DcpIndex, ModelLayout]:
    """`index` and `layout` of a trained folder, plus the extras of `source`: the reshard folder or HF checkpoint
    the training started from (a folder saved with `save_pretrained(..., distributed_checkpoint=True)` holds only the
    tensors the model loads).

    The two folders become one source: an extras file outside the trained folder is named by its absolute path
    (`CheckpointIndex.path_of` joins an absolute name as it is), and a reshard folder's CRC-32s still check it.

    Raises:
        UsageError: `source` is quantized (its extras are not bf16 bytes), holds no extras, or is another model
            (a `config.json` field both have differs, beyond `CONFIG_FIELDS_NOT_COMPARED`), or the trained folder
            already has extras.
    """
    from dataclasses import replace

    from ..errors import UsageError
    from ..read.dcp_source import dcp_kind

    where = f"--extras-from {source}"
    if layout.extras:
        raise UsageError(f"{where}: {index.source} already holds {len(layout.extras)} tensor(s) the model does not "
                         "load; merge writes those back. Leave out --extras-from. Nothing was written.")
    if dcp_kind(source):
        other, other_layout = read_dcp_source(source)
    else:
        from ..read.checkpoint import read_checkpoint
        from ..read.experts import find_experts

        other = read_checkpoint(source, need_data=True)
        if other.config.get("quantization_config"):
            raise UsageError(f"{where}: a quantized checkpoint; its extras are quantized bytes, not the bf16 tensors "
                             "of the trained model. Pass the reshard folder written from it with --dequantize bf16. "
                             "Nothing was written.")
        other_layout = find_experts(other)
    differ = sorted(k for k in set(index.config) & set(other.config) - CONFIG_FIELDS_NOT_COMPARED
                    if index.config[k] != other.config[k])
    if not other.config.get("model_type") or differ:
        shown = ", ".join(f"{k}: {other.config[k]!r} there, {index.config[k]!r} here" for k in differ[:3])
        raise UsageError(f"{where}: not the same model as {index.source} ({shown or 'no model_type in its config'}); "
                         "pass the folder the training started from. Nothing was written.")
    if not other_layout.extras:
        raise UsageError(f"{where}: it holds no tensors the model does not load, so there is nothing to take. "
                         "Nothing was written.")
    root = other.root.resolve()
    entries, extras, crc32 = {}, [], {}
    for t in other_layout.extras:
        entry = other.tensors[t.pieces[0].source]
        key = f"<extras-from>:{entry.name}"
        entries[key] = replace(entry, name=key, file=str(root / entry.file))
        extras.append(replace(t, pieces=(replace(t.pieces[0], source=key),)))
    for name, crc in (getattr(other, "crc32", None) or {}).items():
        crc32[str(root / name)] = crc
    files = {e.file for e in entries.values()}
    merged = replace(index, tensors={**index.tensors, **entries},
                     files=(*index.files, *(replace(h, name=str(root / h.name)) for h in other.files
                                            if str(root / h.name) in files)),
                     crc32={**(index.crc32 or {}), **crc32} if (index.crc32 or crc32) else None)
    return merged, replace(layout, ignored_sources=tuple(t.name for t in extras), extras=tuple(extras))


def _where(source) -> str:
    """A local source as an absolute path (a Hub repo id as it is)."""
    path = Path(os.fspath(source))
    return str(path.resolve()) if path.exists() else str(source)


def left_out(index: DcpIndex, layout: ModelLayout) -> str | None:
    """What a merge of `index` leaves out that its checkpoint may have carried, or None: the tensors the model does
    not load, absent from a saved folder and from a reshard folder written with `--drop-unloaded`."""
    if layout.extras:
        return None
    if index.kind == "reshard":
        try:
            dropped = json.loads((index.root / MANIFEST_NAME).read_text()).get("dropped_unloaded")
        except (OSError, ValueError, AttributeError):
            dropped = None
        if not dropped:
            return None
        return (f"{index.source} was written with --drop-unloaded: {dropped} tensor(s) its source held that the model "
                "does not load are not in it; pass --extras-from with that source to write them back")
    patterns = layout.ignore_patterns
    dropped = f" (this model class drops {', '.join(patterns)} on load)" if patterns else ""
    return (f"{index.source} was saved with save_pretrained(..., distributed_checkpoint=True), which keeps only the "
            f"tensors the model loads: any its checkpoint carried beside them{dropped}, such as MTP layers, are not "
            "in it; pass --extras-from with the reshard folder or checkpoint the training started from to write them "
            "back")


def not_a_merge_output(out: Path) -> str | None:
    """Why `out` may not be replaced by a merge, or None: empty, a complete merge output, or a reshard output."""
    if not out.is_dir():
        return "it is not a folder"
    entries = sorted(os.listdir(out))
    if not entries or MANIFEST_NAME in entries:
        return not_a_reshard_output(out)
    try:
        index = json.loads((out / INDEX_NAME).read_text())
        metadata = index["metadata"]
        if metadata.get("written_by") != MERGE_MARK:
            return f"its {INDEX_NAME} was not written by reshard merge"
        ours = {INDEX_NAME, *index["weight_map"].values(), *metadata["copied"]}
    except FileNotFoundError:
        return f"it holds {', '.join(entries[:5])} and neither {INDEX_NAME} nor {MANIFEST_NAME}"
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"its {INDEX_NAME} cannot be read as a merge output's ({type(e).__name__}: {e})"
    foreign = not_ours(out, entries, ours)
    if foreign:
        return f"it is a merge output but also holds {', '.join(foreign[:5])}, which reshard did not write"
    return None


MERGE_OUTPUT = ReplaceRule(not_a_merge_output, "a complete merge or reshard output")


@dataclass(frozen=True)
class MergeJob:
    """A `merge` as an output job (`reshard.write.output.OutputJob`): its units are the output files."""

    index: DcpIndex
    layout: ModelLayout
    parts: tuple[tuple[OutputTensor, ...], ...]
    layout_mode: str
    max_shard_size: int | None
    extras_from: str | None = None
    checked: bool = False  # every source file read has a CRC-32 in its manifest to check against
    command = "merge"
    compute = False

    @cached_property
    def names(self) -> list[str]:
        return [MERGE_FILE.format(part=i + 1, parts=len(self.parts)) for i in range(len(self.parts))]

    @cached_property
    def unit_sizes(self) -> list[int]:
        return [sum(t.nbytes for t in part) for part in self.parts]

    @property
    def copied(self) -> list[str]:
        return [name for name in self.index.other_files if name not in self.names and name != INDEX_NAME]

    def staged(self, out, overwrite: bool) -> StagedOutput:
        index = self.index
        return StagedOutput(out, overwrite, [index.root, *(index.path_of(f.name) for f in index.files)],
                            rule=MERGE_OUTPUT)

    def needed_bytes(self) -> int:
        return sum(self.unit_sizes) + sum((self.index.root / name).stat().st_size for name in self.copied)

    def write_units(self, tmp: Path, units, *, progress=None, fsync: bool = False) -> list[tuple[int, dict]]:
        engine, entries = Engine(self.index, progress), []
        try:
            for unit in units:
                path, tensors = tmp / self.names[unit], self.parts[unit]
                chunks = [ChunkSpec(t.key, t.dtype, t.shape, (), t.nbytes, i) for i, t in enumerate(tensors)]
                write_safetensors(path, chunks, [(t.nbytes, t.target, t.box) for t in tensors], {"format": "pt"},
                                  engine, checksum=False)
                if fsync:
                    fsync_path(path)
                entries.append((unit, {"name": path.name, "keys": [t.key for t in tensors]}))
            engine.finish()  # a damaged source file is refused before anything is kept
        finally:
            engine.close()
        return entries

    def finish(self, tmp: Path, entries: list[dict]) -> dict:
        """The copied files and the index, last; returns the index document."""
        for name in self.copied:
            shutil.copy2(self.index.root / name, tmp / name)
        weight_map = {key: entry["name"] for entry in entries for key in entry["keys"]}
        document = {"metadata": {"total_size": sum(self.unit_sizes), "written_by": MERGE_MARK,
                                 "tool": f"reshard {__version__}", "layout": self.layout_mode, "copied": self.copied,
                                 # where the extras came from: `verify DEST --against SRC` compares them there
                                 **({"extras_from": _where(self.extras_from)} if self.extras_from is not None
                                    else {})},
                    "weight_map": weight_map}
        (tmp / INDEX_NAME).write_text(json.dumps(document, indent=2) + "\n")
        return document

    def identity(self, out: Path, overwrite: bool) -> dict:
        return {"OUT": str(out), "layout": self.layout_mode,
                "options": f"max_shard_size={self.max_shard_size} overwrite={overwrite} "
                           f"extras_from={self.extras_from}",
                "SRC's safetensors headers": headers_digest(self.index)}

    def summary(self, dest) -> dict:
        return {"dest": str(dest), "files": len(self.names), "tensors": sum(len(p) for p in self.parts),
                "bytes": sum(self.unit_sizes), "layout": self.layout_mode, "source_kind": self.index.kind,
                "source_crc32_checked": self.checked, "extras": len(self.layout.extras),
                "left_out": left_out(self.index, self.layout)}


def merge_job(source, *, max_shard_size: int | None = DEFAULT_MAX_SHARD_SIZE, layout: str = "original",
              extras_from=None) -> MergeJob:
    """Read `source` and plan its merge (checked before anything is written)."""
    index, model_layout = read_dcp_source(source)
    checked = index.crc32 is not None
    if extras_from is not None:
        index, model_layout = with_extras_from(index, model_layout, extras_from)
    tensors = merge_tensors(index, model_layout, layout_mode=layout)
    parts = split_parts(tensors, max_shard_size, nbytes=lambda t: t.nbytes)
    return MergeJob(index, model_layout, tuple(tuple(p) for p in parts), layout, max_shard_size, extras_from, checked)


@removes_made_parents("dest")
def merge_checkpoint(source, dest, *, max_shard_size: int | None = DEFAULT_MAX_SHARD_SIZE,
                     layout: str = "original", overwrite: bool = False, progress: bool | None = None,
                     extras_from=None, workers: int | None = 1, distributed: bool | None = False) -> dict | None:
    """Merge a reshard folder or a saved distributed checkpoint into a standard HF checkpoint at `dest`.

    Args:
        source: a `reshard write` folder, or a folder written by `save_pretrained(..., distributed_checkpoint=True)`.
        dest: the output folder; must not exist unless `overwrite`, and then be empty, a merge output or a reshard
            output.
        max_shard_size: bytes per output file at most (a larger tensor gets a file of its own); None: one file.
        layout: `original` (the source checkpoint's on-disk keys and shapes, per-expert keys split back out; for a
            saved folder what transformers' own `save_pretrained` writes) or `fused` (the in-memory names).
        overwrite: replace an existing `dest` (swapped in only once complete).
        progress: a byte progress bar (None: only on a terminal; False: never).
        extras_from: for a trained folder saved without them, the reshard folder or HF checkpoint the training
            started from, whose tensors the model does not load (MTP layers) are written back beside the trained
            ones (`with_extras_from`: same model, no key collides).
        workers: processes writing shares of the output files on this machine (`reshard.write.workers`); 1 writes
            in this process, None picks `default_workers`. Above 1, call this under `if __name__ == "__main__":`.
            The output is byte-identical either way.
        distributed: this process is one rank of a torchrun job and every rank calls this with the same arguments:
            each writes a share of the files into `dest`, on a file system they all share
            (`reshard.write.distributed`). None: when the launcher's environment says so. Not with `workers`.

    Returns:
        A summary: `dest`, `files`, `tensors`, `bytes` (tensor data), `layout`, `source_kind`,
        `source_crc32_checked` (every source file read was checked against its manifest's CRC-32; False for a saved
        folder, which records none), `extras` (tensors written back that the model does not load) and `left_out`
        (what the merge could not write back, see `left_out`, or None). None on the ranks other than 0 of a
        distributed merge.

    Raises:
        CheckpointError: the input is neither kind, is incomplete (a rank file missing, a gap, overlapping chunks,
            mixed dtypes), or `original` is not known for it. Checked before anything is written. Also: a source
            file's CRC-32 differs from its manifest's (checked as the copy runs; nothing is kept).
        OutputError: `dest` exists and may not be replaced, is or holds the source, another write holds it, or
            the disk is full; nothing partial is left.
        UsageError: `workers` above 1 in a distributed merge, or a `max_shard_size` below 1 byte.

    Example:
        >>> merge_checkpoint("ckpt-step1000", "published")  # doctest: +SKIP
    """
    check_max_shard_size(max_shard_size)
    jobs: list[MergeJob] = []

    def read_job() -> MergeJob:
        jobs.append(merge_job(source, max_shard_size=max_shard_size, layout=layout, extras_from=extras_from))
        return jobs[-1]

    if use_distributed(distributed, workers, "merge"):
        if write_distributed(read_job, dest, overwrite=overwrite, progress=progress, command="merge") is None:
            return None
    else:
        write_output(read_job(), dest, overwrite=overwrite, progress=progress, workers=workers)
    return jobs[-1].summary(dest)


def is_merged_folder(folder) -> bool:
    """Whether `folder` is a plain HF checkpoint (an index or `*.safetensors`, no reshard manifest): what `verify`
    checks as a merge output."""
    path = Path(folder)
    if not path.is_dir() or (path / MANIFEST_NAME).exists():
        return False
    return (path / INDEX_NAME).is_file() or any(p.suffix == ".safetensors" and not p.name.startswith("shard-")
                                                 for p in path.iterdir())


__all__ = ["merge_checkpoint", "merge_tensors", "is_merged_folder"]
