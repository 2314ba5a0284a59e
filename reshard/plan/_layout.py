"""The model's tensors in plain data: in-memory names, shapes, roles, and the on-disk pieces each is built from.

This is the torch-free vocabulary shared by the planner, the writer and the verifier. `reshard.read._experts` fills it
from transformers at the edge; tests can build it by hand.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from enum import Enum


class Role(str, Enum):
    """What a tensor is in the MoE block; only `EXPERT` tensors are expert-sharded."""

    EXPERT = "expert"  # routed experts, stacked on dim 0 in memory, EP-sharded on that dim
    ROUTER = "router"  # the router / gate and its biases: dense
    SHARED_EXPERT = "shared_expert"  # always-on experts: dense
    DENSE = "dense"  # everything else


@dataclass(frozen=True)
class _RoleRule:
    """A tensor whose in-memory name matches `pattern` (`re.search`) has `role`, unless it is a routed expert (the
    model's expert-parallel plan says which are). `seen_in` names the models the row was added for."""

    role: Role
    pattern: str
    seen_in: str


# The first matching row decides; a new model's naming quirk is a row here and a fixture in tests/breadth.py.
ROLE_RULES = (
    _RoleRule(Role.SHARED_EXPERT, r"shared_expert|shared_mlp",
             "DeepSeek-V3, GLM-4.5 (shared_experts), Qwen2-MoE (shared_expert), Granite-MoE-shared (shared_mlp)"),
    _RoleRule(Role.ROUTER, r"(^|\.)(gate|router|moe_statics)(\.|$)",
             "Mixtral, Qwen3-MoE, DeepSeek-V3 (mlp.gate), gpt-oss (router), ERNIE 4.5 (moe_statics)"),
    _RoleRule(Role.ROUTER, r"e_score_correction_bias|expert_bias",
             "DeepSeek-V3, GLM-4.5 (e_score_correction_bias), aux-loss-free routers (expert_bias)"),
)


def role_of(name: str, is_expert: bool) -> Role:
    """The role of in-memory tensor `name`: a routed expert when the model's plan says so, else the first
    `ROLE_RULES` row its name matches, else dense."""
    if is_expert:
        return Role.EXPERT
    return next((rule.role for rule in ROLE_RULES if re.search(rule.pattern, name)), Role.DENSE)


def is_router(name: str) -> bool:
    """Whether `name` is a router tensor by `ROLE_RULES` (a router nested in an `experts` module stays dense)."""
    return role_of(name, False) is Role.ROUTER


class MergeLayout(str, Enum):
    """How `merge` names the tensors it writes (`--layout`); `describe` says it for `--help`. Merge, verify and the
    CLI's choices all take this value."""

    ORIGINAL = "original"  # the source checkpoint's on-disk keys and shapes (per-expert keys split back out)
    FUSED = "fused"  # the model's in-memory names, each tensor whole

    def describe(self) -> str:
        return {MergeLayout.ORIGINAL: "the source's on-disk keys and shapes (per-expert keys split back out)",
                MergeLayout.FUSED: "the model's in-memory names"}[self]


@dataclass(frozen=True)
class Piece:
    """One on-disk tensor placed inside an in-memory tensor.

    Attributes:
        source: the on-disk key.
        offset: where the piece's first element sits in the target, per target dim.
        stacked_dim: the target dim the source lacks (per-expert tensors stacked into one), or None.
    """

    source: str
    offset: tuple[int, ...]
    stacked_dim: int | None = None


@dataclass(frozen=True)
class TargetTensor:
    """An in-memory parameter or persistent buffer and how to build it from the checkpoint.

    Attributes:
        name: the model's state-dict key (fused experts, e.g. `model.layers.0.mlp.experts.gate_up_proj`).
        shape: the global shape.
        dtype: the on-disk safetensors dtype, kept as is.
        role: the tensor's role in the MoE block.
        is_param: False for a persistent buffer (never sharded by FSDP).
        pieces: the on-disk tensors that fill it, covering it exactly once.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    role: Role
    is_param: bool
    pieces: tuple[Piece, ...]

    def piece_shape(self, piece: Piece, source_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The piece's extent in target coordinates (a stacked source gains a length-1 dim)."""
        if piece.stacked_dim is None:
            return tuple(source_shape)
        dims = list(source_shape)
        dims.insert(piece.stacked_dim, 1)
        return tuple(dims)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class ModelLayout:
    """Every tensor the model's state dict holds, as the checkpoint provides it.

    Attributes:
        model_type: `config.json`'s `model_type`.
        architecture: the model class that was built on the meta device.
        tensors: the state-dict entries in model order.
        ignored_sources: on-disk keys the model does not use (e.g. MTP layers transformers drops).
        expert_parallel: whether transformers has an EP plan for the experts (else only ep = 1 is possible).
        extras: the tensors of `ignored_sources`, each whole under its on-disk key (one piece, the key itself, or a
            chunk of an extras file of a reshard folder): what `write` keeps in files no rank loads and `merge`
            writes back (`reshard.write._shards._write_extras`).
        ignore_patterns: the model class's `_keys_to_ignore_on_load_unexpected` (regexes transformers matches with
            `re.search`): which extras transformers drops on purpose (MTP layers) rather than as unexpected keys.
    """

    model_type: str
    architecture: str
    tensors: tuple[TargetTensor, ...]
    ignored_sources: tuple[str, ...] = ()
    expert_parallel: bool = True
    extras: tuple[TargetTensor, ...] = ()
    ignore_patterns: tuple[str, ...] = ()

    @property
    def experts(self) -> tuple[TargetTensor, ...]:
        return tuple(t for t in self.tensors if t.role is Role.EXPERT)

    def by_name(self) -> dict[str, TargetTensor]:
        return {t.name: t for t in self.tensors}


def whole_tensor(key: str, shape: tuple[int, ...], dtype: str, source: str | None = None) -> TargetTensor:
    """An on-disk tensor kept as it is, under its own key (an extra): one piece covering it, from `source`."""
    return TargetTensor(key, tuple(shape), dtype, Role.DENSE, False, (Piece(source or key, (0,) * len(shape)),))


def _tensors_to_list(tensors) -> list:
    return [[t.name, list(t.shape), t.dtype, t.role.value, t.is_param,
             [[p.source, list(p.offset), p.stacked_dim] for p in t.pieces]] for t in tensors]


def _tensors_from_list(rows) -> tuple[TargetTensor, ...]:
    return tuple(TargetTensor(name, tuple(shape), dtype, Role(role), is_param,
                              tuple(Piece(source, tuple(offset), stacked) for source, offset, stacked in pieces))
                 for name, shape, dtype, role, is_param, pieces in rows)


def layout_to_dict(layout: ModelLayout) -> dict:
    """Plain JSON-able form of a layout (for the layout cache)."""
    return {
        "model_type": layout.model_type, "architecture": layout.architecture,
        "ignored_sources": list(layout.ignored_sources), "expert_parallel": layout.expert_parallel,
        "tensors": _tensors_to_list(layout.tensors), "extras": _tensors_to_list(layout.extras),
        "ignore_patterns": list(layout.ignore_patterns),
    }


def layout_from_dict(data: dict) -> ModelLayout:
    """Inverse of `layout_to_dict`."""
    return ModelLayout(data["model_type"], data["architecture"], _tensors_from_list(data["tensors"]),
                       tuple(data["ignored_sources"]), data["expert_parallel"], _tensors_from_list(data["extras"]),
                       tuple(data["ignore_patterns"]))
