"""A merge across nodes (`merge --node-local`): rank files that lie on each node's own disk, read by the ranks of
node 0 over the job's process group.

Each node's first rank lists its copy of the folder (`survey`): every file's size, the header of each
`.safetensors` file and the whole of each small metadata file. Every rank gets every node's listing, so the
ranks of node 0, which write DEST, read one folder (`PeerStore`): a file on their own disk is read there, a header
or a metadata file from the listing, and any other byte range from a rank of a node that holds the file, which
serves requests until every writer is done (`Peers.serve`). The bytes travel as gloo point-to-point messages of at
most `READ_BLOCK` each, so memory stays bounded, and the engine's usual checks apply to them as to any remote
source: the CRC-32 of each range read is combined and checked against the manifest before DEST is put in place.
Nodes' copies of a reshard folder (`write --node-local`) each list their own files: their manifests are joined
into the whole folder's (`reshard.manifest.joined_copies`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import CheckpointError
from ..manifest import MANIFEST_NAME, joined_copies
from ..manifest.format import dump_manifest
from ..read.safetensors_header import json_document
from ..read.store import READ_BLOCK, LocalStore, Store
from .ranks import POLL_S, Agreed, Stopped

WHOLE_LIMIT = 64 << 20  # a metadata file up to this size travels whole with the listing
HEADER_LIMIT = 100 << 20  # safetensors' own bound on a header
REQUEST, DONE = 1, 2
REQUEST_TAG = 1  # a writer's request to a server; the replies to writer w use tags 2 + 2w (status) and 3 + 2w (bytes)
FAILED = 1


def survey(folder: Path) -> dict[str, tuple[int, bytes]]:
    """This node's copy: file name -> (size, the header of a `.safetensors` file or the whole of a small file)."""
    store = LocalStore(Path(folder), links_anywhere=True)
    found = {}
    try:
        for name in store.names():
            size = store.size(name)
            if name.endswith(".safetensors"):
                length = int.from_bytes(store.read(name, 0, 8), "little") if size >= 8 else 0
                found[name] = (size, store.read(name, 0, min(size, 8 + min(length, HEADER_LIMIT))))
            else:
                found[name] = (size, store.read(name, 0, size) if size <= WHOLE_LIMIT else b"")
    finally:
        store.close()
    return found


@dataclass(frozen=True)
class Holding:
    """One file of the joined folder: its size, the bytes every rank has of it (a header, or the whole of a small
    file), and the nodes whose disks hold it."""

    size: int
    head: bytes
    nodes: tuple[int, ...]


def catalog(surveys: list[dict | None], where: str) -> dict[str, Holding]:
    """The joined folder from every node's `survey` (None for ranks that did not survey): each name once.

    Raises:
        CheckpointError: two nodes hold a file of one name with different sizes (copies of different folders).
        ManifestError: the nodes' manifests are of different folders.
    """
    files: dict[str, Holding] = {}
    manifests = []
    for node, found in enumerate(s for s in surveys if s is not None):
        for name, (size, head) in found.items():
            if name == MANIFEST_NAME:
                manifests.append(json_document(head, f"{where}/{name} on node {node}", "copy it again from a good "
                                               "copy of the folder. Nothing was written", path=f"{where}/{name}"))
                continue
            known = files.get(name)
            if known is not None and known.size != size:
                raise CheckpointError(f"{where}/{name}: {known.size} bytes on node {known.nodes[0]}, {size} on node "
                                      f"{node}: the nodes hold different files under one name. Make every copy the "
                                      "same. Nothing was written.", path=f"{where}/{name}")
            files[name] = Holding(size, head, (known.nodes if known else ()) + (node,))
    if manifests:
        joined = dump_manifest(joined_copies(manifests, where)).encode()
        files[MANIFEST_NAME] = Holding(len(joined), joined, ())
    return files


class Peers:
    """The requests of one merge across nodes: the writers (node 0's ranks) ask, every other rank serves its node's
    files. `ranks` is the job's `reshard.write.ranks.Ranks` (its stop and gone flags end any wait)."""

    def __init__(self, ranks, folder: Path, writers: tuple[int, ...], nodes):
        import torch

        self.torch, self.dist, self.ranks = torch, ranks.dist, ranks
        self.folder, self.writers, self.nodes = Path(folder), writers, nodes
        self.names: list[str] = []  # file ids: positions in the joined folder's sorted names
        self._lock = threading.Lock()  # one request in flight per process: bounded memory, replies in order

    def server_for(self, holding: Holding) -> int:
        """The rank that serves a file to this writer: one of the first holding node's, spread over its ranks."""
        ranks = self.nodes.ranks[holding.nodes[0]]
        return ranks[self.writers.index(self.ranks.rank) % len(ranks)]

    def _wait(self, work, *, stop: bool = True) -> None:
        """Wait for a send or receive, polling: a rank gone ends the wait, and so does a stop when `stop`."""
        while not work.is_completed():
            if self.ranks.gone:
                raise Agreed(f"{self.ranks.gone}; every rank stopped and nothing was kept.")
            if stop and self.ranks.stop.is_set():
                raise Stopped()
            time.sleep(POLL_S / 10)
        work.wait()

    def fetch(self, name: str, holding: Holding, start: int, view: memoryview) -> None:
        """Fill `view` with `name`'s bytes from `start`, from the node that holds it, a block at a time."""
        for offset in range(0, len(view), READ_BLOCK):
            part = view[offset:offset + READ_BLOCK]
            self._fetch_block(name, holding, start + offset, part)

    def _fetch_block(self, name: str, holding: Holding, start: int, view: memoryview) -> None:
        torch, dist = self.torch, self.dist
        server = self.server_for(holding)
        tag = 2 + 2 * self.ranks.rank
        with self._lock:
            request = torch.tensor([REQUEST, self.ranks.rank, self.names.index(name), start, len(view), tag])
            self._wait(dist.isend(request, server, group=self.ranks.group, tag=REQUEST_TAG))
            status = torch.zeros(1, dtype=torch.int64)
            self._wait(dist.irecv(status, server, group=self.ranks.group, tag=tag))
            if int(status[0]) == FAILED:
                raise Stopped()  # the server announced why
            data = torch.frombuffer(view, dtype=torch.uint8) if len(view) else torch.empty(0, dtype=torch.uint8)
            self._wait(dist.irecv(data, server, group=self.ranks.group, tag=tag + 1))

    def done(self) -> None:
        """A writer is done (or stopped): tell every server, so that each stops once all writers are."""
        torch, dist = self.torch, self.dist
        for server in (r for r in range(self.ranks.world) if r not in self.writers):
            try:
                self._wait(dist.isend(torch.tensor([DONE, self.ranks.rank, 0, 0, 0, 0]), server,
                                      group=self.ranks.group, tag=REQUEST_TAG), stop=False)
            except (Agreed, RuntimeError):
                return  # a rank is gone: every rank stops on that

    def serve(self, files: dict[str, Holding]) -> str | None:
        """Serve this node's files until every writer is done; a failure to read one (announced to every rank so
        the writers stop) or None."""
        torch, dist = self.torch, self.dist
        store = LocalStore(self.folder, links_anywhere=True)
        writers_left, failure = set(self.writers), None
        buffer = bytearray(READ_BLOCK)
        try:
            while writers_left:
                request = torch.zeros(6, dtype=torch.int64)
                # a writer that fails still says done: only a rank gone ends this wait
                self._wait(dist.irecv(request, None, group=self.ranks.group, tag=REQUEST_TAG), stop=False)
                op, writer, file_id, start, length, tag = (int(v) for v in request)
                if op == DONE:
                    writers_left.discard(writer)
                    continue
                failure = failure or self._answer(store, file_id, start, length, writer, tag, buffer)
        finally:
            store.close()
        return failure

    def _answer(self, store, file_id: int, start: int, length: int, writer: int, tag: int, buffer) -> str | None:
        torch, dist = self.torch, self.dist
        name, problem = self.names[file_id], None
        view = memoryview(buffer)[:length]
        try:
            store.readinto(name, start, view)
        except (OSError, CheckpointError) as e:
            problem = f"{self.ranks.host}: cannot read {self.folder / name} to send it to node 0 ({e})"
            self.ranks.announce("stop", problem)
        status = torch.tensor([FAILED if problem else 0])
        self._wait(dist.isend(status, writer, group=self.ranks.group, tag=tag), stop=False)
        if problem is None:
            data = torch.frombuffer(view, dtype=torch.uint8) if length else torch.empty(0, dtype=torch.uint8)
            self._wait(dist.isend(data, writer, group=self.ranks.group, tag=tag + 1), stop=False)
        return problem


class PeerStore(Store):
    """The joined folder as node 0's writers read it: own disk first, then the listing, then a peer node."""

    def __init__(self, files: dict[str, Holding], peers: Peers, node: int, spec: str):
        self.files, self.peers, self.node = files, peers, node
        self.location = spec
        self.remote = True
        self.local = LocalStore(peers.folder, links_anywhere=True)
        peers.names = sorted(files)
        self.serving = True  # cleared once the servers stopped: a read then cannot be answered

    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self.files))

    def _holding(self, name: str) -> Holding:
        if name not in self.files:
            raise FileNotFoundError(f"{self.url(name)}: on no node")
        return self.files[name]

    def size(self, name: str) -> int:
        return self._holding(name).size

    def local_path(self, name: str) -> Path | None:
        holding = self._holding(name)
        return self.local.local_path(name) if self.node in holding.nodes else None

    def read(self, name: str, start: int, length: int) -> bytes:
        view = memoryview(bytearray(length))
        self.readinto(name, start, view)
        return bytes(view)

    def readinto(self, name: str, start: int, view: memoryview) -> None:
        holding = self._holding(name)
        if start + len(view) > holding.size:
            raise CheckpointError(f"{self.url(name)}: {holding.size} bytes, a read of {len(view)} at {start} runs past "
                                  "its end. Nothing was written.", path=self.url(name))
        if start + len(view) <= len(holding.head):
            view[:] = holding.head[start:start + len(view)]
        elif self.node in holding.nodes:
            self.local.readinto(name, start, view)
        elif self.serving:
            self.peers.fetch(name, holding, start, view)
        else:
            raise CheckpointError(f"{self.url(name)}: needed from node {holding.nodes[0]} after the nodes stopped "
                                  "serving. Nothing was written.", path=self.url(name))

    def close(self) -> None:
        self.local.close()
