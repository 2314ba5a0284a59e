#!/usr/bin/env python
"""Show megatron-fsdp's meta-device init wiping an off-meta buffer, and reshard.patch_megatron_fsdp() keeping it.

Needs one CUDA device and megatron-fsdp (0.6.x); not run in CI. Each run:

1. fills the CUDA caching allocator's free blocks with NaN (allocate, fill, free), so uninitialized memory shows up;
2. builds a small MoE-like model under `torch.device("meta")` whose router has a zero `expert_bias` buffer created
   with an explicit `device="cuda"` (a real tensor, not meta);
3. wraps it with `megatron_fsdp.fully_shard_model(..., init_model_with_meta_device=True)`, which calls
   `router.to_empty(device=..., recurse=False)` and then `router.reset_parameters()`;
4. reports whether `expert_bias` is still the same all-zero tensor.

The stock run is expected to replace the buffer (its address changes; its values are whatever the allocator had,
NaN when the dirty block is reused); the patched run must keep it. The patched mode also checks, without
megatron-fsdp, that a buffer made on the CPU ends on CUDA with its values after `to_empty(device="cuda")` under
`reshard.meta_only_to_empty()`, and that a forward pass then runs. Exit status: 0 when the patched checks passed
(or, with `--mode stock`, always after reporting), 1 when one did not, 2 when CUDA or megatron-fsdp is missing.

Usage (world size 1; torchrun's variables are honoured when present):

    python scripts/megatron_fsdp_buffer_check.py               # stock, then patched, in one process
    python scripts/megatron_fsdp_buffer_check.py --mode patched
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
from pathlib import Path


def _import_reshard():
    try:
        import reshard.load._materialize as materialize
    except ImportError:
        # Running from a checkout without the package installed: the repository root is the script's parent's parent.
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        import reshard.load._materialize as materialize
    return materialize


def _fail_setup(message: str) -> None:
    print(f"megatron_fsdp_buffer_check: {message}", file=sys.stderr)
    raise SystemExit(2)


def build_model(dim: int, n_experts: int, n_blocks: int, device):
    import torch
    from torch import nn

    class Router(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.empty(n_experts, dim))
            # Explicit device: a real, zero-filled tensor even under torch.device("meta"), as MoE routers do it.
            self.register_buffer("expert_bias", torch.zeros(n_experts, device=device), persistent=True)

        def reset_parameters(self):
            # Parameters only: the buffer is expected to keep its zeros.
            nn.init.normal_(self.weight, std=0.02)

        def forward(self, x):
            return x @ self.weight.t() + self.expert_bias

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.router = Router()
            self.proj = nn.Linear(dim, dim)

        def forward(self, x):
            return self.proj(x), self.router(x)

    with torch.device("meta"):
        model = nn.Sequential(*[Block() for _ in range(n_blocks)])
    return model, Block


def dirty_allocator(device, large_mib: int) -> None:
    """Leave NaN in the caching allocator's free blocks, in both its small (<= 1 MiB) and large pools."""
    import torch

    nan = float("nan")
    small = [torch.full((n,), nan, device=device) for n in (64, 256, 1024, 16384, 262144) for _ in range(32)]
    large = torch.full((large_mib * 2**18,), nan, device=device)
    torch.cuda.synchronize(device)
    del small, large  # freed to the cache, not to the driver: the NaN stay in the blocks


def run_once(label: str, args, device, megatron_fsdp, materialize) -> bool:
    """One wrap of a fresh model; True when every router kept its zero buffer in place."""
    import torch

    dirty_allocator(device, args.dirty_mib)
    model, block_cls = build_model(args.dim, args.experts, args.blocks, device)
    routers = [block.router for block in model]
    before = [(r.expert_bias, r.expert_bias.data_ptr()) for r in routers]

    kwargs = dict(
        module=model,
        fsdp_unit_modules=[block_cls],
        zero_dp_strategy="optim_grads_params",
        init_model_with_meta_device=True,
    )
    accepted = inspect.signature(megatron_fsdp.fully_shard_model).parameters
    fsdp_model = megatron_fsdp.fully_shard_model(**{k: v for k, v in kwargs.items() if k in accepted})
    torch.cuda.synchronize(device)

    intact = True
    for i, (router, (old, old_ptr)) in enumerate(zip(routers, before)):
        bias = router.expert_bias
        nonfinite = int((~torch.isfinite(bias)).sum())
        nonzero = int((bias != 0).sum())
        same = bias is old and bias.data_ptr() == old_ptr
        ok = same and nonzero == 0 and nonfinite == 0
        intact &= ok
        print(
            f"[{label}] block {i} expert_bias: {'same tensor' if same else 'REPLACED'}, "
            f"{nonfinite} of {bias.numel()} not finite, {nonzero} non-zero -> {'intact' if ok else 'LOST'}"
        )
    flagged = materialize.check_buffers(fsdp_model.module, warn=False)
    print(f"[{label}] check_buffers: {flagged or 'clean'}")
    del fsdp_model, model, routers, before
    return intact


def check_cpu_buffer_moved(device, materialize) -> bool:
    """A router whose `expert_bias` was made on the CPU: after a meta-only `to_empty(device="cuda")` every tensor
    must be on `device` (the current CUDA device) and the buffer must keep its values, so a forward pass runs."""
    import torch
    from torch import nn

    values = torch.arange(8, dtype=torch.float32)
    with torch.device("meta"):
        router = nn.Linear(16, 8, bias=False)
        router.register_buffer("expert_bias", values.clone(), persistent=True)  # made on the CPU on purpose
    resident = torch.ones(8, device=device)
    router.register_buffer("resident", resident)  # already on the target: must stay the same tensor
    with materialize.meta_only_to_empty():
        router.to_empty(device="cuda")  # no index: the current device, set to `device` by main()
    nn.init.normal_(router.weight, std=0.02)
    bias = router.expert_bias
    placed = bias.device == device and router.weight.device == device
    kept = placed and torch.equal(bias.cpu(), values)
    same = router.resident is resident
    try:
        router(torch.ones(2, 16, device=device)) + router.expert_bias
        forward = True
    except RuntimeError as e:  # e.g. "Expected all tensors to be on the same device"
        print(f"[moved] forward failed: {e}")
        forward = False
    ok = placed and kept and same and forward
    print(f"[moved] CPU-made expert_bias on {bias.device} ({'values kept' if kept else 'VALUES LOST'}), weight on "
          f"{router.weight.device}, resident buffer {'same tensor' if same else 'REPLACED'}, forward "
          f"{'ran' if forward else 'FAILED'} -> {'PASS' if ok else 'FAIL'}")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("stock", "patched", "both"), default="both")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--experts", type=int, default=160)
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--dirty-mib", type=int, default=512, help="size of the NaN block left in the large pool")
    args = parser.parse_args()

    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        _fail_setup("PyTorch is not installed")
    if not torch.cuda.is_available():
        _fail_setup("no CUDA device is available; this check needs one GPU")
    try:
        import megatron_fsdp
    except ImportError as e:
        _fail_setup(f"megatron-fsdp is not importable ({e}); install it with `pip install megatron-fsdp==0.6.1`")
    if not hasattr(megatron_fsdp, "fully_shard_model"):
        _fail_setup(f"this megatron_fsdp ({getattr(megatron_fsdp, '__version__', '?')}) has no fully_shard_model")
    materialize = _import_reshard()
    from reshard.errors import ReshardError

    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500"), ("RANK", "0"), ("WORLD_SIZE", "1"),
                       ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl")
    print(f"torch {torch.__version__}, megatron_fsdp {getattr(megatron_fsdp, '__version__', '?')}, "
          f"{torch.cuda.get_device_name(device)}, world size {dist.get_world_size()}")

    status = 0
    try:
        if args.mode in ("stock", "both"):
            if not run_once("stock", args, device, megatron_fsdp, materialize):
                print("[stock] the buffer was lost, as expected without the patch")
            else:
                print("[stock] the buffer survived: megatron-fsdp no longer calls to_empty on it here, "
                      "or this version materializes differently")
        if args.mode in ("patched", "both"):
            moved = check_cpu_buffer_moved(device, materialize)
            try:
                applied = materialize.patch_megatron_fsdp()
            except ReshardError as e:
                print(f"[patched] refused: {e}")
                return 1
            if not applied:
                print("[patched] patch_megatron_fsdp() did not apply")
                return 1
            try:
                kept = run_once("patched", args, device, megatron_fsdp, materialize)
            finally:
                materialize.unpatch_to_empty()
            print(f"[patched] {'PASS: the buffer is intact' if kept else 'FAIL: the buffer was lost'}")
            status = 0 if kept and moved else 1
    finally:
        dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
