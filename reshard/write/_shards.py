"""`reshard write`: a checkpoint as per-coordinate shard files for a mesh, bytes copied exactly, in one staged output.

Which chunks each file holds comes from the plan (`reshard.plan._files`); the engine fills each file
(`reshard.runs._engine`: byte runs copied from the source files, or bounded slabs computed from quantized ones), so
no tensor is ever materialized. The files of one coordinate are a unit of the job (`WriteJob`), written by this
process, by `--workers N` (`reshard.write._workers`) or by the ranks of a torchrun job (`reshard.write._distributed`),
always the same bytes; one process then writes the extras files, copies the non-weight files and writes the
manifest last, and the staged output (`reshard.write._staged`) swaps the folder in.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path

from ..errors import UsageError
from ..manifest import (ExtrasEntry, FileEntry, MANIFEST_NAME, Manifest, build_manifest, dcp_metadata, extra_file_name,
                        shard_file_name)
from ..plan import ChunkSpec, DTYPE_BITS, ReshardPlan, coordinate_chunks, coordinate_key, coordinate_sizes, split_parts
from ..read import CheckpointIndex
from ..runs import Engine, SourceCrcs
from ._files import copy_source_file, files_at_once, safetensors_header, write_safetensors, write_safetensors_together
from ._output import headers_digest
from ._staged import StagedOutput, fsync_path, staged_output


def _rank_file_layout(items: list) -> tuple[list, bytes, list]:
    """What a rank file of `(ChunkSpec, tensor, box)` items holds: (its chunk specs, its header, the engine's boxes).
    Coordinates with equal chunks (a mesh of thousands has few kinds) share one."""
    specs = [spec for spec, _, _ in items]
    header = safetensors_header(specs, dcp_metadata({s.name: list(s.offsets) for s in specs}))
    return specs, header, [(spec.nbytes, tensor, box) for spec, tensor, box in items]


def write_rank_file(path: Path, layout: tuple[list, bytes, list], engine: Engine, coord: int) -> FileEntry:
    """Write one rank file of `layout` (`_rank_file_layout`) for coordinate `coord`; its manifest entry."""
    specs, header, boxes = layout
    return _rank_file_entry(path, layout, coord, write_safetensors(path, specs, boxes, None, engine, header=header))


def _rank_file_entry(path: Path, layout: tuple[list, bytes, list], coord: int, crc: int) -> FileEntry:
    specs, header, boxes = layout
    # The chunks are a run of the plan's order; their offsets and shapes follow from the placements (the manifest
    # stays linear in tensors plus files, however many coordinates).
    return FileEntry(path.name, coord, specs[0].index, len(specs), len(header) + sum(nbytes for nbytes, _, _ in boxes),
                     f"{crc:08x}", sum(0 in s.shape for s in specs))


def _write_rank_files(files: list[tuple[int, Path, tuple]], engine: Engine) -> list[FileEntry]:
    """Write the rank files `(coord, path, layout)`, one by one or, from a remote source, together; their entries."""
    if len(files) == 1:
        return [write_rank_file(path, layout, engine, coord) for coord, path, layout in files]
    crcs = write_safetensors_together([(path, layout[1], layout[2]) for _, path, layout in files], engine)
    return [_rank_file_entry(path, layout, coord, crc) for (coord, path, layout), crc in zip(files, crcs)]


def _coordinate_files(plan: ReshardPlan, tmp: Path, coords, max_shard_size: int | None):
    """`(coord, path, layout)` of each file of the coordinates, in order; equal coordinates share one layout."""
    last: tuple = (None, None)  # (boxes of every kind, its files' layouts) of the coordinate before
    for coord in coords:
        key = coordinate_key(plan, coord)
        if key != last[0]:  # one coordinate's list at a time
            parts = split_parts(coordinate_chunks(plan, coord), max_shard_size)
            last = (key, [_rank_file_layout(items) for items in parts])
        layouts = last[1]
        for part, layout in enumerate(layouts):
            yield coord, tmp / shard_file_name(coord, part, len(layouts)), layout


def _write_coordinates(plan: ReshardPlan, index: CheckpointIndex, tmp: Path, coords, *,
                      max_shard_size: int | None = None, progress=None, fsync: bool = False,
                      source_crcs: SourceCrcs | None = None, planned_bytes: int | None = None,
                      on_file=None) -> list[FileEntry]:
    """Write the files of the coordinates `coords` into the folder `tmp` and return their manifest entries.

    The one step every writer runs on its share: the in-process write (all coordinates), each worker process of
    `--workers N` and each rank of a distributed write.

    Args:
        coords: the coordinates to write, in order.
        max_shard_size: split each coordinate's data into files of at most this many bytes.
        progress: an object whose `update(nbytes)` is told of every filled byte, or None.
        fsync: flush each written file to disk before returning (a share whose writer reports to another process).
        source_crcs: where the CRC-32s of the source ranges read go, for the process that completes the output;
            None: the source files read are checked here.
        planned_bytes: the data of these coordinates' files, when known (how the engine writes large files).
        on_file: called with each file's path once it is whole (and flushed), or None.

    Returns:
        One entry per file, in coordinate then part order.
    """
    engine = Engine(index, progress, source_crcs, planned_bytes=planned_bytes)
    files = []
    try:
        items = list(_coordinate_files(plan, tmp, coords, max_shard_size))
        at_once = files_at_once(engine, on_file)
        for first in range(0, len(items), at_once):
            group = items[first:first + at_once]
            files += _write_rank_files(group, engine)
            for _, path, _ in group:
                if fsync:
                    fsync_path(path)
                if on_file is not None:
                    on_file(path)
        engine.finish()
    finally:
        engine.close()
    return files


def _write_extras(plan: ReshardPlan, index: CheckpointIndex, folder: Path, *,
                 max_shard_size: int | None = None, source_crcs: SourceCrcs | None = None) -> list[ExtrasEntry]:
    """Write the plan's extras (on-disk tensors the model does not load: MTP layers, ...) whole, under their own
    keys, into `extra-PPPPP-of-NNNNN.safetensors` files in `folder`; returns their manifest entries.

    The names do not match the rank-file pattern transformers' distributed loader looks for, and no coordinate lists
    them, so no rank reads them; `merge` writes them back. Bytes are copied as they are; a quantized pair among them
    is dequantized like every other weight in a dequantizing write, so the output is one consistent bf16 checkpoint.
    `source_crcs` as for `_write_coordinates`.
    """
    if not plan.extras:
        return []
    items = [(ChunkSpec(t.name, t.dtype, t.shape, (0,) * len(t.shape), t.numel * DTYPE_BITS[t.dtype] // 8, i), t,
              tuple((0, n) for n in t.shape)) for i, t in enumerate(plan.extras)]
    engine, entries = Engine(index, source_crcs=source_crcs, planned_bytes=_extras_bytes(plan)), []
    try:
        for part, chunk_items in enumerate(parts := split_parts(items, max_shard_size)):
            path = folder / extra_file_name(part, len(parts))
            specs = [spec for spec, _, _ in chunk_items]
            header = safetensors_header(specs, {"format": "pt"})
            crc = write_safetensors(path, specs, [(s.nbytes, t, box) for s, t, box in chunk_items], None, engine,
                                    header=header)
            entries.append(ExtrasEntry(path.name, len(header) + sum(s.nbytes for s in specs), f"{crc:08x}",
                                       tuple(spec.name for spec in specs)))
        engine.finish()
    finally:
        engine.close()
    return entries


def _extras_bytes(plan: ReshardPlan) -> int:
    """Bytes of tensor data the plan's extras files hold."""
    return sum(t.numel * DTYPE_BITS[t.dtype] // 8 for t in plan.extras)


@dataclass(frozen=True)
class WriteJob:
    """A `write` as an output job (`reshard.write._output._OutputJob`): its units are the coordinates.

    Attributes:
        holds: for a node's own copy, the rank spans whose files it holds (the manifest records them; the extras
            files go with the copy that holds rank 0); None: every rank's.
    """

    plan: ReshardPlan
    index: CheckpointIndex
    max_shard_size: int | None = None
    holds: tuple[tuple[int, int], ...] | None = None
    command = "write"

    @cached_property
    def unit_sizes(self) -> list[int]:
        return coordinate_sizes(self.plan)  # chunk lists are built one coordinate at a time, as its files are written

    @cached_property
    def units(self) -> list[int]:
        mesh = self.plan.mesh
        return list(range(mesh.num_coords)) if self.holds is None else mesh.coords_of(self.holds)

    def for_ranks(self, spans) -> "WriteJob":
        """The job of one node's copy: the files ranks `spans` load (`reshard write --ranks`).

        Raises:
            UsageError: a rank outside the mesh (nothing was written).
        """
        world = self.plan.mesh.world_size
        if (top := max(last for _, last in spans)) >= world:
            raise UsageError(f"--ranks names rank {top}, but the mesh has {world} ranks (0-{world - 1}); pass ranks of "
                             "that mesh. Nothing was written.")
        return replace(self, holds=tuple(tuple(span) for span in spans))

    def for_node(self, spans, world: int, nodes: int) -> "WriteJob":
        """The job of the node whose processes are ranks `spans` of a torchrun job of `world` processes on `nodes`
        nodes (`reshard write --node-local`): each process is the rank of the mesh it will load as.

        Raises:
            UsageError: the mesh's ranks are not the job's processes (the same on every rank).
        """
        mesh = self.plan.mesh
        if mesh.world_size != world:
            raise UsageError(f"--node-local writes each node the files of its own processes' ranks, so the mesh needs "
                             f"one rank per process: {mesh.flags()} has {mesh.world_size} ranks, but this "
                             f"torchrun job runs {world} processes on {nodes} node{'s' if nodes != 1 else ''}. Launch "
                             f"--nnodes x --nproc-per-node = {mesh.world_size} processes, the job that will train on "
                             "this mesh. Nothing was written.")
        return self.for_ranks(spans)

    @property
    def holds_extras(self) -> bool:
        return self.holds is None or any(first == 0 for first, _ in self.holds)

    @property
    def compute(self) -> bool:
        return self.index.quantization is not None

    @property
    def copied(self) -> list[str]:
        """The non-weight files copied beside the shards."""
        return [name for name in self.index.other_files if name != MANIFEST_NAME]

    def staged(self, out, overwrite: bool) -> StagedOutput:
        return staged_output(out, overwrite, self.index, markers=(MANIFEST_NAME,))

    def needed_bytes(self) -> int:
        return (sum(self.unit_sizes[u] for u in self.units) + (_extras_bytes(self.plan) if self.holds_extras else 0)
                + sum(self.index.store.size(name) for name in self.copied))

    def write_units(self, tmp: Path, units, *, progress=None, fsync: bool = False,
                    source_crcs: SourceCrcs | None = None, on_file=None) -> list[tuple[int, FileEntry]]:
        units = list(units)
        files = _write_coordinates(self.plan, self.index, tmp, units, max_shard_size=self.max_shard_size,
                                  progress=progress, fsync=fsync, source_crcs=source_crcs,
                                  planned_bytes=sum(self.unit_sizes[u] for u in units), on_file=on_file)
        return [(entry.coord, entry) for entry in files]

    def finish(self, tmp: Path, entries: list[FileEntry], out: Path, source_crcs: SourceCrcs) -> Manifest:
        """Complete the folder: extras, copied files, the manifest last; returns the manifest."""
        plan, index = self.plan, self.index
        extras = (_write_extras(plan, index, tmp, max_shard_size=self.max_shard_size, source_crcs=source_crcs)
                  if self.holds_extras else [])
        for name in self.copied:
            if name == "config.json" and index.quantization is not None:
                # the bf16 model's config: transformers must not build the quantized model for these files
                from ..read import dequantized_config

                (tmp / name).write_text(json.dumps(dequantized_config(index.config), indent=2) + "\n")
            else:
                copy_source_file(index.store, name, tmp / name)
        manifest = build_manifest(plan, index, entries, extras, where=out, holds=self.holds)
        (tmp / MANIFEST_NAME).write_text(manifest.to_json())
        return manifest

    def identity(self, out: Path, overwrite: bool) -> dict:
        return {"OUT": str(out), "mesh": json.dumps(self.plan.mesh.to_dict(), sort_keys=True),
                "layout": self.plan.mode.value,
                "options": f"max_shard_size={self.max_shard_size} overwrite={overwrite}",
                "SRC's safetensors headers": headers_digest(self.index)}


def _write_shards(plan: ReshardPlan, index: CheckpointIndex, out, *, overwrite: bool = False,
                 max_shard_size: int | None = None, progress: bool | None = None, workers: int | None = 1) -> Manifest:
    """Write `plan` for the source `index` into the folder `out`, in this process or `workers` processes: the
    write step of `reshard.write_checkpoint`, for a plan built by hand (`make_plan` over any `ModelLayout`).

    Returns:
        The manifest written to `out/reshard.json`.

    Raises:
        OutputError: `out` exists (and is not replaceable), is or holds the source, another write to it is running,
            it is not writable, the disk is full, or a worker failed (nothing partial is left).
    """
    from ._runner import run_job

    return run_job(lambda: WriteJob(plan, index, max_shard_size), out, command="write", overwrite=overwrite,
                   progress=progress, workers=workers, distributed=False)[1]
