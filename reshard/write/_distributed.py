"""A distributed `write` or `merge`: the ranks of a torchrun job write shares of one output, into one shared folder or,
with `--node-local`, into each node's own copy of it.

The ranks are grouped by node (torchrun's `GROUP_RANK`, else the host name). Shared, rank 0 claims OUT
(`reshard.write._staged.StagedOutput`: the lock, the checks, the temporary folder on the shared file system) and every
rank writes a share of the units (`reshard.write._workers.assign_shares`, the same on every rank); node-local, the
lowest rank of each node claims OUT on that node's disk, and the node's ranks write a share of the units its ranks
load (`_OutputJob.for_node`). Each rank builds the job from its own node's SRC. The file entries are gathered over a
gloo process group (`reshard.launch.gloo_group`) with the CRC-32s of the source ranges each rank read; each claimer
checks the source files from them (`reshard.runs._source_check`) and completes its folder. Shared, the others wait
for rank 0's outcome; node-local, every claimer first reports that its folder is ready, and only then do they swap
them in, so a failure on one node before that point leaves no node with a new folder. The ranks keep in step
through `reshard.write._ranks`: no rank fails alone, and none hangs when another dies.
"""

from __future__ import annotations

import contextlib
import os
import traceback
from pathlib import Path

from ..errors import OutputError, ReshardError
from ..launch import gloo_group
from ..plan import RankSpans
from ..runs import SourceCrcs
from ..signals import sigterm_as_interrupt
from ..words import mib
from ._finishing import Finishing
from ._output import NodeCopy, in_unit_order, progress_bar, say
from ._nodes import Nodes, node_key
from ._ranks import Agreed, Ranks, Stopped, StoreProgress, agreed
from ._spread import upload_parts, wait_for_senders
from ._staged import remove_temporary, share_failure
from ._workers import assign_shares


def write_distributed(read_job, out, *, overwrite: bool = False, progress: bool | None = None,
                      command: str = "write", node_local: bool = False, gather_from=None, list_from=None):
    """Run an output job as one rank of a distributed job: every rank of the job calls this with the same arguments.

    Args:
        read_job: reads SRC on this rank's node and builds the job (`reshard.write._output._OutputJob`): `() -> job`;
            its errors are agreed like any other rank failure.
        out: the output folder: on a file system every rank sees at the same path, or, `node_local`, on each node's
            own disk at the same path.
        overwrite, progress: as for `reshard.write._output.write_output` (the bar is shown on rank 0 only).
        command: `write` or `merge`, for messages.
        node_local: each node writes into its own `out` the files its ranks load (`job.for_node`).
        gather_from: a `reshard.write.Listing` of the folder on each node's own disk whose files node 0's
            ranks read from every node to write `out` on node 0: `read_job(store)` then takes the joined folder's
            store, and the other nodes' ranks serve their files.
        list_from: with `node_local`, a `Listing` of SRC when it is a local path: each node plans from every node's
            listing joined (`read_job(store)`), so it needs on its own disk only the source files its ranks' files
            read. A path no node has is not listed (a Hub repo id): every node then reads SRC as it is.

    Returns:
        What the job's `finish` returns on rank 0 (a write's manifest), None on the other ranks; `node_local`, a
        `NodeOutcome` on the first rank of each node (its copy; on node 0 every node's too), None on the others.

    Raises:
        ReshardError: on every rank together, naming the failing ranks and their causes (a failure that is the same
            on every rank, such as an impossible mesh, is raised as it is). Nothing is kept, on any node.
        KeyboardInterrupt: Ctrl-C or SIGTERM (torchrun stopping the job); this rank removed what it could.
    """
    with sigterm_as_interrupt():
        if os.environ.get("RANK", "0") == "0":  # before torch is imported and the ranks meet: seconds
            say(command, f"rank 0 of {os.environ.get('WORLD_SIZE', '?')} started; importing torch, joining the other "
                         "ranks, reading SRC's headers", progress)
        group, _ = gloo_group(command)
        with Ranks(group) as ranks:
            out = out if "://" in os.fspath(out) else Path(out).resolve()  # a bucket prefix, or a folder
            return _Rank(ranks, out, overwrite, progress, node_local, gather_from, list_from).run(read_job)


class _Rank(Finishing):
    """One rank's run of a distributed job, step by step: nodes, start (read, plan, claim), write the share, finish
    (`reshard.write._finishing`).

    Its `team` are the ranks writing into one folder with it (every rank, or its node's), led by the lowest, which
    claims the folder and completes it.
    """

    def __init__(self, ranks: Ranks, out: Path, overwrite: bool, progress, node_local: bool, gather_from=None,
                 list_from=None):
        self.ranks, self.out, self.overwrite, self.progress = ranks, out, overwrite, progress
        self.node_local, self.gather_from, self.list_from = node_local, gather_from, list_from
        self.spread = gather_from is not None and not isinstance(out, Path)  # into a bucket: `reshard.write._spread`
        self.peers = self.store = None  # gathering from every node: the requests, and the joined folder
        self.lock = contextlib.ExitStack()
        self.stage = None  # the claimed OUT, on the rank that leads the team
        self.tmp: Path | None = None  # the team's temporary folder; None for a bucket: each rank spools its own
        self.uploads = None  # into a bucket: this rank's uploads (`reshard.write._bucket.Uploads`)
        self.records = None  # and, off rank 0, what they left open for rank 0 to complete
        self.total = 0  # the bytes the output needs, for a full disk's message
        self.handed_over = self.agreed = False
        self.nodes: Nodes | None = None
        self.team: tuple[int, ...] = ()
        self.held: NodeCopy | None = None  # gathering: this node's copy, on its first rank

    @property
    def leads(self) -> bool:
        return self.ranks.rank == self.team[0]

    def run(self, read_job):
        ranks = self.ranks
        self.read_job = read_job
        try:
            self._meet()
            job, start = self._start(read_job)
            entries, source_crcs = self._write_share(job, start)
            if ranks.rank == 0:
                say(job.command, "every share written; checking the source CRC-32s, completing OUT", self.progress)
            self.handed_over = True  # from here only the team's leader touches the temporary folder
            if self.node_local:
                return self._finish_nodes(job, entries, source_crcs)
            if ranks.rank != 0:
                self._wait_for_outcome()
                return self._served()
            return self._finish(job, entries, source_crcs)
        except BaseException as e:
            self._clean_up(e)
            raise
        finally:
            self.lock.close()
            bar, ranks.bar = ranks.bar, None
            if bar is not None:
                bar.close()

    # ---- 0. which node each rank is on ------------------------------------------------------------------------

    def _meet(self) -> None:
        ranks = self.ranks
        listing = self.gather_from or self.list_from
        views = ranks.exchange("nodes", (node_key(), listing is not None and os.path.exists(listing.spec)))
        self.nodes = Nodes.from_views([key for key, _ in views])
        node = self.nodes.of(ranks.rank)
        self.team = (self.nodes.ranks[node] if self.node_local else
                     self.nodes.ranks[0] if self.gather_from is not None else tuple(range(ranks.world)))
        if self.gather_from is not None or any(here for _, here in views):  # a local SRC: on some node's disk
            self._survey(node, listing)

    def _survey(self, node: int, listing) -> None:
        """Every node's listing of its copy of the folder, and the joined folder this rank reads (gathering, node 0's
        ranks, served by the others)."""
        from ._peers import PeerStore, Peers, catalog, survey

        ranks, found, problem = self.ranks, None, None
        local = None
        try:
            local = listing.open_store()
            if ranks.rank == self.nodes.ranks[node][0]:
                found = survey(local)
                shards = [entry[0] for name, entry in found.items() if name.endswith(".safetensors")]
                self.held = NodeCopy(self.nodes.name(node), len(shards), sum(shards), 0)
        except (OSError, ReshardError) as e:
            problem = f"{self.nodes.name(node)}: cannot list {listing.spec} ({e})"
        views = ranks.exchange("survey", (problem, found))
        if (failure := agreed([p for p, _ in views], "cannot read the folder on its disk")) is not None:
            self.agreed = True
            raise failure
        try:
            files = catalog([f for _, f in views], listing.spec, self.nodes.name)
        except ReshardError:
            self.agreed = True  # the same listings on every rank: the same error
            raise
        if self.gather_from is not None:
            self.peers = Peers(ranks, Path(listing.spec), self.team, self.nodes)
        self.store = PeerStore(files, local, node, self.nodes, listing.spec, self.peers)
        self.lock.callback(local.close)

    # ---- 1. every rank reads its own node's SRC and builds the job; each team's leader also claims OUT ----------

    def _start(self, read_job):
        ranks, local_error, problem = self.ranks, None, None
        identity = job = start = None
        try:
            if ranks.rank in self.team:
                job, identity, start = self._read_and_claim(read_job)
            elif self.peers is not None:  # the other nodes' ranks serve their files while node 0's read SRC
                problem = self.peers.serve(self.store.files)
        except Stopped:
            pass  # a rank serving this one failed, and says why
        except Exception as e:  # noqa: BLE001  agreed below: no rank fails alone
            local_error = e
            if not isinstance(e, (ReshardError, OSError)):
                traceback.print_exc()  # not an expected failure: show where, on this rank
        if local_error is not None:
            problem = (str(local_error) if isinstance(local_error, ReshardError) else
                       f"{type(local_error).__name__}: {local_error}")
        views = ranks.exchange("start", (problem, identity, start, self.leads))
        self._agree_to_start(views, local_error)
        if ranks.rank not in self.team:
            return None, None
        start = views[self.team[0]][2]
        self.tmp, self.total = start["tmp"] and Path(start["tmp"]), start["total"]
        if ranks.rank == 0:
            total = sum(v[2]["bytes"] for v in views if v[3])
            say(job.command, f"{ranks.world} ranks joined and planned; writing {mib(total)}", self.progress)
            ranks.bar = progress_bar(total, self.progress, job.command)
        return job, start

    def _read_and_claim(self, read_job):
        """Read SRC and build the job; the team's leader also claims OUT. Gathering, tell the serving ranks when
        done, whatever happened."""
        try:
            job = read_job() if self.store is None else read_job(self.store)
            identity = job.identity(self.out, self.overwrite)
            if self.node_local:
                job = job.for_node(RankSpans.of(self.team), self.ranks.world, len(self.nodes.ranks))
            return job, identity, self._claim(job) if self.leads else None
        finally:
            if self.peers is not None:
                self.peers.done()

    def _claim(self, job) -> dict:
        """The team's leader: OUT checked, locked and claimed, the temporary folder created; what the team needs."""
        self.stage = job.staged(self.out, self.overwrite)
        self.out = self.stage.out
        self.lock.enter_context(self.stage.locked())
        self.stage.claim(job.needed_bytes())
        self.tmp = self.stage.open_shared()
        return {"tmp": self.tmp and str(self.tmp), "host": self.ranks.host, "total": self.stage.total,
                "sizes": job.unit_sizes, "bytes": sum(job.unit_sizes[u] for u in job.units)}

    def _agree_to_start(self, views: list, local_error: BaseException | None) -> None:
        problems = [p for p, _, _, _ in views]
        if local_error is not None and len(set(problems)) == 1:
            self.agreed = True
            raise local_error  # the same on every rank (an impossible mesh, the same bad SRC everywhere): as it is
        leaders = [r for r, view in enumerate(views) if view[3]]
        if any(problems) and all(problems[r] is None for r in range(len(views)) if r not in leaders):
            # about OUT, which only the leaders check (it exists, is locked, the disk is too small)
            self.agreed = True
            if not self.node_local:
                raise local_error if self.ranks.rank == 0 else Agreed(problems[0])
            raise Agreed("; ".join(f"{self.nodes.name(self.nodes.of(r))}: {problems[r]}"
                                   for r in leaders if problems[r]))
        reference = views[0][1]
        for r, (_, other, _, _) in enumerate(views):
            if other is not None and reference is not None and other != reference and not problems[r]:
                differs = ", ".join(k for k in reference if reference[k] != other[k])
                problems[r] = (f"its {differs} differ from rank 0's: every rank needs the same command line and the "
                               "same checkpoint at the same path")
        hint = "" if self.node_local else self.nodes.node_local_hint(problems)
        if (failure := agreed(problems, "cannot write", hint=hint)) is not None:
            self.agreed = True
            raise failure

    # ---- 2. every rank writes its share into its team's temporary folder ----------------------------------------

    def _write_share(self, job, start: dict) -> tuple[list, SourceCrcs | None]:
        """Write this rank's share; on the team's leader, the team's file entries in unit order and source CRC-32s."""
        ranks = self.ranks
        if self.spread:
            return self._spread_share(job)
        if ranks.rank not in self.team:
            return self._serve()
        share = assign_shares(start["sizes"], len(self.team), job.units)[self.team.index(ranks.rank)]
        pairs, result, source_crcs = [], None, SourceCrcs(job.index)
        try:
            if self.tmp is None:  # into a bucket: this rank sends the files it writes
                pairs = self._upload_share(job, share, source_crcs)
            else:
                if not self.tmp.is_dir():
                    raise OutputError(f"{self.tmp}, created by rank 0 on {start['host']}, is not visible on "
                                      f"{ranks.host}: OUT must be on a file system every node shares, at the same path "
                                      "(or pass --node-local to give each node its own copy)")
                counter = StoreProgress(ranks)
                pairs = job.write_units(self.tmp, share, progress=counter, fsync=True, source_crcs=source_crcs)
                counter.flush()
        except Stopped:
            result = None  # another rank failed and says why
        except Exception as e:  # noqa: BLE001
            result = self._share_failure(e)
            ranks.announce("stop", result)
        finally:
            if self.peers is not None:
                self.peers.done()
        return self._gather_entries(job, pairs, result, source_crcs)

    def _spread_share(self, job):
        """Every rank (the other nodes' build the job now) sends its parts of the uploads rank 0 opened."""
        ranks, problem, ids, records, result, source_crcs = self.ranks, None, None, None, None, None
        try:
            job = job or self.read_job(self.store)
            source_crcs = SourceCrcs(job.index)
            if ranks.rank == 0:
                ids = {name: self.stage.uploads.open_upload(name) for name in job.names}
        except Exception as e:  # noqa: BLE001  agreed below
            problem = self._share_failure(e)
        views = ranks.exchange("uploads", (problem, ids))
        if (failure := agreed([p for p, _ in views], "could not start the uploads")) is not None:
            self.agreed = True
            raise failure
        counter = StoreProgress(ranks)
        try:
            records = upload_parts(ranks, self.nodes, job, self.store, self.peers.folder, views[0][1], str(self.out),
                                   source_crcs, counter)
            counter.flush()
        except Stopped:
            pass  # another rank failed and says why
        except Agreed:
            raise
        except Exception as e:  # noqa: BLE001
            result = self._share_failure(e)
            ranks.announce("stop", result)
        self.records = records
        pairs = [job.entry(u) for u in job.units] if ranks.rank == 0 else []
        return self._gather_entries(job, pairs, result, source_crcs)

    def _upload_share(self, job, share, source_crcs) -> list:
        """Write this rank's share into a spool folder of its own, each file sent once whole, its uploads left open
        for rank 0 to complete (rank 0's own are its output's already); the pairs."""
        from ._bucket import Bucket, Uploads

        self.uploads = self.stage.uploads if self.stage is not None else Uploads(Bucket(str(self.out)))
        counter = StoreProgress(self.ranks)
        with self.uploads.spooling() as spool:
            pairs = job.write_units(spool, share, progress=counter, source_crcs=source_crcs,
                                    on_file=self.uploads.send_later)
            records = self.uploads.wait()  # every file sent before the spool goes
        counter.flush()
        self.records = records if self.stage is None else None
        return pairs

    def _serve(self) -> tuple[list, None]:
        """A rank off node 0 while node 0's ranks gather: serve this node's files until they are done."""
        try:
            result = self.peers.serve(self.store.files)
        except Stopped:
            result = None
        except Agreed:
            raise
        except Exception as e:  # noqa: BLE001
            result = self._share_failure(e)
            self.ranks.announce("stop", result)
        self._gather_entries(None, [], result, None)
        return [], None

    def _gather_entries(self, job, pairs: list, result: str | None, source_crcs):
        """Agree that every rank wrote its share; the team's entries and source CRC-32s on its leader."""
        ranks = self.ranks
        views = ranks.exchange("written", result)
        if (failure := agreed(views, "failed while writing")) is not None:
            self.agreed = True
            raise failure
        if ranks.stop.is_set():  # a rank asked to stop but reported no failure: never rename a partial folder
            self.agreed = True
            raise Agreed("the write was stopped on some rank; nothing was kept.")
        mine = (pairs, source_crcs.report() if source_crcs is not None else {}, self.records)
        if self.node_local:  # every leader needs its own node's entries: each rank's go to every rank, then filtered
            gathered = [view for r, view in enumerate(ranks.exchange("entries", mine)) if r in self.team]
            if not self.leads:
                return [], None
        elif (gathered := ranks.gather_to_0(mine)) is None:
            return [], None
        checker = SourceCrcs(job.index)  # every writer's ranges, this one's among them: the leader checks once
        for _, report, records in gathered:
            checker.add_report(report)
            if records:
                self.stage.adopt(records)  # the other ranks' uploads, completed (or aborted) here
        return in_unit_order([pair for share, _, _ in gathered for pair in share]), checker

    def _share_failure(self, e: Exception) -> str:
        return share_failure(e, self.ranks.host, self.out, self.total)

    def _clean_up(self, e: BaseException) -> None:
        ranks, interrupted = self.ranks, isinstance(e, KeyboardInterrupt)
        if self.stage is not None and (not self.handed_over or self.node_local) and not self._completed():
            if self.spread:
                wait_for_senders(ranks)  # a part sent after the abort could bring its upload back
            self.stage.discard(interrupted=e if interrupted else None)
        elif self.uploads is not None and not self.handed_over and self.stage is None:
            self.uploads.abort(interrupted=interrupted)  # this rank's uploads, not yet handed to rank 0
        elif not self.handed_over and self.tmp is not None and self.stage is None:
            # interrupted: removed for a moment only, the rest by the next write
            remove_temporary(self.tmp, self.out, interrupted=e)  # several ranks may try: harmless
        if not self.agreed:
            why = (f"rank {ranks.rank} on {ranks.host} was interrupted" if interrupted else
                   f"rank {ranks.rank} on {ranks.host} stopped ({type(e).__name__}: {e})")
            ranks.leave(why)
        ranks.depart(interrupted=interrupted)

    def _completed(self) -> bool:
        return self.stage is not None and self.stage.completed_all()
