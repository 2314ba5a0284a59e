"""`model.safetensors.index.json` of a merged folder, typed: written by `reshard merge`, parsed here in one place for
`verify` and for `merge --overwrite` (`MergeIndex.from_document`).

`reshard merge` records in `metadata` beside `total_size`: `written_by` (`_MERGE_MARK`: a merge output, whose files
`merge --overwrite` may replace), the `tool`, the `layout` the tensors are named in, the `copied` non-weight files and,
with `--extras-from`, where the extras came from. An index another tool wrote (transformers' `save_pretrained`) has
`total_size` and `weight_map` only; `written_by` is then None.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from ..errors import CheckpointError
from ..plan import MergeLayout
from ..read import INDEX_NAME

_MERGE_MARK = "reshard merge"  # `metadata.written_by` of the index: tells a merge output from other folders


@dataclass(frozen=True)
class MergedFile:
    """One output file of a merge, as its writer reports it: its name and the keys it holds, in file order."""

    name: str
    keys: tuple[str, ...]


@dataclass(frozen=True)
class MergeIndex:
    """A merged folder's index.

    Attributes:
        total_size: bytes of tensor data in the weight files (`metadata.total_size`).
        weight_map: key -> the file holding it.
        written_by: `_MERGE_MARK` for a merge output, or None (an index another tool wrote: the fields below are then
            empty).
        tool: `reshard X.Y.Z`, the merge's.
        layout: how the merge named the tensors (`original` or `fused`).
        copied: the non-weight files copied beside the weights.
        extras_from: the `--extras-from` source as given (`verify DEST --against SRC` compares the extras there).
    """

    total_size: int
    weight_map: Mapping[str, str]
    written_by: str | None = None
    tool: str | None = None
    layout: MergeLayout | None = None
    copied: tuple[str, ...] = ()
    extras_from: str | None = None

    @classmethod
    def of_merge(cls, files: list[MergedFile], total_size: int, layout: MergeLayout, copied: list[str],
                 extras_from: str | None, tool: str) -> "MergeIndex":
        """The index a merge writes for its output `files` (in file order)."""
        weight_map = {key: f.name for f in files for key in f.keys}
        return cls(total_size, MappingProxyType(weight_map), _MERGE_MARK, tool, layout, tuple(copied), extras_from)

    @property
    def merged(self) -> bool:
        """Whether `reshard merge` wrote it."""
        return self.written_by == _MERGE_MARK

    def to_json(self) -> str:
        """The index as the merge writes it (its keys in this order, two-space indent, a trailing newline)."""
        metadata = {"total_size": self.total_size, "written_by": self.written_by, "tool": self.tool,
                    "layout": self.layout.value, "copied": list(self.copied),
                    # where the extras came from: `verify DEST --against SRC` compares them there
                    **({"extras_from": self.extras_from} if self.extras_from is not None else {})}
        return json.dumps({"metadata": metadata, "weight_map": dict(self.weight_map)}, indent=2) + "\n"

    @classmethod
    def from_document(cls, document) -> "MergeIndex":
        """The index `document` (parsed JSON) holds; a merge's fields are read when `written_by` says it is one.

        Raises:
            CheckpointError: a field is missing or of the wrong type (naming it).
        """
        metadata = _field(document, "metadata", dict, "an object")
        weight_map = _field(document, "weight_map", dict, "an object of key to file name")
        if not all(isinstance(v, str) for v in weight_map.values()):
            raise _problem("weight_map", "an object of key to file name")
        total_size = _field(metadata, "total_size", (int, float), "a size in bytes", where="metadata.")
        written_by = metadata.get("written_by")
        if written_by != _MERGE_MARK:
            return cls(total_size, MappingProxyType(weight_map), written_by if isinstance(written_by, str) else None)
        layout = _field(metadata, "layout", str, "original or fused", where="metadata.")
        if layout not in [m.value for m in MergeLayout]:
            raise _problem("metadata.layout", "original or fused", layout)
        copied = _field(metadata, "copied", list, "a list of file names", where="metadata.")
        if not all(isinstance(name, str) for name in copied):
            raise _problem("metadata.copied", "a list of file names", copied)
        extras_from = metadata.get("extras_from")
        if extras_from is not None and not isinstance(extras_from, str):
            raise _problem("metadata.extras_from", "the --extras-from source, a path or URL", extras_from)
        tool = metadata.get("tool")
        return cls(total_size, MappingProxyType(weight_map), _MERGE_MARK, tool if isinstance(tool, str) else None,
                   MergeLayout(layout), tuple(copied), extras_from)


def _field(obj, name: str, kind, what: str, *, where: str = ""):
    value = obj.get(name) if isinstance(obj, dict) else None
    if not isinstance(value, kind) or isinstance(value, bool):
        raise _problem(f"{where}{name}", what, value)
    return value


def _problem(key: str, what: str, value=None) -> CheckpointError:
    shown = "missing" if value is None else f"{json.dumps(value)[:100]}"
    return CheckpointError(f"{INDEX_NAME}: {key} is {shown}; a merged folder's index has {what} there")
