"""One staged output: how every writer claims OUT, fills it out of sight, and puts it in place at once.

`write`, `merge` and rank 0 of a distributed write (of either) go through `StagedOutput`, so the rules are the same
for all: OUT must not be or hold the source; an existing OUT is replaced only with `--overwrite` and only when it is
empty or a complete output of that command; one write at a time holds a lock beside OUT; the temporaries of a killed
write are cleaned under that lock; the free space is checked before any byte is written. Files are written into a
temporary folder beside OUT, fsynced, and the folder is swapped in by an atomic exchange, so OUT is the whole old or
the whole new folder at every instant; any failure or interruption removes the temporary folder.

The lock itself is `reshard.write._lock`; the fsync and the exchange, with their Linux calls, `reshard.write._durable`.
"""

from __future__ import annotations

import errno
import glob
import os
import shutil
import time
from contextlib import contextmanager
from pathlib import Path

from ..errors import OutputError, ReshardError, UsageError
from ..plan import human_bytes
from ..read import S3_SCHEMES, refuse_overlap
from ..signals import signals_held
from ._durable import exchange, fsync_files, fsync_path
from ._lock import write_lock
from ._replaceable import RESHARD_OUTPUT, RULES, ReplaceRule

INTERRUPT_CLEANUP_S = 1.0  # an interrupted write removes its temporary folder this long at most, then exits
_TMP_MARK = ".reshard-tmp-"  # `.OUT.reshard-tmp-PID`: a write in progress; `...-old-PID`: an OUT being swapped out



# ---- what may be replaced (`reshard.write._replaceable`) -----------------------------------------------------

def _check_replaceable(out: Path, overwrite: bool, rule: ReplaceRule = RESHARD_OUTPUT) -> None:
    """Refuse an existing `out` unless `overwrite` and it is an empty folder or what `rule` allows."""
    if not overwrite:
        raise OutputError(f"{out} already exists. Pass --overwrite to replace it (only an empty folder or "
                          f"{rule.replaceable} is replaced), or choose another folder.")
    why = rule.why_not(out)
    if why is not None:
        raise OutputError(f"{out}: --overwrite replaces only an empty folder or {rule.replaceable}, and {why}. "
                          "Nothing was changed. Move what is there yourself, or choose another output folder.")


# ---- the staged output -------------------------------------------------------------------------------------------

class StagedOutput:
    """OUT as one writer claims, fills and completes it.

    Constructed before the lock: OUT is resolved, refused when it is or holds one of `sources` or may not be
    replaced, and its parent is created. Then, under `locked()`: `claim(needed)` cleans stale temporaries, checks OUT
    again and the free space, and names the temporary folder `tmp`; `filling()` creates it and discards it on any
    failure; `complete()` fsyncs it and swaps it in as OUT.

    Args:
        out: the output folder.
        overwrite: whether an existing OUT may be replaced (by `rule`).
        sources: `(name, place)` of the source folder and files (OUT must be none of them, be inside none, nor hold
            one: `reshard.read.refuse_overlap`).
        rule: which existing OUT may be replaced.
        what: OUT's name in messages (`OUT`, `DEST`).
    """

    on_file = None  # files stay in `tmp` until `complete()` (a bucket output sends each once whole)

    def __init__(self, out, overwrite: bool, sources, *, rule: ReplaceRule = RESHARD_OUTPUT, what: str = "OUT"):
        self.out, self.overwrite, self.rule = Path(out).resolve(), overwrite, rule
        self.tmp = self.out.parent / f".{self.out.name}{_TMP_MARK}{os.getpid()}"
        self.total = 0
        refuse_overlap(out, what, sources)
        if os.path.lexists(self.out):
            _check_replaceable(self.out, overwrite, rule)  # refused before anything is touched
        try:
            self.out.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OutputError(f"{self.out.parent}: cannot create it ({e.strerror or e}); choose a folder you can "
                              "write to.") from e

    def locked(self):
        """Hold the write lock beside OUT (`write_lock`)."""
        return write_lock(self.out)

    def claim(self, needed: int) -> None:
        """Under the lock: clean up earlier writes, check OUT again and that `needed` bytes are free."""
        _clean_stale_temporaries(self.out)  # may put back an OUT a killed swap left aside: check it again
        if os.path.lexists(self.out):
            _check_replaceable(self.out, self.overwrite, self.rule)
        self.total = needed
        free = shutil.disk_usage(self.out.parent).free
        if free < needed:
            raise OutputError(f"{self.out.parent}: {human_bytes(free)} free, the output needs "
                              f"{human_bytes(needed)}. Free space or write elsewhere. Nothing was changed.")

    @contextmanager
    def filling(self):
        """Create the temporary folder; on any failure or interruption inside, `discard` it, and an `OSError`
        becomes the `OutputError` a write reports."""
        try:
            self.tmp.mkdir()
            yield self.tmp
        except OSError as e:
            self.discard()
            raise self.error(e) from e
        except BaseException as e:
            self.discard(interrupted=e if isinstance(e, KeyboardInterrupt) else None)
            raise

    def open_shared(self) -> Path:
        """Create the temporary folder the ranks of a distributed job write into; returns it."""
        self.tmp.mkdir()
        return self.tmp

    @contextmanager
    def finishing(self):
        """Where the process completing a distributed job writes the rest: the temporary folder."""
        yield self.tmp

    def completed_all(self) -> bool:
        """Whether the folder is in place (its temporary folder is gone)."""
        return not self.tmp.exists()

    def complete(self) -> None:
        """fsync the finished temporary folder and put it in place as OUT."""
        fsync_files(self.tmp)
        _fsync_dir(self.tmp)
        replace(self.tmp, self.out, self.overwrite, self.rule)

    def discard(self, *, interrupted: KeyboardInterrupt | None = None) -> None:
        """After a failure, or `interrupted` by one: put OUT back if this write had moved it aside, remove the
        temporaries.

        Interrupted (a KeyboardInterrupt: Ctrl-C, SIGTERM), the removal takes `INTERRUPT_CLEANUP_S` at most
        (`_remove_within`), so the process exits at once even after writing 20,000 files; the rest is left for the
        next write to OUT, and the interrupt carries what was left (`left_behind_text`).
        """
        aside = _aside_path(self.out)
        if os.path.lexists(aside) and not os.path.lexists(self.out):
            os.rename(aside, self.out)
        for folder in (self.tmp, aside):
            remove_temporary(folder, self.out, interrupted=interrupted)

    def error(self, e: OSError) -> OutputError:
        """The error a write reports for `e`, once its temporary folder is gone (`_output_error`)."""
        return _output_error(e, self.out, self.total)


def share_failure(e: Exception, host: str, out: Path, total: int) -> str:
    """What a rank reports when writing its share of `out` failed: the error, worded for the user where it is
    expected, else with its traceback printed on this rank."""
    if isinstance(e, OSError):
        e = _output_error(e, out, total)
    if not isinstance(e, ReshardError):
        import traceback

        traceback.print_exc()  # not an expected failure: show where, on this rank
        return f"{host}: {type(e).__name__}: {e}"
    return f"{host}: {e}"


def _output_error(e: OSError, out: Path, total: int) -> OutputError:
    """The error a write to `out` (of `total` bytes) reports for `e`, once its temporary folder is gone."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return OutputError(f"{out.parent}: no space left on the device while writing; nothing was kept. "
                           f"The output needs {human_bytes(total)}.")
    if isinstance(e, OutputError):
        return e
    return OutputError(f"{out}: write failed ({e}); nothing was kept.")


def staged_output(out, overwrite: bool, index, *, rule: ReplaceRule = RESHARD_OUTPUT, markers: tuple[str, ...],
                  what: str = "OUT"):
    """OUT claimed for a job reading `index`: a folder (`StagedOutput`), or a bucket prefix
    (`reshard.write._bucket_output.BucketOutput`, whose commit marker is the files `markers`, written last); neither may
    overlap the source (`source_places`)."""
    from ..read import is_url

    if is_url(out):
        from ._bucket_output import BucketOutput

        return BucketOutput(out, overwrite, markers=markers, rule=rule, sources=source_places(index), what=what)
    return StagedOutput(out, overwrite, source_places(index), rule=rule, what=what)


def check_url_output(out, what: str, overwrite: bool, command: str) -> None:
    """Check an output given as a URL before anything is read: an `s3://bucket/prefix` must be writable with these
    credentials and hold nothing, or (`overwrite`) exactly an output `command` (`write`, `merge`) may replace
    (`reshard.write._replaceable.RULES`); another scheme is refused.

    Raises:
        UsageError: a URL of another scheme.
        OutputError: the bucket or prefix cannot take the output (`reshard.write._bucket`).
    """
    from ..read import S3_SCHEMES, is_url

    if not is_url(out):
        return
    if not out.startswith(S3_SCHEMES):
        raise UsageError(f"{what} {out}: reshard writes to a folder or to an s3://bucket/prefix; not this scheme. "
                         "Nothing was read or written.")
    from ._bucket import Bucket, refuse_occupied

    bucket = Bucket(out)
    bucket.check_writable()
    existing, below = bucket.listing()
    refuse_occupied(bucket, existing, overwrite, RULES[command], below)


def refuse_empty_output(out, what: str) -> None:
    """Refuse an empty output path: `Path("")` is the current folder, which `--overwrite` would swap away.

    Raises:
        UsageError: `out` is empty.
    """
    if not os.fspath(out):
        raise UsageError(f"{what} is empty (\"\"): pass the folder to write, such as ./out; an empty path would be the "
                         "current folder. Nothing was read or written.")


def source_places(index) -> list:
    """`(name, place)` of what an output must not replace of a source (`CheckpointIndex`): its folder, each file where
    its link leads, a cache snapshot's repo folder (its blobs); for a source read in ranges its prefix (a Hub repo
    read in ranges is no place an output can be)."""
    from ..read import local_place, place_of

    if index.root is None:
        paths = [p for p in (index.store.local_path(f.name) for f in index.files) if p is not None]
        remote = [place_of(index.store.location)] if index.store.location.startswith(S3_SCHEMES) else []
    else:
        cache_repo = getattr(index.store, "cache_repo", None)
        paths = [index.root, *(index.root / f.name for f in index.files), *([cache_repo] if cache_repo else [])]
        remote = []
    return [("SRC", place) for place in (*remote, *(local_place(p) for p in paths))]


def remove_temporary(folder: Path, out: Path, *, interrupted: BaseException | None = None) -> None:
    """Remove a temporary folder of a write to `out`: whole, or, interrupted by a KeyboardInterrupt, for
    `INTERRUPT_CLEANUP_S` at most; what remains then travels with the interrupt (its `left_behind` pairs)."""
    if not isinstance(interrupted, KeyboardInterrupt):
        shutil.rmtree(folder, ignore_errors=True)
    elif (stale := _remove_within(folder, out, INTERRUPT_CLEANUP_S)) is not None:
        interrupted.left_behind = (*getattr(interrupted, "left_behind", ()), (stale, out))


def _remove_within(folder: Path, out: Path, seconds: float) -> Path | None:
    """Remove the temporary `folder` of a write to `out` for at most `seconds`, then stop; the folder left, if any.

    It is first renamed `.OUT.reshard-tmp-stale-PID-N`: whatever is left is then plainly stale, and the next write
    to OUT removes it under its lock (`_clean_stale_temporaries`, as after a SIGKILL). Measured: 20,000 files took
    35-56 s to delete on a loaded file system, far past the few seconds a SIGTERM is given before a SIGKILL.
    """
    if not os.path.lexists(folder):
        return None
    stale = out.parent / f".{out.name}{_TMP_MARK}stale-{os.getpid()}-{time.monotonic_ns()}"
    try:
        os.rename(folder, stale)
    except OSError:
        stale = folder  # another rank renamed it first, or the file system refuses: remove it where it is
    deadline = time.monotonic() + seconds
    try:
        with os.scandir(stale) as entries:
            for entry in entries:
                if time.monotonic() > deadline:
                    break
                try:
                    if entry.is_dir(follow_symlinks=False):
                        shutil.rmtree(entry.path)
                    else:
                        os.unlink(entry.path)
                except OSError:
                    pass
        os.rmdir(stale)  # fails while entries remain: the time ran out
    except OSError:
        pass
    return stale if os.path.lexists(stale) else None


def left_behind_text(interrupt: BaseException) -> str:
    """What the writes `interrupt` stopped left on disk or in a bucket, and when it is cleaned, for the CLI's last
    line: both travel on the interrupt (`left_behind`, and a bucket write's `notes`)."""
    left_behind = getattr(interrupt, "left_behind", ())
    notes = " ".join(getattr(interrupt, "notes", ())) + " " if getattr(interrupt, "notes", ()) else ""
    if not left_behind:  # a bucket write's note says itself what it left (`BucketOutput.discard`)
        return notes.strip() if notes else "nothing partial was left behind."
    lines = [notes.strip()] if notes else []
    for folder, out in left_behind:
        try:
            count = f" ({len(os.listdir(folder))} entries)"
        except OSError:
            count = ""
        lines.append(f"the temporary folder {folder}{count} was left behind, not yet removed; the next `reshard "
                     f"write` or `reshard merge` into {out} removes it, or delete it yourself.")
    return " ".join(lines)


# ---- the temporaries of earlier writes ---------------------------------------------------------------------------

def _temporaries(out: Path) -> list[Path]:
    # escaped: an OUT named `m*` must not match the temporaries of another OUT's write
    return sorted(out.parent.glob(f".{glob.escape(out.name)}{_TMP_MARK}*"))


def _aside_path(out: Path) -> Path:
    return out.parent / f".{out.name}{_TMP_MARK}old-{os.getpid()}"


def _clean_stale_temporaries(out: Path) -> None:
    """Under the write lock: put back an OUT a killed swap left aside, then remove every earlier temporary.

    Holding the lock proves their writers are gone (a live writer holds it, on any host), which a pid check cannot
    tell on a shared file system.
    """
    stale = _temporaries(out)
    aside = [p for p in stale if p.name.startswith(f".{out.name}{_TMP_MARK}old-")]
    if aside and not os.path.lexists(out):  # killed between the two renames of the fallback swap
        os.rename(aside[0], out)
        _fsync_dir(out.parent)
        stale.remove(aside[0])
    for tmp in stale:
        shutil.rmtree(tmp, ignore_errors=True)


# ---- putting the folder in place ---------------------------------------------------------------------------------

_fsync_dir = fsync_path  # a folder's entries are made durable the same way


def swap_hook(step: str) -> None:
    """Called at each step of putting the finished folder in place; tests replace it to interrupt there.

    Steps: `before-swap`, `old-moved` (rename fallback only: OUT is aside, signals are held), `swapped` (OUT is the
    new folder, the old one not yet removed), `done`.
    """


def replace(tmp: Path, out: Path, overwrite: bool, rule: ReplaceRule = RESHARD_OUTPUT) -> None:
    """Put the finished folder in place so that OUT is, at every instant, the whole old or the whole new folder.

    An existing OUT (checked again by `rule`: nothing foreign may appear during the write) is exchanged with the new
    folder in one step (Linux `renameat2(RENAME_EXCHANGE)`), then removed from where the new one was. Where the
    kernel or file system cannot exchange, OUT is renamed aside and the new folder renamed in with SIGINT and SIGTERM
    held; only a SIGKILL between those two renames leaves OUT aside, and the next write to OUT puts it back.
    """
    swap_hook("before-swap")
    if not os.path.lexists(out):
        os.rename(tmp, out)
        swap_hook("swapped")
    else:
        _check_replaceable(out, overwrite, rule)
        if exchange(tmp, out):
            _fsync_dir(out.parent)
            swap_hook("swapped")
            shutil.rmtree(tmp, ignore_errors=True)  # the old output, now at the temporary path
        else:
            _rename_aside_and_in(tmp, out)
    _fsync_dir(out.parent)
    swap_hook("done")


def _rename_aside_and_in(tmp: Path, out: Path) -> None:
    aside = _aside_path(out)
    with signals_held():
        os.rename(out, aside)
        try:
            swap_hook("old-moved")
            os.rename(tmp, out)
        except BaseException:
            os.rename(aside, out)
            raise
    _fsync_dir(out.parent)
    swap_hook("swapped")
    shutil.rmtree(aside, ignore_errors=True)
