"""A bucket prefix as the output of `write` and `merge`, through its steps (`BucketOutput`): the staged output's
twin for S3, over the requests and uploads of `reshard.write._bucket`.

The checks come at once: OUT is no place of the source, the prefix may be written, and it holds nothing or (with
`--overwrite`) exactly an output reshard may replace. Every file is sent while the old checkpoint stays whole; then
the swap: the old markers go, the uploads are completed, the new markers are written last, the old objects the new
checkpoint lacks are removed. With `--overwrite` a claim record (`reshard.write._claim`) says what is being
replaced, so a replacement that ends early is completed by the next `--overwrite`.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from pathlib import Path

from ..errors import OutputError, ReshardError
from ..read import ATTEMPTS
from ..words import plural
from ._bucket import MARKERS, Bucket, Uploads, refuse_occupied
from ._claim import CLAIM_NAME, SWAPPING, Claim
from ._replaceable import ReplaceRule

class BucketOutput:
    """OUT as a bucket prefix: the checks at once, then the same steps as `reshard.write._staged.StagedOutput`
    (`locked`, `claim`, `filling`, `complete`, `discard`, `error`), with multipart uploads for the temporary folder.

    Args:
        out: `s3://bucket/prefix`.
        overwrite: whether a prefix holding an output `rule` allows may be replaced.
        markers: the commit marker's files, written last in this order.
        sources: `(name, place)` of each source (OUT must not be one, be inside one, or hold one:
            `reshard.read.refuse_overlap`).
        what: OUT's name in messages (`OUT`, `DEST`).
    """

    def __init__(self, out, overwrite: bool, *, markers: tuple[str, ...], rule: ReplaceRule, sources=(),
                 what: str = "OUT"):
        from ..read import refuse_overlap

        self.bucket = Bucket(str(out))
        self.out, self.overwrite, self.markers = self.bucket.url, overwrite, markers
        refuse_overlap(str(out), what, sources)
        self.bucket.check_writable()
        self.existing, below = self.bucket.listing()
        refuse_occupied(self.bucket, self.existing, overwrite, rule, below)
        self.total = 0
        self.uploads = Uploads(self.bucket)
        self.on_file = self.uploads.send_later  # each file of the writer's spool is sent once whole
        self.tmp: Path | None = None
        self.adopted: dict[str, tuple[str, list[dict]]] = {}  # other ranks' open uploads, to complete or abort
        self.completed: list[str] = []  # objects this write completed or put
        self.done = False  # the marker is written
        self.record: Claim | None = None  # with --overwrite: what is being replaced (`reshard.write._claim`)

    def locked(self):
        """An object store has no lock: one write per prefix at a time is the caller's to keep."""
        return nullcontext()

    def claim(self, needed: int) -> None:
        """With `--overwrite`, the claim record is written before any new byte is sent (`reshard.write._claim`): the
        old checkpoint stays whole until every file is sent, and a rerun can finish what this write leaves."""
        self.total = needed
        if CLAIM_NAME in self.existing:  # a replacement killed mid-way: its uploads nobody will complete go first
            for name, upload in self.bucket.left_uploads():
                self.bucket.call("aborting an interrupted write's upload", name, "abort_multipart_upload",
                                 Key=self.bucket.key(name), UploadId=upload)
        if self.existing:
            self.record = Claim.begin(self.existing)
            try:
                self._put_claim()
            except OutputError as e:
                self.record = None
                e.args = (f"{e} The checkpoint that was at {self.out} is unchanged and loads.", *e.args[1:])
                raise

    @contextmanager
    def filling(self):
        """The spool folder (`Uploads.spooling`); on any failure or interruption inside, every upload is aborted
        (`discard`), and the error says what was removed."""
        with self.uploads.spooling() as self.tmp:
            try:
                yield self.tmp
            except BaseException as e:
                removed = self.discard(interrupted=e if isinstance(e, KeyboardInterrupt) else None)
                if isinstance(e, ReshardError):
                    e.args = (f"{e} {removed}", *e.args[1:])
                elif isinstance(e, OSError):
                    raise OutputError(f"{self.out}: write failed ({e}). {removed}") from e
                raise
            finally:
                self.uploads.close()

    def open_shared(self) -> None:
        """None: the ranks of a distributed job each spool their own files (`Uploads`) and hand over the uploads."""
        return None

    @contextmanager
    def finishing(self):
        """A spool folder for what the process completing a distributed job writes (the metadata, the marker)."""
        with self.uploads.spooling() as self.tmp:
            yield self.tmp

    def completed_all(self) -> bool:
        """Whether the marker is written."""
        return self.done

    def adopt(self, records: dict[str, tuple[str, list[dict]]]) -> None:
        """Take over the open uploads another process sent (`Uploads.wait`): completed or aborted here. Several
        processes may send parts of one upload (a merge across nodes, `reshard.write._spread`): their parts join."""
        self.adopted = _joined_records(self.adopted, records)

    def complete(self) -> None:
        """Send what the spool still holds (the metadata, and the files `--workers` wrote); then swap: with
        `--overwrite`, the claim record names the new objects and the old markers go, so a reader never sees old
        metadata over new files; every upload is completed, the markers are written last, the old objects the new
        checkpoint lacks are removed, and the record last of all."""
        spool = self.tmp
        left = sorted(p.name for p in spool.iterdir() if p.is_file()) if spool is not None else []
        self.uploads.wait()
        left = [name for name in left if (spool / name).exists()]  # the files sent meanwhile are gone
        small = [n for n in left if n not in self.markers and not n.endswith(".safetensors")]
        for name in [n for n in left if n.endswith(".safetensors") and n not in self.markers]:
            self.uploads.send(spool / name, self.uploads.open_upload(name))
        uploads = _joined_records(self.adopted, self.uploads.wait())
        if self.record is not None:  # every byte is sent: from here the old checkpoint is being replaced
            self.record = self.record.swapping([*uploads, *left])
            self._put_claim()
            for name in [m for m in MARKERS if m in self.existing]:
                self.bucket.call("removing the old marker", name, "delete_object", Key=self.bucket.key(name))
        for name in small:
            self.put(name)
        for name, (upload, parts) in sorted(uploads.items()):
            self.bucket.call("completing the upload", name, "complete_multipart_upload", Key=self.bucket.key(name),
                             UploadId=upload, MultipartUpload={"Parts": sorted(parts, key=lambda p: p["PartNumber"])},
                             on_answer=lambda _, name=name: self._completed(name))
        complete_hook("uploaded")
        for name in [m for m in self.markers if m in left]:
            self.put(name)
        self.done = True
        for name in sorted(set(self.existing) - set(self.completed) - {CLAIM_NAME}):
            self.bucket.call("removing an object of the old checkpoint", name, "delete_object",
                             Key=self.bucket.key(name))
        if self.record is not None:
            self.bucket.call("removing the claim record", CLAIM_NAME, "delete_object", Key=self.bucket.key(CLAIM_NAME))
            self.record = None

    def _put_claim(self) -> None:
        self.bucket.call("writing the claim record", CLAIM_NAME, "put_object", Key=self.bucket.key(CLAIM_NAME),
                         Body=self.record.to_bytes())

    def _completed(self, name: str) -> None:
        """`name` is an object now (its answer came, even if the caller was interrupted): the clean-up removes it."""
        self.adopted.pop(name, None)
        with self.uploads.lock:
            self.uploads.open.pop(name, None)
        self.completed.append(name)

    def put(self, name: str) -> None:
        self.bucket.call("writing the object", name, "put_object", Key=self.bucket.key(name),
                         Body=(self.tmp / name).read_bytes(), on_answer=lambda _: self._completed(name))

    def discard(self, *, interrupted: KeyboardInterrupt | None = None) -> str:
        """Abort every open upload and remove every object this write completed; returns what it did, for the
        message (`interrupted`: each request is tried once, and the note travels on the interrupt for the CLI's last
        line, `reshard.write._staged.left_behind_text`)."""
        if self.done:
            return f"{self.out}: complete (its marker is written); nothing was removed."
        swapping = self.record is not None and self.record.state == SWAPPING
        uploads, failed = self.uploads.abort(interrupted=interrupted is not None)
        attempts = 1 if interrupted is not None else ATTEMPTS
        for name, (upload, _) in self.adopted.items():
            uploads[name] = upload
            try:
                self.bucket.call("aborting the upload", name, "abort_multipart_upload", attempts=attempts,
                                 Key=self.bucket.key(name), UploadId=upload)
            except OutputError:
                failed.append(name)
        self.adopted = {}
        # swapping, the objects completed replaced the old ones of their names: they stay, named by the record, for
        # the next --overwrite to complete
        for name in self.completed if not swapping else ():
            try:
                self.bucket.call("removing the object", name, "delete_object", attempts=attempts,
                                 Key=self.bucket.key(name))
            except OutputError:
                failed.append(name)
        note = _removal_text(self.out, uploads, [] if swapping else self.completed, failed)
        if self.record is not None:
            note += " " + self._old_checkpoint_text(swapping, attempts)
        self.completed = []
        if interrupted is not None:
            interrupted.notes = (*getattr(interrupted, "notes", ()), note)
        return note

    def _old_checkpoint_text(self, swapping: bool, attempts: int) -> str:
        """What state the checkpoint this write was replacing is left in, for the message; before the swap, the
        claim record is removed (it is no longer needed)."""
        again = "Run the same command with --overwrite to complete the replacement"
        if swapping:
            return (f"The checkpoint that was at {self.out} no longer loads: its markers were removed and "
                    f"{plural(len(self.completed), 'new object')} written. {CLAIM_NAME} there names every object of "
                    f"both. {again}.")
        try:
            self.bucket.call("removing the claim record", CLAIM_NAME, "delete_object", attempts=attempts,
                             Key=self.bucket.key(CLAIM_NAME))
        except OutputError:
            return (f"The checkpoint that was at {self.out} is unchanged and loads; its claim record {CLAIM_NAME} "
                    f"could not be removed (the next --overwrite accepts it). {again}, or delete it yourself.")
        self.record = None
        return f"The checkpoint that was at {self.out} is unchanged and loads."

    def error(self, e: OSError) -> OutputError:
        return e if isinstance(e, OutputError) else OutputError(f"{self.out}: write failed ({e}); nothing was kept.")


def _joined_records(*records: dict[str, tuple[str, list[dict]]]) -> dict[str, tuple[str, list[dict]]]:
    """Open uploads by name, `(upload id, parts)`, from several processes: one upload's parts from each joined."""
    joined: dict[str, tuple[str, list[dict]]] = {}
    for record in records:
        for name, (upload, parts) in record.items():
            known = joined.get(name, (upload, []))[1]
            joined[name] = (upload, known + [p for p in parts if p not in known])
    return joined


def _removal_text(out: str, uploads: dict, completed: list, failed: list) -> str:
    """What discarding a write to `out` removed, and what it could not."""
    done = [f"aborted {plural(len(uploads), 'multipart upload')}"]
    if uploads:
        done[0] += f" ({', '.join(sorted(uploads)[:3])}{', ...' if len(uploads) > 3 else ''})"
    if completed:
        done.append(f"removed {plural(len(completed), 'object')} it had completed")
    text = f"{out}: {' and '.join(done)}; no commit marker was written"
    if failed:
        text += (f"; {plural(len(failed), 'upload or object')} could not be removed ({', '.join(failed[:3])}): the "
                 "server did not answer. Abort them (`aws s3api list-multipart-uploads`) or let the bucket's "
                 "lifecycle rule remove them")
    return text + "."


def complete_hook(step: str) -> None:
    """Called at each step of completing a bucket output; tests replace it to fail there. Steps: `uploaded` (every
    upload completed, no marker written yet)."""
