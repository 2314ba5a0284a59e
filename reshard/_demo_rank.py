"""One rank of `reshard demo`: load the folder with reshard's loader, check it, report what this rank read.

usage: python -m torch.distributed.run ... -m reshard._demo_rank OUT SRC REPORT_DIR
"""

from __future__ import annotations

import json
import math
import os
import sys


def _count_reads():
    """Record the files and tensor bytes this rank reads: reshard's own-file reads, or `dcp.load`'s reader where the
    loader falls back to it."""
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader

    import reshard.local_read as local_read

    seen = {"files": set(), "bytes": 0}
    read_file = local_read.read_file

    def counted_read_file(job, *args, **kwargs):
        seen["files"].add(job.path.name)
        seen["bytes"] += sum(read.entry.nbytes for read in job.reads)
        return read_file(job, *args, **kwargs)

    local_read.read_file = counted_read_file
    original = HuggingFaceStorageReader.read_data

    def read_data(self, plan, planner):
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            seen["files"].add(os.path.basename(info.relative_path))
            seen["bytes"] += math.prod(item.lengths) * info.dtype.itemsize
        return original(self, plan, planner)

    HuggingFaceStorageReader.read_data = read_data
    return seen


def main() -> None:
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
        reference = AutoModelForCausalLM.from_pretrained(src).state_dict()
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
