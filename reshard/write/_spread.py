"""A merge across nodes into a bucket (`merge --node-local SRC s3://...`): every node uploads the parts of the output
files whose bytes its own disk holds.

Each output file is cut into parts of `reshard.write._bucket.part_bytes(size)`: all of one size but the last, since
S3 takes no part under 5 MiB but the last. A part goes to the node whose copy holds most of its source bytes (ties:
the lowest node), and within the node to its rank with the fewest bytes so far (`_plan_parts`, the same on every rank).
Rank 0 opens every upload and shares the ids; each rank fills its parts in memory, `PARTS_IN_FLIGHT` + 1 at most,
from its node's copy and, for the bytes only another node holds, from a rank of that node over the process group
(`reshard.write._peers`), sends them with the shared id, and hands the ETags to rank 0, which completes every upload and
writes the marker last. Every rank serves its node's bytes on a thread of its own until every rank of the other nodes
has filled its parts, so no rank asks a node that stopped serving. The CRC-32 of every source range read is kept as
the engine keeps it (`reshard.runs.SourceCrcs`): rank 0 checks the source files as for any merge.
"""

from __future__ import annotations

import bisect
import collections
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from ..read import ByteRange
from ..runs import Run, placed_runs, remember
from ._bucket import PARTS_IN_FLIGHT, Bucket, part_bytes

_SENDERS_S = 20.0  # rank 0 waits this long at most for the other ranks' parts in flight to end before it aborts


@dataclass(frozen=True)
class OutputFile:
    """One output file's bytes: its header, then its chunks' byte runs (`dst` absolute, sorted), `size` in all."""

    name: str
    header: bytes
    runs: tuple[Run, ...]
    size: int

    @classmethod
    def of(cls, job, unit: int) -> "OutputFile":
        header, boxes = job.file_layout(unit)
        runs, size = placed_runs(len(header), boxes, job.index.tensors)
        return cls(job.names[unit], header, tuple(sorted(runs, key=lambda r: r.dst)), size)

    def runs_within(self, lo: int, hi: int) -> list[Run]:
        """The runs' pieces that fill `[lo, hi)` of the file."""
        ends = [r.dst + r.nbytes for r in self.runs]
        out = []
        for run in self.runs[bisect.bisect_right(ends, lo):]:
            if run.dst >= hi:
                break
            start, end = max(lo, run.dst), min(hi, run.dst + run.nbytes)
            out.append(Run(run.file, run.src + start - run.dst, start, end - start))
        return out


@dataclass(frozen=True)
class _Part:
    """Part `number` of `count` of the output file `name`: its `size` bytes from `start`, sent by `rank`."""

    name: str
    number: int
    count: int
    start: int
    size: int
    rank: int


def _plan_parts(files: list[OutputFile], holders, node_ranks: tuple[tuple[int, ...], ...], step_of=part_bytes
               ) -> list[_Part]:
    """Every part of every file, each given to a rank of the node holding most of its bytes (ties: the lowest node),
    the rank of that node with the fewest bytes so far. `holders(file)`: the nodes whose copies hold a source file."""
    load = {r: 0 for ranks in node_ranks for r in ranks}
    parts = []
    for f in files:
        step = step_of(f.size)
        count = max(1, -(-f.size // step))
        for number in range(1, count + 1):
            lo, hi = (number - 1) * step, min(f.size, number * step)
            held = [0] * len(node_ranks)
            for run in f.runs_within(lo, hi):
                for node in holders(run.file):
                    held[node] += run.nbytes
            node = max(range(len(node_ranks)), key=lambda n: (held[n], -n))
            rank = min(node_ranks[node], key=lambda r: (load[r], r))
            load[rank] += hi - lo
            parts.append(_Part(f.name, number, count, lo, hi - lo, rank))
    return parts


def _fill_part(part: _Part, f: OutputFile, store_of, source_crcs, buffers: list[bytearray]) -> bytearray:
    """The part's bytes: the header's, then each run's, read in few requests from the store `store_of(file)` gives
    (`Store.read_ranges`, into the caller's `buffers`); the CRC-32 of each checked source range read is kept in
    `source_crcs`."""
    lo, hi = part.start, part.start + part.size
    data = bytearray(part.size)
    view = memoryview(data)
    if lo < len(f.header):
        view[:min(hi, len(f.header)) - lo] = f.header[lo:hi]
    by_store: dict[int, tuple[object, list[Run]]] = {}
    for run in f.runs_within(lo, hi):
        store = store_of(run.file)
        by_store.setdefault(id(store), (store, []))[1].append(run)
    for store, runs in by_store.values():
        def put(piece, runs=runs) -> None:
            whole = runs[piece.index]
            run = replace(whole, src=whole.src + piece.offset, dst=whole.dst + piece.offset, nbytes=len(piece.data))
            view[run.dst - lo:run.dst - lo + run.nbytes] = piece.data
            remember(source_crcs.segments(run.file), run, piece.data, piece.digest)

        store.read_ranges([ByteRange(r.file, r.src, r.nbytes) for r in runs], put, buffers=buffers, each=zlib.crc32)
    return data


class _PartSender:
    """One rank's parts of uploads another rank opened: `PARTS_IN_FLIGHT` at once, their ETags kept by name."""

    def __init__(self, url: str, uploads: dict[str, str]):
        self.bucket, self.uploads = Bucket(url), uploads
        self.pool = ThreadPoolExecutor(max_workers=PARTS_IN_FLIGHT, thread_name_prefix="reshard-part")
        self.in_flight: collections.deque = collections.deque()
        self.parts: dict[str, list[dict]] = {}
        self.lock = threading.Lock()

    def send(self, part: _Part, data: bytearray) -> None:
        while len(self.in_flight) >= PARTS_IN_FLIGHT:
            self.in_flight.popleft().result()
        self.in_flight.append(self.pool.submit(self._send, part, bytes(data)))

    def _send(self, part: _Part, data: bytes) -> None:
        what = f"uploading part {part.number} of {part.count} (bytes {part.start}-{part.start + part.size - 1})"
        answer = self.bucket.call(what, part.name, "upload_part", Key=self.bucket.key(part.name),
                                  UploadId=self.uploads[part.name], PartNumber=part.number, Body=data)
        with self.lock:
            self.parts.setdefault(part.name, []).append({"PartNumber": part.number, "ETag": answer["ETag"]})

    def records(self) -> dict[str, tuple[str, list[dict]]]:
        """Wait for every part sent; `(upload id, parts)` by name, for rank 0 (`BucketOutput.adopt`)."""
        while self.in_flight:
            self.in_flight.popleft().result()
        return {name: (self.uploads[name], list(parts)) for name, parts in self.parts.items()}

    def stop(self) -> None:
        """No part starts or is tried again after this returns (an aborted upload must stay aborted); the parts under
        way end now (one the server holds must not keep an interrupted rank waiting)."""
        self.bucket.cancel()
        self.pool.shutdown(wait=True, cancel_futures=True)


class _Serving:
    """`peers.serve(files)` on a thread of its own, while this rank fills its parts."""

    def __init__(self, peers, files):
        self.failure: str | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(peers, files), name="reshard-serve", daemon=True)
        self.thread.start()

    def _run(self, peers, files) -> None:
        try:
            self.failure = peers.serve(files)
        except BaseException as e:  # noqa: BLE001  raised by `join`, in the rank's own thread
            self.error = e

    def join(self) -> str | None:
        """Wait until every rank of the other nodes is done; a failure to read a file of this node, or None."""
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.failure


def upload_parts(ranks, nodes, job, store, folder, uploads: dict[str, str], url: str, source_crcs, progress
                 ) -> dict[str, tuple[str, list[dict]]]:
    """This rank's parts of every output file, filled and sent while it serves its node's bytes; the ETags by name.

    Args:
        ranks, nodes: the job's `Ranks` and `Nodes`.
        job: the merge (`reshard.write._merge.MergeJob`), its source read through the joined folder.
        store: the joined folder (`reshard.write._peers.PeerStore`); this round asks its peers through its own.
        folder: this node's copy, which its ranks serve.
        uploads: every output file's upload id, opened by rank 0.
    """
    from ._peers import PeerStore, Peers

    peers = Peers(ranks, folder, tuple(range(ranks.world)), nodes)
    # its reads stay on this thread (a part at a time, while PARTS_IN_FLIGHT are sent): an interrupt ends them at once
    reader = PeerStore(store.files, store.local, nodes.of(ranks.rank), nodes, store.location, peers, in_flight=0)
    serving = _Serving(peers, store.files)
    sender = _PartSender(url, uploads)

    def store_of(file: str):  # an `--extras-from` file: through the job's store
        return reader if file in store.files else job.index.store

    buffers: list[bytearray] = []  # where the source's ranges land, kept from part to part

    interrupted = False
    try:
        files = {f.name: f for f in (OutputFile.of(job, unit) for unit in job.units)}
        holders = (lambda file: store.files[file].nodes if file in store.files else range(len(nodes.ranks)))
        for part in _plan_parts(list(files.values()), holders, nodes.ranks):
            if part.rank == ranks.rank:
                sender.send(part, _fill_part(part, files[part.name], store_of, source_crcs, buffers))
                progress.update(part.size)
        return sender.records()
    except KeyboardInterrupt:
        interrupted = True
        raise
    finally:
        sender.stop()
        _count_out(ranks)
        # Interrupted, this rank says goodbye to no peer: they are likely interrupted too, and would not answer
        # (each goodbye waits REPLY_S); it leaves the job instead, which ends every peer's wait at once.
        if not interrupted:
            peers.done()  # only now: this rank asks no node for bytes any more
            failure = serving.join()
            if failure is not None:
                raise OSError(failure)


def _count_out(ranks) -> None:
    try:
        ranks.store.add(ranks.key("senders-stopped"), 1)
    except Exception:  # noqa: BLE001  the store is gone: rank 0 is too, and aborts nothing more
        pass


def wait_for_senders(ranks) -> None:
    """Rank 0, about to abort every upload: wait (`_SENDERS_S` at most) until no rank sends a part any more, which
    could bring an aborted upload back."""
    deadline = time.monotonic() + _SENDERS_S
    try:
        while (ranks.store.add(ranks.key("senders-stopped"), 0) < ranks.world and not ranks.gone
               and time.monotonic() < deadline):
            time.sleep(0.1)
    except Exception:  # noqa: BLE001  the store is gone: no rank is left to send
        pass
