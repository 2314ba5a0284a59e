"""A folder that lies, whole or in parts, on each node's own disk: a merge across nodes (`merge --node-local`), whose
rank files node 0's ranks read over the job's process group, and a node-local write from a local SRC, where each
node needs only the source files its own ranks' files read.

Each node's first rank lists its copy of the folder (`survey`): every file's size, the header of each
`.safetensors` file and the whole of each small metadata file. Every rank gets every node's listing, so the
ranks of node 0, which write DEST, read one folder (`PeerStore`): a file on their own disk is read there, a header
or a metadata file from the listing, and any other byte range from a rank of a node that holds the file, which
serves requests until every writer is done (`Peers.serve`), rank 0's check of the source CRC-32s included: a writer
never waits on a node that stopped serving (one that has not answered for `REPLY_S` stops every rank). The bytes
travel as gloo point-to-point messages of at most `READ_BLOCK` each, so memory stays bounded, and the engine's usual
checks apply to them as to any remote source: the CRC-32 of each range read is combined and checked against the
manifest before DEST is put in place.
Nodes' copies of a reshard folder (`write --node-local`) each list their own files: their manifests are joined
into the whole folder's (`reshard.manifest.joined_copies`). A node-local write plans from the joined listing too, so
every node plans the same job, but no node serves another: a file a node's ranks need and its disk lacks stops the
write, naming the file and the node.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..errors import CheckpointError
from ..manifest import MANIFEST_NAME, dump_manifest, joined_copies
from ..read import DEPTH, HEADER_PROBE, LocalStore, READ_BLOCK, Store, json_document, sampled_crc
from ._ranks import POLL_S, Agreed, Stopped

_WHOLE_LIMIT = 64 << 20  # a metadata file up to this size travels whole with the listing
_HEADER_LIMIT = 100 << 20  # safetensors' own bound on a header
REQUEST, DONE = 1, 2
REPLY_S = 60.0  # a server that has not answered one block's request by then stopped serving: a deadlock
_REQUEST_TAG = 1  # a writer's request to a server; the replies to writer w use tags 2 + 2w (status) and 3 + 2w (bytes)
_FAILED = 1


@dataclass(frozen=True)
class Listing:
    """A folder each node holds at one path on its own disk: its name in messages, and how a node opens its copy
    (with the rules of a source, or of a folder of rank files, whose links may point anywhere)."""

    spec: str
    open_store: Callable[[], LocalStore]

    @classmethod
    def of_copies(cls, folder) -> "Listing":
        """Rank files: a node's copy of a reshard folder, or what a training save left on the node."""
        return cls(str(folder), lambda: LocalStore(Path(folder), links_anywhere=True))

    @classmethod
    def of_source(cls, spec) -> "Listing":
        """A local SRC (a folder, a Hugging Face cache snapshot) with the rules `reshard.read.locate` gives."""
        from ..read import locate

        return cls(str(spec), lambda: locate(spec).store)


def survey(store: LocalStore) -> dict[str, tuple[int, bytes, str | None]]:
    """This node's copy: file name -> (size, the header of a `.safetensors` file or the whole of a small file, the
    sampled tag of a `.safetensors` file's data for the write's identity, `reshard.read._content`)."""
    found = {}
    for name in store.names():
        size = store.size(name)
        if name.endswith(".safetensors"):
            length = int.from_bytes(store.read(name, 0, 8), "little") if size >= 8 else 0
            # as much as a remote header read asks for first (HEADER_PROBE), so reading SRC needs no request
            head = store.read(name, 0, min(size, max(8 + min(length, _HEADER_LIMIT), HEADER_PROBE)))
            tag = sampled_crc(store, name, 8 + length, size) if 8 + length <= size else None
            found[name] = (size, head, tag)
        else:
            found[name] = (size, store.read(name, 0, size) if size <= _WHOLE_LIMIT else b"", None)
    return found


@dataclass(frozen=True)
class _Holding:
    """One file of the joined folder: its size, the bytes every rank has of it (a header, or the whole of a small
    file), the nodes whose disks hold it, and the first holder's tag of its data (`survey`)."""

    size: int
    head: bytes
    nodes: tuple[int, ...]
    tag: str | None = None


def catalog(surveys: list[dict | None], where: str, node_names=None) -> dict[str, _Holding]:
    """The joined folder from every node's `survey` (None for ranks that did not survey): each name once.
    `node_names(node)`: a node in words, for messages (`Nodes.name`; else `node N`).

    Raises:
        CheckpointError: two nodes hold a file of one name with different sizes (copies of different folders).
        ManifestError: the nodes' manifests are of different writes or folders.
    """
    files: dict[str, _Holding] = {}
    manifests, holders = [], []
    for node, found in enumerate(s for s in surveys if s is not None):
        for name, (size, head, tag) in found.items():
            if name == MANIFEST_NAME:
                holders.append(node_names(node) if node_names is not None else f"node {node}")
                manifests.append(json_document(head, f"{where}/{name} on node {node}", "copy it again from a good "
                                               "copy of the folder. Nothing was written", path=f"{where}/{name}"))
                continue
            known = files.get(name)
            if known is not None and known.size != size:
                raise CheckpointError(f"{where}/{name}: {known.size} bytes on node {known.nodes[0]}, {size} on node "
                                      f"{node}: the nodes hold different files under one name. Make every copy the "
                                      "same. Nothing was written.", path=f"{where}/{name}")
            files[name] = _Holding(size, head, (known.nodes if known else ()) + (node,), known.tag if known else tag)
    if manifests:
        joined = dump_manifest(joined_copies(manifests, where, holders)).encode()
        files[MANIFEST_NAME] = _Holding(len(joined), joined, ())
    return files


class Peers:
    """The requests of one merge across nodes: the writers (node 0's ranks, or every rank: `reshard.write._spread`)
    ask, the ranks of the other nodes serve their node's files. `ranks` is the job's `reshard.write._ranks.Ranks` (its
    stop and gone flags end any wait)."""

    def __init__(self, ranks, folder: Path, writers: tuple[int, ...], nodes):
        import torch

        self.torch, self.dist, self.ranks = torch, ranks.dist, ranks
        self.folder, self.writers, self.nodes = Path(folder), writers, nodes
        self.names: list[str] = []  # file ids: positions in the joined folder's sorted names
        self._lock = threading.Lock()  # one request in flight per process: bounded memory, replies in order

    def server_for(self, holding: _Holding) -> int:
        """The rank that serves a file to this writer: one of the first holding node's, spread over its ranks."""
        ranks = self.nodes.ranks[holding.nodes[0]]
        return ranks[self.writers.index(self.ranks.rank) % len(ranks)]

    def _wait(self, work, reply_from: str | None = None) -> None:
        """Wait for a send or receive. Gloo's point-to-point work cannot be polled (`is_completed` stays False until
        `wait`, and a `wait` that times out closes the connection), so a thread waits while this one watches for a
        rank gone. A stop does not end the wait: every request is answered (a failed read with FAILED), so a writer
        and its server always finish the exchange they started and stop between blocks. A writer waiting for
        `reply_from` (its server, in words) gives up after REPLY_S: a server that no longer serves, though no rank
        died, is a deadlock, and every rank stops on it as on a rank gone."""
        failure: list[BaseException] = []
        deadline = time.monotonic() + REPLY_S

        def complete() -> None:
            try:
                work.wait()
            except BaseException as e:  # noqa: BLE001  raised below, in the waiting thread
                failure.append(e)

        waiter = threading.Thread(target=complete, name="reshard-peer-wait", daemon=True)
        waiter.start()
        while waiter.is_alive():
            waiter.join(POLL_S)
            if waiter.is_alive() and self.ranks.gone:
                raise Agreed(f"{self.ranks.gone}; every rank stopped and nothing was kept.")
            if waiter.is_alive() and reply_from is not None and time.monotonic() > deadline:
                self.ranks.leave(f"rank {self.ranks.rank} waited {REPLY_S:.0f} s for {reply_from} to answer a read, "
                                 "but it no longer serves (a deadlock: no rank died)")
                first = self.ranks.wait_for("gone")  # the first rank's reason: the same on every rank
                raise Agreed(f"{first}; every rank stopped and nothing was kept.")
        if failure:
            raise Agreed(f"{self.ranks.gone or 'a rank of another node went away'} ({failure[0]}); every rank "
                         "stopped and nothing was kept.") from failure[0]

    def fetch(self, name: str, holding: _Holding, start: int, view: memoryview) -> None:
        """Fill `view` with `name`'s bytes from `start`, from the node that holds it, a block at a time."""
        for offset in range(0, len(view), READ_BLOCK):
            if self.ranks.stop.is_set():
                raise Stopped()  # another rank failed: no more requests
            part = view[offset:offset + READ_BLOCK]
            self._fetch_block(name, holding, start + offset, part)

    def _fetch_block(self, name: str, holding: _Holding, start: int, view: memoryview) -> None:
        torch, dist = self.torch, self.dist
        server = self.server_for(holding)
        tag = 2 + 2 * self.ranks.rank
        who = f"rank {server} on {self.nodes.name(self.nodes.of(server))}"
        with self._lock:
            request = torch.tensor([REQUEST, self.ranks.rank, self.names.index(name), start, len(view), tag])
            self._wait(dist.isend(request, server, group=self.ranks.group, tag=_REQUEST_TAG), who)
            status = torch.zeros(1, dtype=torch.int64)
            self._wait(dist.irecv(status, server, group=self.ranks.group, tag=tag), who)
            if int(status[0]) == _FAILED:
                raise Stopped()  # the server announced why
            data = torch.frombuffer(view, dtype=torch.uint8) if len(view) else torch.empty(0, dtype=torch.uint8)
            self._wait(dist.irecv(data, server, group=self.ranks.group, tag=tag + 1), who)

    def done(self) -> None:
        """A writer is done (or stopped): tell every server, so that each stops once all writers are."""
        torch, dist = self.torch, self.dist
        for server in self._others():
            try:
                self._wait(dist.isend(torch.tensor([DONE, self.ranks.rank, 0, 0, 0, 0]), server,
                                      group=self.ranks.group, tag=_REQUEST_TAG),
                           f"rank {server} on {self.nodes.name(self.nodes.of(server))}")
            except (Agreed, RuntimeError):
                return  # a rank is gone: every rank stops on that

    def _others(self) -> list[int]:
        """The ranks of the other nodes: only they ask this rank, and only they serve it (its node's bytes are on its
        own disk)."""
        mine = self.nodes.of(self.ranks.rank)
        return [r for r in range(self.ranks.world) if self.nodes.of(r) != mine]

    def serve(self, files: dict[str, _Holding]) -> str | None:
        """Serve this node's files until every writer is done; a failure to read one (announced to every rank so
        the writers stop) or None."""
        torch, dist = self.torch, self.dist
        store = LocalStore(self.folder, links_anywhere=True)
        writers_left, failure = set(self.writers) & set(self._others()), None
        buffer = bytearray(READ_BLOCK)
        try:
            while writers_left:
                request = torch.zeros(6, dtype=torch.int64)
                # a writer that fails still says done: only a rank gone ends this wait
                self._wait(dist.irecv(request, None, group=self.ranks.group, tag=_REQUEST_TAG))
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
        status = torch.tensor([_FAILED if problem else 0])
        self._wait(dist.isend(status, writer, group=self.ranks.group, tag=tag))
        if problem is None:
            data = torch.frombuffer(view, dtype=torch.uint8) if length else torch.empty(0, dtype=torch.uint8)
            self._wait(dist.isend(data, writer, group=self.ranks.group, tag=tag + 1))
        return problem


class PeerStore(Store):
    """The joined folder as a node's writers read it: own disk first, then the listing, then, gathering, a peer node
    (whose ranks serve in three rounds: while the writers read SRC, while they write, and while rank 0 finishes
    DEST and checks the source files' CRC-32s)."""

    def __init__(self, files: dict[str, _Holding], local: LocalStore, node: int, nodes, spec: str,
                 peers: Peers | None = None, *, in_flight: int = DEPTH):
        self.files, self.local, self.node, self.nodes, self.peers = files, local, node, nodes, peers
        self.location = spec
        self.remote = True
        self.in_flight = in_flight  # a peer's answer is a round trip: the next are asked while one is written
        if peers is not None:
            peers.names = sorted(files)

    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self.files))

    def url(self, name: str) -> str:
        """Where `name` is, with the node whose disk it was read from when that is not this one's."""
        holding = self.files.get(name)
        where = f"{self.location.rstrip('/')}/{name}"
        if holding is None or not holding.nodes or self.node in holding.nodes:
            return where
        return f"{where} on {self.nodes.name(holding.nodes[0])}"

    def _holding(self, name: str) -> _Holding:
        if name not in self.files:
            raise FileNotFoundError(f"{self.url(name)}: on no node")
        return self.files[name]

    def size(self, name: str) -> int:
        return self._holding(name).size

    def content_tag(self, name: str) -> str | None:
        """The tag of `name`'s data its first holder sampled (`reshard.read._content`): the same on every node."""
        return self._holding(name).tag

    def local_path(self, name: str) -> Path | None:
        holding = self._holding(name)
        return self.local.local_path(name) if self.node in holding.nodes else None

    def descriptor(self, name: str) -> int:
        return self.local.descriptor(name)  # the engine asks only for a file `local_path` found on this node

    def check_unchanged(self, name: str) -> None:
        if self.node in self._holding(name).nodes:
            self.local.check_unchanged(name)

    def readinto(self, name: str, start: int, view: memoryview) -> None:
        holding = self._holding(name)
        if start + len(view) > holding.size:
            raise CheckpointError(f"{self.url(name)}: {holding.size} bytes, a read of {len(view)} at {start} runs past "
                                  "its end. Nothing was written.", path=self.url(name))
        if start + len(view) <= len(holding.head):
            view[:] = holding.head[start:start + len(view)]
        elif self.node in holding.nodes:
            self.local.readinto(name, start, view)
        elif self.peers is not None:
            self.peers.fetch(name, holding, start, view)
        else:
            where = f"{self.location.rstrip('/')}/{name}"
            holders = ", ".join(self.nodes.name(n) for n in holding.nodes)
            raise CheckpointError(f"{where} is not on {self.nodes.name(self.node)}'s disk, and its ranks' files read "
                                  f"from it (only {holders} {'holds' if len(holding.nodes) == 1 else 'hold'} it). "
                                  "Copy it to this node at the same path, or give every node SRC where all can read "
                                  "it (a shared file system, s3://, the Hub). Nothing was written.", path=where)

    def close(self) -> None:
        self.local.close()
