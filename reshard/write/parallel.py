"""Parallel and distributed `reshard write`: several writers, one temporary folder, one manifest, one rename.

Every writer runs `reshard.write.shards.write_coordinates` on its share of the fsdp coordinates' files; what differs
is who the writers are and how their file entries come back:

- `write_with_workers` (`reshard write --workers N`): worker processes on this machine. They are spawned (not
  forked: the parent may hold threads, e.g. torch's, and a forked copy of a lock held by one of them never frees),
  get the plan and the index pickled once, and report copied bytes, then their file entries or their error, over a
  pipe each. The parent drives the one progress bar. A worker's error, a worker that dies (its pipe closes before
  its result: SIGKILL, the out-of-memory killer), Ctrl-C or SIGTERM stop every worker before the temporary folder is
  removed.
- `write_distributed` (`torchrun ... -m reshard write`): the ranks of a job. Rank 0 takes the write lock, checks
  OUT and creates the temporary folder on the shared file system; each rank writes its share from its own node's
  SRC; file entries are gathered over a gloo process group; rank 0 writes the manifest and renames once every rank
  reported success. Ranks wait for each other by polling the job's store, never inside a blocking collective, so
  SIGTERM (torchrun's agent stopping the job) is handled at once; collectives run only once every rank is known to
  be there. A rank that fails tells the others to stop at their next copied block; one that dies is noticed by its
  missing heartbeats (or by torchrun, which then stops the rest).

Shares: a coordinate's files are one unit, weighed by their bytes. Units go largest first to the least loaded writer
(ties: the lower coordinate, the lower writer), so every rank computes the same assignment from the same sizes.
Every writer produces the same bytes for a coordinate, so the output is byte-identical to `--workers 1`.
"""

from __future__ import annotations

import contextlib
import hashlib
import heapq
import json
import os
import pickle
import shutil
import signal
import socket
import threading
import time
import traceback
from pathlib import Path

from ..errors import OutputError, ReshardError
from .shards import (
    _check_output,
    _claim_output,
    _discard,
    _finish,
    _output_error,
    _progress_bar,
    sigterm_as_interrupt,
    _signals_held,
    _write_lock,
    INTERRUPT_CLEANUP_S,
    remove_within,
    removes_made_parents,
    write_coordinates,
)

WORKER_MIN_BYTES = 1 << 30  # a worker costs ~0.2 s to start: worth it only with at least this much to write
MAX_DEFAULT_WORKERS = 4  # beyond ~4 streams a single disk stops gaining; pass --workers for a parallel file system
REPORT_EVERY_S = 0.2  # how often a writer reports its copied bytes
POLL_S = 0.1  # how often a rank waiting for the others looks at the store (and lets signals in)
HEARTBEAT_S = 1.0
LINGER_S = 5.0  # how long a failing rank 0 that hosts the store keeps it up for the others to read why they stop
STALE_S = 30.0  # a rank whose heartbeat has not moved for this long is gone (SIGKILL, node down)
COLLECTIVE_TIMEOUT_S = 600  # gloo's limit for one collective; ranks enter them only once all are there
STOP_WORKERS_S = 10.0  # a terminated worker that has not exited by then is killed


# ---- shares ------------------------------------------------------------------------------------------------------

def assign_shares(sizes: list[int], writers: int) -> list[list[int]]:
    """Split coordinates (with `sizes[c]` bytes each) among `writers`, balanced by bytes.

    Greedy largest-first: each coordinate, the largest first, goes to the writer with the fewest bytes so far. Ties
    go to the lower coordinate and the lower writer, so the result depends only on the sizes.

    Returns:
        One sorted list of coordinates per writer (empty for a writer left without one).
    """
    shares: list[list[int]] = [[] for _ in range(writers)]
    loads = [(0, w) for w in range(writers)]
    for coord in sorted(range(len(sizes)), key=lambda c: (-sizes[c], c)):
        load, w = heapq.heappop(loads)
        shares[w].append(coord)
        heapq.heappush(loads, (load + sizes[coord], w))
    return [sorted(share) for share in shares]


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))  # what this process may use (taskset, cgroup cpusets), not the machine
    except AttributeError:
        return os.cpu_count() or 1


def default_workers(data_bytes: int, coordinates: int, cores: int | None = None, *, compute: bool = False) -> int:
    """`--workers` when not given: min(4, half the cores, the coordinates, one per GiB of data), at least 1; with
    `compute` (a dequantizing write), every core instead of min(4, half of them).

    Each copying writer keeps about two cores busy (the kernel copy and its CRC-32 thread), and a small write finishes
    before a worker would have started. A dequantizing writer is bound by its own arithmetic, one core each.
    """
    cores = available_cores() if cores is None else cores
    limit = cores if compute else min(MAX_DEFAULT_WORKERS, cores // 2)
    return max(1, min(limit, coordinates, data_bytes // WORKER_MIN_BYTES))


def _failure(e: BaseException) -> dict:
    """What a writer reports about its exception to the process that decides (it may not unpickle every type)."""
    expected = isinstance(e, (ReshardError, OSError))
    return {"type": type(e).__name__, "message": str(e), "reshard": isinstance(e, ReshardError),
            "errno": e.errno if isinstance(e, OSError) else None,
            "strerror": e.strerror if isinstance(e, OSError) else None,
            "filename": e.filename if isinstance(e, OSError) else None,
            "traceback": None if expected else traceback.format_exc()}


# ---- worker processes on one machine -----------------------------------------------------------------------------

class _PipeProgress:
    """A worker's byte counter: batches `update` calls into one message every REPORT_EVERY_S."""

    def __init__(self, conn):
        self.conn, self.pending, self.last = conn, 0, time.monotonic()

    def update(self, nbytes: int) -> None:
        self.pending += nbytes
        if time.monotonic() - self.last >= REPORT_EVERY_S:
            self.flush()

    def flush(self) -> None:
        if self.pending:
            self.conn.send(("bytes", self.pending))
            self.pending = 0
        self.last = time.monotonic()


def _worker(conn, payload: bytes, tmp: str, coords: list[int], max_shard_size: int | None) -> None:
    """A worker process: write `coords`' files into `tmp`, then send their entries (or the error) to the parent."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C reaches the parent too, which stops us
    progress = _PipeProgress(conn)
    try:
        plan, index = pickle.loads(payload)
        files = write_coordinates(plan, index, Path(tmp), coords, max_shard_size=max_shard_size, progress=progress,
                                  fsync=True)
        progress.flush()
        conn.send(("done", files))
    except (BrokenPipeError, ConnectionResetError):
        raise SystemExit(1)  # the parent is gone: nobody will use these files
    except BaseException as e:  # noqa: BLE001  every failure goes to the parent, which decides
        try:
            conn.send(("error", _failure(e)))
        except OSError:
            pass
        raise SystemExit(1)
    finally:
        conn.close()


def _worker_error(worker: int, count: int, failure: dict) -> BaseException:
    """The parent's exception for a worker's reported failure: the same a write in one process raises."""
    if failure["errno"] is not None:  # mapped by the caller like its own (no space left, write failed)
        return OSError(failure["errno"], failure["strerror"] or failure["message"], failure["filename"])
    if failure["reshard"]:
        return OutputError(failure["message"] if failure["type"] == "OutputError" else
                           f"write worker {worker + 1} of {count}: {failure['message']}")
    return RuntimeError(f"write worker {worker + 1} of {count} failed with {failure['type']}: {failure['message']}\n"
                        f"{failure['traceback'] or ''}")


def _worker_died(worker: int, count: int, proc) -> OutputError:
    proc.join(5)
    code = proc.exitcode
    if code is not None and code < 0:
        try:
            how = f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            how = f"was killed by signal {-code}"
        if -code == signal.SIGKILL:
            how += " (the out-of-memory killer, or someone, stopped it)"
    elif code is None:
        how = "closed its pipe but did not exit"
    else:
        how = f"exited with code {code}"
    return OutputError(f"write worker {worker + 1} of {count} (pid {proc.pid}) {how} before reporting its files; "
                       "every worker was stopped and nothing was kept. Run the write again.")


def _stop_workers(procs: list) -> None:
    """Terminate every worker still running and reap them all; one that ignores SIGTERM is killed."""
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + STOP_WORKERS_S
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join()


def write_with_workers(plan, index, tmp: Path, sizes: list[int], workers: int, *, max_shard_size: int | None = None,
                       progress=None) -> list[dict]:
    """Write every coordinate's files into `tmp` with `workers` processes, each a share balanced by bytes.

    Args:
        sizes: the bytes of each coordinate's chunks, by coordinate.
        progress: an object whose `update(nbytes)` is told of every byte copied (the parent's progress bar).

    Returns:
        The file entries of every coordinate, in coordinate then part order (as one process writes them).

    Raises:
        OSError, OutputError: a worker failed (its error) or died; every worker is stopped before this returns.
        KeyboardInterrupt: Ctrl-C or SIGTERM; every worker is stopped before it propagates.
    """
    import multiprocessing
    from multiprocessing.connection import wait

    shares = [share for share in assign_shares(sizes, workers) if share]
    context = multiprocessing.get_context("spawn")
    payload = pickle.dumps((plan, index), protocol=pickle.HIGHEST_PROTOCOL)  # once, not once per worker
    procs, readers = [], []
    try:
        with _signals_held():  # Ctrl-C waits until every started worker is known, so that it is stopped
            for i, share in enumerate(shares):
                reader, writer = context.Pipe(duplex=False)
                proc = context.Process(target=_worker, args=(writer, payload, str(tmp), share, max_shard_size),
                                       name=f"reshard-write-{i + 1}", daemon=True)
                readers.append(reader)
                proc.start()
                procs.append(proc)
                writer.close()  # the worker holds the only write end: its death closes the pipe
        results: dict[int, list[dict]] = {}
        live = {reader: i for i, reader in enumerate(readers)}
        while live:
            for reader in wait(list(live)):
                i = live[reader]
                try:
                    kind, value = reader.recv()
                except EOFError:
                    raise _worker_died(i, len(shares), procs[i]) from None
                if kind == "bytes":
                    if progress is not None:
                        progress.update(value)
                elif kind == "done":
                    results[i] = value
                    del live[reader]
                else:
                    raise _worker_error(i, len(shares), value)
        # a stable sort by coordinate keeps each coordinate's parts in order: the in-process write's order
        return sorted((entry for i in range(len(shares)) for entry in results[i]), key=lambda f: f["coord"])
    finally:
        with _signals_held():  # a second Ctrl-C must not leave a worker writing into a folder about to be removed
            _stop_workers(procs)
        for reader in readers:
            reader.close()


# ---- a distributed write: one rank of a torchrun job -------------------------------------------------------------

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


def _gloo_group():
    """(the group to use, whether this call created the default group): the default one when it is gloo, a new gloo
    group over it otherwise (file I/O needs no GPU backend), or a default gloo group from the launcher's environment.
    A group created here is kept, as reshard's loader does, so a second write in the same job reuses it."""
    import torch.distributed as dist

    from ..load.loader import launcher_world_size

    if dist.is_initialized():
        return (None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")), False
    if launcher_world_size() is None:
        raise OutputError("a distributed write runs as one rank of a torchrun job, but RANK, LOCAL_RANK and WORLD_SIZE "
                          "are not set. Launch it with `torchrun ... -m reshard write ...`, or drop --distributed.")
    from datetime import timedelta

    try:
        dist.init_process_group("gloo", timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    except (RuntimeError, ValueError, OSError) as e:
        raise OutputError(f"RANK/WORLD_SIZE say this is rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']}, but "
                          f"the process group could not be created ({e}). Check MASTER_ADDR/MASTER_PORT.") from e
    import atexit

    # torn down before the interpreter is: left to finalization, gloo's threads can abort the process (SIGABRT)
    atexit.register(lambda: dist.is_initialized() and dist.destroy_process_group())
    return None, True


def _identity(plan, index, out: Path, max_shard_size, overwrite) -> dict:
    """What must be the same on every rank for their shares to fit together: the command and the checkpoint."""
    headers = hashlib.sha256(json.dumps([(f.name, f.digest) for f in index.files]).encode()).hexdigest()
    return {"OUT": str(out), "mesh": json.dumps(plan.mesh.to_dict(), sort_keys=True), "layout": plan.mode.value,
            "options": f"max_shard_size={max_shard_size} overwrite={overwrite}", "SRC's safetensors headers": headers}


def _agreed_failure(views: list, what: str) -> _Agreed | None:
    """The error every rank raises when any rank's view holds a failure (`None` entries and `_Stopped` are fine)."""
    from ..load.local_read import describe_failures, failing_ranks

    failed = failing_ranks(views)
    if not failed:
        return None
    return _Agreed(f"{describe_failures(failed, len(views), what)}. Every rank stopped; nothing was kept.")


@removes_made_parents("out")
def write_distributed(read_plan, out: str | os.PathLike, *, overwrite: bool = False,
                      max_shard_size: int | None = None, progress: bool | None = None) -> dict | None:
    """Write as one rank of a distributed job: every rank of the job calls this with the same arguments.

    Args:
        read_plan: reads SRC on this rank's node and plans it: `() -> (plan, index)`; its errors are agreed like any
            other rank failure.
        out: the output folder, on a file system every rank sees at the same path.
        overwrite, max_shard_size, progress: as for `reshard.write.shards.write_shards` (the bar is shown on rank 0
            only).

    Returns:
        The manifest document on rank 0, None on the other ranks.

    Raises:
        ReshardError: on every rank together, naming the failing ranks and their causes (a failure that is the same
            on every rank, such as an impossible mesh, is raised as it is). Nothing is kept.
        KeyboardInterrupt: Ctrl-C or SIGTERM (torchrun stopping the job); this rank removed what it could.
    """
    with sigterm_as_interrupt():
        group, _ = _gloo_group()
        with _Ranks(group) as ranks:
            return _write_as_rank(ranks, read_plan, out, overwrite, max_shard_size, progress)


def _write_as_rank(ranks: _Ranks, read_plan, out, overwrite: bool, max_shard_size, progress):
    rank, world = ranks.rank, ranks.world
    out = Path(out).resolve()
    lock = contextlib.ExitStack()
    tmp: Path | None = None
    handed_over = agreed = False
    try:
        # 1. every rank reads its own node's SRC and plans; rank 0 also claims OUT
        local_error: BaseException | None = None
        identity = plan = index = start = None
        claiming = False
        try:
            plan, index = read_plan()
            identity = _identity(plan, index, out, max_shard_size, overwrite)
            if rank == 0:
                claiming = True
                out, copied = _check_output(index, out, overwrite)
                lock.enter_context(_write_lock(out))
                sizes, _, total, tmp = _claim_output(plan, index, out, overwrite, copied)
                tmp.mkdir()
                start = {"tmp": str(tmp), "host": ranks.host, "total": total,
                         "sizes": sizes}
        except Exception as e:  # noqa: BLE001  agreed below: no rank fails alone
            local_error = e
            if not isinstance(e, (ReshardError, OSError)):
                traceback.print_exc()  # not an expected failure: show where, on this rank
        problem = None
        if local_error is not None:
            problem = (str(local_error) if isinstance(local_error, ReshardError) else
                       f"{type(local_error).__name__}: {local_error}")
        views = ranks.exchange("start", (problem, identity, start, claiming))
        problems = [p for p, _, _, _ in views]
        if local_error is not None and len(set(problems)) == 1:
            agreed = True
            raise local_error  # the same on every rank (an impossible mesh, the same bad SRC everywhere): as it is
        if problems[0] is not None and views[0][3] and not any(problems[1:]):
            agreed = True  # about OUT, which only rank 0 checks (it exists, is locked, the disk is too small)
            raise local_error if rank == 0 else _Agreed(problems[0])
        reference = views[0][1]
        for r, (_, other, _, _) in enumerate(views):
            if other is not None and reference is not None and other != reference and not problems[r]:
                differs = ", ".join(k for k in reference if reference[k] != other[k])
                problems[r] = (f"its {differs} differ from rank 0's: every rank needs the same command line and the "
                               "same checkpoint at the same path")
        if (failure := _agreed_failure(problems, "cannot write")) is not None:
            agreed = True
            raise failure
        start = views[0][2]
        tmp = Path(start["tmp"])
        total = start["total"]

        # 2. every rank writes its share into the shared temporary folder
        share = assign_shares(start["sizes"], world)[rank]
        if rank == 0:
            ranks.bar = _progress_bar(sum(start["sizes"]), progress)
        files, result = [], None
        try:
            if not tmp.is_dir():
                raise OutputError(f"{tmp}, created by rank 0 on {start['host']}, is not visible on {ranks.host}: OUT "
                                  "must be on a file system every node shares, at the same path")
            counter = _StoreProgress(ranks)
            files = write_coordinates(plan, index, tmp, share, max_shard_size=max_shard_size, progress=counter,
                                      fsync=True)
            counter.flush()
        except _Stopped:
            result = None  # another rank failed and says why
        except Exception as e:  # noqa: BLE001
            if isinstance(e, OSError):
                e = _output_error(e, out, total)
            result = f"{ranks.host}: {e}" if isinstance(e, ReshardError) else f"{ranks.host}: {type(e).__name__}: {e}"
            if not isinstance(e, ReshardError):
                traceback.print_exc()  # not an expected failure: show where, on this rank
            ranks.announce("stop", result)
        views = ranks.exchange("written", result)
        if (failure := _agreed_failure(views, "failed while writing")) is not None:
            agreed = True
            raise failure
        if ranks.stop.is_set():  # a rank asked to stop but reported no failure: never rename a partial folder
            agreed = True
            raise _Agreed("the write was stopped on some rank; nothing was kept.")
        entries = ranks.gather_to_0(files)
        handed_over = True  # from here only rank 0 touches the temporary folder

        # 3. rank 0 writes the manifest and renames; the others wait for its outcome
        if rank != 0:
            outcome = ranks.wait_for("outcome")
            ranks.store.add(ranks.key("acknowledged"), 1)
            if outcome:
                agreed = True
                raise _Agreed(f"rank 0 could not complete {out}: {outcome}")
            return None
        ranks.watch_peers = False  # the others now only wait for the outcome, then leave
        if ranks.bar is not None:
            ranks.bar.update(ranks.store.add(ranks.key("bytes"), 0) - ranks.bar.n)  # every rank has flushed its count
        try:
            manifest = _finish(plan, index, tmp, out, sorted((f for share in entries for f in share),
                                                             key=lambda f: f["coord"]), copied, overwrite,
                             max_shard_size=max_shard_size)  # rank 0 writes the extras files (`write_extras`)
        except BaseException as e:
            _discard(out, tmp, interrupted=isinstance(e, KeyboardInterrupt))
            reason = (str(_output_error(e, out, total)) if isinstance(e, OSError) else
                      "it was interrupted" if isinstance(e, KeyboardInterrupt) else f"{type(e).__name__}: {e}")
            ranks.announce("outcome", reason)
            agreed = True
            if isinstance(e, OSError):
                raise _output_error(e, out, total) from e
            raise
        ranks.announce("outcome", "")
        # keep the store up (with rank 0, when no agent hosts it) until every rank has read the outcome
        deadline = time.monotonic() + STALE_S
        while ranks.store.add(ranks.key("acknowledged"), 0) < world - 1 and time.monotonic() < deadline:
            time.sleep(POLL_S)
        return manifest
    except BaseException as e:
        if not handed_over and tmp is not None:
            interrupted = isinstance(e, KeyboardInterrupt)  # then removed for a moment only, the rest by the next write
            if rank == 0:
                _discard(out, tmp, interrupted=interrupted)
            elif interrupted:
                remove_within(tmp, out, INTERRUPT_CLEANUP_S)
            else:
                shutil.rmtree(tmp, ignore_errors=True)  # rank 0 may be gone; several ranks may try: all harmless
        if not agreed:
            why = (f"rank {rank} on {ranks.host} was interrupted" if isinstance(e, KeyboardInterrupt) else
                   f"rank {rank} on {ranks.host} stopped ({type(e).__name__}: {e})")
            ranks.leave(why)
        ranks.depart(interrupted=isinstance(e, KeyboardInterrupt))
        raise
    finally:
        lock.close()
        bar, ranks.bar = ranks.bar, None
        if bar is not None:
            bar.close()
