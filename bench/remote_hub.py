"""Benchmark a streaming write from the Hub (`reshard write REPO OUT --stream`) against the same write from local
files and against plain ranged GETs of the same weight files, on the tests' local Hub server on 127.0.0.1.

    python bench/remote_hub.py                       # 0.5 GB, 3 runs of each
    python bench/remote_hub.py --size-gb 1 --runs 5 --json hub.json

What it does:

1. Generates SRC, a per-expert BF16 qwen3_moe checkpoint of `--size-gb` in files of `--shard-gb` (bench/write.py's
   generator: random bytes, no model in RAM), `reshard plan`s it (which fills the layout cache every timed write
   uses, the documented plan-then-write workflow), writes it once untimed (REF, the folder every timed write must
   equal), and publishes SRC as `bench/moe` on a LocalHub (tests/hub_server.py: an HTTP server in a thread of this
   process, holding the files in memory, logging every request with the bytes sent). It is stopped at the end.
2. Tries each PARALLEL setting of plain GETs once, then alternates, `--runs` times (the order turns each round), each
   a whole process timed with its `sync`:
   (a) `python -m reshard write bench/moe OUT --fsdp 8 --ep 2 --stream -q`, HF_ENDPOINT at the local Hub and a fresh,
       empty HF_HOME / HF_HUB_CACHE each run;
   (b) the same write from the local SRC (warm page cache: SRC is read once before each);
   (c) the yardstick: every weight file of the repo read with plain sequential 64 MiB ranged GETs through
       huggingface_hub's HTTP session (`get_session()`, httpx; the client reshard's Hub store uses) and dropped;
   (d) the same GETs in the fastest PARALLEL setting.
   Every .safetensors file each write produced must be byte-identical to REF's, and a streamed write must leave no
   weight file in its HF cache.
3. Reports, per measurement (medians over runs): seconds, GB/s (source tensor bytes / seconds), the GETs the Hub
   logged on the weight files (of them the 64 KiB header probes) and the other requests (API, metadata files,
   HEADs), bytes sent on the weight files against their size, peak RSS, CPU seconds of the command and of the Hub
   (this process: its main thread waits while a command runs, so its CPU is the server's). Then the write's
   throughput over the plain GETs' (their seconds over the write's, median of the pairs), the streamed write over
   the local one, and its CPU seconds beyond the local write's, per GB.

Prints a table, and writes it as JSON with `--json PATH`. The Hub keeps the checkpoint in memory (bytes) next to the
files on disk: keep `--size-gb` modest (the generator's smallest checkpoint, one layer, is 0.887 GB: the default 0.5
gives that). Everything generated is deleted at the end unless `--keep`.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import signal
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent / "tests"))
sys.path.insert(0, str(BENCH.parent))  # this checkout's reshard, whatever is installed
import write as wb  # noqa: E402  (bench/write.py: the generator and the timing helpers)
from remote import alternate, med, pairs, self_cpu  # noqa: E402  (bench/remote.py: the S3 bench's helpers)
import hub_server  # noqa: E402
from reshard.read import HEADER_PROBE  # noqa: E402  (a remote header is read with one probe of this many bytes)

GB = 10**9
REPO = "bench/moe"

# The yardstick: every weight file of the repo read with plain ranged GETs through huggingface_hub's own HTTP session
# (httpx), RANGE bytes each, THREADS at once (1: one after the other), and dropped: no planning, no output, no CRC.
RAW_GETS = """
import sys
from concurrent.futures import ThreadPoolExecutor
from huggingface_hub import HfApi, hf_hub_url
from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status
repo, block, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
files = [(e.path, e.size) for e in HfApi().list_repo_tree(repo) if e.path.endswith('.safetensors')]
parts = [(n, o, min(o + block, size)) for n, size in files for o in range(0, size, block)]
headers = build_hf_headers()
def get(part):
    r = get_session().get(hf_hub_url(repo, part[0]), headers={**headers, 'Range': f'bytes={part[1]}-{part[2] - 1}'},
                          follow_redirects=True)
    hf_raise_for_status(r)
    return len(r.content)
with ThreadPoolExecutor(threads) as pool:
    print(sum(pool.map(get, parts)))
"""
SEQUENTIAL = (64 << 20, 1)  # the yardstick: 64 MiB ranges, one after the other
PARALLEL = [(16 << 20, 4), (32 << 20, 4)]  # tried once each; the fastest is timed


def raw_name(setting: tuple[int, int]) -> str:
    return f"  hub GETs {setting[0] >> 20} MiB x {setting[1]}"


class Bench:
    def __init__(self, args, hub: hub_server.LocalHub, work: Path, src: Path, ref: Path):
        self.args, self.hub, self.work, self.src, self.ref = args, hub, work, src, ref
        self.homes = 0

    def hub_env(self) -> tuple[dict, Path]:
        """The write's environment with HF_ENDPOINT at the local Hub and a fresh, empty HF home (returned)."""
        self.homes += 1
        home = self.work / f"hf-home-{self.homes}"
        env = {k: v for k, v in wb.env().items() if not k.startswith("HF_")}  # wb.env() sets HF_HUB_OFFLINE
        env.update(HF_ENDPOINT=self.hub.url, HF_HOME=str(home), HF_HUB_CACHE=str(home / "hub"),
                   HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_DISABLE_PROGRESS_BARS="1")
        return env, home

    def measure(self, cmd: list[str], env: dict) -> dict:
        """Run `cmd` (+ sync) timed, the Hub's log cleared before; what it cost the command and the Hub."""
        with self.hub.lock:
            self.hub.log.clear()
        load = os.getloadavg()[0]
        hub_cpu = self_cpu()
        wall, rss, _, cpu = wb.run_timed(cmd, env=env)
        row = {"seconds": wall, "rss_kib": rss, "cpu": cpu, "hub_cpu": self_cpu() - hub_cpu,
               "loadavg": [load, os.getloadavg()[0]]}
        row.update(self.traffic())
        return row

    def traffic(self) -> dict:
        """What the Hub logged: GETs on the weight files (of them header probes, starting at byte 0), the other
        requests (API calls, metadata files, HEADs), body bytes sent on the weight files and on the rest."""
        with self.hub.lock:
            logged = list(self.hub.log)
        files = [r for r in logged if r.method == "GET" and r.path.endswith(".safetensors")]
        probe = f"bytes=0-{HEADER_PROBE - 1}"
        return {"file_gets": len(files), "header_gets": sum(1 for r in files if r.range == probe),
                "whole_file_gets": sum(1 for r in files if not r.range),
                "other_requests": len(logged) - len(files), "heads": sum(1 for r in logged if r.method == "HEAD"),
                "fetched": sum(r.sent for r in files), "fetched_other": sum(r.sent for r in logged) -
                sum(r.sent for r in files)}

    def same_as_ref(self, out: Path, what: str) -> None:
        """Every .safetensors file of `out` byte-identical to REF's, and the same names."""
        names = sorted(p.name for p in self.ref.glob("*.safetensors"))
        got = sorted(p.name for p in out.glob("*.safetensors"))
        if got != names:
            raise SystemExit(f"{what}: wrote {got}, the reference write {names}")
        for name in names:
            if not filecmp.cmp(out / name, self.ref / name, shallow=False):
                raise SystemExit(f"{what}: {name} differs from the reference write's")

    def write(self, where: str) -> dict:
        out = self.work / "out"
        source, extra, home = str(self.src), [], None
        env = wb.env()
        if where == "hub":
            env, home = self.hub_env()
            source, extra = REPO, ["--stream"]
        cmd = [sys.executable, "-m", "reshard", "write", source, str(out), "--fsdp", str(self.args.fsdp), "--ep",
               str(self.args.ep), *extra, "-q"]
        row = self.measure(cmd, env)
        self.same_as_ref(out, f"the write from {where}")
        if home is not None:
            cached = sorted(p.name for p in home.rglob("*.safetensors"))
            if cached:
                raise SystemExit(f"the streamed write left weights in its HF cache: {cached}")
            wb.remove(home)
        wb.remove(out)
        return row

    def raw_gets(self, setting: tuple[int, int]) -> dict:
        env, home = self.hub_env()
        row = self.measure([sys.executable, "-c", RAW_GETS, REPO, str(setting[0]), str(setting[1])], env)
        wb.remove(home)
        return row


def summary(name: str, rows: list[dict], source_bytes: int, needed: int) -> dict:
    seconds = med(rows, "seconds")
    out = {"measurement": name, "runs": [round(r["seconds"], 3) for r in rows], "seconds": seconds,
           "gb_per_s": source_bytes / seconds / GB, "bytes_needed": needed,
           "peak_rss_mib": max(r["rss_kib"] or 0 for r in rows) / 1024, "cpu_s": med(rows, "cpu"),
           "hub_cpu_s": med(rows, "hub_cpu"),
           "loadavg": [min(r["loadavg"][0] for r in rows), max(max(r["loadavg"]) for r in rows)]}
    out.update({k: med(rows, k) for k in ("file_gets", "header_gets", "whole_file_gets", "other_requests", "heads",
                                           "fetched", "fetched_other")})
    return out


def print_table(rows: list[dict]) -> None:
    print(f"\n{'measurement':28s} {'median s':>9s} {'GB/s':>6s} {'file GETs':>10s} {'other req':>9s} "
          f"{'fetched / files GB':>19s} {'peak RSS':>9s} {'CPU s cmd/hub':>14s}  runs")
    for r in rows:
        fetched = f"{r['fetched'] / GB:.3f} / {r['bytes_needed'] / GB:.3f}"
        cpu = f"{r['cpu_s']:.1f}/{r['hub_cpu_s']:.1f}"
        print(f"{r['measurement']:28s} {r['seconds']:9.2f} {r['gb_per_s']:6.2f} {r['file_gets']:10.0f} "
              f"{r['other_requests']:9.0f} {fetched:>19s} {r['peak_rss_mib']:6.0f} MiB {cpu:>14s}  "
              f"{', '.join(f'{x:.2f}' for x in r['runs'])}")


def best_parallel(bench: Bench) -> tuple[int, int]:
    timed = []
    for setting in PARALLEL:
        row = bench.raw_gets(setting)
        print(f"  hub GETs, {setting[0] >> 20} MiB x {setting[1]} threads: {row['seconds']:.2f} s", flush=True)
        timed.append((row["seconds"], setting))
    return min(timed)[1]


def bench_writes(bench: Bench, total: int) -> tuple[list[dict], dict]:
    needed = sum(p.stat().st_size for p in bench.src.glob("*.safetensors"))  # every weight file, headers and all
    settings = {"sequential": SEQUENTIAL, "parallel": best_parallel(bench)}
    kinds = ["hub", "local", *settings]
    runs: dict[str, list] = {k: [] for k in kinds}
    for i, kind in alternate(kinds, bench.args.runs):
        if kind == "local":
            wb.warm(bench.src)
        row = bench.raw_gets(settings[kind]) if kind in settings else bench.write(kind)
        runs[kind].append(row)
        label = raw_name(settings[kind]).strip() if kind in settings else "write " + kind
        print(f"  run {i + 1} {label:22s} {row['seconds']:6.2f} s (cpu {row['cpu']:.1f} s, hub {row['hub_cpu']:.1f} "
              f"s, peak RSS {(row['rss_kib'] or 0) / 1024:.0f} MiB, {row['file_gets']} GETs on weight files "
              f"({row['header_gets']} header probes), {row['other_requests']} other requests, "
              f"{row['fetched'] / GB:.3f} GB sent; load avg {row['loadavg'][0]:.1f})", flush=True)
    names = {"hub": "write from the Hub --stream", "local": "write from local (warm)",
             "sequential": raw_name(SEQUENTIAL), "parallel": raw_name(settings["parallel"])}
    rows = [summary(names[k], runs[k], total, needed) for k in kinds]
    rows[0]["hub_over_local"] = pairs(runs["hub"], runs["local"])
    # throughput of the write over that of the plain GETs: the GETs' time over the write's, median of the pairs
    rows[0]["over_sequential_gets"] = pairs(runs["sequential"], runs["hub"])
    rows[0]["over_parallel_gets"] = pairs(runs["parallel"], runs["hub"])
    rows[0]["cpu_s_per_gb_beyond_local"] = (rows[0]["cpu_s"] - rows[1]["cpu_s"]) / (total / GB)
    return rows, runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gb", type=float, default=0.5, help="checkpoint size in GB (10^9 bytes), held in RAM")
    parser.add_argument("--shard-gb", type=float, default=1.0, help="source file size (GB), as bench/remote.py")
    parser.add_argument("--runs", type=int, default=3, help="timed runs of each measurement")
    parser.add_argument("--fsdp", type=int, default=8, help="the timed write's mesh")
    parser.add_argument("--ep", type=int, default=2)
    parser.add_argument("--dir", type=Path, default=None, help="where to generate (default: a temp folder)")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--keep", action="store_true", help="keep the generated files (the server is stopped)")
    args = parser.parse_args()

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a SIGTERM still stops the server and removes the files
    work = Path(tempfile.mkdtemp(prefix="reshard-bench-hub-", dir=args.dir))
    wb.CACHE_DIR = work / "layout-cache"
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()}; work folder {work}", flush=True)
    server = None
    try:
        results: dict = {"conditions": {
            "cores": os.cpu_count(), "loadavg_start": os.getloadavg(), "size_gb": args.size_gb,
            "shard_gb": args.shard_gb, "runs": args.runs, "write_mesh": f"{args.fsdp}x{args.ep}"}, "rows": []}
        src, total = wb.generate(work / "src", int(args.size_gb * GB), int(args.shard_gb * GB))
        files = sorted(src.glob("*.safetensors"))
        tensors = len(json.loads((src / "model.safetensors.index.json").read_text())["weight_map"])
        print(f"SRC: {total / GB:.3f} GB of tensors, {len(files)} files, {tensors} tensors", flush=True)
        wb.check_plan(src, args.fsdp)  # fills the layout cache every timed write uses (keyed on config + tensors)
        ref = work / "ref"
        wb.run_timed([sys.executable, "-m", "reshard", "write", str(src), str(ref), "--fsdp", str(args.fsdp), "--ep",
                      str(args.ep), "-q"], env=wb.env())
        hub = hub_server.LocalHub()
        hub.add_folder(REPO, src)
        server = hub_server.start(hub)
        print(f"local Hub on {hub.url}: {REPO}, {len(hub.repos[REPO][hub.refs[REPO]['main']])} files", flush=True)
        bench = Bench(args, hub, work, src, ref)
        rows, results["runs"] = bench_writes(bench, total)
        results["conditions"]["tensors"] = tensors
        results["rows"] = rows
        results["conditions"]["loadavg_end"] = os.getloadavg()
        print_table(rows)
        r = rows[0]
        print(f"  {r['measurement']}: {r['hub_over_local']:.2f}x the local write's seconds (median of pairs); "
              f"throughput {r['over_sequential_gets']:.2f}x sequential 64 MiB GETs, {r['over_parallel_gets']:.2f}x "
              f"the best parallel GETs ({rows[3]['measurement'].strip()}); {r['cpu_s_per_gb_beyond_local']:.2f} CPU s "
              f"per GB beyond the local write; every .safetensors file byte-identical to the local write's")
        print(f"  load average during the runs: {min(x['loadavg'][0] for x in rows):.1f}-"
              f"{max(x['loadavg'][1] for x in rows):.1f} on {os.cpu_count()} cores")
        if args.json:
            args.json.write_text(json.dumps(results, indent=2))
            print(f"wrote {args.json}")
    finally:
        if server is not None:
            server.shutdown()
        wb.keep_or_remove(work, args.keep)


if __name__ == "__main__":
    main()
