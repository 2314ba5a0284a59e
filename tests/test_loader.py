"""The patched loader, on real gloo processes: bit-exact loads, no empty-rank crash, balanced memory, no hang."""

from __future__ import annotations

import json
import time

import pytest
import torch

import reshard
from reshard.api import write_checkpoint
from reshard import read_manifest
from reshard.plan import MeshSpec

from conftest import run_ranks


def load(mode, folder, src, tmp_path, fsdp, ep=1, *, check=True, timeout=240):
    reports = tmp_path / f"reports-{mode}"
    reports.mkdir()
    result = run_ranks("load_reshard.py", fsdp, mode, folder, src, reports, fsdp, ep, timeout=timeout, check=check)
    out = []
    for r in range(fsdp):
        path = reports / f"rank{r}.json"
        out.append(json.loads(path.read_text()) if path.exists() else {"rank": r, "error": "no report (killed)"})
    return result, out


OWN_READER = ["reshard.load._storage.StorageReader"]  # one dcp.load, with reshard's reader: each rank reads its own files


def assert_loaded_exactly(reports, ep=1, *, readers=None):
    for report in reports:
        assert "error" not in report, report.get("traceback", report)
        if readers is not None:
            assert report.get("readers", []) == readers
        assert report["mismatched"] == [], report["mismatched"]
        assert report["uninitialized"] == [], report["uninitialized"]
        if ep == 1:
            assert report["logits_equal"], report["logits_max_abs_diff"]
        else:  # EP routes tokens through grouped kernels and a reduction: same weights, float-rounding differences
            assert report["logits_max_abs_diff"] <= 1e-5, report["logits_max_abs_diff"]
        assert report["step_ok"]


def expert_bytes_per_rank(reports, manifest):
    experts = {n for n, info in manifest["tensors"].items() if info["role"] == "expert"}
    return [sum(info["bytes"] for n, info in r["local"].items() if n in experts) for r in reports]


CASES = [  # model, experts, fused, fsdp, ep: every one leaves ranks empty under stock transformers
    # the default tests load qwen3 on fsdp 4 in test_launch.py and test_demo.py: here the EP case only
    pytest.param("qwen3_moe", None, False, 4, 1, id="qwen3-2experts-fsdp4", marks=pytest.mark.slow),
    pytest.param("mixtral", None, False, 5, 1, id="mixtral-8experts-fsdp5", marks=pytest.mark.slow),
    pytest.param("qwen3_moe", None, True, 4, 2, id="qwen3-fused-2experts-ep2-fsdp4"),
]  # the GLM-like case (10 experts, ep 2, fsdp 4) runs in test_balanced_layout_gives_every_rank_the_same_expert_bytes


@pytest.mark.multirank
@pytest.mark.parametrize("model_type, experts, fused, fsdp, ep", CASES)
def test_reshard_folder_loads_exactly_on_every_rank(tiny, tmp_path, model_type, experts, fused, fsdp, ep):
    src = tiny(model_type, experts=experts, fused=fused)
    out = tmp_path / "out"
    write_checkpoint(src, out, MeshSpec(fsdp=fsdp, ep=ep), progress=False)
    _, reports = load("reshard", out, src, tmp_path, fsdp, ep)
    assert_loaded_exactly(reports, ep, readers=OWN_READER)


@pytest.mark.slow  # 4-rank repeats: the default tests load on 4 ranks in test_launch.py and test_demo.py
@pytest.mark.multirank
def test_a_dtype_conversion_loads_through_the_reader_on_every_rank(tiny, tmp_path):
    """float32 files into a bfloat16 model: the reader reads each chunk through a buffer and converts it."""
    src = tiny("mixtral")
    out = tmp_path / "out"
    write_checkpoint(src, out, MeshSpec(fsdp=5), progress=False)
    _, reports = load("reshard-bf16", out, src, tmp_path, 5)
    for report in reports:
        assert "error" not in report, report.get("traceback", report)
        assert report["readers"] == OWN_READER
        assert report["mismatched"] == [] and report["uninitialized"] == [] and report["step_ok"]


@pytest.mark.slow  # 4-rank repeats: the default tests load on 4 ranks in test_launch.py and test_demo.py
@pytest.mark.multirank
@pytest.mark.parametrize("model_type, experts, fused, fsdp, ep", CASES)
def test_stock_transformers_fails_on_the_original_checkpoint(tiny, tmp_path, model_type, experts, fused, fsdp, ep):
    """The documented upstream failure; if this starts passing, transformers fixed it and the README must say so."""
    src = tiny(model_type, experts=experts, fused=fused)
    result, reports = load("stock", src, src, tmp_path, fsdp, ep, check=False)
    assert result.returncode != 0
    errors = " ".join(r.get("error", "") + r.get("traceback", "") for r in reports)
    assert any(s in errors for s in ("automatic conversion of the weights", "IndexError", "stack expects",
                                      "Connection reset", "Connection closed")), errors[-2000:]


@pytest.mark.slow  # 4-rank repeats: the default tests load on 4 ranks in test_launch.py and test_demo.py
@pytest.mark.multirank
@pytest.mark.parametrize("model_type, experts, fused, fsdp, ep", [CASES[0], CASES[2]])
def test_patched_transformers_loads_the_original_checkpoint(tiny, tmp_path, model_type, experts, fused, fsdp, ep):
    """Empty locals on the normal HF path: no torch.stack([]), no strided IndexError, every param initialized."""
    src = tiny(model_type, experts=experts, fused=fused)
    _, reports = load("patched", src, src, tmp_path, fsdp, ep)
    assert_loaded_exactly(reports, ep)


@pytest.mark.slow  # 4-rank repeats: the default tests load on 4 ranks in test_launch.py and test_demo.py
@pytest.mark.multirank
def test_balanced_layout_gives_every_rank_the_same_expert_bytes(tiny, tmp_path):
    src = tiny("glm4_moe")  # 10 experts, ep 2 -> 5 per EP group over efsdp 2: stock rows [3, 2]
    ratios = {}
    for mode in ("balanced", "stock"):
        out = tmp_path / mode
        write_checkpoint(src, out, MeshSpec(fsdp=4, ep=2), mode=mode, progress=False)
        manifest = json.loads((out / "reshard.json").read_text())
        _, reports = load("reshard", out, src, tmp_path / mode, 4, 2)
        assert_loaded_exactly(reports, 2, readers=OWN_READER)
        per_rank = expert_bytes_per_rank(reports, manifest)
        ratios[mode] = max(per_rank) / (sum(per_rank) / len(per_rank))
    assert ratios["balanced"] == 1.0
    assert ratios["stock"] == pytest.approx(1.2)  # [3, 2] rows: the fuller rank holds 3 / 2.5 = 1.2x the mean


def test_each_rank_checks_its_own_files(tiny, tmp_path):
    """What a rank reports before loading (the multi-rank test below shows every rank stopping on it)."""
    from reshard.load._agreement import _check_own_files
    from reshard import read_manifest
    from reshard.read import LocalStore

    out = tmp_path / "out"
    write_checkpoint(tiny("qwen3_moe"), out, MeshSpec(fsdp=4), progress=False)
    manifest = read_manifest(out)
    store = LocalStore(out)

    def _check_own_files(manifest, rank, check=_check_own_files):
        return check(manifest, store, rank)

    assert [_check_own_files(manifest, r) for r in range(4)] == [None] * 4
    (out / "shard-00002-model-00001-of-00001.safetensors").unlink()
    victim = out / "shard-00003-model-00001-of-00001.safetensors"
    data = victim.read_bytes()
    victim.write_bytes(data[:-100])
    assert _check_own_files(manifest, 0) is None
    assert _check_own_files(manifest, 1).startswith("shard-00002-model-00001-of-00001.safetensors is missing: the "
                                                    "folder lost a file")  # the other ranks' files are there
    assert _check_own_files(manifest, 2) == (f"shard-00003-model-00001-of-00001.safetensors has {len(data) - 100} "
                                             f"bytes, the manifest says {len(data)}")
    victim.write_bytes(b"\xff" * 8 + data[8:])  # same size, a length prefix past the file
    assert "the header length prefix says" in _check_own_files(manifest, 2)
    for name in ("shard-00001-model-00001-of-00001.safetensors", victim.name,
                 "shard-00004-model-00001-of-00001.safetensors"):
        (out / name).unlink()  # now only what rank 1's node would hold, without rank 1's file: a node's copy
    assert "not the files of this node's ranks 1" in _check_own_files(manifest, 1)


@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_reads_through_the_staging_buffers_are_exact(tmp_path, layout):
    """The accelerator path on the host: chunks through two reused buffers (7 bytes here), the CRC worker behind."""
    import zlib

    from reshard.load._local_read import BackgroundCrc, Staging, read_tensor

    data = torch.arange(1000, dtype=torch.float32).reshape(10, 100)
    path = tmp_path / "blob"
    path.write_bytes(b"skip" + data.numpy().tobytes())
    local = torch.full((10, 100), float("nan")) if layout == "contiguous" else torch.full((100, 10), float("nan")).t()
    crc = BackgroundCrc()
    with open(path, "rb", buffering=0) as fh:
        fh.seek(4)
        read_tensor(fh, data.numel() * 4, local, crc, Staging(7), "blob", in_place=False)
    assert torch.equal(local, data)
    assert crc.hexdigest() == f"{zlib.crc32(data.numpy().tobytes()):08x}"


@pytest.mark.slow  # 4-rank repeats: the default tests load on 4 ranks in test_launch.py and test_demo.py
@pytest.mark.multirank
@pytest.mark.parametrize("damage, mode", [("corrupt", "reshard"), ("remove", "patched")],
                         ids=["corrupt-reshard.from_pretrained", "remove-patched-transformers"])
def test_a_bad_shard_stops_every_rank_with_the_reason(tiny, tmp_path, damage, mode):
    """A flipped byte is caught by the CRC as the rank reads; a removed file, by the agreed pre-check that transformers'
    own from_pretrained (patched) runs too. Either way every rank raises, naming rank 2."""
    src = tiny("qwen3_moe")
    out = tmp_path / "out"
    write_checkpoint(src, out, MeshSpec(fsdp=4), progress=False)
    victim = out / "shard-00003-model-00001-of-00001.safetensors"
    if damage == "remove":
        victim.unlink()
    else:
        data = bytearray(victim.read_bytes())
        data[-5] ^= 0xFF
        victim.write_bytes(bytes(data))
    start = time.monotonic()
    result, reports = load(mode, out, src, tmp_path, 4, check=False, timeout=60)
    assert time.monotonic() - start < 60
    assert result.returncode != 0
    for report in reports:
        assert report["error"].startswith("LoadError"), report
        assert "rank 2: shard-00003-model-00001-of-00001.safetensors" in report["error"]
        assert ("is missing" if damage == "remove" else "is corrupt (CRC-32") in report["error"], report["error"]


def test_whole_model_in_one_process_equals_transformers(tiny, tmp_path, monkeypatch, capsys):
    src = tiny("glm4_moe")
    out = tmp_path / "out"
    write_checkpoint(src, out, MeshSpec(fsdp=8, ep=2), progress=False)
    from transformers import AutoModelForCausalLM

    for variable in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(variable, raising=False)
    loaded = reshard.from_pretrained(out).state_dict()
    # `python train.py` is no silent minute either: each phase is a line on stderr (no terminal here)
    phases = [line.split(": ", 1)[1].rsplit(" (", 1)[0] for line in capsys.readouterr().err.splitlines()
              if line.startswith(f"reshard load {out}: ")]
    files = len(read_manifest(out).files)
    assert phases[0] == "starting in one process (the whole model)" and phases[-1] == "loaded", phases
    assert f"checking {files} files (CRC-32 and headers) and that they cover every tensor" in phases, phases
    assert any(p.startswith(f"read {files} files, ") and p.endswith(" with headers, the whole model") for p in phases)
    reference = AutoModelForCausalLM.from_pretrained(src, use_kernels=False).state_dict()
    assert loaded.keys() == reference.keys()
    for name, tensor in reference.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name


def test_world_size_mismatch_is_a_clear_error(tiny, tmp_path):
    src = tiny("qwen3_moe")
    out = tmp_path / "out"
    write_checkpoint(src, out, MeshSpec(fsdp=4), progress=False)
    reports = tmp_path / "reports"
    reports.mkdir()
    result = run_ranks("load_reshard.py", 2, "reshard", out, src, reports, 4, 1, check=False, timeout=60)
    assert result.returncode != 0
    for r in range(2):
        error = json.loads((reports / f"rank{r}.json").read_text())["error"]
        assert "written for 4 ranks" in error and "this job has 2" in error


# ---- meta-only materialization inside transformers ------------------------------------------------------------

SENTINEL = 7.0


def _model_with_offmeta_bias():
    from transformers import Qwen3MoeForCausalLM

    class WithExpertBias(Qwen3MoeForCausalLM):
        def __init__(self, config):
            super().__init__(config)
            for layer in self.model.layers:
                # created with an explicit device on purpose: stays real under the meta-device init context
                layer.mlp.gate.register_buffer(
                    "expert_bias", torch.full((config.num_experts,), SENTINEL, device="cpu"), persistent=False)

    return WithExpertBias


def _biases(model):
    return [layer.mlp.gate.expert_bias for layer in model.model.layers]


def test_stock_transformers_clobbers_an_offmeta_buffer_and_the_patch_keeps_it(tiny, monkeypatch):
    src = tiny("qwen3_moe")
    cls = _model_with_offmeta_bias()
    reshard.unpatch_transformers()
    # make "uninitialized memory" deterministic: what stock materialization hands out is NaN
    real_empty_like = torch.empty_like
    monkeypatch.setattr(torch, "empty_like", lambda t, **kw: real_empty_like(t, **kw).fill_(float("nan"))
                        if t.is_floating_point() else real_empty_like(t, **kw))
    stock = cls.from_pretrained(src, use_kernels=False)
    assert all(torch.isnan(b).all() for b in _biases(stock))
    with reshard.patch_transformers():
        patched = cls.from_pretrained(src, use_kernels=False)
    for bias in _biases(patched):
        assert torch.equal(bias, torch.full_like(bias, SENTINEL))
    assert not torch.isnan(patched.model.rotary_emb.inv_freq).any()  # meta buffers still materialized and set
    assert reshard.check_buffers(patched, warn=False) == []


def test_patched_transformers_loads_a_reshard_folder_without_a_process_group(tiny, tmp_path):
    """One process, no group: transformers' own load of the folder (through dcp.load) still works under the patch."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    src = tiny("qwen3_moe")
    out = tmp_path / "out"
    write_checkpoint(src, out, MeshSpec(fsdp=4), progress=False)
    assert not dist.is_initialized()
    with reshard.patch_transformers():
        loaded = AutoModelForCausalLM.from_pretrained(out).state_dict()
    reference = AutoModelForCausalLM.from_pretrained(src, use_kernels=False).state_dict()
    assert loaded.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(loaded[name], tensor), name


def test_a_reshard_load_never_asks_for_hub_kernels_unless_the_caller_does(tiny, tmp_path, monkeypatch):
    """transformers 5.25 kernelizes by default (and fails without the `kernels` package, or fetches code from the Hub);
    reshard's loads, and every load under the patch, pass use_kernels=False unless the caller asks, and a caller's
    use_kernels=True passes through."""
    import transformers.modeling_utils as mu

    monkeypatch.delenv("USE_HUB_KERNELS", raising=False)
    asked = []
    monkeypatch.setattr(mu.PreTrainedModel, "set_use_kernels", lambda self, use_kernels, *a, **k: asked.append(
        bool(use_kernels)))
    out = tmp_path / "out"
    write_checkpoint(tiny("qwen3_moe"), out, MeshSpec(fsdp=4), progress=False)
    reshard.from_pretrained(out)
    with reshard.patch_transformers():
        from transformers import AutoModelForCausalLM

        AutoModelForCausalLM.from_pretrained(out)
        AutoModelForCausalLM.from_pretrained(tiny("qwen3_moe"))  # an original checkpoint, on the patch's path
    assert asked == [False] * 3, asked  # each of the three loads decided, and none asked for kernels
    asked.clear()
    reshard.from_pretrained(out, use_kernels=True)
    assert asked == [True]


def test_a_users_key_mapping_is_kept_on_the_distributed_checkpoint_path():
    from reshard.load._patch import _dcp_path, _wrap_conversion_mapping

    mapping = _wrap_conversion_mapping(lambda model, key_mapping=None, *rest: ["built", key_mapping])
    token = _dcp_path.set(True)
    try:
        assert mapping("model") == [] and mapping("model", None, None) == []
        assert mapping("model", {"a": "b"}, None) == ["built", {"a": "b"}]
    finally:
        _dcp_path.reset(token)
    assert mapping("model") == ["built", None]


def test_patch_is_idempotent_and_undoes_itself():
    import transformers.core_model_loading as cml
    import transformers.distributed.fsdp as fsdp
    import transformers.modeling_utils as mu

    reshard.unpatch_transformers()
    before = (fsdp.fully_shard, cml.WeightConverter.convert, mu.PreTrainedModel._move_missing_keys_from_meta_to_device)
    with reshard.patch_transformers():
        reshard.patch_transformers()
        assert fsdp.fully_shard is not before[0]
        assert cml.WeightConverter.convert is not before[1]
    after = (fsdp.fully_shard, cml.WeightConverter.convert, mu.PreTrainedModel._move_missing_keys_from_meta_to_device)
    assert after == before


def test_patch_refuses_when_a_hook_vanishes(monkeypatch):
    import transformers.modeling_utils as mu

    from reshard.load._patch import is_patched

    reshard.unpatch_transformers()
    monkeypatch.delattr(mu, "_dtensor_from_local_like")
    with pytest.raises(reshard.ReshardError, match="_dtensor_from_local_like \\(called\\): it is missing") as refused:
        reshard.patch_transformers()
    message = str(refused.value)
    assert "transformers.modeling_utils._dtensor_from_local_like (called): it is missing" in message
    assert "transformers>=5.23,<5.26" in message and "Nothing was patched" in message
    assert not is_patched()


def test_patch_refuses_when_a_signature_changes(monkeypatch):
    import transformers.distributed.mixin as mixin

    from reshard.load._patch import is_patched

    def changed(model, checkpoint_path, strict=True):  # `checkpoint_dir` renamed
        return None

    reshard.unpatch_transformers()
    monkeypatch.setattr(mixin, "_load_model_checkpoint_distributed", changed)
    with pytest.raises(reshard.ReshardError, match="reshard expects parameters") as refused:
        reshard.patch_transformers()
    message = str(refused.value)
    assert ("transformers.distributed.mixin._load_model_checkpoint_distributed (wrapped): reshard expects parameters "
            "(model, checkpoint_dir, strict), found (model, checkpoint_path, strict)") in message
    assert "transformers>=5.23,<5.26" in message
    assert not is_patched()


UNTESTED_RELEASE = """
import warnings
import transformers
import transformers.distributed.fsdp as fsdp
import reshard

transformers.__version__ = "5.99.0"
before = fsdp.fully_shard
with reshard.patch_transformers():  # CALLER LINE
    assert fsdp.fully_shard is not before
with reshard.patch_transformers():
    pass
assert fsdp.fully_shard is before
"""


def test_an_untested_release_warns_once_at_the_callers_line_and_installs(tmp_path):
    """A real process with Python's own warning filters (pytest replaces them in-process): one warning, pointing at the
    line that called `patch_transformers()`, not at reshard's own code; the patch installs both times."""
    import subprocess
    import sys

    script = tmp_path / "user_script.py"
    script.write_text(UNTESTED_RELEASE)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    warned = [line for line in done.stderr.splitlines() if "UntestedTransformersWarning" in line]
    caller = UNTESTED_RELEASE.splitlines().index("with reshard.patch_transformers():  # CALLER LINE") + 1
    assert warned == [f"{script}:{caller}: UntestedTransformersWarning: reshard's loader patch was tested with "
                      "transformers>=5.23,<5.26; transformers 5.99.0 is installed. Every hook it uses is present with "
                      "the expected signature, so it proceeds; report problems with the output of `reshard env`."]


def test_every_hook_is_intact_in_the_installed_transformers():
    """Fails when a hook changes, never because a release is new: the version is the warning's business."""
    from reshard.load._hooks import HOOKS
    from reshard.load import check_hooks

    statuses = check_hooks()
    assert [s.hook for s in statuses] == list(HOOKS) and len(HOOKS) >= 15
    assert [s.hook.qualified for s in statuses if not s.ok] == []


def test_the_tested_range_is_the_tested_releases():
    from reshard.load import in_tested_range

    assert all(in_tested_range(v) for v in ("5.23.0", "5.24.0.dev0", "5.25.0"))
    assert not in_tested_range("5.26.0") and not in_tested_range("4.57.1") and not in_tested_range("6.0.0")


def test_the_package_requirements_admit_every_later_5x_release():
    """pip must never refuse or downgrade a new transformers: setup.cfg's range admits every 5.x from the oldest
    tested release on; the hook check at patch time is the gate."""
    import configparser
    from pathlib import Path

    from packaging.requirements import Requirement

    cfg = configparser.ConfigParser()
    cfg.read(Path(__file__).parent.parent / "setup.cfg")
    lines = [line.split("#")[0].strip() for line in cfg["options"]["install_requires"].splitlines()]
    spec = next(Requirement(line) for line in lines if line.startswith("transformers")).specifier
    assert all(spec.contains(v) for v in ("5.23.0", "5.24.0", "5.25.0", "5.26.0", "5.99.1"))
    assert not spec.contains("5.22.0") and not spec.contains("6.0.0")


def test_from_pretrained_removes_the_patch_it_installed_but_keeps_the_users(tiny, tmp_path):
    import transformers.modeling_utils as mu

    from reshard.load._patch import is_patched

    out = tmp_path / "out"
    write_checkpoint(tiny("qwen3_moe"), out, MeshSpec(fsdp=4), progress=False)
    reshard.unpatch_transformers()
    stock = mu.PreTrainedModel.__dict__["_move_missing_keys_from_meta_to_device"]
    reshard.from_pretrained(out)
    assert not is_patched() and mu.PreTrainedModel.__dict__["_move_missing_keys_from_meta_to_device"] is stock
    with reshard.patch_transformers():
        reshard.from_pretrained(out)
        assert is_patched()  # the user's patch outlives reshard's own call
    assert not is_patched()


def test_the_whole_model_path_checks_checksums_and_coverage(tiny, tmp_path):
    from reshard.load._loader import assemble_state_dict

    out = tmp_path / "out"
    write_checkpoint(tiny("qwen3_moe"), out, MeshSpec(fsdp=4), progress=False)
    victim = out / "shard-00002-model-00001-of-00001.safetensors"
    data = bytearray(victim.read_bytes())
    data[-3] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(reshard.LoadError, match="shard-00002-model-00001-of-00001.safetensors is corrupt"):
        reshard.from_pretrained(out)
    assert assemble_state_dict(out, check_checksums=False)  # the user may skip the check, as on the sharded path
    data[-3] ^= 0xFF
    victim.write_bytes(bytes(data))
    manifest = json.loads((out / "reshard.json").read_text())
    entry = next(f for f in manifest["files"] if f["name"] == victim.name)
    entry["count"] -= 1  # the manifest no longer says where the file's last chunk is: a gap
    (out / "reshard.json").write_text(json.dumps(manifest))
    with pytest.raises(reshard.LoadError, match="coordinate 1: its files hold tensors"):
        reshard.from_pretrained(out)


def test_coverage_check_finds_gaps_and_duplicates():
    from types import SimpleNamespace

    from reshard.manifest._entries import TensorInfo, placement_of
    from reshard.manifest import coverage_problems
    from reshard.plan import MeshSpec

    def doc(runs, *, degree=2, kind="expert"):
        """fsdp 4 x ep 2 (efsdp 2): one [6, 6] expert tensor and a replicated buffer; `runs[c]`: coordinate c's files
        as (first, count) runs of `order`."""
        placement = {"kind": kind, "shard_dim": 0, "degree": degree, "ep": 2}
        return {"mesh": {"fsdp": 4, "ep": 2, "dp_replicate": 1, "tp": 1, "pp": 1}, "order": ["t", "bias"],
                "tensors": {"t": {"shape": [6, 6], "placement": placement},
                            "bias": {"shape": [6], "placement": {"kind": "replicated", "shard_dim": None,
                                                                 "degree": 1, "ep": 1}}},
                "files": [{"coord": c, "first": f, "count": n} for c, found in enumerate(runs) for f, n in found]}

    def typed(document):  # the fields coverage reads: no file names, sizes or CRCs needed
        return SimpleNamespace(
            mesh=MeshSpec(**document["mesh"]), order=tuple(document["order"]),
            files=[SimpleNamespace(**f) for f in document["files"]],
            tensors={n: TensorInfo(n, tuple(t["shape"]), "F32", "expert", True, placement_of(t["placement"]))
                     for n, t in document["tensors"].items()})

    def coverage_problems(document, check=coverage_problems):
        return check(typed(document))

    whole = [[(0, 2)]] * 4
    assert coverage_problems(doc(whole)) == []
    assert coverage_problems(doc([[(0, 1), (1, 1)]] * 4)) == []  # two files per coordinate
    assert coverage_problems(doc([[(0, 1)]] + whole[1:]))  # coordinate 0 lacks the buffer
    assert coverage_problems(doc([[(0, 2), (0, 2)]] + whole[1:]))  # stored twice
    assert coverage_problems(doc(whole, degree=4))  # each EP group's 3 rows chunked as if over 4: a row missing


def test_the_patched_materialization_moves_a_real_buffer_to_the_target_device(tiny):
    """A buffer made on the CPU on purpose ends on the device transformers loads onto, with its values (there is no
    GPU here, so the target is `meta`: the branch is the one a CPU-made buffer takes when loading onto CUDA)."""
    from transformers import AutoConfig

    from reshard.load._patch import _move_only_meta_to_device

    cls = _model_with_offmeta_bias()
    model = cls(AutoConfig.from_pretrained(tiny("qwen3_moe")))
    with reshard.patch_transformers():
        _move_only_meta_to_device(model, [], {"": "cpu"}, None, None)
        kept = _biases(model)
        assert all(torch.equal(b, torch.full_like(b, SENTINEL)) for b in kept)
        _move_only_meta_to_device(model, [], {"": "meta"}, None, None)
    for before, after in zip(kept, _biases(model)):
        assert after.is_meta and after.shape == before.shape and after is not before
