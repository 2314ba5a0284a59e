"""`reshard.StorageReader` and `reshard.shard_placement_fn` with no transformers loader, and torch's own consumers of
a reshard folder: `consolidate_safetensors_files`, `HuggingFaceStorageReader`."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

import reshard
from reshard.api import write_checkpoint
from reshard.errors import LoadError
from reshard.plan import MeshSpec

from conftest import run_ranks

FSDP, EP = 4, 2  # qwen3_moe tiny: 2 experts, 1 per EP group over efsdp 2 -> stock rows [1, 0]: empty ranks


@pytest.fixture(scope="module")
def folders(tiny, tmp_path_factory):
    """The qwen3_moe source and its balanced and stock folders at fsdp 4, ep 2, written once for the module."""
    src = tiny("qwen3_moe")
    root = tmp_path_factory.mktemp("storage")
    out = {"src": src}
    for layout in ("balanced", "stock"):
        out[layout] = root / layout
        write_checkpoint(src, out[layout], MeshSpec(fsdp=FSDP, ep=EP), mode=layout, progress=False)
    return out


@pytest.fixture(scope="module")
def reference(folders):
    """The source's in-memory tensors, as transformers loads them in one process."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folders["src"], use_kernels=False).state_dict()


def _merged(ranges):
    out = []
    for start, end in sorted(ranges):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return out


@pytest.mark.multirank
def test_hand_built_fsdp2_model_loads_with_dcp_and_each_rank_reads_exactly_its_files(folders, tmp_path):
    """HF modeling class on meta, EP and FSDP2 by hand, `dcp.load`: balanced and stock layouts (stock leaves ranks
    empty), DCP resharding onto other placements, and torch's own reader on the stock layout."""
    cases = [f"reshard:{folders['balanced']}", f"reshard:{folders['stock']}", f"resharded:{folders['balanced']}",
             f"torch:{folders['stock']}"]
    run_ranks("dcp_load.py", FSDP, folders["src"], tmp_path, FSDP, EP, *cases, timeout=240)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(FSDP)]
    for report in reports:
        assert "error" not in report, report.get("traceback", report)
        for case, result in report["cases"].items():
            assert result["mismatched"] == [], (case, result["mismatched"])
    for layout in ("balanced", "stock"):
        for report in reports:
            result = report["cases"][f"reshard:{folders[layout]}"]
            # only its own files, every byte of them exactly once, and each one's CRC-32 checked
            assert sorted(result["reads"]) == sorted(result["own"]), (layout, report["rank"], result["reads"])
            for name, ranges in result["reads"].items():
                assert sum(end - start for start, end in ranges) == result["sizes"][name]
                assert _merged(ranges) == [[0, result["sizes"][name]]], (name, ranges)
            assert result["checked"] == result["own"] and result["unchecked"] == []
    balanced = [r["cases"][f"reshard:{folders['balanced']}"]["local"] for r in reports]
    stock = [r["cases"][f"reshard:{folders['stock']}"]["local"] for r in reports]
    assert {p for local in balanced for p, _ in local.values()} == {"(Shard(dim=1), Shard(dim=0))"}
    assert all(0 not in shape for local in balanced for _, shape in local.values())
    empty = {r for r, local in enumerate(stock) if all(shape[0] == 0 for _, shape in local.values())}
    assert empty == {2, 3}  # efsdp index 1 of each EP group holds no expert under stock placement
    # resharded: the balanced folder into FSDP2's default placements reads other ranks' files, in part, unchecked
    resharded = [r["cases"][f"resharded:{folders['balanced']}"] for r in reports]
    assert any(set(r["reads"]) - set(r["own"]) for r in resharded)
    assert any(r["unchecked"] for r in resharded)


def test_single_process_dcp_load_into_full_tensors_equals_the_source(folders, reference):
    """No process group: DCP reshards every chunk into whole tensors; whole files pass their CRC-32."""
    import torch.distributed.checkpoint as dcp

    for layout in ("balanced", "stock"):
        state = {k: torch.full_like(v, float("nan")) for k, v in reference.items()}
        reader = reshard.StorageReader(folders[layout])
        dcp.load(state, storage_reader=reader)
        for name, tensor in reference.items():
            assert torch.equal(state[name], tensor), (layout, name)
        assert sorted(reader.checked_files) == sorted(f.name for f in reader.manifest.files)


def test_a_flipped_byte_or_a_file_unlike_the_manifest_is_a_load_error(folders, reference, tmp_path):
    import shutil

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    out = tmp_path / "out"
    shutil.copytree(folders["stock"], out)
    victim = out / "shard-00003-model-00001-of-00001.safetensors"
    data = bytearray(victim.read_bytes())
    data[-5] ^= 0xFF  # same size, valid header: only the CRC sees it
    victim.write_bytes(bytes(data))
    state = {k: torch.empty_like(v) for k, v in reference.items()}
    with pytest.raises(CheckpointException, match=r"shard-00003-model-00001-of-00001.safetensors is corrupt \(CRC"):
        dcp.load(state, storage_reader=reshard.StorageReader(out))
    dcp.load(state, storage_reader=reshard.StorageReader(out, check_checksums=False))  # the choice is the user's
    data[-5] ^= 0xFF
    data[data.index(b'"format":"pt"') + 11] ^= 0x01  # "pt" -> "pu": the header still parses; the CRC covers it
    victim.write_bytes(bytes(data))
    with pytest.raises(CheckpointException, match=r"shard-00003-model-00001-of-00001.safetensors is corrupt \(CRC"):
        dcp.load(state, storage_reader=reshard.StorageReader(out))
    victim.write_bytes(bytes(data[:-8]))
    with pytest.raises(CheckpointException, match="has .* bytes, the manifest says"):
        dcp.load(state, storage_reader=reshard.StorageReader(out))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "reshard.json").write_text("{not json")  # there but unreadable: never read as a plain folder
    with pytest.raises(LoadError, match="reshard.json"):
        reshard.StorageReader(broken)


def test_torch_consolidates_a_reshard_folder_into_the_source_tensors(folders, reference, tmp_path):
    """torch's `consolidate_safetensors_files`, balanced and stock layouts (stock holds empty markers)."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files

    manifest = reshard.read_manifest(folders["stock"])
    assert manifest.empty_markers > 0
    for layout in ("balanced", "stock"):
        output = tmp_path / layout
        output.mkdir()  # the consolidator needs it to exist
        consolidate_safetensors_files(str(folders[layout]), str(output), dict.fromkeys(reference, 1))
        merged = {}
        for path in output.glob("*.safetensors"):
            merged.update(load_file(path))
        assert merged.keys() == reference.keys()
        for name, tensor in reference.items():
            assert torch.equal(merged[name], tensor), (layout, name)


def test_torch_reader_metadata_agrees_with_the_manifest_and_reshard_reader(folders):
    """Every chunk `HuggingFaceStorageReader` finds in the headers is one the manifest derives, and the reshard
    reader (which opens no header) describes the same tensors with the same non-empty chunks."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    for layout in ("balanced", "stock"):
        manifest = reshard.read_manifest(folders[layout])
        theirs = HuggingFaceStorageReader(str(folders[layout])).read_metadata()
        ours = reshard.StorageReader(folders[layout]).read_metadata()
        expected: dict[str, Counter] = {}
        for entry in manifest.files:
            for chunk in manifest.chunks(entry):
                expected.setdefault(chunk.name, Counter())[(chunk.offsets, chunk.shape)] += 1
        assert theirs.state_dict_metadata.keys() == ours.state_dict_metadata.keys() == expected.keys()
        for name, md in theirs.state_dict_metadata.items():
            info = manifest.tensors[name]
            found = Counter((tuple(c.offsets), tuple(c.sizes)) for c in md.chunks)
            assert found == expected[name], (layout, name)
            assert tuple(md.size) == info.shape == tuple(ours.state_dict_metadata[name].size)
            assert md.properties.dtype == ours.state_dict_metadata[name].properties.dtype
            non_empty = {k for k in found if 0 not in k[1]}
            assert non_empty == {(tuple(c.offsets), tuple(c.sizes)) for c in ours.state_dict_metadata[name].chunks}


def test_shard_placement_fn_names_the_balanced_dims(folders):
    from torch.distributed.tensor import Shard

    manifest = reshard.read_manifest(folders["balanced"])
    shapes = {name: info.shape for name, info in manifest.tensors.items()}
    expert = next(n for n, i in manifest.tensors.items() if i.role == "expert")
    dense = next(n for n, i in manifest.tensors.items() if i.role == "dense")
    by_shape = reshard.shard_placement_fn(folders["balanced"])
    assert by_shape(torch.empty(shapes[expert], device="meta")) == Shard(1)
    assert by_shape(torch.empty(shapes[dense], device="meta")) is None  # FSDP2's default Shard(0)
    stock = reshard.shard_placement_fn(folders["stock"])
    assert stock(torch.empty(shapes[expert], device="meta")) is None

    class Model(torch.nn.Module):  # two parameters of one shape, split on different dims: only names tell them apart
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Parameter(torch.empty(4, 4))
            self.b = torch.nn.Parameter(torch.empty(4, 4))

    files = [{"name": f"f{c}.safetensors", "coord": c, "first": 0, "count": 2, "bytes": 64, "crc32": "00000000",
              "empty_markers": 0} for c in range(4)]  # a sound manifest (validated on construction) of no real files
    data = {"format": "reshard", "version": 2, "mesh": MeshSpec(fsdp=4).to_dict(), "order": ["a", "b"],
            "files": files, "copied": [], "source": {"source": "x", "model_type": None, "architecture": None},
            "coords": [{"coord": c, "ranks": [c], "files": [f"f{c}.safetensors"], "empty_markers": 0}
                       for c in range(4)],
            "tensors": {n: {"shape": [4, 4], "dtype": "F32", "role": "dense", "is_param": True,
                            "placement": {"kind": "dense", "shard_dim": d, "degree": 4, "ep": 1}}
                        for n, d in (("a", 0), ("b", 1))}}
    manifest = reshard.Manifest.from_document(data, folders["balanced"])
    model = Model()
    named = reshard.shard_placement_fn(manifest, model)
    assert named(model.a) is None and named(model.b) == Shard(1)
    with pytest.raises(LoadError, match="pass the model"):
        reshard.shard_placement_fn(manifest)(model.a)


# ---- a drop-in for torch's HuggingFaceStorageReader --------------------------------------------------------------
# The scenarios of torch's own HF storage tests (test_hf_storage.py, test_hf_safetensor_e2e.py), run here against
# reshard's reader: torch's constructor (`path=`, `thread_count`), plain folders without reshard.json.

class _Small(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear_1 = torch.nn.Linear(5, 5)
        self.linear_2 = torch.nn.Linear(5, 1)
        self.emb = torch.nn.EmbeddingBag(5, 10)


def _plain_folder(tmp_path, how):
    """A folder without reshard.json: one safetensors file, or torch's own DCP-safetensors save."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    torch.manual_seed(3)
    saved = _Small().state_dict()
    folder = tmp_path / how
    folder.mkdir()
    if how == "save_file":
        save_file(saved, str(folder / "model-00001-of-00001.safetensors"))
    else:
        dcp.save(saved, storage_writer=HuggingFaceStorageWriter(path=str(folder)))
    return folder, saved


@pytest.mark.parametrize("how", ["save_file", "dcp_save"])
def test_torch_constructor_and_a_plain_folder_load_like_torchs_reader(tmp_path, how):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    folder, saved = _plain_folder(tmp_path, how)
    for reader in (reshard.StorageReader(path=str(folder)), reshard.StorageReader(str(folder), thread_count=2),
                   reshard.StorageReader(folder, 3)):
        assert reader.manifest is None and reader.thread_count in (1, 2, 3)
        state = {k: torch.full_like(v, float("nan")) for k, v in saved.items()}
        dcp.load(state, storage_reader=reader)
        assert sorted(state) == sorted(saved) and all(torch.equal(state[k], saved[k]) for k in saved)
    ours, theirs = reshard.StorageReader(folder).read_metadata(), HuggingFaceStorageReader(str(folder)).read_metadata()
    assert ours.state_dict_metadata == theirs.state_dict_metadata


def test_a_plain_folder_loads_into_an_empty_dict(tmp_path):
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    folder, saved = _plain_folder(tmp_path, "save_file")
    loaded = _load_state_dict_from_keys(storage_reader=reshard.StorageReader(path=str(folder)))
    assert sorted(loaded) == sorted(saved) and all(torch.equal(loaded[k], saved[k]) for k in saved)


def test_thread_count_reads_a_reshard_folder_exactly_and_checks_every_file(folders, reference):
    import torch.distributed.checkpoint as dcp

    for layout in ("balanced", "stock"):
        state = {k: torch.full_like(v, float("nan")) for k, v in reference.items()}
        reader = reshard.StorageReader(folders[layout], thread_count=3)
        assert reader.thread_count == 3
        dcp.load(state, storage_reader=reader)
        assert all(torch.equal(state[k], v) for k, v in reference.items()), layout
        assert sorted(reader.checked_files) == sorted(f.name for f in reader.manifest.files)


@pytest.mark.slow  # torch's scenarios on ranks
@pytest.mark.multirank
def test_torchs_dtensor_reshard_scenarios_load_with_reshards_reader(tmp_path):
    """1-D and 2-D meshes, every placement change, mesh changes both ways and an empty shard (4 gloo ranks): each
    tensor saved by torch's writer loads through reshard's reader equal to the saved one, as through torch's."""
    run_ranks("hf_storage_scenarios.py", 4, tmp_path, timeout=240)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    for report in reports:
        assert "error" not in report, report.get("traceback", report)
        results = report["results"]
        assert len(results) == 2 * (2 + 12 + 8 + 8 + 1)
        assert {k: v for k, v in results.items() if v != "equal"} == {}, report["rank"]
