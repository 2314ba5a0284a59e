"""One rank of `reshard demo`: load the folder with reshard's loader, check it, report what this rank read.

usage: python -m torch.distributed.run ... -m reshard._demo_rank OUT SRC REPORT_DIR
"""

from __future__ import annotations

import json
import math
import os
import sys


def _count_reads():
    """Record the files and tensor bytes this rank reads through `dcp.load`'s storage reader: reshard's (the loader's
    path), or torch's where something loads with it."""
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader

    from reshard.load import StorageReader

    seen = {"files": set(), "bytes": 0}

    def counted(original):
        def read_data(self, plan, planner):
            for item in plan.items:
                info = self.storage_data[item.storage_index]
                seen["files"].add(os.path.basename(info.relative_path))
                seen["bytes"] += math.prod(item.lengths) * info.dtype.itemsize
            return original(self, plan, planner)

        return read_data

    # torch's reader, and reshard's own (the loader's path), which overrides read_data
    for reader in (HuggingFaceStorageReader, StorageReader):
        reader.read_data = counted(reader.read_data)
    return seen


def main() -> None:
    if os.environ.get("LOCAL_RANK") == "0":  # the driver echoes these lines: the imports take seconds per rank
        print("reshard demo: the ranks started; importing torch and transformers", file=sys.stderr, flush=True)
    import torch
    import torch.distributed as dist

    out, src, report_dir = sys.argv[1:4]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    report: dict = {"rank": rank}
    try:
        import reshard
        from transformers import AutoModelForCausalLM

        reads = _count_reads()
        model = reshard.from_pretrained(out)
        if rank == 0:
            print("reshard demo: comparing every tensor with a single-process load of the source", file=sys.stderr,
                  flush=True)
        reference = AutoModelForCausalLM.from_pretrained(src, use_kernels=False).state_dict()
        mismatched, experts = [], {}
        for name, tensor in model.state_dict().items():
            full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
            if not torch.equal(full, reference[name]):
                mismatched.append(name)
            if ".experts." in name and hasattr(tensor, "to_local"):
                experts[name] = list(tensor.to_local().shape)
        uninitialized = [n for n, p in model.named_parameters() if not getattr(p, "_is_hf_initialized", False)]
        report.update(files=sorted(reads["files"]), bytes=reads["bytes"], mismatched=mismatched,
                      uninitialized=uninitialized, experts=experts, tensors=len(reference))
    except Exception as e:  # reported to the driver, which prints it
        report["error"] = f"{type(e).__name__}: {e}"
    with open(os.path.join(report_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    # every rank done with the group before any tears it down: a rank destroying gloo while a peer still finishes
    # its last collective can abort that peer (seen once as SIGABRT on one rank)
    dist.barrier()
    dist.destroy_process_group()
    if "error" in report:
        sys.exit(1)


if __name__ == "__main__":
    main()
