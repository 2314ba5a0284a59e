"""What reshard adds to transformers' distributed loading (tested with 5.23 to 5.25). Explicit and idempotent;
nothing on import.

1. Balanced placement: while a reshard folder with a balanced layout loads, FSDP2's `fully_shard` gets a
   `shard_placement_fn` that shards each expert parameter on the dim the manifest names, so a rank's local
   tensor is exactly the chunk in its file.
2. Empty locals on the normal HF path: when every target of a converter is a DTensor whose local shard is empty on
   this rank, the converter returns an empty local instead of stacking nothing (`torch.stack([])`) or slicing out
   of range; the parameter is then flagged initialized like any loaded one, so no rank runs weight init alone.
3. Meta-only materialization: `_move_missing_keys_from_meta_to_device` replaces only tensors still on `meta`; a
   buffer created off-meta on purpose (a zero router bias) keeps its values. Under accelerate's FSDP RAM-efficient
   loading, a reshard folder's ranks other than 0 materialize their tensors too (transformers would leave them on
   meta for a broadcast that never comes).
4. Own-file reads: a reshard folder's distributed-checkpoint load is `dcp.load` of the model's own state dict with
   `reshard.StorageReader` (each rank reads its own files into its local tensors, CRC-32 checked as they pass),
   and skips building the weight-conversion mapping, which that path never uses.
5. No Hub kernels unless asked: while the patch is installed, `from_pretrained` gets `use_kernels=False` when the
   caller passes none (transformers 5.25 turns kernels on by default, fails without the `kernels` package and fetches
   code from the Hub); a caller's `use_kernels=True` passes through.

All hooks are private transformers API: before installing, `hooks.require_hooks` checks that each name the patch
wraps, replaces or calls is there with the parameters it expects (refusing when one is missing or changed, warning
once outside the tested range).
"""

from __future__ import annotations

import contextvars
import functools
import os
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field

from ..manifest import MANIFEST_NAME
from ._progress import current

# The manifest of the reshard folder being loaded and the store its files are read from, set around `from_pretrained`.
_active_manifest: contextvars.ContextVar[tuple | None] = contextvars.ContextVar("reshard_manifest", default=None)
# Tensor name -> the dim FSDP splits, for the tensors the manifest splits on a dim other than 0.
_split_dims: contextvars.ContextVar[dict[str, int] | None] = contextvars.ContextVar("reshard_dims", default=None)
# Parameter object id -> qualified name, for the model whose FSDP plan is being applied.
_param_names: contextvars.ContextVar[dict[int, str] | None] = contextvars.ContextVar("reshard_params", default=None)
# Whether the CRC-32 of each rank's own files is checked as they are read.
_checksums: contextvars.ContextVar[bool] = contextvars.ContextVar("reshard_checksums", default=True)
# Set while a reshard folder loads through transformers' distributed-checkpoint path.
_dcp_path: contextvars.ContextVar[bool] = contextvars.ContextVar("reshard_dcp_path", default=False)


@dataclass
class _Installed:
    """The loader patch's one record, its only state: what it replaced, and whether the user installed it."""

    originals: dict[tuple[object, str], object] = field(default_factory=dict)
    by_user: bool = False  # patch_transformers() was called: reshard.from_pretrained leaves the hooks in place
    lock: threading.Lock = field(default_factory=threading.Lock)


_INSTALLED = _Installed()


def _set(owner, name: str, value) -> None:
    _INSTALLED.originals.setdefault((owner, name), owner.__dict__[name])
    setattr(owner, name, value)


def is_patched() -> bool:
    return bool(_INSTALLED.originals)


def patch_transformers() -> "_Unpatch":
    """Install reshard's fixes into transformers (idempotent) until `unpatch_transformers()`. Returns a context manager
    that undoes them.

    After it, `AutoModelForCausalLM.from_pretrained(OUT)` loads a reshard folder with balanced placement, empty
    locals handled and only meta tensors materialized; in a torchrun job with no `distributed_config` it uses the
    manifest's mesh (creating the process group the way transformers does), and every rank checks its files and
    agrees with the others before loading.

    Raises:
        ReshardError: a transformers function the patch hooks is missing or has changed its parameters (each is
            named, with the tested range).

    Example:
        >>> with reshard.patch_transformers():  # doctest: +SKIP
        ...     model = AutoModelForCausalLM.from_pretrained(out)
    """
    install()
    _INSTALLED.by_user = True
    return _Unpatch()


def install() -> bool:
    """Install the hooks (idempotent); True when this call installed them. `patch_transformers` is the public way."""
    from ._hooks import require_hooks

    require_hooks()
    with _INSTALLED.lock:
        if _INSTALLED.originals:
            return False
        import transformers.core_model_loading as cml
        import transformers.distributed.fsdp as fsdp
        import transformers.distributed.mixin as mixin
        import transformers.modeling_utils as mu

        _set(fsdp, "fully_shard", _wrap_fully_shard(fsdp.__dict__["fully_shard"]))
        _set(mixin, "apply_fully_sharded_data_parallelism",
             _wrap_apply_fsdp(mixin.__dict__["apply_fully_sharded_data_parallelism"]))
        for cls in (cml.WeightConverter, cml.WeightRenaming):
            _set(cls, "convert", _wrap_convert(cls.__dict__["convert"]))
        _set(mu.PreTrainedModel, "_move_missing_keys_from_meta_to_device", _move_only_meta_to_device)
        _set(mixin, "_load_model_checkpoint_distributed",
             _wrap_load_distributed(mixin.__dict__["_load_model_checkpoint_distributed"]))
        _set(mu, "get_model_conversion_mapping", _wrap_conversion_mapping(mu.__dict__["get_model_conversion_mapping"]))
        _set(mu, "get_distributed_checkpoint_dir", _wrap_checkpoint_dir(mu.__dict__["get_distributed_checkpoint_dir"]))
        _set(mu, "_get_resolved_distributed_checkpoint_files",
             _wrap_checkpoint_files(mu.__dict__["_get_resolved_distributed_checkpoint_files"]))
        _set(mu.PreTrainedModel, "from_pretrained",
             _wrap_from_pretrained(mu.PreTrainedModel.__dict__["from_pretrained"]))
        return True


def uninstall_unless_user() -> None:
    """Remove the hooks unless the user installed them with `patch_transformers()` (then they stay)."""
    if not _INSTALLED.by_user:
        unpatch_transformers()


def unpatch_transformers() -> None:
    """Restore every function `patch_transformers` replaced (idempotent)."""
    with _INSTALLED.lock:
        for (owner, name), original in _INSTALLED.originals.items():
            setattr(owner, name, original)
        _INSTALLED.originals.clear()
        _INSTALLED.by_user = False


class _Unpatch:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        unpatch_transformers()
        return False


@contextmanager
def active_manifest(manifest, store=None, *, checksums: bool | None = None):
    """Around a load of the reshard folder `manifest` (a `Manifest`) describes, its files read through `store`."""
    token = _active_manifest.set(None if manifest is None else (manifest, store))
    crc_token = _checksums.set(_checksums.get() if checksums is None else checksums)
    dims_token = _split_dims.set(None if manifest is None else manifest.split_dims)
    try:
        yield
    finally:
        _checksums.reset(crc_token)
        _split_dims.reset(dims_token)
        _active_manifest.reset(token)


# ---- 1. balanced placement ------------------------------------------------------------------------------------

def _wrap_apply_fsdp(original):
    @functools.wraps(original)
    def apply_fully_sharded_data_parallelism(model, *args, **kwargs):
        token = _param_names.set({id(p): n for n, p in model.named_parameters()})
        try:
            return original(model, *args, **kwargs)
        finally:
            _param_names.reset(token)

    return apply_fully_sharded_data_parallelism


def _wrap_fully_shard(original):
    @functools.wraps(original)
    def fully_shard(module, *args, **kwargs):
        dims, names = _split_dims.get(), _param_names.get()
        if dims and names is not None and "shard_placement_fn" not in kwargs:
            kwargs["shard_placement_fn"] = functools.partial(_placement_for, names=names, dims=dims)
        return original(module, *args, **kwargs)

    return fully_shard


def _placement_for(param, *, names, dims):
    from torch.distributed.tensor import Shard

    dim = dims.get(names.get(id(param)))
    return Shard(dim) if dim is not None else None


# ---- 2. empty locals on the normal path -----------------------------------------------------------------------

def _empty_locals(converter, layer_name, model):
    """Empty local tensors for every target if all of them are empty DTensors on this rank, else None."""
    from transformers.distributed.utils import is_dtensor

    if model is None:
        return None
    targets = list(converter.layer_targets) or [layer_name]
    out = {}
    for target in targets:
        try:
            ref = model.get_parameter_or_buffer(target)
        except (AttributeError, KeyError):
            return None
        if not is_dtensor(ref) or ref._local_tensor.numel() != 0:
            return None
        import torch

        mesh = ref.device_mesh
        device = torch.device(mesh.device_type, torch.cuda.current_device()) if mesh.device_type == "cuda" else "cpu"
        out[target] = torch.empty(ref._local_tensor.shape, dtype=ref.dtype, device=device)
    return out


def _wrap_convert(original):
    @functools.wraps(original)
    def convert(self, layer_name, model=None, config=None, hf_quantizer=None, loading_info=None):
        empty = _empty_locals(self, layer_name, model)
        if empty is not None:
            self.collected_tensors.clear()  # nothing of ours to stack: the pieces belong to other ranks
            return empty
        return original(self, layer_name, model=model, config=config, hf_quantizer=hf_quantizer,
                        loading_info=loading_info)

    return convert


# ---- 3. meta-only materialization -----------------------------------------------------------------------------

def _is_meta(tensor) -> bool:
    return getattr(tensor, "_local_tensor", tensor).is_meta


def _move_only_meta_to_device(self, missing_keys, device_map, device_mesh, hf_quantizer):
    """`PreTrainedModel._move_missing_keys_from_meta_to_device`, keeping the values of tensors that are not on meta:
    one already on its target device stays untouched, one elsewhere (a buffer made on the CPU on purpose while the
    model loads onto a GPU) is moved there with its values."""
    import torch
    import transformers.modeling_utils as mu

    from ._replacement import same_device

    original = _INSTALLED.originals[(mu.PreTrainedModel, "_move_missing_keys_from_meta_to_device")]
    if (mu.is_deepspeed_zero3_enabled() and hf_quantizer is None) or (
            _ram_efficient_non_rank_0(mu) and hf_quantizer is None and _active_manifest.get() is None):
        return original(self, missing_keys, device_map, device_mesh, hf_quantizer)
    tied = set(self.all_tied_weights_keys.keys())
    current().phase("materializing the tensors still on the meta device (buffers made off meta keep their values)")

    def place(key, tensor, make_empty):
        device = mu.get_device(device_map, key, valid_torch_device=True)
        if not _is_meta(tensor):
            if not mu.is_dtensor(tensor) and not same_device(tensor.device, device):
                moved = tensor.to(device)
                if isinstance(tensor, torch.nn.Parameter):
                    moved = torch.nn.Parameter(moved, requires_grad=tensor.requires_grad)
                mu._load_parameter_into_model(self, key, moved)
            return
        mu._load_parameter_into_model(self, key, make_empty(tensor, device))

    def empty_param(param, device):
        if mu.is_dtensor(param):
            local = torch.empty(param._local_tensor.shape, dtype=param.dtype, device=device)
            return torch.nn.Parameter(mu._dtensor_from_local_like(local, param), requires_grad=param.requires_grad)
        return torch.empty_like(param, device=device)

    for key in set(missing_keys) - tied:
        place(key, self.get_parameter_or_buffer(key), empty_param)
    for key, buffer in self.named_non_persistent_buffers():
        place(key, buffer, lambda t, device: torch.empty_like(t, device=device))


def _ram_efficient_non_rank_0(mu) -> bool:
    """accelerate's FSDP RAM-efficient loading (`FSDP_CPU_RAM_EFFICIENT_LOADING`, on by default under
    `accelerate launch --use_fsdp`) on a rank other than its node's rank 0.

    transformers then leaves that rank's parameters on meta, expecting accelerate's FSDP wrapping to broadcast rank
    0's full state dict later. A reshard folder's load never takes that branch: the model is already sharded by its
    `DistributedConfig` (the Trainer does not wrap it again, so nothing would broadcast) and every rank reads its own
    bytes, so every rank materializes its tensors and loads them; otherwise they stay on meta and the first forward
    fails on every rank but 0."""
    return mu.is_fsdp_enabled() and not mu.is_local_dist_rank_0()


# ---- 4. own-file reads on the distributed-checkpoint path -------------------------------------------------------

def _wrap_load_distributed(original):
    @functools.wraps(original)
    def _load_model_checkpoint_distributed(model, checkpoint_dir, strict=True):
        from ..manifest import MANIFEST_NAME
        from ._storage import load_model_state

        active = _active_manifest.get()
        if active is None or not os.path.isfile(os.path.join(checkpoint_dir, MANIFEST_NAME)):
            return original(model, checkpoint_dir, strict)
        # transformers' own version gathers the state dict, turns _StridedShard placements into plain shards (a
        # redistribution, and chunks that no longer match the files), loads, and sets the state dict back: here the
        # model's own tensors are the destination, so a rank whose placements match the folder reads its own files.
        manifest, store = active
        load_model_state(model, manifest, store, checksums=_checksums.get(), strict=strict)
        return None

    return _load_model_checkpoint_distributed


def _wrap_conversion_mapping(original):
    @functools.wraps(original)
    def get_model_conversion_mapping(model, key_mapping=None, *args, **kwargs):
        # The distributed-checkpoint path never reads the mapping (only `_load_pretrained_model` does), and its first
        # build compiles transformers' whole table: ~0.1-0.2 s of every rank's load. A user's key_mapping is kept:
        # PEFT adapter loading reads it from the load config.
        if _dcp_path.get() and key_mapping is None:
            return []
        return original(model, key_mapping, *args, **kwargs)

    return get_model_conversion_mapping


def _remote_staged(folder) -> bool:
    """Whether `folder` is the local copy of the metadata of the remote reshard folder being loaded (its rank files
    stay in the object store, read by the storage reader through the active store)."""
    active = _active_manifest.get()
    return (active is not None and getattr(active[1], "remote", False) and folder is not None
            and os.path.isfile(os.path.join(os.fspath(folder), MANIFEST_NAME)))


def _wrap_checkpoint_dir(original):
    @functools.wraps(original)
    def get_distributed_checkpoint_dir(pretrained_model_name_or_path, subfolder, gguf_file, state_dict):
        # transformers picks its distributed-checkpoint path by the rank files it sees in the folder; a remote reshard
        # folder's local copy holds only the metadata, so it is named here
        if _remote_staged(pretrained_model_name_or_path) and not subfolder and gguf_file is None and state_dict is None:
            return pretrained_model_name_or_path
        return original(pretrained_model_name_or_path, subfolder, gguf_file, state_dict)

    return get_distributed_checkpoint_dir


def _wrap_checkpoint_files(original):
    @functools.wraps(original)
    def _get_resolved_distributed_checkpoint_files(distributed_checkpoint_dir, hf_quantizer=None):
        if _remote_staged(distributed_checkpoint_dir) and hf_quantizer is None:
            return []  # no local file: the storage reader reads the store (the config names the dtype)
        return original(distributed_checkpoint_dir, hf_quantizer)

    return _get_resolved_distributed_checkpoint_files


# ---- the manifest travels with from_pretrained ----------------------------------------------------------------

def _wrap_from_pretrained(original):
    func = original.__func__

    @functools.wraps(func)
    def from_pretrained(cls, pretrained_model_name_or_path=None, *args, **kwargs):
        from pathlib import Path

        from ..launch import multi_rank_job
        from ._agreement import agree_for_pretrained, may_hold_reshard_files

        folder = None if pretrained_model_name_or_path is None else Path(os.fspath(pretrained_model_name_or_path))
        if kwargs.get("use_kernels") is None:
            # transformers 5.25 kernelizes by default and fetches kernel code from the Hub as it loads: no load under
            # the patch does unless asked (a caller's use_kernels=True passes through).
            kwargs["use_kernels"] = False
        active = _active_manifest.get()  # set by reshard.from_pretrained, which has checked and agreed already
        direct = all(kwargs.get(k) is None for k in ("state_dict", "gguf_file")) and not kwargs.get("subfolder")
        if active is None and folder is not None and direct and multi_rank_job() and may_hold_reshard_files(folder):
            active, kwargs["distributed_config"] = agree_for_pretrained(
                folder, kwargs.get("distributed_config"), need_config=kwargs.get("config") is None)
        if active is None and folder is not None and (folder / MANIFEST_NAME).is_file():
            from ..read import open_folder
            from ._agreement import check_copied

            opened = open_folder(folder)  # validated, version included (ManifestError, a LoadError)
            active = opened.manifest, opened.store
            check_copied(opened.manifest, opened.store, need_config=kwargs.get("config") is None)
        if active is None:
            token = _dcp_path.set(False)  # a checkpoint loaded inside a reshard load is an ordinary one
            try:
                return func(cls, pretrained_model_name_or_path, *args, **kwargs)
            finally:
                _dcp_path.reset(token)
        # transformers takes its distributed-checkpoint path for a folder of shard files unless these are given.
        dcp_token = _dcp_path.set(direct)
        try:
            with active_manifest(*active):
                return func(cls, pretrained_model_name_or_path, *args, **kwargs)
        finally:
            _dcp_path.reset(dcp_token)

    return classmethod(from_pretrained)
