"""The launcher and rank agreement: what every multi-rank path (a distributed write, a distributed load) needs below
both, so neither imports the other.

- Environment detection: a launcher (torchrun, or srun/mpirun setting the same variables) says this process is one
  rank of a job.
- Process groups: the default group created from that environment (the way transformers does it for a load, a gloo
  one for a write), and destroyed before the interpreter is: left to finalization, gloo's threads can abort the
  process after an error was printed.
- Agreed failures: every rank's view gathered in one collective, so either every rank raises the same error, naming
  each failing rank and its cause, or none does; no rank fails alone while the others wait in a collective.

Imports nothing heavy at module level: torch (and transformers, for a load's group) only when a function needs it.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import TypeVar

from .errors import LoadError, OutputError

_COLLECTIVE_TIMEOUT_S = 600  # gloo's limit for one collective; ranks enter them only once all are there

_LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE")

E = TypeVar("E", bound=Exception)
STOPPED = "Every rank stopped; nothing was kept."  # the remedy of an agreed failure


# ---- the launcher's environment --------------------------------------------------------------------------------

def launcher_world_size() -> int | None:
    """The WORLD_SIZE a launcher (torchrun, or srun/mpirun setting the same variables) gave this process, or None."""
    if not all(v in os.environ for v in _LAUNCHER_VARIABLES):
        return None
    try:
        return int(os.environ["WORLD_SIZE"])
    except ValueError:
        return None


def multi_rank_job() -> bool:
    """This call runs in a multi-rank job: a process group exists, or a launcher set WORLD_SIZE > 1."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size() > 1
    return (launcher_world_size() or 1) > 1


def in_distributed_job() -> bool:
    """True when this process is one rank of a multi-rank job, initializing the default process group from the
    launcher's environment the way transformers does (nccl bound to LOCAL_RANK on CUDA, gloo on CPU) if needed.

    False (the whole-model path) only when no group exists and there is no launcher environment, or WORLD_SIZE is 1.

    Raises:
        LoadError: the launcher environment is there but the process group cannot be created.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return True
    world = launcher_world_size()
    if world is None or world <= 1:
        return False
    from transformers.distributed.utils import _ensure_torch_distributed

    try:
        _ensure_torch_distributed()
    except OSError as e:
        raise LoadError(f"RANK/WORLD_SIZE say this is rank {os.environ['RANK']} of {world}, but the process group "
                        f"could not be created ({e.__cause__ or e}). Check MASTER_ADDR/MASTER_PORT, or call "
                        "torch.distributed.init_process_group yourself first.") from e
    return True


# ---- process groups --------------------------------------------------------------------------------------------

def gloo_group(command: str):
    """(the group to use, whether this call created the default group) for a file-writing `command` run as one rank
    of a job: the default group when it is gloo, a new gloo group over it otherwise (file I/O needs no GPU backend),
    or a default gloo group created from the launcher's environment. A group created here is kept until the
    interpreter exits, as a load's is, so a second write in the same job reuses it.

    Args:
        command: the `reshard` command running (`write`), named in the message when no launcher started it.

    Raises:
        OutputError: no launcher environment, or the process group cannot be created from it.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        return (None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")), False
    if launcher_world_size() is None:
        raise OutputError(f"a distributed {command} runs as one rank of a torchrun job, but RANK, LOCAL_RANK and "
                          f"WORLD_SIZE are not set. Launch it with `torchrun ... -m reshard {command} ...`, or drop "
                          "--distributed.")
    from datetime import timedelta

    try:
        dist.init_process_group("gloo", timeout=timedelta(seconds=_COLLECTIVE_TIMEOUT_S))
    except (RuntimeError, ValueError, OSError) as e:
        raise OutputError(f"RANK/WORLD_SIZE say this is rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']}, but "
                          f"the process group could not be created ({e}). Check MASTER_ADDR/MASTER_PORT.") from e
    import atexit

    atexit.register(destroy_own_group)  # torn down before the interpreter is (see the module's docstring)
    return None, True


def group_exists() -> bool:
    """Whether a default process group is up (a caller that finds none and creates one owns it)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


@contextmanager
def group_owned(*, created: bool):
    """Around a distributed load: a default process group this call `created` (from the launcher's environment) is
    destroyed on every path. A failed load destroys it at once (every rank raises the agreed `LoadError` together);
    a successful one leaves it to the model, destroyed at interpreter exit. Left to finalization, gloo's threads can
    abort the process after the error was printed ("terminate called without an active exception", exit -6: 2 of
    14 torchrun runs)."""
    if not created:
        yield
        return
    try:
        yield
    except BaseException:
        destroy_own_group()
        raise
    import atexit

    atexit.register(destroy_own_group)


def destroy_own_group() -> None:
    """Destroy the default process group if one is still up (idempotent: atexit may call it after a failure did)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


# ---- agreed failures -------------------------------------------------------------------------------------------

def gather(value) -> list:
    """Every rank's `value`, in rank order (all_gather_object on the default group)."""
    import torch.distributed as dist

    values: list = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def _rank_list(ranks: list[int]) -> str:
    """`[0, 1, 2, 5]` -> `ranks 0-2, 5`."""
    spans: list[list[int]] = []
    for r in ranks:
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    text = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)
    return f"rank{'s' if len(ranks) > 1 else ''} {text}"


def _failing_ranks(problems: list) -> dict[str, list[int]]:
    """Each distinct problem in `problems` (one entry per rank, falsy where fine) with the ranks that have it."""
    failed: dict[str, list[int]] = {}
    for r, p in enumerate(problems):
        if p:
            failed.setdefault(p, []).append(r)
    return failed


def _describe_failures(failed: dict[str, list[int]], ranks: int, what: str) -> str:
    """`N of M ranks <what> (ranks 0-2: cause; rank 5: other cause)`, from `_failing_ranks`."""
    count = sum(len(r) for r in failed.values())
    detail = "; ".join(f"{_rank_list(r)}: {p}" for p, r in failed.items())
    return f"{count} of {ranks} ranks {what} ({detail})"


def agreed_failure(views: list, what: str, error_type: type[E], *,
                   remedy: str = STOPPED) -> E | None:
    """The error every rank raises when any rank's view is a problem (falsy entries are fine), or None.

    Every rank calls it on the same gathered `views`, so every rank gets the same message: `N of M ranks <what>
    (ranks 0-2: cause; ...). <remedy>`, as an `error_type` (the caller's own, e.g. an `OutputError` for a write).
    """
    failed = _failing_ranks(views)
    if not failed:
        return None
    return error_type(f"{_describe_failures(failed, len(views), what)}. {remedy}")


def raise_if_any(problems: list) -> None:
    """Raise LoadError, naming every failing rank, when any rank's entry is a problem (identical ones grouped)."""
    failed = _failing_ranks(problems)
    if len(failed) == 1 and len(next(iter(failed.values()))) == len(problems):
        raise LoadError(next(iter(failed)))  # the same on every rank (a world size or mesh mismatch): say it once
    failure = agreed_failure(problems, "cannot load", LoadError,
                             remedy="Every rank stops here. Run `reshard verify` on the folder, or write it again.")
    if failure is not None:
        raise failure
