"""`reshard merge` and mesh-to-mesh `write` from a distributed checkpoint, in one process.

The round trip over every model type of the breadth matrix runs in tests/breadth.py `check_round_trip`; the lifecycle
on real gloo processes (train, save_pretrained(distributed_checkpoint=True), merge, reload) in
tests/test_merge_lifecycle.py. Here: the HF output itself (files, index, sizes), the layouts, bad inputs (each a clear
error with nothing written), the overwrite rules, an interrupted merge, old manifests, and verify of a merged folder.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import save_file

from reshard.api import merge_checkpoint, verify_folder, write_checkpoint
from reshard.cli import cli
from reshard.manifest import coverage_problem
from reshard.read import open_source
from reshard.errors import CheckpointError, OutputError
from reshard.plan import MeshSpec

from conftest import assert_equal_tensors, tensors_of



def nothing_beside(dest: Path) -> None:
    """DEST was not created and no temporary or lock is left beside it."""
    assert not dest.exists()
    assert [p.name for p in dest.parent.iterdir() if p.name.startswith(f".{dest.name}")] == []


@pytest.fixture(scope="module")
def written(tiny, tmp_path_factory):
    """(source, a reshard folder of it at fsdp 3: stock transformers leaves expert ranks empty there)."""
    src = tiny("qwen3_moe", experts=4)
    out = tmp_path_factory.mktemp("merge") / "fsdp3"
    write_checkpoint(src, out, MeshSpec(fsdp=3), progress=False)
    return src, out


def saved_like(folder: Path, dest: Path) -> Path:
    """`folder`'s rank files and config without reshard.json: the layout `save_pretrained(distributed_checkpoint=True)`
    writes (rank-local `shard-*` files with DCP_SHARDING_INFO, in-memory names), for the bad-input cases."""
    shutil.copytree(folder, dest)
    (dest / "reshard.json").unlink()
    return dest


def resave(path: Path, change) -> None:
    """Rewrite one rank file after `change(tensors, offsets)` edits its tensors and saved offsets in place."""
    with safe_open(path, framework="pt") as f:
        metadata = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    info = json.loads(metadata["DCP_SHARDING_INFO"])
    change(tensors, info)
    info = {k: v for k, v in info.items() if k in tensors}
    save_file(tensors, path, metadata={**metadata, "DCP_SHARDING_INFO": json.dumps(info)})


def test_merge_gives_the_source_back_as_a_standard_checkpoint(written, tmp_path):
    src, folder = written
    dest = tmp_path / "published"
    result = CliRunner().invoke(cli, ["merge", str(folder), str(dest), "--max-shard-size", "150KB", "-q", "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    assert summary["layout"] == "original" and summary["source_kind"] == "reshard"
    assert_equal_tensors(tensors_of(dest), tensors_of(src))  # per-expert keys split back out, bit for bit
    index = json.loads((dest / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in dest.glob("*.safetensors"))
    assert files == [f"model-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, len(files) + 1)]
    assert len(files) > 1 and set(index["weight_map"].values()) == set(files)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors_of(src).values())
    data = {f: (dest / f).stat().st_size - 8 - int.from_bytes((dest / f).read_bytes()[:8], "little") for f in files}
    assert all(n <= 150_000 for n in data.values()), data  # no single tensor here is over the limit
    for f in files:
        with safe_open(dest / f, framework="pt") as handle:
            assert handle.metadata() == {"format": "pt"}  # plain safetensors, no DCP metadata
    assert not (dest / "reshard.json").exists()
    assert (dest / "config.json").read_text() == (src / "config.json").read_text()
    assert verify_folder(dest, against=src).ok  # round-trip proof, against the original checkpoint
    assert verify_folder(dest, against=folder).ok  # and against the reshard folder


def test_fused_layout_keeps_the_in_memory_names(written, tmp_path):
    from transformers import AutoModelForCausalLM

    src, folder = written
    merge_checkpoint(folder, tmp_path / "fused", layout="fused", progress=False)
    reference = AutoModelForCausalLM.from_pretrained(src, use_kernels=False).state_dict()
    assert_equal_tensors(tensors_of(tmp_path / "fused"), reference)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "fused", use_kernels=False).state_dict()
    assert_equal_tensors(loaded, reference)
    assert verify_folder(tmp_path / "fused", against=src).ok


def test_mesh_to_mesh_write_from_a_reshard_folder_and_a_saved_folder(written, tmp_path):
    """`reshard write IN OUT` with IN in the distributed layout: the same bytes at another mesh, loadable whole."""
    import reshard
    from transformers import AutoModelForCausalLM

    src, folder = written
    reference = AutoModelForCausalLM.from_pretrained(src, use_kernels=False).state_dict()
    saved = saved_like(folder, tmp_path / "saved")
    for n, source in enumerate([folder, saved]):
        out = tmp_path / f"out{n}"
        result = CliRunner().invoke(cli, ["write", str(source), str(out), "--fsdp", "4", "--ep", "2", "-q"])
        assert result.exit_code == 0, result.output
        assert verify_folder(out, against=src).ok
        assert_equal_tensors(reshard.from_pretrained(out).state_dict(), reference)
        merge_checkpoint(out, tmp_path / f"merged{n}", progress=False)  # the source layout travels along
        assert_equal_tensors(tensors_of(tmp_path / f"merged{n}"), tensors_of(src))


def test_verify_of_a_merged_folder_catches_a_changed_byte(written, tmp_path):
    src, folder = written
    dest = tmp_path / "dest"
    merge_checkpoint(folder, dest, progress=False)
    file = next(dest.glob("model-*.safetensors"))
    raw = bytearray(file.read_bytes())
    raw[-3] ^= 0x40
    file.write_bytes(bytes(raw))
    summary = verify_folder(dest, against=src)
    assert not summary.ok and any("differs from the source" in p for p in summary.problems)
    result = CliRunner().invoke(cli, ["verify", str(dest), "--against", str(src), "-q"])
    assert result.exit_code == 1 and "differs from the source" in result.output


def test_verify_opens_the_folder_and_the_source_once_each(written, tmp_path, monkeypatch):
    """verify's checker opens nothing the caller named: `reshard verify OUT --against SRC` locates OUT and SRC once
    each, for a reshard folder and for a merged one (whose headers are read through the store it was opened with)."""
    import reshard.read._source as source

    src, folder = written
    dest = tmp_path / "dest"
    merge_checkpoint(folder, dest, progress=False)
    located, locate = [], source.locate

    def counted(spec, **kwargs):
        located.append(str(spec))
        return locate(spec, **kwargs)

    monkeypatch.setattr(source, "locate", counted)
    for out in (folder, dest):
        located.clear()
        result = CliRunner().invoke(cli, ["verify", str(out), "--against", str(src), "-q"])
        assert result.exit_code == 0, result.output
        assert sorted(located) == sorted([str(out), str(src)]), located


def test_the_merge_index_is_typed_and_verify_checks_the_layout_it_records(written, tmp_path):
    """The index a merge writes parses back to the value it was written from (`MergeIndex`); verify refuses a merged
    folder whose index records a layout its keys are not in."""
    import reshard
    from reshard.errors import VerifyError
    from reshard.plan import MergeLayout
    from reshard.read._source import SourceKind
    from reshard.results import Checked
    from reshard.write import MergeIndex

    src, folder = written
    for layout, other in (("fused", "original"), ("original", "fused")):
        dest = tmp_path / layout
        result = merge_checkpoint(folder, dest, layout=layout, progress=False)
        assert result.layout is MergeLayout(layout) and result.source_kind is SourceKind.RESHARD  # enums, not strings
        path = dest / "model.safetensors.index.json"
        text = path.read_text()
        index = MergeIndex.from_document(json.loads(text))
        assert index.merged and index.layout is MergeLayout(layout) and index.to_json() == text
        assert reshard.verify(dest, against=src).kind is Checked.MERGED
        document = json.loads(text)
        document["metadata"]["layout"] = other
        path.write_text(json.dumps(document, indent=2) + "\n")
        assert verify_folder(dest).ok  # without --against there is no source to name the keys
        with pytest.raises(VerifyError, match=re.escape(f"records the {other} layout, but the keys are not the "
                                                        f"source's") + r".*\(they are the " + layout):
            reshard.verify(dest, against=src)
    document["metadata"]["layout"] = "sideways"
    path.write_text(json.dumps(document, indent=2) + "\n")
    with pytest.raises(VerifyError, match=re.escape('metadata.layout is "sideways"')):
        reshard.verify(dest)


# ---- bad inputs: a clear message, nothing written -------------------------------------------------------------

def _refused(source: Path, dest: Path, said: str, *more: str, layout: str = "original") -> str:
    with pytest.raises(CheckpointError, match=re.escape(said)) as info:
        merge_checkpoint(source, dest, layout=layout, progress=False)
    message = str(info.value)
    for needle in more:
        assert needle in message, message
    assert "Nothing was written" in message
    nothing_beside(dest)
    return message


def test_a_missing_rank_file_is_named(written, tmp_path):
    _, folder = written
    broken = tmp_path / "reshard-folder"
    shutil.copytree(folder, broken)
    (broken / "shard-00002-model-00001-of-00001.safetensors").unlink()
    _refused(broken, tmp_path / "a", "shard-00002-model-00001-of-00001.safetensors: missing", "the file of rank 1)")
    saved = saved_like(folder, tmp_path / "saved")
    (saved / "shard-00002-model-00001-of-00001.safetensors").unlink()
    _refused(saved, tmp_path / "b", "1 rank file missing: shard-00002-model-*")
    saved_last = saved_like(folder, tmp_path / "saved-last")
    (saved_last / "shard-00003-model-00001-of-00001.safetensors").unlink()  # no hole in the names: a gap in tensors
    _refused(saved_last, tmp_path / "c", "is in no chunk", "a rank file is missing")


def test_overlapping_and_gapped_chunks_are_named(written, tmp_path):
    _, folder = written
    name = "model.layers.0.mlp.experts.gate_up_proj"
    overlap = saved_like(folder, tmp_path / "overlap")

    def shift(tensors, info):
        info[name]["saved_offsets"] = [0, 8, 0]  # rank 1's rows [16:32] (balanced: dim 1) moved onto rank 0's

    resave(overlap / "shard-00002-model-00001-of-00001.safetensors", shift)
    _refused(overlap, tmp_path / "a", name, "overlap on [0:4, 8:16, 0:64]")
    gap = saved_like(folder, tmp_path / "gap")
    resave(gap / "shard-00002-model-00001-of-00001.safetensors", lambda tensors, info: tensors.pop(name))
    _refused(gap, tmp_path / "b", name, "[0:4, 16:32, 0:64] is in no chunk")


def test_a_folder_of_neither_kind_is_refused(written, tmp_path):
    src, _ = written
    _refused(src, tmp_path / "a", "neither a reshard folder", "save_pretrained(..., distributed_checkpoint=True)")
    (tmp_path / "empty").mkdir()
    _refused(tmp_path / "empty", tmp_path / "b", "neither a reshard folder")
    result = CliRunner().invoke(cli, ["merge", str(src), str(tmp_path / "c")])
    assert result.exit_code == 1 and "neither a reshard folder" in result.output
    nothing_beside(tmp_path / "c")


def test_chunks_of_mixed_dtypes_are_refused(written, tmp_path):
    _, folder = written
    name = "model.layers.1.mlp.experts.down_proj"
    saved = saved_like(folder, tmp_path / "saved")

    def to_half(tensors, info):
        tensors[name] = tensors[name].to(torch.float16)

    resave(saved / "shard-00003-model-00001-of-00001.safetensors", to_half)
    _refused(saved, tmp_path / "a", f"the chunks of {name} disagree on its dtype", "F16 in shard-00003")


def test_an_old_manifest_asks_for_the_fused_layout(written, tmp_path):
    src, folder = written
    old = tmp_path / "old"
    shutil.copytree(folder, old)
    manifest = json.loads((old / "reshard.json").read_text())
    del manifest["source_layout"]
    (old / "reshard.json").write_text(json.dumps(manifest))
    _refused(old, tmp_path / "a", "before reshard recorded the source's on-disk layout", "use --layout fused")
    merge_checkpoint(old, tmp_path / "b", layout="fused", progress=False)  # the in-memory names need no record
    assert "model.layers.1.mlp.experts.gate_up_proj" in tensors_of(tmp_path / "b")


# ---- the output folder: the same rules as write ------------------------------------------------------------------

def test_overwrite_rules(written, tmp_path):
    src, folder = written
    dest = tmp_path / "dest"
    merge_checkpoint(folder, dest, progress=False)
    with pytest.raises(OutputError, match="already exists. Pass --overwrite"):
        merge_checkpoint(folder, dest, progress=False)
    merge_checkpoint(folder, dest, progress=False, overwrite=True, layout="fused")  # a merge output: replaced
    assert "model.layers.1.mlp.experts.gate_up_proj" in tensors_of(dest)
    (dest / "notes.bin").write_bytes(b"mine")
    with pytest.raises(OutputError, match="notes.bin, which reshard did not write"):
        merge_checkpoint(folder, dest, progress=False, overwrite=True)
    assert (dest / "notes.bin").read_bytes() == b"mine"
    with pytest.raises(OutputError, match="was not written by reshard merge|neither"):
        merge_checkpoint(folder, src, progress=False, overwrite=True)  # a user's own HF checkpoint is never replaced
    with pytest.raises(OutputError, match=r"DEST .* is SRC .*Nothing was changed"):
        merge_checkpoint(folder, folder, progress=False, overwrite=True)
    assert verify_folder(folder, against=src).ok


def test_an_interrupted_merge_leaves_nothing(written, tmp_path, monkeypatch):
    import reshard.write._merge as merge

    _, folder = written
    calls = []
    real = merge.write_safetensors

    def fail_second(path, *args, **kwargs):
        calls.append(path)
        if len(calls) == 2:
            raise KeyboardInterrupt("signal 15")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(merge, "write_safetensors", fail_second)
    with pytest.raises(KeyboardInterrupt, match="signal 15"):
        merge_checkpoint(folder, tmp_path / "dest", progress=False, max_shard_size=100_000)
    nothing_beside(tmp_path / "dest")
    merge_checkpoint(folder, tmp_path / "old", progress=False)
    before = tensors_of(tmp_path / "old")
    calls.clear()
    with pytest.raises(KeyboardInterrupt, match="signal 15"):
        merge_checkpoint(folder, tmp_path / "old", progress=False, overwrite=True, layout="fused",
                         max_shard_size=100_000)
    assert_equal_tensors(tensors_of(tmp_path / "old"), before)  # the old output, whole
    assert [p for p in tmp_path.iterdir() if p.name.startswith(".old")] == []


def test_coverage_problem_names_the_region():
    assert coverage_problem((4, 6), [((0, 2), (0, 6)), ((2, 2), (0, 3)), ((2, 2), (3, 3))]) is None
    assert coverage_problem((4, 6), [((0, 2), (0, 6)), ((2, 2), (0, 3))], gap_hint=" (a rank file is missing)") == \
        "the chunks cover 18 of its 24 elements; [2:4, 3:6] is in no chunk (a rank file is missing)"
    assert coverage_problem((4,), [((0, 3),), ((2, 2),)]) == "chunks [0:3] and [2:4] overlap on [2:3]"
    assert coverage_problem((), [()]) is None


def test_the_source_layout_is_linear_in_on_disk_keys(written):
    _, folder = written
    manifest = json.loads((folder / "reshard.json").read_text())
    record = manifest["source_layout"]
    index = open_source(folder).index
    keys = [json.loads(p)[0] for pieces in record["tensors"].values() for p in pieces]
    assert record["version"] == 1 and len(keys) == len(set(keys)) == len(index.original and keys)
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in keys
