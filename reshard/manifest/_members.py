"""The files of a written folder: plain names inside the folder, and the copied non-weight files read through the
folder's store (`reshard.read._store`, which opens regular files only: a FIFO or a device swapped in is refused before
a byte is read, and never blocks the open).
"""

from __future__ import annotations

import json
import os

from ..errors import ReshardError


def plain_name_problem(name) -> str | None:
    """Why `name` is not a plain file name inside a folder (a separator, `.`/`..`, absolute, empty), or None."""
    if not isinstance(name, str) or not name:
        return "a file name must be a non-empty string"
    if "/" in name or "\\" in name or "\0" in name or name in (".", "..") or os.path.isabs(name):
        return "a file name must be a plain name inside the folder (no separator, no `..`, not absolute)"
    return None


_CONFIG_NAME = "config.json"
_MAX_CONFIG_BYTES = 64 << 20  # far above any model's config.json; a longer one is not one


def copied_problems(store, copied, *, config: bool = True, all_present: bool = True) -> list[str]:
    """What is wrong with the folder's copied non-weight files (`copied`: config, generation config, tokenizer
    files), read through the folder's store (`reshard.read.Store`): each must be a regular file (a link to one
    is fine; a FIFO, a device or a folder is refused without blocking) and, with `all_present` (verify), there;
    `config.json`, which a load builds the model from, must be there and parse as a JSON object (`config` False: the
    caller brings its own config). Each problem says what to do."""
    fix = "copy it from the source checkpoint, or write the folder again with `reshard write`"
    problems, missing = [], set()
    for name in copied:
        try:
            store.size(name)
        except FileNotFoundError:
            missing.add(name)
            if all_present or (config and name == _CONFIG_NAME):
                problems.append(f"{name}: missing, though reshard.json lists it as copied from the source; {fix}")
        except (ReshardError, OSError) as e:
            kind = getattr(e, "kind", None)  # a FIFO, a device: named with this folder's remedy
            problems.append(f"{name}: {kind}, not a regular file; reshard reads only regular files: {fix}" if kind
                            else str(e))
    if not config or any(p.startswith(f"{_CONFIG_NAME}:") for p in problems):
        return problems
    if _CONFIG_NAME not in copied and not store.exists(_CONFIG_NAME):
        return [*problems, f"{_CONFIG_NAME}: missing; a load builds the model from it: {fix}"]
    return problems + _config_problems(store, fix)


def _config_problems(store, fix: str) -> list[str]:
    try:
        document = json.loads(store.read_all(_CONFIG_NAME, _MAX_CONFIG_BYTES, "model config"))
    except ReshardError as e:
        return [f"{_CONFIG_NAME}: {e}"]
    except OSError as e:
        return [f"{_CONFIG_NAME}: cannot be read ({e.strerror or e}); {fix}"]
    except (ValueError, RecursionError) as e:  # not UTF-8, not JSON, or nested past the parser
        return [f"{_CONFIG_NAME}: not valid JSON ({type(e).__name__}: {str(e)[:120]}); {fix}"]
    if not isinstance(document, dict):
        return [f"{_CONFIG_NAME}: {type(document).__name__}, not the JSON object of a model config; {fix}"]
    return []
