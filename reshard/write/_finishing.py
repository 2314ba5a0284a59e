"""The last step of a distributed `write` or `merge` (`reshard.write._distributed`): completing the output.

Shared, rank 0 finishes the folder (the rest of its files, the source files' CRC-32s checked) and swaps it in, while
the other ranks wait for its outcome; gathering from every node, the other nodes serve their files once more, for the
check. Node-local, every node's leader completes its copy, all say they are ready, and only then do they swap them in,
so a failure on one node before that point leaves no node with a new folder.
"""

from __future__ import annotations

import time

from ..errors import ReshardError
from ..runs import SourceCrcs
from ._output import NodeCopy, NodeOutcome
from ._ranks import POLL_S, STALE_S, Agreed, Stopped


class Finishing:
    """The finishing steps of `reshard.write._distributed._Rank`, which holds the state they use: its ranks, nodes,
    team, the claimed OUT (`stage`), the peers gathering serves and whether the ranks agreed on a failure."""

    # ---- 3. shared: rank 0 completes the folder and swaps it in; the others wait for its outcome -----------------

    def _served(self) -> NodeOutcome | None:
        """Gathering: the first rank of each node but node 0 says what its node gave (node 0 says what it wrote)."""
        if self.gather_from is None or self.held is None or self.nodes.of(self.ranks.rank) == 0:
            return None
        return NodeOutcome(None, self.held)

    def _wait_for_outcome(self) -> None:
        ranks = self.ranks
        if self.peers is not None:
            self._serve_the_finish()
        outcome = ranks.wait_for("outcome")
        ranks.store.add(ranks.key("acknowledged"), 1)
        if outcome:
            self.agreed = True
            raise Agreed(f"rank 0 could not complete {self.out}: {outcome}")
        return None

    def _serve_the_finish(self) -> None:
        """Gathering from every node: the other nodes serve their files once more, until rank 0 has finished and
        checked the source files' CRC-32s (a check reads the bytes no writer read, some on another node); node 0's
        other ranks say at once that they need nothing more."""
        if self.ranks.rank in self.team:
            self.peers.done()
            return
        try:
            self.peers.serve(self.store.files)  # a file it cannot read: announced, and rank 0's outcome says why
        except Stopped:
            pass

    def _finish(self, job, entries: list, source_crcs: SourceCrcs):
        ranks = self.ranks
        self._show_all_bytes()
        try:
            with self.stage.finishing() as tmp:
                try:
                    # rank 0 writes the rest (a write's extras files, the manifest)
                    result = job.finish(tmp, entries, self.out, source_crcs)
                    source_crcs.check()  # a damaged source file is refused before the output is put in place
                except Stopped:  # a node serving the check could not read a file, and says why
                    raise Agreed(ranks.wait_for("stop")) from None
                finally:
                    if self.peers is not None:
                        self.peers.done()  # the other nodes stop serving only now: the check may read their bytes
                self.stage.complete()
        except BaseException as e:
            ranks.watch_peers = False  # the others now only wait for the outcome, then leave
            self.stage.discard(interrupted=e if isinstance(e, KeyboardInterrupt) else None)
            ranks.announce("outcome", self._reason(e))
            self.agreed = True
            if isinstance(e, OSError):
                raise self.stage.error(e) from e
            raise
        ranks.watch_peers = False
        ranks.announce("outcome", "")
        # keep the store up (with rank 0, when no agent hosts it) until every rank has read the outcome
        deadline = time.monotonic() + STALE_S
        while ranks.store.add(ranks.key("acknowledged"), 0) < ranks.world - 1 and time.monotonic() < deadline:
            time.sleep(POLL_S)
        return result

    def _show_all_bytes(self) -> None:
        bar = self.ranks.bar
        if bar is not None:
            bar.update(self.ranks.store.add(self.ranks.key("bytes"), 0) - bar.n)  # every rank has flushed its count

    def _reason(self, e: BaseException) -> str:
        return (str(self.stage.error(e)) if isinstance(e, OSError) else
                "it was interrupted" if isinstance(e, KeyboardInterrupt) else
                str(e) if isinstance(e, ReshardError) else f"{type(e).__name__}: {e}")

    # ---- 3. node-local: every leader completes its folder, all say they are ready, then all swap them in ---------

    def _finish_nodes(self, job, entries: list, source_crcs: SourceCrcs | None):
        ranks, result, problem = self.ranks, None, None
        self._show_all_bytes()
        if self.leads:
            try:
                result = job.finish(self.tmp, entries, self.out, source_crcs)
                source_crcs.check()  # a damaged source file is refused before any node puts its folder in place
            except Exception as e:  # noqa: BLE001  agreed below
                problem = self._reason(e)
        self._agree_nodes("prepared", problem, "could not complete its copy")
        if self.leads:
            try:
                self.stage.complete()
            except OSError as e:
                problem = self._reason(e)
        self._agree_nodes("done", problem, "could not put its copy in place (the nodes before it did: run the "
                                           "command again with --overwrite)")
        # every node's first rank reports its own copy; node 0 also every node's, for the job's totals
        node = self.nodes.of(ranks.rank)
        store = getattr(getattr(job, "index", None), "store", None)
        fetched = ranks.exchange("fetched", store.fetched if store is not None and store.remote else None)
        ours = [fetched[r] for r in self.nodes.ranks[node] if fetched[r] is not None]
        mine = (NodeCopy.of(self.nodes.name(node), result, sum(ours) if ours else None) if self.leads else None)
        copies = tuple(c for c in ranks.exchange("copies", mine) if c is not None)
        if not self.leads:
            return None
        return NodeOutcome(result, mine, copies if node == 0 else ())

    def _agree_nodes(self, step: str, problem: str | None, what: str) -> None:
        views = self.ranks.exchange(step, problem)
        failed = [(r, p) for r, p in enumerate(views) if p]
        if not failed:
            return
        if self.leads and step == "prepared":
            self.stage.discard()
        self.agreed = True
        text = "; ".join(f"{self.nodes.name(self.nodes.of(r))} {what}: {p}" for r, p in failed)
        raise Agreed(f"{text}. Every node stopped; no node kept a partial folder.")
