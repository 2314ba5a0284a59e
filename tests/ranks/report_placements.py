"""Rank script: load a `reshard write --layout stock` folder with STOCK transformers and report every parameter's
DTensor placements, local shape and global offset as torch computes them.

Usage (under torchrun, gloo on CPU): report_placements.py OUT REPORT_DIR FSDP EP

Writes `REPORT_DIR/rank{r}.json`:
    {"rank": r, "world": w,
     "params": {name: {"placements": [...], "mesh_dims": [...], "mesh_shape": [...], "global_shape": [...],
                       "local_shape": [...], "global_offset": [...], "actual_local_shape": [...],
                       "initialized": bool, "sha256": hex of the local tensor's bytes}},
     "buffers": {name: {"dtensor": bool, "shape": [...], "sha256": ...}}}   (persistent buffers only)
Nothing from reshard is imported: this is what stock transformers + torch do with the folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path


def placement_name(p) -> str:
    """A placement as a string that keeps the split factor of `_StridedShard` (its repr differs across versions)."""
    from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

    if isinstance(p, _StridedShard):
        return f"_StridedShard({p.dim}, sf={p.split_factor})"
    if isinstance(p, Shard):
        return f"Shard({p.dim})"
    if isinstance(p, Replicate):
        return "Replicate()"
    return repr(p)


def digest(t) -> str:
    import torch

    return hashlib.sha256(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def main() -> None:
    out, report_dir, fsdp, ep = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    torch.manual_seed(0)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    kwargs = {"fsdp_size": fsdp}
    if ep > 1:
        kwargs["ep_size"] = ep
    model = AutoModelForCausalLM.from_pretrained(out, distributed_config=DistributedConfig(**kwargs), use_kernels=False)
    params = {}
    for name, p in model.named_parameters():
        entry = {"global_shape": list(p.shape), "initialized": bool(getattr(p, "_is_hf_initialized", False))}
        if isinstance(p, DTensor):
            shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
            entry.update(
                placements=[placement_name(q) for q in p.placements],
                mesh_dims=list(p.device_mesh.mesh_dim_names or ()),
                mesh_shape=list(p.device_mesh.shape),
                local_shape=list(shape),
                global_offset=list(offset),
                actual_local_shape=list(p.to_local().shape),
                sha256=digest(p.to_local()),
            )
        else:
            entry.update(placements=None, local_shape=list(p.shape), global_offset=[0] * p.dim(), sha256=digest(p))
        params[name] = entry
    persistent = set(model.state_dict())
    buffers = {name: {"dtensor": isinstance(b, DTensor), "shape": list(b.shape),
                      "sha256": digest(b.to_local() if isinstance(b, DTensor) else b)}
               for name, b in model.named_buffers() if name in persistent}
    report_dir.mkdir(parents=True, exist_ok=True)
    tmp = report_dir / f".rank{rank}.json.tmp"
    tmp.write_text(json.dumps({"rank": rank, "world": world, "params": params, "buffers": buffers}, indent=1))
    os.replace(tmp, report_dir / f"rank{rank}.json")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
