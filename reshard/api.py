"""Library entry points the CLI calls: one function per command."""

from __future__ import annotations

from .checkpoint import read_checkpoint
from .mesh import MeshSpec
from .plan import LayoutMode, ReshardPlan, make_plan


def plan_checkpoint(source, mesh: MeshSpec, *, mode: LayoutMode | str = LayoutMode.BALANCED,
                    revision: str | None = None, need_data: bool = False) -> ReshardPlan | None:
    """Read `source`'s metadata, find its experts and plan it on `mesh`.

    Args:
        source: a folder, a `.safetensors` file or a Hub repo id.
        mesh: the target mesh.
        mode: `balanced` or `stock`.
        revision: Hub revision.
        need_data: download tensor files too (for writing).

    Returns:
        The plan, or None when the checkpoint has no routed experts.

    Raises:
        ReshardError: any problem with the source, the architecture or the mesh.
    """
    from .experts import find_experts

    index = read_checkpoint(source, revision=revision, need_data=need_data)
    layout = find_experts(index)
    if not layout.experts:
        return None
    return make_plan(layout, mesh, mode=mode)


def write_checkpoint(source, out, mesh: MeshSpec, *, mode: LayoutMode | str = LayoutMode.BALANCED,
                     revision: str | None = None, overwrite: bool = False, max_shard_size: int | None = None,
                     progress: bool | None = None, workers: int | None = 1, distributed: bool = False) -> dict | None:
    """Plan `source` on `mesh` and write it to `out` (see `reshard.write.write_shards`).

    Args:
        workers: processes writing in parallel on this machine (`reshard.parallel.write_with_workers`); 1 writes in
            this process, None picks `reshard.parallel.default_workers`. Above 1, call this under
            `if __name__ == "__main__":` (the workers are spawned). Not with `distributed`.
        distributed: this process is one rank of a job (torchrun) and every rank calls this with the same
            arguments: each reads `source` on its own node and writes its share of the files into `out`, on a file
            system they all share (`reshard.parallel.write_distributed`).

    Returns:
        The manifest document (None on the ranks other than 0 of a distributed write).

    Raises:
        ReshardError: a problem with the source, the mesh or the output; nothing partial is left. In a distributed
            write, on every rank together.
        ValueError: `workers` above 1 with `distributed`.
    """
    from .errors import ArchitectureError
    from .experts import find_experts
    from .write import write_shards

    def read_and_plan():
        index = read_checkpoint(source, revision=revision, need_data=True)
        layout = find_experts(index)
        if not layout.experts:
            raise ArchitectureError(f"{source}: no routed experts found (not a MoE checkpoint); nothing to reshard.")
        return make_plan(layout, mesh, mode=mode), index

    if distributed:
        if workers not in (None, 1):
            raise ValueError("workers > 1 is for a write on one machine; in a distributed write each rank writes its "
                             "share (start more ranks per node instead).")
        from .parallel import write_distributed

        return write_distributed(read_and_plan, out, overwrite=overwrite, max_shard_size=max_shard_size,
                                 progress=progress)
    plan, index = read_and_plan()
    return write_shards(plan, index, out, overwrite=overwrite, max_shard_size=max_shard_size, progress=progress,
                        workers=workers)
