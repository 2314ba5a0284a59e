"""Benchmark reading a checkpoint from S3 against reading it from local files: `reshard write s3://...` and a 4-rank
`reshard.from_pretrained("s3://...")`, on a real S3 server on 127.0.0.1.

    python bench/remote.py                          # 2 GB, 3 runs of each
    python bench/remote.py --size-gb 1 --runs 5 --json remote.json
    python bench/remote.py --direct --profile       # also: S3 without the logging proxy; a profiled write
    python bench/remote.py --size-gb 0.4 --skip write,load --profile   # the profile alone

What it does:

Into S3 (`--skip` without `upload`): `reshard merge FOLDER s3://B/merged-N` against the raw multipart upload of the
same files (a local `reshard merge FOLDER` output) with the same part size and parts in flight, alternating, each a
whole process; the throughput ratio (raw seconds / reshard seconds, median of pairs) and each one's peak RSS.

1. Starts the tests' S3 server (tests/s3_server.py: SeaweedFS `weed`, which must be on PATH, on 127.0.0.1 behind a
   logging proxy that runs in this process). It is stopped at the end whatever happens.
2. Generates SRC, a per-expert BF16 qwen3_moe checkpoint of `--size-gb` (bench/write.py's generator: random bytes,
   no model in RAM), `reshard plan`s it (which fills the layout cache: every timed write, local or S3, runs with
   it warm, the documented plan-then-write workflow), and writes FOLDER = `reshard write SRC --fsdp 4 --ep 2` (the
   mesh of a 4-rank load). Both are uploaded to a fresh bucket, one PUT per file, straight to weed.
3. Alternates, `--runs` times (the order turns each round), each a whole process timed with its `sync`:
   (a) `python -m reshard write s3://B/src OUT --fsdp 8 --ep 2 -q`, the same write from the local SRC, and the
       yardsticks: every tensor file of s3://B/src read with plain ranged GETs through s3fs (`cat_file`) and
       dropped, in sequential 64 MiB ranges, and in the fastest of a few parallel settings (each tried once before
       the runs); the writes' files must be the same. The write's throughput over the GETs' (median of the pairs)
       is the figure the S3 path is held to, and its CPU seconds beyond the local write's, per GB, its cost;
   (b) `torchrun --nproc-per-node 4 bench/remote_rank.py s3://B/folder` (gloo, OMP_NUM_THREADS=1:
       `reshard.from_pretrained`, CRC-32s checked) and the same load of the local FOLDER.
   The local runs read a warm page cache (SRC and FOLDER are read once before each). weed's own files were just
   written and fit in RAM too, so S3 against local is the HTTP path (client, proxy, server) against `pread`, not
   one disk against another. `--direct` adds each S3 command pointed at weed's own port: no proxy, so no log.
4. Reports, per measurement (medians over runs): seconds (whole process + sync; for the load also the slowest
   rank's `from_pretrained` alone, and the time before and after it), GB/s (source tensor bytes / seconds), the GET
   requests the proxy logged against the tensors the source holds (the checkpoint's keys for the write; the chunks
   in the rank files' headers for the load: coalescing means fewer requests than tensors), bytes fetched (GET
   bodies) against bytes needed (the safetensors files the command must read: every source file for the write,
   every rank file for the load), one request's own rate (MB/s), peak RSS (the write process; the largest rank for
   the load), and CPU seconds of the command, of the proxy (this process) and of weed: where the time of the S3 path
   goes when client and server share the machine.

Prints a table, and writes it as JSON with `--json PATH`. `--load-size-gb` loads a checkpoint of another size (if 4
ranks of `--size-gb` do not fit in memory). `--profile` adds one in-process write from S3 under cProfile, and (unless the load is skipped) one 4-rank load
from S3 with rank 0's `from_pretrained` under cProfile. Everything
generated is deleted at the end unless `--keep`.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent / "tests"))
import write as wb  # noqa: E402  (bench/write.py: the generator and the timing helpers)
from s3_server import S3Server  # noqa: E402

GB = 10**9
RANK_SCRIPT = BENCH / "remote_rank.py"
RANKS = 4

# The yardstick of a write from S3: every tensor file of the prefix read with plain ranged GETs through s3fs
# (`cat_file`), RANGE bytes each, THREADS at once (1: one after the other), and dropped: no planning, no output, no CRC.
RAW_GETS = """
import sys
from concurrent.futures import ThreadPoolExecutor
import s3fs
url, block, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
fs = s3fs.S3FileSystem()
files = [(e['name'], e['size']) for e in fs.ls(url.removeprefix('s3://'), detail=True)
         if e['name'].endswith('.safetensors')]
parts = [(n, o, min(o + block, size)) for n, size in files for o in range(0, size, block)]
def get(part):
    return len(fs.cat_file(part[0], start=part[1], end=part[2]))
with ThreadPoolExecutor(threads) as pool:
    print(sum(pool.map(get, parts)))
"""
SEQUENTIAL = (64 << 20, 1)  # the yardstick: 64 MiB ranges, one after the other
PARALLEL = [(16 << 20, 4), (16 << 20, 8), (32 << 20, 4), (64 << 20, 4)]  # tried once; the fastest is timed

# The floor of a merge into S3: the files of a local merge output sent as raw multipart uploads (the same s3fs client
# and settings, the same part size, the same parts in flight as reshard's bucket output), each file's uploads in turn.
RAW_UPLOAD = """
import os, sys
from concurrent.futures import ThreadPoolExecutor
import s3fs
from reshard.read._source import s3_filesystem
from reshard.write._bucket import PARTS_IN_FLIGHT, part_bytes
folder, url = sys.argv[1], sys.argv[2]
bucket, prefix = url.split("://", 1)[1].split("/", 1)
fs = s3_filesystem(s3fs)
def send(key, upload, number, path, start, n):
    with open(path, "rb") as f:
        f.seek(start)
        data = f.read(n)
    for attempt in range(4):  # as reshard's bound: a loaded machine times a request out now and then
        try:
            answer = fs.call_s3("upload_part", Bucket=bucket, Key=key, UploadId=upload, PartNumber=number, Body=data)
            return {"PartNumber": number, "ETag": answer["ETag"]}
        except Exception:
            if attempt == 3:
                raise
with ThreadPoolExecutor(PARTS_IN_FLIGHT) as pool:
    for name in sorted(os.listdir(folder)):
        path, key = os.path.join(folder, name), f"{prefix}/{name}"
        size = os.path.getsize(path)
        step = part_bytes(size)
        upload = fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)["UploadId"]
        parts = list(pool.map(lambda a: send(key, upload, *a), [(i + 1, path, o, min(step, size - o))
                                                                  for i, o in enumerate(range(0, size, step))]))
        fs.call_s3("complete_multipart_upload", Bucket=bucket, Key=key, UploadId=upload,
                   MultipartUpload={"Parts": parts})
"""


# ---- what the server saw ----------------------------------------------------------------------------------------

def weed_cpu(server: S3Server) -> float:
    """CPU seconds weed (one process: master, volume, filer and S3 gateway) has used so far."""
    try:
        fields = Path(f"/proc/{server.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")  # utime stime cutime cstime
    except (OSError, IndexError, ValueError):
        return float("nan")


def self_cpu() -> float:
    """This process's CPU seconds: while a timed command runs, the main thread waits, so this is the proxy's."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def traffic(server: S3Server, bucket: str, prefix: str) -> dict:
    """What the proxy logged under `prefix` since the last `clear_log`: GETs (tensor files, of them header probes,
    and the rest: listings, config, index, manifest), HEADs, body bytes sent."""
    logged = server.requests(bucket=bucket, wait=30)
    gets = [r for r in logged if r.method == "GET"]
    files = [r for r in gets if r.key.startswith(prefix) and r.key.endswith(".safetensors")]
    return {"gets": len(gets), "file_gets": len(files),
            "header_gets": sum(1 for r in files if (r.range or "").startswith("bytes=0-")),
            "other_gets": len(gets) - len(files), "heads": sum(1 for r in logged if r.method == "HEAD"),
            "fetched": sum(r.sent for r in files), "fetched_other": sum(r.sent for r in gets) - sum(
                r.sent for r in files),
            "failed": sum(1 for r in logged if r.status is None or r.status >= 400),
            # one request's own rate (body bytes / seconds the proxy spent on it): what one stream gets
            "stream_mb_s": statistics.median([r.sent / r.seconds / 1e6 for r in files if r.sent >= 1 << 20] or [0]),
            "per_key": _per_access_key(files)}


def _per_access_key(requests) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in requests:
        out[r.access_key or "-"] = out.get(r.access_key or "-", 0) + 1
    return out


def header_tensors(path: Path) -> int:
    """Tensors in a safetensors file's header."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return sum(1 for k in json.loads(f.read(n)) if k != "__metadata__")


# ---- the timed commands ----------------------------------------------------------------------------------------

class Bench:
    def __init__(self, args, server: S3Server, work: Path, bucket: str):
        self.args, self.server, self.work, self.bucket = args, server, work, bucket

    def client_env(self, *, direct: bool = False) -> dict:
        env = self.server.environ("write", base=wb.env())
        if direct:  # weed's own S3 port: no proxy, no log
            env["AWS_ENDPOINT_URL_S3"] = env["AWS_ENDPOINT_URL"] = f"http://127.0.0.1:{self.server.s3_port}"
        return env

    def measure(self, cmd: list[str], *, logged: bool, direct: bool = False) -> dict:
        """Run `cmd` (+ sync) timed; what it cost the command, the proxy and weed."""
        if logged:
            self.server.clear_log()
        load = os.getloadavg()[0]
        proxy, weed, start = self_cpu(), weed_cpu(self.server), time.time()
        wall, rss, _, cpu = wb.run_timed(cmd, env=self.client_env(direct=direct))
        return {"seconds": wall, "rss_kib": rss, "cpu": cpu, "proxy_cpu": self_cpu() - proxy,
                "weed_cpu": weed_cpu(self.server) - weed, "loadavg": [load, os.getloadavg()[0]], "start": start}

    def write(self, src: str, where: str, prefix: str) -> dict:
        out = self.work / "out"
        cmd = [sys.executable, "-m", "reshard", "write", src, str(out), "--fsdp", str(self.args.fsdp), "--ep",
               str(self.args.ep), "-q"]
        row = self.measure(cmd, logged=where == "s3", direct=where == "direct")
        manifest = json.loads((out / "reshard.json").read_text())
        row["crc32"] = {f["name"]: f["crc32"] for f in manifest["files"]}  # the same output, whatever the source
        if where == "s3":
            row.update(traffic(self.server, self.bucket, prefix))
        wb.remove(out)
        return row

    def raw_gets(self, src: str, prefix: str, setting: tuple[int, int]) -> dict:
        row = self.measure([sys.executable, "-c", RAW_GETS, src, str(setting[0]), str(setting[1])], logged=True)
        row.update(traffic(self.server, self.bucket, prefix))
        return row

    def upload(self, folder: Path, merged: Path, kind: str, run: int) -> dict:
        """`reshard merge FOLDER s3://...` (kind "merge"), or the raw multipart upload of MERGED (kind "raw")."""
        url = f"s3://{self.bucket}/{kind}-{run}"
        cmd = ([sys.executable, "-m", "reshard", "merge", str(folder), url, "-q"] if kind == "merge" else
               [sys.executable, "-c", RAW_UPLOAD, str(merged), url])
        row = self.measure(cmd, logged=True)
        logged = [r for r in self.server.requests(bucket=self.bucket, wait=30) if r.key.startswith(f"{kind}-{run}/")
                  and r.method in ("PUT", "POST") and ".reshard-write-check" not in r.key]  # not the permission check
        row["parts"] = sum(1 for r in logged if r.method == "PUT" and "partNumber=" in r.query)
        row["sent"] = sum(r.received for r in logged if r.method == "PUT")
        # the upload itself, as the server saw it: from the first upload opened to the last request done (Python's
        # start, imports and planning left out, which the whole-process time counts)
        row["upload_seconds"] = max(r.started + r.seconds for r in logged) - min(r.started for r in logged)
        import s3fs

        s3fs.S3FileSystem(**self.fs_options()).rm(f"{self.bucket}/{kind}-{run}", recursive=True)
        return row

    def fs_options(self) -> dict:
        env = self.client_env()
        return {"key": env["AWS_ACCESS_KEY_ID"], "secret": env["AWS_SECRET_ACCESS_KEY"],
                "endpoint_url": env["AWS_ENDPOINT_URL_S3"], "skip_instance_cache": True}

    def load(self, folder: str, where: str, prefix: str, architecture: str, *, profile: bool = False) -> dict:
        """One timed 4-rank load; with `profile`, rank 0's `from_pretrained` under cProfile, its profile printed."""
        reports = Path(tempfile.mkdtemp(prefix="ranks-", dir=self.work))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={RANKS}",
               str(RANK_SCRIPT), folder, architecture, str(reports)]
        if profile:
            os.environ["RESHARD_BENCH_PROFILE"] = "1"
        try:
            row = self.measure(cmd, logged=where == "s3", direct=where == "direct")
        finally:
            os.environ.pop("RESHARD_BENCH_PROFILE", None)
        ranks = [json.loads((reports / f"rank{r}.json").read_text()) for r in range(RANKS)]
        if profile:
            print(f"\nprofile: rank 0 of a {RANKS}-rank load from {folder}, {ranks[0]['load_s']:.2f} s, "
                  f"{ranks[0]['load_cpu_s']:.2f} CPU s\n{(reports / 'profile.txt').read_text()}", flush=True)
        wb.remove(reports)
        last = max(ranks, key=lambda r: r["times"]["load_end"])["times"]  # the rank that finished loading last
        row.update(load_max=max(r["load_s"] for r in ranks), load_cpu=[r["load_cpu_s"] for r in ranks],
                   rank_rss_kib=max(r["maxrss_kib"] for r in ranks), share=sum(r["share"] for r in ranks),
                   before_load=last["load_start"] - row["start"],  # torchrun, interpreters, imports, process group
                   after_load=row["start"] + row["seconds"] - last["load_end"])  # report, tear-down, exit, sync
        if where == "s3":
            row.update(traffic(self.server, self.bucket, prefix))
        return row


# ---- the report ------------------------------------------------------------------------------------------------

def med(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else float("nan")


def summary(name: str, rows: list[dict], source_bytes: int, tensors: int, needed: int, *, load: bool) -> dict:
    seconds = med(rows, "seconds")
    out = {"measurement": name, "runs": [round(r["seconds"], 3) for r in rows], "seconds": seconds,
           "gb_per_s": source_bytes / seconds / GB, "tensors": tensors, "bytes_needed": needed,
           "peak_rss_mib": max((r["rank_rss_kib"] if load else r["rss_kib"]) or 0 for r in rows) / 1024,
           "cpu_s": med(rows, "cpu"), "proxy_cpu_s": med(rows, "proxy_cpu"), "weed_cpu_s": med(rows, "weed_cpu"),
           "loadavg": [min(r["loadavg"][0] for r in rows), max(max(r["loadavg"]) for r in rows)]}
    if load:
        out["before_load_s"], out["after_load_s"] = med(rows, "before_load"), med(rows, "after_load")
        out["from_pretrained_s"] = med(rows, "load_max")
        out["from_pretrained_runs"] = [round(r["load_max"], 3) for r in rows]
    if rows and "gets" in rows[0]:
        out.update({k: med(rows, k) for k in ("gets", "file_gets", "header_gets", "other_gets", "heads", "fetched",
                                               "fetched_other", "stream_mb_s")})
        out["failed_requests"] = sum(r["failed"] for r in rows)
        out["file_gets_per_rank"] = rows[-1]["per_key"]
    return out


def print_table(rows: list[dict]) -> None:
    print(f"\n{'measurement':28s} {'median s':>9s} {'GB/s':>6s} {'GETs (files)':>13s} {'tensors':>8s} "
          f"{'fetched / needed GB':>20s} {'peak RSS':>9s} {'CPU s cmd/proxy/weed':>21s}  runs")
    for r in rows:
        gets = f"{r['gets']:.0f} ({r['file_gets']:.0f})" if "gets" in r else "-"
        fetched = f"{r['fetched'] / GB:.3f} / {r['bytes_needed'] / GB:.3f}" if "fetched" in r else \
            f"- / {r['bytes_needed'] / GB:.3f}"
        cpu = f"{r['cpu_s']:.1f}/{r['proxy_cpu_s']:.1f}/{r['weed_cpu_s']:.1f}"
        print(f"{r['measurement']:28s} {r['seconds']:9.2f} {r['gb_per_s']:6.2f} {gets:>13s} {r['tensors']:8d} "
              f"{fetched:>20s} {r['peak_rss_mib']:6.0f} MiB {cpu:>21s}  {', '.join(f'{x:.2f}' for x in r['runs'])}")
        if "from_pretrained_s" in r:
            print(f"{'  from_pretrained (slowest)':28s} {r['from_pretrained_s']:9.2f}  "
                  f"runs {', '.join(f'{x:.2f}' for x in r['from_pretrained_runs'])}; before it (torchrun, start-up, "
                  f"imports, process group) {r['before_load_s']:.2f} s, after it (tear-down, exit) "
                  f"{r['after_load_s']:.2f} s")


def pairs(a: list[dict], b: list[dict], key: str = "seconds") -> float:
    return statistics.median(x[key] / y[key] for x, y in zip(a, b))


def alternate(kinds: list[str], runs: int):
    """(round, kind) pairs: every kind once a round, the first of each round moving on by one."""
    for i in range(runs):
        for kind in kinds[i % len(kinds):] + kinds[:i % len(kinds)]:
            yield i, kind


def best_parallel(bench: Bench, url: str) -> tuple[int, int]:
    """The fastest of the PARALLEL settings of plain ranged GETs, each run once."""
    timed = []
    for setting in PARALLEL:
        row = bench.raw_gets(url, "src/", setting)
        print(f"  raw GETs, {setting[0] >> 20} MiB x {setting[1]} threads: {row['seconds']:.2f} s", flush=True)
        timed.append((row["seconds"], setting))
    return min(timed)[1]


def raw_name(setting: tuple[int, int]) -> str:
    return f"  s3fs GETs {setting[0] >> 20} MiB x {setting[1]}"


def bench_writes(bench: Bench, src: Path, total: int, wheres: list[str]) -> tuple[list[dict], dict]:
    files = sorted(src.glob("*.safetensors"))
    needed = sum(p.stat().st_size for p in files)  # every source file, headers and all: each tensor is written
    tensors = len(json.loads((src / "model.safetensors.index.json").read_text())["weight_map"])
    url = {"s3": f"s3://{bench.bucket}/src", "local": str(src), "direct": f"s3://{bench.bucket}/src"}
    settings = {"sequential": SEQUENTIAL, "parallel": best_parallel(bench, url["s3"])}
    kinds = wheres + list(settings)
    runs: dict[str, list] = {k: [] for k in kinds}
    for i, kind in alternate(kinds, bench.args.runs):
        if kind == "local":
            wb.warm(src)
        row = (bench.raw_gets(url["s3"], "src/", settings[kind]) if kind in settings
               else bench.write(url[kind], kind, "src/"))
        runs[kind].append(row)
        extra = (f", {row['gets']} GETs ({row['file_gets']} on tensor files), {row['fetched'] / GB:.3f} GB fetched, "
                 f"{row['stream_mb_s']:.0f} MB/s per request" if "gets" in row else "")
        label = raw_name(settings[kind]).strip() if kind in settings else "write " + kind
        print(f"  run {i + 1} {label:22s} {row['seconds']:6.2f} s "
              f"(cpu {row['cpu']:.1f} s, proxy {row['proxy_cpu']:.1f} s, weed {row['weed_cpu']:.1f} s, peak RSS "
              f"{(row['rss_kib'] or 0) / 1024:.0f} MiB{extra}; load avg {row['loadavg'][0]:.1f})", flush=True)
    if len({json.dumps(r["crc32"], sort_keys=True) for w in wheres for r in runs[w]}) != 1:
        raise SystemExit("the writes from S3 and from the local copy gave different files")
    names = {"s3": "write from s3://", "local": "write from local (warm)", "direct": "write from s3:// (no proxy)",
             "sequential": raw_name(SEQUENTIAL), "parallel": raw_name(settings["parallel"])}
    rows = [summary(names[k], runs[k], total, tensors, needed, load=False) for k in kinds]
    rows[0]["s3_over_local"] = pairs(runs["s3"], runs["local"])
    # throughput of the write over that of the plain GETs: the GETs' time over the write's, median of the pairs
    rows[0]["over_sequential_gets"] = pairs(runs["sequential"], runs["s3"])
    rows[0]["over_parallel_gets"] = pairs(runs["parallel"], runs["s3"])
    rows[0]["cpu_s_per_gb_beyond_local"] = (rows[0]["cpu_s"] - rows[1]["cpu_s"]) / (total / GB)
    return rows, {k: [{n: v for n, v in r.items() if n != "crc32"} for r in runs[k]] for k in kinds}


def bench_loads(bench: Bench, folder: Path, total: int, architecture: str, wheres: list[str]
                ) -> tuple[list[dict], dict]:
    rank_files = sorted(folder.glob("*.safetensors"))
    needed = sum(p.stat().st_size for p in rank_files)  # each rank reads its own files whole
    tensors = sum(header_tensors(p) for p in rank_files)
    print(f"FOLDER: {total / GB:.2f} GB at fsdp {RANKS} x ep 2, {len(rank_files)} rank files, {tensors} tensors in "
          "their headers", flush=True)
    url = {"s3": f"s3://{bench.bucket}/folder", "local": str(folder), "direct": f"s3://{bench.bucket}/folder"}
    runs: dict[str, list] = {w: [] for w in wheres}
    for i, where in alternate(wheres, bench.args.runs):
        if where == "local":
            wb.warm(folder)
        row = bench.load(url[where], where, "folder/", architecture)
        runs[where].append(row)
        extra = (f", {row['gets']} GETs ({row['file_gets']} on rank files), {row['fetched'] / GB:.3f} GB fetched, "
                 f"{row['stream_mb_s']:.0f} MB/s per request" if "gets" in row else "")
        print(f"  run {i + 1} load  {where:6s} {row['seconds']:6.2f} s, from_pretrained slowest "
              f"{row['load_max']:.2f} s (cpu {row['cpu']:.1f} s, proxy {row['proxy_cpu']:.1f} s, weed "
              f"{row['weed_cpu']:.1f} s, largest rank {row['rank_rss_kib'] / 1024:.0f} MiB{extra}; "
              f"load avg {row['loadavg'][0]:.1f})", flush=True)
    names = {"s3": f"load {RANKS} ranks from s3://", "local": f"load {RANKS} ranks, local (warm)",
             "direct": f"load {RANKS} ranks, s3:// (no proxy)"}
    rows = [summary(names[w], runs[w], total, tensors, needed, load=True) for w in wheres]
    rows[0]["s3_over_local"] = pairs(runs["s3"], runs["local"])
    rows[0]["from_pretrained_s3_over_local"] = pairs(runs["s3"], runs["local"], "load_max")
    return rows, runs


def bench_uploads(bench: Bench, folder: Path) -> tuple[list[dict], dict]:
    """`reshard merge FOLDER s3://...` against the raw multipart upload of its files, alternating."""
    merged = bench.work / "merged"
    wb.run_timed([sys.executable, "-m", "reshard", "merge", str(folder), str(merged), "-q"], env=wb.env())
    total = sum(p.stat().st_size for p in merged.iterdir())
    print(f"MERGED: {total / GB:.2f} GB in {len(list(merged.iterdir()))} files", flush=True)
    runs: dict[str, list] = {"merge": [], "raw": []}
    for i, kind in alternate(["merge", "raw"], bench.args.runs):
        if kind == "merge":
            wb.warm(folder)
        else:
            wb.warm(merged)
        row = bench.upload(folder, merged, kind, i)
        runs[kind].append(row)
        print(f"  run {i + 1} {kind:5s} into s3 {row['seconds']:6.2f} s, uploading {row['upload_seconds']:6.2f} s "
              f"({total / row['upload_seconds'] / 1e6:.0f} MB/s, "
              f"{row['parts']} parts, {row['sent'] / GB:.3f} GB sent, peak RSS {(row['rss_kib'] or 0) / 1024:.0f} "
              f"MiB; load avg {row['loadavg'][0]:.1f})", flush=True)
    rows = [summary("merge into s3://", runs["merge"], total, 0, total, load=False),
            summary("  raw multipart PUTs", runs["raw"], total, 0, total, load=False)]
    rows[0]["throughput_over_raw"] = pairs(runs["raw"], runs["merge"], "upload_seconds")
    rows[0]["process_over_raw"] = pairs(runs["raw"], runs["merge"])
    for row, kind in zip(rows, ("merge", "raw")):
        row["upload_seconds"] = med(runs[kind], "upload_seconds")
    wb.remove(merged)
    return rows, runs


def profile_write(bench: Bench, src_url: str) -> None:
    """One in-process write from S3, straight to weed (the proxy shares this process), under cProfile timed by each
    thread's own CPU clock (`remote_rank.profiled`); the top entries by cumulative and by own CPU time."""
    from remote_rank import profiled

    os.environ.update(bench.client_env(direct=True))
    sys.path.insert(0, str(wb.REPO))
    from reshard.api import write_checkpoint
    from reshard.plan import MeshSpec

    out = bench.work / "out-profile"
    start, cpu = time.perf_counter(), time.process_time()
    _, text = profiled(write_checkpoint, src_url, out, MeshSpec(fsdp=bench.args.fsdp, ep=bench.args.ep),
                       progress=False, top=(25, 15))
    print(f"\nprofile: in-process write from {src_url} (no proxy) {time.perf_counter() - start:.2f} s, "
          f"{time.process_time() - cpu:.2f} CPU s (all threads); {text}", flush=True)
    wb.remove(out)


def report(rows: list[dict], results: dict, args) -> None:
    results["rows"] = rows
    results["conditions"]["loadavg_end"] = os.getloadavg()
    print_table(rows)
    for r in rows:
        if "s3_over_local" in r:
            print(f"  {r['measurement']}: s3 / local {r['s3_over_local']:.2f}x (median of pairs)"
                  + (f", from_pretrained {r['from_pretrained_s3_over_local']:.2f}x"
                     if "from_pretrained_s3_over_local" in r else "")
                  + (f"; throughput {r['over_sequential_gets']:.2f}x sequential 64 MiB GETs, "
                     f"{r['over_parallel_gets']:.2f}x the best parallel GETs; "
                     f"{r['cpu_s_per_gb_beyond_local']:.2f} CPU s per GB beyond the local write"
                     if "over_sequential_gets" in r else "")
                  + (f"; fetched {r['fetched'] / r['bytes_needed']:.4f}x the rank files' bytes"
                     if "from_pretrained_s3_over_local" in r and "fetched" in r else ""))
    for r in rows:
        if "throughput_over_raw" in r:
            print(f"  {r['measurement']}: upload throughput {r['throughput_over_raw']:.2f}x raw multipart PUTs of the "
                  f"same bytes (first upload opened to last request, median of pairs); whole process "
                  f"{r['process_over_raw']:.2f}x")
    for r in rows:
        if r.get("stream_mb_s"):
            print(f"  {r['measurement'].strip()}: one request alone ran at {r['stream_mb_s']:.0f} MB/s (median)")
    if rows:
        print(f"  load average during the runs: {min(r['loadavg'][0] for r in rows):.1f}-"
              f"{max(r['loadavg'][1] for r in rows):.1f} on {os.cpu_count()} cores")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
        print(f"wrote {args.json}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gb", type=float, default=2.0, help="checkpoint size in GB (10^9 bytes)")
    parser.add_argument("--load-size-gb", type=float, default=None,
                        help="checkpoint size for the load (default: --size-gb); a second checkpoint if it differs")
    parser.add_argument("--runs", type=int, default=3, help="timed runs of each measurement")
    parser.add_argument("--fsdp", type=int, default=8, help="the timed write's mesh")
    parser.add_argument("--ep", type=int, default=2)
    parser.add_argument("--shard-gb", type=float, default=1.0, help="source file size (GB)")
    parser.add_argument("--direct", action="store_true",
                        help="also time each S3 command against weed's own port, without the proxy (not logged)")
    parser.add_argument("--skip", default="", help="comma-separated: write, load, upload")
    parser.add_argument("--profile", action="store_true", help="also profile one in-process write from S3 and rank 0 of a load")
    parser.add_argument("--dir", type=Path, default=None, help="where to generate (default: a temp folder)")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--keep", action="store_true", help="keep the generated checkpoints (the server is stopped)")
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    wheres = ["s3", "local"] + (["direct"] if args.direct else [])

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a SIGTERM still stops the server and removes the files
    work = Path(tempfile.mkdtemp(prefix="reshard-bench-remote-", dir=args.dir))
    wb.CACHE_DIR = work / "layout-cache"
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()}; work folder {work}", flush=True)
    server = S3Server.start()  # from the main thread: weed dies with it (see S3Server.start)
    try:
        print(f"S3 server (weed + proxy) on 127.0.0.1 in {server.start_seconds:.1f} s", flush=True)
        bench = Bench(args, server, work, server.new_bucket("bench"))
        results: dict = {"conditions": {
            "cores": os.cpu_count(), "loadavg_start": os.getloadavg(), "size_gb": args.size_gb, "runs": args.runs,
            "write_mesh": f"{args.fsdp}x{args.ep}", "load_ranks": RANKS, "load_mesh": f"{RANKS}x2",
            "direct": args.direct}, "rows": [], "runs": {}}
        src, total = wb.generate(work / "src", int(args.size_gb * GB), int(args.shard_gb * GB))
        print(f"SRC: {total / GB:.2f} GB, {len(list(src.glob('*.safetensors')))} files", flush=True)
        architecture = json.loads((src / "config.json").read_text())["architectures"][0]
        rows = []
        if "write" not in skip or args.profile:
            wb.check_plan(src, args.fsdp)  # fills the layout cache every timed write uses (keyed on config + tensors)
            t = time.perf_counter()
            server.put_folder(src, f"s3://{bench.bucket}/src")
            print(f"  uploaded in {time.perf_counter() - t:.1f} s", flush=True)
        if "write" not in skip:
            write_rows, results["runs"]["write"] = bench_writes(bench, src, total, wheres)
            rows += write_rows
        if "load" not in skip or "upload" not in skip:
            load_src, load_total = src, total
            if args.load_size_gb and args.load_size_gb != args.size_gb:
                load_src, load_total = wb.generate(work / "src-load", int(args.load_size_gb * GB),
                                                   int(args.shard_gb * GB))
            folder = work / "folder"
            wb.run_timed([sys.executable, "-m", "reshard", "write", str(load_src), str(folder), "--fsdp", str(RANKS),
                          "--ep", "2", "-q"], env=wb.env())
            if load_src != src:
                wb.remove(load_src)
            t = time.perf_counter()
            server.put_folder(folder, f"s3://{bench.bucket}/folder")
            print(f"  FOLDER uploaded in {time.perf_counter() - t:.1f} s", flush=True)
            if "load" not in skip:
                load_rows, results["runs"]["load"] = bench_loads(bench, folder, load_total, architecture, wheres)
                rows += load_rows
            if "upload" not in skip:
                upload_rows, results["runs"]["upload"] = bench_uploads(bench, folder)
                rows += upload_rows
        report(rows, results, args)
        if args.profile:
            profile_write(bench, f"s3://{bench.bucket}/src")
            if "load" not in skip:
                bench.load(f"s3://{bench.bucket}/folder", "s3", "folder", architecture, profile=True)
    finally:
        server.stop()
        wb.keep_or_remove(work, args.keep)


if __name__ == "__main__":
    main()
