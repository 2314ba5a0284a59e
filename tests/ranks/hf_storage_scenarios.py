"""Rank script: the DTensor scenarios of torch's own HF storage tests, loaded with `reshard.StorageReader` and, for
reference, with torch's `HuggingFaceStorageReader`, on 4 gloo ranks.

usage: hf_storage_scenarios.py REPORT_DIR
Each scenario saves a [4, 4] (or [1]) tensor with torch's `HuggingFaceStorageWriter` (one file per rank) on one
mesh and placements, loads it on another with each reader (keyword `path=`, and `thread_count=2`), and records
whether the loaded tensor, gathered whole, equals the saved one bit for bit. REPORT_DIR/rank{r}.json holds, per
scenario and reader, `equal` or `error`.
"""

import os
import sys

import torch
import torch.distributed as dist

from rank_report import finish, record_failure


def _scenarios():
    from torch.distributed.tensor import Replicate, Shard

    one_d = [[Shard(0)], [Replicate()]]
    two_d = [[Replicate(), Replicate()], [Replicate(), Shard(0)], [Shard(0), Replicate()], [Shard(0), Shard(0)]]
    cases = []
    for a in one_d:
        for b in one_d:
            if a != b:
                cases.append(("1d->1d", (4,), a, (4,), b, 4))
    for a in two_d:
        for b in two_d:
            if a != b:
                cases.append(("2d->2d", (2, 2), a, (2, 2), b, 4))
    cases += [("1d->2d", (4,), a, (2, 2), b, 4) for a in one_d for b in two_d]
    cases += [("2d->1d", (2, 2), a, (4,), b, 4) for a in two_d for b in one_d]
    # torch's empty-shard case: one element over 4 ranks leaves three empty, loaded onto a 2-D mesh
    cases.append(("empty shard", (4,), [Shard(0)], (2, 2), [Shard(0), Shard(0)], 1))
    return cases


def _sharded() -> dict:
    """The writer's one-file-per-rank flag: `save_distributed` in torch 2.13-2.15, `save_sharded` in later code."""
    import inspect

    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    names = inspect.signature(HuggingFaceStorageWriter.__init__).parameters
    return {"save_distributed": True} if "save_distributed" in names else {"save_sharded": True}


def _run(case, folder, reader_name):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor, zeros

    import reshard

    label, save_shape, save_placements, load_shape, load_placements, n = case
    whole = torch.arange(16, dtype=torch.float).view(4, 4) if n == 4 else torch.tensor([0.625])
    save_mesh = init_device_mesh("cpu", save_shape)
    saved = {"dtensor": distribute_tensor(whole, save_mesh, placements=save_placements)}
    dcp.save(saved, storage_writer=HuggingFaceStorageWriter(path=folder, **_sharded()))
    load_mesh = init_device_mesh("cpu", load_shape)
    state = {"dtensor": zeros(list(whole.shape), device_mesh=load_mesh, placements=load_placements)}
    reader = (reshard.StorageReader(path=folder, thread_count=2) if reader_name == "reshard"
              else HuggingFaceStorageReader(path=folder, thread_count=2))
    dcp.load(state, storage_reader=reader)
    gathered = state["dtensor"].redistribute(load_mesh, placements=[Replicate()] * len(load_shape)).to_local()
    return torch.equal(gathered, whole)


def main(report_dir):
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    report = {"rank": rank, "results": {}}
    try:
        for i, case in enumerate(_scenarios()):
            for reader_name in ("reshard", "torch"):
                folder = os.path.join(report_dir, f"case{i}-{reader_name}")
                key = f"{case[0]} {case[2]} -> {case[4]} [{reader_name}]"
                try:
                    report["results"][key] = "equal" if _run(case, folder, reader_name) else "differs"
                except Exception as e:  # recorded per scenario: the test names each one that fails
                    report["results"][key] = f"error: {type(e).__name__}: {str(e)[:300]}"
                dist.barrier()
    except BaseException as e:
        record_failure(report, e)
    finish(report_dir, report)


if __name__ == "__main__":
    main(sys.argv[1])
