"""The Hugging Face Hub as a source: cache snapshots, what of a repo is downloaded, and when it is streamed instead.

A repo's metadata files are always fetched into the cache (kilobytes). Its weights are downloaded too for a write that
does not stream, only the files its index names (`_HUB_IGNORE` keeps out second copies such as `original/`); otherwise
they are read where the cache already has them, or in ranges from the Hub. Offline (`HF_HUB_OFFLINE`) only the cache
is read, and what it lacks is named. `_source` decides that an argument is a repo id; this module serves it.
"""

from __future__ import annotations

import os
import re
from contextlib import contextmanager
from pathlib import Path

from ..errors import CheckpointError
from ._checkpoint import INDEX_NAME, METADATA_PATTERNS
from ._remote import READ_TIMEOUT_S, CachedHubStore, RemoteStore
from ._store import LocalStore, Store

# Hub paths never downloaded: fnmatch's `*` crosses `/`, so `*/*` keeps the download at the top level.
_HUB_IGNORE = ("*/*", "original/*", ".*", "*.pth", "*.pt", "*.bin", "*.gguf", "consolidated.*")


def cache_repo_of(path: Path) -> Path | None:
    """The repo folder (`models--org--name`) when `path` is a snapshot of the Hugging Face cache, else None."""
    path = Path(os.path.abspath(path))
    repo = path.parent.parent
    if path.parent.name == "snapshots" and repo.name.count("--") >= 2 and (repo / "blobs").is_dir():
        return repo
    return None


def hub_store(repo_id: str, revision: str | None, *, stream: bool, data: bool) -> Store:
    """The store of a Hub repo: its metadata files are fetched into the cache (small); the weights are downloaded too
    for a write that does not stream. A `LocalStore` of the cache snapshot, unless a plan or a streaming write finds
    the weights not cached: then a store reading headers and data in ranges (cached files locally).

    Raises:
        CheckpointError: the repo cannot be fetched, or is not cached while offline (`HF_HUB_OFFLINE`).
    """
    root = _snapshot(repo_id, revision, allow=list(METADATA_PATTERNS))
    commit = root.name if root.parent.name == "snapshots" else revision
    if data and not stream:
        root = _snapshot(repo_id, commit, allow=[*METADATA_PATTERNS, *_hub_weight_names(root)], weights=True)
    offline = _offline()
    if data and not stream or (offline or not stream) and _weights_cached(root, some=offline):
        # offline the cache is all there is, streaming or not: reading the snapshot names what it lacks
        repo = cache_repo_of(root)
        return LocalStore(root, cache_repo=repo) if repo else LocalStore(root)
    commit = commit or revision or "main"
    return CachedHubStore(_HubStore(HubFiles(repo_id, commit), HubFiles.base(repo_id, commit), f"hf://{repo_id}"),
                          repo_id, commit)


class HubFiles:
    """The calls a `RemoteStore` of the Hub makes (`ls`, `info`, `cat_into`), for a Hub repo at one commit, each one
    HTTP request: huggingface_hub's `HfFileSystem` retries 5 times with backoff inside each of reshard's attempts
    (measured with a Hub answering 500: 98 s and 40 log lines before the error), so reshard's bound and its silence
    hold only with reshard's own retries. Reading at a commit id, never a branch, the bytes cannot change under a
    read."""

    def __init__(self, repo_id: str, commit: str):
        self.repo_id, self.commit = repo_id, commit

    @staticmethod
    def base(repo_id: str, commit: str) -> str:
        return f"{repo_id}@{commit}"

    @contextmanager
    def _answer(self, url: str, *, method: str = "GET", headers: dict | None = None, params: dict | None = None):
        """One request, its answer streamed: the status checked (a 404 is `FileNotFoundError`), the body not read."""
        from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

        with get_session().stream(method, url, headers={**build_hf_headers(), **(headers or {})}, params=params,
                                  follow_redirects=True, timeout=READ_TIMEOUT_S) as response:
            if response.status_code >= 400:
                response.read()  # the error's body, for its message
                if response.status_code == 404:
                    raise FileNotFoundError(url)
                hf_raise_for_status(response)
            yield response

    def _name(self, path: str) -> str:
        return path[len(self.base(self.repo_id, self.commit)) + 1:]

    def _url(self, path: str) -> str:
        from huggingface_hub import hf_hub_url

        return hf_hub_url(self.repo_id, self._name(path), revision=self.commit)

    def ls(self, path: str, detail: bool = True, refresh: bool = True) -> list[dict]:
        from huggingface_hub import constants

        url = f"{constants.ENDPOINT}/api/models/{self.repo_id}/tree/{self.commit}"
        found, params = [], {"recursive": "false", "expand": "false"}
        while url:
            with self._answer(url, params=params) as response:
                response.read()
            found += [{"name": f"{path}/{entry['path']}", "type": entry.get("type"), "size": entry.get("size")}
                      for entry in response.json()  # the top level only, whatever the server sends
                      if isinstance(entry, dict) and "/" not in str(entry.get("path", "/"))]
            url, params = response.links.get("next", {}).get("url"), None
        return found

    def info(self, path: str) -> dict:
        with self._answer(self._url(path), method="HEAD") as response:
            pass
        size = response.headers.get("X-Linked-Size") or response.headers.get("Content-Length")
        return {"name": path, "type": "file", "size": int(size or 0)}

    def cat_into(self, path: str, start: int, view: memoryview) -> int:
        """Bytes `[start, start + len(view))` of `path` into `view` as the answer's body arrives, in one ranged
        request (no body joined into `bytes` first); the bytes the answer has (more than `len(view)`: a server that
        ignored the range, whose body is not read past the view)."""
        with self._answer(self._url(path), headers={"Range": f"bytes={start}-{start + len(view) - 1}"}) as response:
            got = 0
            for chunk in response.iter_bytes():
                if got + len(chunk) > len(view):
                    return got + len(chunk)
                view[got:got + len(chunk)] = chunk
                got += len(chunk)
            return got


class _HubStore(RemoteStore):
    """A Hub repo at one commit (`HubFiles`): each ranged answer's body goes straight into the reader's buffer."""

    def _get_into(self, name: str, path: str, start: int, view: memoryview) -> int:
        return self.fs.cat_into(path, start, view)


def _offline() -> bool:
    """HF_HUB_OFFLINE is set: only the local cache can be read (what it lacks is then named, not fetched)."""
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def _snapshot(repo_id: str, revision: str | None, *, allow: list[str], weights: bool = False) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    offline = _offline()
    ignore = ([p for p in _HUB_IGNORE if p != "*/*" or not any("/" in w for w in allow)] if weights
              else list(_HUB_IGNORE))
    try:
        root = Path(snapshot_download(repo_id, revision=revision, allow_patterns=allow, ignore_patterns=ignore))
    except (LocalEntryNotFoundError, FileNotFoundError) as e:
        # huggingface_hub refuses a partly cached snapshot the same way as a missing one
        hint = ("HF_HUB_OFFLINE is set and the repo is not in the local cache (or only some of the files it needs are)"
                if offline else "it could not be reached and is not in the local cache")
        raise CheckpointError(f"{repo_id}: no local folder of that name, and as a Hub repo id {hint}. Check the "
                              f"path, download it once with network access (`hf download {repo_id}`), or pass a "
                              "local folder.", path=repo_id) from e
    except (RepositoryNotFoundError, HfHubHTTPError, OSError) as e:
        raise CheckpointError(f"{repo_id}: cannot fetch from the Hub ({e}). Check the repo id and --revision, "
                              "or pass a local folder.", path=repo_id) from e
    if weights and not any(p.suffix == ".safetensors" for p in root.iterdir()):
        why = ("HF_HUB_OFFLINE is set, so only what is already cached can be used" if offline
               else "the repo may hold no safetensors weights")
        raise CheckpointError(f"{repo_id}: the snapshot at {root} holds no .safetensors files ({why}). Download "
                              f"them with `hf download {repo_id}`, or pass a local folder.", path=repo_id)
    return root


def _weights_cached(root: Path, *, some: bool = False) -> bool:
    """Whether a snapshot already holds every weight file its index names (or, without one, any `*.safetensors`);
    with `some`, any of them (offline, the snapshot is all there is: reading it names what is missing)."""
    import json

    if not (root / INDEX_NAME).is_file():
        return any(p.suffix == ".safetensors" for p in root.iterdir())
    try:
        names = set(json.loads((root / INDEX_NAME).read_text())["weight_map"].values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return True  # an invalid index: reading the snapshot reports it
    found = [isinstance(n, str) and (root / n).exists() for n in names]
    return any(found) if some else all(found)


def _hub_weight_names(root: Path) -> list[str]:
    """The weight files a Hub snapshot needs, as exact download patterns: those its index names, or the top-level
    `*.safetensors` without one. An invalid index yields no names; reading the snapshot then reports it."""
    import json

    if not (root / INDEX_NAME).exists():
        return ["*.safetensors"]
    try:
        weight_map = json.loads((root / INDEX_NAME).read_text())["weight_map"]
        names = {name for name in weight_map.values() if isinstance(name, str)}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []
    return sorted(re.sub(r"([*?[])", r"[\1]", name) for name in names)
