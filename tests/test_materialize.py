"""Meta-only materialization: real tensors survive `to_empty`, meta ones get storage.

Stock `to_empty` allocates with `torch.empty_like`, whose contents depend on the allocator. To make the loss of a
buffer deterministic, the `poisoned_empty_like` fixture makes `torch.empty_like` return NaN-filled tensors, the
worst case of a reused CUDA block; code that keeps real tensors is unaffected by it.
"""

from __future__ import annotations

import sys
import threading
import types
import warnings

import pytest
import torch
from torch import nn

from reshard.load import _materialize as mat
from reshard.load import _replacement as replacement
from reshard.errors import ReshardError
from reshard.load import (MaterializeReport, check_buffers, materialize_meta_, meta_only_to_empty, patch_megatron_fsdp,
                          patch_to_empty, unpatch_to_empty)

STOCK_TO_EMPTY = nn.Module.to_empty


class TaggedParameter(nn.Parameter):
    """A Parameter subclass, as frameworks use to mark e.g. expert or tensor-parallel weights."""


class Router(nn.Module):
    def __init__(self, dim: int, n_experts: int):
        super().__init__()
        self.gate = nn.Linear(dim, n_experts, bias=False)
        # Made on purpose off the meta device (explicit device=) and filled: the tensors to_empty must not touch.
        self.register_buffer("expert_bias", torch.full((n_experts,), 7.0, device="cpu"))
        self.register_buffer("counts", torch.arange(n_experts, device="cpu", dtype=torch.float32), persistent=False)
        self.register_buffer("scratch", torch.empty(n_experts))  # a meta buffer
        self.scale = TaggedParameter(torch.empty(n_experts), requires_grad=False)


class Block(nn.Module):
    def __init__(self, dim: int = 8, n_experts: int = 4, vocab: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.router = Router(dim, n_experts)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied: one Parameter in two modules


def meta_block() -> Block:
    with torch.device("meta"):
        return Block()


@pytest.fixture
def poisoned_empty_like(monkeypatch):
    real = torch.empty_like

    def nan_empty_like(t, *args, **kwargs):
        out = real(t, *args, **kwargs)
        if not out.is_meta and (out.is_floating_point() or out.is_complex()):
            out.fill_(float("nan"))
        return out

    monkeypatch.setattr(torch, "empty_like", nan_empty_like)


@pytest.fixture(autouse=True)
def restore_to_empty():
    yield
    unpatch_to_empty()
    stray = nn.Module.to_empty is not STOCK_TO_EMPTY
    nn.Module.to_empty = STOCK_TO_EMPTY
    mat._TO_EMPTY.reset()
    assert not stray, "a test left nn.Module.to_empty patched"


def no_meta_left(module: nn.Module) -> bool:
    return not any(t.is_meta for t in [*module.parameters(), *module.buffers()])


def test_meta_block_is_what_the_tests_assume():
    block = meta_block()
    assert block.embed.weight.is_meta and block.router.scratch.is_meta and block.router.scale.is_meta
    assert not block.router.expert_bias.is_meta and not block.router.counts.is_meta
    assert type(block.router.scale) is TaggedParameter
    assert block.head.weight is block.embed.weight
    assert "counts" not in block.router.state_dict()  # non-persistent


def test_stock_to_empty_loses_off_meta_buffers(poisoned_empty_like):
    block = meta_block()
    sentinel, counts = block.router.expert_bias, block.router.counts
    block.to_empty(device="cpu")
    # Replaced by new storage (the old tensors are still alive, so the addresses must differ) ...
    assert block.router.expert_bias is not sentinel
    assert block.router.expert_bias.data_ptr() != sentinel.data_ptr()
    assert block.router.counts.data_ptr() != counts.data_ptr()
    # ... holding whatever empty_like gave: here NaN, so the values are gone.
    assert torch.isnan(block.router.expert_bias).all()
    # Stock also unties weights and drops the Parameter subclass, which materialize_meta_ keeps.
    assert block.head.weight is not block.embed.weight
    assert type(block.router.scale) is nn.Parameter


def test_materialize_meta_keeps_real_tensors(poisoned_empty_like):
    block = meta_block()
    bias, counts = block.router.expert_bias, block.router.counts
    report = materialize_meta_(block, "cpu")
    assert block.router.expert_bias is bias and block.router.counts is counts
    assert torch.equal(block.router.expert_bias, torch.full((4,), 7.0))
    assert torch.equal(block.router.counts, torch.arange(4, dtype=torch.float32))
    assert no_meta_left(block)
    assert all(t.device.type == "cpu" for t in [*block.parameters(), *block.buffers()])
    assert isinstance(report, MaterializeReport)
    assert set(report.kept) == {"router.expert_bias", "router.counts"}
    # The tied weight is one tensor, counted once, under its first name.
    assert set(report.materialized) == {"embed.weight", "router.gate.weight", "router.scratch", "router.scale"}
    assert "materialized 4" in str(report) and "kept 2" in str(report) and "router.expert_bias" in str(report)


def test_materialize_meta_keeps_ties_subclass_and_flags():
    block = meta_block()
    block.router.gate.weight.tp_split_dim = 0  # a framework flag on the parameter
    block.router.gate.weight.requires_grad_(False)
    materialize_meta_(block, "cpu")
    assert block.head.weight is block.embed.weight
    assert isinstance(block.embed.weight, nn.Parameter) and block.embed.weight.requires_grad
    assert type(block.router.scale) is TaggedParameter and not block.router.scale.requires_grad
    gate_weight = block.router.gate.weight
    assert type(gate_weight) is nn.Parameter and not gate_weight.requires_grad
    assert gate_weight.tp_split_dim == 0
    names = dict(block.named_parameters())
    assert names["router.scale"] is block.router.scale  # still registered as a parameter, not a buffer


def test_materialize_meta_shared_buffer_and_submodule():
    with torch.device("meta"):
        shared = nn.Linear(2, 2)
        root = nn.Module()
        root.a, root.b = shared, nn.Module()
        root.b.inner = shared  # the same submodule reachable twice
        root.b.register_buffer("buf", torch.empty(3))
        root.register_buffer("same_buf", root.b.buf)  # the same buffer in two modules
    report = materialize_meta_(root, "cpu")
    assert root.b.inner is root.a and root.same_buf is root.b.buf
    assert no_meta_left(root)
    assert sorted(report.materialized) == ["a.bias", "a.weight", "same_buf"]


def test_materialize_meta_is_idempotent():
    block = meta_block()
    materialize_meta_(block, "cpu")
    before = {name: t for name, t in [*block.named_parameters(), *block.named_buffers()]}
    report = materialize_meta_(block, "cpu")
    assert report.materialized == ()
    assert all(t is before[name] for name, t in [*block.named_parameters(), *block.named_buffers()])


# --- real tensors on another device ----------------------------------------------------------------------------------
# A CPU-only torch has one device that holds values, so the "made on the CPU, materialized on CUDA" case is split:
# `same_device` (the decision) is tested on device names, with the current CUDA device faked; the move itself is
# tested by making `same_device` say "elsewhere", and unfaked towards the one other device CPU torch has, meta.
# scripts/megatron_fsdp_buffer_check.py runs the real CPU -> CUDA case on a GPU.


@pytest.mark.parametrize("tensor_device, target, same", [
    ("cpu", "cpu", True),
    ("cpu", "cpu:0", True),  # a CPU tensor's device has no index; "cpu:0" is the same device
    ("cpu", torch.device("cpu", 0), True),
    ("cpu", "meta", False),
    ("cpu", "cuda", False),
    ("meta", "meta", True),
    ("cuda:1", "cuda", True),  # "cuda" is the current device: 1 here
    ("cuda:0", "cuda", False),
    ("cuda:0", "cuda:0", True),
    ("cuda:0", torch.device("cuda", 1), False),
    ("cuda:0", "cpu", False),
])
def testsame_device_normalises_names(monkeypatch, tensor_device, target, same):
    monkeypatch.setattr(replacement, "_current_index", lambda device_type: {"cuda": 1}.get(device_type, 0))
    assert replacement.same_device(torch.device(tensor_device), target) is same


def testsame_device_with_both_indices_does_not_ask_for_the_current_device(monkeypatch):
    def current(device_type):
        raise AssertionError("the current device was looked up")

    monkeypatch.setattr(replacement, "_current_index", current)
    assert replacement.same_device(torch.device("cuda", 0), "cuda:1") is False
    assert replacement.same_device(torch.device("cuda", 1), torch.device("cuda", 1)) is True


def block_with_real_parameter() -> Block:
    block = meta_block()
    real = TaggedParameter(torch.full((3,), 2.0), requires_grad=False)
    real.tp_split_dim = 0  # a framework flag that must survive the move
    block.router.real = real
    block.alias = block.router.real  # registered twice: moved once, still one tensor
    return block


def test_real_tensors_elsewhere_are_moved_with_their_values(monkeypatch, poisoned_empty_like):
    monkeypatch.setattr(replacement, "same_device", lambda tensor_device, target: False)  # every real tensor elsewhere
    block = block_with_real_parameter()
    bias, real = block.router.expert_bias, block.router.real
    report = materialize_meta_(block, "cpu")
    assert set(report.moved) == {"router.expert_bias", "router.counts", "alias"}  # the first name of router.real
    assert report.kept == ()
    assert set(report.materialized) == {"embed.weight", "router.gate.weight", "router.scratch", "router.scale"}
    assert "moved 3 to the target device with their values" in str(report)
    # new tensors with the old values, the old ones not aliased
    assert block.router.expert_bias is not bias and block.router.expert_bias.data_ptr() != bias.data_ptr()
    assert torch.equal(block.router.expert_bias, torch.full((4,), 7.0))
    assert torch.equal(block.router.counts, torch.arange(4, dtype=torch.float32))
    assert "counts" not in block.router.state_dict()  # still a non-persistent buffer
    moved = block.router.real
    assert moved is not real and moved.data_ptr() != real.data_ptr()
    assert type(moved) is TaggedParameter and not moved.requires_grad and moved.tp_split_dim == 0
    assert torch.equal(moved, torch.full((3,), 2.0))
    assert block.alias is moved
    assert dict(block.named_parameters(remove_duplicate=False))["router.real"] is moved


def test_to_empty_moves_a_buffer_made_elsewhere(monkeypatch):
    monkeypatch.setattr(replacement, "same_device", lambda tensor_device, target: False)
    block = meta_block()
    with meta_only_to_empty():
        block.to_empty(device="cpu")
    assert torch.equal(block.router.expert_bias, torch.full((4,), 7.0))
    assert no_meta_left(block)


def test_every_tensor_ends_on_the_target_device():
    """Unfaked: towards meta, the one device besides the CPU that CPU-only torch has, real tensors move too."""
    block = block_with_real_parameter()
    report = materialize_meta_(block, "meta")
    assert all(t.is_meta for t in [*block.parameters(), *block.buffers()])
    assert set(report.moved) == {"router.expert_bias", "router.counts", "alias"}  # the first name of router.real
    assert report.kept == ()
    assert type(block.router.real) is TaggedParameter and block.router.real.tp_split_dim == 0
    assert block.alias is block.router.real and block.head.weight is block.embed.weight


def test_recurse_false_touches_only_own_tensors():
    block = meta_block()
    bias = block.router.expert_bias
    report = materialize_meta_(block.router, "cpu", recurse=False)
    assert not block.router.scratch.is_meta and not block.router.scale.is_meta
    assert block.router.gate.weight.is_meta and block.embed.weight.is_meta  # submodule and sibling untouched
    assert block.router.expert_bias is bias
    assert set(report.materialized) == {"scale", "scratch"}
    assert set(report.kept) == {"expert_bias", "counts"}


def test_context_manager_makes_to_empty_meta_only(poisoned_empty_like):
    block = meta_block()
    bias = block.router.expert_bias
    with meta_only_to_empty():
        assert nn.Module.to_empty is not STOCK_TO_EMPTY
        out = block.to_empty(device="cpu")
    assert out is block
    assert nn.Module.to_empty is STOCK_TO_EMPTY
    assert block.router.expert_bias is bias and torch.equal(bias, torch.full((4,), 7.0))
    assert no_meta_left(block)
    assert block.head.weight is block.embed.weight


def test_context_manager_recurse_false_like_megatron():
    block = meta_block()
    with meta_only_to_empty():
        for module in block.modules():  # megatron-fsdp walks modules and materializes each one alone
            module.to_empty(device="cpu", recurse=False)
    assert no_meta_left(block)
    assert torch.equal(block.router.expert_bias, torch.full((4,), 7.0))


def test_replacement_keeps_to_empty_signature():
    block = meta_block()
    bias = block.router.expert_bias
    with meta_only_to_empty():
        with pytest.raises(TypeError, match="positional argument"):
            block.to_empty("cpu")  # device is keyword-only, as in torch
        # device=None: stock reallocates each tensor where it is (meta stays meta); real tensors are still kept.
        assert block.to_empty(device=None) is block
    assert block.embed.weight.is_meta
    assert block.router.expert_bias is bias


def test_context_manager_restores_on_error():
    with pytest.raises(RuntimeError, match="boom"):
        with meta_only_to_empty():
            raise RuntimeError("boom")
    assert nn.Module.to_empty is STOCK_TO_EMPTY


def test_context_manager_nests():
    with meta_only_to_empty():
        patched = nn.Module.to_empty
        with meta_only_to_empty():
            assert nn.Module.to_empty is patched
        assert nn.Module.to_empty is patched  # the inner exit must not restore early
        block = meta_block()
        bias = block.router.expert_bias
        block.to_empty(device="cpu")
        assert block.router.expert_bias is bias
    assert nn.Module.to_empty is STOCK_TO_EMPTY


def test_context_manager_across_threads():
    barrier = threading.Barrier(4)
    seen = []

    def work():
        with meta_only_to_empty():
            barrier.wait()
            seen.append(nn.Module.to_empty is not STOCK_TO_EMPTY)
            barrier.wait()

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == [True] * 4
    assert nn.Module.to_empty is STOCK_TO_EMPTY


def test_patch_and_unpatch_are_idempotent():
    patch_to_empty()
    patched = nn.Module.to_empty
    patch_to_empty()
    assert nn.Module.to_empty is patched is not STOCK_TO_EMPTY
    with meta_only_to_empty():
        pass
    assert nn.Module.to_empty is patched  # a block closing does not undo an explicit patch
    unpatch_to_empty()
    unpatch_to_empty()
    assert nn.Module.to_empty is STOCK_TO_EMPTY


def test_unpatch_inside_block_keeps_block_active():
    with meta_only_to_empty():
        patch_to_empty()
        unpatch_to_empty()
        assert nn.Module.to_empty is not STOCK_TO_EMPTY
    assert nn.Module.to_empty is STOCK_TO_EMPTY


# --- torchtitan-style meta init --------------------------------------------------------------------------------------


class MoERouter(nn.Module):
    def __init__(self, dim: int, n_experts: int):
        super().__init__()
        self.gate = nn.Linear(dim, n_experts, bias=False)
        # Load-balancing bias: updated outside autograd, so a buffer; meant to start at zero.
        self.register_buffer("expert_bias", torch.zeros(n_experts, device="cpu"), persistent=True)


class TinyMoE(nn.Module):
    def __init__(self, dim: int = 8, n_experts: int = 4):
        super().__init__()
        self.router = MoERouter(dim, n_experts)
        self.w = nn.Parameter(torch.empty(n_experts, dim, dim))

    def init_weights(self) -> None:
        # Like torchtitan's init_weights: parameters only.
        nn.init.normal_(self.router.gate.weight, std=0.02)
        nn.init.normal_(self.w, std=0.02)


def torchtitan_init() -> TinyMoE:
    with torch.device("meta"):
        model = TinyMoE()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights()
    return model


def test_torchtitan_style_stock_init_leaves_nan_bias(poisoned_empty_like):
    model = torchtitan_init()
    assert torch.isnan(model.router.expert_bias).all()
    with pytest.warns(UserWarning, match=r"router\.expert_bias: 4 of 4 values are not finite"):
        assert check_buffers(model) == ["router.expert_bias"]


def test_torchtitan_style_init_keeps_zero_bias(poisoned_empty_like):
    with meta_only_to_empty():
        model = torchtitan_init()
    assert torch.equal(model.router.expert_bias, torch.zeros(4))
    assert torch.isfinite(model.router.gate.weight).all() and torch.isfinite(model.w).all()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_buffers(model) == []


def test_check_buffers_counts_and_skips():
    model = TinyMoE()
    model.w.data.zero_()  # `torch.empty` memory may hold non-finite values of its own: only the two set below count
    model.router.expert_bias[:3] = float("nan")
    model.w.data[0, 0, :2] = float("inf")
    model.register_buffer("ids", torch.zeros(3, dtype=torch.long))  # integers cannot be non-finite
    with torch.device("meta"):
        model.register_buffer("later", torch.empty(2))  # no values yet
    with pytest.warns(UserWarning) as record:
        bad = check_buffers(model)
    assert bad == ["router.expert_bias", "w"]
    assert len(record) == 1
    message = str(record[0].message)
    assert "router.expert_bias: 3 of 4 values are not finite" in message
    assert "w: 2 of 256 values are not finite" in message
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_buffers(model, warn=False) == ["router.expert_bias", "w"]


# --- FSDP2 (DTensor parameters) --------------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:DTensor random operators")
def test_fsdp2_meta_init_keeps_buffer_and_dtensor_params(poisoned_empty_like, tmp_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    assert dist.is_available() and dist.is_gloo_available()  # the CPU build the project installs has both
    assert not dist.is_initialized(), "an earlier test left a process group behind"
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with torch.device("meta"):
            model = TinyMoE()
        fully_shard(model.router, mesh=init_device_mesh("cpu", (1,)))
        weight = model.router.gate.weight
        assert isinstance(weight, DTensor) and weight.is_meta
        with meta_only_to_empty():
            model.to_empty(device="cpu")
        # FSDP2 holds the DTensor parameter object, so it must be filled in place, not replaced.
        assert model.router.gate.weight is weight and not weight.is_meta
        assert isinstance(weight, DTensor) and isinstance(weight, nn.Parameter)
        assert torch.equal(model.router.expert_bias, torch.zeros(4))
        with torch.no_grad():
            model.init_weights()
        assert check_buffers(model, warn=False) == []
    finally:
        dist.destroy_process_group()


# --- megatron-fsdp ---------------------------------------------------------------------------------------------------


def test_patch_megatron_fsdp_without_megatron_is_a_noop(monkeypatch):
    monkeypatch.setitem(sys.modules, "megatron_fsdp", None)  # makes the import fail like a missing package
    with pytest.warns(UserWarning, match="megatron-fsdp is not installed"):
        assert patch_megatron_fsdp() is False
    assert nn.Module.to_empty is STOCK_TO_EMPTY


@pytest.fixture
def fake_megatron(monkeypatch):
    monkeypatch.setitem(sys.modules, "megatron_fsdp", types.ModuleType("megatron_fsdp"))

    def set_version(version: str) -> None:
        monkeypatch.setattr(mat, "_distribution_version", lambda name: version)

    return set_version


@pytest.mark.parametrize("version", ["0.6.1", "0.6.3"])
def test_patch_megatron_fsdp_accepts_known_minor(fake_megatron, version):
    fake_megatron(version)
    assert patch_megatron_fsdp() is True
    assert nn.Module.to_empty is not STOCK_TO_EMPTY
    assert patch_megatron_fsdp() is True  # idempotent
    block = meta_block()
    bias = block.router.expert_bias
    for module in block.modules():
        module.to_empty(device="cpu", recurse=False)
    assert block.router.expert_bias is bias
    unpatch_to_empty()
    assert nn.Module.to_empty is STOCK_TO_EMPTY


@pytest.mark.parametrize("version", ["0.9.0", "0.5.1", "1.6.1"])
def test_patch_megatron_fsdp_refuses_other_versions(fake_megatron, version):
    fake_megatron(version)
    with pytest.raises(ReshardError, match=r"megatron-fsdp " + version.replace(".", r"\.") + r".*0\.6\.x") as info:
        patch_megatron_fsdp()
    assert "0.6.1" in str(info.value)
    assert nn.Module.to_empty is STOCK_TO_EMPTY


def test_patch_megatron_fsdp_falls_back_to_module_version(fake_megatron, monkeypatch):
    def missing(name):
        raise mat.importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(mat, "_distribution_version", missing)
    monkeypatch.setattr(sys.modules["megatron_fsdp"], "__version__", "0.7.0", raising=False)
    with pytest.raises(ReshardError, match=r"0\.7\.0"):
        patch_megatron_fsdp()
    monkeypatch.setattr(sys.modules["megatron_fsdp"], "__version__", "0.6.1")
    assert patch_megatron_fsdp() is True
