"""Running an output job on this machine: one staged output, filled by this process or by `--workers N`.

An output job is what `write` and `merge` have in common, so that one runner, one staged output
(`reshard.write._staged`), the worker processes (`reshard.write._workers`) and the ranks of a distributed job
(`reshard.write._distributed`) serve both. Its files are grouped in units (a `write`'s coordinates, a `merge`'s
files); each unit's files are written the same way by any writer, and one process completes the folder.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ..runs import SourceCrcs
from ..signals import sigterm_as_interrupt
from ..words import mib
from ._staged import StagedOutput
from ._workers import default_workers, write_with_workers


class _OutputJob(Protocol):
    """What a writer runs. It is pickled once for worker processes, and built on each rank of a distributed job.

    Attributes:
        command: `write` or `merge` (the progress bar's label).
        index: the source; a reshard folder's files are checked against its manifest's CRC-32s (`SourceCrcs`).
        unit_sizes: the bytes of each unit's files, by unit (the shares are balanced by them).
        units: the units this output holds, in order: every one, or a node's share (`WriteJob.holds`).
        compute: whether the chunks are computed (a dequantizing write): `--workers` then defaults to every core.
    """

    command: str
    index: object
    unit_sizes: list[int]
    units: list[int]
    compute: bool

    def staged(self, out, overwrite: bool) -> StagedOutput:
        """OUT claimed for this job (the checks made before the lock)."""

    def needed_bytes(self) -> int:
        """Bytes the whole output needs (the free-space check)."""

    def write_units(self, tmp: Path, units, *, progress=None, fsync: bool = False,
                    source_crcs: SourceCrcs | None = None, on_file=None) -> list[tuple]:
        """Write the files of `units` into `tmp`: `(unit, file entry)` each, in unit then part order, the entry typed
        (a write's `reshard.manifest.FileEntry`, a merge's `reshard.write._merge_index.MergedFile`). The CRC-32s
        of the source ranges read go to `source_crcs` (None: checked here, before returning). `on_file` is called
        with each file's path once it is whole (the output's own `on_file`: a bucket's spool sends it then)."""

    def finish(self, tmp: Path, entries: list, out: Path, source_crcs: SourceCrcs):
        """Complete `tmp`, the temporary folder of `out`, from every file entry (in unit order): the rest of its
        files, the index or manifest last; returns what the command returns (a write's `Manifest`, a merge's
        `MergeIndex`). What it reads of the source goes to `source_crcs`; the caller checks them all after it."""

    def identity(self, out: Path, overwrite: bool) -> dict:
        """What must be the same on every rank of a distributed job for their shares to fit together."""


def progress_bar(total: int, progress: bool | None, command: str):
    """A byte bar labelled `reshard COMMAND` (None: on a terminal, and lines on a pipe, `_PipeLines`; False: never)."""
    import sys

    from tqdm.auto import tqdm

    if progress is None and not (hasattr(sys.stderr, "isatty") and sys.stderr.isatty()):
        return _PipeLines(total, command)
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=f"reshard {command}",
                disable=None if progress is None else not progress)


def say(command: str, text: str, progress: bool | None) -> None:
    """A distributed job's phase, one line on stderr (rank 0 calls it; not with `-q`): on a terminal before the bar,
    on a pipe (a torchrun job's log) where no bar is drawn, so the start of a job is never a silent stretch."""
    import sys

    if progress is not False:
        print(f"reshard {command}: {text}", file=sys.stderr, flush=True)


PIPE_EVERY_S = 5.0  # on a pipe, a long write says where it is this often: never a silent stretch longer than this


class _PipeLines:
    """The byte bar on a pipe (a log, `srun`, a torchrun job's output), where tqdm draws nothing: a line every
    `PIPE_EVERY_S` seconds while the files are written, and one when they are, so a long write is never silent; a
    write done within the first interval prints nothing. Same interface as the bar: `n`, `update`, `close`."""

    def __init__(self, total: int, command: str):
        import threading
        import time

        self.total, self.command, self.n, self.said = total, command, 0, False
        self.started = time.monotonic()
        self._done = threading.Event()
        self._ticker = threading.Thread(target=self._tick, name="reshard-lines", daemon=True)
        self._ticker.start()

    def _tick(self) -> None:
        while not self._done.wait(PIPE_EVERY_S):
            self._say(f"{mib(self.n)} of {mib(self.total)} of files written")

    def _say(self, text: str) -> None:
        import sys
        import time

        self.said = True
        print(f"reshard {self.command}: {text} ({time.monotonic() - self.started:.0f} s)", file=sys.stderr,
              flush=True)

    def update(self, n: int) -> None:
        self.n += n

    def close(self) -> None:
        if self._done.is_set():
            return
        self._done.set()
        self._ticker.join()
        if self.said:
            self._say(f"all {mib(self.n)} of files written; checking and completing the folder")


def headers_digest(index) -> str:
    """One digest of SRC's safetensors headers (for `_OutputJob.identity`: the ranks' sources must be the same)."""
    return hashlib.sha256(json.dumps([(f.name, f.digest) for f in index.files]).encode()).hexdigest()


def in_unit_order(pairs: list[tuple]) -> list:
    """The file entries of `(unit, entry)` pairs, in unit order (a stable sort keeps each unit's parts in order)."""
    return [entry for _, entry in sorted(pairs, key=lambda pair: pair[0])]


def write_output(job: _OutputJob, out, *, overwrite: bool = False, progress: bool | None = None,
                 workers: int | None = 1):
    """Run `job` into the folder `out`: checked, locked, filled in a temporary folder, swapped in when complete.

    Args:
        workers: processes writing shares of the units in parallel; 1 writes in this process; None picks
            `default_workers`. With more than 1, a script calling this needs the `if __name__ == "__main__":`
            guard (workers are spawned). The output is the same either way.

    Returns:
        What `job.finish` returns.
    """
    stage = job.staged(out, overwrite)
    with sigterm_as_interrupt(), stage.locked():
        stage.claim(job.needed_bytes())
        sizes = [job.unit_sizes[u] for u in job.units]
        if workers is None:
            workers = default_workers(sum(sizes), len(sizes), compute=job.compute)
        workers = min(workers, len(sizes)) if sizes else 1
        bar = progress_bar(sum(sizes), progress, job.command)
        source_crcs = SourceCrcs(job.index)
        try:
            with stage.filling() as tmp:
                if workers > 1:
                    pairs = write_with_workers(job, tmp, workers, source_crcs, progress=bar)
                else:
                    pairs = job.write_units(tmp, job.units, progress=bar, source_crcs=source_crcs,
                                            on_file=stage.on_file)
                result = job.finish(tmp, in_unit_order(pairs), stage.out, source_crcs)
                source_crcs.check()  # a damaged source file is refused before the output is put in place
                stage.complete()
        finally:
            bar.close()
    return result


@dataclass(frozen=True)
class NodeCopy:
    """What one node's copy holds, as its first rank reports it.

    Attributes:
        node: `node 1 (host, ranks 4-7)`.
        files: rank files in the copy.
        bytes: bytes of those files (headers included).
        empty_markers: explicit empty markers among their tensors.
        fetched: bytes the node's ranks fetched from a remote SRC (None: SRC was read from a disk).
    """

    node: str
    files: int
    bytes: int
    empty_markers: int
    fetched: int | None = None

    @classmethod
    def of(cls, node: str, manifest, fetched: int | None = None) -> "NodeCopy":
        return cls(node, len(manifest.files), manifest.bytes, manifest.empty_markers, fetched)


@dataclass(frozen=True)
class NodeOutcome:
    """A node-local job's outcome on a node's first rank: what `finish` returned there (the node's manifest), the
    node's own copy, and on node 0 every node's copy (empty elsewhere)."""

    result: object
    copy: NodeCopy
    copies: tuple[NodeCopy, ...] = ()
