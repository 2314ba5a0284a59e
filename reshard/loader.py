"""`reshard.from_pretrained`: load a reshard folder on every rank of a torchrun job, or whole in one process."""

from __future__ import annotations

import os
from pathlib import Path

from .errors import LoadError, ReshardError
from .local_read import gather, raise_if_any, torch_dtype
from .manifest import Manifest, read_manifest
from .patch import active_manifest, patch_transformers, unpatch_transformers  # noqa: F401  (re-exported)


def _model_class(manifest: Manifest, model_class):
    if model_class is not None:
        return model_class
    import transformers

    return getattr(transformers, manifest.data["source"].get("architecture") or "", None) or \
        transformers.AutoModelForCausalLM


def _check_own_files(manifest: Manifest, rank: int) -> str | None:
    """Check the files this rank reads exist with the size and a valid header; a problem description or None.

    Their CRC-32 is checked while they are read (`local_read`), not here: that would read them twice.
    """
    from .checkpoint import read_header

    sizes = {f["name"]: f["bytes"] for f in manifest.files}
    for name in manifest.files_of_rank(rank):
        path = manifest.path / name
        if not path.exists():
            return f"{name} is missing"
        if path.stat().st_size != sizes[name]:
            return f"{name} has {path.stat().st_size} bytes, the manifest says {sizes[name]}"
        try:
            read_header(path)
        except ReshardError as e:
            return str(e)
    return None


def from_pretrained(folder: str | os.PathLike, model_class=None, *, distributed_config=None,
                    check_checksums: bool = True, **kwargs):
    """Load a folder written by `reshard write`.

    In a `torchrun` job (a default process group is initialized), every rank reads only its own files: the mesh
    comes from the manifest (or `distributed_config`, which must match it), each rank first validates its files
    and all ranks agree before loading, so a missing or corrupt shard is an error on every rank, not a hang.
    Without a process group the whole model is assembled in this process (for evaluation or inspection).

    Args:
        folder: the output of `reshard write`.
        model_class: a transformers model class (default: the architecture recorded in the manifest).
        distributed_config: a `DistributedConfig`; built from the manifest when omitted.
        check_checksums: verify the CRC-32 of this rank's files (computed over the bytes as they are read).
        **kwargs: passed to `model_class.from_pretrained`.

    Returns:
        The model.

    Raises:
        LoadError: the world size or mesh does not match the manifest, or some rank's files are bad.

    Example:
        >>> model = reshard.from_pretrained("glm-ep8-fsdp64")  # doctest: +SKIP  (inside torchrun, 64 ranks)
    """
    import torch.distributed as dist

    folder = Path(folder)
    manifest = read_manifest(folder)
    model_class = _model_class(manifest, model_class)
    patch_transformers()
    if not (dist.is_available() and dist.is_initialized()):
        return _load_whole(folder, manifest, model_class, **kwargs)

    from transformers.distributed import DistributedConfig

    mesh = manifest.mesh
    world = dist.get_world_size()
    if world != mesh.world_size:
        raise LoadError(f"{folder} was written for {mesh.world_size} ranks ({mesh.describe()}) but this job has "
                        f"{world}. Launch with --nproc-per-node/--nnodes giving {mesh.world_size} ranks, or "
                        f"write the checkpoint again for this mesh.")
    expected = mesh.distributed_config_kwargs()
    if distributed_config is None:
        distributed_config = DistributedConfig(**expected)
    else:
        given = {k: getattr(distributed_config, k) for k in ("fsdp_size", "ep_size", "dp_replicate_size",
                                                               "tp_size", "pp_size")}
        wanted = {"fsdp_size": mesh.fsdp, "ep_size": mesh.ep, "dp_replicate_size": mesh.dp_replicate,
                  "tp_size": mesh.tp, "pp_size": mesh.pp}
        if given != wanted:
            raise LoadError(f"distributed_config {given} does not match the mesh {folder} was written for "
                            f"({wanted}). Pass {mesh.distributed_config_repr()} or omit distributed_config.")
    raise_if_any(gather(_check_own_files(manifest, dist.get_rank())))
    with active_manifest(manifest.data, checksums=check_checksums):
        return model_class.from_pretrained(folder, distributed_config=distributed_config, **kwargs)


def assemble_state_dict(folder: str | os.PathLike) -> dict:
    """Full tensors from a reshard folder, in one process: each chunk placed at its offsets.

    Raises:
        VerifyError: the manifest is missing or unreadable.
    """
    import torch
    from safetensors import safe_open

    manifest = read_manifest(folder)
    out = {}
    for name, info in manifest.data["tensors"].items():
        dtype = torch_dtype(info["dtype"])
        if dtype is None:
            raise LoadError(f"{name} is {info['dtype']}, a safetensors dtype this loader cannot assemble in torch.")
        out[name] = torch.empty(info["shape"], dtype=dtype)
    for entry in manifest.files:
        with safe_open(manifest.path / entry["name"], framework="pt") as f:
            for name, info in entry["tensors"].items():
                if 0 in info["shape"]:
                    continue
                region = tuple(slice(o, o + n) for o, n in zip(info["offsets"], info["shape"]))
                out[name][region] = f.get_tensor(name)
    return out


def _load_whole(folder: Path, manifest: Manifest, model_class, **kwargs):
    from transformers import AutoConfig

    config = kwargs.pop("config", None) or AutoConfig.from_pretrained(folder)
    with active_manifest(manifest.data):
        return model_class.from_pretrained(None, config=config, state_dict=assemble_state_dict(folder), **kwargs)
