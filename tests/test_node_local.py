"""Many nodes, each with its own disk: `write --node-local` under a 2-node torchrun, `write --ranks` in one process,
`verify` of each node's copy, the 2x2 load from node-local copies, and the faults that must stop every rank.

Each node is a torchrun agent in its own mount namespace with its own folder bound at one path (tests/nodes.py),
so a node sees only its own copy; agents meet with static rendezvous on 127.0.0.1 (global rank = node * 2 + local
rank). Every command runs as `python -m reshard` would (tests/ranks/write_cli.py), each under a timeout.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from conftest import rank_reports
from nodes import Kill, node_disks, read_only, run_nodes, tmpfs_disk
from reshard.cli import cli
from reshard.manifest import MANIFEST_NAME
from test_loader import OWN_READER, assert_loaded_exactly

pytestmark = pytest.mark.multirank

NODES, NPROC = 2, 2
MESHES = {"ep": ["--fsdp", "4", "--ep", "2"], "replicas": ["--fsdp", "2", "--dp-replicate", "2"]}
# A killed node is noticed after 10 s without heartbeats instead of production's 30 (docs/faults.md gives the times
# with 30 s): the same path, 20 s less of CI per kill.
QUICK_HEARTBEATS = {"RESHARD_TEST_STALE_S": "10"}


@pytest.fixture
def disks(tmp_path):
    """`(mount_at, node_dirs, reports)` (`nodes.node_disks`)."""
    return node_disks(tmp_path, NODES)


@pytest.fixture(scope="module")
def source(tiny):
    return tiny("qwen3_moe", experts=4)


@pytest.fixture(scope="module")
def shared(source, tmp_path_factory):
    """Each mesh written the usual way, into one folder: what every node's copy must match byte for byte."""
    root = tmp_path_factory.mktemp("shared")
    for name, flags in MESHES.items():
        result = CliRunner().invoke(cli, ["write", str(source), str(root / name), *flags, "-q"])
        assert result.exit_code == 0, result.output
    return root


def run_cli(cases: list[dict], disks, tmp_path: Path, **kwargs):
    """Run `cases` (see tests/ranks/write_cli.py) on every rank of the 2-node job; (result, reports by case)."""
    mount_at, node_dirs, reports = disks
    cases_file = tmp_path / "cases.json"
    cases_file.write_text(json.dumps(cases))
    result = run_nodes("write_cli.py", cases_file, reports, nodes=NODES, nproc=NPROC, mount_at=mount_at,
                       node_dirs=node_dirs, **kwargs)
    found = {}
    for i in range(len(cases)):
        paths = [reports / f"case{i}-rank{r}.json" for r in range(NODES * NPROC)]
        found[i] = [json.loads(p.read_text()) if p.exists() else None for p in paths]
    return result, found


def node_ranks(node: int) -> str:
    return f"{node * NPROC}-{node * NPROC + NPROC - 1}"


def expected_names(shared_folder: Path, node: int) -> set[str]:
    """What `reshard files` lists for the node's ranks, plus the extras files on the node holding rank 0."""
    listed = CliRunner().invoke(cli, ["files", str(shared_folder), "--ranks", node_ranks(node)])
    assert listed.exit_code == 0, listed.output
    names = set(listed.stdout.split())
    if node == 0:
        names |= {p.name for p in shared_folder.glob("extra-*.safetensors")}
    return names


def assert_node_copy(copy: Path, shared_folder: Path, node: int) -> int:
    """The node's copy: exactly its ranks' files, each byte-identical to the shared write's, and a manifest that
    records the ranks it holds; returns its bytes."""
    names = {p.name for p in copy.iterdir()}
    assert names == expected_names(shared_folder, node), (node, sorted(names))
    for name in names - {MANIFEST_NAME}:
        assert (copy / name).read_bytes() == (shared_folder / name).read_bytes(), (node, name)
    first, last = (int(r) for r in node_ranks(node).split("-"))
    assert json.loads((copy / MANIFEST_NAME).read_text())["holds"] == [[first, last]]
    return sum(p.stat().st_size for p in copy.iterdir())


def test_node_local_write_verify_and_load(source, shared, disks, tmp_path):
    """One job writes each mesh node-local and verifies each node's copy; then a 2x2 load from those copies is exact
    on every rank. A mesh that does not fit the job is refused on every rank with one message."""
    mount_at, node_dirs, reports = disks
    cases = []
    for name, flags in MESHES.items():
        cases.append({"argv": ["write", str(source), str(mount_at / name), *flags, "--node-local", "-q"]})
        cases.append({"argv": ["verify", str(mount_at / name), "--against", str(source)]})
    cases.append({"argv": ["write", str(source), str(mount_at / "too-big"), "--fsdp", "8", "--node-local", "-q"]})
    result, found = run_cli(cases, disks, tmp_path, timeout=240)
    assert [n.returncode for n in result.nodes] == [0, 0], [n.stderr[-3000:] for n in result.nodes]
    for i, case in enumerate(cases[:-1]):
        assert [g["exit"] for g in found[i]] == [0] * 4, (case["argv"], [g["stderr"] for g in found[i]])
    # every node says what it wrote, on its first rank only; node 0 adds the job's totals
    said = [g["stdout"] for g in found[0]]
    assert said[1] == said[3] == "", said
    for node in range(NODES):
        assert f"wrote {mount_at / 'ep'} on node {node} (" in said[node * NPROC], said
        assert f"ranks {node_ranks(node)}), this node's copy: 2 files (" in said[node * NPROC], said
    assert "the job: 2 nodes, 4 files (" in said[0] and "the job: " not in said[2], said
    assert said[0].count("\n  node ") == 2, said[0]

    whole = {name: sum(p.stat().st_size for p in (shared / name).iterdir()) for name in MESHES}
    for node in range(NODES):
        for j, name in enumerate(MESHES):
            written = assert_node_copy(node_dirs[node] / name, shared / name, node)
            print(f"node {node}, {name}: {written} of {whole[name]} bytes of the shared write")
            verified = found[2 * j + 1][node * NPROC]["stdout"]
            assert f"OK {mount_at / name} (a node's copy: the files of ranks {node_ranks(node)})" in verified, verified
    replicas = [sum(p.stat().st_size for p in (node_dirs[k] / "replicas").iterdir()) for k in range(NODES)]
    assert replicas[0] == replicas[1]  # each node holds both coordinates of its replica

    refused = found[len(cases) - 1]
    assert {g["exit"] for g in refused} == {2}, [g["stderr"] for g in refused]
    assert len({g["stderr"].splitlines()[-1] for g in refused}) == 1
    assert "--fsdp 8 has 8 ranks, but this torchrun job runs 4 processes on 2 nodes" in refused[0]["stderr"]
    assert not any((d / "too-big").exists() for d in node_dirs)

    load = run_nodes("load_reshard.py", "reshard", mount_at / "ep", source, reports, 4, 2, nodes=NODES, nproc=NPROC,
                     mount_at=mount_at, node_dirs=node_dirs, timeout=240)
    assert [n.returncode for n in load.nodes] == [0, 0], [n.stderr[-3000:] for n in load.nodes]
    assert_loaded_exactly(rank_reports(reports, 4), ep=2, readers=OWN_READER)


def test_write_ranks_in_one_process_is_the_node_copy(source, shared, tmp_path):
    """`write --ranks` without torchrun writes the folder a node gets: the same files, byte for byte, the manifest
    included (what `assert_node_copy` checks against the shared write)."""
    out = tmp_path / "node1"
    result = CliRunner().invoke(cli, ["write", str(source), str(out), *MESHES["ep"], "--ranks", "2-3", "-q"])
    assert result.exit_code == 0, result.output
    assert f"wrote {out} (a node's copy: the files of ranks 2-3): 2 files (" in result.output, result.output
    assert_node_copy(out, shared / "ep", 1)
    checked = CliRunner().invoke(cli, ["verify", str(out), "--against", str(source)])
    assert checked.exit_code == 0 and "(a node's copy: the files of ranks 2-3)" in checked.output, checked.output
    # a node's copy is no whole checkpoint: verifying a merged folder against it says so, and that nothing changed
    merged = tmp_path / "merged"
    assert CliRunner().invoke(cli, ["merge", str(shared / "ep"), str(merged), "-q"]).exit_code == 0
    against_copy = CliRunner().invoke(cli, ["verify", str(merged), "--against", str(out)])
    assert against_copy.exit_code != 0 and f"{out} is a node's copy: it holds the files of ranks 2-3 only" in \
        against_copy.output and "Nothing was written" not in against_copy.output, against_copy.output
    refused = CliRunner().invoke(cli, ["verify", str(out), "--ranks", "0-1"])
    assert refused.exit_code == 2 and "holding the files of ranks 2-3 only (rank 0 needs others)" in refused.output
    outside = CliRunner().invoke(cli, ["write", str(source), str(tmp_path / "x"), *MESHES["ep"], "--ranks", "2-4"])
    assert outside.exit_code == 2 and "--ranks names rank 4, but the mesh has 4 ranks" in outside.output
    alone = CliRunner().invoke(cli, ["write", str(source), str(tmp_path / "y"), *MESHES["ep"], "--node-local"])
    assert alone.exit_code == 2 and "--ranks FIRST-LAST" in alone.output, alone.output
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_verify_ranks_of_a_copy_staged_by_hand(shared, tmp_path):
    """A node's files copied from a whole folder (`reshard files --ranks`): verify of the whole folder reports the
    other node's files missing; `--ranks` checks just these, and catches one flipped byte among them."""
    listed = CliRunner().invoke(cli, ["files", str(shared / "ep"), "--ranks", "2-3"]).stdout.split()
    staged = tmp_path / "staged"
    staged.mkdir()
    for name in listed:
        (staged / name).write_bytes((shared / "ep" / name).read_bytes())
    whole = CliRunner().invoke(cli, ["verify", str(staged)])
    assert whole.exit_code == 1 and "shard-00001-model-00001-of-00001.safetensors: missing" in whole.output
    mine = CliRunner().invoke(cli, ["verify", str(staged), "--ranks", "2-3"])
    assert mine.exit_code == 0 and "(a node's copy: the files of ranks 2-3)" in mine.output, mine.output
    victim = staged / "shard-00004-model-00001-of-00001.safetensors"
    raw = bytearray(victim.read_bytes())
    raw[-7] ^= 0x10
    victim.write_bytes(bytes(raw))
    damaged = CliRunner().invoke(cli, ["verify", str(staged), "--ranks", "2-3"])
    assert damaged.exit_code == 1 and "shard-00004-model-00001-of-00001.safetensors: CRC-32 differs" in damaged.output


@pytest.mark.slow  # simulated nodes: faults and sources
def test_a_node_without_its_ranks_files_stops_every_rank(source, shared, disks, tmp_path):
    """Both nodes given node 0's copy: node 1's ranks cannot load, and every rank raises the same LoadError, which
    names node 1, its ranks and the commands that would give it its files."""
    mount_at, node_dirs, reports = disks
    result = CliRunner().invoke(cli, ["write", str(source), str(tmp_path / "copy0"), *MESHES["ep"], "--ranks", "0-1",
                                      "-q"])
    assert result.exit_code == 0, result.output
    for d in node_dirs:
        (d / "ep").mkdir()
        for p in (tmp_path / "copy0").iterdir():
            (d / "ep" / p.name).write_bytes(p.read_bytes())
    load = run_nodes("load_reshard.py", "reshard", mount_at / "ep", source, reports, 4, 2, nodes=NODES, nproc=NPROC,
                     mount_at=mount_at, node_dirs=node_dirs, timeout=120)
    assert [n.returncode for n in load.nodes] != [0, 0]
    errors = [report.get("error") for report in rank_reports(reports, 4)]
    assert len(set(errors)) == 1, errors
    assert "on node 1 (" in errors[0] and "holds the files of ranks 0-1 only" in errors[0], errors[0]
    assert "--ranks 2-3" in errors[0] and "--node-local" in errors[0] and "reshard files" in errors[0], errors[0]
    print(errors[0])


def assert_nothing_on_any_node(node_dirs, name: str) -> None:
    for d in node_dirs:
        assert [p.name for p in d.iterdir() if name in p.name] == [], (d, sorted(p.name for p in d.iterdir()))


def assert_one_failure(result, found: list[dict], *needles: str) -> list[dict]:
    """Every agent exited cleanly and every rank failed with one and the same message, holding `needles`, within
    60 s; the ranks' reports."""
    assert [n.returncode for n in result.nodes] == [0, 0], [n.stderr[-3000:] for n in result.nodes]
    assert {g["exit"] for g in found} == {1} and len({g["stderr"] for g in found}) == 1, [g["stderr"] for g in found]
    assert all(needle in found[0]["stderr"] for needle in needles), found[0]["stderr"]
    # from each rank's start of the command, which includes waiting for the other node's ranks to import (a minute
    # on a busy machine); a rank stuck on a dead peer would wait for gloo's timeout (600 s)
    assert max(g["seconds"] for g in found) < 120
    return found


@pytest.mark.slow  # simulated nodes: faults and sources
def test_faults_stop_every_rank_and_leave_nothing(source, disks, tmp_path):
    """A disk that fills mid-write on node 1 and an OUT node 1 cannot write: every rank stops with one message
    within 60 s, and no node keeps a folder or a temporary."""
    mount_at, node_dirs, reports = disks
    ep = MESHES["ep"]
    cases = [{"argv": ["write", str(source), str(mount_at / "full"), *ep, "--node-local", "-q"], "fault": "enospc:2"}]
    result, found = run_cli(cases, disks, tmp_path, timeout=120)
    full = assert_one_failure(result, found[0], "no space left on the device")
    print(f"disk full on node 1: {max(g['seconds'] for g in full):.1f} s: {full[0]['stderr'].strip()}")
    assert_nothing_on_any_node(node_dirs, "full")


@pytest.mark.slow  # simulated nodes: faults and sources
def test_an_out_a_node_cannot_write_stops_every_rank(source, disks, tmp_path):
    mount_at, node_dirs, reports = disks
    cases = [{"argv": ["write", str(source), str(mount_at / "ro"), *MESHES["ep"], "--node-local", "-q"]}]
    result, found = run_cli(cases, disks, tmp_path, timeout=120, setup={1: read_only()})
    refused = assert_one_failure(result, found[0], "node 1 (", "Read-only file system")
    print(f"read-only OUT on node 1: {max(g['seconds'] for g in refused):.1f} s: {refused[0]['stderr'].strip()}")
    assert_nothing_on_any_node(node_dirs, "ro")


@pytest.mark.slow  # simulated nodes: faults and sources
def test_a_disk_too_small_on_one_node_is_refused_before_writing(source, disks, tmp_path):
    mount_at, node_dirs, reports = disks
    cases = [{"argv": ["write", str(source), str(mount_at / "small"), *MESHES["ep"], "--node-local", "-q"]}]
    result, found = run_cli(cases, disks, tmp_path, timeout=120, setup={1: tmpfs_disk(64 * 1024)})
    refused = assert_one_failure(result, found[0], "node 1 (", "free, the output needs")
    print(f"small disk on node 1: {max(g['seconds'] for g in refused):.1f} s: {refused[0]['stderr'].strip()}")
    assert_nothing_on_any_node(node_dirs, "small")


@pytest.mark.slow  # simulated nodes: faults and sources
def test_a_node_killed_mid_write_stops_the_others(source, disks, tmp_path):
    """Node 1 killed (agent and workers) while it writes: node 0's ranks stop within 60 s with one message and
    keep nothing; node 1's temporary folder, which no process was left to remove, goes with the next write, which
    then succeeds."""
    mount_at, node_dirs, reports = disks
    out = mount_at / "killed"
    cases = [{"argv": ["write", str(source), str(out), *MESHES["ep"], "--node-local", "-q"],
              "fault": f"sleep:2:{mount_at / 'started'}", "exit": True}]  # as `python -m reshard` would
    result, found = run_cli(cases, disks, tmp_path, timeout=150, kill=Kill(node=1, when_file="started"),
                            env=QUICK_HEARTBEATS)
    assert result.nodes[1].returncode == -9
    survivors = found[0][:NPROC]
    assert {g["exit"] for g in survivors} == {1} and len({g["stderr"] for g in survivors}) == 1, survivors
    assert "stopped responding" in survivors[0]["stderr"] or "left" in survivors[0]["stderr"], survivors[0]
    waited = result.kill_to_exit
    assert waited < 60, waited
    print(f"node 1 killed: node 0 stopped {waited:.1f} s later: {survivors[0]['stderr'].strip()}")
    assert [p.name for p in node_dirs[0].iterdir() if p.name != "started"] == []
    assert not (node_dirs[1] / "killed").exists()
    again, found = run_cli([{"argv": ["write", str(source), str(out), *MESHES["ep"], "--node-local", "-q"]}], disks,
                           tmp_path, timeout=150)
    assert [g["exit"] for g in found[0]] == [0] * 4, [g["stderr"] for g in found[0]]
    assert sorted(p.name for p in node_dirs[1].iterdir() if p.name != "started") == ["killed"]


# ---- merge across nodes --------------------------------------------------------------------------------------------

def merged_here(folder: Path, dest: Path, *args: str) -> Path:
    """`folder` merged in this process: the reference a merge across nodes must equal byte for byte."""
    result = CliRunner().invoke(cli, ["merge", str(folder), str(dest), *args, "-q"])
    assert result.exit_code == 0, result.output
    return dest


def assert_same_files(found: Path, reference: Path) -> None:
    names = sorted(p.name for p in reference.iterdir())
    assert sorted(p.name for p in found.iterdir()) == names
    for name in names:
        assert (found / name).read_bytes() == (reference / name).read_bytes(), name


def test_merge_across_nodes(source, shared, disks, tmp_path):
    """The rank files on each node's own disk, merged by node 0's ranks with the other node's bytes sent over the
    process group: a node-local write's copies (their manifests joined, CRC-32s checked) and a training save's
    folders (config.json on node 0 only). Each DEST, on node 0 only, equals a merge of the same files gathered on one
    machine, byte for byte."""
    mount_at, node_dirs, reports = disks
    saved = tmp_path / "saved"  # what save_pretrained(distributed_checkpoint=True) leaves: rank files and config
    saved.mkdir()
    for p in (shared / "ep").iterdir():
        if p.name != MANIFEST_NAME:
            (saved / p.name).write_bytes(p.read_bytes())
    for node, d in enumerate(node_dirs):
        (d / "saved").mkdir()
        for name in expected_names(shared / "ep", node) - {MANIFEST_NAME}:
            if node == 0 or name.startswith("shard-"):  # config.json only on node 0, as a training save leaves it
                (d / "saved" / name).write_bytes((saved / name).read_bytes())
    cases = [{"argv": ["write", str(source), str(mount_at / "ep"), *MESHES["ep"], "--node-local", "-q"]},
             {"argv": ["merge", str(mount_at / "ep"), str(mount_at / "merged"), "--node-local",
                       "--max-shard-size", "150KB", "-q"]},
             {"argv": ["merge", str(mount_at / "saved"), str(mount_at / "merged-saved"), "--node-local", "-q"]},
             {"argv": ["merge", str(mount_at / "ep"), str(mount_at / "not-local"), "-q"]}]  # the flag forgotten
    result, found = run_cli(cases, disks, tmp_path, timeout=240)
    assert [n.returncode for n in result.nodes] == [0, 0], [n.stderr[-3000:] for n in result.nodes]
    for i, case in enumerate(cases[:-1]):
        assert [g["exit"] for g in found[i]] == [0] * 4, (case["argv"], [g["stderr"] for g in found[i]])
    # node 1 says what its copy gave; node 0's next line compares DEST with the checkpoint the copies came from (node
    # 0's own copy holds ranks 0-1 only), and runs as printed
    said = [g["stdout"] for g in found[1]]
    assert said[1] == said[3] == "", said
    assert said[2].startswith("node 1 (") and f"ranks 2-3): served its copy of {mount_at / 'ep'}, 2 rank files (" \
        in said[2], said[2]
    line = f"reshard verify {mount_at / 'merged'} --against {source}"
    assert f"next:\n  {line}\n" in said[0], said[0]
    here = CliRunner().invoke(cli, ["verify", str(node_dirs[0] / "merged"), "--against", str(source)])
    assert here.exit_code == 0, here.output
    assert f"next:\n  reshard verify {mount_at / 'merged-saved'}\n" in found[2][0]["stdout"], found[2][0]["stdout"]
    # each node's copy says it is one, and how to merge them all
    assert_one_failure(result, found[len(cases) - 1], "cannot write",
                                f"{mount_at / 'ep'} is a node's copy: it holds the files of ranks 0-1 only",
                                f"-m reshard merge {mount_at / 'ep'} DEST --node-local`")
    assert_nothing_on_any_node(node_dirs, "not-local")
    assert_same_files(node_dirs[0] / "merged", merged_here(shared / "ep", tmp_path / "ref", "--max-shard-size",
                                                          "150KB"))
    assert_same_files(node_dirs[0] / "merged-saved", merged_here(saved, tmp_path / "ref-saved"))
    assert not (node_dirs[1] / "merged").exists() and not (node_dirs[1] / "merged-saved").exists()
    print(f"merge across nodes: {found[1][0]['seconds']:.1f} s; from saved folders {found[2][0]['seconds']:.1f} s")


@pytest.mark.slow  # simulated nodes: faults and sources
def test_a_flipped_byte_on_another_node_stops_the_merge(source, disks, tmp_path):
    """One byte flipped in a file only node 1 holds: the bytes node 0 receives fail the manifest's CRC-32, every
    rank exits 1 with one message naming the file, and no DEST is left on either node."""
    mount_at, node_dirs, reports = disks
    write = [{"argv": ["write", str(source), str(mount_at / "ep"), *MESHES["ep"], "--node-local", "-q"]}]
    _, found = run_cli(write, disks, tmp_path)
    assert [g["exit"] for g in found[0]] == [0] * 4, [g["stderr"] for g in found[0]]
    only_there = sorted(set(p.name for p in (node_dirs[1] / "ep").glob("shard-*"))
                        - set(p.name for p in (node_dirs[0] / "ep").glob("shard-*")))
    victim = node_dirs[1] / "ep" / only_there[-1]
    raw = bytearray(victim.read_bytes())
    raw[-5] ^= 0x01
    victim.write_bytes(bytes(raw))
    merge = [{"argv": ["merge", str(mount_at / "ep"), str(mount_at / "merged"), "--node-local", "-q"]}]
    result, found = run_cli(merge, disks, tmp_path)
    assert [g["exit"] for g in found[0]] == [1] * 4, [g["stderr"] for g in found[0]]
    message = found[0][0]["stderr"]  # rank 0 checks; the others say rank 0 could not complete DEST, and why
    assert all(message.removeprefix("Error: ") in g["stderr"] for g in found[0]), [g["stderr"] for g in found[0]]
    assert f"{only_there[-1]} on node 1 (" in message and "CRC-32" in message and "Traceback" not in message, message
    print(f"a flipped byte on node 1, merge: {max(g['seconds'] for g in found[0]):.1f} s: {message.strip()}")
    assert not (node_dirs[0] / "merged").exists() and not (node_dirs[1] / "merged").exists()


@pytest.mark.slow  # simulated nodes: faults and sources
def test_a_node_killed_mid_merge_stops_node_0(source, disks, tmp_path):
    """Node 1 killed while it serves its files: node 0's ranks, which write DEST, stop with one message within
    60 s and leave nothing; the next merge succeeds."""
    mount_at, node_dirs, reports = disks
    write = [{"argv": ["write", str(source), str(mount_at / "ep"), *MESHES["ep"], "--node-local", "-q"]}]
    _, found = run_cli(write, disks, tmp_path)
    assert [g["exit"] for g in found[0]] == [0] * 4, [g["stderr"] for g in found[0]]
    merge = {"argv": ["merge", str(mount_at / "ep"), str(mount_at / "merged"), "--node-local", "-q"]}
    result, found = run_cli([{**merge, "fault": f"serve-sleep:{mount_at / 'serving'}", "exit": True}], disks,
                            tmp_path, timeout=150, kill=Kill(node=1, when_file="serving"), env=QUICK_HEARTBEATS)
    assert result.nodes[1].returncode == -9
    survivors = found[0][:NPROC]
    assert {g["exit"] for g in survivors} == {1} and len({g["stderr"] for g in survivors}) == 1, survivors
    assert "Traceback" not in survivors[0]["stderr"], survivors[0]["stderr"]
    assert result.kill_to_exit < 60, result.kill_to_exit
    print(f"node 1 killed mid-merge: node 0 stopped {result.kill_to_exit:.1f} s later: "
          f"{survivors[0]['stderr'].strip()}")
    assert sorted(p.name for p in node_dirs[0].iterdir()) == ["ep"]
    _, found = run_cli([merge], disks, tmp_path, timeout=150)
    assert [g["exit"] for g in found[0]] == [0] * 4, [g["stderr"] for g in found[0]]
    assert (node_dirs[0] / "merged" / "config.json").exists()


@pytest.mark.slow  # simulated nodes: faults and sources
def test_nodes_manifests_join_into_the_whole_folders(source, shared, tmp_path):
    """The manifests of two nodes' copies (`write --ranks`) join into exactly the manifest of one shared write; a
    copy of another write is refused, naming what differs."""
    from reshard.errors import ManifestError
    from reshard.manifest import joined_copies

    documents = []
    for node in range(NODES):
        copy = tmp_path / f"copy{node}"
        result = CliRunner().invoke(cli, ["write", str(source), str(copy), *MESHES["ep"], "--ranks", node_ranks(node),
                                          "-q"])
        assert result.exit_code == 0, result.output
        documents.append(json.loads((copy / MANIFEST_NAME).read_text()))
    whole = json.loads((shared / "ep" / MANIFEST_NAME).read_text())
    assert all(d.get("holds") for d in documents) and "holds" not in whole
    assert joined_copies(documents, "ep") == whole
    assert joined_copies(documents[::-1], "ep") == whole
    other = json.loads((shared / "replicas" / MANIFEST_NAME).read_text())
    with pytest.raises(ManifestError, match=r"copies of different writes: copy 0 holds write [0-9a-f]{12} \(--fsdp 4 "
                                            r"--ep 2\); copy 1 holds write [0-9a-f]{12} \(--fsdp 2 --dp-replicate 2\)"):
        joined_copies([documents[0], other], "ep")


EP4 = ["--fsdp", "4", "--ep", "4"]  # one expert per rank: each node reads only its own experts' file


def split_by_experts(source: Path, folder: Path) -> dict[str, set[str]]:
    """`source` re-saved as three files: the tensors every rank reads, experts 0-1 and experts 2-3 (at `--ep 4`, one
    expert per rank: node 0's ranks and node 1's), with an index; returns file -> keys."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    folder.mkdir()
    groups: dict[str, dict] = {"dense.safetensors": {}, "experts-0-1.safetensors": {}, "experts-2-3.safetensors": {}}
    with safe_open(str(source / "model.safetensors"), "pt") as f:
        for key in f.keys():
            expert = int(key.split(".experts.")[1].split(".")[0]) if ".experts." in key else None
            name = ("dense.safetensors" if expert is None else
                    "experts-0-1.safetensors" if expert < 2 else "experts-2-3.safetensors")
            groups[name][key] = f.get_tensor(key)
    for name, tensors in groups.items():
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
    weight_map = {key: name for name, tensors in groups.items() for key in tensors}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for name in ("config.json", "generation_config.json"):
        (folder / name).write_bytes((source / name).read_bytes())
    return {name: set(tensors) for name, tensors in groups.items()}


@pytest.mark.slow  # simulated nodes: faults and sources
def test_each_node_needs_only_the_source_files_it_reads(source, disks, tmp_path):
    """A local SRC of which each node holds only what its ranks' files read (node 0: the dense file and experts 0-1
    with the metadata; node 1: the dense file and experts 2-3, nothing else): the node-local write equals a shared
    write from the whole SRC, byte for byte, manifests joined included. A node missing a file its ranks read (moved
    to the other node) stops every rank with one message naming the file and the node, and no node keeps
    anything."""
    from reshard.manifest import joined_copies

    mount_at, node_dirs, reports = disks
    whole = mount_at / "src"  # on the host, the whole SRC at the path the nodes see their parts at
    split_by_experts(source, whole)
    reference = tmp_path / "reference"
    result = CliRunner().invoke(cli, ["write", str(whole), str(reference), *EP4, "-q"])
    assert result.exit_code == 0, result.output
    parts = [{"dense.safetensors", "experts-0-1.safetensors", "model.safetensors.index.json", "config.json",
              "generation_config.json"}, {"dense.safetensors", "experts-2-3.safetensors"}]
    for node, names in enumerate(parts):
        (node_dirs[node] / "src").mkdir()
        for name in names:
            (node_dirs[node] / "src" / name).write_bytes((whole / name).read_bytes())
    cases = [{"argv": ["write", str(whole), str(mount_at / "out"), *EP4, "--node-local", "-q"]}]
    result, found = run_cli(cases, disks, tmp_path)
    assert [g["exit"] for g in found[0]] == [0] * 4, [g["stderr"] for g in found[0]]
    for node in range(NODES):
        assert_node_copy(node_dirs[node] / "out", reference, node)
    documents = [json.loads((d / "out" / MANIFEST_NAME).read_text()) for d in node_dirs]
    assert joined_copies(documents, "out") == json.loads((reference / MANIFEST_NAME).read_text())

    (node_dirs[1] / "src" / "experts-2-3.safetensors").rename(node_dirs[0] / "src" / "experts-2-3.safetensors")
    cases = [{"argv": ["write", str(whole), str(mount_at / "lacking"), *EP4, "--node-local", "-q"]}]
    result, found = run_cli(cases, disks, tmp_path)
    assert {g["exit"] for g in found[0]} == {1}, [g["stderr"] for g in found[0]]
    assert len({g["stderr"] for g in found[0]}) == 1, [g["stderr"] for g in found[0]]
    message = found[0][0]["stderr"]
    assert "experts-2-3.safetensors is not on node 1 (" in message and "Traceback" not in message, message
    print(f"a node without a source file it reads: {max(g['seconds'] for g in found[0]):.1f} s: {message.strip()}")
    assert_nothing_on_any_node(node_dirs, "lacking")


# ---- a remote SRC: each node fetches its own share ---------------------------------------------------------------

@pytest.fixture(scope="module")
def wide(tiny):
    """A source whose embedding and head (8 MiB each, 16.8 MB of its 17 MB) are split by rows across the 4 ranks, in
    pieces far larger than the gaps a remote read would join, so the bytes a node fetches show its share."""
    return tiny("qwen3_moe", experts=4, vocab_size=32768)


def fetched_share(node_dirs, wide: Path, reference: Path, fetched: dict[int, int]) -> None:
    """Each node's copy is the shared write's, and each node fetched its own share of the source: at least the bytes
    of its files, and well under the whole (about half, plus the small tensors every rank reads)."""
    data = sum(p.stat().st_size for p in wide.glob("*.safetensors"))
    for node in range(NODES):
        held = assert_node_copy(node_dirs[node] / "out", reference, node)
        print(f"node {node} fetched {fetched[node]:,} bytes of the source's {data:,} ({fetched[node] / data:.1%}), "
              f"for a copy of {held:,} bytes")
        assert held - 4 * 65536 < fetched[node] < 0.6 * data, (node, fetched, data)


@pytest.mark.slow  # simulated nodes: faults and sources
def test_a_node_local_write_from_s3_fetches_each_nodes_share(s3, wide, disks, tmp_path):
    """From s3://: each node (its own access key, in the server's log) fetches only the bytes of its own files."""
    mount_at, node_dirs, _ = disks
    bucket = s3.new_bucket("nodes")
    s3.put_folder(wide, f"s3://{bucket}/src")
    s3.clear_log()
    reference = tmp_path / "reference"
    assert CliRunner().invoke(cli, ["write", str(wide), str(reference), *MESHES["ep"], "-q"]).exit_code == 0
    cases = [{"argv": ["write", f"s3://{bucket}/src", str(mount_at / "out"), *MESHES["ep"], "--node-local", "-q"]}]
    result, found = run_cli(cases, disks, tmp_path, timeout=240, env=s3.env("nodes"),
                            setup={k: f"export AWS_ACCESS_KEY_ID=node{k}" for k in range(NODES)})
    assert [g["exit"] for g in found[0]] == [0] * 4, [g["stderr"] for g in found[0]]
    fetched = {k: sum(r.sent for r in s3.requests(method="GET", access_key=f"node{k}", prefix="src/")
                      if r.key.endswith(".safetensors")) for k in range(NODES)}
    fetched_share(node_dirs, wide, reference, fetched)
    every_get = {k: sum(r.sent for r in s3.requests(method="GET", access_key=f"node{k}", prefix="src/"))
                 for k in range(NODES)}
    for k in range(NODES):  # each node's first rank reports what its ranks fetched, as the server counted it
        said = found[0][k * NPROC]["stdout"]
        print(said)
        reported = int(re.search(r"fetched from s3://\S+ by this node's ranks: ([\d,]+) bytes", said)[1]
                       .replace(",", ""))
        assert fetched[k] <= reported <= every_get[k], (k, reported, fetched[k], every_get[k])
    job = re.search(r"([\d,]+) bytes fetched from SRC in all", found[0][0]["stdout"])
    assert job is not None and int(job[1].replace(",", "")) == sum(
        int(re.search(r"node's ranks: ([\d,]+) bytes", found[0][k * NPROC]["stdout"])[1].replace(",", ""))
        for k in range(NODES)), found[0][0]["stdout"]


@pytest.mark.slow  # simulated nodes: faults and sources
def test_a_node_local_write_from_the_hub_with_stream_fetches_each_nodes_share(wide, disks, tmp_path):
    """`--stream` from the Hub (the local Hub; each node its own token, in the server's log): each node reads only its
    files' ranges, and no weight lands in its cache."""
    import hub_server

    mount_at, node_dirs, _ = disks
    hub = hub_server.LocalHub()
    hub.add_folder("org/wide", wide)
    server = hub_server.start(hub)
    try:
        reference = tmp_path / "reference"
        assert CliRunner().invoke(cli, ["write", str(wide), str(reference), *MESHES["ep"], "-q"]).exit_code == 0
        cases = [{"argv": ["write", "org/wide", str(mount_at / "out"), *MESHES["ep"], "--node-local", "--stream",
                           "-q"]}]
        env = {"HF_ENDPOINT": hub.url, "HF_HOME": str(mount_at / "hf"), "HF_HUB_DISABLE_TELEMETRY": "1",
               "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_HUB_CACHE": str(mount_at / "hf" / "hub")}
        result, found = run_cli(cases, disks, tmp_path, timeout=240, env=env,
                                setup={k: f"export HF_TOKEN=node{k}" for k in range(NODES)})
    finally:
        server.shutdown()
    assert [g["exit"] for g in found[0]] == [0] * 4, [g["stderr"] for g in found[0]]
    fetched = {k: sum(r.sent for r in hub.log if r.token == f"node{k}" and r.method == "GET"
                      and r.path.endswith(".safetensors")) for k in range(NODES)}
    for d in node_dirs:
        assert not list((d / "hf").rglob("*.safetensors")), sorted((d / "hf").rglob("*"))
    fetched_share(node_dirs, wide, reference, fetched)
