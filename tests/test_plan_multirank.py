"""The planner's stock placements against a real stock load on real gloo processes.

`reshard write --layout stock` writes the folder; STOCK transformers loads it with
`from_pretrained(out, distributed_config=DistributedConfig(fsdp_size=F, ep_size=E))` on F CPU ranks, and every
rank reports, per parameter, the DTensor placements transformers gave it and torch's
`compute_local_shape_and_global_offset` (tests/ranks/report_placements.py). Each must equal `plan.local_box` for
the planned stock placement, and the placements must be what `Placement.describe()` says. The loaded local data
is compared too, with a single-process `from_pretrained` of the source as the reference.
"""

from __future__ import annotations

import hashlib
import re

import pytest
import torch

from reshard.api import plan_checkpoint, write_checkpoint
from reshard.plan import MeshSpec
from reshard.plan import Kind, Placement, local_box

from conftest import rank_reports, run_ranks

_PLACEMENT = re.compile(r"_StridedShard\(\d+, sf=\d+\)|Shard\(\d+\)|Replicate\(\)")


def described(placement: Placement) -> tuple[list[str], list[str]]:
    """`(placements, mesh dim names)` as `Placement.describe()` states them, e.g.
    `(_StridedShard(0, sf=2), Shard(0)) on (efsdp, ep)` -> (["_StridedShard(0, sf=2)", "Shard(0)"], ["efsdp", "ep"])."""
    text = placement.describe()
    placements, _, axes = text.rpartition(" on ")
    return _PLACEMENT.findall(placements), re.findall(r"\w+", axes)


def test_described_parses():
    assert described(Placement(Kind.EXPERT, 0, 4, 2)) == (["_StridedShard(0, sf=2)", "Shard(0)"], ["efsdp", "ep"])
    assert described(Placement(Kind.DENSE, 0, 5)) == (["Shard(0)"], ["fsdp"])


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def _reference_state(src) -> dict[str, torch.Tensor]:
    """The source loaded by transformers in one process: the in-memory (fused) tensors."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(src, use_kernels=False).state_dict()


CASES = [
    # (model_type, experts, fsdp, ep, timeout)
    # Qwen3-MoE 2 experts at fsdp 4 and Mixtral at fsdp 5 are loaded by stock transformers in
    # tests/test_write_multirank.py, which checks every local tensor against the plan's boxes bit for bit; this
    # file keeps the EP case, where placements are strided.
    pytest.param("glm4_moe", None, 8, 2, 240, id="glm4_moe-10experts-fsdp8-ep2"),
]


@pytest.mark.slow  # stock transformers on 8 ranks
@pytest.mark.multirank
@pytest.mark.parametrize("model_type,experts,fsdp,ep,timeout", CASES)
def test_stock_load_matches_planned_boxes(tiny, tmp_path, model_type, experts, fsdp, ep, timeout):
    src = tiny(model_type, experts=experts)
    mesh = MeshSpec(fsdp=fsdp, ep=ep)
    out = tmp_path / "out"
    write_checkpoint(src, out, mesh, mode="stock", progress=False)
    plan = plan_checkpoint(src, mesh, mode="stock").plan
    run_ranks("report_placements.py", fsdp, out, tmp_path / "reports", fsdp, ep, timeout=timeout)
    reports = rank_reports(tmp_path / "reports", fsdp)
    reference = _reference_state(src)

    params = {tp.tensor.name: tp for tp in plan.tensors if tp.tensor.is_param}
    buffers = {tp.tensor.name: tp for tp in plan.tensors if not tp.tensor.is_param}
    saw_empty = saw_strided = 0
    for rank, report in enumerate(reports):
        assert report["rank"] == rank and report["world"] == fsdp
        assert set(report["params"]) == set(params), "the plan and the loaded model disagree on the parameters"
        f = mesh.coord_of(rank)
        for name, tp in params.items():
            got = report["params"][name]
            where = f"rank {rank}: {name}"
            assert tp.stock.kind is not Kind.REPLICATED, where
            assert got["initialized"], f"{where} was not loaded (left for _init_weights)"
            assert tuple(got["global_shape"]) == tp.tensor.shape, where
            placements, axes = described(tp.stock)
            assert got["placements"] == placements, (where, got["placements"], tp.stock.describe())
            assert got["mesh_dims"] == axes, (where, got["mesh_dims"], tp.stock.describe())
            box = local_box(tp.tensor.shape, tp.stock, mesh, f)
            shape, offset = [n for _, n in box], [o for o, _ in box]
            assert got["local_shape"] == shape, (where, got["local_shape"], box)
            assert got["actual_local_shape"] == shape, (where, got["actual_local_shape"], box)
            if 0 in shape:
                saw_empty += 1
                assert shape[tp.stock.shard_dim] == 0, where
            assert got["global_offset"] == offset, (where, got["global_offset"], box)  # empty: torch's convention
            saw_strided += got["placements"][0].startswith("_StridedShard")
            # the rank holds the source's data at that box
            local = reference[name][tuple(slice(o, o + n) for o, n in box)] if 0 not in shape else \
                torch.empty(shape, dtype=reference[name].dtype)
            assert got["sha256"] == _digest(local), f"{where}: loaded data differs from the source at {box}"
        for name, tp in buffers.items():
            got = report["buffers"].get(name)
            assert got is not None, f"rank {rank}: persistent buffer {name} missing"
            assert not got["dtensor"] and tuple(got["shape"]) == tp.tensor.shape, (rank, name, got)
            assert got["sha256"] == _digest(reference[name]), f"rank {rank}: buffer {name} differs from the source"
    # every case has empty locals in stock transformers (that is the point of reshard)
    assert saw_empty > 0
    assert (saw_strided > 0) == (ep > 1)
