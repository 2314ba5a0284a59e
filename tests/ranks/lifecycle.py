"""Rank script: the training lifecycle of issue 14 on a gloo mesh, for several models in one launch.

usage: lifecycle.py train REPORT_DIR (FOLDER SAVE_DIR TRAINED_FILE)...
       lifecycle.py load  REPORT_DIR (FOLDER TRAINED_FILE)...

`train`: per model, `reshard.from_pretrained(FOLDER)` (the mesh comes from its reshard.json), one SGD step, then
`save_pretrained(SAVE_DIR, distributed_checkpoint=True)`; rank 0 writes every tensor's `full_tensor()` (the trained
model, gathered) to TRAINED_FILE (safetensors). `load`: per model, `reshard.from_pretrained(FOLDER)` and every
tensor's `full_tensor()` compared with TRAINED_FILE with `torch.equal`. Each rank writes REPORT_DIR/rank{r}.json
(`error` with the traceback on failure, else `mismatched` per model) and exits non-zero on error.
"""

import os
import sys

import torch
import torch.distributed as dist

from rank_report import finish, record_failure, save


def full_state(model) -> dict:
    return {name: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()
            for name, t in model.state_dict().items()}


def train(rank, folder, save_dir, trained_file, report):
    import reshard
    from safetensors.torch import save_file

    model = reshard.from_pretrained(folder)
    before = full_state(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    ids = torch.tensor([[1, 5, 9, 33, 7, 2, 100, 42]])
    model(ids, labels=ids).loss.backward()
    optimizer.step()
    after = full_state(model)
    report.setdefault("changed", []).append(sum(not torch.equal(before[n], after[n]) for n in after))
    model.save_pretrained(save_dir, distributed_checkpoint=True)
    if rank == 0:
        save_file({n: t.contiguous() for n, t in after.items()}, trained_file)
    dist.barrier()


def load(rank, folder, trained_file, report):
    import reshard
    from safetensors.torch import load_file

    model = reshard.from_pretrained(folder)
    trained = load_file(trained_file)
    state = full_state(model)
    mismatched = sorted(set(state) ^ set(trained))
    mismatched += [n for n in state if n in trained and (state[n].dtype != trained[n].dtype
                                                          or not torch.equal(state[n], trained[n]))]
    report.setdefault("mismatched", []).append(mismatched)


def main():
    phase, report_dir, *args = sys.argv[1:]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    report = {"rank": rank}
    try:
        step = 3 if phase == "train" else 2
        for i in range(0, len(args), step):
            (train if phase == "train" else load)(rank, *args[i:i + step], report)
    except BaseException as e:  # report everything: the test asserts on it
        record_failure(report, e)
        save(report_dir, report)
        os._exit(3)
    finish(report_dir, report)


if __name__ == "__main__":
    main()
