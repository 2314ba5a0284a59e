"""`reshard write` end to end: every byte lands where the loader expects it, checked independently of reshard.

For each model and layout the written folder is checked twice:

- by `reshard.verification.verify(out, against=src)`;
- by this file alone: every shard is opened with `safetensors.safe_open`, each chunk is placed at the
  `saved_offsets` its header's `DCP_SHARDING_INFO` gives, into a zero tensor of the global shape while a counter
  tensor records coverage (every element written exactly once), and the result is compared with `torch.equal` to
  `AutoModelForCausalLM.from_pretrained(src).state_dict()` (the reference loader, not reshard's key mapping).
  Which coordinates hold empty markers is recomputed here from `reshard.plan._placement.chunk` and the placement rules
  (DESIGN.md sections 1-2), not from `local_box`.
"""

from __future__ import annotations

import filecmp
import json
import math
import re
import struct
import zlib
from functools import lru_cache
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open

from reshard.api import verify, write_checkpoint
from reshard.cli import cli
from reshard import read_manifest
from reshard.plan import MeshSpec
from reshard.plan._placement import chunk
from reshard.words import plural

# transformers 5.23 `distributed/checkpoint.py`: the names that select the distributed-checkpoint loader
HF_SHARD_RE = re.compile(r"^shard-[0-9]{5}-model-[0-9]{5}-of-[0-9]{5}\.safetensors$")
SHARD_RE = re.compile(r"^shard-([0-9]{5})-model-([0-9]{5})-of-([0-9]{5})\.safetensors$")
TORCH_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}

# (model_type, experts): Qwen3-MoE 2 experts, Mixtral 8, GLM-like 10 (shared experts, e_score_correction_bias
# buffer), DeepSeek-V3-like 8 (shared experts, bias buffer), gpt-oss 4 (fused on disk, expert biases)
MODELS = [("qwen3_moe", 2), ("mixtral", 8), ("glm4_moe", 10), ("deepseek_v3", 8), ("gpt_oss", 4)]
MESHES = [MeshSpec(fsdp=4), MeshSpec(fsdp=5), MeshSpec(fsdp=8, ep=2)]
CASES = [
    pytest.param(model_type, experts, fused, mesh, mode,
                 id=f"{model_type}-{'fused' if fused else 'per_expert'}-fsdp{mesh.fsdp}-ep{mesh.ep}-{mode}")
    for model_type, experts in MODELS for fused in (False, True) for mesh in MESHES for mode in ("stock", "balanced")
]


# ---- the independent reference ----------------------------------------------------------------------------------

@lru_cache(maxsize=None)
def reference(src: Path) -> tuple[dict[str, torch.Tensor], frozenset[str]]:
    """`from_pretrained(src).state_dict()` and the names of its persistent buffers (cached per source)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, use_kernels=False)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    return state, frozenset(set(state) - params)


def source_dtypes(src: Path) -> set[str]:
    dtypes = set()
    for path in src.glob("*.safetensors"):
        with safe_open(path, framework="pt") as f:
            dtypes |= {f.get_slice(k).get_dtype() for k in f.keys()}
    return dtypes


def is_routed_expert(name: str) -> bool:
    return ".experts." in name and "shared" not in name


def expected_box(shape, *, expert: bool, mesh: MeshSpec, mode: str, coord: int) -> list[tuple[int, int]]:
    """What fsdp coordinate `coord` holds, from `chunk` and the rules of DESIGN.md (independent of `local_box`).

    Dense: dim 0 chunked over fsdp. Experts: dim 0 cut into ep blocks (EP innermost: ep index = coord % ep),
    each chunked over efsdp; balanced moves that split to the first dim >= 1 dividing by efsdp when the block's
    rows do not. An empty chunk has offset = dim size on its empty dim.
    """
    box = [(0, n) for n in shape]
    if not expert:
        box[0] = chunk(shape[0], mesh.fsdp, coord)
    else:
        efsdp_index, ep_index = divmod(coord, mesh.ep)
        rows = shape[0] // mesh.ep
        d = 0
        if mode == "balanced" and rows % mesh.efsdp:
            d = next((i for i in range(1, len(shape)) if shape[i] % mesh.efsdp == 0), 0)
        box[0] = (ep_index * rows, rows)
        offset, length = chunk(box[d][1], mesh.efsdp, efsdp_index)
        box[d] = (shape[d], 0) if length == 0 else (box[d][0] + offset, length)
    return [(shape[i], 0) if n == 0 else (o, n) for i, (o, n) in enumerate(box)]


def read_shards(out: Path) -> dict[str, list[tuple[int, list[int], torch.Tensor, str]]]:
    """Every chunk on disk: name -> [(coord, saved_offsets, tensor, file)], read with safe_open only."""
    chunks: dict[str, list] = {}
    for path in sorted(out.glob("*.safetensors")):
        m = SHARD_RE.match(path.name)
        assert m, f"{path.name} is not a shard file name"
        coord = int(m.group(1)) - 1
        with safe_open(path, framework="pt") as f:
            metadata = f.metadata()
            info = json.loads(metadata["DCP_SHARDING_INFO"])
            assert set(info) == set(f.keys()), f"{path.name}: DCP_SHARDING_INFO and the tensors differ"
            for key in f.keys():
                chunks.setdefault(key, []).append((coord, list(info[key]["saved_offsets"]), f.get_tensor(key),
                                                   path.name))
    return chunks


def check_independently(src: Path, out: Path, mesh: MeshSpec, mode: str) -> None:
    """Assemble every tensor from the shard files and compare it with the reference loader, bit-exactly; the
    manifest's empty markers and roles are those found."""
    manifest = read_manifest(out)
    state, buffers = reference(src)
    chunks = read_shards(out)
    disk_dtypes = source_dtypes(src)
    assert len(disk_dtypes) == 1
    disk_dtype = TORCH_DTYPES[disk_dtypes.pop()]
    assert set(chunks) == set(state), f"on disk but not in the model: {sorted(set(chunks) - set(state))[:4]}; " \
                                      f"in the model but not on disk: {sorted(set(state) - set(chunks))[:4]}"
    expected_empty, found_empty = set(), set()
    for name, ref in state.items():
        assert ref.dtype == disk_dtype, f"{name}: the reference loader changed the dtype"
        full = torch.zeros_like(ref)
        count = torch.zeros(ref.shape, dtype=torch.int32)
        replicated = name in buffers or ref.dim() == 0
        coords = sorted(c for c, _, _, _ in chunks[name])
        assert coords == list(range(mesh.fsdp)), f"{name}: stored for coordinates {coords}"  # every one stands alone
        for coord, offsets, tensor, file in chunks[name]:
            assert tensor.dtype == disk_dtype, f"{file}: {name} is {tensor.dtype}, the source is {disk_dtype}"
            assert len(offsets) == ref.dim() and tensor.dim() == ref.dim()
            if replicated:
                box = [(0, n) for n in ref.shape]
            else:
                box = expected_box(tuple(ref.shape), expert=is_routed_expert(name), mesh=mesh, mode=mode,
                                   coord=coord)
            assert [o for o, _ in box] == offsets and [n for _, n in box] == list(tensor.shape), \
                f"{file}: {name} offsets/shape {offsets}/{list(tensor.shape)}, expected {box}"
            if any(n == 0 for _, n in box):
                expected_empty.add((coord, name))
            if tensor.numel() == 0:
                found_empty.add((coord, name))
                continue
            if replicated:  # a whole copy in every coordinate: each one must equal the source
                assert torch.equal(tensor, ref), f"{file}: the copy of {name} differs from the source"
                if coord:
                    continue
            region = tuple(slice(o, o + n) for o, n in zip(offsets, tensor.shape))
            full[region] = tensor
            count[region] += 1
        assert torch.equal(count, torch.ones_like(count)), \
            f"{name}: elements written {int(count.min())}..{int(count.max())} times, expected exactly once"
        assert torch.equal(full, ref), f"{name}: assembled shards differ from the reference"
    assert found_empty == expected_empty
    listed = {(f.coord, c.name) for f in manifest.files for c in manifest.chunks(f) if c.is_empty}
    assert listed == expected_empty
    assert [c.empty_markers for c in manifest.coords] == \
        [sum(1 for coord, _ in expected_empty if coord == c) for c in range(mesh.fsdp)]
    roles = {name: t.role for name, t in manifest.tensors.items()}
    assert {n for n, r in roles.items() if r == "expert"} == {n for n in state if is_routed_expert(n)}


# ---- every model, layout, mesh and mode ---------------------------------------------------------------------------

@pytest.mark.parametrize("model_type, experts, fused, mesh, mode", CASES)
def test_write_matches_reference(tiny, tmp_path, model_type, experts, fused, mesh, mode):
    src = tiny(model_type, experts=experts, fused=fused)
    with safe_open(src / "model.safetensors", framework="pt") as f:
        per_expert_keys = [k for k in f.keys() if re.search(r"\.experts\.\d+\.", k)]
    if model_type != "gpt_oss":  # gpt-oss has no per-expert format: both fixtures are fused on disk
        assert bool(per_expert_keys) == (not fused), "the fixture's on-disk layout is not the one under test"
    out = tmp_path / "out"
    manifest = write_checkpoint(src, out, mesh, mode=mode, progress=False).manifest
    summary = verify(out, against=src)
    state, buffers = reference(src)
    copies = {name: mesh.fsdp if name in buffers or t.dim() == 0 else 1 for name, t in state.items()}
    assert summary.bytes_compared == sum(t.numel() * t.element_size() * copies[n] for n, t in state.items())
    assert summary.empty_markers == sum(c.empty_markers for c in manifest.coords) == manifest.empty_markers
    check_independently(src, out, mesh, mode)


@pytest.mark.parametrize("mesh", [MeshSpec(fsdp=5), MeshSpec(fsdp=8, ep=2)], ids=["fsdp5", "fsdp8-ep2"])
def test_write_bfloat16_keeps_dtype(tiny, tmp_path, mesh):
    src = tiny("qwen3_moe", experts=2, dtype="bfloat16")
    assert source_dtypes(src) == {"BF16"}
    out = tmp_path / "out"
    write_checkpoint(src, out, mesh, mode="balanced", progress=False)
    verify(out, against=src)
    check_independently(src, out, mesh, "balanced")


def test_expected_empty_ranks_are_what_the_design_says(tiny, tmp_path):
    """The arithmetic this file checks against gives DESIGN.md's worked examples (so it can fail by itself)."""
    assert [chunk(8, 5, i)[1] for i in range(5)] == [2, 2, 2, 2, 0]  # Mixtral 8 experts, fsdp 5
    assert [chunk(2, 4, i)[1] for i in range(4)] == [1, 1, 0, 0]  # Qwen3-MoE 2 experts, fsdp 4
    glm = [expected_box((10, 48, 64), expert=True, mesh=MeshSpec(fsdp=8, ep=2), mode="stock", coord=c)
           for c in range(8)]
    assert [b[0][1] for b in glm] == [2, 2, 2, 2, 1, 1, 0, 0]
    assert glm[6] == [(10, 0), (0, 48), (0, 64)]
    balanced = [expected_box((10, 48, 64), expert=True, mesh=MeshSpec(fsdp=8, ep=2), mode="balanced", coord=c)
                for c in range(8)]
    assert balanced[6] == [(0, 5), (36, 12), (0, 64)] and balanced[7] == [(5, 5), (36, 12), (0, 64)]


# ---- golden: names, header metadata, manifest ------------------------------------------------------------------

def raw_header(path: Path) -> dict:
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        raw = f.read(length)
    assert length % 8 == 0
    return json.loads(raw)


QWEN_EMPTY_ON_2_AND_3 = sorted(f"model.layers.{i}.mlp.{t}" for i in (0, 1)
                               for t in ("experts.down_proj", "experts.gate_up_proj", "gate.weight"))


def test_golden_layout(tiny, tmp_path):
    src = tiny("qwen3_moe", experts=2)
    out = tmp_path / "out"
    write_checkpoint(src, out, MeshSpec(fsdp=4), mode="stock", progress=False)
    shard_names = [f"shard-{c:05d}-model-00001-of-00001.safetensors" for c in (1, 2, 3, 4)]
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["config.json", "generation_config.json", "reshard.json", *shard_names])
    assert all(HF_SHARD_RE.match(p.name) for p in out.glob("*.safetensors"))
    assert sorted(p.name for p in out.glob("*.safetensors")) == shard_names
    for name in ("config.json", "generation_config.json"):
        assert filecmp.cmp(src / name, out / name, shallow=False), f"{name} not copied byte-identical"
    from transformers.distributed.checkpoint import is_sharded_checkpoint

    assert is_sharded_checkpoint(out)
    try:  # the same names torch's own HuggingFaceStorageWriter gives a sharded save
        from torch.distributed.checkpoint._hf_utils import _gen_file_name
    except ImportError:
        pass
    else:
        assert [_gen_file_name(1, 1, shard_index=c) for c in (1, 2, 3, 4)] == shard_names

    # one shard header, coordinate 2 (rank 2: experts and router empty)
    header = raw_header(out / shard_names[2])
    meta = header.pop("__metadata__")
    assert set(meta) == {"DCP_SHARDING_INFO", "DCP_VERSION", "format"}
    assert meta["DCP_VERSION"] == "1.0" and meta["format"] == "pt"
    assert all(isinstance(v, str) for v in meta.values())
    info = json.loads(meta["DCP_SHARDING_INFO"])
    assert meta["DCP_SHARDING_INFO"] == json.dumps(info, separators=(",", ":"))
    assert set(info) == set(header)
    assert all(set(v) == {"saved_offsets"} for v in info.values())
    golden = {  # name: (dtype, shape, saved_offsets)
        "model.embed_tokens.weight": ("F32", [128, 64], [256, 0]),
        "lm_head.weight": ("F32", [128, 64], [256, 0]),
        "model.norm.weight": ("F32", [16], [32]),
        "model.layers.0.self_attn.q_norm.weight": ("F32", [4], [8]),
        "model.layers.0.self_attn.q_proj.weight": ("F32", [16, 64], [32, 0]),
        "model.layers.0.mlp.experts.gate_up_proj": ("F32", [0, 48, 64], [2, 0, 0]),
        "model.layers.0.mlp.experts.down_proj": ("F32", [0, 64, 24], [2, 0, 0]),
        "model.layers.0.mlp.gate.weight": ("F32", [0, 64], [2, 0]),
    }
    for name, (dtype, shape, offsets) in golden.items():
        assert (header[name]["dtype"], header[name]["shape"], info[name]["saved_offsets"]) == (dtype, shape, offsets)
    cursor = 0
    for name, entry in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"]):
        assert entry["data_offsets"] == [cursor, cursor + math.prod(entry["shape"]) * 4]
        cursor = entry["data_offsets"][1]

    # the manifest
    text = (out / "reshard.json").read_text()
    manifest = json.loads(text)
    assert text == json.dumps(manifest, indent=2, sort_keys=True) + "\n"
    assert set(manifest) == {"format", "version", "tool", "source", "mesh", "distributed_config", "layout",
                             "tensors", "coords", "files", "copied", "order", "source_layout", "write_id"}
    assert len(manifest["write_id"]) == 64 and set(manifest["write_id"]) <= set("0123456789abcdef")
    assert manifest["copied"] == sorted(p.name for p in out.iterdir() if p.name != "reshard.json"
                                        and not p.name.startswith("shard-"))
    assert (manifest["format"], manifest["version"], manifest["layout"]) == ("reshard", 3, "stock")
    assert manifest["tool"].startswith("reshard ")
    assert manifest["mesh"] == {"fsdp": 4, "ep": 1, "dp_replicate": 1, "tp": 1, "pp": 1}
    assert manifest["distributed_config"] == {"fsdp_size": 4}
    assert set(manifest["source"]) == {"source", "revision", "model_type", "architecture", "header_sha256"}
    assert manifest["source"]["model_type"] == "qwen3_moe"
    assert set(manifest["source"]["header_sha256"]) == {"model.safetensors"}
    assert manifest["coords"] == [
        {"coord": c, "files": [shard_names[c]], "empty_markers": len(QWEN_EMPTY_ON_2_AND_3) if c >= 2
         else 0} for c in range(4)]
    assert sorted(manifest["order"]) == sorted(manifest["tensors"])
    gate_up = manifest["tensors"]["model.layers.0.mlp.experts.gate_up_proj"]
    assert gate_up == {"shape": [2, 48, 64], "dtype": "F32", "role": "expert", "is_param": True,
                       "placement": {"kind": "dense", "shard_dim": 0, "degree": 4, "ep": 1,
                                     "placements": "Shard(0) on fsdp"},
                       "stock_placement": {"kind": "dense", "shard_dim": 0, "degree": 4, "ep": 1,
                                           "placements": "Shard(0) on fsdp"}}
    assert [f["name"] for f in manifest["files"]] == shard_names
    for entry in manifest["files"]:
        assert set(entry) == {"coord", "name", "bytes", "crc32", "first", "count", "empty_markers"}
        assert (entry["first"], entry["count"]) == (0, len(manifest["order"]))  # one file per coordinate: all
        data = (out / entry["name"]).read_bytes()
        assert entry["bytes"] == len(data) and entry["crc32"] == f"{zlib.crc32(data):08x}"
        header = raw_header(out / entry["name"])
        info = json.loads(header.pop("__metadata__")["DCP_SHARDING_INFO"])
        assert list(header) == manifest["order"]  # the file holds the run of `order` its entry names, in order
        typed = read_manifest(out)
        assert {c.name: {"shape": list(c.shape), "offsets": list(c.offsets)}
                for c in typed.chunks(typed.file_entry(entry["name"]))} \
            == {n: {"shape": h["shape"], "offsets": info[n]["saved_offsets"]} for n, h in header.items()}


def test_max_shard_size_splits_coordinates(tiny, tmp_path):
    src = tiny("mixtral", experts=8)
    out = tmp_path / "out"
    mesh = MeshSpec(fsdp=5)
    result = CliRunner().invoke(cli, ["write", str(src), str(out), "--fsdp", "5", "--layout", "stock",
                                      "--max-shard-size", "64KiB", "-q"])
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "reshard.json").read_text())
    names = sorted(p.name for p in out.glob("*.safetensors"))
    assert all(HF_SHARD_RE.match(n) for n in names)
    assert [p.name for p in out.iterdir() if p.suffix == ".safetensors" and not HF_SHARD_RE.match(p.name)] == []
    for c in range(mesh.fsdp):
        files = manifest["coords"][c]["files"]
        assert len(files) > 1, f"coordinate {c} was not split"
        assert files == [f"shard-{c + 1:05d}-model-{p:05d}-of-{len(files):05d}.safetensors"
                         for p in range(1, len(files) + 1)]
        for name in files:
            header = raw_header(out / name)
            header.pop("__metadata__")
            data = sum(math.prod(h["shape"]) * 4 for h in header.values())
            assert data <= 64 * 1024 or len(header) == 1, f"{name}: {data} bytes in {len(header)} tensors"
    assert sorted(f for c in manifest["coords"] for f in c["files"]) == names
    verify(out, against=src)
    check_independently(src, out, mesh, "stock")


# ---- reshard verify: the negative cases -------------------------------------------------------------------------

@pytest.fixture
def written(tiny, tmp_path):
    src = tiny("qwen3_moe", experts=2)
    out = tmp_path / "out"
    write_checkpoint(src, out, MeshSpec(fsdp=4), mode="stock", progress=False)
    return src, out


def run_verify(out: Path, *extra: str):
    result = CliRunner().invoke(cli, ["verify", str(out), *extra])
    fails = [line for line in result.output.splitlines() if line.startswith("FAIL ")]
    return result, fails


def test_verify_passes_clean_output(written):
    src, out = written
    result, fails = run_verify(out, "--against", str(src))
    assert result.exit_code == 0, result.output
    assert fails == [] and result.output.startswith(f"OK {out}:")


def flip_data_byte(path: Path, at: int = 10) -> str:
    """Flip one byte `at` bytes into the data section; return the tensor it belongs to."""
    header = raw_header(path)
    header.pop("__metadata__")
    name = next(n for n, h in header.items() if h["data_offsets"][0] <= at < h["data_offsets"][1])
    data = bytearray(path.read_bytes())
    (length,) = struct.unpack("<Q", data[:8])
    data[8 + length + at] ^= 0xFF
    path.write_bytes(bytes(data))
    return name


@pytest.mark.parametrize("against, checksums", [(False, True), (True, True), (True, False)],
                         ids=["crc-only", "crc-and-source", "source-only"])
def test_verify_flipped_byte(written, against, checksums):
    src, out = written
    shard = "shard-00001-model-00001-of-00001.safetensors"
    tensor = flip_data_byte(out / shard)
    result, fails = run_verify(out, *(["--against", str(src)] if against else []),
                               *([] if checksums else ["--no-checksums"]))
    assert result.exit_code == 1
    crc = [f for f in fails if f == f"FAIL {shard}: CRC-32 differs from the manifest (the file is corrupt)"]
    differs = [f for f in fails if f.startswith(f"FAIL {shard}: {tensor} differs from the source at chunk")]
    assert len(crc) == checksums, result.output
    assert len(differs) == against, result.output
    assert len(fails) == checksums + against
    assert f"{plural(len(fails), 'problem')}." in result.output


def test_verify_missing_file(written):
    src, out = written
    gone = "shard-00002-model-00001-of-00001.safetensors"
    (out / gone).unlink()
    result, fails = run_verify(out, "--against", str(src))
    assert result.exit_code == 1
    assert any(f.startswith(f"FAIL {gone}: missing") for f in fails), result.output
    assert f"{plural(len(fails), 'problem')}. If this is one node's copy" in result.output  # staged by hand?
    # every tensor now lacks coordinate 1: one line per problem, never several problems on one line
    assert all(f.count("FAIL") == 1 for f in fails)


def test_verify_miscounted_empty_markers_and_a_missing_run(written):
    src, out = written
    path = out / "reshard.json"
    manifest = json.loads(path.read_text())
    entry = manifest["files"][3]
    entry["empty_markers"] -= 1
    path.write_text(json.dumps(manifest))
    result, fails = run_verify(out)
    assert result.exit_code == 1
    assert len(fails) == 1 and fails[0].startswith(f"FAIL {entry['name']}: the manifest counts"), result.output
    entry["empty_markers"] += 1
    entry["count"] -= 1  # the file still holds the last tensor, the manifest no longer says so: a gap
    path.write_text(json.dumps(manifest))
    result, fails = run_verify(out)
    assert result.exit_code == 1
    assert any(f.startswith("FAIL coordinate 3: its files hold tensors") for f in fails), result.output
    assert any(f.startswith(f"FAIL {entry['name']}: header holds") for f in fails), result.output


@pytest.mark.parametrize("mesh", [MeshSpec(fsdp=5), MeshSpec(fsdp=8, ep=2), MeshSpec(fsdp=4, dp_replicate=2)],
                         ids=["fsdp5", "fsdp8-ep2", "hsdp"])
def test_coordinate_sizes_equal_the_chunk_lists(tiny, mesh):
    """The sizes a write balances and checks free space with, computed by tensor kind, equal each coordinate's chunks."""
    from reshard.api import plan_checkpoint
    from reshard.plan import coordinate_chunks, coordinate_sizes

    plan = plan_checkpoint(tiny("glm4_moe"), mesh).plan
    assert coordinate_sizes(plan) == [sum(spec.nbytes for spec, _, _ in coordinate_chunks(plan, c))
                                      for c in range(mesh.num_coords)]


def test_the_disk_starts_writing_while_the_copy_goes_on(tiny, tmp_path, monkeypatch):
    """Every output file is handed to the kernel's writeback each WRITEBACK_BYTES (here 4 KiB) as it is filled, in the
    copying engine (a write, a merge) and in the computing one (dequantized slabs); the bytes are the same as without
    the hint."""
    import reshard.syscalls
    from reshard.api import merge_checkpoint
    from reshard.tiny import quantize_checkpoint

    src = tiny("qwen3_moe", experts=4, dtype="bfloat16")
    write_checkpoint(src, tmp_path / "plain", MeshSpec(fsdp=2), progress=False)
    merge_checkpoint(tmp_path / "plain", tmp_path / "merged-plain", progress=False)
    fp8 = quantize_checkpoint(src, tmp_path / "fp8", method="fp8", block=(16, 16))
    write_checkpoint(fp8, tmp_path / "deq-plain", MeshSpec(fsdp=2), dequantize="bf16", progress=False)
    hints = []
    monkeypatch.setattr(reshard.syscalls, "WRITEBACK_BYTES", 4096)
    real = reshard.syscalls.start_writeback
    monkeypatch.setattr(reshard.syscalls, "start_writeback", lambda fd: (hints.append(fd), real(fd)))
    for what, run in (("write", lambda out: write_checkpoint(src, out, MeshSpec(fsdp=2), progress=False)),
                      ("merge", lambda out: merge_checkpoint(tmp_path / "plain", out, progress=False)),
                      ("deq", lambda out: write_checkpoint(fp8, out, MeshSpec(fsdp=2), dequantize="bf16",
                                                           progress=False))):
        hints.clear()
        run(tmp_path / f"{what}-hinted")
        sizes = [p.stat().st_size for p in (tmp_path / f"{what}-hinted").glob("*.safetensors")]
        # once per 4 KiB written or more (one large copy crosses several steps at once), in every file past 4 KiB
        assert len(hints) >= max(sum(s > 2 * 4096 for s in sizes), sum(sizes) // (64 << 10)), (what, hints, sizes)
        reference = tmp_path / {"write": "plain", "merge": "merged-plain", "deq": "deq-plain"}[what]
        for path in reference.glob("*.safetensors"):
            assert path.read_bytes() == (tmp_path / f"{what}-hinted" / path.name).read_bytes(), (what, path.name)


def test_a_long_write_on_a_pipe_says_where_it_is_and_a_quick_one_says_nothing(monkeypatch, capsys):
    """On a pipe (no terminal: tqdm draws nothing) the byte bar is a line every few seconds while files are written,
    and one when they are; a write done within the first interval prints nothing."""
    import time

    from reshard.write import _output as output

    quick = output.progress_bar(10, None, "merge")  # capsys: stderr is no terminal
    quick.update(10)
    quick.close()
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(output, "PIPE_EVERY_S", 0.05)
    bar = output.progress_bar(3 << 20, None, "write")
    bar.update(1 << 20)
    deadline = time.monotonic() + 30
    while not bar.said and time.monotonic() < deadline:  # a busy machine may run the ticker late
        time.sleep(0.05)
    bar.update(2 << 20)
    bar.close()
    lines = capsys.readouterr().err.splitlines()
    assert any(line.startswith("reshard write: 1.0 MiB of 3.0 MiB of files written (") for line in lines), lines
    assert lines[-1].startswith("reshard write: all 3.0 MiB of files written; checking and completing"), lines
    assert output.progress_bar(10, False, "write").disable  # --quiet: nothing at all
