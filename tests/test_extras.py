"""Issue 23: tensors the model does not load (MTP layers, unexpected keys) travel through write, mesh to mesh and merge.

The breadth matrix (tests/breadth.py `add_unloaded`, `check_case`, `check_round_trip`) carries the keys every model
class ignores on load through write, verify, load, merge and a second mesh for every MoE type; here, on one tiny
DeepSeek-V3 with an MTP layer (`model.layers.61.*`, what its class ignores) and one unexpected key: where the extras
are kept and that no rank reads them, verify, `--drop-unloaded`, the plan report, a quantized source (the extras'
FP8 pairs dequantized like every other weight, checked against the formula), and a trained folder merged with
`--extras-from`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from reshard.api import merge_checkpoint, plan_checkpoint, verify_folder, write_checkpoint
from reshard.cli import cli
from reshard.errors import ReshardError, UsageError
from reshard.plan import MeshSpec
from reshard.plan import plan_to_dict, render_plan
from reshard.manifest import SHARD_FILE_NAME as SAVED_FILE
from reshard.tiny import add_tensors, make_tiny_checkpoint, quantize_checkpoint
from reshard.words import plural

from conftest import assert_equal_tensors, tensors_of

UNEVEN = MeshSpec(fsdp=3)  # 4 experts over 3: stock leaves rank 2 empty
SECOND = MeshSpec(fsdp=4, ep=2)


def mtp_tensors() -> dict[str, torch.Tensor]:
    """An MTP layer as DeepSeek-V3 ships one (its class ignores `model.layers.61.*`), in mixed dtypes and ranks
    (a scalar too), plus one key that matches no pattern and no parameter (an unexpected key)."""
    g = torch.Generator().manual_seed(61)
    return {
        "model.layers.61.eh_proj.weight": torch.randn(64, 128, generator=g),
        "model.layers.61.enorm.weight": torch.randn(64, generator=g).bfloat16(),
        "model.layers.61.mlp.experts.0.down_proj.weight": torch.randn(64, 24, generator=g),
        "model.layers.61.shared_head.head.weight": torch.randn(512, 64, generator=g),
        "model.layers.61.step": torch.tensor(7, dtype=torch.int64),
        "model.unused_calibration": torch.randn(3, 5, generator=g).half(),
    }



@pytest.fixture(scope="module")
def source(tmp_path_factory):
    root = tmp_path_factory.mktemp("extras")
    return add_tensors(make_tiny_checkpoint("deepseek_v3", root / "src", experts=4), mtp_tensors())


@pytest.fixture(scope="module")
def written(source, tmp_path_factory):
    out = tmp_path_factory.mktemp("written") / "fsdp3"
    write_checkpoint(source, out, UNEVEN, progress=False)
    return out


def test_write_keeps_them_in_files_no_rank_reads(source, written):
    manifest = json.loads((written / "reshard.json").read_text())
    (entry,) = manifest["extras"]
    assert entry["name"] == "extra-00001-of-00001.safetensors" and not SAVED_FILE.match(entry["name"])
    assert set(entry["keys"]) == set(mtp_tensors()) and len(entry["crc32"]) == 8
    assert entry["bytes"] == (written / entry["name"]).stat().st_size
    assert not set(entry["keys"]) & set(manifest["tensors"])  # not model tensors: no placement, no coordinate
    assert all(entry["name"] not in c["files"] for c in manifest["coords"])
    assert_equal_tensors(load_file(written / entry["name"]), mtp_tensors())  # byte for byte, dtypes kept
    listed = CliRunner().invoke(cli, ["files", str(written), "--ranks", "0-2"])
    assert listed.exit_code == 0 and "extra-" not in listed.output, listed.output
    assert verify_folder(written, against=source).ok


def test_merge_gives_every_on_disk_key_back_also_through_a_second_mesh(source, written, tmp_path):
    write_checkpoint(written, tmp_path / "second", SECOND, progress=False, max_shard_size=20_000)
    extras = json.loads((tmp_path / "second" / "reshard.json").read_text())["extras"]
    assert len(extras) > 1 and sorted(k for e in extras for k in e["keys"]) == sorted(mtp_tensors())
    assert verify_folder(tmp_path / "second", against=source).ok
    for n, folder in enumerate([written, tmp_path / "second"]):
        result = CliRunner().invoke(cli, ["merge", str(folder), str(tmp_path / f"m{n}"), "-q", "--json"])
        assert result.exit_code == 0, result.output
        summary = json.loads(result.output)
        assert summary["extras"] == len(mtp_tensors()) and summary["left_out"] is None
        assert_equal_tensors(tensors_of(tmp_path / f"m{n}"), tensors_of(source))  # exactly SRC's keys and bytes
        assert verify_folder(tmp_path / f"m{n}", against=source).ok
    merge_checkpoint(tmp_path / "second", tmp_path / "fused", layout="fused", progress=False)
    fused = tensors_of(tmp_path / "fused")
    assert_equal_tensors({k: fused[k] for k in mtp_tensors()}, mtp_tensors())  # under their own keys there too


def test_verify_names_a_changed_or_missing_extras_file(written, tmp_path):
    copy = shutil.copytree(written, tmp_path / "copy")
    path = copy / "extra-00001-of-00001.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    problems = verify_folder(copy).problems
    assert problems == ("extra-00001-of-00001.safetensors: CRC-32 differs from the manifest (the file is corrupt)",)
    path.unlink()
    problems = verify_folder(copy).problems
    assert len(problems) == 1 and problems[0].startswith("extra-00001-of-00001.safetensors: missing"), problems
    with pytest.raises(ReshardError, match="extra-00001-of-00001.safetensors: missing"):
        merge_checkpoint(copy, tmp_path / "dest", progress=False)
    assert not (tmp_path / "dest").exists()


def test_drop_unloaded_leaves_them_out_and_merge_says_so(source, written, tmp_path):
    out = shutil.copytree(written, tmp_path / "dropped")  # an output with extras files is replaceable: all ours
    result = CliRunner().invoke(cli, ["write", str(source), str(out), "--fsdp", "3", "--drop-unloaded", "-q",
                                      "--overwrite"])
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "reshard.json").read_text())
    assert "extras" not in manifest and manifest["dropped_unloaded"] == len(mtp_tensors())
    assert not list(out.glob("extra-*")) and verify_folder(out, against=source).ok
    result = CliRunner().invoke(cli, ["merge", str(out), str(tmp_path / "m"), "-q"])
    assert result.exit_code == 0, result.output
    assert f"left out: {out} was written with --drop-unloaded: {plural(len(mtp_tensors()), 'tensor')}" in result.output
    assert set(tensors_of(tmp_path / "m")) == set(tensors_of(source)) - set(mtp_tensors())


def test_plan_reports_them_and_what_write_does(source):
    plan = plan_checkpoint(source, UNEVEN).plan
    text = render_plan(plan, "SRC")
    assert ("tensors the model does not load: 6 (166.16 KiB)\n  e.g. model.layers.61.eh_proj.weight, "
            "model.layers.61.enorm.weight, model.layers.61.mlp.experts.0.down_proj.weight\n") in text
    assert ("  5 dropped on purpose (MTP layers...) by DeepseekV3ForCausalLM._keys_to_ignore_on_load_unexpected: "
            r"model\.layers\.61.*") in text
    assert "1 map to no parameter or buffer of the model (unexpected keys)" in text
    assert "write: keeps them whole under their own keys in extra-*.safetensors" in text
    assert "--drop-unloaded leaves them out" in text
    extras = plan_to_dict(plan, "SRC")["extras"]
    nbytes = sum(t.numel() * t.element_size() for t in mtp_tensors().values())
    assert extras == {"tensors": 6, "bytes": nbytes, "examples": list(mtp_tensors())[:3], "ignored_by_class": 5,
                      "ignore_patterns": [r"model\.layers\.61.*"], "unexpected": 1, "write": "kept",
                      "dequantized": 0}
    dropped = plan_checkpoint(source, UNEVEN, drop_unloaded=True).plan
    assert dropped.extras == () and "write: leaves them out (--drop-unloaded)" in render_plan(dropped, "SRC")


def fp8_reference(weight: torch.Tensor, scale: torch.Tensor, block) -> torch.Tensor:
    """The FP8 formula, independently of reshard: every element times the scale of its (ceil-grid) block."""
    bm, bn = block
    rows, cols = weight.shape[-2:]
    full = scale.float().repeat_interleave(bm, -2)[..., :rows, :].repeat_interleave(bn, -1)[..., :cols]
    return (weight.float() * full).to(torch.bfloat16)


def test_a_dequantizing_write_dequantizes_their_quantized_pairs(tmp_path):
    bf16 = make_tiny_checkpoint("deepseek_v3", tmp_path / "bf16", experts=4, dtype="bfloat16")
    add_tensors(bf16, {k: v.bfloat16() if v.is_floating_point() else v for k, v in mtp_tensors().items()})
    src = quantize_checkpoint(bf16, tmp_path / "fp8", method="fp8", block=(16, 16))
    quantized = tensors_of(src)
    pairs = [k for k in mtp_tensors() if f"{k}_scale_inv" in quantized]
    assert len(pairs) == 3  # the MTP layer's matrices are stored FP8, as DeepSeek-V3 ships them
    assert plan_to_dict(plan_checkpoint(src, UNEVEN).plan, "SRC")["extras"]["dequantized"] == 3
    out = tmp_path / "out"
    write_checkpoint(src, out, UNEVEN, dequantize="bf16", progress=False)
    assert verify_folder(out, against=src).ok  # recomputed from the FP8 source, bit for bit
    merge_checkpoint(out, tmp_path / "merged", progress=False)
    merged = tensors_of(tmp_path / "merged")
    assert not [k for k in merged if k.endswith("_scale_inv")]  # one consistent bf16 checkpoint
    for key in mtp_tensors():
        expected = (fp8_reference(quantized[key], quantized[f"{key}_scale_inv"], (16, 16)) if key in pairs
                    else quantized[key])
        assert merged[key].dtype == expected.dtype and torch.equal(merged[key], expected), key


def trained_like(folder: Path, dest: Path) -> Path:
    """What `save_pretrained(..., distributed_checkpoint=True)` leaves after training from `folder`: rank files with
    DCP_SHARDING_INFO and config.json, no manifest, no extras (the lifecycle on gloo ranks: test_merge_lifecycle.py)."""
    dest.mkdir()
    for path in folder.iterdir():
        if SAVED_FILE.match(path.name) or path.name == "config.json":
            shutil.copy2(path, dest / path.name)
    return dest


def test_a_trained_folder_takes_them_from_where_training_started(source, written, tmp_path):
    trained = trained_like(written, tmp_path / "trained")
    result = CliRunner().invoke(cli, ["merge", str(trained), str(tmp_path / "bare"), "-q"])
    assert result.exit_code == 0, result.output
    assert (f"left out: {trained} was saved with save_pretrained(..., distributed_checkpoint=True), which keeps only "
            r"the tensors the model loads: any its checkpoint carried beside them (this model class drops "
            r"model\.layers\.61.* on load), such as MTP layers, are not in it; pass --extras-from") in result.output
    expected = tensors_of(source)
    for n, origin in enumerate([written, source]):  # the reshard folder or the HF checkpoint training started from
        dest = tmp_path / f"published{n}"
        result = CliRunner().invoke(cli, ["merge", str(trained), str(dest), "--extras-from", str(origin), "-q"])
        assert result.exit_code == 0, result.output
        assert "left out" not in result.output
        assert_equal_tensors(tensors_of(dest), expected)
        assert verify_folder(dest, against=trained).ok  # the extras compared with where they came from
        assert verify_folder(dest, against=source).ok


def test_extras_from_refuses_another_model_or_a_folder_without_them(source, written, tmp_path):
    trained = trained_like(written, tmp_path / "trained")
    other = make_tiny_checkpoint("deepseek_v3", tmp_path / "other", experts=4, hidden_size=32)
    add_tensors(other, mtp_tensors())
    with pytest.raises(UsageError, match=r"not the same model .*hidden_size: 32 there, 64 here"):
        merge_checkpoint(trained, tmp_path / "a", extras_from=other, progress=False)
    with pytest.raises(UsageError, match="holds no tensors the model does not load"):
        merge_checkpoint(trained, tmp_path / "b", extras_from=trained, progress=False)
    with pytest.raises(UsageError, match="already holds 6 tensor"):
        merge_checkpoint(written, tmp_path / "c", extras_from=source, progress=False)
    assert not [p for p in tmp_path.iterdir() if p.name in "abc"]


def test_an_extra_that_names_a_model_tensor_is_refused(written):
    from dataclasses import replace

    from reshard.read import open_source
    from reshard.write._merge import merge_tensors

    opened = open_source(written)
    index, layout = opened.index, opened.layout
    clash = replace(layout.extras[0], name="model.embed_tokens.weight")
    with pytest.raises(ReshardError, match="model.embed_tokens.weight is both a tensor of the model and one it does"):
        merge_tensors(index, replace(layout, extras=(clash,)))


@pytest.mark.slow  # 4-rank loads
@pytest.mark.multirank
@pytest.mark.parametrize("mode", ["stock", "reshard"])
def test_ranks_load_exactly_beside_the_extras_file(source, tmp_path, mode):
    """Stock transformers' distributed-checkpoint path (torch's reader opens every *.safetensors header) and
    reshard's reader both load a folder holding an extras file, exactly, on real gloo ranks."""
    from test_loader import assert_loaded_exactly, load

    out = tmp_path / "out"
    write_checkpoint(source, out, MeshSpec(fsdp=2), mode="stock", progress=False)
    assert (out / "extra-00001-of-00001.safetensors").exists()
    _, reports = load(mode, out, source, tmp_path, 2)
    assert_loaded_exactly(reports)
