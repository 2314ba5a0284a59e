"""A remote file read front to back in large ranged requests, fetched ahead of its reader (a rank loading its own
file from an object store), and the sizes that bound what a remote read holds in flight."""

from __future__ import annotations

from collections import deque

# A remote file read whole is fetched in requests of RANGE bytes, DEPTH of them in flight while the bytes of the one
# that arrived are used: (DEPTH + 1) x RANGE bytes (160 MiB) bound its memory. Each request costs the client and the
# server CPU (about 5 ms of botocore's here), so ranges are large; 4 streams were S3's best on the test server.
RANGE = 32 << 20
DEPTH = 4


class RangeFile:
    """A remote file read front to back in large ranged requests, not one per tensor.

    Told the byte ranges its reader will read (`expect`: a rank reading its own file, whole), it fetches them ahead in
    requests of at most `RANGE` bytes, `DEPTH` in flight while the reader copies out of the one that arrived: memory
    holds `DEPTH + 1` ranges, and no byte outside the expected ranges is fetched. A read elsewhere (not expected, or
    before `expect`) is one request of exactly what it asks. `close` cancels what has not started and waits for the
    rest: no fetch outlives the file. `store` is the file's `reshard.read.Store`.
    """

    def __init__(self, store, name: str, *, block: int | None = None, depth: int | None = None):
        self.store, self.name, self.block, self.depth = store, name, block or RANGE, depth or DEPTH
        self.size = store.size(name)
        self._pos = 0
        self._todo: deque[tuple[int, int]] = deque()  # expected pieces not yet asked for
        self._ahead: deque[tuple[int, int, memoryview, object]] = deque()  # (start, length, buffer, future)
        self._free: list[bytearray] = []
        self._pool = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._todo.clear()
        self._ahead.clear()
        self._free.clear()

    def expect(self, ranges) -> None:
        """The byte ranges `(start, end)` the reader reads next, in order: fetched ahead, touching ones as one."""
        merged: list[list[int]] = []
        for start, end in ranges:
            if end <= start:
                continue
            if merged and start == merged[-1][1]:
                merged[-1][1] = end
            else:
                merged.append([start, end])
        self._todo.extend((o, min(self.block, end - o)) for start, end in merged for o in range(start, end, self.block))
        self._fill_ahead()

    def _fill_ahead(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        while self._todo and len(self._ahead) < self.depth:
            start, length = self._todo.popleft()
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=self.depth, thread_name_prefix="reshard-range")
            buffer = self._free.pop() if self._free else bytearray(self.block)
            view = memoryview(buffer)[:length]
            self._ahead.append((start, length, view, self._pool.submit(self.store.readinto, self.name, start, view)))

    def seek(self, offset: int, whence: int = 0) -> int:
        self._pos = offset if whence == 0 else self._pos + offset if whence == 1 else self.size + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, view) -> int:
        view = memoryview(view).cast("B")
        if self._pos >= self.size or not len(view):
            return 0
        while self._ahead and self._ahead[0][0] + self._ahead[0][1] <= self._pos:  # passed over: dropped
            self._release(self._ahead.popleft())
        if self._ahead and self._ahead[0][0] <= self._pos:
            start, length, data, future = self._ahead[0]
            future.result()
            offset = self._pos - start
            n = min(len(view), length - offset)
            view[:n] = data[offset:offset + n]
            if offset + n == length:
                self._release(self._ahead.popleft())
        else:  # not expected: exactly what is asked, in one request
            n = min(len(view), self.size - self._pos)
            self.store.readinto(self.name, self._pos, view[:n])
        self._pos += n
        return n

    def _release(self, entry) -> None:
        entry[3].result()  # a failed fetch is the reader's error, even for a range passed over
        self._free.append(entry[2].obj)
        self._fill_ahead()

    def read(self, n: int = -1) -> bytes:
        n = self.size - self._pos if n < 0 else min(n, self.size - self._pos)
        out = bytearray(max(n, 0))
        view, done = memoryview(out), 0
        while done < len(out):
            got = self.readinto(view[done:])
            if not got:
                break
            done += got
        return bytes(out[:done])
