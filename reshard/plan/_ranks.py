"""Sets of global ranks as users type them (`0-7`, `0,8,16-23`), kept as spans: a span like `0-99999999999` is
bounded by the mesh before it becomes a list."""

from __future__ import annotations

import re

from ..errors import UsageError

_SPAN = re.compile(r"([0-9]+)(?:-([0-9]+))?")  # ASCII digits only: str.isdigit() would take "٣" or "²"


class RankSpans(tuple):
    """Inclusive `(first, last)` spans of global ranks, in the order given."""

    @classmethod
    def parse(cls, text: str) -> "RankSpans":
        """`0-7`, `0,8,16-23` as spans.

        Raises:
            UsageError: anything else (the message shows the accepted form).
        """
        spans = []
        for part in str(text).split(","):
            match = _SPAN.fullmatch(part.strip())
            if not match or (match[2] is not None and int(match[2]) < int(match[1])):
                raise UsageError(f"{text!r} is not a rank list like 0-7 or 0,8,16-23 (ranks in ASCII digits 0-9, a "
                                 "span FIRST-LAST with FIRST <= LAST).")
            spans.append((int(match[1]), int(match[2] if match[2] is not None else match[1])))
        return cls(spans)

    @classmethod
    def of(cls, ranks) -> "RankSpans":
        """Spans of an iterable of ranks (consecutive ranks joined)."""
        spans: list[list[int]] = []
        for r in sorted(set(ranks)):
            if spans and spans[-1][1] == r - 1:
                spans[-1][1] = r
            else:
                spans.append([r, r])
        return cls(tuple(s) for s in spans)

    def expand(self, world: int) -> list[int]:
        """The ranks, sorted and distinct.

        Raises:
            UsageError: a rank is outside a mesh of `world` ranks (nothing is expanded then).
        """
        top = max(last for _, last in self)
        if top >= world:
            raise UsageError(f"--ranks names rank {top}, but the folder's mesh has {world} ranks (0-{world - 1}); "
                             "pass ranks of that mesh. Nothing was listed.")
        return sorted({r for first, last in self for r in range(first, last + 1)})

    def __str__(self) -> str:
        return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in self)
