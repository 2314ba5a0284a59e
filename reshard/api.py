"""The library's entry layer: one function per command, each opening its sources through `reshard.read._source` and
returning a frozen result (`reshard.results`) whose `to_json()` is the command's `--json` document and whose
`summary()` is what it prints. The CLI parses flags, calls one of these and prints.
"""

from __future__ import annotations

import os
import shlex

from .errors import ArchitectureError, UsageError
from .plan import LayoutMode, MeshSpec, RankSpans, make_plan
from .read import DISTRIBUTED, SourceKind, OUTPUT_DTYPES, is_url, open_source, refuse_overlap
from .results import EnvResult, FilesResult, MergeResult, PlanResult, ServedResult, VerifyResult, WriteResult


def plan_checkpoint(source, mesh: MeshSpec, *, mode: LayoutMode | str = LayoutMode.BALANCED,
                    revision: str | None = None, stream: bool = False, drop_unloaded: bool = False) -> PlanResult:
    """Read `source`'s metadata (never tensor data), find its experts and plan it on `mesh`: what `reshard plan` runs.

    Args:
        source: anything `reshard.read.open_source` opens (a folder, a cache snapshot, a Hub repo id, an
            `s3://` URL, a reshard or saved folder).
        mesh: the target mesh.
        mode: `balanced` or `stock`.
        revision: Hub revision.
        stream: plan a Hub repo as `write --stream` would read it (the `write` line then says so).
        drop_unloaded: plan a write that leaves out the tensors the model does not load.

    Returns:
        A `PlanResult` (its `plan` is None when the checkpoint has no routed experts).

    Raises:
        ReshardError: any problem with the source, the architecture or the mesh.
    """
    opened = open_source(source, revision=revision, stream=stream, data=False)
    layout = opened.model_layout()
    if not layout.experts:
        return PlanResult(None, str(source))
    plan = make_plan(layout, mesh, mode=mode, quantization=opened.quantization, drop_unloaded=drop_unloaded)
    return PlanResult(plan, str(source), _write_line(str(source), mesh, LayoutMode(mode), revision, stream=stream,
                                                      quantized=opened.quantization is not None))


def _write_line(src: str, mesh: MeshSpec, mode: LayoutMode, revision, *, stream: bool, quantized: bool) -> str:
    """The `reshard write` command for the mesh and flags just planned, with OUT left for the user to name."""
    words = ["reshard", "write", src, "OUT"] + mesh.flags().split()
    words += (["--layout", mode.value] if mode is not LayoutMode.BALANCED else [])
    words += (["--revision", revision] if revision else []) + (["--stream"] if stream else [])
    words += ["--dequantize", "bf16"] if quantized else []
    return " ".join(shlex.quote(w) if w != "OUT" else w for w in words)


def write_checkpoint(source, out, mesh: MeshSpec, *, mode: LayoutMode | str = LayoutMode.BALANCED,
                     revision: str | None = None, stream: bool = False, overwrite: bool = False,
                     max_shard_size: int | None = None, progress: bool | None = None, workers: int | None = 1,
                     distributed: bool | None = None, dequantize: str | None = None,
                     drop_unloaded: bool = False, ranks=None, node_local: bool = False) -> WriteResult | None:
    """Plan `source` on `mesh` and write it to `out`: what `reshard write` runs, with the same defaults except
    `workers`.

    Args:
        source: anything `reshard.read.open_source` opens; a reshard or saved folder goes from mesh to mesh.
        out: the output folder, on a local or shared file system (a URL is refused); it appears only when complete.
        mesh: the target mesh (`reshard.MeshSpec`).
        mode: `balanced` (default) or `stock`.
        revision: Hub revision.
        stream: read a Hub repo in byte ranges instead of downloading it into the cache first.
        overwrite: replace an existing `out` (only an empty folder or a complete reshard output).
        max_shard_size: split each rank's data into files of at most this many bytes.
        progress: a progress bar on stderr (None: when stderr is a terminal).
        workers: processes writing in parallel on this machine (`reshard.write._workers`); 1 writes in this process,
            None picks `reshard.write._workers.default_workers`. Above 1, call this under
            `if __name__ == "__main__":` (the workers are spawned). Not with `distributed`.
        distributed: this process is one rank of a job (torchrun) and every rank calls this with the same
            arguments: each reads `source` on its own node and writes its share of the files into `out`, on a file
            system they all share (`reshard.write._distributed`). None (default): when the launcher's environment
            says so (`RANK`, `LOCAL_RANK`, `WORLD_SIZE` > 1), as `reshard write` and `reshard.from_pretrained` decide.
        dequantize: `bf16` to write a quantized source (FP8 block-scaled, MXFP4) as bf16 rank files in one pass;
            required for such a source, ignored for any other.
        drop_unloaded: leave out the on-disk tensors the model does not load (MTP layers, other unexpected keys).
            By default they are kept, whole and under their own keys, in `extra-*.safetensors` files no rank loads,
            listed in the manifest's `extras`, and `merge` writes them back.
        ranks: write one node's copy: only the files these global ranks load (`RankSpans`, or text like `8-15`),
            and the manifest records them; in this process, for a node set up by ssh or srun.
        node_local: under a multi-node torchrun, each node writes into `out` on its own disk the files its
            processes' ranks load; the mesh must have one rank per process.

    Returns:
        A `WriteResult` (its `manifest` is the folder's; node-local, this node's copy's, with every node's copy on
        node 0), or None on the ranks other than 0 of a distributed write (node-local: other than each node's
        first).

    Raises:
        ReshardError: a problem with the source, the mesh or the output; nothing partial is left. In a distributed
            write, on every rank together.
        UsageError: `out` is a URL; `workers` above 1 in a distributed write; `ranks` in a distributed write, or
            `node_local` outside one.

    Example:
        >>> reshard.write_checkpoint("./Mixtral-8x7B", "./mixtral-fsdp5", reshard.MeshSpec(fsdp=5))
    """
    from .plan import check_max_shard_size
    from .write import Listing, WriteJob, check_url_output, refuse_empty_output, run_job

    refuse_empty_output(out, "OUT")
    refuse_overlap(out, "OUT", [("SRC", source)])  # by spelling now; by the files read, once opened
    check_url_output(out, "OUT", overwrite, "write")
    if dequantize is not None and dequantize not in OUTPUT_DTYPES:
        raise UsageError(f"--dequantize {dequantize}: reshard dequantizes to {', '.join(OUTPUT_DTYPES)} only.")
    check_max_shard_size(max_shard_size)
    spans = RankSpans.parse(ranks) if isinstance(ranks, str) else ranks
    kinds: list[SourceKind] = []

    def read_job(store=None) -> WriteJob:
        opened = open_source(source, revision=revision, stream=stream, store=store)
        kinds.append(opened.kind)
        job = WriteJob(*_plan_for_write(opened, mesh, mode, dequantize, drop_unloaded), max_shard_size)
        return job if spans is None else job.for_ranks(spans)

    local_source = node_local and not is_url(os.fspath(source))  # each node may hold just the files it reads
    job, manifest = run_job(read_job, out, command="write", overwrite=overwrite, progress=progress, workers=workers,
                            distributed=distributed, node_local=node_local, ranks_given=spans is not None,
                            list_from=Listing.of_source(source) if local_source else None)
    if job is None:
        return None
    if node_local:  # this node's first rank: its own copy; node 0 the job's totals too
        return WriteResult(manifest.result, str(out), str(source), kinds[-1], revision,
                           node=manifest.copy.node, copies=manifest.copies, fetched=manifest.copy.fetched)
    return WriteResult(manifest, str(out), str(source), kinds[-1], revision)


def _plan_for_write(opened, mesh: MeshSpec, mode, dequantize: str | None, drop_unloaded: bool) -> tuple:
    """(plan, index) for a write; a quantized source is refused unless `dequantize` says what to write it as (FSDP2
    trains bf16 weights), and checked decodable before any file is written."""
    index = opened.index
    if index.quantization is not None:
        if dequantize is None:
            raise UsageError(f"{opened.spec} is quantized ({index.quantization.describe()}); FSDP2 trains bf16 "
                             "weights, so pass --dequantize bf16 to write bf16 rank files in one pass "
                             "(reshard.write_checkpoint(..., dequantize='bf16')).")
        from .runs import check_decodable

        check_decodable(index)
    layout = opened.model_layout()
    if not layout.experts:
        raise ArchitectureError(f"{opened.spec}: no routed experts found (not a MoE checkpoint); nothing to reshard.")
    return make_plan(layout, mesh, mode=mode, quantization=index.quantization, drop_unloaded=drop_unloaded), index


def verify_folder(out, *, against=None, revision: str | None = None, checksums: bool = True,
                  progress: bool | None = None, ranks=None) -> VerifyResult:
    """Check a reshard folder (or a merged one) and, with `against`, every byte against its source: what `reshard
    verify` runs. The problems are in the result (`ok` is False when there is any); see `reshard.verify`, which
    raises them. `ranks` (`RankSpans` or text like `8-15`): check only the files those ranks load (a node's copy
    staged by hand); a copy written for some ranks (`write --node-local`, `--ranks`) is checked for those."""
    from .errors import VerifyError
    from .read import Folder, open_folder
    from .verification import check_folder, reworded

    spans = RankSpans.parse(ranks) if isinstance(ranks, str) else ranks
    try:  # each opened once, here: the checker opens nothing the caller named
        folder = out if isinstance(out, Folder) else open_folder(out, need_manifest=False)
    except VerifyError as e:  # an unsound manifest: a problem of the folder, in the result
        return VerifyResult(False, str(out), None if against is None else str(against), 0, 0, 0, 0,
                            problems=tuple(e.problems))
    source = None if against is None else reworded(lambda: open_source(against, revision=revision))
    return check_folder(folder, against=source, checksums=checksums, progress=progress, ranks=spans)


def verify(out, *, against=None, revision: str | None = None, checksums: bool = True,
           progress: bool | None = None, ranks=None) -> VerifyResult:
    """Check a `reshard write` folder; with `against`, compare every byte with the source checkpoint.

    Checks: every manifest file exists with its size and CRC-32; each coordinate's files hold every tensor once (a
    chunk, an explicit empty marker, or a whole copy of a replicated tensor); each header holds exactly the chunks
    the manifest derives for it; every sharded tensor's non-empty chunks tile it exactly once; the copied files are
    there and regular, and `config.json` parses. With `against`: each chunk's bytes equal the source's.

    What this proves is the copying: that the bytes sit where the manifest says and equal the source bytes reshard's
    key mapping names. It does not prove that mapping right; the tests check that against transformers' own load.

    Raises:
        ManifestError: `reshard.json` is unsound (a `VerifyError` too), naming the key and the value.
        VerifyError: listing every problem found, one per line.
    """
    from .errors import VerifyError
    from .read import open_folder

    # opened once; an unsound manifest raises its own ManifestError before any file is read
    result = verify_folder(open_folder(out, need_manifest=False), against=against, revision=revision,
                           checksums=checksums, progress=progress, ranks=ranks)
    if not result.ok:
        raise VerifyError(list(result.problems))
    return result


def read_manifest(folder):
    """The validated manifest (`reshard.manifest.Manifest`) of the reshard folder `folder`: a local path or a URL,
    opened as every command opens one (`reshard.read.open_folder`), or a store already open.

    Raises:
        ManifestError: its `reshard.json` is missing, not a regular file, unreadable or unsound.
    """
    from .manifest import read_manifest as read_of_store
    from .read import Store, open_folder

    return read_of_store(folder) if isinstance(folder, Store) else open_folder(folder).manifest


def list_files(out, ranks) -> FilesResult:
    """What `ranks` (a `reshard.plan.RankSpans`, or ranks) need to load the reshard folder `out`, relative to it:
    what `reshard files` runs.

    Raises:
        ManifestError: the folder's manifest is unsound.
        UsageError: a rank outside the folder's mesh (nothing is expanded then), or one whose files a node's copy
            does not hold.
    """
    from .plan import RankSpans
    from .read import open_folder

    opened = open_folder(out)
    store, manifest = opened.store, opened.manifest
    spans = ranks if isinstance(ranks, RankSpans) else RankSpans.of(ranks)
    chosen = spans.expand(manifest.mesh.world_size)  # bounded by the mesh before any span is expanded
    if lacking := [r for r in chosen if not manifest.holds_rank(r)]:  # a node's copy: it cannot stage other ranks
        raise UsageError(f"{out} is a node's copy holding the files of ranks {RankSpans(manifest.holds)} only "
                         f"({'rank' if len(lacking) == 1 else 'ranks'} {RankSpans.of(lacking)} "
                         f"{'needs' if len(lacking) == 1 else 'need'} others): it cannot "
                         "stage another node. List them from a whole folder, or from the node's copy that holds "
                         "them. Nothing was listed.")
    names = manifest.files_for_ranks(chosen)
    size = sum(store.size(n) for n in names if store.exists(n))
    return FilesResult(str(out), tuple(chosen), tuple(sorted({manifest.mesh.coord_of(r) for r in chosen})),
                       tuple(names), size)


def merge_checkpoint(source, dest, *, max_shard_size: int | None = None, layout: str = "original",
                     overwrite: bool = False, progress: bool | None = None, extras_from=None,
                     workers: int | None = 1, distributed: bool | None = False,
                     node_local: bool = False) -> MergeResult | ServedResult | None:
    """Merge a reshard folder or a saved distributed checkpoint into a standard HF checkpoint at `dest`: what
    `reshard merge` runs.

    Args:
        source: a `reshard write` folder, or a folder written by `save_pretrained(..., distributed_checkpoint=True)`
            (local or `s3://`).
        dest: the output folder, on a local or shared file system (a URL is refused); must not exist unless
            `overwrite`, and then be empty, a merge output or a reshard output.
        max_shard_size: bytes per output file at most (a larger tensor gets a file of its own); None: 5 GB, as
            transformers and the Hub write them.
        layout: `original` (the source checkpoint's on-disk keys and shapes, per-expert keys split back out; for a
            saved folder what transformers' own `save_pretrained` writes) or `fused` (the in-memory names).
        overwrite: replace an existing `dest` (swapped in only once complete).
        progress: a byte progress bar (None: only on a terminal; False: never).
        extras_from: for a trained folder saved without them, the reshard folder or HF checkpoint the training
            started from, whose tensors the model does not load (MTP layers) are written back beside the trained ones.
        workers: processes writing shares of the output files on this machine; 1 writes in this process, None picks
            the default. Above 1, call this under `if __name__ == "__main__":`. The output is byte-identical.
        distributed: this process is one rank of a torchrun job and every rank calls this with the same arguments:
            each writes a share of the files into `dest`, on a file system they all share. None: when the launcher's
            environment says so. Not with `workers`.
        node_local: in a torchrun job over several nodes, `source` is at this path on each node's own disk, each
            holding some of the rank files (a node-local write, or a training save): node 0's ranks write `dest` on
            node 0 (or a shared file system), reading the other nodes' files over the process group.

    Returns:
        A `MergeResult`, or None on the ranks other than 0 of a distributed merge; with `node_local`, a
        `ServedResult` on the first rank of each other node (what its copy gave node 0).

    Raises:
        CheckpointError: the input is incomplete (a rank file missing, a gap, overlapping chunks, mixed dtypes), or
            `original` is not known for it; checked before anything is written. Also: a source file's CRC-32
            differs from its manifest's (nothing is kept).
        OutputError: `dest` exists and may not be replaced, is or holds the source, another write holds it, or the
            disk is full; nothing partial is left.
        UsageError: `dest` is a URL; `source` is no distributed checkpoint; `workers` above 1 in a distributed merge.

    Example:
        >>> reshard.merge_checkpoint("ckpt-step1000", "published")  # doctest: +SKIP
    """
    from .plan import check_max_shard_size
    from .write import (DEFAULT_MAX_SHARD_SIZE, Listing, check_url_output, left_out, merge_job, refuse_empty_output,
                        run_job)

    refuse_empty_output(dest, "DEST")
    refuse_overlap(dest, "DEST", [("SRC", source), ("--extras-from", extras_from)])
    check_url_output(dest, "DEST", overwrite, "merge")
    check_max_shard_size(max_shard_size)

    def read_job(store=None):
        extras = None if extras_from is None else open_source(extras_from)
        return merge_job(open_source(source, kinds=DISTRIBUTED, store=store),
                         max_shard_size=max_shard_size or DEFAULT_MAX_SHARD_SIZE, layout=layout, extras_from=extras)

    job, finished = run_job(read_job, dest, command="merge", overwrite=overwrite, progress=progress,
                            workers=workers, distributed=distributed,
                            gather_from=Listing.of_copies(source) if node_local else None)
    if job is None:  # another rank; the first rank of a node that served its files to node 0 says so
        return None if finished is None else ServedResult(finished.copy.node, str(source), str(dest),
                                                          finished.copy.files, finished.copy.bytes)

    # node-local, SRC on node 0 holds node 0's ranks only: the next line compares with the original checkpoint the
    # folder was written from, where its manifest records one (a training save records none: verify DEST alone)
    recorded = getattr(getattr(job.index, "manifest", None), "source", None)
    against = str(source) if not node_local else recorded.source if recorded is not None else None
    return MergeResult(str(dest), str(source), len(job.names), sum(len(p) for p in job.parts),
                       len({t.target.name for p in job.parts for t in p}), sum(job.unit_sizes),
                       job.layout_mode, SourceKind(job.index.kind), job.checked, len(job.layout.extras),
                       left_out(job.index, job.layout), against)


def environment() -> EnvResult:
    """What `reshard env` reports: versions, the loader patch's hooks, the tested matrix, launcher variables."""
    from .env import environment_report

    return EnvResult(environment_report())


def environment_lines(waiting=None):
    """`reshard env`'s lines, each as soon as it is known (the versions at once; torch's build and the hooks after
    importing torch and transformers, which takes seconds: `waiting()` is called before that)."""
    from .env import report_lines

    return report_lines(waiting)
