"""A config that sizes the model beyond its weights is refused before any model is built (issue 61, row 7).

Before: `plan` of a checkpoint with two layers whose config.json said `num_hidden_layers: 1000000000` built the
meta model until it was killed (2.3 GB and growing at 90 s). Each case here runs with the meta-model builder
replaced by one that fails the test, so a refusal that came from building (or an OOM) cannot pass.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import reshard
from reshard.errors import CheckpointError
from reshard.read import _experts
from reshard.read._config_bounds import check_config_bounds

REPO = Path(__file__).resolve().parents[1]


def with_config(src: Path, dest: Path, change) -> Path:
    shutil.copytree(src, dest)
    config = json.loads((dest / "config.json").read_text())
    change(config)
    (dest / "config.json").write_text(json.dumps(config))
    return dest


@pytest.fixture
def never_built(monkeypatch):
    def refuse(config):
        raise AssertionError("the meta model was built from a config the headers cannot hold")
    monkeypatch.setattr(_experts, "build_meta_model", refuse)


@pytest.mark.parametrize("key, value, said", [
    ("num_hidden_layers", 1_000_000_000, r"num_hidden_layers is 1,000,000,000, which names more layers than the "
                                         r"weights hold \(2: keys with layer indices 0-1\)"),
    ("num_hidden_layers", 3, r"num_hidden_layers is 3, which names more layers than the weights hold \(2"),
    ("num_experts", 10**9, r"num_experts is 1,000,000,000, which is larger than any dimension of the weights \(\d+\) "
                           r"and than their number of tensors \(\d+\)"),
    ("hidden_size", 10**12, r"hidden_size is 1,000,000,000,000, which is larger than any dimension"),
    ("vocab_size", 10**10, r"vocab_size is 10,000,000,000, which is larger than any dimension"),
    ("moe_intermediate_size", 10**15, r"moe_intermediate_size is 1,000,000,000,000,000, which is larger than any"),
    ("intermediate_size", [64, 10**9], r"intermediate_size is 1,000,000,000, which is larger"),
])
def test_a_config_larger_than_its_weights_is_refused_before_a_model_is_built(tiny, tmp_path, never_built, key, value,
                                                                             said):
    src = with_config(tiny("qwen3_moe", experts=4), tmp_path / "src", lambda c: c.update({key: value}))
    with pytest.raises(CheckpointError, match=said + r".*Fix .* in config.json.*Nothing was built, read or changed"):
        reshard.open_source(src).model_layout()


def test_a_nested_config_is_bounded_too(tiny, tmp_path, never_built):
    def nest(config):
        config["text_config"] = {"num_hidden_layers": 2, "num_experts": 10**9}
    src = with_config(tiny("qwen3_moe", experts=4), tmp_path / "src", nest)
    with pytest.raises(CheckpointError, match=r"config.json's text_config.num_experts is 1,000,000,000"):
        reshard.open_source(src).model_layout()


def test_plan_of_a_billion_layers_is_one_line_and_writes_nothing(tiny, tmp_path):
    """The command itself, as a user runs it: exit 1, one error, no traceback, no OUT (under a hang guard only)."""
    src = with_config(tiny("qwen3_moe", experts=4), tmp_path / "src",
                      lambda c: c.update(num_hidden_layers=1_000_000_000))
    for args in (["plan", src, "--fsdp", "2"], ["write", src, tmp_path / "out", "--fsdp", "2"]):
        run = subprocess.run([sys.executable, "-m", "reshard", *map(str, args)], capture_output=True, text=True,
                             timeout=120, cwd=REPO, env={"PATH": "/usr/bin:/bin", "RESHARD_CACHE_DIR": "",
                                                         "OMP_NUM_THREADS": "1"})
        assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
        assert "num_hidden_layers is 1,000,000,000, which names more layers than the weights hold" in run.stderr
    assert not (tmp_path / "out").exists()


def test_the_bounds_accept_what_real_checkpoints_hold():
    """A multi-token-prediction layer past num_hidden_layers (DeepSeek V3's layer 61 of 61), experts one key each,
    a per-layer list, and keys without layer indices; each bound refuses one past it."""
    mtp = [(f"model.layers.{i}.mlp.experts.{e}.up_proj.weight", (8, 4)) for i in range(3) for e in range(16)]
    mtp.append(("model.embed_tokens.weight", (100, 4)))
    check_config_bounds({"num_hidden_layers": 2, "n_routed_experts": 16, "vocab_size": 100,
                         "intermediate_size": [8, 8], "text_config": {"hidden_size": 4}}, mtp, where="src")
    with pytest.raises(CheckpointError, match="num_hidden_layers is 4"):
        check_config_bounds({"num_hidden_layers": 4}, mtp, where="src")
    with pytest.raises(CheckpointError, match="vocab_size is 101, which is larger than any dimension of the weights "
                                              r"\(100\) and than their number of tensors \(49\)"):
        check_config_bounds({"vocab_size": 101}, mtp, where="src")
    plain = [("wte.weight", (50, 4)), ("lm_head.weight", (50, 4))]
    check_config_bounds({"n_layer": 30, "hidden_size": 50, "head_dim": None, "rope_scaling": {"factor": 4.0}},
                        plain, where="src")
