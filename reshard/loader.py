"""`reshard.from_pretrained`: load a reshard folder on every rank of a torchrun job, or whole in one process."""

from __future__ import annotations

import os
import zlib
from pathlib import Path

from .errors import LoadError, ReshardError
from .manifest import Manifest, read_manifest
from .patch import active_manifest, patch_transformers, unpatch_transformers  # noqa: F401  (re-exported)


def _model_class(manifest: Manifest, model_class):
    if model_class is not None:
        return model_class
    import transformers

    return getattr(transformers, manifest.data["source"].get("architecture") or "", None) or \
        transformers.AutoModelForCausalLM


def _check_own_files(manifest: Manifest, rank: int, *, checksums: bool) -> str | None:
    """Validate the files this rank reads; return a problem description or None."""
    from .checkpoint import read_header

    wanted = {f["name"]: f for f in manifest.files}
    for name in manifest.files_of_rank(rank):
        path = manifest.path / name
        entry = wanted[name]
        if not path.exists():
            return f"{name} is missing"
        if path.stat().st_size != entry["bytes"]:
            return f"{name} has {path.stat().st_size} bytes, the manifest says {entry['bytes']}"
        try:
            read_header(path)
        except ReshardError as e:
            return str(e)
        if checksums:
            crc, buffer = 0, bytearray(1 << 20)  # one reused buffer: fresh 16 MiB blocks cost page faults
            view = memoryview(buffer)
            with open(path, "rb", buffering=0) as f:
                while n := f.readinto(buffer):
                    crc = zlib.crc32(view[:n], crc)
            if f"{crc:08x}" != entry["crc32"]:
                return f"{name} is corrupt (CRC-32 {crc:08x}, the manifest says {entry['crc32']})"
    return None


def _agree(problem: str | None) -> None:
    """Every rank learns every rank's problem, so all of them raise together instead of one hanging."""
    import torch.distributed as dist

    problems: list = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    failed = [(r, p) for r, p in enumerate(problems) if p]
    if failed:
        detail = "; ".join(f"rank {r}: {p}" for r, p in failed)
        raise LoadError(f"{len(failed)} rank(s) cannot load their shard ({detail}). Every rank stops here. "
                        "Run `reshard verify` on the folder, or write it again.")


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
        check_checksums: verify this rank's files' CRC-32 before loading (reads them once more).
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
    _agree(_check_own_files(manifest, dist.get_rank(), checksums=check_checksums))
    with active_manifest(manifest.data):
        return model_class.from_pretrained(folder, distributed_config=distributed_config, **kwargs)


def assemble_state_dict(folder: str | os.PathLike) -> dict:
    """Full tensors from a reshard folder, in one process: each chunk placed at its offsets.

    Raises:
        VerifyError: the manifest is missing or unreadable.
    """
    import torch
    from safetensors import safe_open

    manifest = read_manifest(folder)
    dtypes = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
    out = {name: torch.empty(info["shape"], dtype=dtypes[info["dtype"]])
           for name, info in manifest.data["tensors"].items()}
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
