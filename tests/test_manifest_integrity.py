"""Damaged, tampered or hostile reshard folders are refused cleanly: `reshard.json` is parsed and validated as one
typed value before anything uses it, and every header is compared with it wherever a folder is read.

Every case must end in a `ReshardError` (exit 1 in the CLI) or in an exact load; never another exception, never a
read outside the folder, never a hang (each case runs under an alarm). The property tests mutate manifests and
headers over thousands of cases and assert that verify and the loaders agree (`outcome`): what verify passes loads
exactly, what a loader refuses verify refuses too; the explicit tests pin each row of the fault table
(`docs/faults.md`, "Damaged or hostile folders").
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import zlib
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import reshard
from reshard.api import verify_folder, write_checkpoint
from reshard.cli import cli
from reshard.errors import LoadError, ManifestError, ReshardError, VerifyError
from reshard.load._loader import assemble_state_dict
from reshard import read_manifest
from reshard.manifest import MANIFEST_NAME, Manifest
from reshard.plan import MeshSpec
from reshard.read._source import SourceKind
from reshard.read import open_source

from conftest import examples, hang_guard, rank_reports, run_ranks

FSDP, EP = 4, 2
VICTIM = "shard-00002-model-00001-of-00001.safetensors"
CASE_SECONDS = 20  # far above any case (milliseconds): only a hang reaches it


def alarm(seconds: int = CASE_SECONDS):
    """Fail a case that hangs (a FIFO opened for reading, an absurd loop) instead of freezing the suite."""
    return hang_guard(seconds)


class Written(tuple):
    """(folder, source, exact tensors), shown by its folder alone in a falsifying example."""

    def __repr__(self):
        return f"Written({self[0]})"


@pytest.fixture(scope="module")
def written(tiny, tmp_path_factory):
    """A qwen3_moe folder on fsdp 4 x ep 2 (written once), its source, and its exact tensors (read before any
    damage)."""
    src = tiny("qwen3_moe")
    out = tmp_path_factory.mktemp("integrity") / "out"
    write_checkpoint(src, out, MeshSpec(fsdp=FSDP, ep=EP), progress=False)
    return Written((out, src, assemble_state_dict(out)))


def copy_folder(out: Path, dest: Path, *, real: tuple[str, ...] = ()) -> Path:
    """`out` as `dest`: the manifest and the `real` files copied, every other file a link to the original (a link
    inside the folder may point anywhere: the user's choice, allowed)."""
    dest.mkdir(parents=True)
    for path in out.iterdir():
        if path.name == MANIFEST_NAME or path.name in real:
            shutil.copyfile(path, dest / path.name)
        else:
            os.symlink(path, dest / path.name)
    return dest


def load_doc(folder: Path) -> dict:
    return json.loads((folder / MANIFEST_NAME).read_text())


def save_doc(folder: Path, doc) -> None:
    (folder / MANIFEST_NAME).write_text(json.dumps(doc))


def restamp(folder: Path, name: str) -> None:
    """Set the manifest's size and CRC-32 of `name` to the file's: only the header check can catch what changed."""
    doc = load_doc(folder)
    for entry in doc["files"]:
        if entry["name"] == name:
            entry["bytes"], entry["crc32"] = (folder / name).stat().st_size, f"{zlib.crc32((folder / name).read_bytes()):08x}"
    save_doc(folder, doc)


def split_file(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + length]), raw[8 + length:]


def join_file(path: Path, header: dict, data: bytes, *, pad_to: int | None = None) -> None:
    text = json.dumps(header, separators=(",", ":")).encode()
    if pad_to is not None:
        text += b" " * (pad_to - len(text))
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def flip_dtype(folder: Path) -> str:
    """Tamper as in the issue: one F32 tensor of VICTIM relabelled I32 (same byte count), its CRC re-stamped.
    Returns the tensor's name."""
    path = folder / VICTIM
    (length,) = struct.unpack("<Q", path.read_bytes()[:8])
    header, data = split_file(path)
    name = next(k for k, v in header.items() if k != "__metadata__" and v["dtype"] == "F32")
    header[name]["dtype"] = "I32"
    join_file(path, header, data, pad_to=length)  # same length: every data offset stays where it was
    restamp(folder, VICTIM)
    return name


def reader_load(folder: Path, reference: dict) -> dict:
    """`dcp.load` with `reshard.StorageReader` in one process, into tensors shaped like `reference`."""
    import torch.distributed.checkpoint as dcp

    state = {name: torch.empty_like(t) for name, t in reference.items()}
    dcp.load(state, storage_reader=reshard.StorageReader(folder))
    return state


def reader_error(folder: Path, reference: dict) -> BaseException:
    """The error of a reader load: DCP wraps each rank's exception in its CheckpointException (a BaseException)."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        reader_load(folder, reference)
    except ReshardError as e:
        return e
    except CheckpointException as e:
        (exc, _), = e.failures.values()
        return exc
    raise AssertionError(f"{folder} loaded through the reader")


def cli_run(*args) -> tuple[int, str]:
    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit), \
        f"{args}: raw {type(result.exception).__name__}: {result.exception}"
    return result.exit_code, result.output  # stdout and stderr, as a terminal shows them


def assert_exact(state: dict, reference: dict) -> None:
    assert state.keys() == reference.keys()
    for name, tensor in reference.items():
        assert state[name].dtype == tensor.dtype and torch.equal(state[name], tensor), name


# ---- row 1: a dtype flipped in a header, the CRC re-stamped --------------------------------------------------------

def test_a_flipped_dtype_with_its_crc_restamped_is_refused_by_verify_the_load_and_the_reader(written, tmp_path):
    out, _, reference = written
    folder = copy_folder(out, tmp_path / "flip", real=(VICTIM,))
    name = flip_dtype(folder)
    said = f"{name} is I32 in the header, F32 in the manifest"
    code, text = cli_run("verify", folder)
    assert code == 1 and said in text, text
    with pytest.raises(LoadError, match=said):
        reshard.from_pretrained(folder)
    assert isinstance(error := reader_error(folder, reference), LoadError) and said in str(error)
    with pytest.raises(ReshardError, match="I32 in the header"):
        open_source(folder)  # merge and a write from this folder (mesh to mesh) read it so


def swap_offsets(folder: Path) -> tuple[str, str]:
    """Tamper as an adversary would: the `data_offsets` of two same-size tensors of VICTIM swapped (every tensor
    still contiguous, the header the same length), its CRC-32 re-stamped. Returns the two names, in file order."""
    path = folder / VICTIM
    (length,) = struct.unpack("<Q", path.read_bytes()[:8])
    header, data = split_file(path)
    by_start = sorted((v["data_offsets"], k) for k, v in header.items() if k != "__metadata__")
    (a, first), (b, second) = next(
        (x, y) for x, y in zip(by_start, by_start[1:])
        if x[0][1] - x[0][0] == y[0][1] - y[0][0] > 0 and data[x[0][0]:x[0][1]] != data[y[0][0]:y[0][1]])
    header[first]["data_offsets"], header[second]["data_offsets"] = b, a
    join_file(path, header, data, pad_to=length)
    restamp(folder, VICTIM)
    return first, second


def test_swapped_data_offsets_with_the_crc_restamped_are_refused_everywhere(written, tmp_path):
    """Offsets are derived from the manifest's order, not trusted: a swap of two same-size tensors keeps the data
    contiguous, so only the order catches it. verify, the one-process load, the reader and merge refuse it."""
    out, _, reference = written
    folder = copy_folder(out, tmp_path / "swap", real=(VICTIM,))
    first, second = swap_offsets(folder)
    said = f"{VICTIM}: {first}'s data begins at byte"
    code, text = cli_run("verify", folder)
    assert code == 1 and said in text and "the manifest's order puts it" in text, text
    with pytest.raises(LoadError, match=re.escape(said)):
        reshard.from_pretrained(folder)
    assert isinstance(error := reader_error(folder, reference), LoadError) and said in str(error)
    with pytest.raises(ReshardError, match=re.escape(said)):
        open_source(folder)
    code, text = cli_run("merge", folder, tmp_path / "merged")
    assert code == 1 and said in text and not (tmp_path / "merged").exists(), text


def load_errors(folder, src, tmp_path) -> list[dict]:
    """A 4-rank load of `folder` that must fail: every rank's report, each a LoadError."""
    reports = tmp_path / "reports"
    reports.mkdir()
    result = run_ranks("load_reshard.py", FSDP, "reshard", folder, src, reports, FSDP, EP, timeout=180, check=False)
    assert result.returncode != 0
    found = rank_reports(reports, FSDP)
    assert all(report["error"].startswith("LoadError") for report in found), found
    return found


@pytest.mark.slow  # 4-rank loads
@pytest.mark.multirank
def test_a_flipped_dtype_stops_every_rank_of_a_four_rank_load_with_one_agreed_error(written, tmp_path):
    out, src, _ = written
    folder = copy_folder(out, tmp_path / "flip", real=(VICTIM,))
    name = flip_dtype(folder)
    for report in load_errors(folder, src, tmp_path):
        assert f"rank 1: {VICTIM}: {name} is I32 in the header, F32 in the manifest" in report["error"], report


def test_a_manifest_shape_unlike_the_headers_is_the_readers_load_error_before_dcp_plans(written, tmp_path):
    """The reader plans from the manifest, so it compares the headers with it first: a shape tampered in reshard.json
    (headers intact) is its LoadError naming the tensor, not the planner's size mismatch, and nothing is loaded."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    out, _, reference = written
    folder = copy_folder(out, tmp_path / "folder")
    doc = load_doc(folder)
    name = next(n for n, info in doc["tensors"].items() if info["placement"]["kind"] == "dense"
                and len(info["shape"]) == 2)
    doc["tensors"][name]["shape"][1] -= 1  # not the split dim: the manifest stays self-consistent
    save_doc(folder, doc)
    state = {k: torch.zeros_like(v) for k, v in reference.items()}
    with alarm(), pytest.raises(CheckpointException) as caught:
        dcp.load(state, storage_reader=reshard.StorageReader(folder))
    failures = [exc for exc, _ in caught.value.failures.values()]
    assert failures and all(isinstance(exc, LoadError) and name in str(exc) for exc in failures), failures
    assert all(not v.any() for v in state.values())  # planning never started: nothing was read into the model


# ---- rows 3 and 4: names outside the folder, files that are not regular ---------------------------------------------

@pytest.mark.parametrize("where", ["absolute", "parent", "dev-zero"])
def test_a_name_outside_the_folder_is_refused_before_any_read(written, tmp_path, where):
    out, _, reference = written
    folder = copy_folder(out, tmp_path / "x" / "folder")
    outside = tmp_path / "elsewhere" / VICTIM
    outside.parent.mkdir()
    shutil.copyfile(out / VICTIM, outside)  # a read through the name would find a valid file there
    (folder / VICTIM).unlink()
    name = {"absolute": str(outside), "parent": f"../../elsewhere/{VICTIM}", "dev-zero": "/dev/zero"}[where]
    doc = load_doc(folder)
    entry = next(e for e in doc["files"] if e["name"] == VICTIM)
    entry["name"] = name
    doc["coords"][entry["coord"]]["files"] = [name]
    save_doc(folder, doc)
    with alarm():
        for args in (("verify", folder), ("files", folder, "--ranks", "0-3")):
            code, text = cli_run(*args)
            assert code == 1 and f"files[{doc['files'].index(entry)}].name is {name!r}" in text, (args, text)
        with pytest.raises(LoadError, match="plain file name inside the folder"):
            reshard.from_pretrained(folder)
        assert isinstance(reader_error(folder, reference), LoadError)


@pytest.mark.parametrize("kind", ["fifo", "link-to-dev-zero", "folder"])
def test_a_file_that_is_not_a_regular_file_is_refused_without_blocking(written, tmp_path, kind):
    out, _, reference = written
    folder = copy_folder(out, tmp_path / "folder")
    (folder / VICTIM).unlink()
    {"fifo": lambda p: os.mkfifo(p), "link-to-dev-zero": lambda p: os.symlink("/dev/zero", p),
     "folder": lambda p: p.mkdir()}[kind](folder / VICTIM)
    with alarm():  # opening a FIFO for reading blocks until a writer comes: it must never be opened so
        code, text = cli_run("verify", folder)
        assert code == 1 and "not a regular file" in text, text
        with pytest.raises(LoadError, match="not a regular file"):
            reshard.from_pretrained(folder)
        assert "not a regular file" in str(reader_error(folder, reference))
        with pytest.raises(ReshardError, match="not a regular file"):
            open_source(folder)


def test_a_link_inside_the_folder_to_a_regular_file_elsewhere_loads(written, tmp_path):
    out, _, reference = written
    assert_exact(assemble_state_dict(copy_folder(out, tmp_path / "links")), reference)  # every shard is a link


# ---- config.json and the other copied files: checked by verify and before every load ------------------------------

SPECIAL = {"dev-zero": lambda p: os.symlink("/dev/zero", p), "fifo": lambda p: os.mkfifo(p),
           "folder": lambda p: p.mkdir()}


@pytest.mark.parametrize("name, kind", [("config.json", "dev-zero"), ("config.json", "fifo"), ("config.json", "folder"),
                                        ("generation_config.json", "dev-zero"), ("generation_config.json", "fifo")])
def test_a_copied_file_that_is_not_a_regular_file_fails_verify_and_every_load(written, tmp_path, name, kind):
    """A link to /dev/zero passed verify and made the load raise a raw ValueError; a FIFO would block the open. (The
    model class's own from_pretrained under the patch checks too; an Auto class reads config.json before it.)"""
    from transformers import Qwen3MoeForCausalLM

    out, _, _ = written
    folder = copy_folder(out, tmp_path / "folder")
    (folder / name).unlink()
    SPECIAL[kind](folder / name)
    said = f"{name}: a {'device' if kind == 'dev-zero' else kind.replace('fifo', 'FIFO')}, not a regular file"
    with alarm():
        code, text = cli_run("verify", folder)
        assert code == 1 and said in text and "FAIL" in text, text
        with pytest.raises(LoadError, match=said) as caught:
            reshard.from_pretrained(folder)
        assert "cannot be loaded" in str(caught.value) and "write the folder again" in str(caught.value)
        with reshard.patch_transformers(), pytest.raises(LoadError, match=said):
            Qwen3MoeForCausalLM.from_pretrained(folder)


@pytest.mark.parametrize("case", ["deleted", "not-json", "a-list"])
def test_a_folder_whose_config_cannot_load_fails_verify(written, tmp_path, case):
    """config.json deleted from OUT: verify said OK on a folder that cannot load."""
    out, _, _ = written
    folder = copy_folder(out, tmp_path / "folder")
    (folder / "config.json").unlink()
    if case != "deleted":
        (folder / "config.json").write_text({"not-json": "{\"model_type\": ", "a-list": "[]"}[case])
    said = {"deleted": "config.json: missing", "not-json": "config.json: not valid JSON",
            "a-list": "config.json: list, not the JSON object of a model config"}[case]
    code, text = cli_run("verify", folder)
    assert code == 1 and said in text and "copy it from the source checkpoint" in text, text
    with alarm(), pytest.raises(LoadError, match=said):
        reshard.from_pretrained(folder)


def test_a_config_passed_by_the_caller_needs_no_config_json(written, tmp_path):
    from transformers import AutoConfig

    out, src, reference = written
    folder = copy_folder(out, tmp_path / "folder")
    (folder / "config.json").unlink()  # still listed as copied: verify says so, a load with its own config does not
    (folder / "generation_config.json").unlink()  # nor a missing file the model does not need
    code, text = cli_run("verify", folder)
    assert code == 1 and "config.json: missing" in text and "generation_config.json: missing" in text, text
    model = reshard.from_pretrained(folder, config=AutoConfig.from_pretrained(src))
    assert_exact(model.state_dict(), reference)


@pytest.mark.slow  # 4-rank loads
@pytest.mark.multirank
def test_config_json_linked_to_dev_zero_stops_every_rank_of_a_four_rank_load(written, tmp_path):
    out, src, _ = written
    folder = copy_folder(out, tmp_path / "folder")
    (folder / "config.json").unlink()
    os.symlink("/dev/zero", folder / "config.json")
    for report in load_errors(folder, src, tmp_path):
        assert "config.json: a device, not a regular file" in report["error"], report


# ---- row 5: an absurd mesh ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("fsdp, said", [
    (40_000_000, "a world size of 40,000,000 ranks (pp 1 x dp_replicate 1 x fsdp 40000000 x tp 1) is over the 65,536"),
    (4096, "mesh.fsdp is 4096: the manifest lists 4 coordinates"),
])
def test_an_absurd_mesh_is_refused_before_anything_expands(written, tmp_path, fsdp, said):
    out, _, reference = written
    folder = copy_folder(out, tmp_path / "huge")
    doc = load_doc(folder)
    doc["mesh"]["fsdp"] = fsdp
    save_doc(folder, doc)
    with alarm(10):  # answered in milliseconds: the mesh bound and the coordinates listed bound the work
        code, text = cli_run("verify", folder)
        assert code == 1 and said in text, text
        with pytest.raises(LoadError, match=re.escape(said)):
            reshard.from_pretrained(folder)
        with pytest.raises(LoadError, match=re.escape(said)):
            reshard.StorageReader(folder)


# ---- row 6: malformed manifests, in every command and the Python API --------------------------------------------

def _set_first(section: str, key: str, value):
    def mutate(doc):
        entry = doc[section][0] if isinstance(doc[section], list) else next(iter(doc[section].values()))
        (entry["placement"] if key in ("kind", "shard_dim") else entry)[key] = value
        return doc
    return mutate


MALFORMED = {  # case -> (mutation, what the message names)
    "a-list": (lambda doc: [], "the document is []"),
    "no-files": (lambda doc: {k: v for k, v in doc.items() if k != "files"}, "files is missing"),
    "no-tensors": (lambda doc: {k: v for k, v in doc.items() if k != "tensors"}, "tensors is missing"),
    "no-mesh": (lambda doc: {k: v for k, v in doc.items() if k != "mesh"}, "mesh is missing"),
    "coord-99": (_set_first("files", "coord", 99), "files[0].coord is 99"),
    "kind-bogus": (_set_first("tensors", "kind", "bogus"), "placement.kind is 'bogus'"),
    "shard-dim-7": (_set_first("tensors", "shard_dim", 7), "placement.shard_dim is 7"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_manifest_is_one_clear_error_everywhere(written, tmp_path, case):
    out, _, _ = written
    folder = copy_folder(out, tmp_path / "folder")
    mutate, said = MALFORMED[case]
    save_doc(folder, mutate(load_doc(folder)))
    for args in (("verify", folder), ("files", folder, "--ranks", "0"), ("merge", folder, tmp_path / "merged")):
        code, text = cli_run(*args)
        assert code == 1 and said in text and "Nothing was changed" in text, (args, text)
    assert not (tmp_path / "merged").exists()
    for call in (read_manifest, reshard.verify, lambda f: reshard.merge_checkpoint(f, tmp_path / "merged"),
                 reshard.from_pretrained, reshard.StorageReader):
        with pytest.raises(ManifestError, match=said.replace("[", r"\[").replace("]", r"\]")) as caught:
            call(folder)
        assert isinstance(caught.value, VerifyError) and isinstance(caught.value, LoadError)


@pytest.mark.parametrize("version", [4, 99])
def test_a_manifest_from_a_newer_reshard_says_to_upgrade(written, tmp_path, version):
    """It was refused with "restore or rewrite" (damage), which neither helps nor is true: a newer reshard wrote it."""
    out, _, _ = written
    folder = copy_folder(out, tmp_path / "newer")
    save_doc(folder, {**load_doc(folder), "version": version, "tool": "reshard 9.0.0"})
    said = f"written by a newer reshard (manifest version {version}, by 'reshard 9.0.0'); upgrade reshard"
    for args in (("verify", folder), ("files", folder, "--ranks", "0"), ("merge", folder, tmp_path / "merged")):
        code, text = cli_run(*args)
        assert code == 1 and said in text and "Nothing was changed" in text, (args, text)
        assert "Restore its reshard.json" not in text and "write the folder again" not in text, text
    with pytest.raises(LoadError, match=re.escape(said)):
        reshard.from_pretrained(folder)
    assert not (tmp_path / "merged").exists()


def test_a_version_2_manifest_listing_each_coordinates_ranks_is_still_read_and_checked(written, tmp_path):
    """Version 2 listed `ranks` per coordinate (one per replica, so it grew with dp_replicate); version 3 derives
    them from the mesh. An older folder loads, and its list is still checked."""
    out, _, reference = written
    folder = copy_folder(out, tmp_path / "v2")
    doc = load_doc(folder)
    assert doc["version"] == 3 and all("ranks" not in c for c in doc["coords"])
    doc["version"] = 2
    for c in doc["coords"]:
        c["ranks"] = [c["coord"]]
    save_doc(folder, doc)
    assert list(read_manifest(folder).coords[3].ranks) == [3]
    assert_exact(assemble_state_dict(folder), reference)
    doc["coords"][1]["ranks"] = [2]
    save_doc(folder, doc)
    with pytest.raises(ManifestError, match=re.escape("coords[1].ranks is [2]: the ranks of coordinate 1")):
        read_manifest(folder)


def test_transformers_under_the_patch_validates_the_manifest_too(written, tmp_path):
    """The patch read the manifest with a plain json.load (no version check): now through `read_manifest`."""
    from transformers import AutoModelForCausalLM

    out, _, _ = written
    for case, mutate in (("version", lambda doc: {**doc, "version": 1}), ("mesh", MALFORMED["no-mesh"][0])):
        folder = copy_folder(out, tmp_path / case)
        save_doc(folder, mutate(load_doc(folder)))
        with reshard.patch_transformers(), pytest.raises(ManifestError, match="version 1|mesh is missing"):
            AutoModelForCausalLM.from_pretrained(folder)


@pytest.mark.parametrize("extras, said", [
    ([{"name": "../x.safetensors", "bytes": 8, "crc32": "00000000", "keys": ["mtp.w"]}], "extras[0].name is '../x"),
    ([{"name": "/elsewhere/extra-00001-of-00001.safetensors", "bytes": 8, "crc32": "00000000", "keys": ["mtp.w"]}],
     "extras[0].name is '/elsewhere"),
    ([{"name": VICTIM, "bytes": 8, "crc32": "00000000", "keys": ["mtp.w"]}], "not a rank file"),
    ([{"name": "extra-00001-of-00001.safetensors", "bytes": -1, "crc32": "00000000", "keys": ["mtp.w"]}],
     "extras[0].bytes is -1"),
    ([{"name": "extra-00001-of-00001.safetensors", "bytes": 8, "crc32": "00000000", "keys": []}],
     "extras[0].keys is []"),
    ({"name": "x"}, "extras is {'name': 'x'}"),
])
def test_a_hostile_extras_section_is_refused(written, extras, said):
    out, _, _ = written
    with pytest.raises(ManifestError, match=re.escape(said)):
        Manifest.from_document({**load_doc(out), "extras": extras}, out)


def test_the_constructor_validates_and_tolerates_unknown_sections(written):
    out, _, _ = written
    doc = load_doc(out)
    assert Manifest.from_document({**doc, "a_later_section": {"anything": [1]}}, out).mesh == MeshSpec(fsdp=FSDP, ep=EP)
    with pytest.raises(ManifestError, match="mesh.fsdp is 0"):
        Manifest.from_document({**doc, "mesh": {**doc["mesh"], "fsdp": 0}}, out)


@pytest.mark.parametrize("how", [{}, {"mode": "stock"}, {"ranks": "2-3"}], ids=["balanced", "stock", "ranks"])
def test_the_writer_types_its_manifest_as_its_document_reads_back(written, tmp_path, monkeypatch, how):
    """The writer builds the manifest from its typed values (the plan, typed file entries), never parsing its own
    document back: what it returns equals what its `reshard.json` parses to, field by field."""
    import reshard.manifest._parsed
    from reshard.manifest import FileEntry
    from reshard.plan import LayoutMode

    def refuse(document):
        raise AssertionError("the writer parsed its own manifest back")

    _, src, _ = written
    out = tmp_path / "out"
    with monkeypatch.context() as patched:
        patched.setattr(reshard.manifest._parsed, "validate_manifest", refuse)
        result = write_checkpoint(src, out, MeshSpec(fsdp=FSDP, ep=EP), progress=False, **how)
    built = result.manifest
    assert result.source_kind is SourceKind.CHECKPOINT  # an enum, printed as its value
    assert json.loads(result.to_json())["layout"] == how.get("mode", "balanced")
    assert built.to_json() == (out / MANIFEST_NAME).read_text()
    assert built == read_manifest(out)  # every field (the document itself is not compared)
    assert built.layout is LayoutMode(how.get("mode", "balanced"))
    assert all(type(f) is FileEntry for f in built.files)
    assert (built.holds is None) == ("ranks" not in how)


def test_a_manifest_goes_to_a_worker_process_as_its_typed_value(written, monkeypatch):
    """Pickled (as `--workers` sends a job), a manifest is its typed value: nothing is validated again."""
    import pickle
    from types import MappingProxyType

    import reshard.manifest._parsed

    out, _, _ = written
    manifest = read_manifest(out)
    manifest.file_entry(VICTIM)  # a cached view: not part of what is sent

    def refuse(document):
        raise AssertionError("validated again")

    monkeypatch.setattr(reshard.manifest._parsed, "validate_manifest", refuse)
    copy = pickle.loads(pickle.dumps(manifest, protocol=pickle.HIGHEST_PROTOCOL))
    assert copy == manifest and copy.to_json() == manifest.to_json() and copy.where == manifest.where
    assert isinstance(copy.tensors, MappingProxyType) and isinstance(copy.source.header_sha256, MappingProxyType)
    assert copy.original_layout() == manifest.original_layout()
    assert copy.chunks(copy.file_entry(VICTIM)) == manifest.chunks(manifest.file_entry(VICTIM))


# ---- property-based: mutated manifests and headers end in a ReshardError or an exact load ---------------------------

HOSTILE_NAMES = ["/dev/zero", "/etc/passwd", "../x.safetensors", "..", ".", "", "a/b.safetensors", "a\\b", "x\0y",
                 MANIFEST_NAME, VICTIM]
VALUES = st.one_of(st.none(), st.booleans(), st.integers(-2, 10), st.integers(-(2 ** 64), 2 ** 64),
                   st.floats(allow_nan=True), st.sampled_from(HOSTILE_NAMES), st.text(max_size=8),
                   st.sampled_from(["F32", "I32", "BF16", "F4", "dense", "expert", "replicated", "00000000"]),
                   st.lists(st.integers(-1, 300), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(),
                                                                                max_size=2))


def _paths(value, prefix=()) -> list[tuple]:
    """Every key path into a JSON value (the long per-key `source_layout` and `header_sha256` lists sampled)."""
    out = [prefix] if prefix else []
    if isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, list):
        items = list(enumerate(value))
    else:
        return out
    if len(items) > 12 and prefix[-1:] not in (("files",), ("coords",), ("order",)):
        items = items[:3] + items[-3:]
    for key, child in items:
        out += _paths(child, prefix + (key,))
    return out


def _apply(doc, path: tuple, action: str, value):
    *parents, last = path
    node = doc
    for key in parents:
        node = node[key]
    if action == "delete":
        del node[last]
    elif action == "retype":
        node[last] = [node[last]] if not isinstance(node[last], list) else json.dumps(node[last])
    elif action == "bump":
        node[last] = node[last] + value if isinstance(node[last], int) and not isinstance(node[last], bool) else value
    else:
        node[last] = value


OUTCOMES: dict[str, int] = {}  # how many cases ended each way (printed with -s: the mix the mutations reach)

# What verify checks that no load needs: the copied non-weight files other than config.json (a tokenizer file
# missing does not stop a load, `reshard.load._agreement.check_copied`). Only such problems may leave verify refusing a
# folder that loads exactly.
_NOT_LOADED = re.compile(r"(?!config\.json:)[^:]*: missing, though reshard\.json lists it as copied from the source; ")


def outcome(folder: Path, reference: dict, *, reader: bool = True) -> str:
    """How verify and the loaders (the one-process load; the storage reader when `reader`: it costs most) end on a
    folder, asserting that they agree: `exact` (verify passes, every loader loads the reference exactly), `refused`
    (verify reports problems, every loader raises a ReshardError) or `verify-only` (verify reports only copied files
    a load does not read, `_NOT_LOADED`, and every loader loads exactly). The source reader (merge, mesh to mesh)
    must end in a ReshardError or a source. Anything else fails the case: a raw exception, a loader that loads what
    verify refuses or refuses what verify passes, two loaders that disagree."""
    from torch.distributed.checkpoint.api import CheckpointException

    results = []
    with alarm():
        verified = verify_folder(folder)  # problems are returned; a raw exception fails
        try:
            assert_exact(assemble_state_dict(folder), reference)
            results.append("exact")
        except ReshardError:
            results.append("refused")
        try:
            if reader:
                assert_exact(reader_load(folder, reference), reference)
                results.append("exact")
        except ReshardError:
            results.append("refused")
        except CheckpointException as e:
            # the reader compares the headers it reads with the manifest before DCP plans: a manifest shape tampered
            # away from the model's is its LoadError, not the planner's size mismatch
            raw = [exc for exc, _ in e.failures.values() if not isinstance(exc, ReshardError)]
            assert not raw, f"the reader raised {raw[0]!r}"
            results.append("refused")
        try:
            open_source(folder)
        except ReshardError:
            pass
    assert len(set(results)) == 1, f"the loaders disagree ({results}); verify: {verified.problems}"
    (loaded,) = set(results)
    if verified.ok:
        assert loaded == "exact", "verify passed a folder a loader refuses"
        kind = "exact"
    elif loaded == "refused":
        kind = "refused"
    else:
        assert all(_NOT_LOADED.match(p) for p in verified.problems), f"verify refused a folder that loads: " \
            f"{verified.problems}"
        kind = "verify-only"
    OUTCOMES[kind] = OUTCOMES.get(kind, 0) + 1
    return kind


PROPERTY = dict(deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
# deadline=None: the alarm above is the hang guard; a deadline would only make a busy CI machine flaky.


@pytest.fixture(scope="module", autouse=True)
def outcome_counts():
    yield
    print(f"\nmanifest integrity outcomes: {OUTCOMES}")


@pytest.fixture(scope="module")
def links(written, tmp_path_factory):
    """A folder of links to `written` whose manifest each case rewrites."""
    return copy_folder(written[0], tmp_path_factory.mktemp("links") / "p")


@pytest.fixture(scope="module")
def playground(written, tmp_path_factory):
    """A folder of links to `written` whose manifest and VICTIM (a real copy) each case rewrites."""
    return copy_folder(written[0], tmp_path_factory.mktemp("playground") / "p", real=(VICTIM,))


@settings(max_examples=examples(700), **PROPERTY)
@given(data=st.data())
def test_mutated_manifests_are_refused_or_load_exactly(written, links, data):
    out, _, reference = written
    doc = load_doc(out)
    paths = _paths(doc)
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        path = data.draw(st.sampled_from(paths), label="path")
        action = data.draw(st.sampled_from(["delete", "set", "retype", "bump"]), label="action")
        value = data.draw(VALUES, label="value")
        try:
            _apply(doc, path, action, value)
        except (KeyError, IndexError, TypeError):
            pass  # an earlier mutation removed or retyped this path
        paths = _paths(doc) if isinstance(doc, (dict, list)) else []
        if not paths:
            break
    save_doc(links, doc)
    outcome(links, reference, reader=data.draw(st.integers(0, 2), label="reader") == 0)


@settings(max_examples=examples(500), **PROPERTY)
@given(data=st.data())
def test_mutated_manifest_bytes_are_refused_or_load_exactly(written, links, data):
    out, _, reference = written
    raw = bytearray((out / MANIFEST_NAME).read_bytes())
    for _ in range(data.draw(st.integers(1, 4), label="edits")):
        at = data.draw(st.integers(0, len(raw) - 1), label="at")
        how = data.draw(st.sampled_from(["flip", "delete", "insert"]), label="how")
        byte = data.draw(st.integers(0, 255), label="byte")
        if how == "flip":
            raw[at] ^= byte or 1
        elif how == "delete":
            del raw[at]
        else:
            raw.insert(at, byte)
    (links / MANIFEST_NAME).write_bytes(bytes(raw))
    outcome(links, reference, reader=data.draw(st.integers(0, 2), label="reader") == 0)


DTYPES = ["F32", "I32", "U32", "F16", "BF16", "I64", "F64", "U8", "BOOL", "F4", "XX"]


@settings(max_examples=examples(200), **PROPERTY)
@given(data=st.data())
def test_mutated_headers_with_restamped_crcs_are_refused_or_load_exactly(written, playground, data):
    out, _, reference = written
    header, body = split_file(out / VICTIM)
    names = sorted(k for k in header if k != "__metadata__")
    pad = None
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        name = data.draw(st.sampled_from(names), label="tensor")
        what = data.draw(st.sampled_from(["dtype", "offsets", "shape", "saved_offsets", "drop", "metadata", "bytes"]),
                         label="what")
        if name not in header:
            continue
        entry = header[name]
        if what == "dtype":
            entry["dtype"] = data.draw(st.sampled_from(DTYPES), label="dtype")
        elif what == "offsets":
            i = data.draw(st.integers(0, 1), label="which")
            entry["data_offsets"][i] += data.draw(st.integers(-64, 64), label="delta")
        elif what == "shape" and entry["shape"]:
            i = data.draw(st.integers(0, len(entry["shape"]) - 1), label="dim")
            entry["shape"][i] = max(0, entry["shape"][i] + data.draw(st.integers(-2, 2), label="delta"))
        elif what == "saved_offsets":
            try:  # an earlier "metadata" mutation may have left no offsets to shift
                info = json.loads(header["__metadata__"]["DCP_SHARDING_INFO"])
                offsets = info[name]["saved_offsets"]
                if not isinstance(offsets, list) or not offsets:
                    continue
                offsets[data.draw(st.integers(0, len(offsets) - 1), label="dim")] += data.draw(st.integers(-3, 3))
            except (ValueError, KeyError, TypeError, IndexError):
                continue
            header["__metadata__"]["DCP_SHARDING_INFO"] = json.dumps(info)
        elif what == "drop":
            del header[name]
        elif what == "metadata":
            header["__metadata__"]["DCP_SHARDING_INFO"] = data.draw(
                st.sampled_from(["", "{", "[]", '{"x": 1}', "null", json.dumps({name: {"saved_offsets": "a"}})]))
        else:
            pad = data.draw(st.integers(0, 16), label="pad")  # spaces after the JSON: every offset shifts
    path = playground / VICTIM
    text = json.dumps(header, separators=(",", ":")).encode() + b" " * (pad or 0)
    if data.draw(st.booleans(), label="raw edit"):
        text = bytearray(text)
        text[data.draw(st.integers(0, len(text) - 1), label="at")] ^= data.draw(st.integers(1, 255), label="bits")
        text = bytes(text)
    path.write_bytes(struct.pack("<Q", len(text)) + text + body)
    save_doc(playground, load_doc(out))
    restamp(playground, VICTIM)
    # the storage reader on a quarter of the cases: every header case is a valid manifest, so each one loads
    outcome(playground, reference, reader=data.draw(st.integers(0, 3), label="reader") == 0)
