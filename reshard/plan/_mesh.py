"""The target device mesh, mirroring transformers' `DistributedConfig`.

Rank layout (transformers 5.23, `distributed/utils.py`): the dense mesh is `(pp, dp_replicate, fsdp, tp)` and the
expert mesh `(pp, dp_replicate, efsdp, ep)`, `ep` innermost, so an EP group is a run of contiguous ranks. With
`tp = pp = 1` a rank's dense coordinate is `fsdp_index = rank % fsdp`, and the same index splits into
`(efsdp_index, ep_index) = divmod(fsdp_index, ep)`:

    --fsdp 4 --ep 2      rank:      0  1  2  3
                         fsdp:      0  1  2  3
                         efsdp:     0  0  1  1
                         ep:        0  1  0  1
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from ..errors import MeshError

# The largest job reshard plans, writes and loads for. Every step is linear in fsdp coordinates (files), and the
# manifest does not list ranks; the bound refuses a mistyped size before anything is sized by it.
_MAX_WORLD_SIZE = 65_536


class Axis(str, Enum):
    """Mesh axis names, as transformers names its device-mesh dims."""

    DP_REPLICATE = "dp_replicate"
    FSDP = "fsdp"
    EFSDP = "efsdp"
    EP = "ep"
    TP = "tp"
    PP = "pp"


@dataclass(frozen=True)
class MeshSpec:
    """A device mesh as `transformers.distributed.DistributedConfig` describes it.

    Args:
        fsdp: `fsdp_size`, ranks that shard every parameter (dense on `fsdp`, experts on `efsdp x ep`).
        ep: `ep_size`, expert-parallel ranks; must divide `fsdp * tp` and the expert count.
        dp_replicate: `dp_replicate_size`, HSDP replicas (each replica holds the same shards).
        tp: `tp_size`; only 1 is supported by reshard's layouts so far.
        pp: `pp_size`; only 1 is supported by reshard's layouts so far.

    Raises:
        MeshError: a size is below 1, the world size is over `_MAX_WORLD_SIZE`, the sizes do not fit together, or
            tp/pp > 1.

    Example:
        >>> MeshSpec(fsdp=64, ep=8).efsdp
        8
    """

    fsdp: int = 1
    ep: int = 1
    dp_replicate: int = 1
    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        for name in ("fsdp", "ep", "dp_replicate", "tp", "pp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise MeshError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}.")
        if self.world_size > _MAX_WORLD_SIZE:
            raise MeshError(
                f"a world size of {self.world_size:,} ranks (pp {self.pp} x dp_replicate {self.dp_replicate} x fsdp "
                f"{self.fsdp} x tp {self.tp}) is over the {_MAX_WORLD_SIZE:,} ranks reshard supports; pick mesh sizes "
                f"whose product is at most {_MAX_WORLD_SIZE:,}. Nothing was changed."
            )
        if self.tp > 1 or self.pp > 1:
            raise MeshError(
                f"tp={self.tp}, pp={self.pp}: reshard writes layouts for FSDP and expert parallelism only; "
                "tensor and pipeline parallelism are not supported yet. Use --tp 1 --pp 1."
            )
        if self.ep % self.tp:
            raise MeshError(f"ep ({self.ep}) must be divisible by tp ({self.tp}), as DistributedConfig requires.")
        if (self.fsdp * self.tp) % self.ep:
            raise MeshError(
                f"fsdp ({self.fsdp * self.tp}) is not divisible by ep ({self.ep}): every group of ep ranks must be "
                "whole. Pick an ep that divides fsdp: 64 ranks in 8 expert-parallel groups of 8 is --fsdp 64 --ep 8."
            )

    @property
    def efsdp(self) -> int:
        """Ranks sharding each expert inside one EP group: `fsdp * tp / ep`."""
        return self.fsdp * self.tp // self.ep

    @property
    def world_size(self) -> int:
        """Processes in the job: `pp * dp_replicate * fsdp * tp`."""
        return self.pp * self.dp_replicate * self.fsdp * self.tp

    @property
    def num_coords(self) -> int:
        """How many coordinates (file groups) the mesh has: ranks of different replicas share a coordinate's files."""
        return self.fsdp

    def coords_of(self, spans) -> list[int]:
        """The coordinates the ranks of `spans` (inclusive `(first, last)` pairs) read, sorted; linear in spans and
        coordinates, never in ranks (a span of a whole replica covers every coordinate)."""
        found: set[int] = set()
        for first, last in spans:
            if last - first + 1 >= self.fsdp:
                return list(range(self.fsdp))
            found.update(r % self.fsdp for r in range(first, last + 1))
        return sorted(found)

    def coord_ranks(self, coord: int) -> range:
        """The global ranks that read coordinate `coord`'s files, one per replica (`r * fsdp + coord`): derived, never
        listed, so nothing grows with dp_replicate."""
        return range(coord, self.world_size, self.fsdp)

    def coord_of(self, rank: int) -> int:
        """The coordinate of a global rank (its fsdp index); ranks of different replicas may share one."""
        if not 0 <= rank < self.world_size:
            raise MeshError(f"rank {rank} is outside the mesh of {self.world_size} ranks.")
        return rank % self.fsdp

    def expert_coords(self, coord: int) -> tuple[int, int]:
        """`(efsdp_index, ep_index)` of an fsdp coordinate: EP is innermost."""
        return divmod(coord, self.ep)

    def distributed_config_kwargs(self) -> dict[str, int]:
        """Keyword arguments for `transformers.distributed.DistributedConfig` that build this mesh."""
        kwargs = {"fsdp_size": self.fsdp}
        if self.ep > 1:
            kwargs["ep_size"] = self.ep
        if self.dp_replicate > 1:
            kwargs["dp_replicate_size"] = self.dp_replicate
        return kwargs

    def distributed_config_repr(self) -> str:
        """The exact `DistributedConfig(...)` call to pass to `from_pretrained`."""
        args = ", ".join(f"{k}={v}" for k, v in self.distributed_config_kwargs().items())
        return f"DistributedConfig({args})"

    def describe(self) -> str:
        """One line with every number of the mesh."""
        text = f"world {self.world_size} = dp_replicate {self.dp_replicate} x fsdp {self.fsdp}"
        if self.ep > 1:
            text += f"; experts: efsdp {self.efsdp} x ep {self.ep} ({self.ep} contiguous ranks per EP group)"
        return text

    def flags(self) -> str:
        """The mesh as the command line gives it: `--fsdp 64 --ep 8` (the flags left at 1 left out, but --fsdp)."""
        given = {"--fsdp": self.fsdp, "--ep": self.ep, "--dp-replicate": self.dp_replicate}
        return " ".join(f"{flag} {v}" for flag, v in given.items() if v != 1 or flag == "--fsdp")

    def to_dict(self) -> dict[str, int]:
        return {"fsdp": self.fsdp, "ep": self.ep, "dp_replicate": self.dp_replicate, "tp": self.tp, "pp": self.pp}


def ranks_text(ranks: range) -> str:
    """`rank 3`, `ranks 3, 7`, `ranks 3, 7, ..., 131075 (32768 ranks, 4 apart)`: a coordinate's ranks without listing
    them all."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if len(ranks) <= 4:
        return "ranks " + ", ".join(map(str, ranks))
    return f"ranks {ranks[0]}, {ranks[1]}, ..., {ranks[-1]} ({len(ranks)} ranks, {ranks.step} apart)"
