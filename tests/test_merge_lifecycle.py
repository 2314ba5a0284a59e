"""The lifecycle on real gloo processes: load with reshard, train a step, save distributed, then publish or resume.

Two torchrun launches for both models (Qwen3-MoE at fsdp 4 x ep 2, DeepSeek-V3 at fsdp 4 with its 6 experts split
on dim 1 by the balanced layout): 4 ranks `reshard.from_pretrained`, one SGD step, and
`save_pretrained(tmp, distributed_checkpoint=True)`, rank 0 keeping the trained `full_tensor()`s; then in this
process `reshard merge tmp DEST` and a plain single-process `from_pretrained(DEST)` equal to them; then
`reshard write tmp OUT2 --fsdp 5` loaded on 5 ranks, again equal. The DeepSeek-V3 source carries an MTP layer
(`model.layers.61.*`, which its class does not load): the trained folder lacks it, and `merge --extras-from` the
reshard folder the training started from gives it back (issue 23).
"""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from reshard.api import verify_folder, write_checkpoint
from reshard.cli import cli
from reshard.plan import MeshSpec

from conftest import rank_reports, run_ranks
from test_extras import mtp_tensors

MODELS = [  # name, tiny() arguments, training mesh
    ("qwen3", dict(model_type="qwen3_moe", experts=4), MeshSpec(fsdp=4, ep=2)),
    ("deepseek", dict(model_type="deepseek_v3", experts=6), MeshSpec(fsdp=4)),
]


def _reports(folder, nproc):
    reports = rank_reports(folder, nproc)
    for report in reports:
        assert "error" not in report, report.get("traceback", report)
    return reports


@pytest.mark.slow  # train, save and merge on 4 ranks
@pytest.mark.multirank
def test_train_save_merge_and_resume_on_another_mesh(tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    train_args, cases = [], []
    for name, kwargs, mesh in MODELS:
        src = tiny(kwargs.pop("model_type"), **kwargs)
        if name == "deepseek":
            import shutil

            from reshard.tiny import add_tensors

            src = add_tensors(shutil.copytree(src, tmp_path / f"{name}-mtp"), mtp_tensors())
        folder, saved, trained = tmp_path / f"{name}-{mesh.fsdp}", tmp_path / f"{name}-saved", \
            tmp_path / f"{name}-trained.safetensors"
        write_checkpoint(src, folder, mesh, progress=False)
        train_args += [folder, saved, trained]
        cases.append((name, src, saved, trained))
    (tmp_path / "train").mkdir()
    run_ranks("lifecycle.py", 4, "train", tmp_path / "train", *train_args, timeout=300)
    for report in _reports(tmp_path / "train", 4):
        assert all(changed > 0 for changed in report["changed"])  # the step really changed the weights
    load_args = []
    for name, src, saved, trained_file in cases:
        trained = load_file(trained_file)
        dest = tmp_path / f"{name}-published"
        result = CliRunner().invoke(cli, ["merge", str(saved), str(dest), "-q"])
        assert result.exit_code == 0, result.output
        assert not (dest / "reshard.json").exists()
        # the keys transformers' own save_pretrained writes: per-expert, as the source checkpoint had them
        keys = set(json.loads((dest / "model.safetensors.index.json").read_text())["weight_map"])
        source_keys = set(json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]) \
            if (src / "model.safetensors.index.json").exists() else set(load_file(src / "model.safetensors"))
        assert keys == source_keys - set(mtp_tensors())  # the MTP layer is not in the trained folder
        # plain transformers, one process
        loaded = AutoModelForCausalLM.from_pretrained(dest, use_kernels=False).state_dict()
        assert loaded.keys() == trained.keys()
        for key, tensor in trained.items():
            assert loaded[key].dtype == tensor.dtype and torch.equal(loaded[key], tensor), key
        assert verify_folder(dest, against=saved).ok
        if name == "deepseek":  # the MTP layer back from the reshard folder the training started from
            with_mtp = tmp_path / f"{name}-published-mtp"
            result = CliRunner().invoke(cli, ["merge", str(saved), str(with_mtp), "-q", "--extras-from",
                                              str(tmp_path / f"{name}-{MODELS[1][2].fsdp}")])
            assert result.exit_code == 0, result.output
            merged = {k: v for f in sorted(with_mtp.glob("*.safetensors")) for k, v in load_file(f).items()}
            assert set(merged) == keys | set(mtp_tensors()) and keys & set(mtp_tensors()) == set()
            for key, tensor in mtp_tensors().items():
                assert merged[key].dtype == tensor.dtype and torch.equal(merged[key], tensor), key
            assert verify_folder(with_mtp, against=saved).ok
        out2 = tmp_path / f"{name}-fsdp5"
        result = CliRunner().invoke(cli, ["write", str(saved), str(out2), "--fsdp", "5", "-q"])
        assert result.exit_code == 0, result.output
        load_args += [out2, trained_file]
    (tmp_path / "load").mkdir()
    run_ranks("lifecycle.py", 5, "load", tmp_path / "load", *load_args, timeout=300)
    for report in _reports(tmp_path / "load", 5):
        assert report["mismatched"] == [[], []]
