"""The planner against torch's own arithmetic.

Independent references used here, never reshard's own code:
- `torch.chunk` and FSDP2's `_chunk_with_empty` for how a dim is split;
- `torch.distributed.tensor._utils._compute_local_shape_and_global_offset` (the plain-data twin of
  `compute_local_shape_and_global_offset`) for every rank's local shape and global offset, with the placements
  transformers 5.23 gives each parameter (DESIGN.md section 2; tests/test_plan_multirank.py checks those
  placements against a real stock load);
- `torch.cat` / `torch.stack` for how on-disk pieces fuse into one in-memory tensor.
"""

from __future__ import annotations

import itertools
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file
from torch.distributed.fsdp._fully_shard._fsdp_common import _chunk_with_empty
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Shard, _StridedShard

from conftest import examples
from reshard.plan import DTYPE_BITS
from reshard.read._safetensors_header import read_header
from reshard.errors import MeshError
from reshard.plan import ModelLayout, Piece, Role, TargetTensor
from reshard.plan import MeshSpec
from reshard.plan import Kind, Placement, box_is_empty, local_box, make_plan, summarize
from reshard.plan._placement import chunk
from reshard.runs import chunk_runs

# ---- torch as the reference ---------------------------------------------------------------------------------------


def torch_placements(placement: Placement, mesh: MeshSpec):
    """`(mesh_shape, placements)` of the DTensor transformers (or the patched loader) builds for `placement`."""
    if placement.kind is Kind.DENSE or placement.ep == 1:
        return (mesh.fsdp,), [Shard(placement.shard_dim)]
    first = (_StridedShard(0, split_factor=placement.ep) if placement.shard_dim == 0
             else Shard(placement.shard_dim))
    return (mesh.efsdp, mesh.ep), [first, Shard(0)]


def torch_coordinate(placement: Placement, mesh: MeshSpec, f: int) -> list[int]:
    """The rank's coordinate on that mesh: `[fsdp]`, or `[efsdp, ep]` with ep innermost (contiguous EP groups)."""
    if placement.kind is Kind.DENSE or placement.ep == 1:
        return [f]
    return [f // mesh.ep, f % mesh.ep]


def torch_local(shape, placement: Placement, mesh: MeshSpec, f: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """torch's `(local_shape, global_offset)` for fsdp coordinate `f`."""
    if placement.kind is Kind.REPLICATED:
        return tuple(shape), (0,) * len(shape)
    mesh_shape, placements = torch_placements(placement, mesh)
    return _compute_local_shape_and_global_offset(tuple(shape), mesh_shape, torch_coordinate(placement, mesh, f),
                                                  placements)


def box_of(local_shape, offset) -> tuple[tuple[int, int], ...]:
    return tuple(zip(offset, local_shape))


def split_lengths(size: int, parts: int) -> list[int]:
    """FSDP2's split of one dim: `torch.chunk`, padded with empty chunks (`_chunk_with_empty`)."""
    return [c.numel() for c in _chunk_with_empty(torch.empty(size), parts, 0)]


# ---- chunk -----------------------------------------------------------------------------------------------------


# DESIGN.md section 1: rows per efsdp rank inside one EP group, for E experts at ep 8 (and Mixtral without EP).
DESIGN_TABLE = [
    # (model, experts, ep, efsdp, rows per efsdp rank)
    ("DeepSeek-V3", 256, 8, 8, [4] * 8),
    ("DeepSeek-V3", 256, 8, 16, [2] * 16),
    ("DeepSeek-V3", 256, 8, 6, [6, 6, 6, 6, 6, 2]),
    ("Qwen3-235B", 128, 8, 8, [2] * 8),
    ("Qwen3-235B", 128, 8, 16, [1] * 16),
    ("Qwen3-235B", 128, 8, 6, [3, 3, 3, 3, 3, 1]),
    ("GLM-4.6", 160, 8, 8, [3, 3, 3, 3, 3, 3, 2, 0]),
    ("GLM-4.6", 160, 8, 16, [2] * 10 + [0] * 6),
    ("GLM-4.6", 160, 8, 6, [4, 4, 4, 4, 4, 0]),
    ("gpt-oss-20b", 32, 8, 8, [1] * 4 + [0] * 4),
    ("gpt-oss-20b", 32, 8, 16, [1] * 4 + [0] * 12),
    ("gpt-oss-20b", 32, 8, 6, [1] * 4 + [0] * 2),
    ("Mixtral-8x7B", 8, 1, 5, [2, 2, 2, 2, 0]),
]


@pytest.mark.parametrize("model,experts,ep,efsdp,rows", DESIGN_TABLE, ids=[f"{r[0]}-ep{r[2]}-efsdp{r[3]}"
                                                                         for r in DESIGN_TABLE])
def test_chunk_matches_design_table(model, experts, ep, efsdp, rows):
    local = experts // ep
    assert [chunk(local, efsdp, i)[1] for i in range(efsdp)] == rows
    assert split_lengths(local, efsdp) == rows  # and FSDP2 agrees with the table


def test_chunk_design_table_empty_counts():
    """The table's headline numbers: GLM-4.6 at ep8 efsdp16 has 6 empty ranks, gpt-oss-20b at ep8 efsdp8 has 4."""
    assert sum(chunk(20, 16, i)[1] == 0 for i in range(16)) == 6
    assert sum(chunk(4, 8, i)[1] == 0 for i in range(8)) == 4
    assert sum(chunk(20, 6, i)[1] == 0 for i in range(6)) == 1


@pytest.mark.parametrize("size", range(0, 41))
def test_chunk_is_torch_chunk(size):
    """Lengths and offsets equal torch.chunk / FSDP2 for every size and part count; empty offsets are the size."""
    for parts in range(1, 20):
        pieces = _chunk_with_empty(torch.arange(size), parts, 0)
        for i, piece in enumerate(pieces):
            offset, length = chunk(size, parts, i)
            assert length == piece.numel(), (size, parts, i)
            if length:
                assert offset == int(piece[0]), (size, parts, i)
            else:
                assert offset == size, (size, parts, i)
            # DTensor's Shard uses the same arithmetic (pytorch#150862 for the empty offset)
            t_shape, t_offset = _compute_local_shape_and_global_offset((size,), (parts,), [i], [Shard(0)])
            assert (offset, length) == (t_offset[0], t_shape[0]), (size, parts, i)


@pytest.mark.parametrize("local", range(1, 70))
def test_empty_rank_rule(local):
    """DESIGN.md: a rank is empty exactly when ceil(L/F) * (F - 1) >= L; and then the last rank is empty."""
    for parts in range(1, 70):
        lengths = split_lengths(local, parts)
        rule = math.ceil(local / parts) * (parts - 1) >= local
        assert (0 in lengths) == rule, (local, parts)
        assert (chunk(local, parts, parts - 1)[1] == 0) == rule, (local, parts)
        assert sum(lengths) == local


# ---- local_box vs torch, rank by rank ----------------------------------------------------------------------------

DENSE_CASES = [
    # (shape, fsdp)
    ((8, 4), 5), ((8, 4), 8), ((8, 4), 3), ((2, 64), 4), ((10, 64), 8), ((160, 5120), 64), ((151552, 5120), 64),
    ((64,), 4), ((7,), 8), ((1,), 3), ((5, 3, 2), 4), ((24, 64), 8), ((0, 4), 2),
]


@pytest.mark.parametrize("shape,fsdp", DENSE_CASES)
def test_local_box_dense_vs_torch(shape, fsdp):
    for ep in [e for e in (1, 2, 4, 8) if fsdp % e == 0]:  # the dense split ignores ep
        mesh = MeshSpec(fsdp=fsdp, ep=ep)
        placement = Placement(Kind.DENSE, 0, fsdp)
        for f in range(fsdp):
            t_shape, t_offset = _compute_local_shape_and_global_offset(shape, (fsdp,), [f], [Shard(0)])
            assert local_box(shape, placement, mesh, f) == box_of(t_shape, t_offset), (shape, fsdp, ep, f)


EXPERT_CASES = [
    # (shape, fsdp, ep): stock experts, uneven cases included
    ((160, 24, 16), 64, 8),  # GLM-4.6: [3,3,3,3,3,3,2,0] per EP group
    ((160, 24, 16), 128, 8),  # 6 empty per group
    ((160, 24, 16), 48, 8),  # efsdp 6
    ((32, 6, 4), 64, 8),  # gpt-oss-20b: 4 empty
    ((256, 4, 2), 48, 8),
    ((10, 48, 64), 8, 2),  # the tiny glm4_moe of the multirank test
    ((10, 64, 24), 8, 2),
    ((8, 6, 4), 4, 4),
    ((8, 6, 4), 8, 8),
    ((6, 5, 3), 12, 3),
    ((4, 2, 2), 16, 2),
    ((12, 3), 8, 4),  # 2-D expert tensor (e.g. an expert bias)
]


@pytest.mark.parametrize("shape,fsdp,ep", EXPERT_CASES)
def test_local_box_stock_experts_vs_torch(shape, fsdp, ep):
    mesh = MeshSpec(fsdp=fsdp, ep=ep)
    placement = Placement(Kind.EXPERT, 0, mesh.efsdp, ep)
    empties = 0
    for f in range(fsdp):
        efsdp_index, ep_index = divmod(f, ep)
        t_shape, t_offset = _compute_local_shape_and_global_offset(
            shape, (mesh.efsdp, ep), [efsdp_index, ep_index], [_StridedShard(0, split_factor=ep), Shard(0)])
        box = local_box(shape, placement, mesh, f)
        assert box == box_of(t_shape, t_offset), (shape, fsdp, ep, f)
        empties += box_is_empty(box)
    # the cases are chosen to include empty ranks where the design table says so
    per_group = [split_lengths(shape[0] // ep, mesh.efsdp)] * ep
    assert empties == sum(n == 0 for lengths in per_group for n in lengths)


@pytest.mark.parametrize("shape,fsdp,ep", EXPERT_CASES + [((20, 12, 8), 8, 1), ((8, 6, 5), 5, 1)])
def test_local_box_balanced_experts_vs_torch(shape, fsdp, ep):
    """`(Shard(d), Shard(0))` on (efsdp, ep) (or `Shard(d)` on fsdp when ep is 1), every dim, even or not."""
    mesh = MeshSpec(fsdp=fsdp, ep=ep)
    for d in range(1, len(shape)):
        placement = Placement(Kind.EXPERT, d, mesh.efsdp, ep)
        for f in range(fsdp):
            if ep == 1:
                t_shape, t_offset = _compute_local_shape_and_global_offset(shape, (fsdp,), [f], [Shard(d)])
            else:
                t_shape, t_offset = _compute_local_shape_and_global_offset(
                    shape, (mesh.efsdp, ep), list(divmod(f, ep)), [Shard(d), Shard(0)])
            assert local_box(shape, placement, mesh, f) == box_of(t_shape, t_offset), (shape, fsdp, ep, d, f)


def test_local_box_expert_with_ep1_is_plain_shard():
    mesh = MeshSpec(fsdp=5)
    for f in range(5):
        t_shape, t_offset = _compute_local_shape_and_global_offset((8, 6, 4), (5,), [f], [Shard(0)])
        assert local_box((8, 6, 4), Placement(Kind.EXPERT, 0, 5, 1), mesh, f) == box_of(t_shape, t_offset)


def test_local_box_replicated_is_whole_tensor():
    mesh = MeshSpec(fsdp=8, ep=2)
    for f in range(8):
        assert local_box((10,), Placement(Kind.REPLICATED), mesh, f) == ((0, 10),)


def test_placement_describe():
    assert Placement(Kind.DENSE, 0, 8).describe() == "Shard(0) on fsdp"
    assert Placement(Kind.EXPERT, 0, 8, 8).describe() == "(_StridedShard(0, sf=8), Shard(0)) on (efsdp, ep)"
    assert Placement(Kind.EXPERT, 1, 8, 8).describe() == "(Shard(1), Shard(0)) on (efsdp, ep)"
    assert Placement(Kind.EXPERT, 1, 4, 1).describe() == "Shard(1) on fsdp"
    assert Placement(Kind.REPLICATED).describe().startswith("Replicate()")


def test_plan_module_imports_without_torch():
    """The planner is plain data: importable with torch blocked."""
    code = ("import sys; sys.modules['torch'] = None\n"
            "import reshard.plan._placement, reshard.plan._layout, reshard.plan._mesh\n"
            "print(reshard.plan._placement.chunk(20, 8, 7))")
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "(20, 0)"


# ---- hand-built layouts --------------------------------------------------------------------------------------------


def _t(name, shape, role, *, dtype="BF16", is_param=True) -> TargetTensor:
    return TargetTensor(name, tuple(shape), dtype, role, is_param, (Piece(name, (0,) * len(shape)),))


def moe_layout(*, layers: int, experts: int, inter: int, hidden: int, vocab: int = 16, dense_layers: int = 0,
               dense_inter: int | None = None, dtype: str = "BF16") -> ModelLayout:
    """A GLM/DeepSeek-like model: dense first layers, then MoE layers with fused experts, router, shared expert."""
    tensors = [_t("model.embed_tokens.weight", (vocab, hidden), Role.DENSE, dtype=dtype)]
    for layer in range(layers):
        p = f"model.layers.{layer}"
        tensors += [_t(f"{p}.self_attn.q_proj.weight", (hidden, hidden), Role.DENSE, dtype=dtype),
                    _t(f"{p}.input_layernorm.weight", (hidden,), Role.DENSE, dtype=dtype)]
        if layer < dense_layers:
            n = dense_inter or 2 * inter
            tensors += [_t(f"{p}.mlp.gate_proj.weight", (n, hidden), Role.DENSE, dtype=dtype),
                        _t(f"{p}.mlp.down_proj.weight", (hidden, n), Role.DENSE, dtype=dtype)]
            continue
        tensors += [
            _t(f"{p}.mlp.experts.gate_up_proj", (experts, 2 * inter, hidden), Role.EXPERT, dtype=dtype),
            _t(f"{p}.mlp.experts.down_proj", (experts, hidden, inter), Role.EXPERT, dtype=dtype),
            _t(f"{p}.mlp.gate.weight", (experts, hidden), Role.ROUTER, dtype=dtype),
            _t(f"{p}.mlp.gate.e_score_correction_bias", (experts,), Role.ROUTER, dtype="F32", is_param=False),
            _t(f"{p}.mlp.shared_experts.gate_proj.weight", (inter, hidden), Role.SHARED_EXPERT, dtype=dtype),
        ]
    tensors += [_t("model.norm.weight", (hidden,), Role.DENSE, dtype=dtype),
                _t("lm_head.weight", (vocab, hidden), Role.DENSE, dtype=dtype)]
    return ModelLayout("glm4_moe", "Glm4MoeForCausalLM", tuple(tensors))


def _check_tiling(shape, boxes, what):
    """Non-empty boxes cover the tensor exactly once: count every element with torch."""
    count = torch.zeros(shape, dtype=torch.int32)
    for box in boxes:
        if box_is_empty(box):
            continue
        count[tuple(slice(o, o + n) for o, n in box)] += 1
    assert int(count.min()) == 1 and int(count.max()) == 1, f"{what}: min {int(count.min())} max {int(count.max())}"


def _expert_bytes(plan, mesh, *, stock: bool) -> list[int]:
    """Per fsdp coordinate, the expert bytes it holds, from torch's local shapes."""
    out = [0] * mesh.num_coords
    for tp in plan.tensors:
        if tp.tensor.role is not Role.EXPERT:
            continue
        placement = tp.stock if stock else tp.planned
        for f in range(mesh.num_coords):
            t_shape, _ = torch_local(tp.tensor.shape, placement, mesh, f)
            out[f] += math.prod(t_shape) * DTYPE_BITS[tp.tensor.dtype] // 8
    return out


def _evenly_splittable(shape, mesh) -> bool:
    """Some dim of an expert tensor splits evenly on its shard axis (dim 0 counts per EP group)."""
    degree = mesh.efsdp if mesh.ep > 1 else mesh.fsdp
    return (shape[0] // mesh.ep) % degree == 0 or any(n % degree == 0 for n in shape[1:])


@st.composite
def meshes_and_layouts(draw):
    ep = draw(st.sampled_from([1, 2, 4]))
    efsdp = draw(st.integers(1, 6))
    experts = ep * draw(st.integers(1, 6))
    layers = draw(st.integers(1, 2))
    layout = moe_layout(layers=layers, experts=experts, inter=draw(st.integers(1, 7)),
                        hidden=draw(st.integers(1, 9)), vocab=draw(st.integers(1, 13)),
                        dense_layers=draw(st.integers(0, layers - 1)))
    return layout, MeshSpec(fsdp=ep * efsdp, ep=ep)


@settings(max_examples=examples(120), deadline=None)
@given(meshes_and_layouts())
def test_boxes_tile_every_tensor_exactly_once(case):
    layout, mesh = case
    plan = make_plan(layout, mesh, mode="balanced")
    for tp in plan.tensors:
        shape = tp.tensor.shape
        if tp.planned.kind is Kind.REPLICATED:
            assert not tp.tensor.is_param
            assert all(box == tuple((0, n) for n in shape) for box in tp.boxes(mesh))
            continue
        for stock in (True, False):
            placement = tp.stock if stock else tp.planned
            boxes = tp.boxes(mesh, stock=stock)
            _check_tiling(shape, boxes, f"{tp.tensor.name} {'stock' if stock else 'planned'} on {mesh}")
            for f, box in enumerate(boxes):  # each box is torch's
                assert box == box_of(*torch_local(shape, placement, mesh, f)), (tp.tensor.name, stock, f)


@settings(max_examples=examples(120), deadline=None)
@given(meshes_and_layouts())
def test_balanced_never_worse_and_even_when_a_dim_divides(case):
    layout, mesh = case
    stock_plan = make_plan(layout, mesh, mode="stock")
    plan = make_plan(layout, mesh, mode="balanced")
    assert all(tp.stock == tp.planned for tp in stock_plan.tensors)
    stock = _expert_bytes(plan, mesh, stock=True)
    planned = _expert_bytes(plan, mesh, stock=False)
    assert stock == _expert_bytes(stock_plan, mesh, stock=False)
    assert sum(planned) == sum(stock)  # nothing lost, nothing duplicated
    assert max(planned) <= max(stock)
    _, stats = summarize(plan)
    assert stats["stock_expert_bytes_max"] == max(stock)
    assert stats["planned_expert_bytes_max"] == max(planned)
    if all(_evenly_splittable(t.shape, mesh) for t in layout.experts):
        assert len(set(planned)) == 1, planned
        assert stats["planned_expert_max_over_mean"] == 1.0
    # the decision: keep dim 0 when it divides, else the first dim >= 1 that divides, else dim 0
    degree = mesh.efsdp if mesh.ep > 1 else mesh.fsdp
    for tp in plan.tensors:
        if tp.tensor.role is not Role.EXPERT:
            assert tp.planned == tp.stock
            continue
        shape = tp.tensor.shape
        dividing = [d for d in range(1, len(shape)) if shape[d] % degree == 0]
        if (shape[0] // mesh.ep) % degree == 0 or not dividing:
            assert tp.planned == tp.stock
        else:
            assert tp.planned.shard_dim == dividing[0] and tp.planned.ep == tp.stock.ep


def test_experts_not_divisible_by_ep_raises_with_numbers():
    layout = moe_layout(layers=1, experts=6, inter=4, hidden=8)
    with pytest.raises(MeshError, match=r"num_experts \(6\) is not divisible by ep \(4\)"):
        make_plan(layout, MeshSpec(fsdp=4, ep=4))
    with pytest.raises(MeshError, match=r"num_experts \(6\) is not divisible by ep \(4\)"):
        make_plan(layout, MeshSpec(fsdp=8, ep=4), mode="stock")
    make_plan(layout, MeshSpec(fsdp=6, ep=3))  # 3 divides 6: fine


def test_ep_without_experts_raises():
    layout = ModelLayout("llama", "LlamaForCausalLM", (_t("w", (8, 8), Role.DENSE),))
    with pytest.raises(MeshError, match="--ep 2"):
        make_plan(layout, MeshSpec(fsdp=4, ep=2))


# ---- GLM-4.6 at ep 8 x efsdp 8 -------------------------------------------------------------------------------------


def test_make_plan_glm46_shape():
    layout = moe_layout(layers=3, dense_layers=1, experts=160, inter=1536, hidden=5120, vocab=151552,
                        dense_inter=12288)
    mesh = MeshSpec(fsdp=64, ep=8)
    plan = make_plan(layout, mesh)
    tensors = {tp.tensor.name: tp for tp in plan.tensors}
    gate_up = tensors["model.layers.1.mlp.experts.gate_up_proj"]
    down = tensors["model.layers.1.mlp.experts.down_proj"]
    assert gate_up.tensor.shape == (160, 3072, 5120)
    assert gate_up.stock == Placement(Kind.EXPERT, 0, 8, 8)
    stock_boxes = gate_up.boxes(mesh, stock=True)
    for group in range(8):  # ranks group, group + 8, ... form one efsdp column of EP group `group`
        rows = [stock_boxes[e * 8 + group][0][1] for e in range(8)]
        assert rows == [3, 3, 3, 3, 3, 3, 2, 0], group
    # balanced: split dim 1, 3072 / 8 = 384 rows each; down_proj [160, 5120, 1536]: 5120 / 8 = 640
    assert gate_up.planned == Placement(Kind.EXPERT, 1, 8, 8)
    assert gate_up.planned.describe() == "(Shard(1), Shard(0)) on (efsdp, ep)"
    assert {box[1][1] for box in gate_up.boxes(mesh)} == {384}
    assert {box[0][1] for box in gate_up.boxes(mesh)} == {20}
    assert down.planned == Placement(Kind.EXPERT, 1, 8, 8)
    assert {box[1][1] for box in down.boxes(mesh)} == {640}
    _, stats = summarize(plan)
    assert stats["stock_expert_max_over_mean"] == pytest.approx(1.2)  # 3 experts where the mean is 2.5
    assert stats["planned_expert_max_over_mean"] == 1.0
    per_expert = (3072 * 5120 + 5120 * 1536) * 2
    assert stats["stock_expert_bytes_max"] == 2 * 3 * per_expert  # 2 MoE layers, 3 experts each
    assert stats["planned_expert_bytes_max"] == 2 * 2.5 * per_expert
    assert _expert_bytes(plan, mesh, stock=True).count(0) == 8  # the last efsdp rank of each EP group
    assert 0 not in _expert_bytes(plan, mesh, stock=False)


# ---- chunk_runs: byte runs vs torch.cat / torch.stack --------------------------------------------------------------

TORCH_DTYPE = {"BF16": torch.bfloat16, "F32": torch.float32, "F16": torch.float16, "I64": torch.int64}


def _save(tmp_path, files: dict[str, dict[str, torch.Tensor]]):
    """Write the sources, return `{key: TensorEntry}` read back from the real headers."""
    entries = {}
    for name, tensors in files.items():
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / name))
        for entry in read_header(tmp_path / name).tensors:
            entries[entry.name] = entry
    return entries


def _apply_runs(tmp_path, tensor: TargetTensor, box, entries) -> torch.Tensor:
    runs = chunk_runs(tensor, box, entries)
    shape = tuple(n for _, n in box)
    itemsize = DTYPE_BITS[tensor.dtype] // 8
    out = bytearray(b"\xa5" * (math.prod(shape) * itemsize))  # a gap would show as a 0xa5a5 pattern
    written = [0] * len(out)
    for run in runs:
        with open(tmp_path / run.file, "rb") as f:
            f.seek(run.src)
            data = f.read(run.nbytes)
        assert len(data) == run.nbytes
        assert 0 <= run.dst and run.dst + run.nbytes <= len(out)
        out[run.dst:run.dst + run.nbytes] = data
        for i in range(run.dst, run.dst + run.nbytes, itemsize):
            written[i] += 1
    assert all(written[i] == 1 for i in range(0, len(out), itemsize)), "runs overlap or leave a gap"
    if not out:
        return torch.empty(shape, dtype=TORCH_DTYPE[tensor.dtype])
    return torch.frombuffer(out, dtype=TORCH_DTYPE[tensor.dtype]).reshape(shape)


def _slice(full: torch.Tensor, box) -> torch.Tensor:
    return full[tuple(slice(o, o + n) for o, n in box)]


def _all_boxes(shape, fsdps=(1, 2, 3, 4, 5, 8), eps=(1, 2, 4)):
    """Every box the planner can produce on these meshes (stock and any-dim balanced), plus odd hand-made ones."""
    boxes = {tuple((0, n) for n in shape)}
    for fsdp, ep in itertools.product(fsdps, eps):
        if fsdp % ep or shape[0] % ep:
            continue
        mesh = MeshSpec(fsdp=fsdp, ep=ep)
        for d in range(len(shape)):
            kind = Kind.EXPERT if ep > 1 else Kind.DENSE
            for f in range(fsdp):
                box = local_box(shape, Placement(kind, d, mesh.efsdp if ep > 1 else fsdp, ep), mesh, f)
                if not box_is_empty(box):
                    boxes.add(box)
    # arbitrary interior boxes: partial on every dim
    boxes.add(tuple((1, n - 2) if n > 2 else (0, n) for n in shape))
    boxes.add(tuple((n - 1, 1) for n in shape))
    return sorted(boxes)


def _check_all(tmp_path, tensor, full, entries):
    assert tuple(full.shape) == tensor.shape
    for box in _all_boxes(tensor.shape):
        got = _apply_runs(tmp_path, tensor, box, entries)
        assert torch.equal(got, _slice(full, box)), (tensor.name, box)
    empty = tuple((n, 0) if d == 0 else (0, n) for d, n in enumerate(tensor.shape))
    assert chunk_runs(tensor, empty, entries) == []


def test_chunk_runs_per_expert_gate_up_fused(tmp_path):
    """Qwen/GLM per-expert keys: MergeModulelist(dim=0) then Concatenate(dim=1) into gate_up_proj [E, 2I, H]."""
    torch.manual_seed(0)
    E, I, H = 6, 5, 7
    gates = [torch.randn(I, H).to(torch.bfloat16) for _ in range(E)]
    ups = [torch.randn(I, H).to(torch.bfloat16) for _ in range(E)]
    # gate and up in different files, experts interleaved with other tensors
    files = {"a.safetensors": {**{f"e.{e}.gate": gates[e] for e in range(E)}, "other": torch.randn(3)},
             "b.safetensors": {f"e.{e}.up": ups[e] for e in range(E)}}
    entries = _save(tmp_path, files)
    pieces = tuple([Piece(f"e.{e}.gate", (e, 0, 0), 0) for e in range(E)]
                   + [Piece(f"e.{e}.up", (e, I, 0), 0) for e in range(E)])
    tensor = TargetTensor("experts.gate_up_proj", (E, 2 * I, H), "BF16", Role.EXPERT, True, pieces)
    full = torch.cat([torch.stack(gates), torch.stack(ups)], dim=1)
    _check_all(tmp_path, tensor, full, entries)
    # the balanced split of the GLM-4.6 case in small: dim 1 of [E, 2I, H] in two halves is exactly gate | up
    box = ((0, E), (0, I), (0, H))
    assert torch.equal(_apply_runs(tmp_path, tensor, box, entries), torch.stack(gates))


def test_chunk_runs_per_expert_down_stacked(tmp_path):
    torch.manual_seed(1)
    E, H, I = 5, 4, 3
    downs = [torch.randn(H, I) for _ in range(E)]
    entries = _save(tmp_path, {"d.safetensors": {f"e.{e}.down": downs[e] for e in range(E)}})
    pieces = tuple(Piece(f"e.{e}.down", (e, 0, 0), 0) for e in range(E))
    tensor = TargetTensor("experts.down_proj", (E, H, I), "F32", Role.EXPERT, True, pieces)
    _check_all(tmp_path, tensor, torch.stack(downs), entries)


def test_chunk_runs_stacked_on_inner_dim(tmp_path):
    """A MergeModulelist on dim 1: pieces stacked inside the tensor, not on its leading dim."""
    torch.manual_seed(2)
    A, E, B = 3, 4, 5
    xs = [torch.randn(A, B).to(torch.bfloat16) for _ in range(E)]
    entries = _save(tmp_path, {"x.safetensors": {f"x.{e}": xs[e] for e in range(E)}})
    pieces = tuple(Piece(f"x.{e}", (0, e, 0), 1) for e in range(E))
    tensor = TargetTensor("stacked_inner", (A, E, B), "BF16", Role.EXPERT, True, pieces)
    _check_all(tmp_path, tensor, torch.stack(xs, dim=1), entries)


def test_chunk_runs_concatenated_dense(tmp_path):
    """Concatenate without stacking: q, k, v on dim 0, and two blocks on dim 1."""
    torch.manual_seed(3)
    q, k, v = torch.randn(6, 4), torch.randn(2, 4), torch.randn(3, 4)
    left, right = torch.randn(5, 3).half(), torch.randn(5, 4).half()
    entries = _save(tmp_path, {"qkv.safetensors": {"q": q, "k": k, "v": v},
                               "lr.safetensors": {"right": right, "left": left}})
    qkv = TargetTensor("qkv", (11, 4), "F32", Role.DENSE, True,
                       (Piece("q", (0, 0)), Piece("k", (6, 0)), Piece("v", (8, 0))))
    _check_all(tmp_path, qkv, torch.cat([q, k, v], dim=0), entries)
    lr = TargetTensor("lr", (5, 7), "F16", Role.DENSE, True, (Piece("left", (0, 0)), Piece("right", (0, 3))))
    _check_all(tmp_path, lr, torch.cat([left, right], dim=1), entries)


def test_chunk_runs_fused_source_dim1_split(tmp_path):
    """An already fused gate_up_proj [E, 2I, H] (save_original_format=False) split on dim 1 and dim 2."""
    torch.manual_seed(4)
    full = torch.randn(4, 6, 5).to(torch.bfloat16)
    entries = _save(tmp_path, {"f.safetensors": {"pre": torch.arange(3), "gate_up": full}})
    tensor = TargetTensor("gate_up", (4, 6, 5), "BF16", Role.EXPERT, True, (Piece("gate_up", (0, 0, 0)),))
    _check_all(tmp_path, tensor, full, entries)
    # a dim-1 chunk is one run per expert (it is contiguous only inside each expert)
    runs = chunk_runs(tensor, ((0, 4), (3, 3), (0, 5)), entries)
    assert len(runs) == 4 and all(r.nbytes == 3 * 5 * 2 for r in runs)
    # a dim-0 chunk of a single source is a single run
    assert len(chunk_runs(tensor, ((1, 2), (0, 6), (0, 5)), entries)) == 1


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_chunk_runs_arbitrary_boxes(tmp_path_factory, data):
    """Random expert counts, sizes and boxes against torch.cat(torch.stack(...)) slicing."""
    tmp_path = tmp_path_factory.mktemp("runs")
    E, I, H = data.draw(st.integers(1, 5)), data.draw(st.integers(1, 4)), data.draw(st.integers(1, 4))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    gates = [torch.randn(I, H, generator=gen) for _ in range(E)]
    ups = [torch.randn(I, H, generator=gen) for _ in range(E)]
    entries = _save(tmp_path, {"g.safetensors": {f"g{e}": gates[e] for e in range(E)},
                               "u.safetensors": {f"u{e}": ups[e] for e in range(E)}})
    pieces = tuple([Piece(f"g{e}", (e, 0, 0), 0) for e in range(E)] + [Piece(f"u{e}", (e, I, 0), 0) for e in range(E)])
    tensor = TargetTensor("gate_up", (E, 2 * I, H), "F32", Role.EXPERT, True, pieces)
    full = torch.cat([torch.stack(gates), torch.stack(ups)], dim=1)
    box = []
    for n in tensor.shape:
        start = data.draw(st.integers(0, n - 1))
        box.append((start, data.draw(st.integers(1, n - start))))
    box = tuple(box)
    assert torch.equal(_apply_runs(tmp_path, tensor, box, entries), _slice(full, box))


@settings(max_examples=examples(300), deadline=None)
@given(fsdp=st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16, 24]), data=st.data())
def test_every_coordinate_at_once_is_local_box_of_each(fsdp, data):
    """`coordinate_boxes`, `split_lengths` and `local_sizes` (what plan, coverage, the reader and the writers use to
    stay linear in coordinates) give exactly `local_box` of each coordinate, for placements that disagree with the
    mesh too (coverage must find those) and shapes with empty dims."""
    from reshard.plan import coordinate_boxes
    from reshard.plan._placement import local_sizes, split_lengths

    ep = data.draw(st.sampled_from([e for e in range(1, fsdp + 1) if fsdp % e == 0]), label="ep")
    mesh = MeshSpec(fsdp=fsdp, ep=ep)
    shape = tuple(data.draw(st.lists(st.sampled_from([0, 1, 2, 3, 5, 8, 12, 20, 40]), min_size=1, max_size=3),
                            label="shape"))
    kind = data.draw(st.sampled_from(list(Kind)), label="kind")
    dim = data.draw(st.integers(0, len(shape) - 1), label="dim")
    placement = Placement(kind, None if kind is Kind.REPLICATED else dim, data.draw(st.integers(1, 6), label="degree"),
                          data.draw(st.integers(1, 5), label="ep"))
    boxes = [local_box(shape, placement, mesh, c) for c in range(fsdp)]
    assert coordinate_boxes(shape, placement, mesh) == boxes
    assert local_sizes(shape, placement, mesh) == [math.prod(n for _, n in box) for box in boxes]
    if kind is not Kind.REPLICATED:
        assert split_lengths(shape, placement, mesh) == [box[dim][1] for box in boxes]
