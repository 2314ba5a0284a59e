"""What each command returns: a frozen value with `to_json()` (the `--json` document) and `summary()` (the lines the
CLI prints). The entry points in `reshard.api` build them; the CLI only prints them.

Counts say what they count: a model tensor is an in-memory tensor of the model (`model.layers.0.mlp.experts.
gate_up_proj`), a checkpoint key an on-disk tensor of a Hugging Face checkpoint (`...experts.3.gate_proj.weight`).
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from enum import Enum

from .manifest import Manifest, write_label
from .plan import MergeLayout, ReshardPlan
from .read import SourceKind
from .words import mib, plural

_UNCHECKED_SAVED = ("note: SRC was saved by save_pretrained(..., distributed_checkpoint=True), which records no "
                   "CRC-32: its bytes were copied as they are, not checked.")


def _verify_line(out, against=None, revision=None) -> str:
    """The `reshard verify` command that checks what a command just wrote, ready to paste."""
    words = ["reshard", "verify", str(out)] + (["--against", str(against)] if against else [])
    words += ["--revision", revision] if revision and against else []
    return " ".join(map(shlex.quote, words))


def _dump(document: dict) -> str:
    return json.dumps(document, indent=2)


# ---- plan ------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PlanResult:
    """`reshard plan`: the plan (None when the checkpoint has no routed experts) and the `write` line to run next.

    Attributes:
        plan: the plan, or None.
        source: the source as given.
        write_line: the `reshard write` command for this mesh and these flags, with OUT to name.
    """

    plan: ReshardPlan | None
    source: str
    write_line: str = ""

    def to_json(self) -> str:
        from .plan import PLAN_JSON_VERSION, plan_to_dict

        if self.plan is None:
            return _dump({"reshard_plan_version": PLAN_JSON_VERSION, "source": self.source, "routed_experts": 0,
                          "message": self._no_experts()})
        return _dump(plan_to_dict(self.plan, self.source))

    def _no_experts(self) -> str:
        return f"{self.source}: no routed experts found (not a MoE checkpoint); nothing to reshard."

    def summary(self) -> str:
        from .plan import render_plan

        if self.plan is None:
            return self._no_experts()
        return f"{render_plan(self.plan, self.source)}\n\nnext: {self.write_line}"


# ---- write -----------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class WriteResult:
    """`reshard write`: the manifest written, and how to check and load the folder.

    Attributes:
        manifest: the manifest of OUT.
        out: OUT as given.
        source: SRC as given.
        source_kind: what SRC is (`reshard.read.SourceKind`: a checkpoint, or a reshard or saved folder written
            from mesh to mesh).
        revision: the Hub revision asked for, or None.
        verify_against: the SRC `verify --against` can compare with (None for a reshard or saved SRC).
        node: after a node-local write, the node whose copy `manifest` is (`node 1 (host, ranks 4-7)`).
        copies: on node 0 of a node-local write, every node's copy (`reshard.write._output.NodeCopy`).
        fetched: after a node-local write from a remote SRC, the bytes this node's ranks fetched from it.
    """

    manifest: Manifest
    out: str
    source: str
    source_kind: SourceKind
    revision: str | None = None
    node: str | None = None
    copies: tuple = ()
    fetched: int | None = None

    @property
    def extras(self) -> int:
        return sum(len(e.keys) for e in self.manifest.extras)

    def to_json(self) -> str:
        m = self.manifest
        return _dump({"out": self.out, "files": len(m.files), "bytes": m.bytes, "tensors": len(m.tensors),
                      "dequantized_tensors": m.dequantized, "empty_markers": m.empty_markers,
                      "source_crc32_checked": self.source_kind is SourceKind.RESHARD, "extras": self.extras,
                      "layout": m.layout.value, "mesh": m.mesh.to_dict(),
                      "distributed_config": m.mesh.distributed_config_kwargs()})

    def summary(self) -> str:
        m = self.manifest
        lines = [f"wrote {self.out}{self._whose()}: {plural(len(m.files), 'file')} ({mib(m.bytes)} with headers), "
                 f"{plural(len(m.tensors), 'model tensor')}"
                 + (f" ({m.dequantized} dequantized to bf16)" if m.dequantized else "")
                 + f", {plural(m.empty_markers, 'explicit empty marker')}"
                 + (f"; {plural(self.extras, 'tensor')} the model does not load kept in extra-*.safetensors."
                    if self.extras else ".")]
        if self.fetched is not None:
            lines.append(f"fetched from {self.source} by this node's ranks: {self.fetched:,} bytes "
                         f"({mib(self.fetched)})")
        lines += self._job_lines()
        if self.source_kind is SourceKind.SAVED:
            lines.append(_UNCHECKED_SAVED)
        # A folder in the distributed-checkpoint layout is no `--against` source: verify checks the output on its own.
        against = self.source if self.source_kind is SourceKind.CHECKPOINT else None
        lines.append("next:\n  " + _verify_line(self.out, against, self.revision)
                     + f"\n  load: reshard.from_pretrained({self.out!r}) on every rank of the job "
                       f"({m.mesh.distributed_config_repr()})")
        return "\n".join(lines)


    def _whose(self) -> str:
        """Which copy this is, said as verify says it: a node's copy holds some ranks' files only."""
        holds = self.manifest.holds
        if holds is None:
            return ""
        from .plan import RankSpans

        if self.node:
            return f" on {self.node}, this node's copy"
        return f" (a node's copy: the files of ranks {RankSpans(holds)})"

    def _job_lines(self) -> list[str]:
        """Node 0 of a node-local write: every node's copy, and the job's totals."""
        if not self.copies:
            return []
        c = self.copies
        lines = [f"the job: {plural(len(c), 'node')}, {plural(sum(x.files for x in c), 'file')} "
                 f"({mib(sum(x.bytes for x in c))} with headers), "
                 f"{plural(sum(x.empty_markers for x in c), 'explicit empty marker')}"
                 + ("" if any(x.fetched is None for x in c)
                    else f", {sum(x.fetched for x in c):,} bytes fetched from SRC")
                 + " in all:"]
        return lines + [f"  {x.node}: {plural(x.files, 'file')} ({mib(x.bytes)}), "
                        f"{plural(x.empty_markers, 'explicit empty marker')}"
                        + ("" if x.fetched is None else f", {x.fetched:,} bytes fetched from SRC") for x in c]


# ---- verify ----------------------------------------------------------------------------------------------------------

class Checked(str, Enum):
    """What `reshard verify` checked."""

    RESHARD = "reshard"  # a reshard folder
    MERGED = "merged"  # a plain Hugging Face checkpoint, as `merge` writes it


@dataclass(frozen=True)
class VerifyResult:
    """`reshard verify`: what was checked and every problem found (`ok` when there is none).

    Attributes:
        kind: a reshard folder or a merged one (`Checked`).
        ranks: the ranks whose files were checked, as spans (None: every rank's).
        write_id: the write the folder or node's copy belongs to (its manifest's `write_id`; None: not recorded).
    """

    ok: bool
    folder: str
    against: str | None
    files: int
    tensors: int
    empty_markers: int
    bytes_compared: int
    dequantized_tensors: tuple[str, ...] = ()
    problems: tuple[str, ...] = ()
    kind: Checked = Checked.RESHARD
    ranks: str | None = None
    write_id: str | None = None

    def to_json(self) -> str:
        document = {"ok": self.ok, "folder": self.folder, "against": self.against}
        if self.kind is Checked.MERGED:
            document["kind"] = self.kind.value
        document.update(files=self.files, tensors=self.tensors, empty_markers=self.empty_markers,
                        bytes_compared=self.bytes_compared, dequantized_tensors=list(self.dequantized_tensors),
                        problems=list(self.problems))
        if self.ranks is not None:
            document["ranks"] = self.ranks
        if self.write_id is not None:
            document["write_id"] = self.write_id
        return _dump(document)

    def summary(self) -> str:
        if self.kind is Checked.MERGED:
            what = f"{plural(self.files, 'file')}, {plural(self.tensors, 'checkpoint key')}, index and headers agree"
        else:
            what = (f"{plural(self.files, 'file')}, {plural(self.tensors, 'model tensor')}, "
                    f"{plural(self.empty_markers, 'explicit empty marker')}, "
                    + ("every tensor covered exactly once" if self.ranks is None else
                       "every chunk those ranks load in place once"))
        held = f" (a node's copy: the files of ranks {self.ranks})" if self.ranks is not None else ""
        return (f"OK {self.folder}{held}: {what}"
                + (f", {self.bytes_compared} bytes of tensor data equal to {self.against}" if self.against else "")
                + (f" ({plural(len(self.dequantized_tensors), 'tensor')} recomputed from its quantized weights)"
                   if self.dequantized_tensors else "") + "."
                + (f" Part of {write_label(self.write_id)}." if self.kind is Checked.RESHARD else ""))

    def failure(self) -> str:
        """The one line that ends a failed verify; files missing from a whole folder may be a node's copy staged by
        hand, which `--ranks` checks."""
        line = f"{self.folder}: {plural(len(self.problems), 'problem')}."
        if self.ranks is None and self.kind is Checked.RESHARD and any(": missing" in p for p in self.problems):
            line += (" If this is one node's copy (staged with `reshard files --ranks`), check it with "
                     "`reshard verify OUT --ranks FIRST-LAST`.")
        return line


# ---- files -----------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class FilesResult:
    """`reshard files`: what the ranks need to load OUT, relative to it."""

    out: str
    ranks: tuple[int, ...]
    coords: tuple[int, ...]
    files: tuple[str, ...]
    bytes: int

    def to_json(self) -> str:
        return _dump({"out": self.out, "ranks": list(self.ranks), "coords": list(self.coords),
                      "files": list(self.files), "bytes": self.bytes})

    def summary(self) -> str:
        return "\n".join(self.files)

    def numbering(self) -> str:
        """Why rank 2 reads `shard-00003-...`: said once, on stderr, so the list itself stays pipeable."""
        return ("note: ranks count from 0 and shard files from 1: `shard-00003-model-...` holds what the ranks of "
                "coordinate 2 load (ranks 2, 2 + fsdp, ...).")


# ---- merge -----------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MergeResult:
    """`reshard merge`: what DEST holds.

    Attributes:
        tensors: the tensors written, under the keys of `layout` (checkpoint keys for `original`, model tensors for
            `fused`), the extras included.
        model_tensors: the model's in-memory tensors they hold.
        layout: how the tensors are named (`MergeLayout`).
        source_kind: what SRC is (`reshard.read.SourceKind`: a reshard or saved folder).
        left_out: what the merge could not write back, or None.
        against: what the next line's `verify --against` compares DEST with (SRC; after `--node-local`, the
            original checkpoint the copies were written from, None when unknown).
    """

    dest: str
    source: str
    files: int
    tensors: int
    model_tensors: int
    bytes: int
    layout: MergeLayout
    source_kind: SourceKind
    source_crc32_checked: bool
    extras: int
    left_out: str | None = None
    against: str | None = None

    def to_json(self) -> str:
        return _dump({"dest": self.dest, "files": self.files, "tensors": self.tensors, "bytes": self.bytes,
                      "layout": self.layout.value, "source_kind": self.source_kind.value,
                      "source_crc32_checked": self.source_crc32_checked, "extras": self.extras,
                      "left_out": self.left_out})

    def summary(self) -> str:
        what = (plural(self.tensors, "checkpoint key") + f" (the source's on-disk layout, {self.model_tensors} model "
                "tensors)" if self.layout is MergeLayout.ORIGINAL
                else plural(self.tensors, "model tensor") + " (fused layout)")
        lines = [f"merged {self.source} into {self.dest}: {plural(self.files, 'file')} ({mib(self.bytes)} with "
                 f"headers), {what}"
                 + (f"; {self.extras} of them the model does not load (MTP layers, ...)." if self.extras else ".")]
        if self.left_out:
            lines.append(f"left out: {self.left_out}.")
        if not self.source_crc32_checked:
            lines.append(_UNCHECKED_SAVED)
        lines.append(f"next:\n  {_verify_line(self.dest, self.against)}\n  load: AutoModelForCausalLM.from_pretrained("
                     f"{self.dest!r}), or publish it: hf upload ORG/NAME {shlex.quote(self.dest)}")
        return "\n".join(lines)


@dataclass(frozen=True)
class ServedResult:
    """`reshard merge --node-local` on the first rank of a node other than node 0: what its copy gave node 0."""

    node: str
    source: str
    dest: str
    files: int
    bytes: int

    def to_json(self) -> str:
        return _dump({"node": self.node, "source": self.source, "dest": self.dest, "files": self.files,
                      "bytes": self.bytes})

    def summary(self) -> str:
        return (f"{self.node}: served its copy of {self.source}, {plural(self.files, 'rank file')} "
                f"({mib(self.bytes)} with headers), to node 0, which merged every node's files into {self.dest} "
                "(node 0 prints the result and the next line).")


# ---- env and demo ----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class EnvResult:
    """`reshard env`: the report a bug report needs (`reshard.env.environment_report`)."""

    report: dict = field(repr=False)

    def to_json(self) -> str:
        return _dump(self.report)

    def summary(self) -> str:
        from .env import format_report

        return format_report(self.report)


@dataclass(frozen=True)
class DemoResult:
    """`reshard demo`: each rank's report, the folders (kept or removed) and the closing report lines."""

    folder: str
    kept: bool
    ranks: tuple[dict, ...] = field(repr=False)
    lines: tuple[str, ...] = ()

    def to_json(self) -> str:
        return _dump({"folder": self.folder, "kept": self.kept, "ranks": list(self.ranks)})

    def summary(self) -> str:
        return "\n".join(self.lines)
