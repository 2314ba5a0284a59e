"""Stream a checkpoint into per-coordinate shard files, atomically, copying bytes exactly.

Which chunks each file holds comes from the plan (`reshard.plan.files`); each chunk is a list of byte runs copied
from the source files (`reshard.runs.byte_runs`), so no tensor is ever materialized and peak memory is one copy
buffer, or, for a dequantized tensor, two bounded slabs computed from the source (`reshard.runs.dequant`).
Files are written into a temporary folder beside OUT, fsynced, the manifest written last, and the folder renamed
into place; any failure or interruption removes the temporary folder. One write at a time holds a lock beside OUT;
an existing OUT is replaced only when it is empty or a reshard output, by an atomic exchange, so OUT is the whole
old or the whole new folder at every instant.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import functools
import glob
import json
import os
import shutil
import signal
import socket
import struct
import sys
import threading
import time
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from .. import __version__
from ..errors import OutputError
from ..manifest import (MANIFEST_FORMAT, MANIFEST_NAME, MANIFEST_VERSION, dcp_metadata, dump_manifest,
                        extra_file_name, shard_file_name)
from ..plan.files import ChunkSpec, coordinate_chunks, coordinate_sizes, split_parts
from ..plan.layout import TargetTensor
from ..plan.placement import ReshardPlan
from ..read.checkpoint import DTYPE_BITS, CheckpointIndex, is_metadata_file
from ..runs.byte_runs import Run, chunk_runs

INTERRUPT_CLEANUP_S = 1.0  # an interrupted write removes its temporary folder this long at most, then exits
COPY_BUFFER_BYTES = 1 << 20  # 1 MiB: measured as fast as `cp` in the fallback loop; 16 MiB was 2.5x slower
TMP_MARK = ".reshard-tmp-"  # `.OUT.reshard-tmp-PID`: a write in progress; `...-old-PID`: an OUT being swapped out
LOCK_MARK = ".reshard-lock"  # `.OUT.reshard-lock`: held (flock) by the one write to OUT, holds "host pid"


def safetensors_header(chunks: list[ChunkSpec], metadata: dict[str, str]) -> bytes:
    """The 8-byte length prefix and JSON header for `chunks` laid out back to back, padded to 8 bytes."""
    header: dict = {"__metadata__": metadata}
    cursor = 0
    for c in chunks:
        header[c.name] = {"dtype": c.dtype, "shape": list(c.shape), "data_offsets": [cursor, cursor + c.nbytes]}
        cursor += c.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


class _Copier:
    """Copies runs into output files and computes each file's CRC-32 on the side.

    Data moves with `copy_file_range` (inside the kernel, as `cp` does; a read/write loop where the kernel refuses
    it, e.g. across some filesystems). The CRC-32 of a file is computed in one background thread from the same
    source bytes while the copy runs, so the two use both cores instead of taking turns.
    """

    def __init__(self, index: CheckpointIndex, progress):
        self.index = index
        self.progress = progress
        self.dequantizer = None
        if index.quantization is not None:
            from ..runs.dequant import Dequantizer

            self.dequantizer = Dequantizer(index)
        self.buffer = bytearray(COPY_BUFFER_BYTES)
        self.sources: dict[str, int] = {}
        self.kernel_copy = hasattr(os, "copy_file_range")
        self.stop = threading.Event()
        self.crc_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reshard-crc")
        from .source_check import SourceCheck

        # a reshard folder as the source: each file it reads is checked whole against its manifest's CRC-32
        self.source_check = SourceCheck(getattr(index, "crc32", None), index.path_of, str(index.root))

    def fd(self, file: str) -> int:
        if file not in self.sources:
            self.sources[file] = os.open(self.index.path_of(file), os.O_RDONLY)
            self.source_check.start(file)
        return self.sources[file]

    def finish_source_checks(self) -> list[str]:
        """Wait for the CRC-32 checks of the source files read; raises `CheckpointError` naming a damaged one."""
        return self.source_check.finish()

    def crc_later(self, header: bytes, runs: list[Run]) -> Future:
        """CRC-32 of `header` followed by the runs' source bytes, computed in the background."""
        for run in runs:
            self.fd(run.file)  # open in this thread: the dict is not shared while the job runs

        def job() -> int:
            crc, view = zlib.crc32(header), memoryview(bytearray(COPY_BUFFER_BYTES))
            for run in runs:
                fd, done = self.sources[run.file], 0
                while done < run.nbytes:
                    if self.stop.is_set():
                        return crc
                    got = os.preadv(fd, [view[:min(run.nbytes - done, len(view))]], run.src + done)
                    if got <= 0:
                        raise OutputError(f"{run.file}: short read at byte {run.src + done}; the source file is "
                                          "truncated or changed during the write.")
                    crc = zlib.crc32(view[:got], crc)
                    done += got
            return crc

        return self.crc_pool.submit(job)

    def copy(self, runs: list[Run], out_fd: int, base: int) -> None:
        """Copy `runs` into `out_fd`, each at `base + run.dst`."""
        for run in runs:
            src_fd, done = self.fd(run.file), 0
            while done < run.nbytes:
                self.source_check.raise_if_failed()  # a damaged source stops the copy at once
                got = self._copy_some(src_fd, out_fd, run.nbytes - done, run.src + done, base + run.dst + done)
                if got <= 0:
                    raise OutputError(f"{run.file}: short read at byte {run.src + done}; the source file is "
                                      "truncated or changed during the write.")
                done += got
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
        got = os.preadv(src_fd, [view], src)
        written = 0
        while written < got:
            written += os.pwrite(out_fd, view[written:got], dst + written)
        return got

    def read_into(self, run: Run, view: memoryview) -> None:
        """Read `run`'s source bytes into `view` (as long as the run)."""
        fd, done = self.fd(run.file), 0
        while done < run.nbytes:
            got = os.preadv(fd, [view[done:run.nbytes]], run.src + done)
            if got <= 0:
                raise OutputError(f"{run.file}: short read at byte {run.src + done}; the source file is truncated or "
                                  "changed during the write.")
            done += got

    def close(self):
        self.stop.set()
        self.crc_pool.shutdown(wait=True)
        self.source_check.close()
        for fd in self.sources.values():
            os.close(fd)
        if self.dequantizer is not None:
            self.dequantizer.close()


def _write_file(path: Path, items: list, copier: _Copier) -> dict:
    specs = [spec for spec, _, _ in items]
    header = safetensors_header(specs, dcp_metadata({s.name: list(s.offsets) for s in specs}))
    return _file_entry(path, specs, _write_chunks(path, header, items, copier))


def _write_chunks(path: Path, header: bytes, items: list, copier: _Copier) -> int:
    """Create `path` holding `header` and then the `(ChunkSpec, tensor, box)` items' bytes, copied or (a dequantized
    tensor) computed; returns the file's CRC-32."""
    dequantizer = copier.dequantizer
    if dequantizer is not None and any(dequantizer.computes(tensor) for _, tensor, _ in items):
        return _write_computed_file(path, header, items, copier)
    placed, size = placed_runs(len(header), [(spec.nbytes, tensor, box) for spec, tensor, box in items], copier.index)
    crc = copier.crc_later(header, placed)
    write_copied_file(path, header, placed, size, copier)
    return crc.result()


def placed_runs(start: int, boxes: list, index) -> tuple[list[Run], int]:
    """The byte runs that fill `(nbytes, target, box)` items one after another from file offset `start`, and the
    offset where the last one ends (the file's size)."""
    placed, base = [], start
    for nbytes, target, box in boxes:
        placed += [Run(r.file, r.src, base + r.dst, r.nbytes) for r in chunk_runs(target, box, index.tensors)]
        base += nbytes
    return placed, base


def write_copied_file(path: Path, header: bytes, placed: list[Run], size: int, copier: _Copier) -> None:
    """Create `path` with its `size` bytes reserved, write `header`, then copy the `placed` runs."""
    out_fd = create_sized(path, size)
    try:
        written = os.write(out_fd, header)
        if written != len(header):
            raise OutputError(f"{path}: short write of the header ({written} of {len(header)} bytes).")
        copier.copy(placed, out_fd, 0)
    finally:
        os.close(out_fd)


def _file_entry(path: Path, specs: list[ChunkSpec], crc: int) -> dict:
    # The chunks are a run of the plan's order; their offsets and shapes follow from the placements (the manifest
    # stays linear in tensors plus files, however many coordinates).
    return {"name": path.name, "bytes": path.stat().st_size, "crc32": f"{crc:08x}",
            "first": specs[0].index, "count": len(specs), "empty_markers": sum(0 in s.shape for s in specs)}


def _write_computed_file(path: Path, header: bytes, items: list, copier: _Copier) -> int:
    """Write a file holding dequantized chunks, in order: computed slabs and copied runs alike pass through memory
    (bounded: two slabs, one copy buffer). The CRC-32 and the write of one slab run in the background thread while
    the next slab is computed (numpy, zlib and pwrite release the GIL). Returns the file's CRC-32."""
    dequantizer = copier.dequantizer
    view = memoryview(copier.buffer)
    out_fd = create_sized(path, len(header) + sum(spec.nbytes for spec, _, _ in items))
    state = {"crc": zlib.crc32(header), "position": _pwrite_all(out_fd, header, 0)}

    def put(data) -> None:  # in order, on the one background thread
        state["crc"] = zlib.crc32(data, state["crc"])
        state["position"] = _pwrite_all(out_fd, data, state["position"])

    previous = None
    try:
        for spec, tensor, box in items:
            computed = dequantizer.computes(tensor)
            if computed:
                pieces = dequantizer.chunk_slabs(tensor, box)
            else:
                pieces = (view[:n] for n in _runs_through(copier, chunk_runs(tensor, box, copier.index.tensors), view))
            for data in pieces:
                job = copier.crc_pool.submit(put, data)
                if previous is not None:
                    previous.result()  # its slab buffer is the one the next slab is computed into
                previous = job
                if not computed:  # the copy buffer is refilled at once: no overlap
                    previous.result()
                if copier.progress is not None:
                    copier.progress.update(len(data))
        if previous is not None:
            previous.result()
    finally:
        if previous is not None:
            previous.exception()  # never close the file under a running write
        os.close(out_fd)
    return state["crc"]


def _runs_through(copier: _Copier, runs: list[Run], view: memoryview):
    """Read `runs` (in output order, contiguous) into `view` a buffer at a time; yields the bytes filled each time."""
    for run in runs:
        for start in range(0, run.nbytes, len(view)):
            n = min(len(view), run.nbytes - start)
            copier.read_into(Run(run.file, run.src + start, 0, n), view)
            yield n


def _pwrite_all(fd: int, data, position: int) -> int:
    """Write all of `data` at `position`; returns the position after it."""
    data, done = memoryview(data).cast("B"), 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], position + done)
    return position + done


def write_extras(plan: ReshardPlan, index: CheckpointIndex, folder: Path, *,
                 max_shard_size: int | None = None) -> list[dict]:
    """Write the plan's extras (on-disk tensors the model does not load: MTP layers, ...) whole, under their own
    keys, into `extra-PPPPP-of-NNNNN.safetensors` files in `folder`; returns their manifest entries.

    The names do not match the rank-file pattern transformers' distributed loader looks for, and no coordinate lists
    them, so no rank reads them; `merge` writes them back. Bytes are copied as they are; a quantized pair among them
    is dequantized like every other weight in a dequantizing write, so the output is one consistent bf16 checkpoint.
    """
    if not plan.extras:
        return []
    items = [(ChunkSpec(t.name, t.dtype, t.shape, (0,) * len(t.shape), t.numel * DTYPE_BITS[t.dtype] // 8, i), t,
              tuple((0, n) for n in t.shape)) for i, t in enumerate(plan.extras)]
    parts = split_parts(items, max_shard_size)
    copier = _Copier(index, None)
    entries = []
    try:
        for part, chunk_items in enumerate(parts):
            path = folder / extra_file_name(part, len(parts))
            specs = [spec for spec, _, _ in chunk_items]
            crc = _write_chunks(path, safetensors_header(specs, {"format": "pt"}), chunk_items, copier)
            entries.append({"name": path.name, "bytes": path.stat().st_size, "crc32": f"{crc:08x}",
                            "keys": [spec.name for spec in specs]})
        copier.finish_source_checks()
    finally:
        copier.close()
    return entries


def extras_bytes(plan: ReshardPlan) -> int:
    """Bytes of tensor data the plan's extras files hold."""
    return sum(t.numel * DTYPE_BITS[t.dtype] // 8 for t in plan.extras)


def _fsync_files(folder: Path) -> None:
    """One fsync pass over the finished files: the kernel writes them back together, not one file at a time."""
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def _swap_hook(step: str) -> None:
    """Called at each step of putting the finished folder in place; tests replace it to interrupt there.

    Steps: `before-swap`, `old-moved` (rename fallback only: OUT is aside, signals are held), `swapped` (OUT is the
    new folder, the old one not yet removed), `done`.
    """


def _temporaries(out: Path) -> list[Path]:
    # escaped: an OUT named `m*` must not match the temporaries of another OUT's write
    return sorted(out.parent.glob(f".{glob.escape(out.name)}{TMP_MARK}*"))


def _aside_path(out: Path) -> Path:
    return out.parent / f".{out.name}{TMP_MARK}old-{os.getpid()}"


def _clean_stale_temporaries(out: Path) -> None:
    """Under the write lock: put back an OUT a killed swap left aside, then remove every earlier temporary.

    Holding the lock proves their writers are gone (a live writer holds it, on any host), which a pid check cannot
    tell on a shared file system.
    """
    stale = _temporaries(out)
    aside = [p for p in stale if p.name.startswith(f".{out.name}{TMP_MARK}old-")]
    if aside and not os.path.lexists(out):  # killed between the two renames of the fallback swap
        os.rename(aside[0], out)
        _fsync_dir(out.parent)
        stale.remove(aside[0])
    for tmp in stale:
        shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def _write_lock(out: Path):
    """Hold `.OUT.reshard-lock` (flock, released by the kernel when the process dies) for the whole write.

    Raises:
        OutputError: another write to `out` holds it (naming its host and pid), or no lock can be taken there.
    """
    path = out.parent / f".{out.name}{LOCK_MARK}"
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise OutputError(f"{path}: cannot create the write lock beside {out.name} ({e.strerror or e}); "
                              "choose a folder you can write to.") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = os.pread(fd, 200, 0).decode(errors="replace").split()
            os.close(fd)
            if e.errno not in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES):
                raise OutputError(f"{path}: cannot lock it ({e.strerror or e}); this file system does not support "
                                  "file locks. Write to another one.") from e
            who = f" (host {holder[0]}, pid {holder[1]})" if len(holder) == 2 else ""
            raise OutputError(f"another reshard write{who} is writing {out}; wait for it to finish, or stop it, "
                              "then run this again. Nothing was changed.") from e
        try:  # its last holder may have removed the file between our open and flock: lock the one at `path`
            if os.path.samestat(os.fstat(fd), os.stat(path)):
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{socket.gethostname()} {os.getpid()}\n".encode(), 0)
        yield
    finally:
        try:
            os.unlink(path)  # still locked: a writer that opened it meanwhile sees it gone and retries
        except OSError:
            pass
        os.close(fd)


def _refuse_source_overlap(out: Path, index: CheckpointIndex) -> None:
    """Refuse an OUT that is the source or holds any of its files: replacing OUT would delete them."""
    for path in [index.root, *(index.path_of(f.name) for f in index.files)]:
        real = Path(path).resolve()
        if real == out or out in real.parents:
            raise OutputError(f"{out} is or holds the source checkpoint ({real}); writing there would replace the "
                              "source. Nothing was changed. Choose another output folder.")


def _not_replaceable(out: Path) -> str | None:
    """Why `out` may not be replaced, or None: it is empty, or holds only what one reshard write put there."""
    if not out.is_dir():
        return "it is not a folder"
    entries = sorted(os.listdir(out))
    if not entries:
        return None
    try:
        manifest = json.loads((out / MANIFEST_NAME).read_text())
    except FileNotFoundError:
        return f"it holds {_some(entries)} and no {MANIFEST_NAME}, so it is not a reshard output"
    except (OSError, ValueError) as e:
        return f"its {MANIFEST_NAME} cannot be read ({e})"
    try:
        if manifest.get("format") != MANIFEST_FORMAT:
            return f"its {MANIFEST_NAME} is not a reshard manifest"
        ours = {MANIFEST_NAME, *(f["name"] for f in manifest["files"]),
                *(f["name"] for f in manifest.get("extras") or ())}
        copied = manifest.get("copied")
        # a manifest from before `copied` was recorded: only top-level files reshard copies today count as ours
        ours |= set(copied) if copied is not None else {e for e in entries if is_metadata_file(e)}
    except (AttributeError, KeyError, TypeError):
        return f"its {MANIFEST_NAME} is damaged"
    foreign = [e for e in entries if e not in ours or not (out / e).is_file()]
    if foreign:
        return f"it is a reshard output but also holds {_some(foreign)}, which reshard did not write"
    return None


def _some(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def _check_replaceable(out: Path, overwrite: bool, *, why_not=None, replaceable: str = "a complete reshard output"
                       ) -> None:
    """Refuse an existing `out` unless `overwrite` and it is an empty folder or `replaceable` (`why_not(out)`, by
    default `_not_replaceable`, says why it is not, or None)."""
    if not overwrite:
        raise OutputError(f"{out} already exists. Pass --overwrite to replace it (only an empty folder or "
                          f"{replaceable} is replaced), or choose another folder.")
    why = (why_not or _not_replaceable)(out)
    if why is not None:
        rule = f"--overwrite replaces only an empty folder or {replaceable}"
        raise OutputError(f"{out}: {rule}, and {why}. Nothing was changed. Move what is there yourself, or choose "
                          "another output folder.")


@contextmanager
def sigterm_as_interrupt():
    """Let SIGTERM unwind like Ctrl-C, as `KeyboardInterrupt("signal 15")`, so `finally` blocks clean up (the
    temporary folder is removed) and the CLI boundary exits 143. Off the main thread, signals are left alone."""
    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def write_coordinates(plan: ReshardPlan, index: CheckpointIndex, tmp: Path, coords, *,
                      max_shard_size: int | None = None, progress=None, fsync: bool = False) -> list[dict]:
    """Write the files of the fsdp coordinates `coords` into the folder `tmp` and return their manifest entries.

    The one step every writer runs on its share: the in-process write (all coordinates), each worker process of
    `--workers N` and each rank of a distributed write.

    Args:
        coords: the coordinates to write, in order.
        max_shard_size: split each coordinate's data into files of at most this many bytes.
        progress: an object whose `update(nbytes)` is told of every copied byte, or None.
        fsync: flush each written file to disk before returning (a share whose writer reports to another process).

    Returns:
        One entry per file, `{"coord": c, ...}`, in coordinate then part order.
    """
    copier = _Copier(index, progress)
    files, paths = [], []
    try:
        for coord in coords:
            parts = split_parts(coordinate_chunks(plan, coord), max_shard_size)  # one coordinate's list at a time
            for part, items in enumerate(parts):
                path = tmp / shard_file_name(coord, part, len(parts))
                files.append({"coord": coord, **_write_file(path, items, copier)})
                paths.append(path)
        copier.finish_source_checks()
    finally:
        copier.close()
    if fsync:
        for path in paths:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    return files


def _check_output(index: CheckpointIndex, out: str | os.PathLike, overwrite: bool) -> tuple[Path, list[str]]:
    """The checks made before the lock is taken: the resolved OUT and the metadata files to copy beside the shards."""
    out = Path(out).resolve()
    for file in index.files:
        index.path_of(file.name)  # fails early for header-only (remote) sources
    _refuse_source_overlap(out, index)
    if os.path.lexists(out):
        _check_replaceable(out, overwrite)  # refused before anything is touched
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"{out.parent}: cannot create it ({e.strerror or e}); choose a folder you can write "
                          "to.") from e
    return out, [name for name in index.other_files if name != MANIFEST_NAME]


def _claim_output(plan: ReshardPlan, index: CheckpointIndex, out: Path, overwrite: bool, copied: list[str]):
    """Under the write lock: clean up earlier writes, check OUT again and the free space.

    Returns:
        (each coordinate's bytes of shard data, their sum, the bytes of the whole output, the temporary folder).
    """
    _clean_stale_temporaries(out)  # may put back an OUT a killed swap left aside: check it again
    if os.path.lexists(out):
        _check_replaceable(out, overwrite)
    sizes = coordinate_sizes(plan)  # chunk lists are built one coordinate at a time, as its files are written
    data = sum(sizes)
    total = data + extras_bytes(plan) + sum((index.root / name).stat().st_size for name in copied)
    free = shutil.disk_usage(out.parent).free
    if free < total:
        raise OutputError(f"{out.parent}: {free / 2**30:.2f} GiB free, the output needs {total / 2**30:.2f} GiB. "
                          "Free space or write elsewhere.")
    return sizes, data, total, out.parent / f".{out.name}{TMP_MARK}{os.getpid()}"


def _progress_bar(total: int, progress: bool | None):
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="reshard write",
                disable=None if progress is None else not progress)


def _finish(plan: ReshardPlan, index: CheckpointIndex, tmp: Path, out: Path, files: list[dict],
            copied: list[str], overwrite: bool, *, max_shard_size: int | None = None) -> dict:
    """Complete the temporary folder (extras, copied files, fsync, the manifest last) and put it in place as OUT."""
    extras = write_extras(plan, index, tmp, max_shard_size=max_shard_size)
    for name in copied:
        if name == "config.json" and index.quantization is not None:
            # the bf16 model's config: transformers must not build the quantized model for these files
            from ..read.quant import dequantized_config

            (tmp / name).write_text(json.dumps(dequantized_config(index.config), indent=2) + "\n")
        else:
            shutil.copy2(index.root / name, tmp / name)
    _fsync_files(tmp)
    manifest = _manifest(plan, index, files, extras)
    with open(tmp / MANIFEST_NAME, "w") as f:
        f.write(dump_manifest(manifest))
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    _replace(tmp, out, overwrite)
    return manifest


def _output_error(e: OSError, out: Path, total: int) -> OutputError:
    """The error a write reports for `e`, once its temporary folder is gone."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return OutputError(f"{out.parent}: no space left on the device while writing; nothing was kept. "
                           f"The output needs {total / 2**30:.2f} GiB.")
    if isinstance(e, OutputError):
        return e
    return OutputError(f"{out}: write failed ({e}); nothing was kept.")


def removes_made_parents(argument: str):
    """Decorate a writer whose parameter `argument` is its output folder: when it fails or is interrupted, the parent
    folders of the output it created (those missing before the call, and still empty) are removed again, so a refused
    write into `small/x/y/out` leaves no empty `x/y` behind."""
    def decorate(fn):
        import inspect

        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            made = _missing_parents(Path(signature.bind(*args, **kwargs).arguments[argument]))
            try:
                return fn(*args, **kwargs)
            except BaseException:
                for folder in made:  # deepest first; one that is not empty (someone else's now) stays, as all above
                    try:
                        os.rmdir(folder)
                    except OSError:
                        break
                raise

        return wrapper

    return decorate


def _missing_parents(out: Path) -> list[Path]:
    """The parent folders of `out` that do not exist yet, deepest first."""
    missing, parent = [], Path(os.path.abspath(out)).parent
    while not os.path.lexists(parent) and parent != parent.parent:
        missing.append(parent)
        parent = parent.parent
    return missing


@removes_made_parents("out")
def write_shards(plan: ReshardPlan, index: CheckpointIndex, out: str | os.PathLike, *, overwrite: bool = False,
                 max_shard_size: int | None = None, progress: bool | None = None, workers: int | None = 1) -> dict:
    """Write `plan` for the checkpoint `index` into the folder `out`.

    Args:
        plan: from `make_plan`.
        index: the source checkpoint (local files: `read_checkpoint(..., need_data=True)`).
        out: the output folder; must not exist unless `overwrite`, and then be empty or a reshard output.
        max_shard_size: split each coordinate's data into files of at most this many bytes.
        progress: show a byte progress bar (None: only on a terminal; False: never).
        workers: processes writing shares of the coordinates' files in parallel (`reshard.write.parallel`); 1 writes in
            this process; None picks `reshard.write.parallel.default_workers`. With more than 1, a script calling this
            needs the `if __name__ == "__main__":` guard (workers are spawned). The output is the same either way.

    Returns:
        The manifest document written to `out/reshard.json`.

    Raises:
        OutputError: `out` exists (and is not replaceable), is or holds the source, another write to it is running,
            it is not writable, the disk is full, or a worker failed (nothing partial is left).
        CheckpointError: the source is not available locally.

    Example:
        >>> write_shards(plan, read_checkpoint("ckpt", need_data=True), "ckpt-fsdp8")  # doctest: +SKIP
    """
    out, copied = _check_output(index, out, overwrite)
    with sigterm_as_interrupt(), _write_lock(out):
        sizes, data, total, tmp = _claim_output(plan, index, out, overwrite, copied)
        if workers is None or workers > 1:
            from .parallel import default_workers, write_with_workers

            workers = (default_workers(data, len(sizes), compute=index.quantization is not None) if workers is None
                       else min(workers, len(sizes)))
        bar = _progress_bar(data, progress)
        try:
            with discarded_on_failure(out, tmp, total):
                tmp.mkdir()
                if workers > 1:
                    files = write_with_workers(plan, index, tmp, sizes, workers, max_shard_size=max_shard_size,
                                               progress=bar)
                else:
                    files = write_coordinates(plan, index, tmp, range(len(sizes)), max_shard_size=max_shard_size,
                                              progress=bar)
                manifest = _finish(plan, index, tmp, out, files, copied, overwrite, max_shard_size=max_shard_size)
        finally:
            bar.close()
    return manifest


@contextmanager
def discarded_on_failure(out: Path, tmp: Path, total: int):
    """Around filling `tmp` and putting it in place as `out`: on any failure or interruption, `_discard`, and an
    `OSError` becomes the `OutputError` a write reports (`total`: the bytes the output needs, for a full disk)."""
    try:
        yield
    except OSError as e:
        _discard(out, tmp)
        raise _output_error(e, out, total) from e
    except BaseException as e:
        _discard(out, tmp, interrupted=isinstance(e, KeyboardInterrupt))
        raise


def _discard(out: Path, tmp: Path, *, interrupted: bool = False) -> None:
    """After a failure or interruption: put OUT back if this write had moved it aside, remove the temporaries.

    Interrupted (Ctrl-C, SIGTERM), the removal takes `INTERRUPT_CLEANUP_S` at most (`remove_within`), so the process
    exits at once even after writing 20,000 files; the rest is left for the next write to OUT.
    """
    aside = _aside_path(out)
    if os.path.lexists(aside) and not os.path.lexists(out):
        os.rename(aside, out)
    for folder in (tmp, aside):
        if interrupted:
            remove_within(folder, out, INTERRUPT_CLEANUP_S)
        else:
            shutil.rmtree(folder, ignore_errors=True)


def remove_within(folder: Path, out: Path, seconds: float) -> None:
    """Remove the temporary `folder` of a write to `out` for at most `seconds`, then stop.

    It is first renamed `.OUT.reshard-tmp-stale-PID-N`: whatever is left is then plainly stale, and the next write
    to OUT removes it under its lock (`_clean_stale_temporaries`, as after a SIGKILL). Measured: 20,000 files took
    35-56 s to delete on a loaded file system, far past the few seconds a SIGTERM is given before a SIGKILL.
    """
    if not os.path.lexists(folder):
        return
    stale = out.parent / f".{out.name}{TMP_MARK}stale-{os.getpid()}-{time.monotonic_ns()}"
    try:
        os.rename(folder, stale)
    except OSError:
        stale = folder  # another rank renamed it first, or the file system refuses: remove it where it is
    deadline = time.monotonic() + seconds
    try:
        with os.scandir(stale) as entries:
            for entry in entries:
                if time.monotonic() > deadline:
                    return
                try:
                    if entry.is_dir(follow_symlinks=False):
                        shutil.rmtree(entry.path)
                    else:
                        os.unlink(entry.path)
                except OSError:
                    pass
        os.rmdir(stale)
    except OSError:
        pass


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _replace(tmp: Path, out: Path, overwrite: bool, *, check=None) -> None:
    """Put the finished folder in place so that OUT is, at every instant, the whole old or the whole new folder.

    An existing OUT (checked again: nothing foreign may appear during the write) is exchanged with the new folder in
    one step (Linux `renameat2(RENAME_EXCHANGE)`), then removed from where the new one was. Where the kernel or file
    system cannot exchange, OUT is renamed aside and the new folder renamed in with SIGINT and SIGTERM held; only a
    SIGKILL between those two renames leaves OUT aside, and the next write to OUT puts it back.
    """
    _swap_hook("before-swap")
    if not os.path.lexists(out):
        os.rename(tmp, out)
        _swap_hook("swapped")
    else:
        (check or _check_replaceable)(out, overwrite)  # `reshard merge` passes its own rule
        if _exchange(tmp, out):
            _fsync_dir(out.parent)
            _swap_hook("swapped")
            shutil.rmtree(tmp, ignore_errors=True)  # the old output, now at the temporary path
        else:
            aside = _aside_path(out)
            with _signals_held():
                os.rename(out, aside)
                try:
                    _swap_hook("old-moved")
                    os.rename(tmp, out)
                except BaseException:
                    os.rename(aside, out)
                    raise
            _fsync_dir(out.parent)
            _swap_hook("swapped")
            shutil.rmtree(aside, ignore_errors=True)
    _fsync_dir(out.parent)
    _swap_hook("done")


@contextmanager
def _signals_held():
    """Hold SIGINT and SIGTERM around the two renames of a swap: raised again, to their own handlers, after it.

    Python runs signal handlers in the main thread whichever thread the kernel picked, so recording them there
    (not masking this thread) is what keeps them out of the block. Off the main thread they never interrupt it.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    held = (signal.SIGINT, signal.SIGTERM)
    previous = {s: signal.signal(s, lambda signum, frame: caught.append(signum)) for s in held}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)
        for s in dict.fromkeys(caught):
            signal.raise_signal(s)


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


@functools.lru_cache(maxsize=None)
def _libc(name: str, *argtypes):
    """Linux C library's function `name` (errno kept, int result), or None: another platform, or a C library
    without it (renameat2 needs glibc 2.28)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes = list(argtypes)
    fn.restype = ctypes.c_int
    return fn


def _fallocate():
    return _libc("fallocate", ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)


def create_sized(path: Path, size: int) -> int:
    """Create `path` (it must not exist) for writing, with its `size` bytes of blocks reserved up front; returns the fd.

    Writes into reserved blocks skip the file system's block allocation on each write (on ext4, 32 MiB pwrites ran 2-7x
    faster, fsync included), and a full disk fails here, before any byte is copied. Where the platform or file system
    has no fallocate nothing is reserved: this is Linux's call, not glibc's posix_fallocate, which writes zeros instead.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    fn = _fallocate()
    if fn is not None and size > 0 and fn(fd, 0, 0, size) != 0:
        err = ctypes.get_errno()
        if err not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            os.close(fd)
            raise OSError(err, os.strerror(err), str(path))
    return fd


def _renameat2():
    return _libc("renameat2", ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)


def _exchange(a: Path, b: Path) -> bool:
    """Swap the entries at `a` and `b` atomically; False (nothing moved) where the kernel or file system cannot."""
    fn = _renameat2()
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _placement_dict(p) -> dict:
    return {"kind": p.kind.value, "shard_dim": p.shard_dim, "degree": p.degree, "ep": p.ep,
            "placements": p.describe()}


def _dequantized_from(tensor: TargetTensor, index: CheckpointIndex) -> dict:
    """`{"dequantized_from": ...}` for a tensor computed from quantized pieces (their format and keys), else {}."""
    quantized = index.quantization.tensors if index.quantization is not None else {}
    sources = [quantized[p.source] for p in tensor.pieces if p.source in quantized]
    if not sources:
        return {}
    record = sources[0].record()
    record["keys"] = [key for q in sources for key in q.record()["keys"]]
    return {"dequantized_from": record}


def _manifest(plan: ReshardPlan, index: CheckpointIndex, files: list[dict], extras: list[dict] = ()) -> dict:
    """The manifest document for the written `files` (their entries, every coordinate's, in any order) and the
    extras files (`write_extras`; the `extras` section only when there are any)."""
    mesh = plan.mesh
    by_coord: dict[int, list[dict]] = {c: [] for c in range(mesh.num_shard_groups)}
    for entry in sorted(files, key=lambda f: (f["coord"], f["first"])):
        by_coord[entry["coord"]].append(entry)
    return {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "tool": f"reshard {__version__}",
        "source": {
            "source": index.source,
            "revision": index.revision,
            "model_type": plan.layout.model_type,
            "architecture": plan.layout.architecture,
            "header_sha256": {f.name: f.digest for f in index.files},
            **({"quantization_config": index.quantization.config} if index.quantization is not None else {}),
        },
        "mesh": mesh.to_dict(),
        "distributed_config": mesh.distributed_config_kwargs(),
        "layout": plan.mode.value,
        "tensors": {
            tp.tensor.name: {"shape": list(tp.tensor.shape), "dtype": tp.tensor.dtype, "role": tp.tensor.role.value,
                             "is_param": tp.tensor.is_param, "placement": _placement_dict(tp.planned),
                             "stock_placement": _placement_dict(tp.stock),
                             **_dequantized_from(tp.tensor, index)}
            for tp in plan.tensors
        },
        "order": [tp.tensor.name for tp in plan.tensors],  # file entries name runs of it (`first`, `count`)
        "coords": [
            {"coord": c, "ranks": [r * mesh.fsdp + c for r in range(mesh.dp_replicate)],
             "files": [f["name"] for f in entries], "empty_markers": sum(f["empty_markers"] for f in entries)}
            for c, entries in by_coord.items()
        ],
        "files": [entry for c in by_coord for entry in by_coord[c]],
        "copied": [name for name in index.other_files if name != MANIFEST_NAME],  # non-weight files, as they were
        # the source's on-disk keys per tensor, for `reshard merge --layout original` (reshard.read.dcp_source)
        "source_layout": _source_layout(plan, index),
        **({"extras": list(extras)} if extras else {}),
        # with --drop-unloaded: how many the source held, so that `merge` can say what it cannot write back
        **({"dropped_unloaded": len(plan.layout.extras)} if plan.layout.extras and not plan.extras else {}),
    }


def _source_layout(plan: ReshardPlan, index: CheckpointIndex) -> dict | None:
    from ..read.dcp_source import source_layout_record

    return source_layout_record(plan.layout, index)
