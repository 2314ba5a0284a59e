"""Read each rank's shards from its own files straight into the model's local tensors.

transformers loads a distributed checkpoint with `dcp.load`: every rank reads every file's metadata, the load plan
is gathered and scattered, data is read through mmap into new tensors and then copied into the model. A reshard
folder already holds each rank's exact local shard, so here each tensor is read once, with `readinto`, into the
memory of its local shard (staged through host memory when the shard lives on an accelerator or is not
contiguous). The CRC-32 of each of the rank's own files is computed over the same bytes as they pass, so checking
costs no second read.

Each rank decides from its own model whether this path applies (every local shard's shape, global offset and dtype
must equal a chunk in the folder); one `all_gather_object` then makes the decision and any read error common to all
ranks: either every rank takes this path or every rank falls back to `dcp.load`, and a bad file stops every rank.
"""

from __future__ import annotations

import json
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ..read.checkpoint import FileHeader, TensorEntry, read_header
from ..errors import LoadError, ReshardError
from ..manifest import DCP_SHARDING_INFO_KEY, SAVED_OFFSETS_KEY, Manifest, file_crc32

_CRC_BLOCK = 1 << 20


def torch_dtype(code: str):
    """The torch dtype of a safetensors dtype code (`BF16` -> torch.bfloat16), or None if torch has none."""
    import torch

    return {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
            "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
            "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}.get(code)


@dataclass(frozen=True)
class _Read:
    entry: TensorEntry
    local: object  # the torch.Tensor the bytes land in


@dataclass(frozen=True)
class _FileReads:
    path: Path
    header: FileHeader
    reads: tuple[_Read, ...]
    crc32: str | None  # expected CRC-32 of the whole file when this rank checks it


def local_boxes(model) -> dict[str, tuple[object, tuple[int, ...], tuple[int, ...]]]:
    """State-dict name -> (local tensor, local shape, global offset) for this rank."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    boxes = {}
    for name, tensor in model.state_dict().items():
        if isinstance(tensor, DTensor):
            shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
            boxes[name] = (tensor._local_tensor, tuple(shape), tuple(offset))
        else:
            boxes[name] = (tensor, tuple(tensor.shape), (0,) * tensor.dim())
    return boxes


def plan_reads(model, manifest: Manifest, rank: int, *, checksums: bool) -> list[_FileReads] | str:
    """Which file each local shard of this rank comes from; a reason string when some shard has no exact chunk."""
    own = manifest.files_of_rank(rank)
    chunks: dict[tuple, str] = {}  # (name, offsets, shape) -> file, for this rank's own files only
    for file in own:
        for chunk in manifest.chunks(manifest.file_entry(file)):
            chunks[(chunk.name, chunk.offsets, chunk.shape)] = file
    wanted: dict[str, list[tuple[str, object, tuple[int, ...]]]] = {name: [] for name in own}
    placed: set[tuple] = set()  # (address, shape) of every local that is read
    unplaced = []
    for name, (local, shape, offset) in local_boxes(model).items():
        if local.numel() == 0:
            continue  # an empty local: nothing to read (its file holds an explicit empty marker)
        if (local.data_ptr(), tuple(local.shape)) in placed:
            continue  # a tied weight: its memory is read once (its own copy in the file still passes the CRC)
        file = chunks.get((name, offset, shape))
        if file is None:
            unplaced.append((name, local, shape, offset))
            continue
        wanted.setdefault(file, []).append((name, local, offset))
        placed.add((local.data_ptr(), tuple(local.shape)))
    for name, local, shape, offset in unplaced:
        if (local.data_ptr(), tuple(local.shape)) not in placed:  # a tied weight is the same memory as a read one
            return f"no chunk of {name} at offset {list(offset)} with shape {list(shape)} in the folder"
    crcs = {f["name"]: f["crc32"] for f in manifest.files}
    plan = []
    for file, targets in wanted.items():
        path = manifest.path / file
        header = read_header(path)
        entries = {e.name: e for e in header.tensors}
        saved = _saved_offsets(header)
        reads = []
        for name, local, offset in targets:
            entry = entries.get(name)
            if entry is None or saved.get(name) != list(offset) or tuple(entry.shape) != tuple(local.shape):
                return f"{file} does not hold {name} at offset {list(offset)} with shape {list(local.shape)}"
            if torch_dtype(entry.dtype) != local.dtype:
                return f"{name} is {entry.dtype} in {file} but {local.dtype} in the model (a dtype conversion)"
            reads.append(_Read(entry, local))
        plan.append(_FileReads(path, header, tuple(reads), crcs[file] if checksums and file in own else None))
    return plan


def _saved_offsets(header: FileHeader) -> dict[str, list[int]]:
    info = json.loads(header.metadata.get(DCP_SHARDING_INFO_KEY) or "{}")
    return {name: chunk.get(SAVED_OFFSETS_KEY) for name, chunk in info.items()}


def _fill(fh, view: memoryview, where: str) -> None:
    done = 0
    while done < len(view):
        n = fh.readinto(view[done:])
        if not n:
            raise LoadError(f"{where}: the file ended early; it is truncated")
        done += n


def _flat_bytes(tensor):
    """A contiguous tensor's memory as a 1-D uint8 tensor (a view)."""
    import torch

    return tensor.reshape(-1).view(torch.uint8)


class _Staging:
    """Two reusable host buffers for shards that cannot be read into directly (accelerator memory).

    Reused, so their pages fault in once rather than for every tensor (fresh pages cost more than the copy); two,
    so a chunk can be read into one while the CRC worker still holds the other.
    """

    def __init__(self, nbytes: int = 64 << 20):
        self.nbytes = nbytes
        self._buffers: list = [None, None]
        self._busy: list[Future | None] = [None, None]
        self._next = 0

    def take(self):
        """(slot, buffer): a free buffer, once the CRC of its last chunk is done."""
        import torch

        slot, self._next = self._next, self._next ^ 1
        if self._busy[slot] is not None:
            self._busy[slot].result()
            self._busy[slot] = None
        if self._buffers[slot] is None:
            self._buffers[slot] = torch.empty(self.nbytes, dtype=torch.uint8)
        return slot, self._buffers[slot]

    def hold(self, slot: int, future: Future | None) -> None:
        self._busy[slot] = future


class _BackgroundCrc:
    """CRC-32 of byte blocks in the order given, computed on one worker thread while the caller reads on.

    zlib and file reads both release the GIL, so checksumming one tensor overlaps reading the next: on a machine
    with a core to spare, checking costs almost nothing on top of the read.
    """

    def __init__(self):
        self._value = 0
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reshard-crc")
        self._pending: list[Future] = []

    def update(self, data) -> Future:
        future = self._pool.submit(self._update, data)  # one worker: blocks are taken in order
        self._pending.append(future)
        return future

    def _update(self, data) -> None:
        self._value = zlib.crc32(data, self._value)

    def hexdigest(self) -> str:
        self.close()
        for future in self._pending:
            future.result()  # re-raise anything the worker met
        return f"{self._value:08x}"

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def read_file(job: _FileReads, staging: _Staging | None = None) -> str | None:
    """Read one file's tensors into their local shards; with a CRC to check, every byte of the file passes it.

    `staging`: the host buffers for accelerator shards, shared by a rank's files (made here if not given).
    Returns a problem description, or None.
    """
    import torch

    reads = {r.entry.name: r for r in job.reads}
    crc = _BackgroundCrc() if job.crc32 is not None else None
    staging = staging or _Staging()
    try:
        with torch.no_grad(), open(job.path, "rb", buffering=0) as fh:
            if crc:
                header = bytearray(job.header.header_bytes)
                _fill(fh, memoryview(header), job.path.name)
                crc.update(header)
            position = job.header.header_bytes
            for entry in sorted(job.header.tensors, key=lambda e: e.data_start):
                read = reads.get(entry.name)
                if read is None and not crc:
                    continue
                if crc and entry.data_start != position:  # bytes between tensors still count
                    fh.seek(position)
                    _crc_span(fh, entry.data_start - position, crc, job.path.name)
                fh.seek(entry.data_start)
                position = entry.data_start + entry.nbytes
                if read is None:
                    _crc_span(fh, entry.nbytes, crc, job.path.name)
                    continue
                local = read.local
                _read_tensor(fh, entry.nbytes, local, crc, staging, f"{job.path.name} ({entry.name})",
                             in_place=local.device.type == "cpu")
            if crc:
                fh.seek(position)
                while block := fh.read(_CRC_BLOCK):
                    crc.update(block)
        if crc and (value := crc.hexdigest()) != job.crc32:
            return f"{job.path.name} is corrupt (CRC-32 {value}, the manifest says {job.crc32})"
        return None
    finally:
        if crc:
            crc.close()


def _read_tensor(fh, nbytes: int, local, crc: _BackgroundCrc | None, staging: _Staging, where: str, *,
                 in_place: bool) -> None:
    """Read one tensor's `nbytes` (the file is positioned at them) into `local`, passing them to `crc`.

    `in_place`: read straight into `local`'s memory (host memory); else through `staging` (accelerator memory).
    """
    import torch

    if local.is_contiguous() and in_place:
        view = memoryview(_flat_bytes(local).numpy())
        _fill(fh, view, where)
        if crc:
            crc.update(view)
    elif local.is_contiguous():  # accelerator memory: through the staging buffers, chunk by chunk
        dest, done = _flat_bytes(local), 0
        while done < nbytes:
            slot, buffer = staging.take()
            n = min(staging.nbytes, nbytes - done)
            view = memoryview(buffer.numpy())[:n]
            _fill(fh, view, where)
            staging.hold(slot, crc.update(view) if crc else None)
            dest[done:done + n].copy_(buffer[:n])
            done += n
    else:  # a strided local: the whole tensor staged, then copied in place
        whole = torch.empty(local.shape, dtype=local.dtype)
        view = memoryview(_flat_bytes(whole).numpy())
        _fill(fh, view, where)
        if crc:
            crc.update(view)  # the view keeps `whole` alive until its CRC is done
        local.copy_(whole)


def _crc_span(fh, length: int, crc: _BackgroundCrc, where: str) -> None:
    while length > 0:
        block = fh.read(min(length, _CRC_BLOCK))
        if not block:
            raise LoadError(f"{where}: the file ended early; it is truncated")
        crc.update(block)
        length -= len(block)


def gather(value) -> list:
    """Every rank's `value`, in rank order (all_gather_object on the default group)."""
    import torch.distributed as dist

    values: list = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def _rank_list(ranks: list[int]) -> str:
    """`[0, 1, 2, 5]` -> `ranks 0-2, 5`."""
    spans: list[list[int]] = []
    for r in ranks:
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    text = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)
    return f"rank{'s' if len(ranks) > 1 else ''} {text}"


def failing_ranks(problems: list) -> dict[str, list[int]]:
    """Each distinct problem in `problems` (one entry per rank, falsy where fine) with the ranks that have it."""
    failed: dict[str, list[int]] = {}
    for r, p in enumerate(problems):
        if p:
            failed.setdefault(p, []).append(r)
    return failed


def describe_failures(failed: dict[str, list[int]], ranks: int, what: str) -> str:
    """`N of M rank(s) <what> (ranks 0-2: cause; rank 5: other cause)`, from `failing_ranks`."""
    count = sum(len(r) for r in failed.values())
    detail = "; ".join(f"{_rank_list(r)}: {p}" for p, r in failed.items())
    return f"{count} of {ranks} rank(s) {what} ({detail})"


def raise_if_any(problems: list) -> None:
    """Raise LoadError, naming every failing rank, when any rank's entry is a problem (identical ones grouped)."""
    failed = failing_ranks(problems)
    if len(failed) == 1 and len(next(iter(failed.values()))) == len(problems):
        raise LoadError(next(iter(failed)))  # the same on every rank (a world size or mesh mismatch): say it once
    if failed:
        raise LoadError(f"{describe_failures(failed, len(problems), 'cannot load')}. Every rank stops here. "
                        "Run `reshard verify` on the folder, or write it again.")


def load_local_shards(model, manifest: Manifest, *, checksums: bool = True) -> bool:
    """Fill every local shard of `model` from this rank's files; every rank must call it.

    Returns True when the shards were read here, False when some rank's model does not match the folder's chunks
    exactly (then every rank returns False and the caller loads with `dcp.load`; with `checksums`, the ranks that
    did not read their files check their CRCs first).

    Raises:
        LoadError: on every rank, when any rank's files are missing, truncated or corrupt.
    """
    import torch.distributed as dist

    rank = dist.get_rank()
    reason = problem = None
    try:
        plan = plan_reads(model, manifest, rank, checksums=checksums)
        if isinstance(plan, str):
            reason = plan
        else:
            staging = _Staging()
            for job in plan:
                problem = problem or read_file(job, staging)
    except ReshardError as e:
        problem = str(e)
    except Exception as e:  # noqa: BLE001  anything else too: raising alone would leave the other ranks in gather
        problem = f"{type(e).__name__}: {e}"
    notes = gather((reason, problem))
    raise_if_any([p for _, p in notes])
    reasons = [(r, why) for r, (why, _) in enumerate(notes) if why]
    if not reasons:
        return True
    if rank == 0:
        import warnings

        r, why = reasons[0]
        warnings.warn(f"reshard: loading through dcp.load, not from each rank's own files: rank {r}: {why}",
                      stacklevel=2)
    if checksums:  # a rank that read its files has checked them already; only the others still need the pass
        raise_if_any(gather(_own_files_problem(manifest, rank) if reason else None))
    return False


def _own_files_problem(manifest: Manifest, rank: int) -> str | None:
    """CRC-32 of each of this rank's files against the manifest; a problem description or None. Never raises."""
    expected = {f["name"]: f["crc32"] for f in manifest.files}
    problems = []
    for name in manifest.files_of_rank(rank):
        try:
            crc = file_crc32(manifest.path / name)
        except OSError as e:
            problems.append(f"{name} cannot be read ({e.strerror or e})")
            continue
        if crc != expected[name]:
            problems.append(f"{name} is corrupt (CRC-32 {crc}, the manifest says {expected[name]})")
    return "; ".join(problems) or None
