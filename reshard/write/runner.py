"""The one way an output job runs: in this process, in `--workers` processes, or as the ranks of a torchrun job.

`write` and `merge` differ only in the job (`reshard.write.output.OutputJob`) their entry point builds; where it runs is
decided here, from the flags and the launcher's environment, the same way for both.
"""

from __future__ import annotations

from .distributed import use_distributed, write_distributed
from .output import write_output
from .staged import removes_made_parents


@removes_made_parents("out")
def run_job(read_job, out, *, command: str, overwrite: bool = False, progress: bool | None = None,
            workers: int | None = 1, distributed: bool | None = None):
    """Build the job (`read_job()`) and run it into the folder `out`.

    Args:
        read_job: reads the source and plans: `() -> OutputJob`. In a distributed run every rank calls it on its own
            node, and its errors are agreed like any other rank failure.
        command: `write` or `merge`, for messages.
        overwrite, progress, workers: as for `reshard.write.output.write_output`.
        distributed: run as one rank of a torchrun job (None: when the launcher's environment says so).

    Returns:
        (the job, what its `finish` returned), or (None, None) on the ranks other than 0 of a distributed run.

    Raises:
        UsageError: `workers` above 1 in a distributed run (refused before anything is read).
    """
    if use_distributed(distributed, workers, command):
        jobs: list = []

        def build():
            jobs.append(read_job())
            return jobs[-1]

        result = write_distributed(build, out, overwrite=overwrite, progress=progress, command=command)
        return (jobs[-1], result) if result is not None else (None, None)
    job = read_job()
    return job, write_output(job, out, overwrite=overwrite, progress=progress, workers=workers)
