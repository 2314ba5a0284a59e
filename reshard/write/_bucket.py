"""A bucket prefix (`s3://bucket/prefix`) as the output of `write` and `merge`: its requests and uploads (the steps
of an output are `reshard.write._bucket_output.BucketOutput`).

A folder is filled out of sight in a temporary folder and swapped in at once (`reshard.write._staged`). A bucket has
no rename, so here the temporary is the set of open multipart uploads, and the swap is completing them, then writing
the commit marker last (`reshard.json` for a write; `config.json` and the index for a merge): a reader treats a
prefix without it as unfinished. Each output file is written by the one path every file takes
(`reshard.write._files`), into a local spool folder, and, once whole, sent as one multipart upload in parts of
`PART_BYTES`, `PARTS_IN_FLIGHT` at once, while the next file is filled; its spool copy is then removed. So the local
disk holds at most the file being filled and `_FILES_QUEUED` + 1 being sent, and memory the parts in flight.

Every request is retried `ATTEMPTS` times on a transient error (a 5xx, a reset, a timeout), then its error names the
URL, the part and the attempts. A failure or an interruption aborts every upload started and removes every object
this write completed; an `--overwrite` keeps the old checkpoint whole until every part is sent, then removes its
markers before any new object appears, so a reader never sees old metadata over new files (`reshard.write._claim`).
Requests go through s3fs (botocore), with the AWS environment's endpoint and credentials.
"""

from __future__ import annotations

import asyncio
import collections
import errno
import os
import shutil
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from pathlib import Path

from ..errors import OutputError, UsageError
from ..manifest import MANIFEST_NAME
from ..read import ATTEMPTS, BACKOFF_S, INDEX_NAME, READ_TIMEOUT_S, transient
from ..words import plural
from ._claim import CLAIM_NAME, claim_problem
from ._replaceable import ReplaceRule

# S3 takes 5 MiB to 5 GiB; 16 MiB x PARTS_IN_FLIGHT is the memory parts in flight hold. RESHARD_S3_PART_MIB sets
# another (`configured_part_bytes`): smaller parts spread a merge across nodes more evenly (`reshard.write._spread`)
PART_MIB_VARIABLE = "RESHARD_S3_PART_MIB"
_DEFAULT_PART_MIB, _LEAST_PART_MIB, _MOST_PART_MIB = 16, 5, 5 << 10
PART_BYTES: int | None = None  # a part size set in code (the tests'); None: RESHARD_S3_PART_MIB, or 16 MiB
_MAX_PARTS = 10_000  # S3's limit per upload: a larger file gets larger parts
PARTS_IN_FLIGHT = 4
_FILES_QUEUED = 1  # whole files waiting in the spool while the next is filled
MARKERS = (MANIFEST_NAME, INDEX_NAME, "config.json")  # what tells a reader a prefix holds a checkpoint
PROBE = ".reshard-write-check"  # the key a write-permission check opens (and aborts) an upload for
# A request gets READ_TIMEOUT_S plus its body at this rate, then it is given up and tried again: botocore's timeouts
# cover connecting and reading the answer, not a server that stops reading a body it was sent
_SLOWEST_UPLOAD = 1 << 20  # bytes per second


def configured_part_bytes() -> int:
    """The part size asked for: `PART_BYTES`, or `RESHARD_S3_PART_MIB` (a whole number of MiB, 5 to 5120: what S3
    takes), or 16 MiB; read when a bucket is written, so a bad value fails that command alone, before any request.

    Raises:
        UsageError: the variable is not a whole number within S3's limits (nothing is clamped).
    """
    if PART_BYTES is not None:
        return PART_BYTES
    text = os.environ.get(PART_MIB_VARIABLE, "").strip()
    if not text:
        return _DEFAULT_PART_MIB << 20
    try:
        mib = int(text, 10)
    except ValueError:
        mib = None
    if mib is None or not _LEAST_PART_MIB <= mib <= _MOST_PART_MIB:
        raise UsageError(f"{PART_MIB_VARIABLE}={text!r}: the S3 part size is a whole number of MiB from "
                         f"{_LEAST_PART_MIB} to {_MOST_PART_MIB} (S3 takes parts of 5 MiB to 5 GiB); unset, it is "
                         f"{_DEFAULT_PART_MIB}. Set it within that range or unset it. Nothing was read or written.")
    return mib << 20


def part_bytes(size: int) -> int:
    """The part size for a file of `size` bytes: `configured_part_bytes()`, or larger (MiB-aligned) to stay within
    `_MAX_PARTS`."""
    least = -(-size // _MAX_PARTS)
    return max(configured_part_bytes(), -(-least // (1 << 20)) << 20)


def _retried(error: BaseException) -> bool:
    """Whether a failed request is tried again: a transient failure (`reshard.read.transient`), but not an
    answer s3fs turned into an `OSError` with a code (EINVAL: a part too small, an upload unknown; EACCES)."""
    if type(error) is OSError and error.errno in (errno.EINVAL, errno.EACCES, errno.EPERM, errno.ENOENT):
        return False
    return transient(error)


class Bucket:
    """A bucket prefix, through s3fs: the requests an output makes, each with the bounded retries."""

    def __init__(self, url: str):
        try:
            import s3fs
        except ImportError as e:
            raise UsageError(f"{url}: writing to s3:// needs the s3 extra: `pip install 'reshard[s3]'` (s3fs). "
                             "Nothing was read or written.") from e
        from ..read import s3_filesystem, s3_prefix

        # spelled as a source is (`reshard.read.s3_prefix`): `s3://b//rs/` is `s3://b/rs`, here and in every message
        self.name, self.prefix = s3_prefix(url)
        self.url = f"s3://{self.name}/{self.prefix}"
        configured_part_bytes()  # a bad RESHARD_S3_PART_MIB is refused before any request
        if not self.name or not self.prefix:
            raise UsageError(f"{url}: an output in a bucket is a prefix, s3://bucket/prefix, not a whole bucket. "
                             "Nothing was read or written.")
        self.fs = s3_filesystem(s3fs)
        self.stop = threading.Event()  # set when the output is discarded: no more retries
        self._lock = threading.Lock()
        self._in_flight: dict[Future, str] = {}  # the requests under way, and their operations (`cancel`)

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}"

    def where(self, name: str) -> str:
        return f"{self.url}/{name}"

    def call(self, what: str, name: str | None, operation: str, *, attempts: int = ATTEMPTS, on_answer=None,
             **params):
        """`operation` (a botocore S3 call) with `params`, tried up to `attempts` times while it fails transiently.
        `on_answer(answer)` is called as the answer arrives, even when the caller was interrupted while it waited: an
        upload opened or an object written then is still known to the clean-up.

        Raises:
            OutputError: it failed; the message names the URL, what was asked and the attempts.
        """
        delay, last, attempt = BACKOFF_S, None, 0
        for attempt in range(1, attempts + 1):
            try:
                return self._request(operation, params, on_answer)
            except Exception as e:  # noqa: BLE001  botocore and s3fs raise many unrelated types
                last = e
                if not _retried(e) or attempt == attempts or self.stop.is_set():
                    break
                time.sleep(delay)
                delay *= 2
        where = self.where(name) if name is not None else self.url
        raise OutputError(f"{where}: {what} failed after {plural(attempt, 'attempt')} ({type(last).__name__}: "
                          f"{str(last)[:300]}). Check the endpoint, the credentials, the bucket's permissions and the "
                          "network, then run the command again.") from last

    def _request(self, operation: str, params: dict, on_answer):
        """One try of `operation` on s3fs's event loop, given up (`TimeoutError`, tried again) after its deadline, or
        ended by `cancel`."""
        body = params.get("Body")
        seconds = READ_TIMEOUT_S + (len(body) if body is not None else 0) / _SLOWEST_UPLOAD
        request = asyncio.run_coroutine_threadsafe(self.fs._call_s3(operation, Bucket=self.name, **params),
                                                   self.fs.loop)
        with self._lock:
            self._in_flight[request] = operation
        request.add_done_callback(self._landed)
        if on_answer is not None:
            request.add_done_callback(lambda r: r.cancelled() or r.exception() is not None or on_answer(r.result()))
        try:
            return request.result(timeout=seconds)
        except FutureTimeout:
            request.cancel()
            raise TimeoutError(f"no answer within {seconds:.0f} s") from None

    def _landed(self, request: Future) -> None:
        with self._lock:
            self._in_flight.pop(request, None)

    def cancel(self) -> None:
        """Stop retrying; end the parts under way (a part the server holds must not keep an interrupted write
        waiting), and wait up to `READ_TIMEOUT_S` for the other requests under way, whose answers (an upload opened,
        an object written) the clean-up needs."""
        self.stop.set()
        with self._lock:
            in_flight = dict(self._in_flight)
        for request, operation in in_flight.items():
            if operation == "upload_part":
                request.cancel()
        wait([r for r, operation in in_flight.items() if operation != "upload_part"], timeout=READ_TIMEOUT_S)

    def names(self) -> dict[str, int]:
        """The objects directly under the prefix: name -> size."""
        return self.listing()[0]

    def listing(self) -> tuple[dict[str, int], list[str]]:
        """The objects directly under the prefix (name -> size), and its sub-prefixes (`name/`)."""
        found, below, token = {}, [], None
        while True:
            more = {"ContinuationToken": token} if token else {}
            page = self.call("listing the prefix", None, "list_objects_v2", Prefix=self.prefix + "/", Delimiter="/",
                             **more)
            for entry in page.get("Contents", []):
                found[entry["Key"][len(self.prefix) + 1:]] = int(entry["Size"])
            below += [p["Prefix"][len(self.prefix) + 1:] for p in page.get("CommonPrefixes", [])]
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return found, below

    def left_uploads(self) -> list[tuple[str, str]]:
        """The multipart uploads open directly under the prefix: (name, upload id)."""
        found, more = [], {}
        while True:
            page = self.call("listing the open uploads", None, "list_multipart_uploads", Prefix=self.prefix + "/",
                             **more)
            found += [(u["Key"][len(self.prefix) + 1:], u["UploadId"]) for u in page.get("Uploads", [])
                      if "/" not in u["Key"][len(self.prefix) + 1:]]
            if not page.get("IsTruncated"):
                return found
            more = {"KeyMarker": page.get("NextKeyMarker"), "UploadIdMarker": page.get("NextUploadIdMarker")}

    def store(self):
        """The prefix as a source store (`reshard.read.S3Store`): what a rule reads of the output there."""
        from ..read import S3Store

        return S3Store(self.fs, f"{self.name}/{self.prefix}", self.url)

    def check_writable(self) -> None:
        """Refuse missing credentials, a missing bucket and a prefix this client may not write, before anything is
        read: the bucket is asked for, and an upload is opened under the prefix and aborted at once."""
        nothing = "Nothing was read or written."
        try:
            self.call("checking the bucket", None, "head_bucket")
            opened = self.call("checking that the prefix may be written", PROBE, "create_multipart_upload",
                               Key=self.key(PROBE))
            self.call("checking that the prefix may be written", PROBE, "abort_multipart_upload", Key=self.key(PROBE),
                      UploadId=opened["UploadId"])
        except OutputError as e:
            cause = e.__cause__
            kind = type(cause).__name__
            if kind in ("NoCredentialsError", "PartialCredentialsError"):
                raise OutputError(f"{self.url}: no AWS credentials were found. Set AWS_ACCESS_KEY_ID and "
                                  f"AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), then run the command again. {nothing}"
                                  ) from cause
            if isinstance(cause, FileNotFoundError):
                raise OutputError(f"{self.url}: the bucket {self.name} does not exist at "
                                  f"{self.fs.client_kwargs.get('endpoint_url') or 'the AWS endpoint'}. Create it, or "
                                  f"check the URL and AWS_ENDPOINT_URL_S3. {nothing}") from cause
            if isinstance(cause, PermissionError):
                raise OutputError(f"{self.url}: this client may not write under the prefix (access denied). Use "
                                  f"credentials that may, or another prefix. {nothing}") from cause
            raise OutputError(f"{e} {nothing}") from cause


def refuse_occupied(bucket: Bucket, existing: dict[str, int], overwrite: bool, rule: ReplaceRule,
                    below: list[str] = ()) -> None:
    """Refuse a prefix that holds objects, unless `overwrite` and it holds exactly an output `rule` allows: the
    objects its manifest or merge index claims, and no other object and no sub-prefix (named in the message)."""
    if not existing and not below:
        return
    if not overwrite:
        interrupted = (f" and the record of an interrupted --overwrite ({CLAIM_NAME}), which --overwrite completes"
                       if CLAIM_NAME in existing else "")
        raise OutputError(f"{bucket.url} already holds {plural(len(existing) + len(below), 'object')}{interrupted}. "
                          f"Pass --overwrite to replace it (only {rule.replaceable} is replaced), or choose another "
                          "prefix. Nothing was read or written.")
    entries = {**{name: True for name in existing}, **{name: False for name in below}}
    # an interrupted --overwrite left its record: what it names is reshard's to replace, so the rerun completes it
    why = (claim_problem if CLAIM_NAME in existing else rule.problem)(bucket.store(), entries)
    if why is not None:
        raise OutputError(f"{bucket.url}: --overwrite replaces only {rule.replaceable}, and {why}. Nothing was "
                          "changed. Move or remove those objects yourself, or choose another prefix.")


class Uploads:
    """One process's uploads into a bucket output: a local spool folder whose whole files are sent at once, as
    multipart uploads left open. Each rank of a torchrun write has its own and hands its `records` to rank 0, which
    completes them (`BucketOutput.adopt`)."""

    def __init__(self, bucket: Bucket):
        self.bucket = bucket
        self.spool: Path | None = None
        self.open: dict[str, str] = {}  # name -> upload id
        self.parts: dict[str, list[dict]] = {}  # name -> its parts' numbers and ETags
        self.sending: collections.deque = collections.deque()
        self.file_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reshard-upload")
        self.part_pool = ThreadPoolExecutor(max_workers=PARTS_IN_FLIGHT, thread_name_prefix="reshard-part")
        self.lock = threading.Lock()

    @contextmanager
    def spooling(self):
        """The spool folder, whose files the writer hands to `send_later` once whole; removed after."""
        self.spool = Path(tempfile.mkdtemp(prefix="reshard-upload-"))
        try:
            yield self.spool
        finally:
            shutil.rmtree(self.spool, ignore_errors=True)

    def send_later(self, path: Path) -> None:
        """Send the whole file `path` in the background; wait first while `_FILES_QUEUED` others wait in the spool."""
        while len(self.sending) > _FILES_QUEUED:
            self.sending.popleft().result()
        upload = self.open_upload(path.name)
        self.sending.append(self.file_pool.submit(self.send, path, upload))

    def wait(self) -> dict[str, tuple[str, list[dict]]]:
        """Wait until every file handed over is sent; its `(upload id, parts)` by name (the uploads stay open)."""
        while self.sending:
            self.sending.popleft().result()
        with self.lock:
            return {name: (upload, list(self.parts.get(name, []))) for name, upload in self.open.items()}

    def open_upload(self, name: str) -> str:
        def opened(answer) -> None:
            with self.lock:
                self.open[name] = answer["UploadId"]

        return self.bucket.call("starting the upload", name, "create_multipart_upload", on_answer=opened,
                                Key=self.bucket.key(name))["UploadId"]

    def send(self, path: Path, upload: str) -> None:
        """Send `path` as the parts of the open `upload`, `PARTS_IN_FLIGHT` at once, then remove it."""
        size = path.stat().st_size
        step = part_bytes(size)
        count = max(1, -(-size // step))
        in_flight: collections.deque = collections.deque()
        fd = os.open(path, os.O_RDONLY)
        try:
            for number in range(1, count + 1):
                if self.bucket.stop.is_set():
                    return
                start = (number - 1) * step
                data = os.pread(fd, min(step, size - start), start)
                in_flight.append(self.part_pool.submit(self.send_part, path.name, upload, number, count, start, data))
                if len(in_flight) >= PARTS_IN_FLIGHT:
                    in_flight.popleft().result()
            while in_flight:
                in_flight.popleft().result()
        finally:
            for future in in_flight:
                future.cancel()
            os.close(fd)
        path.unlink()

    def send_part(self, name: str, upload: str, number: int, count: int, start: int, data: bytes) -> None:
        what = f"uploading part {number} of {count} (bytes {start}-{start + len(data) - 1})"
        answer = self.bucket.call(what, name, "upload_part", Key=self.bucket.key(name), UploadId=upload,
                                  PartNumber=number, Body=data)
        with self.lock:
            self.parts.setdefault(name, []).append({"PartNumber": number, "ETag": answer["ETag"]})

    def abort(self, *, interrupted: bool = False) -> tuple[dict[str, str], list[str]]:
        """Stop sending and abort every open upload (interrupted: one try each); (the uploads, those not aborted)."""
        self.bucket.cancel()  # a file being sent stops at its next part; the parts under way end, and none is retried
        self.file_pool.shutdown(wait=True, cancel_futures=True)
        self.part_pool.shutdown(wait=True, cancel_futures=True)  # a part sent after its abort could bring it back
        with self.lock:
            uploads, self.open = dict(self.open), {}
        failed = []
        for name, upload in uploads.items():
            try:
                self.bucket.call("aborting the upload", name, "abort_multipart_upload", Key=self.bucket.key(name),
                                 attempts=1 if interrupted else ATTEMPTS, UploadId=upload)
            except OutputError:
                failed.append(name)
        return uploads, failed

    def close(self) -> None:
        self.file_pool.shutdown(wait=False, cancel_futures=True)
        self.part_pool.shutdown(wait=False, cancel_futures=True)
