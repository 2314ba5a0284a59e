"""What the rank scripts share: each rank writes REPORT_DIR/rank{r}.json, which the test reads and asserts on."""

import json
import os
import traceback


def record_failure(report: dict, error: BaseException, limit: int = 3000) -> None:
    """Put `error` and the end of its traceback into `report` (the test prints them)."""
    report["error"] = f"{type(error).__name__}: {error}"
    report["traceback"] = traceback.format_exc()[-limit:]


def save(report_dir, report: dict) -> None:
    with open(os.path.join(report_dir, f"rank{report['rank']}.json"), "w") as f:
        json.dump(report, f)


def finish(report_dir, report: dict, code: int = 0) -> None:
    """Save the report, then leave the process group together (a rank tearing gloo down while a peer still runs its
    last collective can abort that peer) and end the process at once.

    The report is the test's whole verdict, so nothing after it may fail a rank: a gloo work object still referenced
    while the interpreter is torn down aborts the process (`terminate called without an active exception`, exit -6;
    pytorch/pytorch#179291), as one of 4 ranks of dcp_load.py did once in CI after a complete run. `os._exit` skips
    that teardown; what it would flush is flushed here first. `code`: the exit status."""
    import gc
    import sys

    import torch.distributed as dist

    save(report_dir, report)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    gc.collect()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
