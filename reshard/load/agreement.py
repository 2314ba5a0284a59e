"""The rank agreement to load: every check a rank makes before a distributed load (the manifest, the world size, the
mesh, its own files), caught and gathered in one collective.

Either every rank raises the same `LoadError`, naming each failing rank, or every rank loads: no rank can fail alone
while the others wait in a collective (under srun or mpirun no agent would kill them). Both `reshard.from_pretrained`
(`loader`) and transformers' own `from_pretrained` under the patch (`patch`) agree here.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

from ..errors import LoadError, ReshardError, VerifyError
from ..launch import gather, raise_if_any
from ..manifest import MANIFEST_NAME, Manifest, copied_problems, header_problems, read_manifest
from ..plan.ranks import RankSpans
from ..read.checkpoint import header_of
from ..read.source import locate

_MESH_FIELDS = ("fsdp_size", "ep_size", "dp_replicate_size", "tp_size", "pp_size")


def has_shard_files(folder: Path) -> bool:
    """Whether `folder` looks like a distributed checkpoint (shard files by transformers' naming)."""
    return folder.is_dir() and any(folder.glob("shard-*-model-*-of-*.safetensors"))


@dataclass(frozen=True)
class Agreed:
    """What every rank agreed to load: the manifest, the store its files are read from, the `DistributedConfig`."""

    manifest: Manifest
    store: object
    distributed_config: object


def _check_own_files(manifest: Manifest, store, rank: int) -> str | None:
    """Check the files this rank reads exist, are regular files and readable, with the size and a header that
    holds what the manifest says (names, dtypes, shapes, offsets); a problem or None.

    Their CRC-32 is checked while they are read (`reshard.load.storage`), not here: that would read them twice.
    """
    if not manifest.holds_rank(rank):
        return _node_lacks(manifest, rank, f"holds the files of ranks {RankSpans(manifest.holds)} only")
    for name in manifest.files_of_rank(rank):
        entry = manifest.file_entry(name)
        try:
            size = store.size(name)
            if size != entry.bytes:
                return f"{name} has {size} bytes, the manifest says {entry.bytes}"
            problems = header_problems(entry, manifest.chunks(entry), header_of(store, name))
        except FileNotFoundError:
            if _lost_not_staged(manifest, store, rank):  # a whole folder that lost a file
                return (f"{name} is missing: the folder lost a file since it was written. Write it again, or copy "
                        "the file back from a whole copy")
            return _node_lacks(manifest, rank, f"lacks the files its ranks load (`reshard verify {manifest.where}` "
                                               "lists them)")
        except (ReshardError, OSError) as e:
            return str(e)
        if problems:
            return "; ".join(problems)
    return None


def _node_ranks(rank: int) -> RankSpans:
    """This node's ranks, from torchrun's LOCAL_RANK and LOCAL_WORLD_SIZE (this rank alone without them)."""
    local, size = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    return RankSpans.of(range(rank - local, rank - local + size))


def _lost_not_staged(manifest: Manifest, store, rank: int, probes: int = 64) -> bool:
    """Whether a missing file was lost from a whole folder rather than never copied to this node: this node runs
    every rank, or the folder holds files of ranks off this node (a few probed)."""
    mine = {r for first, last in _node_ranks(rank) for r in range(first, last + 1)}
    if len(mine) >= manifest.mesh.world_size:
        return True
    others = (r for r in range(manifest.mesh.world_size) if r not in mine)
    names = (name for r in others for name in manifest.files_of_rank(r))
    return any(store.exists(name) for _, name in zip(range(probes), names))


def _node_lacks(manifest: Manifest, rank: int, what: str) -> str:
    """Why this node cannot load, and the commands that would give it its ranks' files: the same text on each of
    the node's ranks (torchrun's RANK, LOCAL_RANK, LOCAL_WORLD_SIZE), so they are named together."""
    spans = _node_ranks(rank)
    node = f"node {os.environ['GROUP_RANK']} ({socket.gethostname()})" if "GROUP_RANK" in os.environ else \
        socket.gethostname()
    where = manifest.where
    return (f"on {node}, {where} {what}, not the files of this node's ranks {spans}. Write them there with "
            f"`reshard write SRC {where} {manifest.mesh.flags()} --ranks {spans}` (or every node's copy at once: "
            f"`torchrun ... -m reshard write SRC {where} {manifest.mesh.flags()} --node-local`), or copy them from a "
            f"whole folder: `reshard files FOLDER --ranks {spans}`")


def check_copied(manifest: Manifest, store, *, need_config: bool = True) -> None:
    """Refuse a folder whose copied non-weight files cannot load (`copied_problems`: a special file such as a link
    to /dev/zero or a FIFO, a missing or unparsable config.json) with a `LoadError` saying what to do, before
    transformers opens one (a raw `ValueError`, or an open that blocks). `need_config`: no config was passed. A
    missing tokenizer file does not stop a load (verify reports it)."""
    if problems := copied_problems(store, manifest.copied, config=need_config, all_present=False):
        raise LoadError(f"{manifest.where} cannot be loaded: {'; '.join(problems)}")


def _config_mismatch(distributed_config, manifest: Manifest) -> str | None:
    mesh = manifest.mesh
    given = {k: getattr(distributed_config, k) for k in _MESH_FIELDS}
    wanted = {"fsdp_size": mesh.fsdp, "ep_size": mesh.ep, "dp_replicate_size": mesh.dp_replicate,
              "tp_size": mesh.tp, "pp_size": mesh.pp}
    if given == wanted:
        return None
    return (f"distributed_config {given} does not match the mesh {manifest.where} was written for ({wanted}). "
            f"Pass {mesh.distributed_config_repr()} or omit distributed_config.")


def _local_checks(folder, distributed_config, rank: int, world: int, *, require_manifest: bool, need_config: bool):
    """This rank's view before loading: (has a manifest, the manifest or None, its store, a problem or None).
    Never raises."""
    try:
        store = locate(folder, outside_links=True).store
        if not require_manifest and not store.exists(MANIFEST_NAME):
            return False, None, None, None
        manifest = read_manifest(store)
    except VerifyError as e:
        return False, None, None, "; ".join(e.problems)
    except Exception as e:  # noqa: BLE001  raising here alone would leave the other ranks in the gather
        return False, None, None, f"{MANIFEST_NAME}: {type(e).__name__}: {e}"
    try:
        mesh = manifest.mesh
        if world != mesh.world_size:
            return True, manifest, store, (f"{folder} was written for {mesh.world_size} ranks ({mesh.describe()}) but "
                                           f"this job has {world}. Launch with --nproc-per-node/--nnodes giving "
                                           f"{mesh.world_size} ranks, or write the checkpoint again for this mesh.")
        if distributed_config is not None and (mismatch := _config_mismatch(distributed_config, manifest)):
            return True, manifest, store, mismatch
        check_copied(manifest, store, need_config=need_config)
        return True, manifest, store, _check_own_files(manifest, store, rank)
    except LoadError as e:
        return True, manifest, store, str(e)
    except Exception as e:  # noqa: BLE001
        return True, manifest, store, f"{type(e).__name__}: {e}"


def agree_to_load(folder, distributed_config=None, *, require_manifest: bool = True,
                  need_config: bool = True) -> Agreed | None:
    """Make every pre-load check on every rank and agree on the outcome in one collective.

    Args:
        folder: the folder every rank is about to load (a local path or an `s3://` URL).
        distributed_config: the `DistributedConfig` the caller passed, or None to take the manifest's.
        require_manifest: a folder without `reshard.json` is an error (`reshard.from_pretrained`); when False
            (transformers' own `from_pretrained` under the patch), a folder without it on every rank is not a
            reshard folder and None is returned.
        need_config: the folder's config.json must be there (the caller passes no `config`).

    Returns:
        The agreed manifest, store and `DistributedConfig` on every rank, or None when no rank has a manifest and
        none is required.

    Raises:
        LoadError: on every rank together, naming each failing rank and its cause.
    """
    import torch.distributed as dist
    from transformers.distributed import DistributedConfig

    rank, world = dist.get_rank(), dist.get_world_size()
    has, manifest, store, problem = _local_checks(folder, distributed_config, rank, world,
                                                  require_manifest=require_manifest, need_config=need_config)
    views = gather((has, problem))
    if not require_manifest and not any(h for h, _ in views):
        return None
    if not require_manifest and not all(h for h, _ in views):
        views = [(h, p or (None if h else f"{folder}/{MANIFEST_NAME} is missing on this rank, present on others"))
                 for h, p in views]
    raise_if_any([p for _, p in views])
    if distributed_config is None:
        distributed_config = DistributedConfig(**manifest.mesh.distributed_config_kwargs())
    return Agreed(manifest, store, distributed_config)
