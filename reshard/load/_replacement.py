"""Each tensor's replacement on the target device, for `materialize_meta_` (`reshard.load._materialize`).

Only a meta tensor gets fresh (uninitialized) storage; a real tensor already on the target is kept as the same object,
one elsewhere is copied there with its values. A parameter's replacement keeps its class, `requires_grad`, Python
attributes and grad; a wrapper subclass (FSDP2's DTensor) keeps its identity too, since other objects hold it.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass


def replacement(tensor: torch.Tensor, device, *, is_param: bool) -> tuple[torch.Tensor, str]:
    """`tensor`'s replacement on `device`, and which field of `reshard.load.MaterializeReport` names it:
    only a meta tensor gets fresh storage (`materialized`); a real one on `device` is itself (`kept`), one elsewhere is
    copied (`moved`)."""
    if tensor.is_meta:
        new = _materialize_parameter(tensor, device) if is_param else torch.empty_like(tensor, device=device)
        return new, "materialized"
    if same_device(tensor.device, device):
        return tensor, "kept"
    return (_move_parameter(tensor, device) if is_param else tensor.to(device, copy=True)), "moved"


def _new_parameter(old: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
    """A parameter holding `data` that looks like `old`: same class, `requires_grad` and Python attributes."""
    cls = type(old)
    if isinstance(cls, type) and issubclass(cls, nn.Parameter):
        try:
            new = cls(data, requires_grad=old.requires_grad)
        except TypeError:
            # A subclass whose __new__ takes other arguments: build it the way nn.Parameter.__new__ does.
            new = torch.Tensor._make_subclass(cls, data, old.requires_grad)
    else:
        # A tensor subclass flagged as a parameter (e.g. an FSDP2 DTensor): nn.Parameter keeps its type.
        new = nn.Parameter(data, requires_grad=old.requires_grad)
    # Frameworks hang flags on parameters (tensor-parallel attributes, `_is_param`); stock to_empty drops them.
    new.__dict__.update(old.__dict__)
    return new


def _current_index(device_type: str) -> int:
    """The device index a bare `device_type` (e.g. `"cuda"`) allocates on now, as `torch.empty(device=...)` does."""
    if device_type == "cuda":
        return torch.cuda.current_device()
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and accelerator.is_available() and accelerator.current_accelerator().type == device_type:
        return accelerator.current_device_index()
    return 0  # cpu, meta and single-device types


def same_device(tensor_device: torch.device, target: torch.device | str | int) -> bool:
    """Whether a tensor on `tensor_device` already lives where `to_empty(device=target)` would put it.

    `"cuda"` (no index) means the current CUDA device, so a tensor on `cuda:0` is there while device 0 is current and
    elsewhere after `torch.cuda.set_device(1)`. A CPU tensor's device has no index: `"cpu"` and `"cpu:0"` are one
    device. An int is what `torch.device(int)` makes of it (the current accelerator's device of that index).
    """
    target = torch.device(target)
    if tensor_device.type != target.type:
        return False
    if tensor_device.index == target.index:
        return True
    if tensor_device.index is not None and target.index is not None:
        return False
    current = _current_index(target.type)  # one side has no index: it means the current device
    return (current if tensor_device.index is None else tensor_device.index) == (
        current if target.index is None else target.index)


def _replace_parameter(old: torch.Tensor, data: torch.Tensor, grad: torch.Tensor | None) -> torch.Tensor:
    """`old`'s replacement holding `data` (and `grad`), or `old` itself with the new contents swapped in."""
    new = _new_parameter(old, data)
    if grad is not None:
        new.grad = grad
    # Wrapper subclasses (DTensor under FSDP2) are owned by objects that keep a reference to the parameter, so, like
    # nn.Module._apply, swap the new contents into the old object instead of replacing it; honour torch's opt-in too.
    if is_traceable_wrapper_subclass(data) or torch.__future__.get_swap_module_params_on_conversion():
        if old.grad is not None:
            old.grad = None  # an accessed .grad holds a second reference, which swap_tensors refuses
        torch.utils.swap_tensors(old, new)
        return old
    return new


def _materialize_parameter(old: torch.Tensor, device: torch.device | str | int) -> torch.Tensor:
    with torch.no_grad():
        data = torch.empty_like(old, device=device)
    grad = old.grad
    if grad is not None and grad.is_meta:
        grad = torch.empty_like(grad, device=device)
    return _replace_parameter(old, data, grad)


def _move_parameter(old: torch.Tensor, device: torch.device | str | int) -> torch.Tensor:
    # A move between devices copies anyway; copy=True makes that explicit, so the source is never aliased.
    with torch.no_grad():
        data = old.detach().to(device, copy=True)
    grad = old.grad
    if grad is not None:
        grad = torch.empty_like(grad, device=device) if grad.is_meta else grad.to(device)
    return _replace_parameter(old, data, grad)
