"""An object store read through fsspec (s3fs for S3, huggingface_hub's `HfFileSystem` for the Hub), as a `Store`.

Each read is one ranged request of at most `READ_BLOCK` bytes; transient failures (5xx, a reset connection, a
timeout) are retried `ATTEMPTS` times with backoff, and the error names the URL and the attempts. The back end's own
retries are turned down to one try, so the bound is this module's: a server that goes away is an error within a
minute. `requests` counts what was asked, for the benchmarks and the tests.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path, PurePosixPath

from ..errors import CheckpointError
from .store import READ_BLOCK, LocalStore, RangeFile, Store, check_name

ATTEMPTS = 4  # tries of one remote request before it is an error
BACKOFF_S = 0.5  # the first wait between tries; doubled after each
CONNECT_TIMEOUT_S = 5
READ_TIMEOUT_S = 10  # ATTEMPTS x this + the backoff stays under a minute: a vanished server is an error in time


def transient(error: BaseException) -> bool:
    """Whether a failed request may succeed when tried again: a 5xx, 408 or 429 answer, a reset or refused
    connection, a timeout; never a missing object or a refusal of access."""
    status = getattr(getattr(error, "response", None), "status_code", None)
    if status is None and isinstance(getattr(error, "response", None), dict):  # botocore's ClientError
        status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    if status is not None:
        return status >= 500 or status in (408, 429)
    if isinstance(error, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
        return False
    if type(error).__name__ in ("OfflineModeIsEnabled", "HFValidationError", "NoCredentialsError"):
        return False  # a setting, not a passing fault
    return isinstance(error, (OSError, TimeoutError, ConnectionError)) or type(error).__name__ in (
        "TimeoutError", "FSTimeoutError", "ClientPayloadError", "ServerDisconnectedError", "ClientOSError",
        "ClientConnectorError", "ServerTimeoutError", "EndpointConnectionError", "ConnectTimeoutError",
        "ReadTimeoutError", "ConnectionClosedError")


class RemoteStore(Store):
    """Files under `base` of an fsspec file system, read in ranged requests.

    Args:
        fs: the file system (`s3fs.S3FileSystem`, `huggingface_hub.HfFileSystem`).
        base: the prefix, in the file system's own spelling (`bucket/prefix`, `org/name@commit`).
        location: the URL messages show (`s3://bucket/prefix`).
        read_options: passed to `cat_file`: whatever makes it one exact ranged request (HfFileSystem reads through a
            file object, whose read-ahead cache must be off; s3fs needs none).
    """

    def __init__(self, fs, base: str, location: str, *, read_options: dict | None = None):
        self.fs, self.base, self.location = fs, base.rstrip("/"), location.rstrip("/")
        self.read_options = read_options or {}  # what makes `cat_file` one exact ranged request on this back end
        self.requests = 0
        self._sizes: dict[str, int] | None = None
        self._lock = threading.Lock()

    def __getstate__(self):
        return {**self.__dict__, "_lock": None}

    def __setstate__(self, state):
        self.__dict__.update(state, _lock=threading.Lock())

    def _path(self, name: str) -> str:
        return f"{self.base}/{check_name(name, self.location)}"

    def _call(self, what: str, name: str | None, call):
        """`call()` with the bounded retries; every failure a `CheckpointError` naming the URL and the attempts."""
        where = self.url(name) if name is not None else self.location
        delay, last = BACKOFF_S, None
        for attempt in range(1, ATTEMPTS + 1):
            with self._lock:
                self.requests += 1
            try:
                return call()
            except FileNotFoundError:
                raise
            except Exception as e:  # noqa: BLE001  fsspec back ends raise many unrelated types
                last = e
                if not transient(e) or attempt == ATTEMPTS:
                    break
                time.sleep(delay)
                delay *= 2
        tries = f"{attempt} attempt{'s' if attempt > 1 else ''}"
        raise CheckpointError(f"{where}: {what} failed after {tries} ({type(last).__name__}: {str(last)[:300]}). Check "
                              "the endpoint, the credentials and the network, then run the command again. Nothing "
                              "was kept.", path=where) from last

    def _listing(self) -> dict[str, int]:
        if self._sizes is None:
            def ls():
                return self.fs.ls(self.base, detail=True, refresh=True)
            try:
                found = self._call("listing", None, ls)
            except FileNotFoundError:
                found = []
            sizes = {}
            for entry in found:
                if entry.get("type") == "file":
                    sizes[entry["name"].rstrip("/").rsplit("/", 1)[-1]] = int(entry.get("size") or 0)
            self._sizes = sizes
        return self._sizes

    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self._listing()))

    def size(self, name: str) -> int:
        if "/" not in name and name in self._listing():
            return self._listing()[name]
        if "/" not in name:
            raise FileNotFoundError(self.url(name))
        info = self._call("a size request", name, lambda: self.fs.info(self._path(name)))
        return int(info["size"])

    def read(self, name: str, start: int, length: int) -> bytes:
        if length == 0:
            return b""
        path = self._path(name)
        data = self._call(f"a ranged read of bytes {start}-{start + length - 1}", name,
                          lambda: self.fs.cat_file(path, start=start, end=start + length, **self.read_options))
        if len(data) != length:
            raise CheckpointError(f"{self.url(name)}: asked for {length} bytes at {start}, got {len(data)}: the object "
                                  "is shorter than its header says (truncated or replaced). Nothing was kept.",
                                  path=self.url(name))
        return data

    def readinto(self, name: str, start: int, view: memoryview) -> None:
        for offset in range(0, len(view), READ_BLOCK):
            n = min(READ_BLOCK, len(view) - offset)
            view[offset:offset + n] = self.read(name, start + offset, n)


class CachedHubStore(Store):
    """A Hub repo at one commit: files already in the local cache are read there, the others in ranged requests."""

    def __init__(self, remote: RemoteStore, repo_id: str, commit: str):
        self.remote, self.repo_id, self.commit = remote, repo_id, commit
        self.location = remote.location
        self._local: dict[str, LocalStore | None] = {}

    @property
    def requests(self) -> int:
        return self.remote.requests

    def url(self, name: str) -> str:
        return self.remote.url(name)

    def _cached(self, name: str) -> LocalStore | None:
        if name not in self._local:
            from huggingface_hub import try_to_load_from_cache

            found = try_to_load_from_cache(self.repo_id, name, revision=self.commit)
            store = None
            if isinstance(found, str):
                snapshot = Path(found).parents[len(PurePosixPath(name).parts) - 1]
                store = LocalStore(snapshot, link_root=snapshot.parents[1], cache_repo=snapshot.parents[1])
            self._local[name] = store
        return self._local[name]

    def names(self) -> tuple[str, ...]:
        return self.remote.names()

    def size(self, name: str) -> int:
        local = self._cached(name)
        return local.size(name) if local is not None else self.remote.size(name)

    def read(self, name: str, start: int, length: int) -> bytes:
        local = self._cached(name)
        return local.read(name, start, length) if local is not None else self.remote.read(name, start, length)

    def readinto(self, name: str, start: int, view: memoryview) -> None:
        local = self._cached(name)
        if local is not None:
            local.readinto(name, start, view)
        else:
            self.remote.readinto(name, start, view)

    def local_path(self, name: str) -> Path | None:
        local = self._cached(name)
        return local.local_path(name) if local is not None else None

    def open(self, name: str):
        local = self._cached(name)
        return local.open(name) if local is not None else RangeFile(self.remote, name)

    def close(self) -> None:
        for store in self._local.values():
            if store is not None:
                store.close()


