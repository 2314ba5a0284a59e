"""Sources where checkpoints live (`reshard.read._source`): a Hugging Face cache snapshot, any source for `plan`, URLs
refused as outputs, and the rules a link out of a source meets. S3 and the Hub in ranges: tests/test_remote.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from reshard.api import plan_checkpoint, write_checkpoint
from reshard.cli import cli
from reshard.errors import CheckpointError
from reshard.plan import MeshSpec
from reshard.read._source import SourceKind, Where
from reshard.read import locate, open_source

REPO = Path(__file__).resolve().parents[1]
MESH = MeshSpec(fsdp=4)


def invoke(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def files_of(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def cache_snapshot(src: Path, cache: Path, repo: str = "org/tiny", commit: str = "0" * 40) -> Path:
    """`src` laid out as the Hugging Face cache lays out a download: `models--org--name/blobs/<hash>` files, and
    `snapshots/<commit>/<name>` links to `../../blobs/<hash>`, `refs/main` naming the commit."""
    import hashlib

    folder = cache / f"models--{repo.replace('/', '--')}"
    (folder / "blobs").mkdir(parents=True)
    snapshot = folder / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(commit)
    for path in sorted(src.iterdir()):
        blob = hashlib.sha256(path.read_bytes()).hexdigest()
        shutil.copyfile(path, folder / "blobs" / blob)
        (snapshot / path.name).symlink_to(Path("..") / ".." / "blobs" / blob)
    return snapshot


# ---- a Hugging Face cache snapshot ----------------------------------------------------------------------------------

def test_a_cache_snapshot_folder_is_a_source_and_writes_what_the_plain_folder_writes(tiny, tmp_path):
    src = tiny("qwen3_moe")
    snapshot = cache_snapshot(src, tmp_path / "hub")
    assert all(p.is_symlink() for p in snapshot.iterdir())  # every file a link out of the snapshot, into blobs/
    location = locate(snapshot)
    assert (location.where, location.kind) == (Where.HF_CACHE, SourceKind.CHECKPOINT)
    write_checkpoint(src, tmp_path / "plain", MESH, progress=False)
    result = invoke("write", snapshot, tmp_path / "cached", "--fsdp", 4, "-q")
    assert result.exit_code == 0, result.output
    plain, cached = files_of(tmp_path / "plain"), files_of(tmp_path / "cached")
    assert plain.keys() == cached.keys()
    for name in plain:
        if name != "reshard.json":
            assert plain[name] == cached[name], name
    plain_doc, cached_doc = (json.loads(d["reshard.json"]) for d in (plain, cached))
    assert plain_doc["tensors"] == cached_doc["tensors"] and plain_doc["files"] == cached_doc["files"]
    assert cached_doc["source"]["source"] == str(snapshot)


def test_a_link_out_of_the_cache_repo_is_refused_and_says_what_is_followed(tiny, tmp_path):
    src = tiny("qwen3_moe")
    snapshot = cache_snapshot(src, tmp_path / "hub")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copy(src / "model.safetensors", elsewhere / "model.safetensors")
    (snapshot / "model.safetensors").unlink()
    (snapshot / "model.safetensors").symlink_to(elsewhere / "model.safetensors")
    result = invoke("write", snapshot, tmp_path / "out", "--fsdp", 4, "-q")
    assert result.exit_code == 1, result.output
    assert "a link out of the checkpoint folder" in result.output
    assert "links are followed into" in result.output and "blobs" in result.output, result.output
    assert not (tmp_path / "out").exists()


def test_outside_a_cache_a_link_out_of_the_folder_is_refused_with_the_rule(tiny, tmp_path):
    src = shutil.copytree(tiny("qwen3_moe"), tmp_path / "src")
    moved = tmp_path / "model.safetensors"
    shutil.move(src / "model.safetensors", moved)
    (src / "model.safetensors").symlink_to(moved)
    with pytest.raises(CheckpointError, match="must be inside it .*Hugging Face cache snapshot's links"):
        open_source(src)


def test_a_special_file_among_the_metadata_is_refused_and_named(tiny, tmp_path):
    """A FIFO as generation_config.json was dropped in silence (the write exited 0): now it is refused, named."""
    src = shutil.copytree(tiny("qwen3_moe"), tmp_path / "src")
    (src / "generation_config.json").unlink()
    os.mkfifo(src / "generation_config.json")
    result = invoke("write", src, tmp_path / "out", "--fsdp", 4, "-q")
    assert result.exit_code == 1 and "generation_config.json: a FIFO, not a regular file" in result.output, \
        result.output
    assert not (tmp_path / "out").exists()


# ---- plan takes what write takes ------------------------------------------------------------------------------------

def test_plan_accepts_a_reshard_folder_and_a_saved_folder(tiny, tmp_path):
    src = tiny("qwen3_moe")
    write_checkpoint(src, tmp_path / "fsdp4", MESH, progress=False)
    from_folder = json.loads(invoke("plan", tmp_path / "fsdp4", "--fsdp", 2, "--json").stdout)
    from_source = json.loads(invoke("plan", src, "--fsdp", 2, "--json").stdout)
    assert from_folder["families"] == from_source["families"] and from_folder["summary"] == from_source["summary"]
    result = plan_checkpoint(tmp_path / "fsdp4", MeshSpec(fsdp=2))
    assert result.plan is not None and "reshard write" in result.summary()


# ---- an output in a bucket needs credentials: refused before anything is read ----------------------------------------

@pytest.mark.parametrize("command", ["write", "merge"])
def test_a_bucket_output_without_credentials_is_refused_at_once_and_creates_nothing(tiny, tmp_path, command):
    src = tiny("qwen3_moe")
    if command == "merge":
        write_checkpoint(src, tmp_path / "folder", MESH, progress=False)
        src = tmp_path / "folder"
    args = [command, src, "s3://bucket/out"] + (["--fsdp", 4] if command == "write" else [])
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(PYTHONPATH=str(REPO), AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"),
               AWS_CONFIG_FILE=str(tmp_path / "none"), AWS_EC2_METADATA_DISABLED="true")
    result = subprocess.run([sys.executable, "-m", "reshard", *map(str, args)], capture_output=True, text=True,
                            cwd=tmp_path, timeout=120, env=env)
    assert result.returncode == 1, result.stderr  # the environment lacks what the call needs: the call is fine
    assert "s3://bucket/out: no AWS credentials were found" in result.stderr, result.stderr
    assert "Nothing was read or written" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "s3:").exists() and sorted(p.name for p in tmp_path.iterdir()) == \
        (["folder"] if command == "merge" else [])


def test_a_url_of_another_scheme_is_refused_as_a_source(tmp_path):
    result = invoke("plan", "gs://bucket/model", "--fsdp", 2)
    assert result.exit_code == 2 and "s3://bucket/prefix URLs; not this scheme" in result.output, result.output


def test_without_s3fs_an_s3_source_names_the_extra(tmp_path):
    code = ("import sys; sys.modules['s3fs'] = None\n"
            "from reshard.cli import main\n"
            "sys.argv = ['reshard', 'plan', 's3://bucket/model', '--fsdp', '2']\n"
            "main()\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 2 and "pip install -e '.[s3]'" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("repo_id", ["a/..", "a/.", "a/-b", "x/y.."])
def test_an_invalid_hub_id_is_one_clear_error(repo_id, tmp_path):
    result = subprocess.run([sys.executable, "-m", "reshard", "plan", repo_id, "--fsdp", "2"], capture_output=True,
                            text=True, cwd=tmp_path, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 1 and "not a valid Hub repo id" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and "HFValidationError" not in result.stderr


@pytest.mark.parametrize("field, value, said", [
    ("num_experts", "4", "expected int, got str"),
    ("num_experts", 1e308, "expected int, got float"),
    ("rms_norm_eps", "NaN", "holds NaN, which is no JSON number"),
    ("rope_theta", "Infinity", "holds Infinity, which is no JSON number"),
])
def test_a_config_value_of_the_wrong_type_or_not_finite_is_one_clear_error(tiny, tmp_path, field, value, said):
    src = shutil.copytree(tiny("qwen3_moe"), tmp_path / "src")
    text = (src / "config.json").read_text()
    config = json.loads(text)
    config[field] = "@@"
    literal = value if value in ("NaN", "Infinity") else json.dumps(value)
    (src / "config.json").write_text(json.dumps(config).replace('"@@"', literal))
    for args in (("plan", src, "--fsdp", 4), ("write", src, tmp_path / "out", "--fsdp", 4, "-q")):
        result = subprocess.run([sys.executable, "-m", "reshard", *map(str, args)], capture_output=True, text=True,
                                timeout=120, env={**os.environ, "PYTHONPATH": str(REPO), "RESHARD_CACHE_DIR": ""})
        assert result.returncode == 1 and said in result.stderr and "config.json" in result.stderr, result.stderr
        assert "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()


# ---- links that loop, and links a cache snapshot may not follow ---------------------------------------------------

@pytest.mark.parametrize("where", ["folder", "snapshot"])
@pytest.mark.parametrize("loop", ["two json files", "weights to itself"])
def test_a_link_that_loops_is_refused_by_name(tiny, tmp_path, where, loop):
    """Row 6: `x.json -> y.json -> x.json`, or `model.safetensors` linking to itself, in a folder or a cache
    snapshot: one `CheckpointError` naming the file (it was `RuntimeError: Symlink loop from ...`, a traceback)."""
    src = shutil.copytree(tiny("qwen3_moe"), tmp_path / "src")
    folder = src if where == "folder" else cache_snapshot(src, tmp_path / "hub")
    if loop == "two json files":
        (folder / "x.json").symlink_to("y.json")
        (folder / "y.json").symlink_to("x.json")
        name = "x.json"
    else:
        (folder / "model.safetensors").unlink()
        (folder / "model.safetensors").symlink_to("model.safetensors")
        name = "model.safetensors"
    with pytest.raises(CheckpointError, match=rf"{name}: a link that loops \(.*\).*Nothing was read or changed"):
        open_source(folder)
    result = invoke("write", folder, tmp_path / "out", "--fsdp", 4, "-q")
    assert result.exit_code == 1 and f"{name}: a link that loops" in result.output, result.output
    assert "Traceback" not in result.output and not (tmp_path / "out").exists()


def test_a_snapshot_link_into_the_repo_but_outside_blobs_is_refused(tiny, tmp_path):
    """Row 11: a snapshot file linking to `../../refs/main` (inside the repo folder, outside `blobs/`) was accepted
    and copied into OUT; links are followed into `blobs/` only, as the docs and the refusal say."""
    snapshot = cache_snapshot(tiny("qwen3_moe"), tmp_path / "hub")
    (snapshot / "notes.txt").symlink_to(Path("..") / ".." / "refs" / "main")
    result = invoke("write", snapshot, tmp_path / "out", "--fsdp", 4, "-q")
    assert result.exit_code == 1, result.output
    assert "notes.txt: a link out of the checkpoint folder" in result.output
    assert "links are followed into" in result.output and "blobs" in result.output, result.output
    assert not (tmp_path / "out").exists()
    (snapshot / "notes.txt").unlink()
    assert invoke("write", snapshot, tmp_path / "out", "--fsdp", 4, "-q").exit_code == 0  # blobs/ links: fine


@pytest.mark.parametrize("command", ["write", "merge"])
def test_an_empty_output_is_a_bad_call_and_the_current_folder_stays(tiny, tmp_path, command):
    """Row 12: `reshard write SRC "" --overwrite` in an empty current folder exited 0 and swapped the current folder
    itself for the output; now exit 2 before anything is read (merge DEST "" the same)."""
    src = tiny("qwen3_moe")
    if command == "merge":
        write_checkpoint(src, tmp_path / "folder", MESH, progress=False)
        src = tmp_path / "folder"
    here = tmp_path / "here"
    here.mkdir()
    args = [command, src, "", "--overwrite"] + (["--fsdp", 4] if command == "write" else [])
    result = subprocess.run([sys.executable, "-m", "reshard", *map(str, args)], capture_output=True, text=True,
                            cwd=here, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 2, result.stderr
    assert f'{"OUT" if command == "write" else "DEST"} is empty ("")' in result.stderr, result.stderr
    assert "Nothing was read or written" in result.stderr and "Traceback" not in result.stderr
    assert here.is_dir() and list(here.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == (["folder", "here"] if command == "merge" else ["here"])
