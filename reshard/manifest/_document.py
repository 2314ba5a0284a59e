"""The manifest a write records, built here beside the parser that reads it back (`validate_manifest`).

From the typed inputs only: the plan (what each file holds follows from its placements), the source index (its name,
header digests, copied files, quantization and on-disk layout) and the entries of the files written. The keys are
built in the order docs/format.md describes them; `dump_manifest` writes them sorted.
"""

from __future__ import annotations

import hashlib
import json
from types import MappingProxyType

from .. import __version__
from ..plan import Placement, ReshardPlan, TargetTensor
from ._entries import CoordEntry, ExtrasEntry, FileEntry, SourceRecord, TensorInfo
from ._format import MANIFEST_FORMAT, MANIFEST_NAME, MANIFEST_VERSION
from ._parsed import Manifest
from ._source_layout import source_layout_record


def build_manifest(plan: ReshardPlan, index, files: list[FileEntry], extras: list[ExtrasEntry] = (), *, where,
                   holds=None) -> Manifest:
    """The manifest of a written folder, typed from what was written, with the document `to_json` writes built from
    those values (`Manifest.written`: the writer's values are not parsed back; a reader validates them).

    Args:
        where: the folder being written (messages name it).
        holds: the rank spans a node's copy holds (`files` are then only theirs), or None for a whole folder.
        plan: the plan the files were written from.
        index: the source (`reshard.read.CheckpointIndex`, or its bf16 view of a quantized checkpoint).
        files: the rank files' entries, every coordinate's, in any order.
        extras: the extras files' entries (`_write_extras`); the `extras` section only when there are any.
    """
    mesh = plan.mesh
    files = tuple(sorted(files, key=lambda f: (f.coord, f.first)))
    records = {tp.tensor.name: _tensor(tp, index) for tp in plan.tensors}
    fields = {"mesh": mesh, "order": tuple(records),
              "tensors": MappingProxyType({name: _tensor_info(tp, records[name]) for name, tp in
                                           zip(records, plan.tensors)}),
              "files": files, "coords": _coords(mesh, files), "copied": tuple(name for name in index.other_files
                                                                              if name != MANIFEST_NAME),
              "source": _source(plan, index), "layout": plan.mode, "extras": tuple(extras),
              # with --drop-unloaded: how many the source held, so that `merge` can say what it cannot write back
              "dropped_unloaded": len(plan.layout.extras) if plan.layout.extras and not plan.extras else 0,
              "tool": f"reshard {__version__}", "holds": None if holds is None else tuple((s[0], s[1]) for s in holds),
              # the same for every node's copy of one write (docs/format.md)
              "write_id": write_id(plan, index)}
    return Manifest.written(_document(plan, index, records, fields), where, **fields)


def _document(plan: ReshardPlan, index, records: dict[str, dict], fields: dict) -> dict:
    """The document of the manifest's typed `fields`, its keys in the order docs/format.md describes them."""
    mesh, source = plan.mesh, fields["source"]
    document = {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "tool": fields["tool"],
        "source": {"source": source.source, "revision": source.revision, "model_type": source.model_type,
                   "architecture": source.architecture, "header_sha256": dict(source.header_sha256),
                   **({"quantization_config": index.quantization.config} if index.quantization is not None else {})},
        "write_id": fields["write_id"],
        "mesh": mesh.to_dict(),
        "distributed_config": mesh.distributed_config_kwargs(),
        "layout": fields["layout"].value,
        "tensors": records,
        "order": list(fields["order"]),  # file entries name runs of it (`first`, `count`)
        # no `ranks`: they follow from the mesh (`MeshSpec.coord_ranks`), so the document does not grow with
        # dp_replicate
        "coords": [{"coord": c.coord, "files": list(c.files), "empty_markers": c.empty_markers}
                   for c in fields["coords"]],
        "files": [entry.record() for entry in fields["files"]],
        "copied": list(fields["copied"]),  # non-weight files, as they were
        # the source's on-disk keys per tensor, for `reshard merge --layout original` (`recorded_source_layout`)
        "source_layout": source_layout_record(plan.layout, index),
        **({"extras": [entry.record() for entry in fields["extras"]]} if fields["extras"] else {}),
        **({"dropped_unloaded": fields["dropped_unloaded"]} if fields["dropped_unloaded"] else {}),
    }
    if fields["holds"] is not None:
        document["holds"] = [list(span) for span in fields["holds"]]
    return document


def write_id(plan: ReshardPlan, index) -> str:
    """The write's identity: the SHA-256 of what was read (each weight file's name, size, header digest and data
    tag, `index.content_tags()`) and what it was planned for (the mesh, the layout, extras kept or dropped). Separate
    `write --ranks` runs from the same content for the same mesh get the same id; other content or another mesh
    another."""
    record = {"content": index.content_tags(), "mesh": plan.mesh.to_dict(), "layout": plan.mode.value,
              "dropped_unloaded": bool(plan.layout.extras and not plan.extras)}
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


def _source(plan: ReshardPlan, index) -> SourceRecord:
    quantization = index.quantization
    return SourceRecord(index.source, index.revision, plan.layout.model_type, plan.layout.architecture,
                        MappingProxyType({f.name: f.digest for f in index.files}),
                        None if quantization is None else MappingProxyType(quantization.config))


def _tensor(tp, index) -> dict:
    tensor = tp.tensor
    return {"shape": list(tensor.shape), "dtype": tensor.dtype, "role": tensor.role.value,
            "is_param": tensor.is_param, "placement": _placement_dict(tp.planned),
            "stock_placement": _placement_dict(tp.stock), **_dequantized_from(tensor, index)}


def _tensor_info(tp, record: dict) -> TensorInfo:
    """The typed entry of tensor `tp`, beside its document `record` (whose `dequantized_from` it shares)."""
    tensor, dequantized = tp.tensor, record.get("dequantized_from")
    return TensorInfo(tensor.name, tuple(tensor.shape), tensor.dtype, tensor.role, tensor.is_param, tp.planned,
                      None if dequantized is None else MappingProxyType(dequantized))


def _coords(mesh, files: tuple[FileEntry, ...]) -> tuple[CoordEntry, ...]:
    """Each coordinate's entry: its ranks (from the mesh), its files in file order and their empty markers."""
    by_coord: dict[int, list[FileEntry]] = {c: [] for c in range(mesh.num_coords)}
    for entry in files:
        by_coord[entry.coord].append(entry)
    return tuple(CoordEntry(c, mesh.coord_ranks(c), tuple(f.name for f in entries),
                            sum(f.empty_markers for f in entries)) for c, entries in by_coord.items())


def _placement_dict(p: Placement) -> dict:
    return {"kind": p.kind.value, "shard_dim": p.shard_dim, "degree": p.degree, "ep": p.ep,
            "placements": p.describe()}


def _dequantized_from(tensor: TargetTensor, index) -> dict:
    """`{"dequantized_from": ...}` for a tensor computed from quantized pieces (their format and keys), else {}."""
    quantized = index.quantization.tensors if index.quantization is not None else {}
    sources = [quantized[p.source] for p in tensor.pieces if p.source in quantized]
    if not sources:
        return {}
    record = sources[0].record()
    record["keys"] = [key for q in sources for key in q.record()["keys"]]
    return {"dequantized_from": record}


def different_writes(where, held: list[tuple[str, str | None, str]]) -> str:
    """The message when nodes hold copies of different writes: `held` is each holder's (name, write id, mesh
    flags), holders of one write named together."""
    from ._parsed import write_label

    groups: dict[tuple, list[str]] = {}
    for who, write, flags in held:
        groups.setdefault((write, flags), []).append(who)
    named = "; ".join(f"{' and '.join(whos)} {'hold' if len(whos) > 1 else 'holds'} {write_label(write)} ({flags})"
                      for (write, flags), whos in groups.items())
    return (f"{where}: the nodes hold copies of different writes: {named}. The source's content or the mesh "
            "differs between them (a copy written before SRC changed, or for another mesh). Every node needs its copy "
            "of one write: write them again together (`torchrun ... -m reshard write SRC OUT ... --node-local`), or "
            "with `write --ranks` on each node from the same SRC content and mesh; `reshard verify` on each node "
            "says which write its copy belongs to. Nothing was changed.")


def unknown_identity(where, lacking: list[str]) -> str:
    """The message when copies meet and some have no `write_id` (an older reshard's manifest): `lacking` names
    their holders. Two such copies of different checkpoints of one shape agree in everything else they record."""
    named = " and ".join(lacking)
    return (f"{where}: {named} {'hold copies' if len(lacking) > 1 else 'holds a copy'} with no write_id (written by "
            "a reshard older than write identities), so nothing tells whether the copies are of one write: two "
            "checkpoints of the same shapes record the same mesh and names. Copies are joined only by identity. "
            "Write every node's copy again with this reshard, together (`torchrun --nnodes N --nproc-per-node P ... "
            "-m reshard write SRC OUT ... --node-local`) or with `write --ranks` on each node from the same SRC "
            "content and mesh; `reshard verify` on each node says which write its copy belongs to. Nothing was "
            "changed.")


def joined_copies(documents: list[dict], where, holders: list[str] | None = None) -> dict:
    """One whole folder's manifest document from the manifests of nodes' copies of it (`write --node-local`): their
    files and coordinates together, the extras from the copy that has them, no `holds`. Copies of one folder differ
    in nothing else; whole copies (staged by hand) are already the same. `holders`: each document's holder, for
    messages (`node 0`, ...). A copy without a `write_id` (an older reshard's) joins only copies whose manifest is
    the same as its own, CRC-32s of every file included (one folder every node sees, or whole copies of it).

    Raises:
        ManifestError: the copies are of different writes (naming which holder holds which), of unknown identity
            and not all the same (naming the holders without a `write_id`), or of different folders (naming the
            key that differs).
    """
    from ..errors import ManifestError

    holders = holders or [f"copy {i}" for i in range(len(documents))]
    if len({d["write_id"] for d in documents if d.get("write_id")}) > 1:
        held = [(who, d.get("write_id"), _flags(d.get("mesh"))) for who, d in zip(holders, documents)]
        raise ManifestError([different_writes(where, held)])
    lacking = [who for who, d in zip(holders, documents) if not d.get("write_id")]
    if lacking and any(d != documents[0] for d in documents):  # so past here, all copies have an id or none has
        raise ManifestError([unknown_identity(where, lacking)])
    skipped = {"holds", "files", "coords", "extras"}
    joined = {k: v for k, v in documents[0].items() if k not in skipped}
    files: dict[str, dict] = {}
    coords: dict[int, dict] = {}
    for document in documents:
        if differs := sorted(k for k in set(joined) | set(document) - skipped
                             if document.get(k) != joined.get(k)):
            raise ManifestError([f"{where}: the nodes hold copies of different folders ({MANIFEST_NAME} differs in "
                                 f"{differs[0]}); every node needs its copy of the same write"])
        files.update((f["name"], f) for f in document.get("files", []) if isinstance(f, dict))
        for entry in (c for c in document.get("coords", []) if isinstance(c, dict)):
            known = coords.setdefault(entry["coord"], {**entry, "files": []})  # a copy lists only its own files
            known["files"] += [name for name in entry.get("files", []) if name not in known["files"]]
        if document.get("extras"):
            joined["extras"] = document["extras"]
    joined["files"] = sorted(files.values(), key=lambda f: (f.get("coord", 0), f.get("first", 0), f["name"]))
    joined["coords"] = [coords[c] for c in sorted(coords)]
    return joined


def _flags(mesh) -> str:
    """A manifest's `mesh` as the command line gives it (`MeshSpec.flags`), from the document as it is."""
    if not isinstance(mesh, dict):
        return f"mesh {mesh!r}"
    order = ["fsdp", "ep", "dp_replicate", "tp", "pp"]
    keys = [k for k in order if k in mesh] + sorted(set(mesh) - set(order))
    return " ".join(f"--{k.replace('_', '-')} {mesh[k]}" for k in keys if mesh[k] != 1 or k == "fsdp")
