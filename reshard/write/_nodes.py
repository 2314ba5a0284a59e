"""The ranks of a distributed write or merge by node, and whether a command runs as one rank of such a job."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from ..errors import UsageError
from ..launch import launcher_world_size
from ..plan import RankSpans


def use_distributed(distributed: bool | None, workers: int | None, command: str) -> bool:
    """Whether a `command` runs as one rank of a distributed job: `distributed`, or, when None, what the launcher's
    environment says (`RANK`, `LOCAL_RANK`, `WORLD_SIZE` > 1).

    Raises:
        UsageError: `workers` above 1 in a distributed run (every rank writes its share there).
    """
    if distributed is None:
        distributed = (launcher_world_size() or 1) > 1
    if distributed and workers not in (None, 1):
        raise UsageError(f"--workers {workers} is for a {command} on one machine; in a torchrun {command} every rank "
                         "writes its share (for more writers per node, raise --nproc-per-node). Nothing was written.")
    return bool(distributed)


@dataclass(frozen=True)
class Nodes:
    """The job's ranks by node, nodes numbered in the order of their lowest rank.

    Attributes:
        ranks: each node's global ranks, ascending.
        hosts: each node's host name, for messages.
    """

    ranks: tuple[tuple[int, ...], ...]
    hosts: tuple[str, ...]

    @classmethod
    def from_views(cls, views: list[tuple[str, str]]) -> "Nodes":
        """From every rank's `(node key, host)`, in rank order."""
        keys: dict[str, list[int]] = {}
        for rank, (key, _) in enumerate(views):
            keys.setdefault(key, []).append(rank)
        groups = sorted(keys.values())
        return cls(tuple(tuple(g) for g in groups), tuple(views[g[0]][1] for g in groups))

    def of(self, rank: int) -> int:
        return next(n for n, ranks in enumerate(self.ranks) if rank in ranks)

    def name(self, node: int) -> str:
        return f"node {node} ({self.hosts[node]}, ranks {RankSpans.of(self.ranks[node])})"

    def node_local_hint(self, problems: list) -> str:
        """Files missing on some nodes of a shared job over several: likely each node holds its own (node-local
        copies)."""
        lacking = (": missing (", "is in no chunk")  # a file, or a chunk of a node-local copy's joined manifest
        if len(self.ranks) < 2 or not any(p and any(w in p for w in lacking) for p in problems):
            return ""
        return ("If each node holds only its own files (a node-local copy, or a training save on each node's disk), "
                "pass --node-local.")


def node_key() -> tuple[str, str]:
    """This process's `(node key, host)`: torchrun's agent number (`GROUP_RANK`) tells simulated or same-named
    nodes apart; without it, the host name."""
    host = socket.gethostname()
    group = os.environ.get("GROUP_RANK")
    return (f"agent {group}" if group is not None else f"host {host}"), host
