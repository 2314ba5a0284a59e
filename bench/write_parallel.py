"""Benchmark parallel writes: `reshard write --workers 1` vs `--workers 2` vs a 2-rank torchrun write vs `cp -r`.

    python bench/write_parallel.py                  # 8 GB checkpoint, 3 runs of each
    python bench/write_parallel.py --size-gb 2 --runs 5 --dir /mnt/fast

What it does:

1. Generates SRC with bench/write.py's generator (a per-expert BF16 `qwen3_moe` of about `--size-gb`), syncs it to
   disk, runs `reshard plan` on it (the documented plan-then-write workflow: the layout cache is warm for every write),
   warms the page cache, and copies SRC once, untimed (a virtual disk writes never-used blocks much more slowly).
2. Runs, `--runs` times each, in an order that rotates every round so none always goes first:
   (a) `python -m reshard write SRC OUT --fsdp F --workers 1 -q`,
   (b) the same with `--workers 2`,
   (c) `python -m torch.distributed.run --standalone --nproc-per-node 2 -m reshard write SRC OUT --fsdp F -q`,
   (d) `cp -r SRC OUT`,
   each followed by `sync` and timed whole (start-up and imports included). Outputs are removed, and synced, between
   runs, outside the timings. Every reshard output must have the same `reshard.json` as the first `--workers 1` one
   (so the same files, sizes and CRC-32s).
3. Samples every process of each command (found through their parents) every 0.1 s for its peak RSS (`VmHWM`, which only
   grows, so the last sample is within 0.1 s of the peak) and reports the largest per role: the write process, each
   worker, each rank, torchrun's agent.

Reports the median time of each and, per round, the ratios to `--workers 1` and to `cp -r` (medians of the rounds).
Everything generated is deleted at the end unless `--keep`.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import write as base  # noqa: E402  bench/write.py: the generator and helpers

GB = base.GB


def role_of(cmdline: str, root: bool) -> str:
    if root:
        return "agent" if "torch.distributed.run" in cmdline else "cp" if cmdline.startswith("cp ") else "write"
    if "resource_tracker" in cmdline:
        return "helper"
    return "worker" if "spawn_main" in cmdline else "rank" if "reshard" in cmdline else "other"


class PeakRss:
    """Peak RSS of a process and of every process it starts (found through their parents while they run: torchrun
    puts each rank in a session of its own), sampled from /proc every `interval` seconds."""

    def __init__(self, pid: int, interval: float = 0.1):
        self.root, self.interval, self.peaks, self.known = pid, interval, {}, {pid}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def sample(self) -> None:
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                pid, ppid = int(stat.parent.name), int(stat.read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid in self.known:
                self.known.add(pid)
        for pid in self.known:
            try:
                status = Path(f"/proc/{pid}/status").read_text()
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            m = re.search(r"VmHWM:\s+(\d+) kB", status)
            if m and cmdline:  # the role from the latest command line: a spawned worker shows its parent's until exec
                _, peak = self.peaks.get(pid, (None, 0))
                self.peaks[pid] = (role_of(cmdline, pid == self.root), max(peak, int(m.group(1))))

    def run(self) -> None:
        while not self.stop.wait(self.interval):
            self.sample()

    def finish(self) -> dict[str, list[int]]:
        """KiB peaks by role, one per process."""
        self.stop.set()
        self.thread.join()
        out: dict[str, list[int]] = {}
        for role, kib in self.peaks.values():
            out.setdefault(role, []).append(kib)
        return out


def run_timed(cmd: list[str]) -> tuple[float, dict[str, list[int]]]:
    """Run `cmd` (in its own process group) then `sync`; wall seconds of both, and peak RSS per process."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=base.env(),
                            cwd=base.REPO, start_new_session=True)
    rss = PeakRss(proc.pid)
    out, err = proc.communicate()
    peaks = rss.finish()
    subprocess.run(["sync"], check=True)
    wall = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{out}\n{err[-4000:]}")
    return wall, peaks


def commands(src: Path, out: Path, fsdp: int) -> dict[str, list[str]]:
    write = ["-m", "reshard", "write", str(src), str(out), "--fsdp", str(fsdp), "-q"]
    return {
        "workers 1": [sys.executable, *write, "--workers", "1"],
        "workers 2": [sys.executable, *write, "--workers", "2"],
        "torchrun 2 ranks": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                             *write],
        "cp -r": ["cp", "-r", str(src), str(out)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gb", type=float, default=8.0, help="checkpoint size in GB (10^9 bytes)")
    parser.add_argument("--runs", type=int, default=3, help="timed runs of each")
    parser.add_argument("--fsdp", type=int, default=8)
    parser.add_argument("--shard-gb", type=float, default=2.0, help="source file size (GB)")
    parser.add_argument("--dir", type=Path, default=None, help="where to generate (default: a temp folder)")
    parser.add_argument("--keep", action="store_true", help="keep the generated checkpoint")
    args = parser.parse_args()

    root = args.dir or Path(tempfile.gettempdir())
    root.mkdir(parents=True, exist_ok=True)
    size = int(args.size_gb * GB)
    need = int(size * 2.1) + GB
    free = shutil.disk_usage(root).free
    print(f"disk: {free / GB:.1f} GB free in {root}, need about {need / GB:.1f} GB; "
          f"{len(os.sched_getaffinity(0))} cores", flush=True)
    if free < need:
        raise SystemExit(f"not enough free space in {root}: {free / GB:.1f} GB free, need {need / GB:.1f} GB")
    work = Path(tempfile.mkdtemp(prefix="reshard-bench-parallel-", dir=root))
    base.CACHE_DIR = work / "layout-cache"
    try:
        t = time.perf_counter()
        src, total = base.generate(work / "src", size, int(args.shard_gb * GB))
        subprocess.run(["sync"], check=True)  # or the first timed command would flush the generated SRC
        print(f"generated {total / GB:.2f} GB in {time.perf_counter() - t:.1f} s", flush=True)
        base.check_plan(src, args.fsdp)
        base.warm(src)
        out = work / "out"
        cmds = commands(src, out, args.fsdp)
        # untimed: on a virtual disk the first write to never-used blocks is much slower than every later one
        run_timed(cmds["cp -r"])
        base.remove(out)
        names = list(cmds)
        times: dict[str, list[float]] = {n: [] for n in names}
        rss: dict[str, dict[str, int]] = {n: {} for n in names}
        reference = None
        for i in range(args.runs):
            order = names[i % len(names):] + names[:i % len(names)]
            for name in order:
                wall, peaks = run_timed(cmds[name])
                times[name].append(wall)
                for role, kib in peaks.items():
                    rss[name][role] = max(rss[name].get(role, 0), *kib)
                if name != "cp -r":
                    manifest = (out / "reshard.json").read_text()
                    if reference is None:
                        reference = manifest
                    elif manifest != reference:
                        raise SystemExit(f"{name}: reshard.json differs from the first write's")
                base.remove(out)
                roles = ", ".join(f"{role} {' '.join(f'{k / 1024:.0f}' for k in sorted(kib))}"
                                  for role, kib in sorted(peaks.items()) if role != "helper")
                print(f"  round {i + 1}: {name:17s} {wall:6.2f} s   peak RSS MiB: {roles}", flush=True)

        print(f"\nresults: {total / GB:.2f} GB, fsdp {args.fsdp}, {args.runs} runs each, warm page cache, "
              f"{len(os.sched_getaffinity(0))} cores; time = whole process + sync")
        ratio = lambda a, b: statistics.median(x / y for x, y in zip(times[a], times[b]))  # noqa: E731
        for name in names:
            roles = ", ".join(f"{role} {kib / 1024:.0f}" for role, kib in sorted(rss[name].items())
                              if role != "helper")
            print(f"  {name:17s} median {statistics.median(times[name]):6.2f} s "
                  f"({', '.join(f'{x:.2f}' for x in times[name])}); "
                  f"vs workers 1: {ratio(name, 'workers 1'):.2f}x; vs cp -r: {ratio(name, 'cp -r'):.2f}x; "
                  f"peak RSS per process (MiB): {roles}")
        print("  every reshard output had the same reshard.json (files, sizes, CRC-32s)")
    finally:
        base.keep_or_remove(work, args.keep)


if __name__ == "__main__":
    main()
