"""Counts in messages, in words: `1 file`, `2 files` (never `file(s)`)."""


def plural(n: int, noun: str, nouns: str | None = None) -> str:
    """`1 file`, `2 files`, `0 files`; `nouns` for an irregular plural."""
    return f"{n} {noun if n == 1 else nouns or noun + 's'}"


def mib(n: int) -> str:
    """A byte count in MiB, one decimal: `0.4 MiB`."""
    return f"{n / 2**20:.1f} MiB"
