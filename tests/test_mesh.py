"""`MeshSpec`: validation with numbers, derived sizes, and agreement with transformers' `DistributedConfig`."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import examples
from reshard.plan import _mesh as mesh_module
from reshard.errors import MeshError, ReshardError
from reshard.plan._mesh import Axis
from reshard.plan import MeshSpec

REPO_ROOT = Path(__file__).resolve().parents[1]


# ---- validation ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("field", ["fsdp", "ep", "dp_replicate", "tp", "pp"])
@pytest.mark.parametrize("value", [0, -2, 2.0, "4", None])
def test_sizes_must_be_positive_integers(field, value):
    with pytest.raises(MeshError, match="must be a positive integer") as info:
        MeshSpec(**{field: value})
    flag = "--" + field.replace("_", "-")
    assert str(info.value) == f"{flag} must be a positive integer, got {value!r}."


@pytest.mark.parametrize("fsdp, ep", [(8, 3), (6, 4), (4, 8), (10, 4)])
def test_ep_must_divide_fsdp(fsdp, ep):
    with pytest.raises(MeshError, match="is not divisible by ep") as info:
        MeshSpec(fsdp=fsdp, ep=ep)
    assert f"fsdp ({fsdp}) is not divisible by ep ({ep})" in str(info.value)


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2), (4, 4)])
def test_tp_and_pp_are_refused(tp, pp):
    with pytest.raises(MeshError, match="not supported yet") as info:
        MeshSpec(fsdp=8, tp=tp, pp=pp)
    message = str(info.value)
    assert f"tp={tp}, pp={pp}" in message and "not supported yet" in message and "--tp 1 --pp 1" in message


def test_mesh_error_is_a_value_error_and_a_reshard_error():
    with pytest.raises(ValueError, match="--fsdp must be a positive integer, got 0"):
        MeshSpec(fsdp=0)
    assert issubclass(MeshError, ReshardError)


def test_frozen():
    spec = MeshSpec(fsdp=4)
    with pytest.raises(dataclasses.FrozenInstanceError, match="cannot assign to field \'fsdp\'"):
        spec.fsdp = 8  # type: ignore[misc]


# ---- derived sizes ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, efsdp, world", [
    (dict(), 1, 1),
    (dict(fsdp=4), 4, 4),
    (dict(fsdp=4, ep=2), 2, 4),
    (dict(fsdp=8, ep=2), 4, 8),
    (dict(fsdp=64, ep=8), 8, 64),
    (dict(fsdp=8, ep=8), 1, 8),
    (dict(fsdp=4, ep=2, dp_replicate=3), 2, 12),
])
def test_efsdp_and_world_size(kwargs, efsdp, world):
    spec = MeshSpec(**kwargs)
    assert (spec.efsdp, spec.world_size, spec.num_coords) == (efsdp, world, spec.fsdp)


def test_describe_and_round_trip():
    spec = MeshSpec(fsdp=8, ep=2, dp_replicate=2)
    assert spec.describe() == ("world 16 = dp_replicate 2 x fsdp 8; experts: efsdp 4 x ep 2 "
                               "(2 contiguous ranks per EP group)")
    assert MeshSpec(fsdp=5).describe() == "world 5 = dp_replicate 1 x fsdp 5"
    assert MeshSpec(**spec.to_dict()) == spec
    assert spec.to_dict() == {"fsdp": 8, "ep": 2, "dp_replicate": 2, "tp": 1, "pp": 1}


def test_axis_names_are_transformers_mesh_dim_names():
    assert {a.value for a in Axis} == {"pp", "dp_replicate", "fsdp", "tp", "efsdp", "ep"}
    assert Axis.EFSDP == "efsdp"


def test_coord_of_replicas_share_coordinates():
    spec = MeshSpec(fsdp=4, ep=2, dp_replicate=2)
    assert [spec.coord_of(r) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    for rank in (-1, 8):
        with pytest.raises(MeshError, match=f"rank {rank} is outside the mesh of 8 ranks"):
            spec.coord_of(rank)


def _docstring_table(doc: str) -> dict[str, list[int]]:
    """The rows of the rank table in `reshard/plan/_mesh.py`'s docstring: `name: 0 1 2 ...`."""
    rows = {}
    for line in doc.splitlines():
        m = re.search(r"\b(rank|fsdp|efsdp|ep):\s+((?:\d+\s*)+)$", line)
        if m:
            rows[m.group(1)] = [int(x) for x in m.group(2).split()]
    return rows


def test_docstring_rank_table():
    table = _docstring_table(mesh_module.__doc__)
    assert table == {"rank": [0, 1, 2, 3], "fsdp": [0, 1, 2, 3], "efsdp": [0, 0, 1, 1], "ep": [0, 1, 0, 1]}
    assert "--fsdp 4 --ep 2" in mesh_module.__doc__
    spec = MeshSpec(fsdp=4, ep=2)
    for rank, fsdp, efsdp, ep in zip(*(table[k] for k in ("rank", "fsdp", "efsdp", "ep"))):
        assert spec.coord_of(rank) == fsdp
        assert spec.expert_coords(fsdp) == (efsdp, ep)


def test_ep_groups_are_contiguous_ranks():
    spec = MeshSpec(fsdp=16, ep=8)
    groups: dict[int, list[int]] = {}
    for rank in range(spec.world_size):
        efsdp, ep = spec.expert_coords(spec.coord_of(rank))
        groups.setdefault(efsdp, []).append(rank)
        assert 0 <= ep < 8 and 0 <= efsdp < spec.efsdp
    assert groups == {0: list(range(8)), 1: list(range(8, 16))}


# ---- transformers' DistributedConfig ------------------------------------------------------------------------------

MESHES = [dict(fsdp=1), dict(fsdp=4), dict(fsdp=5), dict(fsdp=4, ep=2), dict(fsdp=8, ep=2), dict(fsdp=64, ep=8),
          dict(fsdp=6, ep=3), dict(fsdp=4, ep=2, dp_replicate=2), dict(fsdp=8, ep=8)]


@pytest.mark.parametrize("kwargs", MESHES, ids=lambda k: "-".join(f"{a}{b}" for a, b in k.items()))
def test_distributed_config_kwargs_build_the_same_mesh(kwargs):
    from transformers.distributed import DistributedConfig

    spec = MeshSpec(**kwargs)
    config = DistributedConfig(**spec.distributed_config_kwargs())
    assert (config.fsdp_size, config.ep_size, config.efsdp_size, config.dp_replicate_size, config.tp_size,
            config.pp_size) == (spec.fsdp, spec.ep, spec.efsdp, spec.dp_replicate, spec.tp, spec.pp)
    # the repr users paste into from_pretrained builds the same config
    assert eval(spec.distributed_config_repr(), {"DistributedConfig": DistributedConfig}) == config


def test_distributed_config_repr_text():
    assert MeshSpec(fsdp=8, ep=2).distributed_config_repr() == "DistributedConfig(fsdp_size=8, ep_size=2)"
    assert MeshSpec(fsdp=5).distributed_config_repr() == "DistributedConfig(fsdp_size=5)"
    assert MeshSpec(fsdp=4, dp_replicate=2).distributed_config_repr() == \
        "DistributedConfig(fsdp_size=4, dp_replicate_size=2)"


@settings(max_examples=examples(200), deadline=None)
@given(fsdp=st.integers(1, 24), ep=st.integers(1, 24), dp_replicate=st.integers(1, 3))
def test_accepts_exactly_what_distributed_config_accepts(fsdp, ep, dp_replicate):
    from transformers.distributed import DistributedConfig

    try:
        DistributedConfig(fsdp_size=fsdp, ep_size=ep, dp_replicate_size=dp_replicate)
    except ValueError:
        with pytest.raises(MeshError, match="not divisible"):
            MeshSpec(fsdp=fsdp, ep=ep, dp_replicate=dp_replicate)
    else:
        spec = MeshSpec(fsdp=fsdp, ep=ep, dp_replicate=dp_replicate)
        assert spec.efsdp == DistributedConfig(**spec.distributed_config_kwargs()).efsdp_size


# transformers builds its meshes with `initialize_distributed_mesh`; a fake process group (in-process, no peers, no
# network) lets it run once per rank so the coordinates it assigns can be read back.
_MESH_SCRIPT = r"""
import json, sys
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from transformers.distributed import DistributedConfig
from transformers.distributed.utils import initialize_distributed_mesh

out = []
for kwargs in json.loads(sys.argv[1]):
    config = DistributedConfig(**kwargs)
    world = config.pp_size * config.dp_replicate_size * config.fsdp_size * config.tp_size
    coords = []
    for rank in range(world):
        dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
        try:
            _, meshes = initialize_distributed_mesh(config)
            dense, expert = meshes._dense_mesh, meshes._expert_mesh
            coords.append({"dense": dict(zip(dense.mesh_dim_names, dense.get_coordinate())),
                           "expert": dict(zip(expert.mesh_dim_names, expert.get_coordinate()))})
        finally:
            dist.destroy_process_group()
    out.append(coords)
print(json.dumps(out))
"""


def test_rank_layout_matches_transformers_device_meshes():
    meshes = [MeshSpec(fsdp=4, ep=2), MeshSpec(fsdp=8, ep=2, dp_replicate=2), MeshSpec(fsdp=6, ep=3)]
    configs = [m.distributed_config_kwargs() for m in meshes]
    result = subprocess.run([sys.executable, "-c", _MESH_SCRIPT, json.dumps(configs)], capture_output=True,
                            text=True, cwd=REPO_ROOT, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    layouts = json.loads(result.stdout.strip().splitlines()[-1])
    for spec, ranks in zip(meshes, layouts):
        assert len(ranks) == spec.world_size
        for rank, got in enumerate(ranks):
            shard = spec.coord_of(rank)
            efsdp, ep = spec.expert_coords(shard)
            assert got["dense"] == {"pp": 0, "dp_replicate": rank // spec.fsdp, "fsdp": shard, "tp": 0}, (spec, rank)
            assert got["expert"] == {"pp": 0, "dp_replicate": rank // spec.fsdp, "efsdp": efsdp, "ep": ep}, (spec, rank)
    # and the docstring's 2x2 table is what transformers does
    table = _docstring_table(mesh_module.__doc__)
    assert [(r["expert"]["efsdp"], r["expert"]["ep"]) for r in layouts[0]] == list(zip(table["efsdp"], table["ep"]))
