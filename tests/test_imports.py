"""Cheap imports: the CLI starts without torch, and planning works where torch cannot be imported at all."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def python(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=REPO_ROOT, env=env,
                          timeout=120)


def imported_modules(importtime_stderr: str) -> set[str]:
    """Module names from `-X importtime` lines: `import time: self [us] | cumulative | name` (indented by depth)."""
    names = set()
    for line in importtime_stderr.splitlines():
        if line.startswith("import time:") and line.count("|") == 2:
            name = line.rsplit("|", 1)[1].strip()
            if name != "imported package":
                names.add(name)
    return names


def test_cli_import_does_not_import_torch():
    result = python("-X", "importtime", "-c", "import reshard.cli")
    assert result.returncode == 0, result.stderr
    names = imported_modules(result.stderr)
    assert {"reshard", "reshard.cli", "click"} <= names  # the parse found what it should
    heavy = sorted(n for n in names if n.split(".")[0] in {"torch", "transformers", "safetensors", "numpy"})
    assert heavy == []


_NO_TORCH = r"""
import json, sys
sys.modules["torch"] = None  # `import torch` now raises ImportError
import reshard.plan._placement, reshard.plan._mesh, reshard.plan._report, reshard.read._checkpoint, reshard.manifest, reshard.write._shards
import reshard.verification
from reshard.plan._layout import ModelLayout, Piece, Role, TargetTensor
from reshard.plan._mesh import MeshSpec
from reshard.plan._placement import make_plan, summarize
from reshard.plan._report import plan_to_dict, render_plan

try:
    import torch
except ImportError:
    pass
else:
    raise SystemExit("torch was importable")

E, I, H = 10, 24, 64
def expert(name, shape):
    return TargetTensor(name, shape, "BF16", Role.EXPERT, True, tuple(
        Piece(f"{name}.{e}", (e,) + (0,) * (len(shape) - 1), 0) for e in range(shape[0])))
layout = ModelLayout("toy_moe", "ToyMoeForCausalLM", (
    TargetTensor("model.embed_tokens.weight", (512, H), "BF16", Role.DENSE, True,
                 (Piece("model.embed_tokens.weight", (0, 0)),)),
    TargetTensor("model.layers.0.mlp.gate.weight", (E, H), "BF16", Role.ROUTER, True,
                 (Piece("model.layers.0.mlp.gate.weight", (0, 0)),)),
    TargetTensor("model.layers.0.mlp.gate.e_score_correction_bias", (E,), "F32", Role.ROUTER, False,
                 (Piece("model.layers.0.mlp.gate.e_score_correction_bias", (0,)),)),
    expert("model.layers.0.mlp.experts.gate_up_proj", (E, 2 * I, H)),
    expert("model.layers.0.mlp.experts.down_proj", (E, H, I)),
))
plan = make_plan(layout, MeshSpec(fsdp=8, ep=2))
families, stats = summarize(plan)
doc = plan_to_dict(plan, "toy")
text = render_plan(plan, "toy")
print(json.dumps({
    "torch_loaded": sys.modules.get("torch") is not None,
    "planned": {tp.tensor.name: [tp.planned.kind.value, tp.planned.shard_dim] for tp in plan.tensors},
    "stock_rows": {f["pattern"]: f["stock"]["rows_per_rank"] for f in doc["families"] if f["role"] == "expert"},
    "ratios": [stats["stock_expert_max_over_mean"], stats["planned_expert_max_over_mean"]],
    "text_has_config": "DistributedConfig(fsdp_size=8, ep_size=2)" in text,
}))
"""


def test_plan_without_torch():
    result = python("-c", _NO_TORCH)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["torch_loaded"] is False
    assert out["planned"] == {
        "model.embed_tokens.weight": ["dense", 0],
        "model.layers.0.mlp.gate.weight": ["dense", 0],
        "model.layers.0.mlp.gate.e_score_correction_bias": ["replicated", None],
        "model.layers.0.mlp.experts.gate_up_proj": ["expert", 1],  # 48 rows / efsdp 4
        "model.layers.0.mlp.experts.down_proj": ["expert", 1],  # 64 / 4
    }
    # 5 experts per EP group chunked over efsdp 4: [2, 2, 1, 0] per group, interleaved by fsdp coordinate
    assert out["stock_rows"] == {"model.layers.*.mlp.experts.gate_up_proj": [2, 2, 2, 2, 1, 1, 0, 0],
                                 "model.layers.*.mlp.experts.down_proj": [2, 2, 2, 2, 1, 1, 0, 0]}
    assert out["ratios"][0] > 1 and out["ratios"][1] == 1.0
    assert out["text_has_config"] is True


_VERIFY_NAME = r"""
import inspect, json, sys
import reshard
outcome = {}
for when in ("before", "after"):  # before and after the name was resolved (and cached) by the package
    if when == "after":
        reshard.verify
    try:
        import reshard.verify
    except ModuleNotFoundError as e:
        outcome[when] = f"refused: {e.name}"
    else:
        outcome[when] = "imported"
    outcome[when + "_is_function"] = inspect.isfunction(reshard.verify) and reshard.verify.__name__ == "verify"
from reshard import verify
import reshard.api
outcome["from_import"] = verify is reshard.verify is reshard.api.verify
outcome["submodule_registered"] = "reshard.verify" in sys.modules
print(json.dumps(outcome))
"""


def test_reshard_verify_stays_the_function_after_import_reshard_verify():
    """`import reshard.verify` must not replace the function `reshard.verify` with a module of that name: there is
    no such module (it is `reshard.verification`), so the import fails cleanly and the function stays."""
    result = python("-c", _VERIFY_NAME)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {
        "before": "refused: reshard.verify", "before_is_function": True,
        "after": "refused: reshard.verify", "after_is_function": True,
        "from_import": True, "submodule_registered": False,
    }
