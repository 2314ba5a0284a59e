"""The files of a written folder, opened safely: plain names inside the folder, regular files only.

A link inside the folder may point anywhere (the user's choice); what it names must be a regular file, so a FIFO or
a device swapped in for a shard is refused before a byte is read, and never blocks the open.
"""

from __future__ import annotations

import json
import os
import stat
import zlib
from pathlib import Path

from ..errors import ManifestError, ReshardError
from .format import REMEDY, reject


def plain_name_problem(name) -> str | None:
    """Why `name` is not a plain file name inside a folder (a separator, `.`/`..`, absolute, empty), or None."""
    if not isinstance(name, str) or not name:
        return "a file name must be a non-empty string"
    if "/" in name or "\\" in name or "\0" in name or name in (".", "..") or os.path.isabs(name):
        return "a file name must be a plain name inside the folder (no separator, no `..`, not absolute)"
    return None


def open_member(folder: str | Path, name: str):
    """Open file `name` of `folder` for reading (unbuffered), only if it is a regular file.

    A link inside the folder may point anywhere (the user's choice); what it names must be a regular file. A FIFO,
    a device or a folder is refused before it is opened, and the open itself cannot block (O_NONBLOCK, then fstat:
    a FIFO swapped in after the check is refused too).

    Raises:
        ManifestError: not a plain name, or not a regular file.
        OSError: the file is missing or unreadable.
    """
    if why := plain_name_problem(name):
        reject("a file name", name, why)
    path = Path(folder) / name
    _refuse_irregular(name, os.stat(path).st_mode)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        _refuse_irregular(name, os.fstat(fd).st_mode)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb", buffering=0)
    except BaseException:
        os.close(fd)
        raise


def _refuse_irregular(name: str, mode: int) -> None:
    if not stat.S_ISREG(mode):
        kind = ("a FIFO" if stat.S_ISFIFO(mode) else "a folder" if stat.S_ISDIR(mode)
                else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode)
                else "not a regular file")
        raise ManifestError([f"{name}: {kind}, not a regular file; reshard reads only regular files. {REMEDY}"])


def check_member(folder: str | Path, name: str) -> None:
    """Open and close file `name` of `folder` (`open_member`): a `ManifestError` unless it is a regular file."""
    with open_member(folder, name):
        pass


def member_problem(folder: str | Path, name: str) -> str | None:
    """Why file `name` of `folder` cannot be read as a regular file of the folder (see `open_member`), or None."""
    try:
        check_member(folder, name)
        return None
    except ManifestError as e:
        return "; ".join(e.problems)
    except FileNotFoundError:
        return f"{name} is missing"
    except OSError as e:
        return f"{name} cannot be read ({e.strerror or e})"


def file_crc32(path: str | Path) -> str:
    """CRC-32 of a whole file as the manifest records it (8 hex digits), read through one reused 1 MiB buffer."""
    crc, buffer = 0, bytearray(1 << 20)  # a fresh block per read would cost page faults on every block
    view = memoryview(buffer)
    path = Path(path)
    with open_member(path.parent, path.name) as f:  # a FIFO or a device is never read
        while n := f.readinto(buffer):
            crc = zlib.crc32(view[:n], crc)
    return f"{crc:08x}"


CONFIG_NAME = "config.json"
MAX_CONFIG_BYTES = 64 << 20  # far above any model's config.json; a longer one is not one


def copied_problems(store, copied, *, config: bool = True, all_present: bool = True) -> list[str]:
    """What is wrong with the folder's copied non-weight files (`copied`: config, generation config, tokenizer
    files), read through the folder's store (`reshard.read.store.Store`): each must be a regular file (a link to one
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
            if all_present or (config and name == CONFIG_NAME):
                problems.append(f"{name}: missing, though reshard.json lists it as copied from the source; {fix}")
        except (ReshardError, OSError) as e:
            kind = getattr(e, "kind", None)  # a FIFO, a device: named with this folder's remedy
            problems.append(f"{name}: {kind}, not a regular file; reshard reads only regular files: {fix}" if kind
                            else str(e))
    if not config or any(p.startswith(f"{CONFIG_NAME}:") for p in problems):
        return problems
    if CONFIG_NAME not in copied and not store.exists(CONFIG_NAME):
        return [*problems, f"{CONFIG_NAME}: missing; a load builds the model from it: {fix}"]
    return problems + _config_problems(store, fix)


def _config_problems(store, fix: str) -> list[str]:
    try:
        document = json.loads(store.read_all(CONFIG_NAME, MAX_CONFIG_BYTES, "model config"))
    except ReshardError as e:
        return [f"{CONFIG_NAME}: {e}"]
    except OSError as e:
        return [f"{CONFIG_NAME}: cannot be read ({e.strerror or e}); {fix}"]
    except (ValueError, RecursionError) as e:  # not UTF-8, not JSON, or nested past the parser
        return [f"{CONFIG_NAME}: not valid JSON ({type(e).__name__}: {str(e)[:120]}); {fix}"]
    if not isinstance(document, dict):
        return [f"{CONFIG_NAME}: {type(document).__name__}, not the JSON object of a model config; {fix}"]
    return []
