"""The command line's flag types: sizes, counts and rank lists, parsed from ASCII digits only.

Python's `int` and `str.isdigit` take any script's digits ('٣', an Arabic-Indic 3) and `int` takes `1_000`; a flag
must not take them silently, so each type here matches its form first and says the accepted form and range.
"""

from __future__ import annotations

import re

import click

from .errors import UsageError
from .plan import RankSpans


def _parse_size(text: str) -> int:
    """Bytes from `5GB`, `500MiB` or `1000000` (`--max-shard-size`), 1 or more."""
    units = {"": 1, "B": 1, "K": 2**10, "KB": 10**3, "KIB": 2**10, "M": 2**20, "MB": 10**6, "MIB": 2**20,
             "G": 2**30, "GB": 10**9, "GIB": 2**30, "T": 2**40, "TB": 10**12, "TIB": 2**40}
    # one number in ASCII digits (`\d` would take any script's digits): `1.2.3` is a usage error
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in units:
        raise click.BadParameter(f"{text!r} is not a size like 5GB, 500MiB or 1000000 (1 byte or more).")
    size = int(float(m.group(1)) * units[m.group(2).upper()])
    if size < 1:  # 0 would put no tensor in any file
        raise click.BadParameter(f"{text!r} is {size} bytes; a size is 1 byte or more, like 5GB, 500MiB or 1000000.")
    return size


class _ParsedType(click.ParamType):
    """A flag whose text `parse` turns into a value, raising `click.BadParameter` (or the library's `UsageError`) with
    the message; a value that is already `parsed` (a default) passes as it is."""

    parse = staticmethod(str)
    parsed: type = str

    def convert(self, value, param, ctx):
        if isinstance(value, self.parsed):
            return value
        try:
            return self.parse(value)
        except click.BadParameter as e:
            self.fail(e.message, param, ctx)
        except UsageError as e:
            self.fail(str(e), param, ctx)


class SizeType(_ParsedType):
    name, parse, parsed = "size", staticmethod(_parse_size), int


class Count(click.IntRange):
    """click's `IntRange` for text in ASCII digits only: Python's `int` also reads '٣' (an Arabic-Indic 3), '1_000'
    and other scripts' digits, which a flag must not take silently."""

    def convert(self, value, param, ctx):
        if isinstance(value, str) and not re.fullmatch(r"\s*[+-]?[0-9]+\s*", value):
            accepted = f"{self.min} to {self.max}" if self.max is not None else f"{self.min} or more"
            self.fail(f"{value!r} is not a whole number in ASCII digits 0-9 ({accepted}).", param, ctx)
        return super().convert(value, param, ctx)


class RanksType(_ParsedType):
    name, parse, parsed = "ranks", staticmethod(RankSpans.parse), RankSpans
