"""The transformers names the loader patch wraps, replaces or calls, and a check that each is there as expected.

The patch hooks private transformers API, so a version string says little: what matters is that each function
still exists with the parameters the patch passes or receives. `check_hooks` inspects them without installing
anything; the patch refuses to install when one is missing or changed, and warns once when every hook is intact
but the installed transformers is outside the tested range (`reshard env` shows the same facts).
"""

from __future__ import annotations

import importlib
import inspect
import re
import warnings
from dataclasses import dataclass

# The transformers releases the suite runs against (CI: the whole suite on the newest, the core tests on the oldest).
# setup.cfg admits every later 5.x release: pip never refuses or downgrades a new one; `require_hooks` is the gate.
_TESTED_TRANSFORMERS = ((5, 23), (5, 24), (5, 25))
TESTED_RANGE = "transformers>=5.23,<5.26"


@dataclass(frozen=True)
class _Hook:
    """One transformers name the patch relies on.

    `params` are the leading parameters, in order, that reshard passes or receives; `keywords` are parameters it
    passes by name. A `replaced` hook must keep exactly `params`, since transformers calls reshard's version.
    """

    module: str
    name: str
    use: str  # "wrapped", "replaced" or "called"
    params: tuple[str, ...] = ()
    keywords: tuple[str, ...] = ()

    @property
    def qualified(self) -> str:
        return f"{self.module}.{self.name}"


_MU = "transformers.modeling_utils"
HOOKS = (
    _Hook("transformers.distributed.fsdp", "fully_shard", "wrapped", ("module",), ("shard_placement_fn",)),
    _Hook("transformers.distributed.mixin", "apply_fully_sharded_data_parallelism", "wrapped", ("model",)),
    _Hook("transformers.distributed.mixin", "_load_model_checkpoint_distributed", "wrapped",
         ("model", "checkpoint_dir", "strict")),
    _Hook("transformers.core_model_loading", "WeightConverter.convert", "wrapped",
         ("self", "layer_name", "model", "config", "hf_quantizer", "loading_info")),
    _Hook("transformers.core_model_loading", "WeightRenaming.convert", "wrapped",
         ("self", "layer_name", "model", "config", "hf_quantizer", "loading_info")),
    _Hook(_MU, "PreTrainedModel._move_missing_keys_from_meta_to_device", "replaced",
         ("self", "missing_keys", "device_map", "device_mesh", "hf_quantizer")),
    _Hook(_MU, "get_model_conversion_mapping", "wrapped", ("model", "key_mapping")),
    _Hook(_MU, "get_distributed_checkpoint_dir", "wrapped",
         ("pretrained_model_name_or_path", "subfolder", "gguf_file", "state_dict")),
    _Hook(_MU, "_get_resolved_distributed_checkpoint_files", "wrapped", ("distributed_checkpoint_dir", "hf_quantizer")),
    _Hook(_MU, "PreTrainedModel.from_pretrained", "wrapped", ("pretrained_model_name_or_path",)),
    _Hook(_MU, "is_deepspeed_zero3_enabled", "called"),
    _Hook(_MU, "is_fsdp_enabled", "called"),
    _Hook(_MU, "is_local_dist_rank_0", "called"),
    _Hook(_MU, "get_device", "called", ("device_map", "param_name"), ("valid_torch_device",)),
    _Hook(_MU, "_load_parameter_into_model", "called", ("model", "param_name", "tensor")),
    _Hook(_MU, "_dtensor_from_local_like", "called", ("local_tensor", "ref")),
    _Hook(_MU, "is_dtensor", "called", ("obj",)),
    _Hook("transformers.distributed.utils", "is_dtensor", "called", ("obj",)),
    _Hook("transformers.distributed.utils", "_ensure_torch_distributed", "called"),
    _Hook("transformers.distributed", "DistributedConfig", "called", (),
         ("fsdp_size", "ep_size", "dp_replicate_size", "tp_size", "pp_size", "enable_expert_parallel")),
)


@dataclass(frozen=True)
class _HookStatus:
    hook: _Hook
    problem: str | None  # None: present and as expected

    @property
    def ok(self) -> bool:
        return self.problem is None


def _resolve(hook: _Hook):
    obj = importlib.import_module(hook.module)
    for part in hook.name.split("."):
        # The class dict, not getattr: a classmethod must be seen as itself, and a name inherited from a base class
        # is not the one the patch replaces.
        owner_dict = getattr(obj, "__dict__", {})
        if part not in owner_dict and not hasattr(obj, part):
            return None
        obj = owner_dict[part] if part in owner_dict else getattr(obj, part)
    return obj.__func__ if isinstance(obj, (classmethod, staticmethod)) else obj


def _problem(hook: _Hook) -> str | None:
    try:
        obj = _resolve(hook)
    except ImportError as e:
        return f"its module cannot be imported ({e})"
    if obj is None:
        return "it is missing"
    try:
        parameters = list(inspect.signature(obj).parameters.values())
    except (TypeError, ValueError):
        return "its signature cannot be read"
    names = [p.name for p in parameters if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if hook.name.endswith("from_pretrained") and names[:1] == ["cls"]:
        names = names[1:]
    leading = tuple(names[:len(hook.params)])
    if leading != hook.params or (hook.use == "replaced" and tuple(names) != hook.params):
        return f"reshard expects parameters ({', '.join(hook.params)}), found ({', '.join(names)})"
    takes_any_keyword = any(p.kind == p.VAR_KEYWORD for p in parameters)
    lost = [k for k in hook.keywords if k not in names and not takes_any_keyword]
    if lost:
        return f"parameter {', '.join(lost)} is gone (found ({', '.join(names)}))"
    return None


def check_hooks() -> list[_HookStatus]:
    """The status of every hook in the installed transformers; imports transformers, installs nothing."""
    return [_HookStatus(hook, _problem(hook)) for hook in HOOKS]


def transformers_version() -> str:
    import transformers

    return transformers.__version__


def minor_of(version: str | None) -> tuple[int, int] | None:
    """`(major, minor)` of a version string (`"5.25.0.dev0"` -> `(5, 25)`), or None when it has none."""
    match = re.match(r"(\d+)\.(\d+)", version or "")
    return (int(match[1]), int(match[2])) if match else None


def in_tested_range(version: str) -> bool:
    return minor_of(version) in _TESTED_TRANSFORMERS


def _refusal(version: str, broken: list[_HookStatus]) -> str:
    lines = "; ".join(f"{s.hook.qualified} ({s.hook.use}): {s.problem}" for s in broken)
    return (f"reshard's loader patch cannot install on transformers {version}: {lines}. It was tested with "
            f"{TESTED_RANGE}; install a version in that range (`pip install \"{TESTED_RANGE}\"`). Nothing was "
            "patched.")


class UntestedTransformersWarning(UserWarning):
    """Every hook is intact, but the installed transformers is newer (or older) than the releases reshard tested."""


# Shown once per process and message by the warnings machinery itself, wherever the patch is installed from.
warnings.filterwarnings("once", category=UntestedTransformersWarning)


def require_hooks() -> None:
    """Refuse (ReshardError) when a hook is missing or changed; warn once when outside the tested range."""
    from ..errors import ReshardError

    version = transformers_version()
    broken = [s for s in check_hooks() if not s.ok]
    if broken:
        raise ReshardError(_refusal(version, broken))
    if not in_tested_range(version):
        warnings.warn(f"reshard's loader patch was tested with {TESTED_RANGE}; transformers {version} is installed. "
                      "Every hook it uses is present with the expected signature, so it proceeds; report problems "
                      "with the output of `reshard env`.", UntestedTransformersWarning, stacklevel=_caller_level())


def _caller_level() -> int:
    """The `stacklevel` of the first frame outside reshard and contextlib: the line that asked for the patch."""
    import contextlib
    import os
    import sys

    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    frame, level = sys._getframe(1), 1
    while frame is not None and (frame.f_code.co_filename.startswith(package)
                                 or frame.f_code.co_filename == contextlib.__file__):
        frame, level = frame.f_back, level + 1
    return level
