"""`reshard plan` on tiny checkpoints: the human report's key facts, the `--json` document, and exit codes.

Exit codes: 0 ok (also "nothing to reshard"), 1 a domain error (message, no traceback unless --debug), 2 a bad call.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from reshard.cli import cli
from reshard.errors import MeshError

REPO_ROOT = Path(__file__).resolve().parents[1]


def run(*args: str, expect: int = 0):
    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert result.exit_code == expect, (result.exit_code, result.output, result.exception)
    return result


def plan_json(*args: str) -> dict:
    doc = json.loads(run("plan", *args, "--json").stdout)
    assert doc["reshard_plan_version"] == 1
    return doc


def experts_of(doc: dict) -> dict[str, dict]:
    """Routed-expert families by their last name part (`gate_up_proj`, `down_proj`)."""
    families = [f for f in doc["families"] if f["role"] == "expert"]
    by_name = {f["pattern"].rsplit(".", 1)[-1]: f for f in families}
    assert len(by_name) == len(families)
    return by_name


def expert_blocks(text: str) -> dict[str, tuple[str, str, str]]:
    """The human report's routed-expert section: name -> (family line, stock line, planned line)."""
    lines = text.splitlines()
    blocks = {}
    for i, line in enumerate(lines):
        if line.startswith("  model.") and ".experts." in line and i + 2 < len(lines):
            stock, planned = lines[i + 1].strip(), lines[i + 2].strip()
            assert stock.startswith("stock ") and planned.startswith("planned "), lines[i:i + 3]
            blocks[line.split()[0].rsplit(".", 1)[-1]] = (line, stock, planned)
    return blocks


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    """A tiny dense (non-MoE) checkpoint."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=128)
    path = tmp_path_factory.mktemp("llama")
    LlamaForCausalLM(config).save_pretrained(path)
    return path


# ---- Qwen3-MoE, 2 experts, fsdp 4 ---------------------------------------------------------------------------------

def test_qwen3_moe_two_experts_fsdp4_human(tiny):
    out = run("plan", tiny("qwen3_moe"), "--fsdp", "4").stdout

    assert "load with: DistributedConfig(fsdp_size=4)" in out
    assert "world 4 = dp_replicate 1 x fsdp 4" in out
    blocks = expert_blocks(out)
    assert set(blocks) == {"gate_up_proj", "down_proj"}
    for family, stock, planned in blocks.values():
        assert "[2, " in family  # 2 experts
        # one rank-map notation per report: the planned rows (12, 16) are runs, so the stock map is runs too
        assert stock.split() == ["stock", "Shard(0)", "on", "fsdp", "1", "on", "2", "ranks,", ".", "on", "2", "ranks",
                                 "empty", "on", "2", "ranks"]
        assert planned.split()[:4] == ["planned", "Shard(1)", "on", "fsdp"]
        rows = {"gate_up_proj": 48 // 4, "down_proj": 64 // 4}[family.split()[0].rsplit(".", 1)[1]]
        assert planned.split()[4:8] == [str(rows), "on", "4", "ranks"]  # the same rows on all 4: no '.', no empty
        assert planned.endswith("split dim 1 (divides evenly)")
    assert "stock transformers leaves" in out and "on 2 ranks (2-3);" in out
    assert "stock 36.00 KiB / 18.00 KiB = 2.00; planned 18.00 KiB / 18.00 KiB = 1.00" in out


def test_qwen3_moe_two_experts_fsdp4_json(tiny):
    doc = plan_json(tiny("qwen3_moe"), "--fsdp", "4")
    assert doc["model_type"] == "qwen3_moe" and doc["layout"] == "balanced"
    assert doc["mesh"] == {"fsdp": 4, "ep": 1, "dp_replicate": 1, "tp": 1, "pp": 1, "efsdp": 4, "world_size": 4}
    assert doc["distributed_config"] == "DistributedConfig(fsdp_size=4)"
    experts = experts_of(doc)
    assert set(experts) == {"gate_up_proj", "down_proj"}
    for name, split in (("gate_up_proj", 48 // 4), ("down_proj", 64 // 4)):
        fam = experts[name]
        assert fam["count"] == 2 and fam["shape"][0] == 2
        assert fam["stock"]["rows_per_rank"] == [1, 1, 0, 0] and fam["stock"]["empty_ranks"] == [2, 3]
        assert fam["planned"]["shard_dim"] == 1 and fam["planned"]["placement"] == "Shard(1) on fsdp"
        assert fam["planned"]["rows_per_rank"] == [split] * 4 and fam["planned"]["empty_ranks"] == []
    summary = doc["summary"]
    assert summary["stock_expert_max_over_mean"] == 2.0
    assert summary["planned_expert_max_over_mean"] == 1.0
    assert summary["stock_empty_ranks"] == [2, 3]
    # the 2-row router is dense and stays chunked on dim 0, so ranks 2 and 3 still hold an (explicit) empty
    router = next(f for f in doc["families"] if f["role"] == "router")
    assert router["planned"]["empty_ranks"] == [2, 3]


def test_stock_layout_keeps_stock_placements(tiny):
    doc = plan_json(tiny("qwen3_moe"), "--fsdp", "4", "--layout", "stock")
    assert doc["layout"] == "stock"
    for fam in experts_of(doc).values():
        assert fam["planned"] == fam["stock"]
    assert doc["summary"]["planned_expert_max_over_mean"] == 2.0


# ---- Mixtral, 8 experts, fsdp 5: nothing divides by 5 -------------------------------------------------------------

def test_mixtral_eight_experts_fsdp5(tiny):
    src = tiny("mixtral")
    out = run("plan", src, "--fsdp", "5").stdout
    assert "DistributedConfig(fsdp_size=5)" in out
    blocks = expert_blocks(out)
    assert set(blocks) == {"gate_up_proj", "down_proj"}
    for family, stock, planned in blocks.values():
        assert "[8, " in family
        assert stock.split()[4:] == ["2222.", "empty", "on", "1", "rank"]
        assert planned.split()[4] == "2222." and planned.endswith("no dim divides evenly: explicit empty markers")
    assert "of them expert tensors) on rank 4;" in out

    doc = plan_json(src, "--fsdp", "5")
    experts = experts_of(doc)
    assert set(experts) == {"gate_up_proj", "down_proj"}
    for fam in experts.values():
        assert fam["shape"][0] == 8
        assert fam["stock"]["rows_per_rank"] == [2, 2, 2, 2, 0] and fam["stock"]["empty_ranks"] == [4]
        assert fam["planned"] == fam["stock"]
    assert doc["summary"]["stock_expert_max_over_mean"] == pytest.approx(1.25)
    assert doc["summary"]["planned_expert_max_over_mean"] == pytest.approx(1.25)
    assert doc["summary"]["planned_empty_ranks"] == [4]


# ---- GLM-like, 10 experts, fsdp 8, ep 2 (efsdp 4) -----------------------------------------------------------------

def test_glm4_moe_ten_experts_fsdp8_ep2(tiny):
    src = tiny("glm4_moe")
    out = run("plan", src, "--fsdp", "8", "--ep", "2").stdout
    assert "load with: DistributedConfig(fsdp_size=8, ep_size=2)" in out
    assert "experts: efsdp 4 x ep 2 (2 contiguous ranks per EP group)" in out
    blocks = expert_blocks(out)
    assert set(blocks) == {"gate_up_proj", "down_proj"}
    for family, stock, planned in blocks.values():
        assert "[10, " in family
        # one notation in the whole report: the planned rows (12, 16) need runs, so the stock map is runs too
        assert ("(_StridedShard(0, sf=2), Shard(0)) on (efsdp, ep) 2 on 4 ranks, 1 on 2 ranks, . on 2 ranks empty on "
                "2 ranks") in " ".join(stock.split())
        rows = {"gate_up_proj": 48 // 4, "down_proj": 64 // 4}[family.split()[0].rsplit(".", 1)[1]]
        assert "(Shard(1), Shard(0)) on (efsdp, ep)" in planned and f" {rows} on 8 ranks " in planned
    assert "_StridedShard(0, sf=N) is torch's private placement" in out  # explained where it appears

    doc = plan_json(src, "--fsdp", "8", "--ep", "2")
    assert doc["mesh"]["efsdp"] == 4 and doc["mesh"]["world_size"] == 8
    assert doc["distributed_config"] == "DistributedConfig(fsdp_size=8, ep_size=2)"
    experts = experts_of(doc)
    for name, split in (("gate_up_proj", 48 // 4), ("down_proj", 64 // 4)):
        fam = experts[name]
        assert fam["shape"][0] == 10 and fam["count"] == 1  # first_k_dense_replace=1: one MoE layer of two
        rows = fam["stock"]["rows_per_rank"]
        # ranks are fsdp coordinates; EP group g holds ranks g, g+2, ...: 5 experts chunked over efsdp 4
        assert [rows[ep::2] for ep in range(2)] == [[2, 2, 1, 0], [2, 2, 1, 0]]
        assert fam["stock"]["empty_ranks"] == [6, 7]
        assert fam["planned"]["shard_dim"] == 1
        assert fam["planned"]["rows_per_rank"] == [split] * 8 and fam["planned"]["empty_ranks"] == []
    assert doc["summary"]["stock_expert_max_over_mean"] == pytest.approx(1.6)
    assert doc["summary"]["stock_expert_max_over_mean"] > 1
    assert doc["summary"]["planned_expert_max_over_mean"] == 1.0
    # the shared expert is dense: never expert-sharded
    shared = [f for f in doc["families"] if f["role"] == "shared_expert"]
    assert shared and all(f["stock"]["placement"] == "Shard(0) on fsdp" for f in shared)


# ---- errors and exit codes ----------------------------------------------------------------------------------------

def test_ep_not_dividing_the_expert_count_is_a_bad_call(tiny):
    result = run("plan", tiny("glm4_moe"), "--fsdp", "6", "--ep", "3", expect=2)
    assert "num_experts (10) is not divisible by ep (3)" in result.stderr
    assert "Traceback" not in result.output and result.stdout == ""


def test_missing_folder_is_a_domain_error(tmp_path):
    result = run("plan", tmp_path / "nope", "--fsdp", "4", expect=1)
    assert f"{tmp_path / 'nope'}: no such file or folder" in result.stderr
    assert "Traceback" not in result.output


@pytest.mark.parametrize("args, fragment", [
    (["--fsdp", "8", "--ep", "3"], "fsdp (8) is not divisible by ep (3)"),
    (["--fsdp", "8", "--tp", "2"], "tp=2, pp=1"),
    (["--fsdp", "8", "--pp", "2"], "tp=1, pp=2"),
    (["--fsdp", "0"], "--fsdp"),
    ([], "Missing option '--fsdp'"),
    (["--fsdp", "4", "--layout", "odd"], "--layout"),
])
def test_bad_calls_exit_2(tmp_path, args, fragment):
    # the folder does not even exist: flags are checked before any I/O
    result = run("plan", tmp_path / "nope", *args, expect=2)
    assert fragment in result.stderr and "Usage:" in result.stderr


def test_dense_checkpoint_has_nothing_to_reshard(llama):
    result = run("plan", llama, "--fsdp", "4")
    assert result.stdout.strip() == f"{llama}: no routed experts found (not a MoE checkpoint); nothing to reshard."


def test_debug_raises_the_domain_error(tiny):
    result = CliRunner().invoke(cli, ["--debug", "plan", str(tiny("glm4_moe")), "--fsdp", "6", "--ep", "3"])
    assert result.exit_code == 1
    assert isinstance(result.exception, MeshError)
    assert "num_experts (10) is not divisible by ep (3)" in str(result.exception)


def _module_run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "reshard", *args], capture_output=True, text=True, cwd=REPO_ROOT,
                          env=env, timeout=120)


def test_python_dash_m_help():
    result = _module_run("--help")
    assert result.returncode == 0, result.stderr
    for command in ("plan", "write", "verify"):
        assert f"  {command} " in result.stdout


def test_traceback_only_with_debug(tmp_path):
    quiet = _module_run("plan", str(tmp_path / "nope"), "--fsdp", "2")
    assert quiet.returncode == 1
    assert "Error:" in quiet.stderr and "no such file or folder" in quiet.stderr and "Traceback" not in quiet.stderr

    loud = _module_run("--debug", "plan", str(tmp_path / "nope"), "--fsdp", "2")
    assert loud.returncode == 1
    assert "Traceback (most recent call last)" in loud.stderr
    assert "reshard.errors.CheckpointError" in loud.stderr and "no such file or folder" in loud.stderr
