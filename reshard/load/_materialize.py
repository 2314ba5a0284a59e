"""Meta-device materialization that keeps the values of real tensors.

`torch.nn.Module.to_empty(device=...)` replaces *every* parameter and buffer with uninitialized memory, including
buffers a model deliberately created off the meta device (a router's zero-filled `expert_bias` made with an explicit
`device=` inside `with torch.device("meta"):`). `reset_parameters()` / `init_weights()` usually re-initialize only
parameters, so such a buffer keeps whatever the allocator had there: garbage, often NaN on a reused CUDA block.

`materialize_meta_` allocates only tensors that are actually on the meta device, and moves a real tensor that sits on
another device (a buffer made on the CPU, then `to_empty(device="cuda")`) to the target with its values, as
`nn.Module.to` would; tensors already on the target stay the same objects (how each tensor is replaced:
`reshard.load._replacement`). `meta_only_to_empty` and `patch_to_empty` swap it in for `nn.Module.to_empty` so that
third-party code calling `to_empty` (megatron-fsdp's meta init, FSDP2 recipes, torchtitan) gets the same behaviour;
`patch_megatron_fsdp` does that after a version check, and `check_buffers` finds the damage when it already happened.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from ..words import plural
from ._hooks import minor_of
from ._replacement import replacement

__all__ = [
    "MaterializeReport",
    "check_buffers",
    "materialize_meta_",
    "meta_only_to_empty",
    "patch_megatron_fsdp",
    "patch_to_empty",
    "unpatch_to_empty",
]

# megatron-fsdp releases whose meta-init path we have read: `m.to_empty(device=self.device, recurse=False)` followed
# by `m.reset_parameters()` in `megatron_fsdp/param_and_grad_buffer.py`. Other minors may have moved that call.
_MEGATRON_FSDP_KNOWN_VERSION = "0.6.1"
_MEGATRON_FSDP_SUPPORTED_MINOR = (0, 6)


@dataclass(frozen=True)
class MaterializeReport:
    """What `materialize_meta_` did.

    Each distinct tensor object appears once, under the first qualified name it is reachable by (the same
    de-duplication as `named_parameters()` / `named_buffers()`), so a tied weight is counted once.

    Attributes:
        materialized: names of meta tensors that were given (uninitialized) storage on the target device.
        kept: names of real tensors already on the target device, left exactly as they were (same objects).
        moved: names of real tensors that were on another device and were copied to the target device, values
            kept (a parameter keeps its class, `requires_grad` and attributes).
    """

    materialized: tuple[str, ...]
    kept: tuple[str, ...]
    moved: tuple[str, ...] = ()

    def __str__(self) -> str:
        def listed(names: tuple[str, ...]) -> str:
            more = f", ... ({len(names) - 8} more)" if len(names) > 8 else ""
            return ", ".join(names[:8]) + more

        text = (f"materialized {plural(len(self.materialized), 'meta tensor')}, "
                f"kept {plural(len(self.kept), 'non-meta tensor')}")
        if self.kept:
            text += f" (kept: {listed(self.kept)})"
        if self.moved:
            text += f", moved {len(self.moved)} to the target device with their values ({listed(self.moved)})"
        return text


def materialize_meta_(
    module: nn.Module, device: torch.device | str | int, *, recurse: bool = True
) -> MaterializeReport:
    """Give storage on `device` to the meta tensors of `module`, in place, keeping the values of every other tensor.

    A drop-in for `module.to_empty(device=device, recurse=recurse)` that does not clobber parameters or buffers
    created off the meta device on purpose (for example a zero-filled router `expert_bias` made with an explicit
    `device=` inside `with torch.device("meta"):`). Differences from `to_empty`, all deliberate:

    - a non-meta tensor already on `device` stays the same object with the same values;
    - a non-meta tensor on another device (a buffer made on the CPU, then `to_empty(device="cuda")`) is copied to
      `device` with its values, as `module.to(device)` would, so every tensor ends on `device`;
    - a parameter registered in several places (tied weights) is materialized once and stays shared;
    - a parameter keeps its class (`nn.Parameter` subclass), `requires_grad` and Python attributes.

    Materialized tensors are uninitialized, exactly as with `to_empty`; run the model's own initialization next.

    Args:
        module: the module to materialize in place.
        device: where every tensor ends, e.g. `"cpu"`, `"cuda:0"`, `torch.device("cuda", 1)`; `"cuda"` means the
            current CUDA device.
        recurse: when False, only the module's own parameters and buffers are handled, not its submodules'
            (the meaning of `to_empty(recurse=False)`).

    Returns:
        A `MaterializeReport` naming the tensors that were materialized, kept, and moved.

    Example:

    ```python
    >>> import torch
    >>> from reshard import materialize_meta_
    >>> with torch.device("meta"):
    ...     gate = torch.nn.Linear(8, 4, bias=False)
    ...     gate.register_buffer("expert_bias", torch.zeros(4, device="cpu"))
    >>> report = materialize_meta_(gate, "cpu")
    >>> report.materialized, report.kept
    (('weight',), ('expert_bias',))
    >>> gate.expert_bias
    tensor([0., 0., 0., 0.])

    ```
    """
    modules = module.named_modules() if recurse else [("", module)]
    # id -> (original, replacement); holding the original keeps its id from being reused during the walk.
    memo: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    names: dict[str, list[str]] = {"materialized": [], "kept": [], "moved": []}
    for prefix, mod in modules:
        for slots, is_param in ((mod._parameters, True), (mod._buffers, False)):
            for key, tensor in slots.items():
                if tensor is None:
                    continue
                if id(tensor) not in memo:  # a tied tensor met again gets the replacement it got the first time
                    new, outcome = replacement(tensor, device, is_param=is_param)
                    memo[id(tensor)] = (tensor, new)
                    names[outcome].append(f"{prefix}.{key}" if prefix else key)
                slots[key] = memo[id(tensor)][1]
    return MaterializeReport(**{outcome: tuple(found) for outcome, found in names.items()})


# --- making nn.Module.to_empty meta-only -----------------------------------------------------------------------------

class _ToEmptyPatch:
    """The process-wide meta-only `nn.Module.to_empty`: installed exactly while a `meta_only_to_empty()` block is open
    or `patch_to_empty()` is in force, and the method it replaced. The one record of that patch's state."""

    def __init__(self):
        self.lock = threading.RLock()
        self.depth = 0  # open meta_only_to_empty() blocks
        self.explicit = False  # patch_to_empty() was called
        self.original = None  # what nn.Module.to_empty was before ours was installed

    def sync(self) -> None:
        """Install or remove the meta-only to_empty so it is active exactly while someone asks for it. Hold `lock`."""
        wanted = self.explicit or self.depth > 0
        current = nn.Module.to_empty
        if wanted and self.original is None:
            self.original = current
            nn.Module.to_empty = _meta_only_to_empty
        elif not wanted and self.original is not None:
            if current is not _meta_only_to_empty:
                # Someone wrapped or replaced ours meanwhile; putting the original back would silently drop their patch.
                warnings.warn(
                    "torch.nn.Module.to_empty was replaced by other code while reshard's meta-only version was "
                    "installed; leaving the current one in place",
                    stacklevel=4,
                )
            else:
                nn.Module.to_empty = self.original
            self.original = None

    def enter(self) -> None:
        with self.lock:
            self.depth += 1
            try:
                self.sync()
            except BaseException:
                self.depth -= 1
                raise

    def exit(self) -> None:
        with self.lock:
            self.depth -= 1
            self.sync()

    def set_explicit(self, wanted: bool) -> None:
        with self.lock:
            self.explicit = wanted
            self.sync()

    def reset(self) -> None:
        """Forget every block and the explicit patch (tests restore the stock method themselves)."""
        with self.lock:
            self.depth, self.explicit, self.original = 0, False, None


_TO_EMPTY = _ToEmptyPatch()


def _meta_only_to_empty(self: nn.Module, *, device: torch.device | str | int | None, recurse: bool = True) -> nn.Module:
    """Meta-only `nn.Module.to_empty`, installed by reshard: only meta tensors are reallocated on `device`.

    Tensors that already have storage keep their values: left as they are on `device`, copied there from another
    device; see `reshard.load.materialize_meta_`.
    """
    if device is None:
        # Stock to_empty(device=None) reallocates each tensor on its own device: meta stays meta, so with real
        # tensors kept there is nothing left to do.
        return self
    materialize_meta_(self, device, recurse=recurse)
    return self


_meta_only_to_empty.__reshard_meta_only__ = True


@contextlib.contextmanager
def meta_only_to_empty() -> Iterator[None]:
    """Make `torch.nn.Module.to_empty` meta-only for the duration of the block.

    Inside the block every `module.to_empty(device=..., recurse=...)` call, including ones made by libraries,
    behaves like `materialize_meta_`: only meta tensors get new (uninitialized) storage, real tensors keep their
    values (moved to `device` when they are elsewhere), and the module is returned. The original method is
    restored on exit, also when the block raises. Blocks may nest, also across threads; the method is restored
    when the outermost one exits (and stays patched if `patch_to_empty()` is in force).

    The patch is process-wide: other threads calling `to_empty` while a block is open get the meta-only version.

    Example:

    ```python
    >>> import torch
    >>> from reshard import meta_only_to_empty
    >>> with torch.device("meta"):
    ...     gate = torch.nn.Linear(8, 4, bias=False)
    ...     gate.register_buffer("expert_bias", torch.zeros(4, device="cpu"))
    >>> with meta_only_to_empty():
    ...     gate = gate.to_empty(device="cpu")
    >>> gate.expert_bias
    tensor([0., 0., 0., 0.])

    ```
    """
    _TO_EMPTY.enter()
    try:
        yield
    finally:
        _TO_EMPTY.exit()


def patch_to_empty() -> None:
    """Make `torch.nn.Module.to_empty` meta-only until `unpatch_to_empty()`; calling it again does nothing.

    Use this when the `to_empty` call happens somewhere a `with meta_only_to_empty():` block cannot reach (inside
    a library's constructor spread over your setup code).

    Example:

    ```python
    >>> from reshard import patch_to_empty, unpatch_to_empty
    >>> patch_to_empty()
    >>> # ... build and shard the model: every to_empty() now keeps real tensors ...
    >>> unpatch_to_empty()

    ```
    """
    _TO_EMPTY.set_explicit(True)


def unpatch_to_empty() -> None:
    """Undo `patch_to_empty()`; calling it again, or without a patch, does nothing.

    Open `meta_only_to_empty()` blocks keep the meta-only method until they exit.
    """
    _TO_EMPTY.set_explicit(False)


# --- megatron-fsdp ---------------------------------------------------------------------------------------------------


def _distribution_version(name: str) -> str:
    """The installed version of distribution `name` (a seam for tests)."""
    return importlib.metadata.version(name)


def patch_megatron_fsdp() -> bool:
    """Keep megatron-fsdp's meta-device init from wiping buffers that were created off the meta device.

    megatron-fsdp 0.6.x (with `init_model_with_meta_device=True`) calls `m.to_empty(device=..., recurse=False)` and
    then `m.reset_parameters()` on each module with meta parameters, so a real buffer on such a module (a router's
    zero `expert_bias`) is replaced by uninitialized memory and never re-filled. This installs the meta-only
    `to_empty` process-wide (`patch_to_empty()`), which megatron-fsdp's call then picks up. Calling it again does
    nothing more; undo it with `unpatch_to_empty()`.

    Returns:
        True when the patch is in force; False when megatron-fsdp is not installed (a warning says so and nothing
        is changed).

    Raises:
        ReshardError: megatron-fsdp is installed but its version is not one whose meta-init path this patch was
            checked against.

    Example:

    ```python
    >>> import reshard
    >>> # before megatron_fsdp.fully_shard_model(..., init_model_with_meta_device=True):
    >>> reshard.patch_megatron_fsdp()  # doctest: +SKIP
    True

    ```
    """
    try:
        megatron_fsdp = importlib.import_module("megatron_fsdp")
    except ImportError as e:
        if isinstance(e, ModuleNotFoundError) and e.name == "megatron_fsdp":
            reason = "megatron-fsdp is not installed"
        else:
            reason = f"megatron_fsdp failed to import ({e})"
        warnings.warn(f"{reason}; patch_megatron_fsdp() changed nothing", stacklevel=2)
        return False

    _require_supported(megatron_fsdp)
    patch_to_empty()
    return True


def _require_supported(megatron_fsdp) -> None:
    """Refuse a megatron-fsdp whose meta-init path this patch was not checked against (it may not use `to_empty`)."""
    from reshard.errors import ReshardError

    try:
        version = _distribution_version("megatron-fsdp")
    except importlib.metadata.PackageNotFoundError:
        # Imported from a source tree (Megatron-LM's megatron/core/distributed/fsdp/src) without package metadata.
        version = getattr(megatron_fsdp, "__version__", None)
    if minor_of(version) != _MEGATRON_FSDP_SUPPORTED_MINOR:
        supported = ".".join(map(str, _MEGATRON_FSDP_SUPPORTED_MINOR)) + ".x"
        raise ReshardError(
            f"megatron-fsdp {version or '(unknown version)'} is not supported by patch_megatron_fsdp(): it was "
            f"checked against megatron-fsdp {supported} (known good: {_MEGATRON_FSDP_KNOWN_VERSION}). Install "
            f"megatron-fsdp=={_MEGATRON_FSDP_KNOWN_VERSION}, or check that this version still materializes meta "
            "modules with `to_empty` and, if so, call reshard.patch_to_empty() yourself."
        )


# --- detecting the damage --------------------------------------------------------------------------------------------


def check_buffers(module: nn.Module, *, warn: bool = True) -> list[str]:
    """Name the floating-point buffers and parameters of `module` that hold NaN or infinite values.

    Run it after initialization (or after loading a checkpoint) to catch buffers that a stock `to_empty` left
    uninitialized. Meta tensors have no values and are skipped.

    Args:
        module: the module to scan, recursively.
        warn: when True and something is found, emit one `UserWarning` naming each tensor with its count of
            non-finite values.

    Returns:
        Qualified names of the tensors with non-finite values, buffers first, in module order; empty when clean.

    Example:

    ```python
    >>> import torch
    >>> from reshard import check_buffers
    >>> gate = torch.nn.Linear(8, 4, bias=False)
    >>> gate.register_buffer("expert_bias", torch.full((4,), float("nan")))
    >>> check_buffers(gate, warn=False)
    ['expert_bias']

    ```
    """
    bad: list[str] = []
    lines: list[str] = []
    named = [*module.named_buffers(), *module.named_parameters()]
    seen: set[int] = set()
    for name, tensor in named:
        if id(tensor) in seen or tensor.is_meta or not (tensor.is_floating_point() or tensor.is_complex()):
            continue
        seen.add(id(tensor))
        data = tensor.detach()
        if hasattr(data, "to_local"):  # DTensor: check this rank's shard, without a collective
            data = data.to_local()
        count = int((~torch.isfinite(data)).sum())
        if count:
            bad.append(name)
            lines.append(f"{name}: {count} of {data.numel()} values are not finite")
    if warn and bad:
        warnings.warn(
            f"{plural(len(bad), 'tensor')} with non-finite values (uninitialized memory after to_empty?):\n"
            + "\n".join(lines),
            stacklevel=2,
        )
    return bad
