"""reshard: plan, write and load MoE checkpoints on FSDP2 x expert-parallel meshes.

Importing the package is cheap (no torch); each public name is imported from its module on first use.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "MeshSpec": "mesh",
    "read_checkpoint": "checkpoint",
    "find_experts": "experts",
    "make_plan": "plan",
    "plan_checkpoint": "api",
    "write_shards": "write",
    "verify": "verification",
    "merge_checkpoint": "merge",
    "Manifest": "manifest",
    "read_manifest": "manifest",
    "from_pretrained": "loader",
    "patch_transformers": "loader",
    "unpatch_transformers": "loader",
    "StorageReader": "storage",
    "shard_placement_fn": "storage",
    "materialize_meta_": "materialize",
    "meta_only_to_empty": "materialize",
    "patch_to_empty": "materialize",
    "unpatch_to_empty": "materialize",
    "patch_megatron_fsdp": "materialize",
    "check_buffers": "materialize",
    "MaterializeReport": "materialize",
    "ReshardError": "errors",
    "CheckpointError": "errors",
    "MeshError": "errors",
    "ArchitectureError": "errors",
    "OutputError": "errors",
    "VerifyError": "errors",
    "LoadError": "errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'reshard' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
