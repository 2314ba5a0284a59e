"""The ranks of a distributed `write` or `merge` keeping in step: waits that poll the job's store, heartbeats, a stop
flag, agreed failures.

Ranks wait for each other by polling the job's store, never inside a blocking collective, so SIGTERM (torchrun's
agent stopping the job) is handled at once; collectives run only once every rank is known to be there. A rank that
fails tells the others to stop at their next copied block; one that dies is noticed by its missing heartbeats (or
by torchrun, which then stops the rest). Every rank fails together, with one message naming the failing ranks.
"""

from __future__ import annotations

import os
import socket
import threading
import time

from ..errors import OutputError
from ..launch import STOPPED, agreed_failure
from ._workers import REPORT_EVERY_S

POLL_S = 0.1  # how often a rank waiting for the others looks at the store (and lets signals in)
_HEARTBEAT_S = 1.0
_LINGER_S = 5.0  # how long a failing rank 0 that hosts the store keeps it up for the others to read why they stop
STALE_S = 30.0  # a rank whose heartbeat has not moved for this long is gone (SIGKILL, node down)


class Stopped(Exception):
    """Another rank failed: this one stops writing and reports that it stopped."""


class Agreed(OutputError):
    """An error every rank raises together, decided from a collective."""


class _Answering:
    """The job's store as the main thread uses it. Its host (rank 0 without a launcher agent, else the agent) may
    vanish mid-write: a call that then fails stops this rank with that cause, as an agreed error, instead of a bare
    network error escaping the CLI."""

    def __init__(self, store, ranks: Ranks):
        self._store, self._ranks = store, ranks

    def __getattr__(self, name: str):
        method = getattr(self._store, name)

        def answered(*args, **kwargs):
            try:
                return method(*args, **kwargs)
            except (RuntimeError, OSError) as e:  # DistNetworkError and DistStoreError are RuntimeErrors
                why = self._ranks.gone or f"the job's store stopped answering ({e}): rank 0 or the launcher is gone"
                raise Agreed(f"{why}; every rank stopped and nothing was kept.") from e

        return answered


class Ranks:
    """This rank's part in a distributed write: waits that poll the store, a stop flag, heartbeats, the bar.

    Store keys live under a prefix that is the same on every rank (the job's restart count and how many writes this
    rank has run, counted in the store under its own key), so two writes in one job never share one.
    """

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
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        written = store.add(f"reshard-write/{restart}/count/{self.rank}", 1)  # the same on every rank: each counts
        self.prefix = f"reshard-write/{restart}/{written}/"
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
                if now - last_beat >= _HEARTBEAT_S:
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
                if self.watch_peers and now - last_check >= 2 * _HEARTBEAT_S:
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
            deadline = time.monotonic() + _LINGER_S
            while (self.store.add(self.key("left"), 0) < self.world - len(self.stale)
                   and time.monotonic() < deadline):
                time.sleep(POLL_S)
        except Exception:  # noqa: BLE001
            pass

    def _arrive(self, step: str) -> None:
        """Wait, polling, until every rank reached `step`; raise at once if a rank is gone. A rank that said it is
        gone and then arrived (its share failed) is seen by every rank once all are here, in the store itself rather
        than through the watcher's next poll: none enters the collective that rank will not join (measured on a busy
        machine: one rank of four got "a rank left during the exchange" instead of the others' message)."""
        key = self.key(f"arrived/{step}")
        self.store.add(key, 1)
        while self.store.add(key, 0) < self.world:
            if self.gone:
                raise Agreed(f"{self.gone}; every rank stopped and nothing was kept.")
            time.sleep(POLL_S)
        if self.gone is None and self.store.check([self.key("gone")]):
            self.gone = self.store.get(self.key("gone")).decode()
        if self.gone:
            raise Agreed(f"{self.gone}; every rank stopped and nothing was kept.")

    def exchange(self, step: str, value) -> list:
        """Every rank's `value`, once every rank is there (all_gather_object on the gloo group)."""
        self._arrive(step)
        values: list = [None] * self.world
        try:
            self.dist.all_gather_object(values, value, group=self.group)
        except RuntimeError as e:
            raise Agreed(f"a rank left during the {step} exchange ({e}); every rank stopped and nothing was "
                          "kept.") from e
        return values

    def gather_to_0(self, value) -> list | None:
        """Every rank's `value` on rank 0 (gather_object on the gloo group); right after an exchange."""
        values = [None] * self.world if self.rank == 0 else None
        try:
            self.dist.gather_object(value, values, group=self.group, group_dst=0)
        except RuntimeError as e:
            raise Agreed(f"a rank left while the file entries were gathered ({e}); every rank stopped and nothing "
                          "was kept.") from e
        return values

    def wait_for(self, name: str, *, timeout: float | None = None) -> str | None:
        """The flag `name` once set (polling), None after `timeout`; raise if a rank is gone first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.store.check([self.key(name)]):
            if self.gone:
                raise Agreed(f"{self.gone}; every rank stopped and nothing was kept.")
            if deadline is not None and time.monotonic() > deadline:
                return None
            time.sleep(POLL_S)
        return self.store.get(self.key(name)).decode()


class StoreProgress:
    """A rank's byte counter: adds to the job's counter every REPORT_EVERY_S (rank 0 shows it), and stops the copy
    when another rank failed."""

    def __init__(self, ranks: Ranks):
        self.ranks, self.pending, self.last = ranks, 0, time.monotonic()

    def update(self, nbytes: int) -> None:
        if self.ranks.stop.is_set():
            raise Stopped()
        self.pending += nbytes
        if time.monotonic() - self.last >= REPORT_EVERY_S:
            self.flush()

    def flush(self) -> None:
        if self.pending:
            self.ranks.store.add(self.ranks.key("bytes"), self.pending)
            self.pending = 0
        self.last = time.monotonic()




def agreed(views: list, what: str, *, hint: str = "") -> Agreed | None:
    """The error every rank raises when any rank's view holds a failure (`None` entries are fine); `hint` follows
    the standard remedy."""
    return agreed_failure(views, what, Agreed, remedy=" ".join(filter(None, [STOPPED, hint])))
