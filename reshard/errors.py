"""One error hierarchy for everything reshard raises.

Every error carries the numbers and names needed to act on it, and its message says what to do.
The CLI catches `ReshardError` once and prints the message without a traceback (`--debug` shows it).
"""

from __future__ import annotations

from .words import plural


class ReshardError(Exception):
    """Base class of every error reshard raises."""


class CheckpointError(ReshardError, ValueError):
    """The source checkpoint is missing, malformed, or not what its index says.

    Attributes:
        path: the file or folder at fault, when there is one.
    """

    def __init__(self, message: str, *, path: str | None = None):
        super().__init__(message)
        self.path = path


class UsageError(ReshardError, ValueError):
    """The command's flags cannot work with this input (the CLI exits 2 with the usage line, as for a bad flag)."""


class MeshError(UsageError):
    """The requested mesh cannot hold this model, or is not supported yet."""


class SourceChangedError(CheckpointError):
    """A source file or object changed while it was read (replaced, rewritten or overwritten after its header was
    read): what was read no longer belongs to one file. The command stops and keeps nothing."""


class QuantizationError(CheckpointError):
    """A quantized checkpoint reshard cannot dequantize: unknown method, a missing or mis-shaped scale, a dtype
    this torch lacks."""


class ArchitectureError(ReshardError, ValueError):
    """The model type cannot be mapped from its on-disk keys to its in-memory parameters."""


class OutputError(ReshardError, OSError):
    """The output folder exists, cannot be written, or ran out of space."""


class VerifyError(ReshardError):
    """A written folder does not match its manifest or its source.

    Attributes:
        problems: one line per problem found.
    """

    def __init__(self, problems: list[str]):
        super().__init__(f"{plural(len(problems), 'problem')} found:\n" + "\n".join(problems))
        self.problems = list(problems)


class LoadError(ReshardError, RuntimeError):
    """A rank could not load its shard; raised on every rank, naming the failing one."""


class ManifestError(VerifyError, LoadError):
    """`reshard.json` (or a header or file it names) is not what a reshard folder can hold: a key missing or of the
    wrong type, a value out of range, a file name outside the folder, a file that is not a regular file, a header
    that disagrees with it. Raised before any byte it describes is used; nothing is changed.

    Both a `VerifyError` (what `verify` reports) and a `LoadError` (what a load raises), so each caller's existing
    `except` holds; the multi-rank load still gathers it into one agreed `LoadError` on every rank.

    Attributes:
        problems: one line per problem found, each naming the key and its value.
    """
