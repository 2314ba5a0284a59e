"""`--workers N`: worker processes on this machine writing shares of one output's files into its temporary folder.

Any output job (`reshard.write._output._OutputJob`: a `write`'s coordinates, a `merge`'s files) is split into units of
files weighed by their bytes; units go largest first to the least loaded writer (ties: the lower unit, the lower
writer), so every writer, and every rank of a distributed write (`reshard.write._distributed`), computes the same
assignment from the same sizes. Every writer produces the same bytes for a unit, so the output is byte-identical to
one process.

Workers are spawned (not forked: the parent may hold threads, e.g. torch's, and a forked copy of a lock held by one
of them never frees), get the job pickled once, and report filled bytes, then their file entries and the CRC-32s of
the source ranges they read, or their error, over a pipe each. The parent drives the one progress bar and checks the
source files from every worker's ranges (`reshard.runs._source_check`). A worker's error, a worker that dies (its pipe
closes before its result: SIGKILL, the out-of-memory killer), Ctrl-C or SIGTERM stop every worker before the temporary
folder is removed.
"""

from __future__ import annotations

import heapq
import os
import pickle
import signal
import time
import traceback
from pathlib import Path

from ..errors import OutputError, ReshardError
from ..runs import SourceCrcs
from ..signals import signals_held

_WORKER_MIN_BYTES = 1 << 30  # a worker costs ~0.2 s to start: worth it only with at least this much to write
_MAX_DEFAULT_WORKERS = 4  # beyond ~4 streams a single disk stops gaining; pass --workers for a parallel file system
REPORT_EVERY_S = 0.2  # how often a writer reports its copied bytes
_STOP_WORKERS_S = 10.0  # a terminated worker that has not exited by then is killed


# ---- shares ------------------------------------------------------------------------------------------------------

def assign_shares(sizes: list[int], writers: int, units=None) -> list[list[int]]:
    """Split `units` (default: every unit; unit `u` has `sizes[u]` bytes) among `writers`, balanced by bytes.

    Greedy largest-first: each unit, the largest first, goes to the writer with the fewest bytes so far. Ties
    go to the lower unit and the lower writer, so the result depends only on the sizes.

    Returns:
        One sorted list of units per writer (empty for a writer left without one).
    """
    shares: list[list[int]] = [[] for _ in range(writers)]
    loads = [(0, w) for w in range(writers)]
    for unit in sorted(range(len(sizes)) if units is None else units, key=lambda u: (-sizes[u], u)):
        load, w = heapq.heappop(loads)
        shares[w].append(unit)
        heapq.heappush(loads, (load + sizes[unit], w))
    return [sorted(share) for share in shares]


def _available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))  # what this process may use (taskset, cgroup cpusets), not the machine
    except AttributeError:
        return os.cpu_count() or 1


def default_workers(data_bytes: int, units: int, cores: int | None = None, *, compute: bool = False) -> int:
    """`--workers` when not given: min(4, half the cores, the units, one per GiB of data), at least 1; with
    `compute` (a dequantizing write), every core instead of min(4, half of them).

    Each copying writer keeps about two cores busy (the kernel copy and its CRC-32 thread), and a small write finishes
    before a worker would have started. A dequantizing writer is bound by its own arithmetic, one core each.
    """
    cores = _available_cores() if cores is None else cores
    limit = cores if compute else min(_MAX_DEFAULT_WORKERS, cores // 2)
    return max(1, min(limit, units, data_bytes // _WORKER_MIN_BYTES))


def _failure_report(e: BaseException) -> dict:
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


def _worker(conn, payload: bytes, tmp: str, units: list[int]) -> None:
    """A worker process: write the `units`' files into `tmp`, then send their entries and the CRC-32s of the source
    ranges read (or the error) to the parent."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C reaches the parent too, which stops us
    progress = _PipeProgress(conn)
    try:
        job = pickle.loads(payload)
        source_crcs = SourceCrcs(job.index)
        files = job.write_units(Path(tmp), units, progress=progress, fsync=True, source_crcs=source_crcs)
        progress.flush()
        conn.send(("done", (files, source_crcs.report())))
    except (BrokenPipeError, ConnectionResetError):
        raise SystemExit(1)  # the parent is gone: nobody will use these files
    except BaseException as e:  # noqa: BLE001  every failure goes to the parent, which decides
        try:
            conn.send(("error", _failure_report(e)))
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
    deadline = time.monotonic() + _STOP_WORKERS_S
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join()


def write_with_workers(job, tmp: Path, workers: int, source_crcs: SourceCrcs, *,
                       progress=None) -> list[tuple]:
    """Write every unit's files of `job` into `tmp` with `workers` processes, each a share balanced by bytes.

    Args:
        progress: an object whose `update(nbytes)` is told of every byte copied (the parent's progress bar).
        source_crcs: where each worker's CRC-32s of the source ranges it read go, for the caller to check.

    Returns:
        `(unit, file entry)` of every file, in unit then part order (as one process writes them).

    Raises:
        OSError, OutputError: a worker failed (its error) or died; every worker is stopped before this returns.
        KeyboardInterrupt: Ctrl-C or SIGTERM; every worker is stopped before it propagates.
    """
    import multiprocessing

    shares = [share for share in assign_shares(job.unit_sizes, workers, job.units) if share]
    context = multiprocessing.get_context("spawn")
    payload = pickle.dumps(job, protocol=pickle.HIGHEST_PROTOCOL)  # once, not once per worker
    procs, readers = [], []
    try:
        with signals_held():  # Ctrl-C waits until every started worker is known, so that it is stopped
            for i, share in enumerate(shares):
                reader, writer = context.Pipe(duplex=False)
                proc = context.Process(target=_worker, args=(writer, payload, str(tmp), share),
                                       name=f"reshard-write-{i + 1}", daemon=True)
                readers.append(reader)
                proc.start()
                procs.append(proc)
                writer.close()  # the worker holds the only write end: its death closes the pipe
        results = _collect(readers, procs, progress)
        for _, report in results.values():
            source_crcs.add_report(report)
        # a stable sort by unit keeps each unit's parts in order: the in-process write's order
        return sorted((entry for i in range(len(shares)) for entry in results[i][0]), key=lambda e: e[0])
    finally:
        with signals_held():  # a second Ctrl-C must not leave a worker writing into a folder about to be removed
            _stop_workers(procs)
        for reader in readers:
            reader.close()


def _collect(readers: list, procs: list, progress) -> dict[int, tuple]:
    """Each worker's file entries and source CRC-32s, by worker, once all have reported; their byte counts go to
    `progress` meanwhile.

    Raises:
        OSError, OutputError: the first worker that reports a failure, or dies before reporting.
    """
    from multiprocessing.connection import wait

    results: dict[int, list] = {}
    live = {reader: i for i, reader in enumerate(readers)}
    while live:
        for reader in wait(list(live)):
            i = live[reader]
            try:
                kind, value = reader.recv()
            except EOFError:
                raise _worker_died(i, len(readers), procs[i]) from None
            if kind == "bytes":
                if progress is not None:
                    progress.update(value)
            elif kind == "done":
                results[i] = value
                del live[reader]
            else:
                raise _worker_error(i, len(readers), value)
    return results
