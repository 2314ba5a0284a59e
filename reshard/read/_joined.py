"""Two stores read as one: a merge's `--extras-from` source beside the trained folder."""

from __future__ import annotations

from pathlib import Path

from ._store import Store


class JoinedStore(Store):
    """Two stores read as one: a name under `prefix` is `other`'s (a merge's `--extras-from` source beside the trained
    folder), every other name `main`'s. Only `main`'s names are listed."""

    def __init__(self, main: Store, prefix: str, other: Store):
        self.main, self.prefix, self.other = main, prefix, other
        self.location = main.location
        self.remote = main.remote or other.remote
        self.in_flight = max(main.in_flight, other.in_flight)

    @property
    def fetched(self) -> int:
        return self.main.fetched + self.other.fetched

    @property
    def requests(self) -> int:
        return self.main.requests + self.other.requests

    def _route(self, name: str) -> tuple[Store, str]:
        if name.startswith(self.prefix):
            return self.other, name[len(self.prefix):]
        return self.main, name

    def url(self, name: str) -> str:
        store, name = self._route(name)
        return store.url(name)

    def names(self) -> tuple[str, ...]:
        return self.main.names()

    def size(self, name: str) -> int:
        store, name = self._route(name)
        return store.size(name)

    def read(self, name: str, start: int, length: int) -> bytes:
        store, name = self._route(name)
        return store.read(name, start, length)

    def readinto(self, name: str, start: int, view: memoryview) -> None:
        store, name = self._route(name)
        store.readinto(name, start, view)

    def local_path(self, name: str) -> Path | None:
        store, name = self._route(name)
        return store.local_path(name)

    def descriptor(self, name: str) -> int:
        store, name = self._route(name)
        return store.descriptor(name)

    def check_unchanged(self, name: str) -> None:
        store, name = self._route(name)
        store.check_unchanged(name)

    def check_inside(self, name: str) -> None:
        store, name = self._route(name)
        store.check_inside(name)

    def open(self, name: str):
        store, name = self._route(name)
        return store.open(name)

    def close(self) -> None:
        self.main.close()
        self.other.close()
