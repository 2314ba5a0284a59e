"""The one engine every writer uses: the bytes of any chunk, as byte runs copied from the source files or as bounded
slabs computed from quantized ones, written after a file's header.

`write`, `merge`, mesh-to-mesh and each worker or rank of a parallel write hand `Engine.fill` a header and the
chunks of one output file, `(nbytes, tensor, box)` each; whether a chunk's bytes are copied or computed is decided
here, not by the writer. No tensor is ever materialized:
- a job larger than the page cache's room for dirty pages fills its files of 64 MiB or more front to back in aligned
  blocks written around the page cache (`reshard.runs._direct`): each source byte is read once, into a block, where a
  writer thread computes the file's CRC-32 (and a checked source range's) before the block goes to disk, while the
  next block is read;
- the other files, and those on a file system without direct I/O, are copied with `copy_file_range` (inside the
  kernel, as `cp` does; a read/write loop where the kernel refuses it) and handed to writeback every 64 MiB, their
  CRC-32 computed from a second read of the same source bytes on one background thread while the copy runs;
- a dequantized chunk is computed in two bounded slabs (`reshard.runs._dequant`).
Either way the CRC-32 of each source range copied from a reshard folder is kept, and its files are checked against
their manifest (`reshard.runs._source_check`), so damage is refused, never copied under a fresh CRC, without reading
them again.
"""

from __future__ import annotations

import errno
import os
import threading
import zlib
from concurrent.futures import Future, ThreadPoolExecutor

from ..errors import OutputError
from ..syscalls import Writeback, page_cache_room, pread_full
from ._byte_runs import Run, chunk_runs, placed_runs
from ._crc import BlockCrcs, Segments, crc32_combine
from ._direct import MIN_FILE_BYTES, BlockRing, DirectOutput
from ._fetch import fill_fetched
from ._source_check import SourceCrcs

COPY_BUFFER_BYTES = 1 << 20  # 1 MiB: measured as fast as `cp` in the fallback loop; 16 MiB was 2.5x slower
_SMALL_RUN_BYTES = 16 << 10  # up to this, a second CRC-32 pass over a run costs less than combining CRC-32s
_INLINE_CRC_BYTES = 1 << 16  # a file with at most this much data gets its CRC-32 in the writing thread


def _short_read(run: Run, done: int) -> OutputError:
    return OutputError(f"{run.file}: short read at byte {run.src + done}; the source file is truncated or changed "
                       "during the write.")


class Engine:
    """Fills output files with the bytes of their chunks, from the source checkpoint `index`.

    Args:
        index: the source (local files), a `CheckpointIndex`; a reshard folder's records its files' CRC-32s.
        progress: an object whose `update(nbytes)` is told of every byte filled, or None.
        source_crcs: where the CRC-32s of the source ranges read are kept, for the process that completes the output
            to check (`SourceCrcs.check`); None: this engine is the only writer and `finish` checks them.
        planned_bytes: the data this engine will write, when known: a job the page cache has room for goes through
            it, a larger one around it (`_cached`); None: large files go around it.
    """

    def __init__(self, index, progress=None, source_crcs: SourceCrcs | None = None, *,
                 planned_bytes: int | None = None):
        self.index = index
        self.progress = progress
        self.dequantizer = None
        if index.quantization is not None:
            from ._dequant import Dequantizer

            self.dequantizer = Dequantizer(index)
        self.buffer = bytearray(COPY_BUFFER_BYTES)
        self.sources: dict[str, int] = {}
        self.local: dict[str, bool] = {}
        self.kernel_copy = hasattr(os, "copy_file_range")
        self.stop = threading.Event()
        self.crc_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reshard-crc")
        self.checks_itself = source_crcs is None
        self.source_crcs = SourceCrcs(index) if source_crcs is None else source_crcs
        self.crc_buffer: bytearray | None = None
        self.ring: BlockRing | None = None  # made for the first large file
        self.fetch_buffers: list[bytearray] = []  # a remote source's ranges land here (`fetch.fill_fetched`)
        self.planned_bytes = planned_bytes
        self.cached_job: bool | None = None  # decided at the first large file (`_cached`)
        self.segments_lock = threading.Lock()  # the writer threads of direct outputs keep source ranges' CRC-32s

    # ---- the one entry -------------------------------------------------------------------------------------------

    def fill(self, out_fd: int, header: bytes, boxes: list, *, checksum: bool = True) -> int | None:
        """Write `header` at the start of `out_fd`, then the chunks `(nbytes, tensor, box)` back to back.

        Returns:
            The CRC-32 of the whole file (None without `checksum`).

        Raises:
            SourceChangedError: a source file read was written to or replaced since its header was read.
        """
        crc = self._fill(out_fd, header, boxes, checksum)
        self._check_sources()
        return crc

    def fill_together(self, outputs: list[tuple[int, bytes, list]], *, checksum: bool = True) -> list[int | None]:
        """`fill` for several output files, `(out_fd, header, boxes)` each; their CRC-32s (None without `checksum`).

        From a remote source the files are filled together: each source range is requested once for all of them, in
        source order (`fetch.fill_fetched`), not once per file in the pieces each needs. Local sources and computed
        chunks are filled one file after another, as `fill` does."""
        crcs: dict[int, int | None] = {}
        fetched: list[tuple[int, tuple[int, bytes, list]]] = []
        for i, (out_fd, header, boxes) in enumerate(outputs):
            runs = self._fetched_runs(header, boxes)
            if runs is None:
                crcs[i] = self._fill(out_fd, header, boxes, checksum)
            else:
                fetched.append((i, (out_fd, header, runs)))
        if fetched:
            for (i, _), crc in zip(fetched, fill_fetched(self, [output for _, output in fetched])):
                crcs[i] = crc if checksum else None
        self._check_sources()
        return [crcs[i] for i in range(len(outputs))]

    @property
    def fetches(self) -> bool:
        """Whether this engine's source is read in ranged requests (a remote store), where filling the files of a job
        together (`fill_together`) fetches each source range once."""
        return any(not self._local(entry.file) for entry in self.index.tensors.values())

    def _fetched_runs(self, header: bytes, boxes: list) -> list | None:
        """The placed runs of a file whose chunks are copied from a remote source, or None (local, or computed)."""
        dequantizer = self.dequantizer
        if dequantizer is not None and any(dequantizer.computes(tensor) for _, tensor, _ in boxes):
            return None
        placed, _ = placed_runs(len(header), boxes, self.index.tensors)
        return placed if any(not self._local(run.file) for run in placed) else None

    def _check_sources(self) -> None:
        """The local source files read are still the files their headers came from: their bytes were read through
        descriptors of those files, and nothing wrote to them or put another file at their paths meanwhile."""
        read = set(self.sources) | (set(self.dequantizer.fds) if self.dequantizer is not None else set())
        for file in sorted(read):
            self.index.store.check_unchanged(file)

    def _fill(self, out_fd: int, header: bytes, boxes: list, checksum: bool) -> int | None:
        dequantizer = self.dequantizer
        if dequantizer is not None and any(dequantizer.computes(tensor) for _, tensor, _ in boxes):
            return self._fill_computed(out_fd, header, boxes)
        placed, _ = placed_runs(len(header), boxes, self.index.tensors)
        if any(not self._local(run.file) for run in placed):
            crc, = fill_fetched(self, [(out_fd, header, placed)])  # ranged requests: few, large, bounded
            return crc if checksum else None
        checked = any(self.source_crcs.checks(run.file) for run in placed)
        crcs = BlockCrcs(checksum, self.segments_lock)
        direct = self._direct_output(out_fd, placed, crcs)
        if direct is not None:
            self._fill_direct(direct, header, placed)
            return crcs.crc if checksum else None
        crc = self._crc_later(header, placed) if checksum or checked else None  # a checked source is read once
        written = os.pwrite(out_fd, header, 0)
        if written != len(header):
            raise OutputError(f"short write of a file's header ({written} of {len(header)} bytes).")
        self._copy(placed, out_fd)
        crc = None if crc is None else crc.result()
        return crc if checksum else None

    def finish(self) -> list[str]:
        """Without `source_crcs` given, check the source files read against their manifest's CRC-32s; the files
        checked (none with them: the process that completes the output checks).

        Raises:
            CheckpointError: a source file is damaged (its CRC-32 differs from its manifest's); nothing may be kept.
        """
        return self.source_crcs.check() if self.checks_itself else []

    def close(self) -> None:
        self.stop.set()
        self.crc_pool.shutdown(wait=True)
        if self.ring is not None:
            self.ring.close()
        for fd in self.sources.values():
            os.close(fd)
        if self.dequantizer is not None:
            self.dequantizer.close()

    # ---- copying ------------------------------------------------------------------------------------------------

    def _local(self, file: str) -> bool:
        """Whether source `file` is on this machine (copied inside the kernel), not read in ranged requests."""
        if file not in self.local:
            self.local[file] = self.index.store.local_path(file) is not None
        return self.local[file]

    def _fd(self, file: str) -> int:
        """The file's descriptor from the store: the file whose header was read, never a file put at its path since."""
        if file not in self.sources:
            self.sources[file] = self.index.store.descriptor(file)
        return self.sources[file]

    def _crc_later(self, header: bytes, runs: list[Run]) -> Future:
        """CRC-32 of `header` followed by the runs' source bytes, computed in the background from one read of each
        run, which also keeps the CRC-32 of each range of a checked source file (`SourceCrcs`); a small file's here
        and now (handing it to the thread cost more than the CRC: a file of empty markers is a header alone)."""
        for run in runs:
            self._fd(run.file)  # open in this thread: the dicts are not shared while the job runs
        known = {run.file: self.source_crcs.segments(run.file) for run in runs}
        if sum(run.nbytes for run in runs) <= _INLINE_CRC_BYTES and not any(known.values()):
            done: Future = Future()
            done.set_result(self._crc(header, runs, memoryview(self.buffer), known))
            return done
        if self.crc_buffer is None:  # one buffer for every job: the single CRC thread runs them in turn
            self.crc_buffer = bytearray(COPY_BUFFER_BYTES)
        return self.crc_pool.submit(self._crc, header, runs, memoryview(self.crc_buffer), known)

    def _crc(self, header: bytes, runs: list[Run], view: memoryview, known: dict) -> int:
        crc = zlib.crc32(header)
        for run in runs:
            if known[run.file] is None:
                crc = self._read_crc(run, run.src, run.nbytes, view, crc)
            elif run.nbytes <= _SMALL_RUN_BYTES:
                crc = self._small_run_crc(run, known[run.file], view, crc)
            else:
                crc = crc32_combine(crc, self._run_crc(run, known[run.file], view), run.nbytes)
            if self.stop.is_set():
                break
        return crc

    def _run_crc(self, run: Run, known: Segments, view: memoryview) -> int:
        """The CRC-32 of `run`'s source bytes; the ranges of it not yet `known` become known."""
        crc = 0
        for start, end, seen in known.split(run.src, run.src + run.nbytes):
            piece = self._read_crc(run, start, end - start, view, 0)
            if self.stop.is_set():
                break
            if not seen:  # a range read again (a replicated tensor, in several output files) is kept once
                known.add(start, end, piece)
            crc = crc32_combine(crc, piece, end - start)
        return crc

    def _small_run_crc(self, run: Run, known: Segments, view: memoryview, crc: int) -> int:
        """`crc` continued over a small run's source bytes, read once; its ranges not yet `known` become known (a run
        that continues the last known range extends its CRC-32, the common case of a file read in order)."""
        data = view[:run.nbytes]
        self._read_into(run, data)
        if not known.extend(run.src, data):
            for start, end, seen in known.split(run.src, run.src + run.nbytes):
                if not seen:
                    known.add(start, end, zlib.crc32(data[start - run.src:end - run.src]))
        return zlib.crc32(data, crc)

    def _read_crc(self, run: Run, start: int, nbytes: int, view: memoryview, crc: int) -> int:
        """`crc` continued over the `nbytes` source bytes of `run` from file offset `start`."""
        fd, done = self.sources[run.file], 0
        while done < nbytes and not self.stop.is_set():
            want = min(nbytes - done, len(view))
            got = pread_full(fd, view[:want], start + done)
            if got < want:
                raise _short_read(run, start - run.src + done + got)
            crc = zlib.crc32(view[:got], crc)
            done += got
        return crc

    def _copy(self, runs: list[Run], out_fd: int) -> None:
        """Copy `runs` into `out_fd`, each at `run.dst`; the disk starts writing while the copy goes on (fsync at
        the end of the output then waits for little: measured at 2.14 GB, 1.2 s of fsync became 0.02 s)."""
        writeback = Writeback(out_fd)
        for run in runs:
            src_fd, done = self._fd(run.file), 0
            while done < run.nbytes:
                got = self._copy_some(src_fd, out_fd, run.nbytes - done, run.src + done, run.dst + done)
                if got <= 0:
                    raise _short_read(run, done)
                done += got
                writeback.wrote(got)
                if self.progress is not None:
                    self.progress.update(got)

    def _copy_some(self, src_fd: int, out_fd: int, n: int, src: int, dst: int) -> int:
        if self.kernel_copy:
            try:
                return os.copy_file_range(src_fd, out_fd, min(n, 1 << 30), src, dst)
            except OSError as e:
                if e.errno not in (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM):
                    raise
                self.kernel_copy = False  # this kernel or filesystem pair cannot: copy through the buffer
        view = memoryview(self.buffer)[:min(n, len(self.buffer))]
        got = pread_full(src_fd, view, src)
        written = 0
        while written < got:
            written += os.pwrite(out_fd, view[written:got], dst + written)
        return got

    def _read_into(self, run: Run, view: memoryview) -> None:
        """Read `run`'s source bytes into `view` (as long as the run)."""
        if not self._local(run.file):
            self.index.store.readinto(run.file, run.src, view[:run.nbytes])
            return
        done = pread_full(self._fd(run.file), view[:run.nbytes], run.src)
        if done < run.nbytes:
            raise _short_read(run, done)

    # ---- copying around the page cache -------------------------------------------------------------------------

    def _direct_output(self, out_fd: int, runs: list[Run], crcs: BlockCrcs) -> DirectOutput | None:
        """A direct output whose blocks' CRC-32s go to `crcs`, or None for the page cache path: a small file, a job the
        page cache has room for (`_cached`), or a file system without direct I/O."""
        if self._cached(sum(run.nbytes for run in runs)):
            return None
        if self.ring is None:
            self.ring = BlockRing()
        return DirectOutput.start(out_fd, self.ring, crcs.digest, crcs.collect)

    def _fill_direct(self, out: DirectOutput, header: bytes, runs: list[Run]) -> None:
        """Fill the file front to back through `out`'s blocks (`placed_runs` tile it after the header, in order): each
        piece of a run is read once, into the block, where a writer thread computes its CRC-32s (`BlockCrcs`) before
        the block goes to disk; the next block is read meanwhile."""
        known = {run.file: self.source_crcs.segments(run.file) for run in runs}
        try:
            out.put(header, None)
            for run in runs:
                segments, done = known[run.file], 0
                while done < run.nbytes:
                    piece = out.space()
                    piece = piece[:min(len(piece), run.nbytes - done)]
                    self._read_into(Run(run.file, run.src + done, 0, len(piece)), piece)
                    out.advance(len(piece), None if segments is None else (segments, run.src + done))
                    done += len(piece)
                    if self.progress is not None:
                        self.progress.update(len(piece))
            out.finish(len(header) + sum(run.nbytes for run in runs))
        except BaseException:
            out.abort()
            raise

    def _cached(self, nbytes: int) -> bool:
        """Whether a file of `nbytes` of data goes through the page cache: a small one always; a large one when the
        whole job (`planned_bytes`) fits in the room the kernel has for dirty pages before it throttles writers
        (`page_cache_room`, read at the first large file). There the kernel's copy and its writeback in large requests
        were the faster (a 2.14 GB merge: 0.89x `cp -r` + sync, 0.89-1.12x direct); past it they cost about 1.5 CPU s
        per GB against 0.8 direct and the writers are throttled (a 7.76 GB merge 1.51x, direct 0.84x)."""
        if nbytes < MIN_FILE_BYTES:
            return True
        if self.cached_job is None:
            room = page_cache_room()
            self.cached_job = None not in (room, self.planned_bytes) and self.planned_bytes <= room
        return self.cached_job

    # ---- computing ----------------------------------------------------------------------------------------------

    def _fill_computed(self, out_fd: int, header: bytes, boxes: list) -> int:
        """Fill a file holding dequantized chunks, in order: computed slabs and copied runs alike pass through memory
        (bounded: two slabs, one copy buffer). The CRC-32 and the write of one slab run in the background thread
        while the next slab is computed (numpy, zlib and pwrite release the GIL). Returns the file's CRC-32."""
        state = {"crc": zlib.crc32(header), "position": _pwrite_all(out_fd, header, 0)}
        writeback = Writeback(out_fd)

        def put(data) -> None:  # in order, on the one background thread
            state["crc"] = zlib.crc32(data, state["crc"])
            state["position"] = _pwrite_all(out_fd, data, state["position"])
            writeback.wrote(len(data))

        previous = None
        try:
            for _, tensor, box in boxes:
                computed = self.dequantizer.computes(tensor)
                for data in self._pieces(tensor, box, computed):
                    job = self.crc_pool.submit(put, data)
                    if previous is not None:
                        previous.result()  # its slab buffer is the one the next slab is computed into
                    previous = job
                    if not computed:  # the copy buffer is refilled at once: no overlap
                        previous.result()
                    if self.progress is not None:
                        self.progress.update(len(data))
            if previous is not None:
                previous.result()
        finally:
            if previous is not None:
                previous.exception()  # never let the file be closed under a running write
        return state["crc"]

    def _pieces(self, tensor, box, computed: bool):
        """The chunk's bytes in order: computed slabs, or its copied runs a buffer at a time."""
        if computed:
            yield from self.dequantizer.chunk_slabs(tensor, box)
            return
        view = memoryview(self.buffer)
        for run in chunk_runs(tensor, box, self.index.tensors):
            for start in range(0, run.nbytes, len(view)):
                n = min(len(view), run.nbytes - start)
                self._read_into(Run(run.file, run.src + start, 0, n), view)
                yield view[:n]


def _pwrite_all(fd: int, data, position: int) -> int:
    """Write all of `data` at `position`; returns the position after it."""
    data, done = memoryview(data).cast("B"), 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], position + done)
    return position + done
