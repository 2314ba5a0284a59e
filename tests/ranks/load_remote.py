"""Rank script: load a reshard folder from an object store and report what each rank got.

usage: load_remote.py URL SRC REPORT_DIR
Each rank loads with `reshard.from_pretrained(URL)`, reading S3 as access key `rank{r}` (the test's server logs which
rank asked for which object), checks every tensor against a one-process transformers load of SRC and writes
REPORT_DIR/rank{r}.json (the error, if any, with its traceback, and how long the load took).
"""

import os
import sys
import time

import torch

from rank_report import finish, record_failure


def main():
    url, src, report_dir = sys.argv[1:4]
    rank = int(os.environ["RANK"])
    os.environ["AWS_ACCESS_KEY_ID"] = f"rank{rank}"  # the server's log tells the ranks apart by it
    report = {"rank": rank}
    started = time.monotonic()
    try:
        import reshard
        from transformers import AutoModelForCausalLM

        model = reshard.from_pretrained(url)  # creates the process group from torchrun's environment
        report["seconds"] = time.monotonic() - started
        reference = AutoModelForCausalLM.from_pretrained(src, use_kernels=False).state_dict()
        report["mismatched"] = [n for n, t in model.state_dict().items()
                                if not torch.equal(t.full_tensor() if hasattr(t, "full_tensor") else t, reference[n])]
        report["tensors"] = len(reference)
    except Exception as e:  # the test reads it
        report["seconds"] = time.monotonic() - started
        record_failure(report, e)
    # a failed load has destroyed the group it made: no barrier then
    finish(report_dir, report, code=3 if "error" in report else 0)


if __name__ == "__main__":
    main()
