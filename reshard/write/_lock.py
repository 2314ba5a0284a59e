"""One write at a time to OUT: the lock file beside it, `.OUT.reshard-lock`.

The lock is a `flock` on that file, so the kernel releases it when its holder dies, on any host of a shared file
system where a pid check could not tell whether a writer still lives. Holding it is what lets the staged output
(`reshard.write._staged`) remove the temporaries of earlier writes: their writers are gone. The file holds the
holder's "host pid", so a refused writer names who holds it.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
from contextlib import contextmanager
from pathlib import Path

from ..errors import OutputError

_LOCK_MARK = ".reshard-lock"  # `.OUT.reshard-lock`: held (flock) by the one write to OUT, holds "host pid"


def _open_lock(path: Path, out: Path) -> int:
    """The locked fd of `path`, once it is the file at `path` (its last holder may remove it meanwhile)."""
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise OutputError(f"{path}: cannot create the write lock beside {out.name} ({e.strerror or e}); "
                              "choose a folder you can write to.") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = os.pread(fd, 200, 0).decode(errors="replace").split()
            os.close(fd)
            if e.errno not in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES):
                raise OutputError(f"{path}: cannot lock it ({e.strerror or e}); this file system does not support "
                                  "file locks. Write to another one.") from e
            who = f" (host {holder[0]}, pid {holder[1]})" if len(holder) == 2 else ""
            raise OutputError(f"another reshard write{who} is writing {out}; wait for it to finish, or stop it, "
                              "then run this again. Nothing was changed.") from e
        try:
            if os.path.samestat(os.fstat(fd), os.stat(path)):
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


@contextmanager
def write_lock(out: Path):
    """Hold `.OUT.reshard-lock` (flock, released by the kernel when the process dies) for the whole write.

    Raises:
        OutputError: another write to `out` holds it (naming its host and pid), or no lock can be taken there.
    """
    path = out.parent / f".{out.name}{_LOCK_MARK}"
    fd = _open_lock(path, out)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{socket.gethostname()} {os.getpid()}\n".encode(), 0)
        yield
    finally:
        try:
            os.unlink(path)  # still locked: a writer that opened it meanwhile sees it gone and retries
        except OSError:
            pass
        os.close(fd)
