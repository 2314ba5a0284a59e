"""`reshard.from_pretrained`: load a reshard folder on every rank of a torchrun job, or whole in one process.

Before a distributed load, every rank makes its checks and all ranks agree on the outcome (`agreement`), so either
every rank raises the same `LoadError` or every rank loads. The launcher's environment and the process group come
from `reshard.launch`.
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path

from ..errors import LoadError, ReshardError
from ..launch import group_exists, group_owned, in_distributed_job, launcher_world_size
from ..manifest import MANIFEST_NAME, Manifest, coverage_problems, header_problems, read_manifest
from ..read import header_of, torch_dtype
from ._agreement import agree_to_load, check_copied
from ._patch import active_manifest, install, uninstall_unless_user
from ._progress import LoadProgress, current, showing, shown_here


def _model_class(manifest: Manifest, model_class):
    if model_class is not None:
        return model_class
    import transformers

    return getattr(transformers, manifest.source.architecture or "", None) or transformers.AutoModelForCausalLM


def from_pretrained(folder: str | os.PathLike, model_class=None, *, distributed_config=None,
                    check_checksums: bool = True, progress: bool | None = None, **kwargs):
    """Load a folder written by `reshard write` (a local folder, a node's own copy, or an `s3://` URL).

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
        progress: show the load's phases on stderr (starting, checked, reading N of M files, materializing, loaded;
            a bar on a terminal). Default: on the first rank of each node (`LOCAL_RANK` 0) only.
        **kwargs: passed to `model_class.from_pretrained`.

    Returns:
        The model.

    Raises:
        LoadError: the world size or mesh does not match the manifest, or some rank's files are bad (on every rank).

    Example:
        >>> model = reshard.from_pretrained("glm-ep8-fsdp64")  # doctest: +SKIP  (inside torchrun, 64 ranks)
    """
    installed_here = install()
    had_group = group_exists()
    shown = LoadProgress(os.fspath(folder), shown=shown_here(progress))
    try:
        with showing(shown):
            if not in_distributed_job():
                shown.phase("starting in one process (the whole model)")
                opened = _opened(folder)
                store, manifest = opened.store, opened.manifest
                model = _load_whole(store, manifest, _model_class(manifest, model_class),
                                    check_checksums=check_checksums, **kwargs)
            else:
                model = _load_distributed(folder, model_class, distributed_config, check_checksums, had_group,
                                          **kwargs)
        shown.phase("loaded")
        return model
    finally:
        if installed_here:
            uninstall_unless_user()


def _load_distributed(folder, model_class, distributed_config, check_checksums: bool, had_group: bool, **kwargs):
    shown = current()
    shown.phase(f"starting on {launcher_world_size()} ranks: every rank checks its files, then all agree")
    with group_owned(created=not had_group):
        agreed = agree_to_load(folder, distributed_config, need_config=kwargs.get("config") is None)
        shown.phase(f"every rank's files checked; building the model on the meta device, sharded for "
                    f"{agreed.manifest.mesh.describe()}")
        with active_manifest(agreed.manifest, agreed.store, checksums=check_checksums), \
                _local_folder(agreed.store, agreed.manifest) as local:
            return _model_class(agreed.manifest, model_class).from_pretrained(
                local, distributed_config=agreed.distributed_config, **kwargs)


def _opened(folder):
    """The folder opened once (`reshard.read.open_folder`): a ManifestError is a LoadError already, any other
    error becomes one."""
    from ..read import open_folder

    try:
        return open_folder(folder)
    except LoadError:
        raise
    except ReshardError as e:
        raise LoadError(str(e)) from e


_FLOAT_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64"}


@contextmanager
def _local_folder(store, manifest: Manifest):
    """The folder transformers reads `config.json` (and the rest of the copied files) from: the folder itself, or, for
    a remote one, a temporary local copy of just those small files and the manifest, removed after the load."""
    root = getattr(store, "root", None)
    if root is not None:
        yield root
        return
    import shutil
    import tempfile

    staged = Path(tempfile.mkdtemp(prefix="reshard-load-"))
    try:
        for name in (MANIFEST_NAME, *manifest.copied):
            (staged / name).write_bytes(store.read(name, 0, store.size(name)))
        _name_the_dtype(staged / "config.json", manifest)
        yield staged
    finally:
        shutil.rmtree(staged, ignore_errors=True)


def _name_the_dtype(config: Path, manifest: Manifest) -> None:
    """transformers reads a rank file for the dtype a config lacks; a remote folder has no local one to read."""
    if not config.is_file():
        return
    document = json.loads(config.read_text())
    if document.get("dtype") is None and document.get("torch_dtype") is None:
        floating = next((t.dtype for t in manifest.tensors.values() if t.dtype in _FLOAT_DTYPES), "F32")
        config.write_text(json.dumps({**document, "dtype": _FLOAT_DTYPES[floating]}, indent=2))


def assemble_state_dict(folder, *, check_checksums: bool = True) -> dict:
    """Full tensors from a reshard folder (local or remote), in one process: each chunk placed at its offsets.

    Before any tensor is built, the chunks the manifest lists must cover every tensor exactly (a gap would otherwise
    be uninitialized memory) and, with `check_checksums`, every file must match its CRC-32.

    Raises:
        LoadError: the manifest is missing or unreadable, a tensor is not covered, or a file is missing or corrupt.
    """
    if hasattr(folder, "read_all"):  # a store given: its manifest
        store, manifest = folder, read_manifest(folder)  # a ManifestError is a LoadError
    else:
        opened = _opened(folder)
        store, manifest = opened.store, opened.manifest
    current().phase(f"checking {len(manifest.files)} files" + (" (CRC-32 and headers)" if check_checksums else "")
                    + " and that they cover every tensor")
    problems = coverage_problems(manifest)
    for entry in manifest.files:
        problems += _file_problems(store, manifest, entry, check_checksums)
    if problems:
        raise LoadError(f"{manifest.where} cannot be loaded: {'; '.join(problems)}. Run `reshard verify` on it, or "
                        "write it again.")
    return _assembled(store, manifest)


def _file_problems(store, manifest: Manifest, entry, check_checksums: bool) -> list[str]:
    try:
        size = store.size(entry.name)  # a FIFO or a device is never read
        if size != entry.bytes:
            return [f"{entry.name} has {size} bytes, the manifest says {entry.bytes}"]
        if check_checksums and (crc := _crc32(store, entry.name, size)) != entry.crc32:
            return [f"{entry.name} is corrupt (CRC-32 {crc}, the manifest says {entry.crc32})"]
        return header_problems(entry, manifest.chunks(entry), header_of(store, entry.name))
    except FileNotFoundError:
        return [f"{entry.name} is missing"]
    except OSError as e:
        return [f"{entry.name} cannot be read ({e.strerror or e})"]
    except ReshardError as e:  # a header that does not parse, a special file
        return [str(e)]


def _crc32(store, name: str, size: int) -> str:
    import zlib

    from ..read import READ_BLOCK

    crc = 0
    for start in range(0, size, READ_BLOCK):
        crc = zlib.crc32(store.read(name, start, min(READ_BLOCK, size - start)), crc)
    return f"{crc:08x}"


def _assembled(store, manifest: Manifest) -> dict:
    import torch

    out = {}
    for name, info in manifest.tensors.items():
        dtype = torch_dtype(info.dtype)
        if dtype is None:
            raise LoadError(f"{name} is {info.dtype}, a safetensors dtype this loader cannot assemble in torch.")
        out[name] = torch.empty(info.shape, dtype=dtype)
    replicated_done = set()  # every coordinate holds a copy: read one
    with current().reading(len(manifest.files), manifest.bytes, "with headers, the whole model") as shown:
        for done, entry in enumerate(manifest.files, 1):
            _place_file(store, manifest, entry, out, replicated_done)
            shown(done, sum(e.bytes for e in manifest.files[:done]))
    return out


def _place_file(store, manifest: Manifest, entry, out: dict, replicated_done: set) -> None:
    """Each chunk file `entry` holds, read and placed at its offsets in `out`'s full tensors."""
    import torch

    stored = {t.name: t for t in header_of(store, entry.name).tensors}
    for chunk in manifest.chunks(entry):
        if chunk.is_empty or chunk.name in replicated_done:
            continue
        if manifest.tensors[chunk.name].is_replicated:
            replicated_done.add(chunk.name)
        t = stored[chunk.name]
        data = bytearray(store.read(entry.name, t.data_start, t.nbytes))
        local = torch.frombuffer(data, dtype=out[chunk.name].dtype).reshape(chunk.shape) if t.nbytes else None
        region = tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.shape))
        if local is not None:
            out[chunk.name][region] = local


def _load_whole(store, manifest: Manifest, model_class, *, check_checksums: bool = True, **kwargs):
    from transformers import AutoConfig

    check_copied(manifest, store, need_config=kwargs.get("config") is None)  # before transformers opens any
    if kwargs.get("config") is None:
        with _local_folder(store, manifest) as local:
            kwargs["config"] = AutoConfig.from_pretrained(local)
    config = kwargs.pop("config")
    state_dict = assemble_state_dict(store, check_checksums=check_checksums)
    with active_manifest(manifest, store):
        return model_class.from_pretrained(None, config=config, state_dict=state_dict, **kwargs)
