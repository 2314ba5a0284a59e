"""The load fault matrix, measured: each pre-load fault on 4 CPU ranks launched with no agent (torch.multiprocessing
spawn, as under srun or mpirun), the error every rank prints, and each rank's seconds from launch to exit.

    python bench/faults.py [--ranks 4]

Seconds include starting Python and importing torch and transformers on every rank (most of it on a 2-core
machine); a hang would show as a rank still running at the 120 s deadline.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RANKS = REPO / "tests" / "ranks"


def damage(fault: str, out: Path, work: Path, ranks: int):
    """Apply `fault` to `out`: (folder argument, processes to launch, extra environment)."""
    victim = out / "shard-00003-model-00001-of-00001.safetensors"
    if fault == "manifest missing on one rank":
        for r in range(ranks):
            shutil.copytree(out, work / f"node{r}")
        (work / "node2" / "reshard.json").unlink()
        return str(work / "node{rank}"), ranks, {}
    if fault == "one rank's file unreadable":
        victim.chmod(0)
        return str(out), ranks, {"RESHARD_TEST_DENY": str(victim)}  # as root chmod does not stop reads
    if fault == "job larger than the manifest's world":
        return str(out), ranks + 1, {}
    if fault == "job smaller than the manifest's world":
        return str(out), ranks // 2, {}
    if fault == "one rank's file truncated":
        victim.write_bytes(victim.read_bytes()[:-64])
        return str(out), ranks, {}
    if fault == "one rank's file corrupt (flipped byte)":
        data = bytearray(victim.read_bytes())
        data[-5] ^= 0xFF
        victim.write_bytes(bytes(data))
        return str(out), ranks, {}
    raise ValueError(fault)


FAULTS = ["manifest missing on one rank", "one rank's file unreadable", "job larger than the manifest's world",
          "job smaller than the manifest's world", "one rank's file truncated", "one rank's file corrupt (flipped byte)"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4)
    args = parser.parse_args()
    from reshard.api import write_checkpoint
    from reshard.plan import MeshSpec
    from reshard.tiny import make_tiny_checkpoint

    print("| fault | what every rank raises (abridged) | exit codes | seconds to exit, per rank |")
    print("|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        src = make_tiny_checkpoint("qwen3_moe", Path(tmp) / "src", experts=args.ranks // 2)
        for i, fault in enumerate(FAULTS):
            work = Path(tmp) / f"case{i}"
            work.mkdir()
            out = work / "out"
            write_checkpoint(src, out, MeshSpec(fsdp=args.ranks), progress=False)
            folder, nproc, env = damage(fault, out, work, args.ranks)
            reports, summary = work / "reports", work / "summary.json"
            reports.mkdir()
            subprocess.run([sys.executable, str(RANKS / "spawn.py"), str(nproc), str(summary),
                            str(RANKS / "load_env.py"), "reshard", folder, "-", str(reports)],
                           env={**os.environ, "OMP_NUM_THREADS": "1", **env}, capture_output=True, timeout=300)
            exits = json.loads(summary.read_text())
            errors = set()
            for r in range(nproc):
                path = reports / f"rank{r}.json"
                errors.add(json.loads(path.read_text()).get("error", "(loaded)") if path.exists() else "(no report)")
            error = " / ".join(sorted(errors))
            error = error if len(error) < 150 else error[:147] + "..."
            codes = sorted({str(e["exitcode"]) for e in exits.values()})
            seconds = ", ".join("hang" if e["seconds"] is None else f"{e['seconds']:.1f}" for e in exits.values())
            print(f"| {fault} | {error} | {'/'.join(codes)} | {seconds} |", flush=True)


if __name__ == "__main__":
    main()
