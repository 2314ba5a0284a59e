"""A distributed `write` or `merge`: the ranks of a torchrun job write shares of one output into one folder.

Rank 0 claims OUT (`reshard.write.staged.StagedOutput`: the lock, the checks, the temporary folder on the shared file
system); each rank builds the job from its own node's SRC and writes its share of the units
(`reshard.write.workers.assign_shares`, the same on every rank); the file entries are gathered over a gloo process
group (`reshard.launch.gloo_group`) with the CRC-32s of the source ranges each rank read; rank 0 checks the source
files from them (`reshard.runs.source_check`), completes the folder and swaps it in once every rank reported success.
Ranks wait for each other by polling the job's store, never inside a blocking collective, so SIGTERM (torchrun's
agent stopping the job) is handled at once; collectives run only once every rank is known to be there. A rank that
fails tells the others to stop at their next copied block; one that dies is noticed by its missing heartbeats (or
by torchrun, which then stops the rest). Every rank fails together, with one message naming the failing ranks.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
import traceback
from pathlib import Path

from ..errors import OutputError, ReshardError, UsageError
from ..launch import agreed_failure, gloo_group, launcher_world_size
from ..runs.source_check import SourceCrcs
from ..signals import sigterm_as_interrupt
from .output import in_unit_order, progress_bar
from .staged import output_error, remove_temporary
from .workers import REPORT_EVERY_S, assign_shares

POLL_S = 0.1  # how often a rank waiting for the others looks at the store (and lets signals in)
HEARTBEAT_S = 1.0
LINGER_S = 5.0  # how long a failing rank 0 that hosts the store keeps it up for the others to read why they stop
STALE_S = 30.0  # a rank whose heartbeat has not moved for this long is gone (SIGKILL, node down)


class _Stopped(Exception):
    """Another rank failed: this one stops writing and reports that it stopped."""


class _Agreed(OutputError):
    """An error every rank raises together, decided from a collective."""


class _Answering:
    """The job's store as the main thread uses it. Its host (rank 0 without a launcher agent, else the agent) may
    vanish mid-write: a call that then fails stops this rank with that cause, as an agreed error, instead of a bare
    network error escaping the CLI."""

    def __init__(self, store, ranks: _Ranks):
        self._store, self._ranks = store, ranks

    def __getattr__(self, name: str):
        method = getattr(self._store, name)

        def answered(*args, **kwargs):
            try:
                return method(*args, **kwargs)
            except (RuntimeError, OSError) as e:  # DistNetworkError and DistStoreError are RuntimeErrors
                why = self._ranks.gone or f"the job's store stopped answering ({e}): rank 0 or the launcher is gone"
                raise _Agreed(f"{why}; every rank stopped and nothing was kept.") from e

        return answered


class _Ranks:
    """This rank's part in a distributed write: waits that poll the store, a stop flag, heartbeats, the bar.

    Store keys live under a prefix that is the same on every rank (the job's restart count and how many writes this
    process has run), so two writes in one job never share one.
    """

    writes = 0

    def __init__(self, group):
        import torch.distributed as dist

        self.dist, self.group = dist, group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.host = socket.gethostname()
        store = dist.distributed_c10d._get_default_store()
        try:
            self.watch_store = store.clone()  # its own connection: heartbeats never queue behind the main thread
        except (AttributeError, RuntimeError, NotImplementedError):
            self.watch_store = store
        self.store = _Answering(store, self)
        _Ranks.writes += 1
        self.prefix = f"reshard-write/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{_Ranks.writes}/"
        self.stop = threading.Event()  # some rank failed: stop writing at the next copied block
        self.gone: str | None = None  # some rank left without reporting: no collective can complete
        self.watch_peers = True
        self.bar = None
        self._done = threading.Event()
        self._beats: dict[int, tuple[int, float]] = {}
        self.stale: set[int] = set()  # ranks rank 0 found without heartbeats
        self._thread = threading.Thread(target=self._watch, name="reshard-ranks", daemon=True)

    def key(self, name: str) -> str:
        return self.prefix + name

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._done.set()
        self._thread.join(5)
        self.watch_store = None  # a clone's connection closes now, not at interpreter exit

    def _watch(self) -> None:
        store, last_beat, last_check = self.watch_store, 0.0, time.monotonic()
        while not self._done.wait(POLL_S):
            try:
                now = time.monotonic()
                if now - last_beat >= HEARTBEAT_S:
                    store.add(self.key(f"alive/{self.rank}"), 1)
                    last_beat = now
                if store.check([self.key("stop")]):
                    self.stop.set()
                if self.gone is None and store.check([self.key("gone")]):
                    self.gone = store.get(self.key("gone")).decode()
                    self.stop.set()
                bar = self.bar
                if bar is not None:
                    bar.update(store.add(self.key("bytes"), 0) - bar.n)
                if self.watch_peers and now - last_check >= 2 * HEARTBEAT_S:
                    self._check_heartbeats(store, now)
                    last_check = now
            except Exception as e:  # noqa: BLE001  the store went away with rank 0 or the launcher
                if not self._done.is_set():
                    self.gone = self.gone or f"the job's store stopped answering ({e}): rank 0 or the launcher is gone"
                    self.stop.set()
                return

    def _check_heartbeats(self, store, now: float) -> None:
        """Rank 0 watches every rank, the others rank 0."""
        for r in (range(1, self.world) if self.rank == 0 else (0,)):
            beat = store.add(self.key(f"alive/{r}"), 0)
            seen = self._beats.get(r)
            if seen is None or seen[0] != beat:
                self._beats[r] = (beat, now)
            elif now - seen[1] > STALE_S:
                self.stale.add(r)
                why = f"rank {r} stopped responding {STALE_S:.0f} s ago (killed, or its node is down)"
                self.announce("gone", why, store=store)
                self.gone = self.gone or why

    def announce(self, name: str, message: str, *, store=None) -> None:
        """Set the flag `name` (stop, gone, outcome) to `message`, unless another rank set it first."""
        store = store or self.store
        if store.add(self.key(name + "#"), 1) == 1:
            store.set(self.key(name), message)

    def leave(self, why: str) -> None:
        """Best effort, on the way out: tell the others this rank will not come back (the store may be gone)."""
        try:
            self.announce("gone", why)
        except Exception:  # noqa: BLE001
            pass

    def depart(self, *, interrupted: bool) -> None:
        """Best effort, on the way out of a failed write: count this rank out. Without a launcher agent rank 0's
        process hosts the store, so a failing rank 0 keeps it up (LINGER_S at most) until every rank still alive
        has left: none then misses the flag that says why it stops."""
        try:
            self.store.add(self.key("left"), 1)
            hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
            if self.rank != 0 or not hosts_store or interrupted:  # a signal stops every rank: leave promptly
                return
            deadline = time.monotonic() + LINGER_S
            while (self.store.add(self.key("left"), 0) < self.world - len(self.stale)
                   and time.monotonic() < deadline):
                time.sleep(POLL_S)
        except Exception:  # noqa: BLE001
            pass

    def _arrive(self, step: str) -> None:
        """Wait, polling, until every rank reached `step`; raise at once if a rank is gone."""
        key = self.key(f"arrived/{step}")
        self.store.add(key, 1)
        while self.store.add(key, 0) < self.world:
            if self.gone:
                raise _Agreed(f"{self.gone}; every rank stopped and nothing was kept.")
            time.sleep(POLL_S)

    def exchange(self, step: str, value) -> list:
        """Every rank's `value`, once every rank is there (all_gather_object on the gloo group)."""
        self._arrive(step)
        values: list = [None] * self.world
        try:
            self.dist.all_gather_object(values, value, group=self.group)
        except RuntimeError as e:
            raise _Agreed(f"a rank left during the {step} exchange ({e}); every rank stopped and nothing was "
                          "kept.") from e
        return values

    def gather_to_0(self, value) -> list | None:
        """Every rank's `value` on rank 0 (gather_object on the gloo group); right after an exchange."""
        values = [None] * self.world if self.rank == 0 else None
        try:
            self.dist.gather_object(value, values, group=self.group, group_dst=0)
        except RuntimeError as e:
            raise _Agreed(f"a rank left while the file entries were gathered ({e}); every rank stopped and nothing "
                          "was kept.") from e
        return values

    def wait_for(self, name: str, *, timeout: float | None = None) -> str | None:
        """The flag `name` once set (polling), None after `timeout`; raise if a rank is gone first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.store.check([self.key(name)]):
            if self.gone:
                raise _Agreed(f"{self.gone}; every rank stopped and nothing was kept.")
            if deadline is not None and time.monotonic() > deadline:
                return None
            time.sleep(POLL_S)
        return self.store.get(self.key(name)).decode()


class _StoreProgress:
    """A rank's byte counter: adds to the job's counter every REPORT_EVERY_S (rank 0 shows it), and stops the copy
    when another rank failed."""

    def __init__(self, ranks: _Ranks):
        self.ranks, self.pending, self.last = ranks, 0, time.monotonic()

    def update(self, nbytes: int) -> None:
        if self.ranks.stop.is_set():
            raise _Stopped()
        self.pending += nbytes
        if time.monotonic() - self.last >= REPORT_EVERY_S:
            self.flush()

    def flush(self) -> None:
        if self.pending:
            self.ranks.store.add(self.ranks.key("bytes"), self.pending)
            self.pending = 0
        self.last = time.monotonic()




def _failed(views: list, what: str) -> _Agreed | None:
    """The error every rank raises when any rank's view holds a failure (`None` entries are fine)."""
    return agreed_failure(views, what, _Agreed)


def use_distributed(distributed: bool | None, workers: int | None, command: str) -> bool:
    """Whether a `command` runs as one rank of a distributed job: `distributed`, or, when None, what the launcher's
    environment says (`RANK`, `LOCAL_RANK`, `WORLD_SIZE` > 1).

    Raises:
        UsageError: `workers` above 1 in a distributed run (every rank writes its share there).
    """
    if distributed is None:
        distributed = (launcher_world_size() or 1) > 1
    if distributed and workers not in (None, 1):
        raise UsageError(f"--workers {workers} is for a {command} on one machine; in a torchrun {command} every rank "
                         "writes its share (for more writers per node, raise --nproc-per-node). Nothing was written.")
    return bool(distributed)


def write_distributed(read_job, out, *, overwrite: bool = False, progress: bool | None = None,
                      command: str = "write"):
    """Run an output job as one rank of a distributed job: every rank of the job calls this with the same arguments.

    Args:
        read_job: reads SRC on this rank's node and builds the job (`reshard.write.output.OutputJob`): `() -> job`;
            its errors are agreed like any other rank failure.
        out: the output folder, on a file system every rank sees at the same path.
        overwrite, progress: as for `reshard.write.output.write_output` (the bar is shown on rank 0 only).
        command: `write` or `merge`, for messages.

    Returns:
        What the job's `finish` returns on rank 0 (a write's manifest document), None on the other ranks.

    Raises:
        ReshardError: on every rank together, naming the failing ranks and their causes (a failure that is the same
            on every rank, such as an impossible mesh, is raised as it is). Nothing is kept.
        KeyboardInterrupt: Ctrl-C or SIGTERM (torchrun stopping the job); this rank removed what it could.
    """
    with sigterm_as_interrupt():
        group, _ = gloo_group(command)
        with _Ranks(group) as ranks:
            return _Rank(ranks, Path(out).resolve(), overwrite, progress).run(read_job)


class _Rank:
    """One rank's run of a distributed job, step by step: start (read, plan, claim), write the share, finish."""

    def __init__(self, ranks: _Ranks, out: Path, overwrite: bool, progress):
        self.ranks, self.out, self.overwrite, self.progress = ranks, out, overwrite, progress
        self.lock = contextlib.ExitStack()
        self.stage = None  # rank 0's claimed OUT
        self.tmp: Path | None = None
        self.total = 0  # the bytes the output needs, for a full disk's message
        self.handed_over = self.agreed = False

    def run(self, read_job):
        ranks = self.ranks
        try:
            job, start = self._start(read_job)
            entries, source_crcs = self._write_share(job, start)
            self.handed_over = True  # from here only rank 0 touches the temporary folder
            if ranks.rank != 0:
                return self._wait_for_outcome()
            return self._finish(job, entries, source_crcs)
        except BaseException as e:
            self._clean_up(e)
            raise
        finally:
            self.lock.close()
            bar, ranks.bar = ranks.bar, None
            if bar is not None:
                bar.close()

    # ---- 1. every rank reads its own node's SRC and builds the job; rank 0 also claims OUT -----------------------

    def _start(self, read_job):
        ranks, local_error = self.ranks, None
        identity = job = start = None
        claiming = False
        try:
            job = read_job()
            identity = job.identity(self.out, self.overwrite)
            if ranks.rank == 0:
                claiming = True
                start = self._claim(job)
        except Exception as e:  # noqa: BLE001  agreed below: no rank fails alone
            local_error = e
            if not isinstance(e, (ReshardError, OSError)):
                traceback.print_exc()  # not an expected failure: show where, on this rank
        problem = None
        if local_error is not None:
            problem = (str(local_error) if isinstance(local_error, ReshardError) else
                       f"{type(local_error).__name__}: {local_error}")
        views = ranks.exchange("start", (problem, identity, start, claiming))
        self._agree_to_start(views, local_error)
        start = views[0][2]
        self.tmp, self.total = Path(start["tmp"]), start["total"]
        return job, start

    def _claim(self, job) -> dict:
        """Rank 0: OUT checked, locked and claimed, the temporary folder created; what the others need of it."""
        self.stage = job.staged(self.out, self.overwrite)
        self.out = self.stage.out
        self.lock.enter_context(self.stage.locked())
        self.stage.claim(job.needed_bytes())
        self.stage.tmp.mkdir()
        self.tmp = self.stage.tmp
        return {"tmp": str(self.tmp), "host": self.ranks.host, "total": self.stage.total, "sizes": job.unit_sizes}

    def _agree_to_start(self, views: list, local_error: BaseException | None) -> None:
        problems = [p for p, _, _, _ in views]
        if local_error is not None and len(set(problems)) == 1:
            self.agreed = True
            raise local_error  # the same on every rank (an impossible mesh, the same bad SRC everywhere): as it is
        if problems[0] is not None and views[0][3] and not any(problems[1:]):
            self.agreed = True  # about OUT, which only rank 0 checks (it exists, is locked, the disk is too small)
            raise local_error if self.ranks.rank == 0 else _Agreed(problems[0])
        reference = views[0][1]
        for r, (_, other, _, _) in enumerate(views):
            if other is not None and reference is not None and other != reference and not problems[r]:
                differs = ", ".join(k for k in reference if reference[k] != other[k])
                problems[r] = (f"its {differs} differ from rank 0's: every rank needs the same command line and the "
                               "same checkpoint at the same path")
        if (failure := _failed(problems, "cannot write")) is not None:
            self.agreed = True
            raise failure

    # ---- 2. every rank writes its share into the shared temporary folder ----------------------------------------

    def _write_share(self, job, start: dict) -> tuple[list[dict], SourceCrcs | None]:
        """Write this rank's share; on rank 0, every rank's file entries in unit order and source CRC-32s."""
        ranks = self.ranks
        share = assign_shares(start["sizes"], ranks.world)[ranks.rank]
        if ranks.rank == 0:
            ranks.bar = progress_bar(sum(start["sizes"]), self.progress, job.command)
        pairs, result, source_crcs = [], None, SourceCrcs(job.index)
        try:
            if not self.tmp.is_dir():
                raise OutputError(f"{self.tmp}, created by rank 0 on {start['host']}, is not visible on {ranks.host}: "
                                  "OUT must be on a file system every node shares, at the same path")
            counter = _StoreProgress(ranks)
            pairs = job.write_units(self.tmp, share, progress=counter, fsync=True, source_crcs=source_crcs)
            counter.flush()
        except _Stopped:
            result = None  # another rank failed and says why
        except Exception as e:  # noqa: BLE001
            result = self._share_failure(e)
            ranks.announce("stop", result)
        views = ranks.exchange("written", result)
        if (failure := _failed(views, "failed while writing")) is not None:
            self.agreed = True
            raise failure
        if ranks.stop.is_set():  # a rank asked to stop but reported no failure: never rename a partial folder
            self.agreed = True
            raise _Agreed("the write was stopped on some rank; nothing was kept.")
        gathered = ranks.gather_to_0((pairs, source_crcs.report()))
        if gathered is None:
            return [], None
        checker = SourceCrcs(job.index)  # every rank's ranges, this one's among them: rank 0 checks once
        for _, report in gathered:
            checker.add_report(report)
        return in_unit_order([pair for share, _ in gathered for pair in share]), checker

    def _share_failure(self, e: Exception) -> str:
        host = self.ranks.host
        if isinstance(e, OSError):
            e = output_error(e, self.out, self.total)
        if not isinstance(e, ReshardError):
            traceback.print_exc()  # not an expected failure: show where, on this rank
            return f"{host}: {type(e).__name__}: {e}"
        return f"{host}: {e}"

    # ---- 3. rank 0 completes the folder and swaps it in; the others wait for its outcome -------------------------

    def _wait_for_outcome(self) -> None:
        ranks = self.ranks
        outcome = ranks.wait_for("outcome")
        ranks.store.add(ranks.key("acknowledged"), 1)
        if outcome:
            self.agreed = True
            raise _Agreed(f"rank 0 could not complete {self.out}: {outcome}")
        return None

    def _finish(self, job, entries: list[dict], source_crcs: SourceCrcs):
        ranks = self.ranks
        ranks.watch_peers = False  # the others now only wait for the outcome, then leave
        if ranks.bar is not None:
            ranks.bar.update(ranks.store.add(ranks.key("bytes"), 0) - ranks.bar.n)  # every rank has flushed its count
        try:
            # rank 0 writes the rest (a write's extras files, the manifest)
            result = job.finish(self.tmp, entries, self.out, source_crcs)
            source_crcs.check()  # a damaged source file is refused before the output is put in place
            self.stage.complete()
        except BaseException as e:
            self.stage.discard(interrupted=isinstance(e, KeyboardInterrupt))
            reason = (str(self.stage.error(e)) if isinstance(e, OSError) else
                      "it was interrupted" if isinstance(e, KeyboardInterrupt) else
                      str(e) if isinstance(e, ReshardError) else f"{type(e).__name__}: {e}")
            ranks.announce("outcome", reason)
            self.agreed = True
            if isinstance(e, OSError):
                raise self.stage.error(e) from e
            raise
        ranks.announce("outcome", "")
        # keep the store up (with rank 0, when no agent hosts it) until every rank has read the outcome
        deadline = time.monotonic() + STALE_S
        while ranks.store.add(ranks.key("acknowledged"), 0) < ranks.world - 1 and time.monotonic() < deadline:
            time.sleep(POLL_S)
        return result

    def _clean_up(self, e: BaseException) -> None:
        ranks, interrupted = self.ranks, isinstance(e, KeyboardInterrupt)
        if not self.handed_over and self.tmp is not None:
            # interrupted: removed for a moment only, the rest by the next write
            if self.stage is not None:
                self.stage.discard(interrupted=interrupted)
            else:
                remove_temporary(self.tmp, self.out, interrupted=interrupted)  # several ranks may try: harmless
        if not self.agreed:
            why = (f"rank {ranks.rank} on {ranks.host} was interrupted" if interrupted else
                   f"rank {ranks.rank} on {ranks.host} stopped ({type(e).__name__}: {e})")
            ranks.leave(why)
        ranks.depart(interrupted=interrupted)
