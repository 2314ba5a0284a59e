"""`reshard.from_pretrained`: load a reshard folder on every rank of a torchrun job, or whole in one process.

Before a distributed load, every check a rank makes (the manifest, the world size, the mesh, its own files) is
caught and gathered in one collective, so either every rank raises the same `LoadError`, naming each failing rank,
or every rank loads: no rank can fail alone while the others wait in a collective (under srun or mpirun no agent
would kill them).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

from ..errors import LoadError, ReshardError, VerifyError
from ..manifest import (MANIFEST_NAME, Manifest, coverage_problems, file_crc32, header_problems, member_problem,
                        read_manifest)
from ..read.checkpoint import read_header, torch_dtype
from .local_read import gather, raise_if_any
from .patch import (active_manifest, install, patch_transformers,  # noqa: F401  (re-exported)
                    uninstall_unless_user, unpatch_transformers)

_LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE")
_MESH_FIELDS = ("fsdp_size", "ep_size", "dp_replicate_size", "tp_size", "pp_size")


def launcher_world_size() -> int | None:
    """The WORLD_SIZE a launcher (torchrun, or srun/mpirun setting the same variables) gave this process, or None."""
    if not all(v in os.environ for v in _LAUNCHER_VARIABLES):
        return None
    try:
        return int(os.environ["WORLD_SIZE"])
    except ValueError:
        return None


def in_distributed_job() -> bool:
    """True when this process is one rank of a multi-rank job, initializing the default process group from the
    launcher's environment the way transformers does (nccl bound to LOCAL_RANK on CUDA, gloo on CPU) if needed.

    False (the whole-model path) only when no group exists and there is no launcher environment, or WORLD_SIZE is 1.

    Raises:
        LoadError: the launcher environment is there but the process group cannot be created.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return True
    world = launcher_world_size()
    if world is None or world <= 1:
        return False
    from transformers.distributed.utils import _ensure_torch_distributed

    try:
        _ensure_torch_distributed()
    except OSError as e:
        raise LoadError(f"RANK/WORLD_SIZE say this is rank {os.environ['RANK']} of {world}, but the process group "
                        f"could not be created ({e.__cause__ or e}). Check MASTER_ADDR/MASTER_PORT, or call "
                        "torch.distributed.init_process_group yourself first.") from e
    return True


def has_shard_files(folder: Path) -> bool:
    """Whether `folder` looks like a distributed checkpoint (shard files by transformers' naming)."""
    return folder.is_dir() and any(folder.glob("shard-*-model-*-of-*.safetensors"))


def _model_class(manifest: Manifest, model_class):
    if model_class is not None:
        return model_class
    import transformers

    return getattr(transformers, manifest.data["source"].get("architecture") or "", None) or \
        transformers.AutoModelForCausalLM


def _check_own_files(manifest: Manifest, rank: int) -> str | None:
    """Check the files this rank reads exist, are regular files and readable, with the size and a header that
    holds what the manifest says (names, dtypes, shapes, offsets); a problem or None.

    Their CRC-32 is checked while they are read (`local_read`), not here: that would read them twice.
    """
    for name in manifest.files_of_rank(rank):
        entry, path = manifest.file_entry(name), manifest.path / name
        if problem := member_problem(manifest.path, name):  # opens it: an unreadable one (permissions) fails here
            return problem
        size = path.stat().st_size
        if size != entry.bytes:
            return f"{name} has {size} bytes, the manifest says {entry.bytes}"
        try:
            problems = header_problems(entry, manifest.chunks(entry), read_header(path))
        except (ReshardError, OSError) as e:
            return str(e)
        if problems:
            return "; ".join(problems)
    return None


def _config_mismatch(distributed_config, manifest: Manifest) -> str | None:
    mesh = manifest.mesh
    given = {k: getattr(distributed_config, k) for k in _MESH_FIELDS}
    wanted = {"fsdp_size": mesh.fsdp, "ep_size": mesh.ep, "dp_replicate_size": mesh.dp_replicate,
              "tp_size": mesh.tp, "pp_size": mesh.pp}
    if given == wanted:
        return None
    return (f"distributed_config {given} does not match the mesh {manifest.path} was written for ({wanted}). "
            f"Pass {mesh.distributed_config_repr()} or omit distributed_config.")


def _local_checks(folder: Path, distributed_config, rank: int, world: int, *, require_manifest: bool):
    """This rank's view before loading: (has a manifest, the manifest or None, a problem or None). Never raises."""
    if not require_manifest and not (folder / MANIFEST_NAME).is_file():
        return False, None, None
    try:
        manifest = read_manifest(folder)
    except VerifyError as e:
        return False, None, "; ".join(e.problems)
    except Exception as e:  # noqa: BLE001  raising here alone would leave the other ranks in the gather
        return False, None, f"{MANIFEST_NAME}: {type(e).__name__}: {e}"
    try:
        mesh = manifest.mesh
        if world != mesh.world_size:
            return True, manifest, (f"{folder} was written for {mesh.world_size} ranks ({mesh.describe()}) but this "
                                    f"job has {world}. Launch with --nproc-per-node/--nnodes giving "
                                    f"{mesh.world_size} ranks, or write the checkpoint again for this mesh.")
        if distributed_config is not None and (mismatch := _config_mismatch(distributed_config, manifest)):
            return True, manifest, mismatch
        return True, manifest, _check_own_files(manifest, rank)
    except Exception as e:  # noqa: BLE001
        return True, manifest, f"{type(e).__name__}: {e}"


def agree_to_load(folder: str | os.PathLike, distributed_config=None, *, require_manifest: bool = True):
    """Make every pre-load check on every rank and agree on the outcome in one collective.

    Args:
        folder: the folder every rank is about to load.
        distributed_config: the `DistributedConfig` the caller passed, or None to take the manifest's.
        require_manifest: a folder without `reshard.json` is an error (`reshard.from_pretrained`); when False
            (transformers' own `from_pretrained` under the patch), a folder without it on every rank is not a
            reshard folder and None is returned.

    Returns:
        (manifest, distributed_config) on every rank, or None when no rank has a manifest and none is required.

    Raises:
        LoadError: on every rank together, naming each failing rank and its cause.
    """
    import torch.distributed as dist
    from transformers.distributed import DistributedConfig

    folder = Path(folder)
    rank, world = dist.get_rank(), dist.get_world_size()
    has, manifest, problem = _local_checks(folder, distributed_config, rank, world,
                                           require_manifest=require_manifest)
    views = gather((has, problem))
    if not require_manifest and not any(h for h, _ in views):
        return None
    if not require_manifest and not all(h for h, _ in views):
        views = [(h, p or (None if h else f"{folder / MANIFEST_NAME} is missing on this rank, present on others"))
                 for h, p in views]
    raise_if_any([p for _, p in views])
    if distributed_config is None:
        distributed_config = DistributedConfig(**manifest.mesh.distributed_config_kwargs())
    return manifest, distributed_config


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
    had_group = _group_exists()
    try:
        if not in_distributed_job():
            manifest = read_manifest(folder)
            return _load_whole(folder, manifest, _model_class(manifest, model_class),
                               check_checksums=check_checksums, **kwargs)
        with _group_owned(created=not had_group):
            manifest, distributed_config = agree_to_load(folder, distributed_config)
            with active_manifest(manifest.data, checksums=check_checksums):
                return _model_class(manifest, model_class).from_pretrained(
                    folder, distributed_config=distributed_config, **kwargs)
    finally:
        if installed_here:
            uninstall_unless_user()


def _group_exists() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


@contextmanager
def _group_owned(*, created: bool):
    """Around a distributed load: a default process group this call `created` (from the launcher's environment) is
    destroyed on every path. A failed load destroys it at once (every rank raises the agreed `LoadError` together);
    a successful one leaves it to the model, destroyed at interpreter exit. Left to finalization, gloo's threads can
    abort the process after the error was printed ("terminate called without an active exception", exit -6: 2 of
    14 torchrun runs)."""
    if not created:
        yield
        return
    try:
        yield
    except BaseException:
        destroy_own_group()
        raise
    import atexit

    atexit.register(destroy_own_group)


def destroy_own_group() -> None:
    """Destroy the default process group if one is still up (idempotent: atexit may call it after a failure did)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


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

    config = kwargs.pop("config", None) or AutoConfig.from_pretrained(folder)
    state_dict = assemble_state_dict(folder, check_checksums=check_checksums)
    with active_manifest(manifest.data):
        return model_class.from_pretrained(None, config=config, state_dict=state_dict, **kwargs)
