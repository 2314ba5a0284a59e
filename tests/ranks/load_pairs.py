"""Rank script: load several written folders in one job and compare each with its reference checkpoint.

usage: load_pairs.py REPORT_DIR OUT=REF [OUT=REF ...]
Each OUT is loaded with `reshard.from_pretrained` on this torchrun job's mesh (the manifest's), each REF whole in
this process with stock transformers; every parameter's `full_tensor()` must be `torch.equal` to REF's. One launch
for several folders: the imports and the process group are paid once. Each rank writes REPORT_DIR/rank{r}.json.
"""

import os
import sys

import torch

from rank_report import finish, record_failure


def main():
    report_dir, pairs = sys.argv[1], [arg.split("=", 1) for arg in sys.argv[2:]]
    import reshard
    from transformers import AutoModelForCausalLM

    rank = int(os.environ["RANK"])
    report = {"rank": rank, "folders": {}}
    try:
        for out, ref in pairs:
            model = reshard.from_pretrained(out)
            reference = AutoModelForCausalLM.from_pretrained(ref, dtype=torch.bfloat16, use_kernels=False).state_dict()
            state = model.state_dict()
            mismatched = [name for name, tensor in state.items()
                          if not torch.equal(tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor,
                                             reference[name])]
            local = {name: list(t.to_local().shape) for name, t in state.items() if hasattr(t, "to_local")}
            report["folders"][out] = {"mismatched": mismatched, "tensors": len(state),
                                      "missing": sorted(set(reference) - set(state)),
                                      "empty_locals": sorted(n for n, s in local.items() if 0 in s)}
    except BaseException as e:  # report everything: the test asserts on it
        record_failure(report, e)
    finish(report_dir, report, code=3 if "error" in report else 0)


if __name__ == "__main__":
    main()
