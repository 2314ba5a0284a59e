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
from pathlib import Path

from .. import __version__
from ..read.checkpoint import INDEX_NAME
from ..read.dcp_source import DcpIndex, read_dcp_source
from ..errors import CheckpointError, OutputError
from ..plan.files import split_parts
from ..plan.layout import ModelLayout, TargetTensor
from ..manifest import MANIFEST_NAME
from ..plan.placement import Box

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
        from ..read.checkpoint import DTYPE_BITS

        return math.prod(self.shape) * DTYPE_BITS[self.dtype] // 8


def _removes_made_parents(argument: str):
    """`reshard.write.shards.removes_made_parents`, imported at the call (this module imports shards lazily)."""
    def decorate(fn):
        import functools

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            from .shards import removes_made_parents

            return removes_made_parents(argument)(fn)(*args, **kwargs)

        return wrapper

    return decorate


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


def _not_replaceable(out: Path) -> str | None:
    """Why `out` may not be replaced by a merge, or None: empty, a complete merge output, or a reshard output."""
    from .shards import _not_replaceable as reshard_output

    if not out.is_dir():
        return "it is not a folder"
    entries = sorted(os.listdir(out))
    if not entries or MANIFEST_NAME in entries:
        return reshard_output(out)
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
    foreign = [e for e in entries if e not in ours or not (out / e).is_file()]
    if foreign:
        return f"it is a merge output but also holds {', '.join(foreign[:5])}, which reshard did not write"
    return None


def _check_replaceable(out: Path, overwrite: bool) -> None:
    from .shards import _check_replaceable as check

    check(out, overwrite, why_not=_not_replaceable, replaceable="a complete merge or reshard output")


def _write_merged_file(path: Path, tensors: list[OutputTensor], copier) -> None:
    from ..plan.files import ChunkSpec
    from .shards import placed_runs, safetensors_header, write_copied_file

    header = safetensors_header([ChunkSpec(t.key, t.dtype, t.shape, (), t.nbytes, i) for i, t in enumerate(tensors)],
                                {"format": "pt"})
    placed, size = placed_runs(len(header), [(t.nbytes, t.target, t.box) for t in tensors], copier.index)
    write_copied_file(path, header, placed, size, copier)


@_removes_made_parents("dest")
def merge_checkpoint(source, dest, *, max_shard_size: int | None = DEFAULT_MAX_SHARD_SIZE,
                     layout: str = "original", overwrite: bool = False, progress: bool | None = None,
                     extras_from=None) -> dict:
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

    Returns:
        A summary: `dest`, `files`, `tensors`, `bytes` (tensor data), `layout`, `source_kind`,
        `source_crc32_checked` (every source file read was checked against its manifest's CRC-32; False for a saved
        folder, which records none), `extras` (tensors written back that the model does not load) and `left_out`
        (what the merge could not write back, see `left_out`, or None).

    Raises:
        CheckpointError: the input is neither kind, is incomplete (a rank file missing, a gap, overlapping chunks,
            mixed dtypes), or `original` is not known for it. Checked before anything is written. Also: a source
            file's CRC-32 differs from its manifest's (checked as the copy runs; nothing is kept).
        OutputError: `dest` exists and may not be replaced, is or holds the source, another write holds it, or
            the disk is full; nothing partial is left.

    Example:
        >>> merge_checkpoint("ckpt-step1000", "published")  # doctest: +SKIP
    """
    from .shards import (
        TMP_MARK,
        _Copier,
        _clean_stale_temporaries,
        _fsync_dir,
        _fsync_files,
        _progress_bar,
        _refuse_source_overlap,
        _replace,
        _write_lock,
        discarded_on_failure,
        sigterm_as_interrupt,
    )

    index, model_layout = read_dcp_source(source)
    checked = index.crc32 is not None
    if extras_from is not None:
        index, model_layout = with_extras_from(index, model_layout, extras_from)
    tensors = merge_tensors(index, model_layout, layout_mode=layout)
    parts = split_parts(tensors, max_shard_size, nbytes=lambda t: t.nbytes)
    names = [MERGE_FILE.format(part=i + 1, parts=len(parts)) for i in range(len(parts))]
    copied = [name for name in index.other_files if name not in names and name != INDEX_NAME]
    out = Path(dest).resolve()
    _refuse_source_overlap(out, index)
    if os.path.lexists(out):
        _check_replaceable(out, overwrite)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"{out.parent}: cannot create it ({e.strerror or e}); choose a folder you can write "
                          "to.") from e
    data = sum(t.nbytes for t in tensors)
    with sigterm_as_interrupt(), _write_lock(out):
        _clean_stale_temporaries(out)
        if os.path.lexists(out):
            _check_replaceable(out, overwrite)
        total = data + sum((index.root / name).stat().st_size for name in copied)
        free = shutil.disk_usage(out.parent).free
        if free < total:
            raise OutputError(f"{out.parent}: {free / 2**30:.2f} GiB free, the merged checkpoint needs "
                              f"{total / 2**30:.2f} GiB. Free space or write elsewhere.")
        tmp = out.parent / f".{out.name}{TMP_MARK}{os.getpid()}"
        bar = _progress_bar(data, progress)
        bar.set_description("reshard merge")
        copier = None
        try:
            with discarded_on_failure(out, tmp, total):
                tmp.mkdir()
                copier = _Copier(index, bar)
                weight_map = {}
                for name, part in zip(names, parts):
                    _write_merged_file(tmp / name, part, copier)
                    weight_map.update((t.key, name) for t in part)
                copier.finish_source_checks()  # a damaged source file is refused before anything is kept
                copier.close()
                copier = None
                for name in copied:
                    shutil.copy2(index.root / name, tmp / name)
                document = {"metadata": {"total_size": data, "written_by": MERGE_MARK,
                                         "tool": f"reshard {__version__}", "layout": layout, "copied": copied,
                                         # where the extras came from: `verify DEST --against SRC` compares them there
                                         **({"extras_from": _where(extras_from)} if extras_from is not None else {})},
                            "weight_map": weight_map}
                (tmp / INDEX_NAME).write_text(json.dumps(document, indent=2) + "\n")
                _fsync_files(tmp)
                _fsync_dir(tmp)
                _replace(tmp, out, overwrite, check=_check_replaceable)
        finally:
            if copier is not None:
                copier.close()
            bar.close()
    return {"dest": str(dest), "files": len(names), "tensors": len(tensors), "bytes": data, "layout": layout,
            "source_kind": index.kind, "source_crc32_checked": checked, "extras": len(model_layout.extras),
            "left_out": left_out(index, model_layout)}


def is_merged_folder(folder) -> bool:
    """Whether `folder` is a plain HF checkpoint (an index or `*.safetensors`, no reshard manifest): what `verify`
    checks as a merge output."""
    path = Path(folder)
    if not path.is_dir() or (path / MANIFEST_NAME).exists():
        return False
    return (path / INDEX_NAME).is_file() or any(p.suffix == ".safetensors" and not p.name.startswith("shard-")
                                                 for p in path.iterdir())


__all__ = ["merge_checkpoint", "merge_tensors", "is_merged_folder"]
