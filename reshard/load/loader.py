"""`reshard.from_pretrained`: load a reshard folder on every rank of a torchrun job, or whole in one process.

Before a distributed load, every rank makes its checks and all ranks agree on the outcome (`agreement`), so either
every rank raises the same `LoadError` or every rank loads. The launcher's environment and the process group come
from `reshard.launch`.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import LoadError, ReshardError, VerifyError
from ..launch import group_exists, group_owned, in_distributed_job
from ..manifest import Manifest, coverage_problems, file_crc32, header_problems, member_problem, read_manifest
from ..read.checkpoint import read_header, torch_dtype
from .agreement import agree_to_load, check_copied
from .patch import active_manifest, install, uninstall_unless_user


def _model_class(manifest: Manifest, model_class):
    if model_class is not None:
        return model_class
    import transformers

    return getattr(transformers, manifest.data["source"].get("architecture") or "", None) or \
        transformers.AutoModelForCausalLM


def from_pretrained(folder: str | os.PathLike, model_class=None, *, distributed_config=None,
                    check_checksums: bool = True, **kwargs):
    """Load a folder written by `reshard write`.

    In a multi-rank job every rank reads only its own files, with the mesh from the manifest (or
    `distributed_config`, which must match it). The process group is the one you initialized, or, when there is none
    and the process was started by torchrun (RANK, LOCAL_RANK, WORLD_SIZE > 1 set), one created the way transformers
    does it. Every rank first checks the manifest, the world size and its own files, and all ranks agree before
    loading, so a missing or corrupt shard on one rank is an error on every rank, not a hang. With no launcher
    environment (or WORLD_SIZE 1) the whole model is assembled in this process (for evaluation or inspection).

    The loader patch is installed for the call and removed when it returns, unless you installed it yourself with
    `reshard.patch_transformers()`.

    Args:
        folder: the output of `reshard write`.
        model_class: a transformers model class (default: the architecture recorded in the manifest).
        distributed_config: a `DistributedConfig`; built from the manifest when omitted.
        check_checksums: verify the CRC-32 of the files read (computed over the bytes as they are read).
        **kwargs: passed to `model_class.from_pretrained`.

    Returns:
        The model.

    Raises:
        LoadError: the world size or mesh does not match the manifest, or some rank's files are bad (on every rank).

    Example:
        >>> model = reshard.from_pretrained("glm-ep8-fsdp64")  # doctest: +SKIP  (inside torchrun, 64 ranks)
    """
    folder = Path(folder)
    installed_here = install()
    had_group = group_exists()
    try:
        if not in_distributed_job():
            manifest = read_manifest(folder)
            return _load_whole(folder, manifest, _model_class(manifest, model_class),
                               check_checksums=check_checksums, **kwargs)
        with group_owned(created=not had_group):
            manifest, distributed_config = agree_to_load(folder, distributed_config,
                                                         need_config=kwargs.get("config") is None)
            with active_manifest(manifest.data, checksums=check_checksums):
                return _model_class(manifest, model_class).from_pretrained(
                    folder, distributed_config=distributed_config, **kwargs)
    finally:
        if installed_here:
            uninstall_unless_user()


def assemble_state_dict(folder: str | os.PathLike, *, check_checksums: bool = True) -> dict:
    """Full tensors from a reshard folder, in one process: each chunk placed at its offsets.

    Before any tensor is built, the chunks the manifest lists must cover every tensor exactly (a gap would otherwise
    be uninitialized memory) and, with `check_checksums`, every file must match its CRC-32.

    Raises:
        LoadError: the manifest is missing or unreadable, a tensor is not covered, or a file is missing or corrupt.
    """
    import torch
    from safetensors import safe_open

    try:
        manifest = read_manifest(folder)
    except VerifyError as e:
        raise LoadError("; ".join(e.problems)) from e
    problems = coverage_problems(manifest.data)
    for entry in manifest.files:
        path = manifest.path / entry.name
        if problem := member_problem(manifest.path, entry.name):  # a FIFO or a device is never read
            problems.append(problem)
            continue
        try:
            if check_checksums and (crc := file_crc32(path)) != entry.crc32:
                problems.append(f"{entry.name} is corrupt (CRC-32 {crc}, the manifest says {entry.crc32})")
            problems += header_problems(entry, manifest.chunks(entry), read_header(path))
        except OSError as e:
            problems.append(f"{entry.name} cannot be read ({e.strerror or e})")
        except ReshardError as e:  # a header that does not parse
            problems.append(str(e))
    if problems:
        raise LoadError(f"{manifest.path} cannot be loaded: {'; '.join(problems)}. Run `reshard verify` on it, or "
                        "write it again.")
    out = {}
    for name, info in manifest.data["tensors"].items():
        dtype = torch_dtype(info["dtype"])
        if dtype is None:
            raise LoadError(f"{name} is {info['dtype']}, a safetensors dtype this loader cannot assemble in torch.")
        out[name] = torch.empty(info["shape"], dtype=dtype)
    replicated_done = set()  # every coordinate holds a copy: read one
    for entry in manifest.files:
        with safe_open(manifest.path / entry.name, framework="pt") as f:
            for chunk in manifest.chunks(entry):
                if chunk.is_empty or chunk.name in replicated_done:
                    continue
                if manifest.data["tensors"][chunk.name]["placement"]["kind"] == "replicated":
                    replicated_done.add(chunk.name)
                region = tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.shape))
                out[chunk.name][region] = f.get_tensor(chunk.name)
    return out


def _load_whole(folder: Path, manifest: Manifest, model_class, *, check_checksums: bool = True, **kwargs):
    from transformers import AutoConfig

    check_copied(manifest, need_config=kwargs.get("config") is None)  # before transformers opens any of them
    config = kwargs.pop("config", None) or AutoConfig.from_pretrained(folder)
    state_dict = assemble_state_dict(folder, check_checksums=check_checksums)
    with active_manifest(manifest.data):
        return model_class.from_pretrained(None, config=config, state_dict=state_dict, **kwargs)
