"""CUDA check of the empty-rank hang (stock transformers) and its fix (reshard), on one GPU.

On a CUDA mesh, stock transformers 5.23 loading a checkpoint whose experts leave ranks empty does not crash: the
empty ranks skip "initialized" marking, run `_init_weights`, and DTensor's RNG tracker broadcasts on the WORLD
group from there, a collective the loaded ranks never join. This script shows it and shows reshard's folder
loading instead. Four ranks share one GPU over gloo (NCCL refuses two ranks per GPU), so every rank is told it is
local rank 0 before transformers binds its device.

usage:  python scripts/cuda_empty_rank_check.py [--timeout 90] [--device cuda|cpu]
It generates a tiny Qwen3-MoE with 2 experts, runs stock transformers at fsdp 4 under a watchdog (expected on
CUDA: a hang, killed at --timeout; on CPU: an error), then `reshard write` + `reshard.from_pretrained` (expected:
every rank returns, its parameters on the device, each local shard equal bit for bit to the source checkpoint's
slice; each report also counts `dcp.load` calls: 0 when the rank read its own files). Exit 0 when both behave as expected, 1 otherwise, 2 when the device is missing. `--device cpu` runs the
same flow without a GPU, to check the script itself.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RANKS = 4


def local_shards_match(model, source: Path) -> tuple[int, list[str]]:
    """Compare every parameter's local shard with the same slice of the source checkpoint (no collectives)."""
    import torch
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(source, use_kernels=False).state_dict()
    checked, wrong = 0, []
    for name, tensor in model.state_dict().items():
        if isinstance(tensor, DTensor):
            shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
            expected = reference[name][tuple(slice(o, o + n) for o, n in zip(offset, shape))]
            local = tensor.to_local()
        else:
            expected, local = reference[name], tensor
        checked += 1
        if not torch.equal(local.detach().cpu(), expected):
            wrong.append(name)
    return checked, wrong


def rank_main(mode: str, device: str, folder: str, source: str, reports: str) -> None:
    import torch
    import torch.distributed as dist

    stacks_after = float(os.environ.get("RESHARD_CHECK_STACKS_AFTER", "0"))
    if stacks_after:
        faulthandler.dump_traceback_later(stacks_after, exit=False)
    if device == "cuda":
        os.environ["LOCAL_RANK"] = "0"  # one GPU for all ranks; transformers binds cuda:LOCAL_RANK
        torch.cuda.set_device(0)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    import torch.distributed.checkpoint as dcp

    dcp_calls, dcp_load = [], dcp.load
    dcp.load = lambda *args, **kwargs: dcp_calls.append(1) or dcp_load(*args, **kwargs)
    started = time.monotonic()
    if mode == "stock":
        model = AutoModelForCausalLM.from_pretrained(folder, distributed_config=DistributedConfig(fsdp_size=RANKS),
                                                     use_kernels=False)
    else:
        import reshard

        model = reshard.from_pretrained(folder)
    seconds = time.monotonic() - started
    # A training job's next step is a collective on every rank; a barrier stands in for it, so a rank left alone
    # in a collective inside from_pretrained waits here instead of seeing its peers exit.
    dist.barrier()
    faulthandler.cancel_dump_traceback_later()
    checked, wrong = local_shards_match(model, Path(source))
    devices = sorted({str(p.device) for p in model.parameters()})
    Path(reports, f"rank{rank}.json").write_text(json.dumps(
        {"rank": rank, "load_s": round(seconds, 2), "params_checked": checked, "mismatched": wrong,
         "devices": devices, "dcp_load_calls": len(dcp_calls)}))
    dist.destroy_process_group()


def launch(mode: str, device: str, folder: Path, source: Path, work: Path, timeout: float) -> tuple[str, float]:
    """Run one torchrun job under a watchdog; its output goes to WORK/MODE.log."""
    reports = work / mode
    reports.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={RANKS}", __file__,
           "--rank-mode", mode, "--device", device, str(folder), str(source), str(reports)]
    # Each rank prints its Python stack shortly before the watchdog fires: that shows where a hang sits.
    env = dict(os.environ, RESHARD_CHECK_STACKS_AFTER=str(max(timeout - 15, 5)))
    log_path = work / f"{mode}.log"
    started = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            returncode = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.terminate()  # torchrun forwards SIGTERM to its workers
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
            subprocess.run(["pkill", "-9", "-f", f"rank-mode {mode}"], check=False)
            return f"hang (killed by the watchdog at {timeout:.0f} s)", time.monotonic() - started
    elapsed = time.monotonic() - started
    if returncode == 0:
        return "returned", elapsed
    # The first rank's own exception line, not torchrun's ChildFailedError summary.
    text = log_path.read_text(errors="replace")
    errors = [line for line in text.splitlines() if re.match(r"\[rank\d+\]: \w*(Error|Exception)\b", line)]
    return f"failed (exit {returncode}): {errors[0] if errors else text[-400:]}", elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--timeout", type=float, default=90, help="watchdog for each torchrun job, in seconds")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--workdir", type=Path, help="where the checkpoints, reports and logs go (default: a temp dir)")
    parser.add_argument("--rank-mode", choices=["stock", "reshard"], help=argparse.SUPPRESS)
    parser.add_argument("args", nargs="*", help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.rank_mode:
        rank_main(ns.rank_mode, ns.device, *ns.args)
        return 0
    import torch
    import transformers

    if ns.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: this check needs one GPU (or --device cpu to check the script itself).")
        return 2
    name = torch.cuda.get_device_name(0) if ns.device == "cuda" else "CPU"
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {RANKS} ranks on {name}, gloo")
    from reshard.api import write_checkpoint
    from reshard.plan import MeshSpec
    from reshard.tiny import make_tiny_checkpoint

    root = ns.workdir or Path(tempfile.mkdtemp(prefix="reshard-cuda-"))
    root.mkdir(parents=True, exist_ok=True)
    src = make_tiny_checkpoint("qwen3_moe", root / "src", experts=2)
    stock, stock_s = launch("stock", ns.device, src, src, root, ns.timeout)
    print(f"stock transformers, original checkpoint, fsdp {RANKS}: {stock} after {stock_s:.1f} s")
    out = root / "out"
    write_checkpoint(src, out, MeshSpec(fsdp=RANKS), progress=False)
    fixed, fixed_s = launch("reshard", ns.device, out, src, root, ns.timeout)
    reports = [json.loads(p.read_text()) for p in sorted((root / "reshard").glob("rank*.json"))]
    print(f"reshard folder + reshard.from_pretrained: {fixed} after {fixed_s:.1f} s")
    for report in reports:
        print("  ", json.dumps(report))
    on_device = all(all(d.startswith(ns.device) for d in r["devices"]) for r in reports)
    ok = (fixed == "returned" and len(reports) == RANKS and on_device
          and all(r["params_checked"] > 0 and not r["mismatched"] for r in reports))
    stock_expected = stock.startswith("hang") if ns.device == "cuda" else stock.startswith("failed")
    print("RESULT:", "as expected" if ok and stock_expected else "unexpected",
          f"(stock {'as documented' if stock_expected else 'NOT as documented'}; "
          f"reshard {'ok' if ok else 'NOT ok'}; files in {root})")
    return 0 if ok and stock_expected else 1


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
