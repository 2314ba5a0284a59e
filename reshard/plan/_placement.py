"""Simulate how transformers 5.23 + FSDP2 shard every tensor, and decide the layout reshard writes instead.

Pure planning over plain data: no torch, no I/O. The arithmetic mirrors torch's
`torch.distributed.tensor._utils._compute_local_shape_and_global_offset` (tests compare them rank by rank):

- dense parameters: `Shard(0)` on `fsdp` (replicated over `dp_replicate`), chunked like `torch.chunk`:
  `ceil(n / w)` rows per rank, trailing ranks possibly empty;
- routed experts with ep > 1: `(_StridedShard(0, sf=ep), Shard(0))` on `(efsdp, ep)`: the expert dim is cut into
  `ep` contiguous blocks of `E / ep`, and each block is chunked over `efsdp`; with ep = 1, `Shard(0)` on `fsdp`;
- persistent buffers: not sharded (every rank holds the whole tensor).

An empty local shard has length 0 and, as torch defines it, a global offset equal to the dim's size.

The balanced layout keeps EP on the expert dim and moves the FSDP split of an expert tensor to the first dim
d >= 1 that divides evenly by the shard degree, when the expert dim does not: every rank then holds the same bytes.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from dataclasses import dataclass
from enum import Enum

from ..errors import MeshError
from ._dtypes import DTYPE_BITS
from ._layout import ModelLayout, Role, TargetTensor
from ._mesh import MeshSpec

Box = tuple[tuple[int, int], ...]  # (global offset, length) per tensor dim


class LayoutMode(str, Enum):
    """`stock`: shard exactly as transformers does. `balanced`: move uneven expert splits to an even dim."""

    STOCK = "stock"
    BALANCED = "balanced"


class Kind(str, Enum):
    REPLICATED = "replicated"  # persistent buffers
    DENSE = "dense"  # Shard(shard_dim) on fsdp
    EXPERT = "expert"  # EP on dim 0, then efsdp on shard_dim


@dataclass(frozen=True)
class Placement:
    """How one tensor is split over the mesh.

    Attributes:
        kind: replicated, dense (fsdp only) or expert (ep, then efsdp).
        shard_dim: the tensor dim the fsdp / efsdp axis splits (None when replicated).
        degree: ranks along that axis (fsdp, or efsdp for experts with ep > 1).
        ep: expert-parallel ranks splitting dim 0 first (1 when there is no EP split).
    """

    kind: Kind
    shard_dim: int | None = None
    degree: int = 1
    ep: int = 1

    def describe(self) -> str:
        """The DTensor placements transformers / the patched loader give the parameter."""
        if self.kind is Kind.REPLICATED:
            return "Replicate() (buffer, not sharded)"
        if self.kind is Kind.DENSE or self.ep == 1:
            return f"Shard({self.shard_dim}) on fsdp"
        first = f"_StridedShard(0, sf={self.ep})" if self.shard_dim == 0 else f"Shard({self.shard_dim})"
        return f"({first}, Shard(0)) on (efsdp, ep)"


def chunk(size: int, parts: int, index: int) -> tuple[int, int]:
    """`(offset, length)` of chunk `index` when `size` rows are split like `torch.chunk` into `parts`.

    Every chunk holds `ceil(size / parts)` rows and the trailing ones take what is left, possibly nothing; an
    empty chunk's offset is `size` (torch's convention for empty shards).

    Example:
        >>> [chunk(20, 8, i)[1] for i in range(8)]
        [3, 3, 3, 3, 3, 3, 2, 0]
    """
    per = -(-size // parts)
    start = index * per
    if start >= size:
        return size, 0
    return start, min(per, size - start)


def _chunk_lengths(size: int, parts: int) -> list[int]:
    """`[chunk(size, parts, i)[1] for i in range(parts)]`, built from its three runs (full, the rest, empty)."""
    per = -(-size // parts)
    if per == 0:
        return [0] * parts
    full, rest = divmod(size, per)
    lengths = [per] * full + ([rest] if rest else [])
    return lengths + [0] * (parts - len(lengths))


@functools.lru_cache(maxsize=1 << 16)
def local_box(shape: tuple[int, ...], placement: Placement, mesh: MeshSpec, coord: int) -> Box:
    """The global region one fsdp coordinate holds of a tensor (see the module docstring for the rules).

    Cached: a model has a few dozen distinct (shape, placement) pairs however many layers, so a coordinate's chunk
    list costs one lookup per tensor.
    """
    box = [(0, n) for n in shape]
    if placement.kind is Kind.REPLICATED:
        return tuple(box)
    d = placement.shard_dim
    if placement.kind is Kind.DENSE or placement.ep == 1:
        box[d] = chunk(shape[d], mesh.fsdp, coord)
    else:
        efsdp_index, ep_index = mesh.expert_coords(coord)
        per_group = shape[0] // placement.ep
        box[0] = (ep_index * per_group, per_group)
        offset, length = chunk(box[d][1], placement.degree, efsdp_index)
        if length == 0:
            box[d] = (shape[d], 0)
        else:
            box[d] = (box[d][0] + offset, length)
    if any(length == 0 for _, length in box):
        # torch: an empty shard's offset is the dim size on the sharded dim; other dims keep their offsets
        box = [(shape[i], 0) if length == 0 else (offset, length) for i, (offset, length) in enumerate(box)]
    return tuple(box)


def coordinate_boxes(shape: tuple[int, ...], placement: Placement, mesh: MeshSpec) -> list[Box]:
    """`local_box` of every coordinate, in coordinate order, in O(coordinates) with no cache lookup per coordinate.

    Coordinate `e * blocks + i` holds chunk `e` of block `i`'s split dim, where the blocks are the tensor's EP blocks
    on dim 0 (one block, the whole tensor, without EP): each chunk is cut once per `e`.
    """
    n = mesh.num_coords
    if placement.kind is Kind.REPLICATED:
        return [tuple((0, s) for s in shape)] * n
    d, blocks, count = placement.shard_dim, *_blocks(shape, placement, mesh)
    if any(length == 0 for _, length in blocks[0]):  # nothing to split (rare): the rule, coordinate by coordinate
        return [local_box(shape, placement, mesh, c) for c in range(n)]
    rows = blocks[0][d][1]  # every block's split dim has the same length
    out = []
    for e in range(n // len(blocks)):
        offset, length = chunk(rows, count, e)
        for block in blocks:
            piece = (block[d][0] + offset, length) if length else (shape[d], 0)  # torch's offset of an empty shard
            out.append(block[:d] + (piece,) + block[d + 1:])
    return out


def _blocks(shape: tuple[int, ...], placement: Placement, mesh: MeshSpec) -> tuple[list[Box], int]:
    """The blocks coordinate `c` takes its chunk from, block `c % len(blocks)` (the EP index: one block, the whole
    tensor, without EP), and how many chunks each block's split dim is cut into (as `local_box` does)."""
    whole = tuple((0, s) for s in shape)
    if placement.kind is Kind.DENSE or placement.ep == 1:
        return [whole], mesh.fsdp
    per_group = shape[0] // placement.ep
    return [((i * per_group, per_group),) + whole[1:] for i in range(mesh.ep)], placement.degree


def split_lengths(shape: tuple[int, ...], placement: Placement, mesh: MeshSpec) -> list[int]:
    """Each coordinate's local length on the split dim (0: an empty local), in O(coordinates) without a box: a
    coordinate's length depends only on its chunk index `e` (see `coordinate_boxes`)."""
    if placement.kind is Kind.REPLICATED:
        return [shape[0] if shape else 1] * mesh.num_coords
    d, blocks, count = placement.shard_dim, *_blocks(shape, placement, mesh)
    lengths = _chunk_lengths(blocks[0][d][1], count)[:mesh.num_coords // len(blocks)]
    lengths += [0] * (mesh.num_coords // len(blocks) - len(lengths))  # (a count below the chunks asked for)
    return lengths if len(blocks) == 1 else [length for length in lengths for _ in blocks]


def local_sizes(shape: tuple[int, ...], placement: Placement, mesh: MeshSpec) -> list[int]:
    """Each coordinate's local element count, in O(coordinates): only the split dim's length varies."""
    numel = math.prod(shape)
    if placement.kind is Kind.REPLICATED or numel == 0:
        return [numel] * mesh.num_coords
    d, blocks, _ = placement.shard_dim, *_blocks(shape, placement, mesh)
    rest = math.prod(n for i, (_, n) in enumerate(blocks[0]) if i != d)  # a block's elements per row of dim d
    return [rest * length for length in split_lengths(shape, placement, mesh)]


def box_is_empty(box: Box) -> bool:
    return any(length == 0 for _, length in box)


@dataclass(frozen=True)
class _TensorPlan:
    """One tensor's stock placement (what transformers does) and the placement reshard writes."""

    tensor: TargetTensor
    stock: Placement
    planned: Placement

    def boxes(self, mesh: MeshSpec, *, stock: bool = False) -> tuple[Box, ...]:
        return tuple(coordinate_boxes(self.tensor.shape, self.stock if stock else self.planned, mesh))


@dataclass(frozen=True)
class ReshardPlan:
    """The whole plan: the mesh, and per state-dict tensor its stock and planned placements.

    Attributes:
        mesh: the target mesh.
        layout: the model's tensors and their on-disk pieces.
        mode: stock or balanced.
        tensors: one `_TensorPlan` per state-dict tensor, in model order.
        quantization: the source's `reshard.read._quant._Quantization` when the layout is its bf16 view, else None.
        extras: the on-disk tensors the model does not load that `write` keeps, whole, in files no rank loads
            (`layout.extras`, or none with `drop_unloaded`).
    """

    mesh: MeshSpec
    layout: ModelLayout
    mode: LayoutMode
    tensors: tuple[_TensorPlan, ...]
    quantization: object = None
    extras: tuple[TargetTensor, ...] = ()

    @functools.cached_property  # kept on the plan (its own __dict__): the writers ask for its coordinates in turn
    def tensor_kinds(self) -> tuple[list[tuple], list[tuple[TargetTensor, int]]]:
        """The plan's distinct (shape, planned placement, dtype) kinds, and each tensor (in plan order) with its
        kind's index: a coordinate's boxes are computed once per kind, not once per tensor."""
        kinds: dict[tuple, int] = {}
        tensors = [(tp.tensor, kinds.setdefault((tp.tensor.shape, tp.planned, tp.tensor.dtype), len(kinds)))
                   for tp in self.tensors]
        return list(kinds), tensors


def _stock_placement(tensor: TargetTensor, mesh: MeshSpec) -> Placement:
    if not tensor.is_param or not tensor.shape:
        return Placement(Kind.REPLICATED)
    if tensor.role is Role.EXPERT and mesh.ep > 1:
        return Placement(Kind.EXPERT, 0, mesh.efsdp, mesh.ep)
    return Placement(Kind.DENSE, 0, mesh.fsdp)


def _planned_placement(stock: Placement, tensor: TargetTensor, mode: LayoutMode) -> Placement:
    if mode is LayoutMode.STOCK or tensor.role is not Role.EXPERT or stock.kind is Kind.REPLICATED:
        return stock
    rows = tensor.shape[0] // stock.ep
    if rows % stock.degree == 0:
        return stock  # dim 0 already splits evenly: keep what stock transformers loads unpatched
    for d in range(1, len(tensor.shape)):
        if tensor.shape[d] % stock.degree == 0:
            return Placement(stock.kind, d, stock.degree, stock.ep)
    return stock  # nothing divides: dim-0 chunks with explicit empty markers


def make_plan(layout: ModelLayout, mesh: MeshSpec, *, mode: LayoutMode | str = LayoutMode.BALANCED,
              quantization=None, drop_unloaded: bool = False) -> ReshardPlan:
    """Plan every tensor of `layout` on `mesh`.

    Args:
        layout: from `find_experts`.
        mesh: the target mesh.
        mode: `balanced` (default) or `stock`.
        quantization: the source's quantization, when `layout` is of its bf16 view (reported, not planned on).
        drop_unloaded: leave out the tensors the model does not load (`layout.extras`); by default they are kept.

    Returns:
        A frozen `ReshardPlan`.

    Raises:
        MeshError: ep > 1 but the model has no experts, or an expert count is not divisible by ep.

    Example:
        >>> plan = make_plan(layout, MeshSpec(fsdp=64, ep=8))  # doctest: +SKIP
    """
    mode = LayoutMode(mode)
    experts = layout.experts
    if mesh.ep > 1 and not experts:
        raise MeshError(f"--ep {mesh.ep}: {layout.model_type} has no expert-parallel tensors; use --ep 1.")
    if mesh.ep > 1 and not layout.expert_parallel:
        raise MeshError(f"--ep {mesh.ep}: transformers has no expert-parallel plan for {layout.model_type} (its "
                        "experts are sharded by FSDP only); use --ep 1.")
    for tensor in experts:
        if mesh.ep > 1 and tensor.shape[0] % mesh.ep:
            raise MeshError(f"{tensor.name}: num_experts ({tensor.shape[0]}) is not divisible by ep ({mesh.ep}); "
                            "transformers' expert parallelism needs whole experts per EP rank. Pick an ep that "
                            f"divides {tensor.shape[0]}.")
    plans = []
    for tensor in layout.tensors:
        stock = _stock_placement(tensor, mesh)
        plans.append(_TensorPlan(tensor, stock, _planned_placement(stock, tensor, mode)))
    return ReshardPlan(mesh, layout, mode, tuple(plans), quantization, () if drop_unloaded else layout.extras)


# ---- summaries for humans and --json ---------------------------------------------------------------------------

_LAYER = re.compile(r"\.(\d+)\.")


def family_of(name: str) -> str:
    """A tensor's family: its name with layer / block numbers replaced by `*`."""
    return _LAYER.sub(".*.", _LAYER.sub(".*.", name))


@dataclass(frozen=True)
class FamilySummary:
    pattern: str
    role: Role
    count: int
    shape: tuple[int, ...]
    dtype: str
    stock: Placement
    planned: Placement
    stock_rows: tuple[int, ...]  # local length on the split dim, per fsdp coordinate
    planned_rows: tuple[int, ...]

    @property
    def stock_empty(self) -> tuple[int, ...]:
        if self.stock.kind is Kind.REPLICATED:
            return ()
        return tuple(i for i, n in enumerate(self.stock_rows) if n == 0)

    @property
    def planned_empty(self) -> tuple[int, ...]:
        if self.planned.kind is Kind.REPLICATED:
            return ()
        return tuple(i for i, n in enumerate(self.planned_rows) if n == 0)


def _rows(plan: _TensorPlan, mesh: MeshSpec, stock: bool) -> tuple[int, ...]:
    return tuple(split_lengths(plan.tensor.shape, plan.stock if stock else plan.planned, mesh))


def expert_bytes_per_rank(plan: ReshardPlan) -> tuple[list[int], list[int]]:
    """Routed-expert bytes each fsdp coordinate holds: (stock transformers', the plan's). O(tensors + kinds x
    coordinates): tensors of one (shape, placement, dtype) hold the same bytes everywhere, so each kind is sized
    once and counted."""
    sides = []
    for stock in (True, False):
        kinds: dict[tuple, int] = {}
        for tp in plan.tensors:
            if tp.tensor.role is Role.EXPERT:
                key = (tp.tensor.shape, tp.stock if stock else tp.planned, tp.tensor.dtype)
                kinds[key] = kinds.get(key, 0) + 1
        per_coord = [0] * plan.mesh.num_coords
        for (shape, placement, dtype), count in kinds.items():
            scale = count * DTYPE_BITS[dtype] // 8
            per_coord = [total + scale * n for total, n in zip(per_coord, local_sizes(shape, placement, plan.mesh))]
        sides.append(per_coord)
    return sides[0], sides[1]


def summarize(plan: ReshardPlan) -> tuple[list[FamilySummary], dict]:
    """Group tensors into families and compute the stock-vs-planned figures `reshard plan` prints."""
    mesh = plan.mesh
    families: dict[tuple, FamilySummary] = {}
    counts: dict[tuple, int] = {}
    stock_bytes, planned_bytes = expert_bytes_per_rank(plan)
    empty = {"stock_tensors": 0, "planned_tensors": 0, "stock_ranks": set(), "planned_ranks": set(),
             "stock_expert_tensors": 0, "planned_expert_tensors": 0}
    for tp in plan.tensors:
        t = tp.tensor
        key = (family_of(t.name), t.shape, t.dtype, tp.stock, tp.planned, t.role)
        counts[key] = counts.get(key, 0) + 1
        if key not in families:  # a family's rows are computed once: O(families x coordinates), not tensors x
            families[key] = FamilySummary(key[0], t.role, 0, t.shape, t.dtype, tp.stock, tp.planned,
                                          _rows(tp, mesh, True), _rows(tp, mesh, False))
    out = [dataclasses.replace(f, count=counts[k]) for k, f in families.items()]
    for fam in out:
        for side, ranks in (("stock", fam.stock_empty), ("planned", fam.planned_empty)):
            if ranks:
                empty[f"{side}_tensors"] += fam.count
                empty[f"{side}_expert_tensors"] += fam.count if fam.role is Role.EXPERT else 0
                empty[f"{side}_ranks"].update(ranks)

    def ratio(values):
        mean = sum(values) / len(values)
        return max(values) / mean if mean else 1.0

    stats = {
        "tensors": len(plan.tensors),
        "expert_tensors": sum(1 for tp in plan.tensors if tp.tensor.role is Role.EXPERT),
        "stock_empty_tensors": empty["stock_tensors"],
        "stock_empty_expert_tensors": empty["stock_expert_tensors"],
        "stock_empty_ranks": sorted(empty["stock_ranks"]),
        "planned_empty_tensors": empty["planned_tensors"],
        "planned_empty_expert_tensors": empty["planned_expert_tensors"],
        "planned_empty_ranks": sorted(empty["planned_ranks"]),
        "stock_expert_bytes_max": max(stock_bytes),
        "stock_expert_bytes_mean": sum(stock_bytes) / len(stock_bytes),
        "stock_expert_max_over_mean": ratio(stock_bytes),
        "planned_expert_bytes_max": max(planned_bytes),
        "planned_expert_bytes_mean": sum(planned_bytes) / len(planned_bytes),
        "planned_expert_max_over_mean": ratio(planned_bytes),
    }
    return out, stats
