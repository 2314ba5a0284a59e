"""Benchmark `reshard merge` against `cp -r` + `sync` on a generated ~8 GB distributed checkpoint.

    python bench/merge.py                  # 8 GB, 3 runs each
    python bench/merge.py --size-gb 2 --runs 5 --dir /mnt/fast

What it does:

1. Generates a per-expert BF16 qwen3_moe checkpoint of `--size-gb` (bench/write.py's generator: random bytes, no
   model in RAM) and writes it with `reshard write --fsdp 8 --ep 2` (balanced): IN, a folder in the distributed
   layout (the same rank-local DCP safetensors files `save_pretrained(..., distributed_checkpoint=True)` writes, every
   expert tensor split across 8 rank files), then removes the generated source.
2. Warms the page cache (reads IN once), then alternates, `--runs` times each:
   (a) `python -m reshard merge IN DEST -q` (original layout: 64 per-expert keys split back out of each fused
       tensor, 5 GB files) then `sync`, (b) `cp -r IN DEST2` then `sync`; each timed as a whole process (start-up and
       imports included) plus its `sync`, outputs removed between runs outside the timings.
3. Reports the median ratio merge / cp (target < 1.5, aim 1.15), merge throughput in GB/s next to verl's merger (about
   33 MB/s: 4 h for Qwen3-235B), and peak RSS of the merge process (`/usr/bin/time -v`) at this size and at a 4x
   smaller one of the same tensor sizes (bounded: it must not grow with the checkpoint). The small merge is also
   checked with `reshard verify DEST --against IN` (every tensor equal, byte for byte).

`--against DIR` also times the merge of another checkout of reshard (e.g. `git worktree add ../before main`), its runs
alternating with this one's on the same IN: a before/after pair measured in the same conditions.
Everything generated is deleted at the end unless `--keep`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import write as wb  # noqa: E402  (bench/write.py: the generator and the timing helpers)

GB = 10**9
VERL_BYTES_PER_S = 33e6


def make_input(root: Path, size: int, shard: int, fsdp: int, ep: int) -> tuple[Path, int]:
    src, total = wb.generate(root / "src", size, shard)
    folder = root / "in"
    start = time.perf_counter()
    wb.run_timed([sys.executable, "-m", "reshard", "write", str(src), str(folder), "--fsdp", str(fsdp), "--ep",
                  str(ep), "-q"], env=wb.env())
    print(f"  IN: {total / GB:.2f} GB written at fsdp {fsdp} x ep {ep} in {time.perf_counter() - start:.1f} s",
          flush=True)
    wb.remove(src)
    return folder, total


def merge_once(folder: Path, work: Path, *, keep: bool = False, repo: Path = wb.REPO
               ) -> tuple[float, int | None, float]:
    dest = work / "dest"
    wall, rss, _, cpu = wb.run_timed([sys.executable, "-m", "reshard", "merge", str(folder), str(dest), "-q"],
                                     env=wb.env(repo), cwd=repo)
    if not (dest / "model.safetensors.index.json").exists():
        raise SystemExit("the merge produced no index")
    if not keep:
        wb.remove(dest)
    return wall, rss, cpu


def cp_once(folder: Path, work: Path) -> float:
    wall, _, _, _ = wb.run_timed(["cp", "-r", str(folder), str(work / "dest2")])
    wb.remove(work / "dest2")
    return wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gb", type=float, default=8.0, help="checkpoint size in GB (10^9 bytes)")
    parser.add_argument("--runs", type=int, default=3, help="timed runs of each of merge and cp")
    parser.add_argument("--fsdp", type=int, default=8)
    parser.add_argument("--ep", type=int, default=2)
    parser.add_argument("--dir", type=Path, default=None, help="where to generate (default: a temp folder)")
    parser.add_argument("--keep", action="store_true", help="keep the generated folders")
    parser.add_argument("--against", type=lambda p: Path(p).resolve(), default=None,
                        help="another checkout of reshard whose merge is timed too, alternating (before/after)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="reshard-bench-merge-", dir=args.dir))
    wb.CACHE_DIR = work / "layout-cache"
    try:
        size = int(args.size_gb * GB)
        print(f"generating {args.size_gb} GB in {work}", flush=True)
        folder, total = make_input(work / "big", size, 2 * GB, args.fsdp, args.ep)
        wb.warm(folder)
        merges, cps, rss, cpus, against = [], [], [], [], []
        for run in range(args.runs):
            if args.against and run % 2 == 1:  # alternate which checkout goes first
                against.append(merge_once(folder, work, repo=args.against))
            wall, peak, cpu = merge_once(folder, work)
            if args.against and run % 2 == 0:
                against.append(merge_once(folder, work, repo=args.against))
            merges.append(wall)
            rss.append(peak)
            cpus.append(cpu)
            cps.append(cp_once(folder, work))
            print(f"  run {run + 1}: merge {merges[-1]:.2f} s ({total / merges[-1] / GB:.2f} GB/s, cpu {cpu:.1f} s, "
                  f"peak RSS {peak / 1024 if peak else float('nan'):.0f} MiB), cp -r {cps[-1]:.2f} s"
                  + (f"; {args.against}: merge {against[-1][0]:.2f} s (cpu {against[-1][2]:.1f} s)" if against else ""),
                  flush=True)
        ratios = [m / c for m, c in zip(merges, cps)]
        wb.remove(work / "big")
        small_folder, small_total = make_input(work / "small", size // 4, 2 * GB, args.fsdp, args.ep)
        small_wall, small_rss, _ = merge_once(small_folder, work, keep=True)
        start = time.perf_counter()
        verify = wb.subprocess.run([sys.executable, "-m", "reshard", "verify", str(work / "dest"), "--against",
                                    str(small_folder), "-q"], capture_output=True, text=True, env=wb.env(),
                                   cwd=wb.REPO)
        print(f"  verify DEST --against IN ({small_total / GB:.2f} GB): exit {verify.returncode} in "
              f"{time.perf_counter() - start:.1f} s: {verify.stdout.strip() or verify.stderr.strip()[-300:]}")
        median = statistics.median(merges)
        print(f"\nmerge {total / GB:.2f} GB (original layout, per-expert keys): median {median:.2f} s, "
              f"cp -r + sync median {statistics.median(cps):.2f} s")
        print(f"ratio merge / cp: median {statistics.median(ratios):.2f} (runs: "
              f"{', '.join(f'{r:.2f}' for r in ratios)}; target < 1.5, aim 1.15)")
        if against:
            walls = [a for a, _, _ in against]
            print(f"{args.against}: merge median {statistics.median(walls):.2f} s, ratio merge / cp: median "
                  f"{statistics.median(a / c for a, c in zip(walls, cps)):.2f} (runs: "
                  f"{', '.join(f'{a / c:.2f}' for a, c in zip(walls, cps))}), cpu median "
                  f"{statistics.median(c for _, _, c in against):.1f} s")
        print(f"throughput: {total / median / GB:.2f} GB/s whole process, vs verl's merger ~0.033 GB/s "
              f"({total / median / VERL_BYTES_PER_S:.0f}x)")
        big = max(r for r in rss if r) / 1024 if any(rss) else float("nan")
        small = small_rss / 1024 if small_rss else float("nan")
        print(f"peak RSS: {big:.0f} MiB at {total / GB:.2f} GB, {small:.0f} MiB at {small_total / GB:.2f} GB "
              f"(small merge {small_wall:.2f} s)")
    finally:
        wb.keep_or_remove(work, args.keep)


if __name__ == "__main__":
    main()
