"""CUDA check of the empty-rank hang (stock transformers) and its fix (reshard), on one GPU.

On a CUDA mesh, stock transformers 5.23 loading a checkpoint whose experts leave ranks empty does not crash: the
empty ranks skip "initialized" marking, run `_init_weights`, and DTensor's RNG tracker broadcasts on the WORLD
group from there, a collective the loaded ranks never join. This script shows it and shows reshard's folder
loading instead. Four ranks share one GPU over gloo (NCCL refuses two ranks per GPU).

usage (driver):  python scripts/cuda_empty_rank_check.py [--timeout 120]
It generates a tiny Qwen3-MoE with 2 experts, runs stock transformers at fsdp 4 under a watchdog (expected: a
hang, killed at --timeout), then `reshard write` + `reshard.from_pretrained` (expected: every rank returns and
matches the single-process load). Exit 0 when both behave as expected, 1 otherwise, 2 without CUDA.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def rank_main(mode: str, folder: str, src: str, reports: str) -> None:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(0)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    started = time.monotonic()
    if mode == "stock":
        model = AutoModelForCausalLM.from_pretrained(folder, distributed_config=DistributedConfig(fsdp_size=4))
    else:
        import reshard

        model = reshard.from_pretrained(folder)
    reference = AutoModelForCausalLM.from_pretrained(src).state_dict()
    equal = all(torch.equal(t.full_tensor().cpu() if hasattr(t, "full_tensor") else t.cpu(), reference[n])
                for n, t in model.state_dict().items())
    Path(reports, f"rank{rank}.json").write_text(json.dumps(
        {"rank": rank, "seconds": time.monotonic() - started, "equal": equal,
         "device": str(next(model.parameters()).device)}))
    dist.destroy_process_group()


def launch(mode: str, folder: Path, src: Path, reports: Path, timeout: float) -> tuple[str, float]:
    reports.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", __file__,
           "--rank-mode", mode, str(folder), str(src), str(reports)]
    started = time.monotonic()
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, start_new_session=True)
    except subprocess.TimeoutExpired:
        return "hang (killed by the watchdog)", time.monotonic() - started
    status = "returned" if result.returncode == 0 else f"failed (exit {result.returncode}): {result.stderr[-800:]}"
    return status, time.monotonic() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--timeout", type=float, default=120)
    parser.add_argument("--rank-mode", choices=["stock", "reshard"])
    parser.add_argument("args", nargs="*")
    ns = parser.parse_args()
    if ns.rank_mode:
        rank_main(ns.rank_mode, *ns.args)
        return 0
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: this check needs one GPU (the CPU test suite covers the CPU behaviour).")
        return 2
    from reshard.api import write_checkpoint
    from reshard.mesh import MeshSpec
    from reshard.tiny import make_tiny_checkpoint

    root = Path(tempfile.mkdtemp(prefix="reshard-cuda-"))
    src = make_tiny_checkpoint("qwen3_moe", root / "src", experts=2)
    stock, stock_s = launch("stock", src, src, root / "stock", ns.timeout)
    print(f"stock transformers, original checkpoint, fsdp 4 on one GPU: {stock} after {stock_s:.0f} s")
    out = root / "out"
    write_checkpoint(src, out, MeshSpec(fsdp=4), progress=False)
    fixed, fixed_s = launch("reshard", out, src, root / "reshard", ns.timeout)
    reports = [json.loads(p.read_text()) for p in sorted((root / "reshard").glob("rank*.json"))]
    print(f"reshard folder + reshard.from_pretrained: {fixed} after {fixed_s:.0f} s; ranks: {reports}")
    ok = fixed == "returned" and len(reports) == 4 and all(r["equal"] for r in reports)
    print("RESULT:", "as expected" if ok and stock.startswith("hang") else "unexpected", f"(files in {root})")
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
