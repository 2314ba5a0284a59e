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
                     progress: bool | None = None) -> dict:
    """Plan `source` on `mesh` and write it to `out` (see `reshard.write.write_shards`).

    Returns:
        The manifest document.

    Raises:
        ReshardError: a problem with the source, the mesh or the output; nothing partial is left.
    """
    from .errors import ArchitectureError
    from .experts import find_experts
    from .write import write_shards

    index = read_checkpoint(source, revision=revision, need_data=True)
    layout = find_experts(index)
    if not layout.experts:
        raise ArchitectureError(f"{source}: no routed experts found (not a MoE checkpoint); nothing to reshard.")
    plan = make_plan(layout, mesh, mode=mode)
    return write_shards(plan, index, out, overwrite=overwrite, max_shard_size=max_shard_size, progress=progress)
