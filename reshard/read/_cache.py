"""A cache of `ModelLayout`s, so `write` after `plan` (or a second `plan`) skips importing torch and transformers.

Building a layout means importing transformers and building the model on the meta device: seconds, however small
the checkpoint. The layout depends only on `config.json`, the on-disk tensors' names, dtypes and shapes, the
transformers version and reshard's own code that builds it, so those form the key: any change misses the cache.
The code enters as a digest of the source files, not as the version number, so an upgrade, or an edit in a source
checkout, never serves a layout built by other code. Set `RESHARD_CACHE_DIR` to move it, or to an empty string to
turn it off.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
from pathlib import Path

from .. import __version__
from ._checkpoint import CheckpointIndex
from ..plan import ModelLayout, layout_from_dict, layout_to_dict


# The modules whose code decides what a cached layout holds (reading the index, finding experts, the layout and its
# JSON form, planning on it) and this one, which decides the key.
_LAYOUT_CODE_MODULES = ("read._checkpoint", "read._safetensors_header", "read._quant", "read._experts",
                        "read._key_templates", "read._converter_ops", "plan._layout", "plan._placement", "read._cache")


@functools.lru_cache(maxsize=1)
def code_digest() -> str | None:
    """SHA-256 of the files of `_LAYOUT_CODE_MODULES` as imported (source, or bytecode without it); None when they
    cannot be read, which turns the cache off rather than risk a stale layout."""
    digest = hashlib.sha256()
    try:
        for name in _LAYOUT_CODE_MODULES:
            spec = importlib.util.find_spec(f"reshard.{name}")
            digest.update(spec.loader.get_data(spec.origin))
    except (OSError, AttributeError, ImportError):
        return None
    return digest.hexdigest()


def cache_dir() -> Path | None:
    configured = os.environ.get("RESHARD_CACHE_DIR")
    if configured is not None:
        return Path(configured) if configured else None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "reshard" / "layouts"


def layout_key(index: CheckpointIndex) -> str:
    try:
        transformers_version = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        transformers_version = "none"
    digest = hashlib.sha256()
    digest.update(json.dumps([__version__, code_digest(), transformers_version, index.config],
                             sort_keys=True).encode())
    for name in sorted(index.tensors):
        entry = index.tensors[name]
        digest.update(f"\n{name}\t{entry.dtype}\t{entry.shape}".encode())
    return digest.hexdigest()


def load_layout(index: CheckpointIndex) -> ModelLayout | None:
    folder = cache_dir()
    if folder is None or code_digest() is None:
        return None
    try:
        return layout_from_dict(json.loads((folder / f"{layout_key(index)}.json").read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None  # a miss or a damaged entry: build it again


def save_layout(index: CheckpointIndex, layout: ModelLayout) -> None:
    folder = cache_dir()
    if folder is None or code_digest() is None:
        return
    try:
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{layout_key(index)}.json"
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(layout_to_dict(layout), separators=(",", ":")))
            os.replace(tmp, path)
        except BaseException:  # also Ctrl-C or SIGTERM: leave no temporary file behind
            tmp.unlink(missing_ok=True)
            raise
    except OSError:
        pass  # a read-only home is no reason to fail a plan
