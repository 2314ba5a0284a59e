"""Loading where users run it: launched by torchrun or by a plain spawn (no agent), with no `init_process_group` in
the rank script; every pre-load fault stops every rank on its own, fast; node-local copies load alone."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from reshard.api import write_checkpoint
from reshard.cli import cli
from reshard.plan import MeshSpec

from conftest import RANK_SCRIPTS, run_ranks

# Every rank must stop with the error within this once every rank has imported torch, transformers' model code and
# reshard: a rank that waited for a dead peer would wait for gloo's collective timeout (600 s). It is measured from
# the last rank's imports, not from launch: on a busy machine four ranks' imports alone take a minute or more. From
# there to the error took under 10 s idle and 63 s at load 28 on 2 cores (transformers' lazy imports still inside
# the window then; test_launch.py, 2026-12-02).
EXIT_BUDGET_S = 90


def seconds_to_error(reports: list[dict]) -> float:
    """The longest time from the moment every reporting rank had its imports done to a rank's error."""
    started = max(report["loading_at"] for report in reports if "loading_at" in report)
    return max(report["ended_at"] - started for report in reports if "ended_at" in report)


def torchrun_load(mode, folder, src, tmp_path, nproc, *, env=None, check=True):
    reports = tmp_path / f"reports-torchrun-{mode}"
    reports.mkdir()
    start = time.monotonic()
    # The agent kills the other ranks once one has failed; looking every 5 s lets each rank show its own error
    # first (every rank raises within a moment of the others), which is what the fault tests check.
    result = run_ranks("load_env.py", nproc, mode, folder, src, reports, env=env, check=check, timeout=300,
                       monitor_interval=5)
    elapsed = time.monotonic() - start
    return result, [_report(reports, r) for r in range(nproc)], elapsed


def spawn_load(mode, folder, src, tmp_path, nproc, *, env=None):
    """The rank script on `nproc` processes from torch.multiprocessing spawn: nobody kills a straggler."""
    reports = tmp_path / f"reports-spawn-{mode}"
    reports.mkdir()
    summary = tmp_path / "spawn-summary.json"
    cmd = [sys.executable, str(RANK_SCRIPTS / "spawn.py"), str(nproc), str(summary),
           str(RANK_SCRIPTS / "load_env.py"), mode, str(folder), str(src), str(reports)]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=360, env=full_env, start_new_session=True)
    exits = json.loads(summary.read_text())
    return result, [_report(reports, r) for r in range(nproc)], exits


def _report(folder, rank):
    path = folder / f"rank{rank}.json"
    return json.loads(path.read_text()) if path.exists() else {"rank": rank, "error": "no report (killed)"}


def assert_exact(reports, *, tolerance=0.0):
    for report in reports:
        assert "error" not in report, report.get("traceback", report)
        assert report["is_dtensor"], "loaded whole in every process instead of sharded"
        assert report["keys_equal"] and report["mismatched"] == [], report.get("mismatched")
        assert report["logits_max_abs_diff"] <= tolerance, report["logits_max_abs_diff"]


# ---- 1. torchrun as transformers does it ------------------------------------------------------------------------

@pytest.mark.multirank
def test_reshard_from_pretrained_under_torchrun_needs_no_init_process_group(tiny, tmp_path):
    src = tiny("qwen3_moe")  # 2 experts on fsdp 4: stock transformers leaves ranks 2 and 3 empty
    out = tmp_path / "out"
    write_checkpoint(src, out, MeshSpec(fsdp=4), progress=False)
    result, reports, _ = torchrun_load("reshard", out, src, tmp_path, 4)
    assert_exact(reports)
    # no silent wait: the first rank of the node shows each phase as it begins, once (a pipe: one line each)
    phases = [line.split(": ", 1)[1].rsplit(" (", 1)[0] for line in result.stderr.splitlines()
              if line.startswith(f"reshard load {out}: ")]
    assert phases == ["starting on 4 ranks: every rank checks its files, then all agree",
                      "every rank's files checked; building the model on the meta device, sharded for world 4 = "
                      "dp_replicate 1 x fsdp 4",
                      "materializing the tensors still on the meta device (buffers made off meta keep their values)",
                      "reading 1 file, 0.1 MiB of tensor data, this rank's",
                      "read 1 file, 0.1 MiB of tensor data, this rank's", "loaded"], result.stderr[-3000:]


@pytest.mark.slow  # a second 4-rank load (the patched path)
@pytest.mark.multirank
def test_patched_transformers_from_pretrained_takes_the_manifests_mesh_under_torchrun(tiny, tmp_path):
    """`AutoModelForCausalLM.from_pretrained(OUT)`, no distributed_config, no init_process_group: the manifest's
    fsdp 4 x ep 2 mesh, with a replicated router buffer (GLM's e_score_correction_bias)."""
    src = tiny("glm4_moe")
    out = tmp_path / "out"
    write_checkpoint(src, out, MeshSpec(fsdp=4, ep=2), progress=False)
    _, reports, _ = torchrun_load("patched", out, src, tmp_path, 4)
    assert_exact(reports, tolerance=1e-5)  # EP's grouped kernels round differently; the weights are equal


def test_without_a_launcher_the_whole_model_loads_in_one_process(tiny, tmp_path, monkeypatch):
    import torch.distributed as dist

    from reshard.launch import in_distributed_job

    for variable in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(variable, raising=False)
    assert not in_distributed_job()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert not in_distributed_job() and not dist.is_initialized()


# ---- 2. one agreed decision: every rank exits with the error, on its own -----------------------------------------

def _fault(name, out, tmp_path):
    """Damage `out` (written for 4 ranks) for fault `name`: (folder argument, ranks to launch, env, expected)."""
    victim = out / "shard-00003-model-00001-of-00001.safetensors"
    if name == "manifest-missing-on-one-rank":
        for r in range(4):
            shutil.copytree(out, tmp_path / f"node{r}")
        (tmp_path / "node2" / "reshard.json").unlink()
        return str(tmp_path / "node{rank}"), 4, {}, "rank 2: " 
    if name == "unreadable-file":
        victim.chmod(0)  # enough for a normal user; as root, opening it is refused by the rank script's shim
        return str(out), 4, {"RESHARD_TEST_DENY": str(victim)}, "rank 2: shard-00003-model-00001-of-00001.safetensors"
    if name == "job-larger-than-manifest":
        return str(out), 5, {}, "written for 4 ranks"
    if name == "job-smaller-than-manifest":
        return str(out), 2, {}, "written for 4 ranks"
    if name == "truncated-file":
        data = victim.read_bytes()
        victim.write_bytes(data[:-64])
        return str(out), 4, {}, "rank 2: shard-00003-model-00001-of-00001.safetensors has"
    raise AssertionError(name)


FAULTS = ["manifest-missing-on-one-rank", "unreadable-file", "job-larger-than-manifest", "job-smaller-than-manifest",
          "truncated-file"]
# Every fault under torchrun; without an agent (spawn: each rank must exit by itself) one fault found on one rank
# and one found by every rank: how a rank exits does not depend on which fault it met, and each spawn case costs
# 20 s of CI.
# The default tests run one fault found on one rank under torchrun; the rest of the matrix is marked slow.
CASES = [pytest.param(fault, launcher, marks=() if (fault, launcher) == ("truncated-file", "torchrun") else
                      pytest.mark.slow)
         for fault, launcher in [(fault, "torchrun") for fault in FAULTS] + [("unreadable-file", "spawn"),
                                                                              ("job-smaller-than-manifest", "spawn")]]


@pytest.mark.multirank
@pytest.mark.parametrize("fault, launcher", CASES)
def test_a_pre_load_fault_stops_every_rank_with_the_same_error(tiny, tmp_path, fault, launcher):
    src = tiny("qwen3_moe")
    out = tmp_path / "out"
    write_checkpoint(src, out, MeshSpec(fsdp=4), progress=False)
    folder, nproc, env, expected = _fault(fault, out, tmp_path)
    if launcher == "spawn":
        result, reports, exits = spawn_load("reshard", folder, "-", tmp_path, nproc, env=env)
        for rank, info in exits.items():  # nobody killed anyone: each rank exited by itself, with its error
            assert info["exitcode"] == 3, (rank, info, result.stderr[-3000:])
    else:
        result, reports, _ = torchrun_load("reshard", folder, "-", tmp_path, nproc, env=env, check=False)
        assert result.returncode != 0
    assert seconds_to_error(reports) < EXIT_BUDGET_S, reports
    errors = {report["error"] for report in reports}
    assert len(errors) == 1, errors  # the same agreed error on every rank, not one rank's own exception
    (error,) = errors
    assert error.startswith("LoadError: ") and expected in error, error
    # the process group reshard created from the launcher's environment is destroyed on the error path: left to
    # finalization, gloo's threads could abort the process after the error ("terminate called without ...")
    assert not any(report.get("group_left_up", True) for report in reports), reports
    if fault == "manifest-missing-on-one-rank":
        assert "reshard.json" in error and "rank 0" not in error


# ---- 3. each rank's files hold everything it loads -------------------------------------------------------------

def test_every_coordinate_holds_a_full_copy_of_each_replicated_buffer(tiny, tmp_path):
    from safetensors.torch import load_file

    src = tiny("glm4_moe")
    out = tmp_path / "out"
    write_checkpoint(src, out, MeshSpec(fsdp=4, ep=2), progress=False)
    manifest = json.loads((out / "reshard.json").read_text())
    replicated = sorted(n for n, t in manifest["tensors"].items() if t["placement"]["kind"] == "replicated")
    assert any("e_score_correction_bias" in n for n in replicated)
    source = {}
    for path in src.glob("*.safetensors"):
        source.update(load_file(path))
    for coord in range(4):
        (first, *_) = [f["name"] for f in manifest["files"] if f["coord"] == coord]
        stored = load_file(out / first)
        for name in replicated:
            assert name in stored, (coord, name)
            assert stored[name].equal(source[name])


def test_files_lists_what_a_node_needs(tiny, tmp_path):
    src = tiny("qwen3_moe")
    out = tmp_path / "out"
    write_checkpoint(src, out, MeshSpec(fsdp=4, dp_replicate=2), progress=False)
    result = CliRunner().invoke(cli, ["files", str(out), "--ranks", "1,2,5"])
    assert "ranks count from 0 and shard files from 1" in result.stderr  # said beside the list, not in it
    assert result.exit_code == 0, result.output
    listed = result.stdout.split()
    assert listed[0] == "reshard.json" and "config.json" in listed
    shards = [n for n in listed if n.startswith("shard-")]
    assert shards == ["shard-00002-model-00001-of-00001.safetensors",  # ranks 1 and 5 (replica 2) share coord 1
                      "shard-00003-model-00001-of-00001.safetensors"]
    document = json.loads(CliRunner().invoke(cli, ["files", str(out), "--ranks", "0-1", "--json"]).output)
    assert document["coords"] == [0, 1] and document["files"][0] == "reshard.json"
    assert document["bytes"] == sum((out / n).stat().st_size for n in document["files"])
    assert CliRunner().invoke(cli, ["files", str(out), "--ranks", "3-1"]).exit_code == 2


@pytest.mark.multirank
def test_node_local_copies_load_exactly_reading_only_their_own_folder(tiny, tmp_path):
    """Each rank gets a folder holding only what `reshard files --ranks R` lists; it loads exactly and opens nothing
    outside it (GLM-like with EP and a replicated router buffer)."""
    src = tiny("glm4_moe")
    out = tmp_path / "out"
    write_checkpoint(src, out, MeshSpec(fsdp=4, ep=2), progress=False)
    nodes = tmp_path / "nodes"
    for rank in range(4):
        listed = CliRunner().invoke(cli, ["files", str(out), "--ranks", str(rank)]).stdout.split()
        for name in listed:
            (nodes / f"rank{rank}" / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(out / name, nodes / f"rank{rank}" / name)
        assert len([n for n in listed if n.startswith("shard-")]) == 1
    shutil.rmtree(out)  # nothing shared is left to read
    _, reports, _ = torchrun_load("reshard", nodes / "rank{rank}", src, tmp_path, 4,
                                  env={"RESHARD_TEST_WATCH": str(tmp_path)})
    assert_exact(reports, tolerance=1e-5)
    for report in reports:
        own = f"nodes{os.sep}rank{report['rank']}{os.sep}"
        assert report["opened"], "the audit hook saw no file opened"
        assert all(path.startswith(own) for path in report["opened"]), report["opened"]
        assert any(path.endswith(".safetensors") for path in report["opened"]), report["opened"]


# ---- 4. `reshard.launch` on its own: the environment, owned groups, agreed messages -----------------------------

def test_launcher_world_size_needs_all_three_variables_and_a_number(monkeypatch):
    from reshard.launch import launcher_world_size

    for variable in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(variable, raising=False)
    assert launcher_world_size() is None
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert launcher_world_size() is None  # LOCAL_RANK missing: not a launcher's environment
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert launcher_world_size() == 4
    monkeypatch.setenv("WORLD_SIZE", "four")
    assert launcher_world_size() is None


def test_a_write_group_without_a_launcher_says_how_to_launch_it(monkeypatch):
    import torch.distributed as dist

    from reshard.errors import OutputError
    from reshard.launch import gloo_group

    for variable in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(variable, raising=False)
    assert not dist.is_initialized()
    with pytest.raises(OutputError, match="RANK, LOCAL_RANK and WORLD_SIZE are not set") as e:
        gloo_group("write")
    assert str(e.value) == ("a distributed write runs as one rank of a torchrun job, but RANK, LOCAL_RANK and "
                            "WORLD_SIZE are not set. Launch it with `torchrun ... -m reshard write ...`, or drop "
                            "--distributed.")
    assert not dist.is_initialized()


def test_an_owned_group_is_destroyed_on_failure_and_at_exit_on_success(monkeypatch):
    import atexit

    import reshard.launch as launch

    destroyed, registered = [], []
    monkeypatch.setattr(launch, "destroy_own_group", lambda: destroyed.append(True))
    monkeypatch.setattr(atexit, "register", registered.append)
    with pytest.raises(KeyboardInterrupt, match="^$"):
        with launch.group_owned(created=True):
            raise KeyboardInterrupt
    assert destroyed == [True] and registered == []
    with launch.group_owned(created=True):
        pass
    assert destroyed == [True] and registered == [launch.destroy_own_group]
    with pytest.raises(ValueError, match="^$"):
        with launch.group_owned(created=False):  # the caller's own group: never touched
            raise ValueError
    assert destroyed == [True] and len(registered) == 1


def test_an_agreed_failure_names_each_failing_rank_once_per_cause():
    from reshard.errors import LoadError, OutputError
    from reshard.launch import agreed_failure, raise_if_any

    views = [None, "disk full", "disk full", "disk full", None, "no such file", "disk full"]
    failure = agreed_failure(views, "cannot write", OutputError)
    assert type(failure) is OutputError
    assert str(failure) == ("5 of 7 ranks cannot write (ranks 1-3, 6: disk full; rank 5: no such file). Every rank "
                            "stopped; nothing was kept.")
    assert agreed_failure([None, None], "cannot write", OutputError) is None
    raise_if_any([None, None, None])  # every rank fine: nothing raised
    with pytest.raises(LoadError, match="^written for 4 ranks$") as e:
        raise_if_any(["written for 4 ranks", "written for 4 ranks"])
    assert str(e.value) == "written for 4 ranks"  # the same on every rank: said once, as it is
    with pytest.raises(LoadError, match="1 of 2 ranks cannot load") as e:
        raise_if_any([None, "truncated"])
    assert str(e.value) == ("1 of 2 ranks cannot load (rank 1: truncated). Every rank stops here. Run `reshard "
                            "verify` on the folder, or write it again.")
