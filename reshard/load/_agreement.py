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
from ..manifest import (MANIFEST_NAME, Manifest, copied_problems, different_writes, header_problems,
                        unknown_identity, write_label)
from ..plan import RankSpans
from ..read import header_of, open_folder

_MESH_FIELDS = ("fsdp_size", "ep_size", "dp_replicate_size", "tp_size", "pp_size")


def _has_shard_files(folder: Path) -> bool:
    """Whether `folder` looks like a distributed checkpoint (shard files by transformers' naming)."""
    return folder.is_dir() and any(folder.glob("shard-*-model-*-of-*.safetensors"))


def may_hold_reshard_files(folder: Path) -> bool:
    """A local folder that is, or may be on other ranks, a reshard folder: all ranks must then agree on it."""
    return (folder / MANIFEST_NAME).is_file() or _has_shard_files(folder)


@dataclass(frozen=True)
class Agreed:
    """What every rank agreed to load: the manifest, the store its files are read from, the `DistributedConfig`."""

    manifest: Manifest
    store: object
    distributed_config: object


def _check_own_files(manifest: Manifest, store, rank: int) -> str | None:
    """Check the files this rank reads exist, are regular files and readable, with the size and a header that
    holds what the manifest says (names, dtypes, shapes, offsets); a problem or None.

    Their CRC-32 is checked while they are read (`reshard.load._storage`), not here: that would read them twice.
    """
    if not manifest.holds_rank(rank):
        return _node_lacks(manifest, rank, f"holds the files of ranks {RankSpans(manifest.holds)} only")
    for name in manifest.files_of_rank(rank):
        entry = manifest.file_entry(name)
        try:
            size = store.size(name)
            if size != entry.bytes:
                return f"{name} has {size} bytes, the manifest says {entry.bytes}"
            problems = header_problems(entry, manifest.chunks(entry), header_of(store, name, exact=True))
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


def _node_name() -> str:
    """This node in words: torchrun's node rank (GROUP_RANK) and the host name, or the host name alone."""
    host = socket.gethostname()
    return f"node {os.environ['GROUP_RANK']} ({host})" if "GROUP_RANK" in os.environ else host


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
    spans, node = _node_ranks(rank), _node_name()
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
        opened = open_folder(folder, need_manifest=require_manifest)
        if opened.manifest is None:
            return False, None, None, None
        store, manifest = opened.store, opened.manifest
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
    gathered = gather((has, problem, None if manifest is None else _copy_facts(manifest, rank)))
    views = [(h, p) for h, p, _ in gathered]
    if not require_manifest and not any(h for h, _ in views):
        return None
    if not require_manifest and not all(h for h, _ in views):
        views = [(h, p or (None if h else f"{folder}/{MANIFEST_NAME} is missing on this rank, present on others"))
                 for h, p in views]
    copies = _copies_by_node([facts for _, _, facts in gathered])
    lacking = any(p for _, p in views)  # copies swapped between nodes of replicas may still hold each rank's files
    if (mismatch := _different_writes(folder, copies) or (lacking and _nodes_swapped(folder, copies))):
        raise LoadError(mismatch)  # the same gathered facts on every rank: the same message
    raise_if_any([p for _, p in views])
    if distributed_config is None:
        distributed_config = DistributedConfig(**manifest.mesh.distributed_config_kwargs())
    return Agreed(manifest, store, distributed_config)


def _copy_facts(manifest: Manifest, rank: int) -> dict:
    """What this rank's copy is, for comparing copies across nodes: its write, mesh and ranks held, and the node."""
    return {"write": manifest.write_id, "flags": manifest.mesh.flags(),
            "record": None if manifest.write_id else manifest.record_digest,  # an older reshard's: compared whole
            "holds": None if manifest.holds is None else [list(s) for s in manifest.holds],
            "node": _node_name(), "group": os.environ.get("GROUP_RANK"), "host": socket.gethostname(),
            "ranks": list(_node_ranks(rank))}


def _copies_by_node(facts: list[dict | None]) -> list[dict]:
    """One entry per node (its first rank's facts), in rank order; ranks without a manifest left out."""
    nodes: dict[str, dict] = {}
    for entry in facts:
        if entry is not None:
            nodes.setdefault(entry["node"], entry)
    return list(nodes.values())


def _different_writes(folder, copies: list[dict]) -> str | None:
    """The message when nodes hold copies of different writes (other content, or another mesh), else None. A copy
    without a write id (an older reshard's manifest) meets only copies whose manifest is the same as its own (one
    folder every node sees, whole copies of it); else its identity is unknown, and it is refused."""
    names = [f"node {c['group']} ({c['host']}, ranks {RankSpans(c['ranks'])})" if c["group"] is not None else
             f"{c['host']} (ranks {RankSpans(c['ranks'])})" for c in copies]
    if len({c["write"] for c in copies if c["write"]}) > 1 or len({c["flags"] for c in copies}) > 1:
        return different_writes(folder, [(who, c["write"], c["flags"]) for who, c in zip(names, copies)])
    if len({c["record"] for c in copies}) > 1:
        return unknown_identity(folder, [who for who, c in zip(names, copies) if not c["write"]])
    return None


def _nodes_swapped(folder, copies: list[dict]) -> str | None:
    """The message when every node holds a copy of the write, but of another node's ranks: the nodes came up in
    another order than the write's (torchrun's c10d rendezvous numbers nodes by arrival). None otherwise."""
    if len(copies) < 2 or any(c["holds"] is None for c in copies):
        return None
    held = [_ranks_of(c["holds"]) for c in copies]
    given = [_ranks_of(c["ranks"]) for c in copies]
    if held == given or sorted(map(sorted, held)) != sorted(map(sorted, given)):
        return None
    wrong = [f"{c['node']} was given ranks {RankSpans(c['ranks'])} but holds the copy of ranks "
             f"{RankSpans(c['holds'])}" for c, h, g in zip(copies, held, given) if h != g]
    first, per_node = copies[0], len(given[0])
    should = "; ".join(f"the node holding ranks {RankSpans(c['holds'])} must be node {min(h) // per_node}"
                       for c, h in zip(copies, held))
    return (f"{folder}: the nodes came up in another order than the write's: {'; '.join(wrong)}. Every copy is "
            f"there ({write_label(first['write'])}); only the node ranks are swapped. Start the job with the write's "
            f"node ranks ({should}): with torchrun's static rendezvous, `torchrun --nnodes N --node-rank K "
            "--master-addr HOST ...` with K the node's index in the write, or the scheduler's node index "
            "(`--node-rank $SLURM_NODEID`). Only if a copy is wrong, write it again on that node with `reshard write "
            f"SRC {folder} {first['flags']} --ranks FIRST-LAST`. Nothing was loaded.")


def _ranks_of(spans) -> set[int]:
    return {r for first, last in spans for r in range(first, last + 1)}


def agree_for_pretrained(folder, distributed_config, *, need_config: bool):
    """For a patched `from_pretrained` in a multi-rank job: the agreed ((manifest, store), DistributedConfig) for a
    reshard folder, or (None, the config given)."""
    from ..launch import in_distributed_job

    in_distributed_job()  # create the process group from the launcher's environment, as transformers would
    agreed = agree_to_load(folder, distributed_config, require_manifest=False, need_config=need_config)
    if agreed is None:
        return None, distributed_config
    return (agreed.manifest, agreed.store), agreed.distributed_config
