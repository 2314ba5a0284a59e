"""The one way an output job runs: in this process, in `--workers` processes, or as the ranks of a torchrun job.

`write` and `merge` differ only in the job (`reshard.write._output._OutputJob`) their entry point builds; where it
runs is decided here, from the flags and the launcher's environment, the same way for both. A run that fails or is
interrupted also removes the parent folders of OUT it created (`_removes_made_parents`).
"""

from __future__ import annotations

import functools
import inspect
import os
from pathlib import Path

from ..errors import UsageError
from ._distributed import write_distributed
from ._nodes import use_distributed
from ._output import write_output


def _removes_made_parents(argument: str):
    """Decorate a writer whose parameter `argument` is its output folder: when it fails or is interrupted, the parent
    folders of the output it created (those missing before the call, and still empty) are removed again, so a refused
    write into `small/x/y/out` leaves no empty `x/y` behind."""
    def decorate(fn):
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            made = _missing_parents(Path(signature.bind(*args, **kwargs).arguments[argument]))
            try:
                return fn(*args, **kwargs)
            except BaseException:
                for folder in made:  # deepest first; one that is not empty (someone else's now) stays, as all above
                    try:
                        os.rmdir(folder)
                    except OSError:
                        break
                raise

        return wrapper

    return decorate


def _missing_parents(out: Path) -> list[Path]:
    """The parent folders of `out` that do not exist yet, deepest first."""
    missing, parent = [], Path(os.path.abspath(out)).parent
    while not os.path.lexists(parent) and parent != parent.parent:
        missing.append(parent)
        parent = parent.parent
    return missing


@_removes_made_parents("out")
def run_job(read_job, out, *, command: str, overwrite: bool = False, progress: bool | None = None,
            workers: int | None = 1, distributed: bool | None = None, node_local: bool = False,
            ranks_given: bool = False, gather_from=None, list_from=None):
    """Build the job (`read_job()`) and run it into the folder `out`.

    Args:
        read_job: reads the source and plans: `() -> OutputJob`. In a distributed run every rank calls it on its own
            node, and its errors are agreed like any other rank failure.
        command: `write` or `merge`, for messages.
        overwrite, progress, workers: as for `reshard.write._output.write_output`.
        distributed: run as one rank of a torchrun job (None: when the launcher's environment says so).
        node_local: in a torchrun job, each node writes its own copy (`reshard.write._distributed`).
        gather_from: in a torchrun job, node 0's ranks write `out` from this folder (a `reshard.write.Listing`),
            on every node's own disk.
        list_from: with `node_local`, a local SRC (a `Listing`) of which each node may hold only what it reads.
        ranks_given: the job holds the files of some ranks only (`--ranks`), which a torchrun job decides itself.

    Returns:
        (the job, what its `finish` returned), or (None, None) on the ranks other than 0 of a distributed run;
        gathering, on the first rank of each other node, (None, its `NodeOutcome`).

    Raises:
        UsageError: `workers` above 1 in a distributed run; `--ranks` in one, or `--node-local` outside one (refused
            before anything is read).
    """
    distributed = use_distributed(distributed, workers, command)
    if node_local and "://" in os.fspath(out):
        raise UsageError(f"{out}: --node-local writes a copy to each node's own disk; into a bucket, run the torchrun "
                         f"{command} without it (each rank sends the files it writes). Nothing was read or written.")
    if (node_local or gather_from is not None) and not distributed:
        alone = (" or, on one node without torchrun, write that node's files with `reshard write SRC OUT ... --ranks "
                 "FIRST-LAST`" if command == "write" else "")
        raise UsageError(f"--node-local is for a torchrun {command} over several nodes, each with its own disk, but "
                         f"this one runs in one process. Launch it with `torchrun --nnodes N ... -m reshard {command} "
                         f"... --node-local`{alone}. Nothing was written.")
    if distributed:
        if ranks_given:
            raise UsageError("--ranks writes one node's copy in one process; in a torchrun write pass --node-local "
                             "instead (each node then writes its own ranks' files). Nothing was written.")
        jobs: list = []

        def build(*store):
            jobs.append(read_job(*store))
            return jobs[-1]

        result = write_distributed(build, out, overwrite=overwrite, progress=progress, command=command,
                                   node_local=node_local, gather_from=gather_from, list_from=list_from)
        # a node that only served its files to node 0 built no job, and says what it gave
        return (jobs[-1] if jobs else None, result) if result is not None else (None, None)
    job = read_job()
    return job, write_output(job, out, overwrite=overwrite, progress=progress, workers=workers)
