"""Helpers of the load path: reading a tensor's bytes straight into its local shard, with the CRC-32 computed on a
worker thread as they pass (`reshard.load._storage`).

A reshard folder holds each rank's exact local shard, so each tensor is read once, with `readinto`, into the memory
of its local shard (staged through host memory when the shard lives on an accelerator or is not contiguous).
"""

from __future__ import annotations

import zlib
from concurrent.futures import Future, ThreadPoolExecutor

from ..errors import LoadError


def fill(fh, view: memoryview, where: str) -> None:
    """Read into all of `view` (`readinto` may return less than asked); a file that ends first is truncated."""
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


class Staging:
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


class BackgroundCrc:
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


def read_tensor(fh, nbytes: int, local, crc: BackgroundCrc | None, staging: Staging, where: str, *,
                 in_place: bool) -> None:
    """Read one tensor's `nbytes` (the file is positioned at them) into `local`, passing them to `crc`.

    `in_place`: read straight into `local`'s memory (host memory); else through `staging` (accelerator memory).
    """
    import torch

    if local.is_contiguous() and in_place:
        view = memoryview(_flat_bytes(local).numpy())
        fill(fh, view, where)
        if crc:
            crc.update(view)
    elif local.is_contiguous():  # accelerator memory: through the staging buffers, chunk by chunk
        dest, done = _flat_bytes(local), 0
        while done < nbytes:
            slot, buffer = staging.take()
            n = min(staging.nbytes, nbytes - done)
            view = memoryview(buffer.numpy())[:n]
            fill(fh, view, where)
            staging.hold(slot, crc.update(view) if crc else None)
            dest[done:done + n].copy_(buffer[:n])
            done += n
    else:  # a strided local: the whole tensor staged, then copied in place
        whole = torch.empty(local.shape, dtype=local.dtype)
        view = memoryview(_flat_bytes(whole).numpy())
        fill(fh, view, where)
        if crc:
            crc.update(view)  # the view keeps `whole` alive until its CRC is done
        local.copy_(whole)
