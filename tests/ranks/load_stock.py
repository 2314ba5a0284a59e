"""Rank script: load a `reshard write --layout stock` folder with STOCK transformers (no reshard patch) and check it.

Usage (under torchrun): load_stock.py SRC OUT FSDP EP REPORT_DIR

Each rank
- records what torch's `HuggingFaceStorageReader.read_data` reads: per file, the bytes of every read item
  (`prod(lengths) * itemsize`), taken from the load plan before any data is read;
- loads OUT with `AutoModelForCausalLM.from_pretrained(OUT, distributed_config=DistributedConfig(...))`;
- compares every local tensor (`to_local()`) bit-exactly with the slice of a single-process load of SRC that the
  written plan (manifest placements, `reshard.plan._placement.local_box`) assigns to its coordinate;
- writes `REPORT_DIR/rank{r}.json`. Mismatches are reported, not raised, so the test sees every one.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: `reshard` without installing it

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402


def main() -> None:
    src, out, fsdp, ep, report_dir = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5])
    rank = int(os.environ["RANK"])

    reads: dict[str, int] = {}
    items: list[list] = []
    stock_read_data = HuggingFaceStorageReader.read_data

    def recording_read_data(self, plan, planner):
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            nbytes = math.prod(item.lengths) * info.dtype.itemsize
            name = os.path.basename(info.relative_path)
            reads[name] = reads.get(name, 0) + nbytes
            items.append([item.storage_index.fqn, name, list(item.lengths)])
        return stock_read_data(self, plan, planner)

    HuggingFaceStorageReader.read_data = recording_read_data

    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    kwargs = {"fsdp_size": fsdp}
    if ep > 1:
        kwargs["ep_size"] = ep
    model = AutoModelForCausalLM.from_pretrained(out, distributed_config=DistributedConfig(**kwargs), use_kernels=False)
    HuggingFaceStorageReader.read_data = stock_read_data

    from reshard import read_manifest
    from reshard.plan import local_box

    manifest = read_manifest(out)
    mesh = manifest.mesh
    coord = mesh.coord_of(rank)
    reference = AutoModelForCausalLM.from_pretrained(src, use_kernels=False).state_dict()

    problems, checked, empty_locals = [], 0, []
    uninitialized = []
    state = model.state_dict(keep_vars=True)
    for name, info in manifest.tensors.items():
        if name not in state:
            problems.append(f"{name}: not in the loaded model's state dict")
            continue
        value = state[name]
        if not getattr(value, "_is_hf_initialized", False):
            uninitialized.append(name)
        local = value.to_local() if isinstance(value, DTensor) else value
        box = local_box(info.shape, info.placement, mesh, coord)
        ref = reference[name]
        if any(n == 0 for _, n in box):
            expected = ref.new_empty([n for _, n in box])
            empty_locals.append(name)
        else:
            expected = ref[tuple(slice(o, o + n) for o, n in box)]
        local = local.detach()
        if local.dtype != expected.dtype or tuple(local.shape) != tuple(expected.shape):
            problems.append(f"{name}: local {local.dtype} {list(local.shape)}, expected {expected.dtype} "
                            f"{list(expected.shape)} (box {box})")
        elif not torch.equal(local, expected):
            problems.append(f"{name}: local values differ from the reference slice {box}")
        checked += 1
    extra = sorted(set(state) - set(manifest.tensors))
    if extra:
        problems.append(f"state-dict keys the manifest lacks: {extra[:5]}")

    report = {"rank": rank, "coord": coord, "problems": problems, "checked": checked, "empty_locals": empty_locals,
              "uninitialized": uninitialized, "reads": reads, "items": items,
              "world": dist.get_world_size() if dist.is_initialized() else 1}
    report_dir.mkdir(parents=True, exist_ok=True)
    (report_dir / f"rank{rank}.json").write_text(json.dumps(report, indent=1))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
