"""Rank script: load a reshard folder the way users launch it, with no `init_process_group` of its own.

usage: load_env.py MODE FOLDER SRC REPORT_DIR
MODE: `reshard` (reshard.from_pretrained(FOLDER)) or `patched` (reshard.patch_transformers(), then transformers'
own AutoModelForCausalLM.from_pretrained(FOLDER) with no distributed_config). FOLDER may hold `{rank}`, replaced by
this rank's number (node-local copies). SRC `-` skips the comparison with a single-process load of the source.

The process group comes from the launcher's environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT), created by
reshard as transformers would. Each rank writes REPORT_DIR/rank{r}.json: the error if any (and seconds to it), the
parameters that differ from the source, whether logits match, every file it opened under the test's folder
while loading, and on the machine's monotonic clock when its imports were done (`loading_at`) and when it stopped
with an error (`ended_at`). It exits 3 on an error, without any barrier: a rank must never need the others to stop.

RESHARD_TEST_DENY: a path whose opening fails with EACCES, as for a non-root user without read permission (tests
run as root, which chmod cannot stop).
"""

import builtins
import errno
import json
import os
import sys
import time
import traceback


def main():
    start = time.monotonic()
    mode, folder, src, report_dir = sys.argv[1:5]
    rank = int(os.environ["RANK"])
    folder = folder.replace("{rank}", str(rank))
    report = {"rank": rank, "world": int(os.environ["WORLD_SIZE"])}
    deny = os.environ.get("RESHARD_TEST_DENY")
    if deny:
        real_open = builtins.open

        def open_denying(file, *args, **kwargs):
            if os.path.realpath(os.fspath(file)) == os.path.realpath(deny):
                raise PermissionError(errno.EACCES, "Permission denied", os.fspath(file))
            return real_open(file, *args, **kwargs)

        builtins.open = open_denying
    watch = os.path.realpath(os.environ.get("RESHARD_TEST_WATCH", "/nonexistent"))
    opened = set()

    def audit(event, args):
        if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
            path = os.path.realpath(os.fsdecode(args[0]))
            if path.startswith(watch + os.sep):
                opened.add(os.path.relpath(path, watch))

    sys.addaudithook(audit)
    try:
        import torch
        import torch.distributed.checkpoint  # noqa: F401
        # imported before the clock starts (transformers imports its model code lazily, inside from_pretrained): on
        # a busy machine imports take long, and the clock times the load's own steps
        __import__("transformers.modeling_utils")
        from transformers import AutoModelForCausalLM

        import reshard
        import reshard.load._loader  # noqa: F401

        report["loading_at"] = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process of the machine
        if mode == "reshard":
            model = reshard.from_pretrained(folder)
        else:
            reshard.patch_transformers()
            model = AutoModelForCausalLM.from_pretrained(folder)
        report["opened"] = sorted(opened)
        watch = "/nonexistent"  # the reference load below reads the source: not the rank's files
        report["is_dtensor"] = any(hasattr(t, "full_tensor") for t in model.state_dict().values())
        if src != "-":
            reference = AutoModelForCausalLM.from_pretrained(src, use_kernels=False)
            ref_state = reference.state_dict()
            state = model.state_dict()
            report["keys_equal"] = sorted(state) == sorted(ref_state)
            report["mismatched"] = [n for n, t in state.items()
                                    if not torch.equal(t.full_tensor() if hasattr(t, "full_tensor") else t,
                                                       ref_state[n])]
            ids = torch.tensor([[1, 5, 9, 33, 7, 2, 100, 42]])
            with torch.no_grad():
                diff = (model(ids).logits - reference(ids).logits).abs().max()
            report["logits_max_abs_diff"] = float(diff)
    except BaseException as e:  # report everything: the test asserts on it
        report["error"] = f"{type(e).__name__}: {e}"
        report["traceback"] = traceback.format_exc()[-3000:]
        import torch.distributed as dist

        report["group_left_up"] = dist.is_initialized()  # reshard created it: a failed load must destroy it
        report["seconds"] = time.monotonic() - start
        report["ended_at"] = time.monotonic()
        with open(os.path.join(report_dir, f"rank{rank}.json"), "w") as f:
            json.dump(report, f)
        os._exit(3)
    report["seconds"] = time.monotonic() - start
    with open(os.path.join(report_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
