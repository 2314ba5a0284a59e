"""A node's ranks, end to end in plain data: torchrun's view of each process becomes the node's ranks
(`reshard.write._nodes.Nodes`), their spans (`reshard.plan._ranks.RankSpans`: what `--ranks` and the messages say) and
the coordinates whose files the node writes or loads (`MeshSpec.coords_of`); a loading rank derives the same span from
LOCAL_RANK and LOCAL_WORLD_SIZE (`reshard.load._agreement`). No process is started: the simulated-node tests
(tests/test_node_local.py, slow) run the same path under torchrun; these catch a node whose last rank is dropped in
milliseconds."""

from __future__ import annotations

import pytest

from reshard.load._agreement import _node_ranks
from reshard.plan import MeshSpec
from reshard.plan import RankSpans
from reshard.write._nodes import Nodes

# (nodes, processes per node, mesh of nodes x processes ranks): spans shorter than, equal to and longer than fsdp
JOBS = [(2, 4, MeshSpec(fsdp=8)), (2, 4, MeshSpec(fsdp=8, ep=2)), (2, 2, MeshSpec(fsdp=4, ep=2)),
        (2, 4, MeshSpec(fsdp=4, dp_replicate=2)), (4, 2, MeshSpec(fsdp=4, dp_replicate=2)),
        (2, 3, MeshSpec(fsdp=2, dp_replicate=3)), (3, 1, MeshSpec(fsdp=3))]


def views(nodes: int, nproc: int) -> list[tuple[str, str]]:
    """Every rank's `(node key, host)` as torchrun numbers them: node k runs ranks k * nproc ... k * nproc + nproc - 1."""
    return [(f"agent {r // nproc}", f"host{r // nproc}") for r in range(nodes * nproc)]


@pytest.mark.parametrize("nodes, nproc, mesh", JOBS, ids=lambda v: str(v) if not isinstance(v, MeshSpec) else v.flags())
def test_each_node_gets_all_its_ranks_and_their_coordinates(nodes, nproc, mesh, monkeypatch):
    assert mesh.world_size == nodes * nproc
    found = Nodes.from_views(views(nodes, nproc))
    assert found.ranks == tuple(tuple(range(k * nproc, (k + 1) * nproc)) for k in range(nodes))
    for node, team in enumerate(found.ranks):
        first, last = node * nproc, node * nproc + nproc - 1
        spans = RankSpans.of(team)  # what `--node-local` hands the write job (`WriteJob.for_node`)
        assert spans == ((first, last),)
        assert str(spans) == (f"{first}-{last}" if nproc > 1 else f"{first}")
        assert found.name(node) == f"node {node} (host{node}, ranks {spans})"
        assert RankSpans.parse(str(spans)).expand(mesh.world_size) == list(team)  # `--ranks` as the message says it
        assert mesh.coords_of(spans) == sorted({mesh.coord_of(r) for r in team})  # the files the node holds
        for local, rank in enumerate(team):  # a loading rank's view of its node (torchrun's environment)
            monkeypatch.setenv("LOCAL_RANK", str(local))
            monkeypatch.setenv("LOCAL_WORLD_SIZE", str(nproc))
            assert _node_ranks(rank) == spans, (node, rank)


def test_a_node_of_scattered_ranks_keeps_every_one():
    """Ranks placed round-robin over two hosts: every rank in its node, each node's spans naming each rank."""
    found = Nodes.from_views([(f"host {r % 2}", f"h{r % 2}") for r in range(8)])
    assert found.ranks == ((0, 2, 4, 6), (1, 3, 5, 7))
    assert [found.of(r) for r in range(8)] == [0, 1] * 4
    spans = RankSpans.of(found.ranks[1])
    assert spans == ((1, 1), (3, 3), (5, 5), (7, 7)) and str(spans) == "1,3,5,7"
    assert spans.expand(8) == [1, 3, 5, 7]
    assert MeshSpec(fsdp=8).coords_of(spans) == [1, 3, 5, 7]
    assert RankSpans.of([3, 4, 5, 9]) == ((3, 5), (9, 9)) and RankSpans.of([7]) == ((7, 7),)
