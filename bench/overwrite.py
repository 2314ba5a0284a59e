"""Benchmark what `--overwrite` into a bucket costs: `reshard write SRC s3://B/out --overwrite` over an existing
checkpoint there, against the same write into a fresh prefix, on a real S3 server on 127.0.0.1.

    python bench/overwrite.py                            # 1.6 GB, 3 runs of each
    python bench/overwrite.py --repo ../other-checkout   # the same, with another checkout's reshard (a before/after)

What it does: starts the tests' S3 server (tests/s3_server.py: SeaweedFS behind the logging proxy), generates SRC,
a per-expert BF16 qwen3_moe checkpoint of `--size-gb` (bench/write.py's generator), and writes it once into
s3://B/out (`--fsdp 4 --ep 2`): the old checkpoint. Then it alternates, `--runs` times, (a) the same write into
s3://B/out with `--overwrite` and (b) the same write into a fresh prefix s3://B/fresh-N (removed after), each a
whole process timed with its `sync`, SRC warm in the page cache. It reports the medians of the seconds, and the
requests the proxy logged for each, by kind: what the overwrite costs beyond a fresh write (the listing and the
manifest read that check what may be replaced, the claim record's two PUTs and its DELETE, the old markers' and
the old objects' DELETEs). Everything generated is removed at the end unless `--keep`.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent / "tests"))
import write as wb  # noqa: E402  (bench/write.py: the generator and the timing helpers)
from s3_server import S3Server  # noqa: E402

GB = 10**9


def kind_of(request) -> str:
    """A request's kind, as S3 names its operations."""
    if request.method == "PUT":
        return "UploadPart" if "partNumber=" in request.query else "PutObject"
    if request.method == "POST":
        return "CreateMultipartUpload" if request.query.startswith("uploads") else "CompleteMultipartUpload"
    if request.method == "DELETE":
        return "AbortMultipartUpload" if "uploadId=" in request.query else "DeleteObject"
    if request.method == "GET":
        return ("ListObjectsV2" if "list-type=2" in request.query else
                "ListMultipartUploads" if "uploads" in request.query else "GetObject")
    return request.method


def run(server: S3Server, bucket: str, cmd: list[str], env: dict, prefix: str, repo: Path) -> dict:
    server.clear_log()
    wall, rss, err, cpu = wb.run_timed(cmd, env=env, cwd=repo)  # `python -m` puts the working folder first
    log = [r for r in server.requests(bucket=bucket, wait=30) if r.key == "" or r.key.startswith(prefix + "/")]
    kinds = collections.Counter(kind_of(r) for r in log)
    return {"seconds": wall, "cpu": cpu, "rss_kib": rss, "requests": len(log), "kinds": dict(sorted(kinds.items())),
            "sent": sum(r.received for r in log), "loadavg": os.getloadavg()[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gb", type=float, default=1.6, help="checkpoint size in GB (10^9 bytes)")
    parser.add_argument("--runs", type=int, default=3, help="timed runs of each")
    parser.add_argument("--repo", type=Path, default=BENCH.parent, help="the checkout whose reshard runs")
    parser.add_argument("--dir", type=Path, default=None, help="where to generate (default: a temp folder)")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--keep", action="store_true", help="keep the generated checkpoint (the server is stopped)")
    args = parser.parse_args()

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a SIGTERM still stops the server and removes the files
    work = Path(tempfile.mkdtemp(prefix="reshard-bench-overwrite-", dir=args.dir))
    wb.CACHE_DIR = work / "layout-cache"
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()}; reshard from {args.repo}", flush=True)
    server = S3Server.start()
    try:
        bucket = server.new_bucket("overwrite")
        env = server.environ("write", base=wb.env(args.repo.resolve()))
        src, total = wb.generate(work / "src", int(args.size_gb * GB), int(GB))
        print(f"SRC: {total / GB:.2f} GB", flush=True)
        probe = subprocess.run([sys.executable, "-c", "import reshard; print(reshard.__file__)"], env=env,
                               cwd=args.repo.resolve(), capture_output=True, text=True, check=True).stdout.strip()
        print(f"  reshard from {probe}", flush=True)

        def write(url: str, *more: str) -> list[str]:
            return [sys.executable, "-m", "reshard", "write", str(src), url, "--fsdp", "4", "--ep", "2", "-q", *more]

        wb.check_plan(src, 4)  # the layout cache every timed write uses
        repo = args.repo.resolve()
        first = run(server, bucket, write(f"s3://{bucket}/out"), env, "out", repo)
        print(f"  the old checkpoint written in {first['seconds']:.2f} s", flush=True)
        rows: dict[str, list] = {"overwrite": [], "fresh": []}
        for i in range(args.runs):
            for kind in (("overwrite", "fresh") if i % 2 == 0 else ("fresh", "overwrite")):
                wb.warm(src)
                prefix = "out" if kind == "overwrite" else f"fresh-{i}"
                row = run(server, bucket, write(f"s3://{bucket}/{prefix}", *(["--overwrite"] if kind == "overwrite"
                                                                              else [])), env, prefix, repo)
                if kind == "fresh":
                    import s3fs

                    s3fs.S3FileSystem(key="bench", secret=env["AWS_SECRET_ACCESS_KEY"],
                                      endpoint_url=env["AWS_ENDPOINT_URL_S3"]).rm(f"{bucket}/{prefix}", recursive=True)
                rows[kind].append(row)
                print(f"  run {i + 1} {kind:9s} {row['seconds']:6.2f} s, {row['requests']} requests "
                      f"{row['kinds']}; load avg {row['loadavg']:.1f}", flush=True)
        medians = {kind: statistics.median(r["seconds"] for r in rows[kind]) for kind in rows}
        extra = collections.Counter(rows["overwrite"][-1]["kinds"])
        extra.subtract(rows["fresh"][-1]["kinds"])
        print(f"overwrite: median {medians['overwrite']:.2f} s; fresh: {medians['fresh']:.2f} s; the overwrite's "
              f"extra requests: {sum(extra.values())} ({ {k: v for k, v in extra.items() if v} })")
        if args.json:
            args.json.write_text(json.dumps({"size_gb": total / GB, "medians": medians, "runs": rows,
                                             "extra": dict(extra)}, indent=1))
    finally:
        server.stop()
        wb.keep_or_remove(work, args.keep)


if __name__ == "__main__":
    main()
