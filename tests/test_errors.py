"""Error paths a user hits, end to end through the CLI or the loader: exit code, and words that say what to do."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from click.testing import CliRunner
from safetensors.torch import save_file
import torch

from reshard.api import write_checkpoint
from reshard.cli import cli
from reshard.plan import MeshSpec


def run(*args, env=None):
    return CliRunner().invoke(cli, [str(a) for a in args], env=env)


def test_unknown_architecture(tmp_path):
    save_file({"w": torch.zeros(2)}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "not_a_real_moe"}))
    result = run("plan", tmp_path, "--fsdp", 2)
    assert result.exit_code == 1
    assert "model_type 'not_a_real_moe' is not known to transformers" in result.output
    assert "Traceback" not in result.output


def test_hub_id_while_offline_and_not_cached(tmp_path, monkeypatch):
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    result = run("plan", "nobody-here/no-such-moe", "--fsdp", 2,
                 env={"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "cache")})
    assert result.exit_code == 1, result.output
    assert "HF_HUB_OFFLINE is set and the repo is not in the local cache" in result.output
    assert "hf download nobody-here/no-such-moe" in result.output


def test_write_on_a_mesh_the_model_cannot_take(tiny, tmp_path):
    result = run("write", tiny("glm4_moe"), tmp_path / "out", "--fsdp", 6, "--ep", 3)
    assert result.exit_code == 2  # an impossible mesh is a bad call
    assert "num_experts (10) is not divisible by ep (3)" in result.output
    assert not (tmp_path / "out").exists()


def test_distributed_config_that_does_not_match_the_manifest(tiny, tmp_path):
    out = tmp_path / "out"
    write_checkpoint(tiny("qwen3_moe"), out, MeshSpec(fsdp=1), progress=False)
    script = textwrap.dedent(f"""
        import torch.distributed as dist
        from transformers.distributed import DistributedConfig
        import reshard
        dist.init_process_group("gloo", init_method="file://{tmp_path}/store", rank=0, world_size=1)
        try:
            reshard.from_pretrained({str(out)!r}, distributed_config=DistributedConfig(fsdp_size=1, ep_size=1,
                                    dp_replicate_size=1, tp_size=1, pp_size=1, fsdp_cpu_offload=True))
            reshard.from_pretrained({str(out)!r}, distributed_config=DistributedConfig(fsdp_size=2))
        except reshard.LoadError as e:
            print("LOADERROR", e)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert "LOADERROR distributed_config" in result.stdout, result.stderr[-3000:]
    assert "does not match the mesh" in result.stdout and "DistributedConfig(fsdp_size=1)" in result.stdout
