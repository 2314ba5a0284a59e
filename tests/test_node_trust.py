"""Trust where nodes' copies meet: one write identity compared by the load and by `merge --node-local`, a merge
across nodes that never waits on a node that stopped serving, and the nodes' order.

On simulated nodes (tests/nodes.py, as in test_node_local.py): each node a torchrun agent with its own disk bound at
one path, every command run as `python -m reshard` would, each under a timeout.
"""

from __future__ import annotations

import json
import shutil
import socket
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from conftest import rank_reports
from nodes import node_disks, run_nodes
from reshard.cli import cli
from reshard.manifest import MANIFEST_NAME
from test_node_local import NODES, NPROC, assert_same_files, merged_here, run_cli

pytestmark = pytest.mark.multirank

EP = ["--fsdp", "4", "--ep", "2"]
HOST = socket.gethostname()  # simulated nodes share the host's name


@pytest.fixture
def disks(tmp_path):
    return node_disks(tmp_path, NODES)


@pytest.fixture(scope="module")
def glm(tiny):
    """GLM-4.5's shape (issue row 13): 10 routed experts, a dense first layer, shared experts."""
    return tiny("glm4_moe", experts=10)


def test_merge_across_nodes_of_a_glm_checkpoint_ends_byte_identical(glm, disks, tmp_path):
    """Row 13: rank 0's check of the source CRC-32s reads bytes no writer read, some on node 1; node 1 serves them
    (it used to have stopped serving: a hang at 2% CPU). DEST equals a one-machine merge byte for byte."""
    mount_at, node_dirs, _ = disks
    cases = [{"argv": ["write", str(glm), str(mount_at / "ep"), *EP, "--node-local", "-q"]},
             {"argv": ["merge", str(mount_at / "ep"), str(mount_at / "merged"), "--node-local", "-q"]}]
    result, found = run_cli(cases, disks, tmp_path, timeout=240)
    for i, case in enumerate(cases):
        assert [g["exit"] for g in found[i]] == [0] * 4, (case["argv"], [g["stderr"] for g in found[i]])
    shared = tmp_path / "shared"
    assert CliRunner().invoke(cli, ["write", str(glm), str(shared), *EP, "-q"]).exit_code == 0
    assert_same_files(node_dirs[0] / "merged", merged_here(shared, tmp_path / "reference"))
    print(f"GLM-shaped merge across nodes: {max(g['seconds'] for g in found[1]):.1f} s")


def test_a_node_that_stops_serving_stops_every_rank(glm, disks, tmp_path):
    """Node 1's ranks drop node 0's requests unanswered and go on serving, alive (a deadlock no death explains):
    the writer gives up after the reply bound (5 s here, 60 s in production) and every rank stops with one
    message naming the rank that did not answer; no DEST is left."""
    mount_at, node_dirs, _ = disks
    write = [{"argv": ["write", str(glm), str(mount_at / "ep"), *EP, "--node-local", "-q"]}]
    _, found = run_cli(write, disks, tmp_path)
    assert [g["exit"] for g in found[0]] == [0] * 4, [g["stderr"] for g in found[0]]
    merge = [{"argv": ["merge", str(mount_at / "ep"), str(mount_at / "merged"), "--node-local", "-q"],
              "fault": "serve-drop"}]
    result, found = run_cli(merge, disks, tmp_path, timeout=120, env={"RESHARD_TEST_REPLY_S": "5"})
    stderr = [g["stderr"] for g in found[0]]
    assert [g["exit"] for g in found[0]] == [1] * 4 and len(set(stderr)) == 1, stderr
    assert "waited 5 s for rank 2 on node 1 (" in stderr[0] or "waited 5 s for rank 3 on node 1 (" in stderr[0], stderr
    assert "no longer serves (a deadlock: no rank died)" in stderr[0] and "Traceback" not in stderr[0], stderr[0]
    assert max(g["seconds"] for g in found[0]) < 60
    assert not (node_dirs[0] / "merged").exists()
    print(f"a node that stopped serving: {max(g['seconds'] for g in found[0]):.1f} s: {stderr[0].strip()}")


# ---- one write identity --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def versions(tiny):
    """Two checkpoints of one shape and different weights: a model at two steps (v1, v2)."""
    return tiny("qwen3_moe", experts=4), tiny("qwen3_moe", experts=4, seed=1)


def write_ranks(src: Path, out: Path, ranks: str, *mesh: str) -> str:
    """`write --ranks` in this process (a node's copy made by hand); its write id."""
    result = CliRunner().invoke(cli, ["write", str(src), str(out), *mesh, "--ranks", ranks, "-q"])
    assert result.exit_code == 0, result.output
    return json.loads((out / MANIFEST_NAME).read_text())["write_id"]


def place(copies: list[Path], node_dirs, name: str) -> None:
    """Node k's disk gets `copies[k]` at `name`."""
    for copy, node_dir in zip(copies, node_dirs):
        shutil.copytree(copy, node_dir / name)


def load_on_nodes(folder_name: str, source: Path, disks, fsdp: int = 4, ep: int = 2) -> list[str | None]:
    """The 2x2 load of `mount_at/folder_name` (reshard.from_pretrained); each rank's error, under a timeout that
    fails the test on a hang."""
    mount_at, node_dirs, reports = disks
    for stale in reports.iterdir():
        stale.unlink()
    started = time.monotonic()
    load = run_nodes("load_reshard.py", "reshard", mount_at / folder_name, source, reports, fsdp, ep, nodes=NODES,
                     nproc=NPROC, mount_at=mount_at, node_dirs=node_dirs, timeout=120)
    elapsed = time.monotonic() - started
    print(f"load of {folder_name} on 2 nodes: refused after {elapsed:.1f} s, imports included")
    assert elapsed < 120
    assert [n.returncode for n in load.nodes] != [0, 0]
    return [report.get("error") for report in rank_reports(reports, NODES * NPROC)]


def test_write_ids_agree_for_one_write_only(versions, tmp_path):
    """Separate `--ranks` runs from one content and mesh get one write id (equal to the shared write's); other
    content at the same path, or another mesh, another. verify prints the id of a node's copy and of a whole
    folder, with and without --against."""
    v1, v2 = versions
    src = tmp_path / "src"
    shutil.copytree(v1, src)
    first = write_ranks(src, tmp_path / "a0", "0-1", *EP)
    assert write_ranks(src, tmp_path / "a1", "2-3", *EP) == first
    whole = tmp_path / "whole"
    assert CliRunner().invoke(cli, ["write", str(src), str(whole), *EP, "-q"]).exit_code == 0
    assert json.loads((whole / MANIFEST_NAME).read_text())["write_id"] == first
    assert write_ranks(src, tmp_path / "m1", "2-3", "--fsdp", "4") != first  # another mesh
    shutil.rmtree(src)
    shutil.copytree(v2, src)  # the next step, at the same path: same names, sizes and headers
    assert write_ranks(src, tmp_path / "b1", "2-3", *EP) != first
    for folder, against in ((tmp_path / "a1", ["--against", str(v1)]), (whole, [])):
        checked = CliRunner().invoke(cli, ["verify", str(folder), *against])
        assert checked.exit_code == 0 and f"Part of write {first[:12]}." in checked.output, checked.output
        as_json = CliRunner().invoke(cli, ["verify", str(folder), "--json"])
        assert json.loads(as_json.stdout)["write_id"] == first, as_json.output


def test_files_of_ranks_a_copy_lacks_is_refused(versions, tmp_path):
    """Row 7: `files --ranks 3` on node 0's copy (ranks 0-1) lists nothing and says which ranks the copy holds."""
    write_ranks(versions[0], tmp_path / "copy0", "0-1", *EP)
    refused = CliRunner().invoke(cli, ["files", str(tmp_path / "copy0"), "--ranks", "3"])
    assert refused.exit_code == 2 and refused.stdout == "", refused.output
    assert "holding the files of ranks 0-1 only (rank 3 needs others)" in refused.output, refused.output
    assert "Nothing was listed." in refused.output
    held = CliRunner().invoke(cli, ["files", str(tmp_path / "copy0"), "--ranks", "0-1"])
    assert held.exit_code == 0 and "shard-00001-model-00001-of-00001.safetensors" in held.stdout, held.output


def assert_refused_everywhere(errors: list, *needles: str) -> str:
    assert all(errors) and len(set(errors)) == 1, errors
    assert all(n in errors[0] for n in needles) and "Traceback" not in errors[0], errors[0]
    return errors[0]


def test_copies_of_two_writes_are_refused_by_load_and_merge(versions, disks, tmp_path):
    """Row 1: node 0's copy written from SRC at v1, node 1's from the same path after it became v2. Row 4: node 0's
    copy at --fsdp 4 --ep 2, node 1's at --fsdp 4. The 2-node load and `merge --node-local` refuse each on every
    rank, with one message naming which node holds which write; no hang, nothing merged."""
    v1, v2 = versions
    mount_at, node_dirs, _ = disks
    src = tmp_path / "src"
    shutil.copytree(v1, src)
    old = write_ranks(src, tmp_path / "v1-0", "0-1", *EP)
    shutil.rmtree(src)
    shutil.copytree(v2, src)
    new = write_ranks(src, tmp_path / "v2-1", "2-3", *EP)
    place([tmp_path / "v1-0", tmp_path / "v2-1"], node_dirs, "steps")
    mesh = write_ranks(v1, tmp_path / "nofsdp-1", "2-3", "--fsdp", "4")
    place([tmp_path / "v1-0", tmp_path / "nofsdp-1"], node_dirs, "meshes")

    steps = assert_refused_everywhere(load_on_nodes("steps", v1, disks), "the nodes hold copies of different writes",
                                      f"node 0 ({HOST}, ranks 0-1) holds write {old[:12]} (--fsdp 4 --ep 2)",
                                      f"node 1 ({HOST}, ranks 2-3) holds write {new[:12]} (--fsdp 4 --ep 2)")
    print(f"row 1, load: {steps}")
    meshes = assert_refused_everywhere(load_on_nodes("meshes", v1, disks), "copies of different writes",
                                       f"holds write {old[:12]} (--fsdp 4 --ep 2)",
                                       f"holds write {mesh[:12]} (--fsdp 4)")
    print(f"row 4, load: {meshes}")

    cases = [{"argv": ["merge", str(mount_at / name), str(mount_at / f"merged-{name}"), "--node-local", "-q"]}
             for name in ("steps", "meshes")]
    result, found = run_cli(cases, disks, tmp_path, timeout=180)
    for i, write in enumerate((new, mesh)):
        stderr = [g["stderr"] for g in found[i]]
        assert [g["exit"] for g in found[i]] == [1] * 4 and len(set(stderr)) == 1, stderr
        assert f"node 0 ({HOST}, ranks 0-1) holds write {old[:12]}" in stderr[0], stderr[0]
        assert f"node 1 ({HOST}, ranks 2-3) holds write {write[:12]}" in stderr[0], stderr[0]
        assert max(g["seconds"] for g in found[i]) < 60
        print(f"row {(1, 4)[i]}, merge --node-local: {max(g['seconds'] for g in found[i]):.1f} s: "
              f"{stderr[0].strip()}")
    assert not any((d / "merged-steps").exists() or (d / "merged-meshes").exists() for d in node_dirs)


def test_nodes_in_another_order_are_told_so(versions, disks, tmp_path):
    """Issue 40's node order: every node holds a copy of the one write, but node 0 holds ranks 2-3's and node 1
    ranks 0-1's (the nodes came up in another order). The load says exactly that first, how to pin the node ranks,
    and only then offers to write again."""
    v1 = versions[0]
    write = write_ranks(v1, tmp_path / "c0", "0-1", *EP)
    write_ranks(v1, tmp_path / "c1", "2-3", *EP)
    place([tmp_path / "c1", tmp_path / "c0"], disks[1], "swapped")
    error = assert_refused_everywhere(load_on_nodes("swapped", v1, disks), "the nodes came up in another order",
                                      f"node 0 ({HOST}) was given ranks 0-1 but holds the copy of ranks 2-3",
                                      f"Every copy is there (write {write[:12]})", "--node-rank")
    assert error.index("--node-rank") < error.index("write it again"), error
    print(f"nodes swapped: {error}")


def strip_write_id(folder: Path) -> dict:
    """Make `folder`'s manifest an older reshard's (no `write_id`); its document."""
    document = json.loads((folder / MANIFEST_NAME).read_text())
    del document["write_id"]
    (folder / MANIFEST_NAME).write_text(json.dumps(document))
    return document


def test_copies_without_a_write_id_join_only_copies_recorded_the_same(versions, tmp_path):
    """Issue 61, row 4: a manifest from before `write_id` still reads (its write unknown, as verify says), but node
    copies of it are never joined on trust: copies of two checkpoints of one shape (v1 on node 0, v2 on node 1)
    record the same mesh, names and shapes, and joining them gave 21-23 of 33 keys matching neither. Whole copies
    recorded the same (CRC-32s included) still join; a copy with an id beside one without is refused too."""
    from reshard.errors import ManifestError
    from reshard.manifest import joined_copies

    v1, v2 = versions
    write_ranks(v1, tmp_path / "c0", "0-1", *EP)
    with_id = json.loads((tmp_path / "c0" / MANIFEST_NAME).read_text())
    old = strip_write_id(tmp_path / "c0")
    write_ranks(v1, tmp_path / "c1", "2-3", *EP)
    other = strip_write_id(tmp_path / "c1")
    write_ranks(v2, tmp_path / "v2", "2-3", *EP)
    stepped = strip_write_id(tmp_path / "v2")
    for documents in ([old, other], [old, stepped], [with_id, stepped]):
        with pytest.raises(ManifestError, match=r"(holds a copy|hold copies) with no write_id \(written by a reshard older than "
                                                r"write identities\).*--node-local.*Nothing was changed"):
            joined_copies(documents, "old", ["node 0", "node 1"])
    assert joined_copies([old, dict(old)], "old") == {k: v for k, v in old.items() if k != "holds"}
    checked = CliRunner().invoke(cli, ["verify", str(tmp_path / "c1")])
    assert checked.exit_code == 0 and "Part of a write of unknown identity" in checked.output, checked.output


def test_node_copies_without_a_write_id_are_refused_by_load_and_merge(versions, disks, tmp_path):
    """Row 4 on simulated nodes: node 0 holds v1's ranks 0-1 with no write_id, node 1 v2's ranks 2-3 (with its id,
    or without). The 2-node load and `merge --node-local` stop every rank within 60 s with one message naming the
    copy without an identity and the command that writes it again; nothing is merged."""
    v1, v2 = versions
    mount_at, node_dirs, _ = disks
    write_ranks(v1, tmp_path / "v1-0", "0-1", *EP)
    strip_write_id(tmp_path / "v1-0")
    write_ranks(v2, tmp_path / "v2-1", "2-3", *EP)
    place([tmp_path / "v1-0", tmp_path / "v2-1"], node_dirs, "mixed")
    error = assert_refused_everywhere(load_on_nodes("mixed", v1, disks),
                                      f"node 0 ({HOST}, ranks 0-1) holds a copy with no write_id",
                                      "-m reshard write SRC OUT ... --node-local")
    assert "node 1" not in error.split("no write_id")[0], error
    print(f"row 4, load: {error}")
    merge = [{"argv": ["merge", str(mount_at / "mixed"), str(mount_at / "merged-mixed"), "--node-local", "-q"]}]
    result, found = run_cli(merge, disks, tmp_path, timeout=180)
    stderr = [g["stderr"] for g in found[0]]
    assert [g["exit"] for g in found[0]] == [1] * 4 and len(set(stderr)) == 1, stderr
    assert "holds a copy with no write_id" in stderr[0] and "Traceback" not in stderr[0], stderr[0]
    assert max(g["seconds"] for g in found[0]) < 60
    assert not any((d / "merged-mixed").exists() for d in node_dirs)
    print(f"row 4, merge --node-local: {max(g['seconds'] for g in found[0]):.1f} s: {stderr[0].strip()}")
