"""Library entry points the CLI calls: one function per command."""

from __future__ import annotations

import functools

from .errors import ArchitectureError, UsageError
from .read.checkpoint import CheckpointIndex, read_checkpoint
from .plan.mesh import MeshSpec
from .plan.placement import LayoutMode, ReshardPlan, make_plan
from .read.quant import OUTPUT_DTYPES, dequantized_view, detect_quantization


def read_source(source, *, revision: str | None = None, need_data: bool = False) -> CheckpointIndex:
    """`read_checkpoint`, and for a quantized checkpoint its bf16 view (`reshard.read.quant.dequantized_view`):
    what every command plans, writes and verifies against."""
    index = read_checkpoint(source, revision=revision, need_data=need_data)
    quantization = detect_quantization(index)
    return index if quantization is None else dequantized_view(index, quantization)


def plan_checkpoint(source, mesh: MeshSpec, *, mode: LayoutMode | str = LayoutMode.BALANCED,
                    revision: str | None = None, need_data: bool = False,
                    drop_unloaded: bool = False) -> ReshardPlan | None:
    """Read `source`'s metadata, find its experts and plan it on `mesh`.

    Args:
        source: a folder, a `.safetensors` file or a Hub repo id.
        mesh: the target mesh.
        mode: `balanced` or `stock`.
        revision: Hub revision.
        need_data: download tensor files too (for writing).
        drop_unloaded: plan a write that leaves out the tensors the model does not load (see `write_checkpoint`).

    Returns:
        The plan, or None when the checkpoint has no routed experts.

    Raises:
        ReshardError: any problem with the source, the architecture or the mesh.
    """
    from .read.experts import find_experts

    index = read_source(source, revision=revision, need_data=need_data)
    layout = find_experts(index)
    if not layout.experts:
        return None
    return make_plan(layout, mesh, mode=mode, quantization=index.quantization, drop_unloaded=drop_unloaded)


def write_checkpoint(source, out, mesh: MeshSpec, *, mode: LayoutMode | str = LayoutMode.BALANCED,
                     revision: str | None = None, overwrite: bool = False, max_shard_size: int | None = None,
                     progress: bool | None = None, workers: int | None = 1, distributed: bool | None = None,
                     dequantize: str | None = None, drop_unloaded: bool = False) -> dict | None:
    """Plan `source` on `mesh` and write it to `out`: what `reshard write` runs, with the same defaults except
    `workers` (see `reshard.write.shards.write_shards`).

    Args:
        source: a folder, a `.safetensors` file, a Hub repo id, a reshard folder or a saved distributed checkpoint.
        out: the output folder; it appears only when complete.
        mesh: the target mesh (`reshard.MeshSpec`).
        mode: `balanced` (default) or `stock`.
        revision: Hub revision.
        overwrite: replace an existing `out` (only an empty folder or a complete reshard output).
        max_shard_size: split each rank's data into files of at most this many bytes.
        progress: a progress bar on stderr (None: when stderr is a terminal).
        workers: processes writing in parallel on this machine (`reshard.write.workers`); 1
            writes in this process, None picks `reshard.write.workers.default_workers`. Above 1, call this under
            `if __name__ == "__main__":` (the workers are spawned). Not with `distributed`.
        distributed: this process is one rank of a job (torchrun) and every rank calls this with the same
            arguments: each reads `source` on its own node and writes its share of the files into `out`, on a file
            system they all share (`reshard.write.distributed`). None (default): when the launcher's
            environment says so (`RANK`, `LOCAL_RANK`, `WORLD_SIZE` > 1), as `reshard write` and
            `reshard.from_pretrained` decide.
        dequantize: `bf16` to write a quantized source (FP8 block-scaled, MXFP4) as bf16 rank files in one pass;
            required for such a source, ignored for any other.
        drop_unloaded: leave out the on-disk tensors the model does not load (MTP layers, other unexpected keys).
            By default they are kept, whole and under their own keys, in `extra-*.safetensors` files no rank loads,
            listed in the manifest's `extras`, and `merge` writes them back.

    Returns:
        The manifest document (None on the ranks other than 0 of a distributed write).

    Raises:
        ReshardError: a problem with the source, the mesh or the output; nothing partial is left. In a distributed
            write, on every rank together.
        UsageError: `workers` above 1 in a distributed write (it is a `ValueError` too).

    Example:
        >>> reshard.write_checkpoint("./Mixtral-8x7B", "./mixtral-fsdp5", reshard.MeshSpec(fsdp=5))
    """
    from .write.distributed import use_distributed, write_distributed
    from .plan.files import check_max_shard_size
    from .write.shards import WriteJob, write_shards

    if dequantize is not None and dequantize not in OUTPUT_DTYPES:
        raise UsageError(f"--dequantize {dequantize}: reshard dequantizes to {', '.join(OUTPUT_DTYPES)} only.")
    check_max_shard_size(max_shard_size)
    read_plan = functools.partial(_read_and_plan, source, mesh, mode=mode, revision=revision, dequantize=dequantize,
                                  drop_unloaded=drop_unloaded)
    if use_distributed(distributed, workers, "write"):  # more workers per rank are refused before anything is read
        return write_distributed(lambda: WriteJob(*read_plan(), max_shard_size), out, overwrite=overwrite,
                                 progress=progress)
    plan, index = read_plan()
    return write_shards(plan, index, out, overwrite=overwrite, max_shard_size=max_shard_size, progress=progress,
                        workers=workers)


def _read_and_plan(source, mesh: MeshSpec, *, mode, revision, dequantize, drop_unloaded) -> tuple:
    """(plan, index) for a write: what each rank of a distributed write runs on its own node, so its errors are
    agreed like any other rank failure. A reshard folder or a saved distributed checkpoint goes from mesh to mesh."""
    from .read.dcp_source import dcp_kind, read_dcp_source
    from .read.experts import find_experts

    if dcp_kind(source):
        index, layout = read_dcp_source(source)
        return make_plan(layout, mesh, mode=mode, drop_unloaded=drop_unloaded), index
    index = _read_for_write(source, revision, dequantize)
    layout = find_experts(index)
    if not layout.experts:
        raise ArchitectureError(f"{source}: no routed experts found (not a MoE checkpoint); nothing to reshard.")
    return make_plan(layout, mesh, mode=mode, quantization=index.quantization, drop_unloaded=drop_unloaded), index


def _read_for_write(source, revision: str | None, dequantize: str | None) -> CheckpointIndex:
    """`read_source` with the data, refusing a quantized source unless `dequantize` says what to write it as (FSDP2
    trains bf16 weights), and checking it can be decoded before any file is written."""
    index = read_source(source, revision=revision, need_data=True)
    if index.quantization is not None:
        if dequantize is None:
            raise UsageError(f"{source} is quantized ({index.quantization.describe()}); FSDP2 trains bf16 "
                             "weights, so pass --dequantize bf16 to write bf16 rank files in one pass "
                             "(reshard.write_checkpoint(..., dequantize='bf16')).")
        from .runs.dequant import check_decodable

        check_decodable(index)
    return index
