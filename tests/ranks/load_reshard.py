"""Rank script: load a checkpoint on a gloo mesh and report what each rank got.

usage: load_reshard.py MODE FOLDER SRC REPORT_DIR FSDP EP
MODE: `reshard` (reshard.from_pretrained(FOLDER)), `reshard-bf16` (the same with dtype=bfloat16, which the files do
not hold: a dtype conversion), `stock` (stock transformers on FOLDER, no patch) or `patched`
(reshard.patch_transformers(), then transformers' own from_pretrained on FOLDER: e.g. an original checkpoint).
The report counts `dcp.load` calls, to tell reshard's own-file reads from the distributed-checkpoint fallback.
Each rank writes REPORT_DIR/rank{r}.json (or rank{r}.error.json with the exception) and exits non-zero on error.
"""

import math
import os
import sys

import torch
import torch.distributed as dist

from rank_report import finish, record_failure, save


def main():
    mode, folder, src, report_dir, fsdp, ep = sys.argv[1:7]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    report = {"rank": rank, "dcp_load_calls": 0}
    import torch.distributed.checkpoint as dcp

    dcp_load = dcp.load

    def counted_load(*args, **kwargs):
        report["dcp_load_calls"] += 1
        reader = type(kwargs.get("storage_reader"))
        report.setdefault("readers", []).append(f"{reader.__module__}.{reader.__qualname__}")
        return dcp_load(*args, **kwargs)

    dcp.load = counted_load
    try:
        from transformers import AutoModelForCausalLM
        from transformers.distributed import DistributedConfig

        config = DistributedConfig(fsdp_size=int(fsdp), **({"ep_size": int(ep)} if int(ep) > 1 else {}))
        dtype = {"dtype": torch.bfloat16} if mode == "reshard-bf16" else {}
        if mode.startswith("reshard"):
            import reshard

            model = reshard.from_pretrained(folder, **dtype)
        else:
            if mode == "patched":
                import reshard

                reshard.patch_transformers()
            # stock transformers 5.25 would kernelize by default; the patched path turns that off by itself
            stock = {} if mode == "patched" else {"use_kernels": False}
            model = AutoModelForCausalLM.from_pretrained(folder, distributed_config=config, **stock)
        reference = AutoModelForCausalLM.from_pretrained(src, **dtype, use_kernels=False)
        ref_state = reference.state_dict()
        mismatched, uninitialized, local = [], [], {}
        for name, tensor in model.state_dict().items():
            full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
            if full.dtype != ref_state[name].dtype or not torch.equal(full, ref_state[name]):
                mismatched.append(name)
            local_tensor = tensor.to_local() if hasattr(tensor, "to_local") else tensor
            local[name] = {"shape": list(local_tensor.shape), "bytes": local_tensor.numel() * local_tensor.element_size(),
                           "placements": str(getattr(tensor, "placements", None))}
        for name, param in model.named_parameters():
            if not getattr(param, "_is_hf_initialized", False):
                uninitialized.append(name)
        ids = torch.tensor([[1, 5, 9, 33, 7, 2, 100, 42]])
        with torch.no_grad():
            logits = model(ids).logits
            ref_logits = reference(ids).logits
        report.update(mismatched=mismatched, uninitialized=uninitialized, local=local,
                      logits_equal=bool(torch.equal(logits, ref_logits)),
                      logits_max_abs_diff=float((logits - ref_logits).abs().max()))
        # one training step: forward, backward, optimizer
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        loss = model(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        report["loss"] = float(loss)
        report["step_ok"] = math.isfinite(float(loss))
    except BaseException as e:  # report everything: the test asserts on it
        record_failure(report, e)
        save(report_dir, report)
        if type(e).__name__ == "LoadError":
            dist.barrier()  # reshard's errors are raised on every rank together: let each one report before exiting
        os._exit(3)
    finish(report_dir, report)


if __name__ == "__main__":
    main()
