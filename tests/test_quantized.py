"""Quantized sources (block-scaled FP8, MXFP4) written as bf16 rank files in one pass (`write --dequantize bf16`).

Tiny bf16 checkpoints are quantized here in the shipped formats (`reshard.tiny.quantize_checkpoint`), then planned,
written at an empty-rank mesh (balanced and stock) and an even one, verified against the source, and loaded: in one
process and on 4 gloo ranks. The values are checked against two references that do not use reshard's code:

- the formula, written in this file: `bf16(fp32(w) * scale[i // bm, j // bn])` with the block size of
  `weight_block_size` and a ceil grid (`fp8_reference`);
- transformers' own dequantizing CPU load (`FineGrainedFP8Config` dequantizes automatically on CPU; MXFP4 with
  `Mxfp4Config(dequantize=True)`), where transformers handles the shape. It derives the FP8 block from the scale
  grid, so it is wrong where a partial edge block makes the grid divide the shape unevenly (the DeepSeek-V3 case
  below): those tensors equal the formula and differ from transformers, which this file asserts too.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

import reshard
from reshard.api import plan_checkpoint, verify, write_checkpoint
from reshard.read import open_source
from reshard.cli import cli
from reshard.runs import Dequantizer
from reshard.runs._dequant import slabs
from reshard.errors import QuantizationError, UsageError
from reshard.plan import MeshSpec
from reshard.plan import plan_to_dict, render_plan
from reshard.tiny import make_tiny_checkpoint, quantize_checkpoint

from conftest import rank_reports, run_ranks

# model -> (tiny model type, experts, on-disk layout, method, block); 6 experts leave stock rank 3 of fsdp 4 empty
MODELS = {
    "deepseek_v3-fp8": ("deepseek_v3", 6, False, "fp8", (16, 16)),  # 24-row experts: partial 16-row blocks
    "qwen3_moe-fp8": ("qwen3_moe", 6, False, "fp8", (32, 32)),
    "qwen3_moe-fp8-fused": ("qwen3_moe", 6, True, "fp8", (32, 32)),
    "gpt_oss-mxfp4": ("gpt_oss", 6, True, "mxfp4", None),
}
EMPTY_MESH = MeshSpec(fsdp=4)  # 6 experts over 4: [2, 2, 2, 0] in the stock layout
EVEN_MESH = MeshSpec(fsdp=2)


def fp8_reference(weight: torch.Tensor, scale: torch.Tensor, block) -> torch.Tensor:
    """The FP8 formula, independently of reshard: every element times the scale of its (ceil-grid) block."""
    bm, bn = block
    rows, cols = weight.shape[-2:]
    full = scale.float().repeat_interleave(bm, -2)[..., :rows, :].repeat_interleave(bn, -1)[..., :cols]
    return (weight.float() * full).to(torch.bfloat16)


def _state(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def _reference_folder(quantized: Path, bf16_source: Path, dest: Path, block) -> Path:
    """A bf16 checkpoint in the source's key layout holding the formula's values (FP8), for stock transformers."""
    state = _state(quantized)
    out = {}
    for key, tensor in state.items():
        if key.endswith("_scale_inv"):
            continue
        out[key] = fp8_reference(tensor, state[f"{key}_scale_inv"], block) if f"{key}_scale_inv" in state else tensor
    dest.mkdir()
    save_file(out, dest / "model.safetensors", metadata={"format": "pt"})
    shutil.copy2(bf16_source / "config.json", dest / "config.json")
    return dest


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (quantized source, bf16 reference folder, method, block), generated once."""
    root = tmp_path_factory.mktemp("quantized")
    out = {}
    for name, (model_type, experts, fused, method, block) in MODELS.items():
        bf16 = make_tiny_checkpoint(model_type, root / f"{name}-bf16", experts=experts, fused=fused,
                                    dtype="bfloat16")
        quantized = quantize_checkpoint(bf16, root / name, method=method, block=block or (128, 128))
        if method == "fp8":
            reference = _reference_folder(quantized, bf16, root / f"{name}-ref", block)
        else:  # MXFP4: transformers' own dequantizing load is the reference (it handles every gpt-oss shape)
            from transformers import AutoModelForCausalLM, Mxfp4Config

            model = AutoModelForCausalLM.from_pretrained(quantized, dtype=torch.bfloat16,
                                                         quantization_config=Mxfp4Config(dequantize=True),
                                                         use_kernels=False)
            reference = root / f"{name}-ref"  # its state dict as is (save_pretrained would quantize it back)
            reference.mkdir()
            save_file({k: v.contiguous() for k, v in model.state_dict().items()}, reference / "model.safetensors",
                      metadata={"format": "pt"})
            shutil.copy2(bf16 / "config.json", reference / "config.json")
        out[name] = (quantized, reference, method, block)
    return out


@pytest.fixture(scope="module")
def written(models, tmp_path_factory):
    """(name, layout, mesh) -> folder: every model at the empty-rank mesh (balanced, stock) and the even one."""
    root = tmp_path_factory.mktemp("dequantized")
    out = {}
    for name, (src, *_rest) in models.items():
        for mode, mesh in (("balanced", EMPTY_MESH), ("stock", EMPTY_MESH), ("balanced", EVEN_MESH)):
            folder = root / f"{name}-{mode}-{mesh.fsdp}"
            write_checkpoint(src, folder, mesh, mode=mode, dequantize="bf16", progress=False)
            out[name, mode, mesh.fsdp] = folder
    return out


def _transformers_load(src: Path, method: str):
    from transformers import AutoModelForCausalLM, Mxfp4Config

    extra = {"quantization_config": Mxfp4Config(dequantize=True)} if method == "mxfp4" else {}
    return AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16, **extra, use_kernels=False).state_dict()


def test_plan_reports_the_quantization(models):
    src, _, method, block = models["deepseek_v3-fp8"]
    plan = plan_checkpoint(src, EMPTY_MESH).plan
    text = render_plan(plan, str(src))
    assert "quantized source: FP8 (F8_E4M3) with block scales, 16x16 per scale" in text
    assert "--dequantize bf16" in text
    doc = plan_to_dict(plan, str(src))["quantization"]
    state = _state(src)
    assert doc["quantized_source_tensors"] == sum(k.endswith("_scale_inv") for k in state)
    assert doc["quantized_source_bytes"] == sum(t.numel() * t.element_size() for k, t in state.items()
                                                if t.dtype == torch.float8_e4m3fn or k.endswith("_scale_inv"))
    reference = _state(models["deepseek_v3-fp8"][1])
    assert doc["output_bytes"] == sum(t.numel() * t.element_size() for t in reference.values())
    # planned on the bf16 model: the experts are BF16 and fused, the scales are gone
    names = {tp.tensor.name: tp.tensor for tp in plan.tensors}
    assert names["model.layers.1.mlp.experts.gate_up_proj"].dtype == "BF16"
    assert not any("scale_inv" in n for n in names)
    gpt = plan_checkpoint(models["gpt_oss-mxfp4"][0], EMPTY_MESH).plan
    assert "MXFP4" in render_plan(gpt, "gpt")
    assert {tp.tensor.name: tp.tensor.shape for tp in gpt.tensors}["model.layers.0.mlp.experts.gate_up_proj"] == \
        (6, 64, 192)  # [E, in, out], transposed from the blocks' [E, out, in / 32, 16]


def test_mapping_a_quantized_index_directly_names_the_call_that_gives_its_bf16_view(models):
    """`find_experts` on a quantized checkpoint as stored is refused, naming the public call that maps its bf16
    view; that call works."""
    from reshard import find_experts, open_source
    from reshard.errors import ArchitectureError
    from reshard.read._source import read_checkpoint

    src = models["deepseek_v3-fp8"][0]
    with pytest.raises(ArchitectureError, match=r"open it with reshard\.open_source\(\.\.\.\), whose model_layout"):
        find_experts(read_checkpoint(src))
    assert open_source(src).model_layout().experts


@pytest.mark.parametrize("name", list(MODELS))
def test_written_folders_verify_and_carry_the_bf16_config(models, written, name):
    src, reference, method, block = models[name]
    for (model, mode, fsdp), folder in written.items():
        if model != name:
            continue
        summary = verify(folder, against=src, progress=False)
        assert summary.dequantized_tensors, "verify must recompute the dequantized chunks"
        manifest = json.loads((folder / "reshard.json").read_text())
        config = json.loads((folder / "config.json").read_text())
        assert "quantization_config" not in config
        assert manifest["source"]["quantization_config"]["quant_method"] == method
        computed = {n for n, t in manifest["tensors"].items() if "dequantized_from" in t}
        assert computed == set(summary.dequantized_tensors)
        assert all(manifest["tensors"][n]["dtype"] == "BF16" for n in computed)
        if mode == "stock" and fsdp == 4:
            assert sum(c["empty_markers"] for c in manifest["coords"]) > 0  # the empty-rank mesh has empty ranks


def test_a_merged_dequantized_folder_verifies_against_its_reshard_folder_not_the_quantized_source(models, written,
                                                                                                 tmp_path):
    src = models["qwen3_moe-fp8"][0]
    folder = written["qwen3_moe-fp8", "balanced", EMPTY_MESH.fsdp]
    merged = tmp_path / "merged"
    assert CliRunner().invoke(cli, ["merge", str(folder), str(merged), "-q"]).exit_code == 0
    assert verify(merged, against=folder, progress=False).ok
    result = CliRunner().invoke(cli, ["verify", str(merged), "--against", str(src), "-q"])
    assert result.exit_code == 2, result.output
    assert "is a quantized checkpoint" in result.output and "--against" in result.output
    assert "Traceback" not in result.output and "read_source" not in result.output


@pytest.mark.parametrize("name", list(MODELS))
def test_single_process_load_equals_the_references(models, written, name):
    src, reference_folder, method, block = models[name]
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(reference_folder, dtype=torch.bfloat16,
                                                     use_kernels=False).state_dict()
    by_transformers = _transformers_load(src, method)
    for key in [(name, "balanced", 4), (name, "stock", 4), (name, "balanced", 2)]:
        state = reshard.from_pretrained(written[key]).state_dict()
        assert state.keys() == reference.keys()
        assert [n for n, t in state.items() if not torch.equal(t, reference[n])] == [], key
    differs = sorted(n for n, t in state.items() if not torch.equal(t, by_transformers[n]))
    if name == "deepseek_v3-fp8":
        # transformers takes the block as rows // scale_rows: 24-row weights with a [2, .] grid get 12-row blocks.
        # Exactly the tensors with such a partial block differ from it; the rest equal it bit for bit.
        partial = sorted(n for n in state if re.search(r"experts\.(gate_up|down)_proj$|shared_experts\.", n))
        assert differs == partial and partial
    elif name == "qwen3_moe-fp8-fused":
        # transformers 5.23 has no dequantizing converter for fused FP8 experts on disk: it reports the
        # `*_scale_inv` keys as unexpected and loads the raw codes, so only the fused experts differ
        assert differs == sorted(n for n in state if re.search(r"experts\.(gate_up|down)_proj$", n))
    else:
        assert differs == []


def test_dequantized_values_follow_the_formula_on_disk(models, written):
    """The rank files themselves (not a load): each per-expert FP8 weight sits in the fused chunk as the formula
    gives it, whatever the split (balanced splits the fused dim 1 across the 24-row partial blocks)."""
    src, _, _, block = models["deepseek_v3-fp8"]
    state = _state(src)
    folder = written["deepseek_v3-fp8", "balanced", 4]
    full = torch.zeros(6, 48, 64, dtype=torch.bfloat16)
    seen = torch.zeros(6, 48, 64, dtype=torch.int32)
    for file in folder.glob("shard-*.safetensors"):
        from safetensors import safe_open

        with safe_open(file, "pt") as f:
            offsets = json.loads(f.metadata()["DCP_SHARDING_INFO"])
            key = "model.layers.1.mlp.experts.gate_up_proj"
            chunk = f.get_tensor(key)
            region = tuple(slice(o, o + n) for o, n in zip(offsets[key]["saved_offsets"], chunk.shape))
            full[region] = chunk
            seen[region] += 1
    assert torch.equal(seen, torch.ones_like(seen))
    for e in range(6):
        for half, proj in enumerate(("gate", "up")):
            key = f"model.layers.1.mlp.experts.{e}.{proj}_proj.weight"
            expected = fp8_reference(state[key], state[f"{key}_scale_inv"], block)
            assert torch.equal(full[e, half * 24:(half + 1) * 24], expected), key


def test_slabs_bound_memory_and_give_the_same_bytes(models, tmp_path, monkeypatch):
    """A tiny slab budget cuts every chunk into many slabs (mid-block, mid-expert): the files are identical."""
    import reshard.runs._dequant as dequant

    src = models["deepseek_v3-fp8"][0]
    write_checkpoint(src, tmp_path / "big", EMPTY_MESH, dequantize="bf16", progress=False)
    monkeypatch.setattr(dequant, "SLAB_BYTES", 256)
    write_checkpoint(src, tmp_path / "small", EMPTY_MESH, dequantize="bf16", progress=False)
    for file in sorted((tmp_path / "big").iterdir()):
        assert file.read_bytes() == (tmp_path / "small" / file.name).read_bytes(), file.name


def test_slabs_tile_a_box_in_order():
    box = ((2, 3), (0, 5), (4, 6))
    for budget in (2, 12, 60, 10_000):
        pieces = list(slabs(box, 2, budget))
        cells = [(a, b, c) for s in pieces for a in range(s[0][0], s[0][0] + s[0][1])
                 for b in range(s[1][0], s[1][0] + s[1][1]) for c in range(s[2][0], s[2][0] + s[2][1])]
        expected = [(a, b, c) for a in range(2, 5) for b in range(5) for c in range(4, 10)]
        assert cells == expected, budget  # row-major order, each cell once
        assert all(2 * (s[0][1] * s[1][1] * s[2][1]) <= max(budget, 12) for s in pieces)


def test_fp8_regions_with_partial_blocks_match_the_formula(tmp_path):
    """Any region of a weight whose shape is not a multiple of the block, incl. DeepSeek-V3's [576, 7168] case
    in miniature ([36, 56] in 8x8 blocks: a [5, 7] grid)."""
    torch.manual_seed(0)
    weight = (torch.randn(2, 36, 56) * 100).to(torch.float8_e4m3fn)
    scale = torch.rand(2, 5, 7) + 0.01
    save_file({"w": weight, "w_scale_inv": scale}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "x", "quantization_config": {
        "quant_method": "fp8", "weight_block_size": [8, 8]}}))
    index = open_source(tmp_path).index
    expected = fp8_reference(weight, scale, (8, 8))
    dq = Dequantizer(index)
    try:
        for lo, hi in [([0, 0, 0], [2, 36, 56]), ([1, 3, 5], [2, 35, 50]), ([0, 31, 9], [1, 36, 17]),
                       ([0, 8, 48], [2, 16, 56])]:
            got = dq.region("w", lo, hi)
            assert torch.equal(got, expected[tuple(slice(a, b) for a, b in zip(lo, hi))]), (lo, hi)
    finally:
        dq.close()


def test_mxfp4_regions_match_transformers(tmp_path):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    torch.manual_seed(0)
    blocks = torch.randint(0, 256, (3, 40, 4, 16), dtype=torch.uint8)
    scales = torch.randint(110, 140, (3, 40, 4), dtype=torch.uint8)
    save_file({"p_blocks": blocks, "p_scales": scales}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "x", "quantization_config": {
        "quant_method": "mxfp4"}}))
    index = open_source(tmp_path).index
    expected = convert_moe_packed_tensors(blocks, scales)  # [3, 128, 40]
    dq = Dequantizer(index)
    try:
        assert index.tensors["p"].shape == tuple(expected.shape)
        for lo, hi in [([0, 0, 0], [3, 128, 40]), ([1, 5, 3], [3, 70, 39]), ([2, 96, 0], [3, 128, 1])]:
            got = dq.region("p", lo, hi)
            assert torch.equal(got, expected[tuple(slice(a, b) for a, b in zip(lo, hi))]), (lo, hi)
    finally:
        dq.close()


def test_workers_write_the_same_files(models, written, tmp_path):
    src = models["qwen3_moe-fp8"][0]
    write_checkpoint(src, tmp_path / "w2", EMPTY_MESH, dequantize="bf16", progress=False, workers=2)
    one = written["qwen3_moe-fp8", "balanced", 4]
    for file in sorted(one.iterdir()):
        if file.name != "reshard.json":
            assert file.read_bytes() == (tmp_path / "w2" / file.name).read_bytes(), file.name


@pytest.mark.slow  # 4-rank loads
@pytest.mark.multirank
def test_multirank_loads_equal_the_references(models, written, tmp_path):
    pairs = [f"{written[name, mode, 4]}={models[name][1]}"
             for name, mode in (("deepseek_v3-fp8", "balanced"), ("qwen3_moe-fp8", "stock"),
                                ("qwen3_moe-fp8-fused", "balanced"), ("gpt_oss-mxfp4", "stock"))]
    run_ranks("load_pairs.py", 4, tmp_path, *pairs, timeout=240)
    for report in rank_reports(tmp_path, 4):
        assert "error" not in report, report.get("traceback")
        assert len(report["folders"]) == len(pairs)
        for folder, result in report["folders"].items():
            assert result["mismatched"] == [] and result["missing"] == [], (report["rank"], folder)


# ---- bad inputs: a clear message, nothing written -----------------------------------------------------------------

def _broken(models, tmp_path, edit) -> Path:
    src = tmp_path / "src"
    shutil.copytree(models["qwen3_moe-fp8"][0], src)
    edit(src)
    return src


def _rewrite(src: Path, change) -> None:
    state = _state(src)
    change(state)
    for file in src.glob("*.safetensors"):
        file.unlink()
    save_file(state, src / "model.safetensors", metadata={"format": "pt"})


def _config(src: Path, change) -> None:
    config = json.loads((src / "config.json").read_text())
    change(config["quantization_config"])
    (src / "config.json").write_text(json.dumps(config))


BAD = {
    "scale missing": (lambda s: _rewrite(s, lambda st: st.pop("model.layers.1.mlp.experts.0.up_proj.weight_scale_inv")),
                      "has no scale 'model.layers.1.mlp.experts.0.up_proj.weight_scale_inv'"),
    "grid does not cover": (lambda s: _config(s, lambda q: q.update(weight_block_size=[8, 32])),
                            "the scale grid does not cover the weight"),
    "unknown method": (lambda s: _config(s, lambda q: q.update(quant_method="awq")),
                       "quant_method 'awq' is not supported"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_quantized_inputs_fail_clearly_and_write_nothing(models, tmp_path, case):
    edit, message = BAD[case]
    src = _broken(models, tmp_path, edit)
    for args in (["plan", str(src), "--fsdp", "4"],
                 ["write", str(src), str(tmp_path / "out"), "--fsdp", "4", "--dequantize", "bf16", "-q"]):
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == 1, result.output
        assert message in result.output
        assert "Traceback" not in result.output
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["src"]  # no temporary folder or lock left either


def test_an_fp8_dtype_this_torch_lacks_is_refused_before_writing(models, tmp_path, monkeypatch):
    from reshard.read import _checkpoint as checkpoint

    monkeypatch.setitem(checkpoint.TORCH_DTYPE_NAMES, "F8_E4M3", "float8_e4m3_not_in_this_torch")
    result = CliRunner().invoke(cli, ["write", str(models["qwen3_moe-fp8"][0]), str(tmp_path / "out"), "--fsdp", "4",
                                      "--dequantize", "bf16", "-q"])
    assert result.exit_code == 1
    assert "has no float8_e4m3_not_in_this_torch dtype" in result.output and "Install a torch" in result.output
    assert list(tmp_path.iterdir()) == []


def test_a_quantized_source_without_the_flag_is_a_usage_error(models, tmp_path):
    src = models["gpt_oss-mxfp4"][0]
    result = CliRunner().invoke(cli, ["write", str(src), str(tmp_path / "out"), "--fsdp", "4", "-q"])
    assert result.exit_code == 2
    assert "pass --dequantize bf16" in result.output and "MXFP4" in result.output
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(UsageError, match="--dequantize bf16"):
        write_checkpoint(src, tmp_path / "out", EMPTY_MESH, progress=False)
    with pytest.raises(QuantizationError, match=r"scale 'a\.weight_scale_inv' has no weight 'a\.weight' beside it"):
        index_dir = tmp_path / "lonely"
        index_dir.mkdir()
        save_file({"a.weight_scale_inv": torch.ones(1, 1)}, index_dir / "model.safetensors")
        (index_dir / "config.json").write_text(json.dumps({"model_type": "x", "quantization_config": {
            "quant_method": "fp8", "weight_block_size": [128, 128]}}))
        open_source(index_dir)
