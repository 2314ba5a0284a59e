"""A local Hugging Face Hub for the tests: an HTTP server on 127.0.0.1 speaking the parts of the Hub API that
huggingface_hub uses to read and download a model repo, so the real client runs against it (`HF_ENDPOINT`).

Served:
- `GET /api/models/{repo}` and `/api/models/{repo}/revision/{rev}`: model info with `sha` (the commit) and
  `siblings`;
- `GET /api/models/{repo}/tree/{rev}[/{path}]`: the file listing (`snapshot_download` lists files with it);
- `HEAD` / `GET /{repo}/resolve/{rev}/{path}`: the file, with `ETag` (git blob id, or the SHA-256 for LFS-sized
  files, as the Hub sends), `X-Repo-Commit`, `Content-Length`, `Accept-Ranges`, and `Range: bytes=a-b` (206).

A revision is a branch name or a commit id. Every request is logged (method, path, range, bytes of body sent), and
`fail` makes the next GETs of one file drop the connection halfway through (then answer 500) to test download errors;
`down` answers 500 to every request whose path matches it.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

LFS_THRESHOLD = 10_000  # files this size or larger are served like LFS files (ETag = SHA-256, `lfs` in listings)


@dataclass
class Request:
    method: str
    repo: str
    path: str  # the file path for resolve requests, else the API path
    range: str | None
    sent: int  # bytes of body sent
    token: str | None = None  # the client's `Authorization: Bearer` token: who asked (a node's own HF_TOKEN)


@dataclass
class LocalHub:
    """The repos served and the log of requests. `repos[repo][commit] = {path: bytes}`, `refs[repo][branch] = commit`."""

    repos: dict[str, dict[str, dict[str, bytes]]] = field(default_factory=dict)
    refs: dict[str, dict[str, str]] = field(default_factory=dict)
    log: list[Request] = field(default_factory=list)
    failing: dict[tuple[str, str], str] = field(default_factory=dict)  # (repo, path) -> "drop"
    shorts: dict[tuple[str, str], list[int]] = field(default_factory=dict)  # (repo, path) -> [answers left, bytes]
    url: str = ""
    lock: threading.Lock = field(default_factory=threading.Lock)
    down: str | None = None  # a regex: every request whose path matches it is answered 500 (".": a Hub in an outage)
    # each file's digests, computed once: `id(data) -> (data, {kind: hex})` (the file is held, so its id stays its own)
    digests: dict[int, tuple[bytes, dict[str, str]]] = field(default_factory=dict)

    def digest(self, data: bytes, kind: str) -> str:
        """`kind` "etag" (what `_etag` gives) or "sha1" of `data`, hashed once per file, not once per request: a
        ranged read of a large file must not cost a hash of all of it."""
        with self.lock:
            held = self.digests.get(id(data))
            if held is None or held[0] is not data:
                held = self.digests[id(data)] = (data, {})
        if kind not in held[1]:
            held[1][kind] = _etag(data) if kind == "etag" else hashlib.sha1(data).hexdigest()
        return held[1][kind]

    def add(self, repo: str, files: dict[str, bytes], *, branch: str = "main") -> str:
        """Publish `files` as a new commit of `repo` on `branch`; returns the commit id."""
        commit = hashlib.sha1(json.dumps([repo, branch, sorted((k, hashlib.sha1(v).hexdigest())
                                                              for k, v in files.items())]).encode()).hexdigest()
        self.repos.setdefault(repo, {})[commit] = dict(files)
        self.refs.setdefault(repo, {})[branch] = commit
        return commit

    def add_folder(self, repo: str, folder: Path, *, branch: str = "main", extra: dict[str, bytes] | None = None) -> str:
        files = {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
        return self.add(repo, {**files, **(extra or {})}, branch=branch)

    def fail(self, repo: str, path: str) -> None:
        self.failing[(repo, path)] = "drop"

    def short(self, repo: str, path: str, times: int, by: int) -> None:
        """The next `times` ranged GETs of `path` past its first byte (its data, not the header probe) answer an
        honest 206 `by` bytes short: Content-Length and Content-Range say the shorter length, and that is sent."""
        self.shorts[(repo, path)] = [times, by]

    def heal(self) -> None:
        self.failing.clear()
        self.shorts.clear()

    def served(self, repo: str, path: str) -> list[Request]:
        """The resolve requests for one file (HEAD and GET)."""
        return [r for r in self.log if r.repo == repo and r.path == path]

    def downloaded(self, repo: str) -> set[str]:
        """Files of `repo` whose body was sent, whole or in part."""
        return {r.path for r in self.log if r.repo == repo and r.method == "GET" and r.sent
                and not r.path.startswith("api:")}

    def commit_of(self, repo: str, revision: str) -> str | None:
        commits = self.repos.get(repo, {})
        return revision if revision in commits else self.refs.get(repo, {}).get(revision)


def _etag(data: bytes) -> str:
    if len(data) >= LFS_THRESHOLD:
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # the git blob id


def _handler(hub: LocalHub):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet
            pass

        def _token(self):
            auth = self.headers.get("Authorization") or ""
            return auth[len("Bearer "):] if auth.startswith("Bearer ") else None

        def _json(self, payload, status=200):
            body = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _error(self, status, message, code=None):
            body = json.dumps({"error": message}).encode()
            self.send_response(status)
            if code:
                self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", message)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def do_HEAD(self):
            self._route()

        def do_GET(self):
            self._route()

        def _route(self):
            path = unquote(urlparse(self.path).path)
            if hub.down is not None and re.search(hub.down, path):
                with hub.lock:
                    hub.log.append(Request(self.command, "", path, self.headers.get("Range"), 0, self._token()))
                return self._error(500, "Internal Error")
            api = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/(revision|tree)/([^/]+)(/.*)?)?", path)
            if api:
                return self._api(api.group(1), api.group(2), api.group(3) or "main", (api.group(4) or "").strip("/"))
            resolve = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
            if resolve:
                return self._resolve(*resolve.groups())
            self._error(404, f"no route for {path}")

        def _api(self, repo, kind, revision, sub):
            commit = hub.commit_of(repo, revision)
            with hub.lock:
                hub.log.append(Request(self.command, repo, f"api:{kind or 'info'}:{revision}", None, 0, self._token()))
            if repo not in hub.repos:
                return self._error(404, "Repository not found", "RepoNotFound")
            if commit is None:
                return self._error(404, f"Invalid rev id: {revision}", "RevisionNotFound")
            files = hub.repos[repo][commit]
            if kind == "tree":
                prefix = f"{sub}/" if sub else ""
                entries = []
                for name, data in sorted(files.items()):
                    if not name.startswith(prefix):
                        continue
                    entry = {"type": "file", "oid": hub.digest(data, "etag") if len(data) < LFS_THRESHOLD else
                             hub.digest(data, "sha1"), "size": len(data), "path": name}
                    if len(data) >= LFS_THRESHOLD:
                        entry["lfs"] = {"oid": hub.digest(data, "etag"), "size": len(data), "pointerSize": 134}
                    entries.append(entry)
                return self._json(entries)
            return self._json({"id": repo, "modelId": repo, "sha": commit, "private": False, "disabled": False,
                               "gated": False, "downloads": 0, "likes": 0, "tags": [],
                               "siblings": [{"rfilename": name} for name in sorted(files)]})

        def _resolve(self, repo, revision, name):
            commit = hub.commit_of(repo, revision)
            files = hub.repos.get(repo, {}).get(commit or "", {})
            if name not in files:
                with hub.lock:
                    hub.log.append(Request(self.command, repo, name, self.headers.get("Range"), 0, self._token()))
                return self._error(404, "Entry not found", "EntryNotFound")
            data = files[name]
            start, end, status = 0, len(data) - 1, 200
            wanted = self.headers.get("Range")
            if wanted:
                match = re.fullmatch(r"bytes=(\d+)-(\d*)", wanted.strip())
                start = int(match.group(1))
                end = min(int(match.group(2)) if match.group(2) else len(data) - 1, len(data) - 1)
                status = 206
                short = hub.shorts.get((repo, name)) if self.command == "GET" and start > 0 else None
                if short and short[0] > 0 and end - short[1] >= start:
                    short[0] -= 1
                    end -= short[1]
            failing = self.command == "GET" and hub.failing.get((repo, name))
            if failing == "dropped":  # after the drop, the server errors until healed
                with hub.lock:
                    hub.log.append(Request(self.command, repo, name, wanted, 0, self._token()))
                return self._error(500, "Internal Error")
            body = memoryview(data)[start:end + 1]  # the range itself, sent without a copy of it or of the file
            self.send_response(status)
            self.send_header("ETag", f'"{hub.digest(data, "etag")}"')
            self.send_header("X-Repo-Commit", commit)
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(len(body)))
            if status == 206:
                self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
            self.end_headers()
            sent = 0
            if self.command == "GET":
                if failing == "drop":  # half the body, then the connection goes away
                    body = body[:len(body) // 2]
                    hub.failing[(repo, name)] = "dropped"
                    self.close_connection = True
                self.wfile.write(body)
                sent = len(body)
            with hub.lock:
                hub.log.append(Request(self.command, repo, name, wanted, sent, self._token()))

    return Handler


def start(hub: LocalHub) -> ThreadingHTTPServer:
    """Serve `hub` on 127.0.0.1 (a free port) in a daemon thread; sets `hub.url`. Stop with `server.shutdown()`."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
    server.daemon_threads = True
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server
