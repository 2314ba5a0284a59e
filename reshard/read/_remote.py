"""An object store read through fsspec (s3fs for S3; for the Hub, `reshard.read._hub.HubFiles`), as a `Store`.

Each read is one ranged request of at most `READ_BLOCK` bytes; transient failures (5xx, a reset connection, a
timeout) are tried `ATTEMPTS` times with backoff, and the error names the URL and the attempts. The back end's own
retries are turned down to one try, so the bound is this module's: a server that goes away is an error within a
minute. An S3 object is pinned by the ETag its listing gave (`S3Store`: `If-Match` on every read); a Hub file by the
commit id it is read at. `requests` counts what was asked, for the benchmarks and the tests.
"""

from __future__ import annotations

import threading
import time
from abc import abstractmethod
from pathlib import Path, PurePosixPath

from ..errors import CheckpointError, SourceChangedError
from ._range_file import DEPTH, RangeFile
from ._store import READ_BLOCK, LocalStore, Store, changed, check_name

ATTEMPTS = 4  # tries of one remote request before it is an error
BACKOFF_S = 0.5  # the first wait between tries; doubled after each
CONNECT_TIMEOUT_S = 5
READ_TIMEOUT_S = 10  # ATTEMPTS x this + the backoff stays under a minute: a vanished server is an error in time


class ShortAnswer(ConnectionError):
    """A ranged answer with fewer bytes than asked (an honest 206 cut short, a body that ended early): a transient
    fault, tried again; the error after the last try says the server sent fewer bytes than asked."""


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
        "ReadTimeoutError", "ConnectionClosedError", "ConnectError", "ConnectTimeout", "ReadTimeout", "ReadError",
        "RemoteProtocolError")  # the last five: httpx's, under huggingface_hub


class RemoteStore(Store):
    """Files under `base` of an fsspec file system, read in ranged requests.

    Args:
        fs: the file system (`s3fs.S3FileSystem`, `reshard.read._hub.HubFiles`).
        base: the prefix, in the file system's own spelling (`bucket/prefix`, `org/name@commit`).
        location: the URL messages show (`s3://bucket/prefix`).

    A back end says how one ranged request fills a buffer (`_get_into`).
    """

    in_flight = DEPTH  # each request costs a round trip: `read_ranges` keeps this many going

    def __init__(self, fs, base: str, location: str):
        self.fs, self.base, self.location = fs, base.rstrip("/"), location.rstrip("/")
        self.requests = 0
        self.fetched = 0  # bytes of data received (every whole answer), for the per-node report
        self._sizes: dict[str, int] | None = None
        self._tags: dict[str, str | None] = {}  # each object's ETag when listed: every later read requires it
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
            except (FileNotFoundError, SourceChangedError):
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
                    name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
                    sizes[name] = int(entry.get("size") or 0)
                    if entry.get("ETag"):
                        self._tags[name] = entry["ETag"]
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
        if info.get("ETag"):
            self._tags.setdefault(name, info["ETag"])
        return int(info["size"])

    def read(self, name: str, start: int, length: int) -> bytes:
        out = bytearray(length)
        self.readinto(name, start, memoryview(out))
        return bytes(out)

    def readinto(self, name: str, start: int, view: memoryview) -> None:
        """Fill `view` in ranged requests of at most `READ_BLOCK` bytes, each written straight into its part of
        `view` as the answer arrives (where the back end can; else one copy of its `bytes`)."""
        view = memoryview(view).cast("B")
        path = self._path(name)
        for offset in range(0, len(view), READ_BLOCK):
            part = view[offset:offset + READ_BLOCK]
            first = start + offset
            got = self._call(f"a ranged read of bytes {first}-{first + len(part) - 1}", name,
                             lambda: self._whole_answer(name, path, first, part))
            self._check_length(name, first, len(part), got)
            with self._lock:
                self.fetched += got

    def _whole_answer(self, name: str, path: str, start: int, view: memoryview) -> int:
        """One ranged request into `view`; an answer shorter than asked is a transient fault (`ShortAnswer`), tried
        again by `_call` like any other."""
        got = self._get_into(name, path, start, view)
        if got < len(view):
            raise ShortAnswer(f"the server sent {got} of the {len(view)} bytes asked at {start}")
        return got

    def _check_length(self, name: str, start: int, length: int, got: int) -> None:
        if got > length:
            raise CheckpointError(f"{self.url(name)}: asked for {length} bytes at {start}, got {got}: the server "
                                  "sent more than asked (it ignored the Range of the request), so where the bytes "
                                  "belong is unknown. Use a server that honours ranged GETs. Nothing was kept.",
                                  path=self.url(name))

    @abstractmethod
    def _get_into(self, name: str, path: str, start: int, view: memoryview) -> int:
        """Bytes `[start, start + len(view))` of the object at `path` into `view`, in one request; the bytes the
        answer has (more than `len(view)`: a server that ignored the range, whose bytes are not kept)."""


class S3Store(RemoteStore):
    """An S3 prefix: each ranged GET requires the ETag the listing gave (If-Match), so an object overwritten after its
    header was read answers 412 and the read stops; the answer's own ETag and range are checked too (a server that
    ignores If-Match or Range)."""

    def _get_into(self, name: str, path: str, start: int, view: memoryview) -> int:
        from fsspec.asyn import sync

        if name not in self._tags:
            self.size(name)  # the listing's ETag (or the object's, for a name in a sub-folder)
            self._tags.setdefault(name, None)  # a server that gives none: nothing to require
        return sync(self.fs.loop, self._get_object, name, path, start, view)

    async def _get_object(self, name: str, path: str, start: int, view: memoryview) -> int:
        bucket, key, _ = self.fs.split_path(path)
        tag = self._tags.get(name)
        try:
            answer = await self.fs._call_s3("get_object", Bucket=bucket, Key=key,
                                            Range=f"bytes={start}-{start + len(view) - 1}",
                                            **({"IfMatch": tag} if tag else {}))
        except OSError as e:
            if _precondition_failed(e):
                raise changed(self.url(name), f"its ETag is no longer {tag}: the object was overwritten") from e
            raise
        body = answer["Body"]
        try:
            if tag and answer.get("ETag") is not None and _tag_value(answer["ETag"]) != _tag_value(tag):
                raise changed(self.url(name), f"its ETag went from {tag} to {answer['ETag']}: the object was "
                                              "overwritten")
            size = answer.get("ContentLength")
            if size is not None and size > len(view):
                return size  # the wrong length (a server that ignored the Range): said before a byte is read
            done = 0
            while done < len(view):  # the answer's chunks go straight into their place: no joined `bytes`
                got = await body.readinto(view[done:])
                if not got:
                    break
                done += got
        finally:
            body.close()
        if tag and answer.get("ETag") is None:
            await self._confirm_unchanged(name, bucket, key, tag)
        return done

    async def _confirm_unchanged(self, name: str, bucket: str, key: str, tag: str) -> None:
        """An answer without an ETag, from a server whose listing gave one: a HEAD after it says whether the object
        is still the one listed, so bytes read are never trusted on the server's word alone."""
        head = await self.fs._call_s3("head_object", Bucket=bucket, Key=key)
        now = head.get("ETag")
        if now is None:
            raise changed(self.url(name), "the server sends no ETag with its answers or its HEAD, so reshard cannot "
                                          "tell the object is the one it listed; use a server that sends ETags")
        if _tag_value(now) != _tag_value(tag):
            raise changed(self.url(name), f"its ETag went from {tag} to {now}: the object was overwritten")


def _tag_value(tag: str) -> str:
    """An ETag's value: `W/"abc"`, `"abc"` and `abc` are one tag (servers and proxies quote and weaken them)."""
    tag = tag.strip()
    return (tag[2:] if tag[:2] in ("W/", "w/") else tag).strip('"')


def _precondition_failed(error: BaseException) -> bool:
    """Whether s3fs's error is the server's 412: the If-Match ETag is no longer the object's."""
    cause = error.__cause__ if error.__cause__ is not None else error
    response = getattr(cause, "response", None) or {}
    return (response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 412
            or response.get("Error", {}).get("Code") == "PreconditionFailed")


class CachedHubStore(Store):
    """A Hub repo at one commit: files already in the local cache are read there, the others in ranged requests."""

    def __init__(self, remote: RemoteStore, repo_id: str, commit: str):
        self.remote, self.repo_id, self.commit = remote, repo_id, commit
        self.location = remote.location
        self.in_flight = remote.in_flight
        self._local: dict[str, LocalStore | None] = {}

    @property
    def fetched(self) -> int:
        return self.remote.fetched

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
                store = LocalStore(snapshot, cache_repo=snapshot.parents[1])
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

    def descriptor(self, name: str) -> int:
        local = self._cached(name)
        return local.descriptor(name) if local is not None else self.remote.descriptor(name)

    def check_unchanged(self, name: str) -> None:
        local = self._cached(name)
        if local is not None:
            local.check_unchanged(name)

    def open(self, name: str):
        local = self._cached(name)
        return local.open(name) if local is not None else RangeFile(self.remote, name)

    def close(self) -> None:
        for store in self._local.values():
            if store is not None:
                store.close()


