"""reshard: plan, write and load MoE checkpoints on FSDP2 x expert-parallel meshes.

Importing the package is cheap (no torch); each public name is imported from its module on first use.
"""

from __future__ import annotations

from .exports import lazy_exports

__version__ = "0.1.0"

_EXPORTS = {
    "MeshSpec": "plan",
    "open_source": "read",
    "find_experts": "read",
    "make_plan": "plan",
    "plan_checkpoint": "api",
    "write_checkpoint": "api",
    "verify": "api",
    "verify_folder": "api",
    "list_files": "api",
    "merge_checkpoint": "api",
    "Manifest": "manifest",
    "read_manifest": "api",
    "from_pretrained": "load",
    "patch_transformers": "load",
    "unpatch_transformers": "load",
    "StorageReader": "load",
    "shard_placement_fn": "load",
    "materialize_meta_": "load",
    "meta_only_to_empty": "load",
    "patch_to_empty": "load",
    "unpatch_to_empty": "load",
    "patch_megatron_fsdp": "load",
    "check_buffers": "load",
    "MaterializeReport": "load",
    "ReshardError": "errors",
    "CheckpointError": "errors",
    "MeshError": "errors",
    "ArchitectureError": "errors",
    "OutputError": "errors",
    "VerifyError": "errors",
    "LoadError": "errors",
    "ManifestError": "errors",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
