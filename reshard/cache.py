"""A cache of `ModelLayout`s, so `write` after `plan` (or a second `plan`) skips importing torch and transformers.

Building a layout means importing transformers and building the model on the meta device: seconds, however small
the checkpoint. The layout depends only on `config.json`, the on-disk tensors' names, dtypes and shapes, and the
transformers and reshard versions, so those form the key: any change misses the cache. Set `RESHARD_CACHE_DIR` to
move it, or to an empty string to turn it off.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
from pathlib import Path

from . import __version__
from .checkpoint import CheckpointIndex
from .layout import ModelLayout, layout_from_dict, layout_to_dict


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
    digest.update(json.dumps([__version__, transformers_version, index.config], sort_keys=True).encode())
    for name in sorted(index.tensors):
        entry = index.tensors[name]
        digest.update(f"\n{name}\t{entry.dtype}\t{entry.shape}".encode())
    return digest.hexdigest()


def load_layout(index: CheckpointIndex) -> ModelLayout | None:
    folder = cache_dir()
    if folder is None:
        return None
    try:
        return layout_from_dict(json.loads((folder / f"{layout_key(index)}.json").read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None  # a miss or a damaged entry: build it again


def save_layout(index: CheckpointIndex, layout: ModelLayout) -> None:
    folder = cache_dir()
    if folder is None:
        return
    try:
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{layout_key(index)}.json"
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(layout_to_dict(layout), separators=(",", ":")))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home is no reason to fail a plan
