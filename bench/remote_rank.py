"""One rank of `bench/remote.py`: `reshard.from_pretrained(FOLDER)` timed, from a local folder or an `s3://` URL.

usage (under torchrun): remote_rank.py FOLDER ARCHITECTURE REPORT_DIR

`bench/load_rank.py` does not fit: it reads the config with `AutoConfig.from_pretrained(FOLDER)`, which cannot read
an `s3://` URL, and its read counters wrap local file opens only. Here the S3 requests are counted by the server's
proxy instead: each rank reads as access key `rank{r}`, so the log tells the ranks apart.

Every import (torch, transformers, the model class ARCHITECTURE, reshard's loader, s3fs) and the process group come
before a barrier, so `load_s` is `from_pretrained` alone, comparable across ranks and between local and S3. Writes
REPORT_DIR/rank{r}.json: `load_s`, `load_cpu_s` (this process, all threads), `share` (bytes of its local tensors),
`maxrss_kib` (getrusage: the process's peak RSS), `times` (epoch seconds: process start, imports and process group
done, around the load, report written).
"""

from __future__ import annotations

import importlib
import json
import os
import resource
import sys
import time


def _process_start() -> float:
    """Epoch seconds at which this process started (its age from /proc, 10 ms resolution)."""
    now = time.time()
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    with open("/proc/self/stat") as f:
        start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    return now - (uptime - start_ticks / os.sysconf("SC_CLK_TCK"))


def profiled(function, *args, top: tuple[int, int] = (30, 20), **kwargs):
    """`function(*args, **kwargs)` under cProfile timed by each thread's own CPU clock: every thread started meanwhile
    has a profiler of its own (the fetches run on a pool, the client's event loop on its own thread), added up at the
    end; returns (its result, the top entries by cumulative and by own CPU time, as text). bench/remote.py's write
    profile uses it too."""
    import cProfile
    import io
    import pstats
    import threading

    profiles, run = [cProfile.Profile(time.thread_time)], threading.Thread.run

    def each_thread(thread):
        profiler = cProfile.Profile(time.thread_time)
        profiles.append(profiler)
        profiler.runcall(run, thread)

    threading.Thread.run = each_thread
    try:
        result = profiles[0].runcall(function, *args, **kwargs)
    finally:
        threading.Thread.run = run
    out = io.StringIO()
    stats = pstats.Stats(profiles[0], stream=out)
    for profiler in profiles[1:]:
        try:
            stats.add(profiler)
        except TypeError:  # a thread still running (the client's event loop): its profile is not closed yet
            pass
    stats.sort_stats("cumulative").print_stats(top[0])
    stats.sort_stats("tottime").print_stats(top[1])
    return result, f"{len(profiles)} threads profiled\n{out.getvalue()}"


def main() -> None:
    folder, architecture, report_dir = sys.argv[1:4]
    rank = int(os.environ["RANK"])
    os.environ["AWS_ACCESS_KEY_ID"] = f"rank{rank}"  # read by botocore when the store is opened, after this
    times = {"process_start": _process_start(), "script_start": time.time()}
    import torch.distributed as dist
    import transformers

    import reshard
    import reshard.load._loader  # noqa: F401  (what from_pretrained imports on first use)

    getattr(transformers, architecture)  # the lazy import of the modeling module, outside the timed load
    if folder.startswith("s3://"):
        importlib.import_module("s3fs")  # imported outside the timed load, as the modeling module is
    transformers.logging.set_verbosity_error()
    dist.init_process_group("gloo")
    times["imports"] = time.time()
    dist.barrier()
    times["load_start"] = time.time()
    cpu = time.process_time()
    if rank == 0 and os.environ.get("RESHARD_BENCH_PROFILE"):  # bench/remote.py --profile: rank 0 profiled
        model, text = profiled(reshard.from_pretrained, folder)
        with open(os.path.join(report_dir, "profile.txt"), "w") as f:
            f.write(text)
    else:
        model = reshard.from_pretrained(folder)  # CRC-32 of every file checked as its bytes pass (the default)
    times["load_end"] = time.time()
    cpu = time.process_time() - cpu
    local = [t.to_local() if hasattr(t, "to_local") else t for t in model.state_dict().values()]
    report = {"rank": rank, "load_s": times["load_end"] - times["load_start"], "load_cpu_s": cpu,
              "share": sum(t.numel() * t.element_size() for t in local),
              "maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "times": times}
    times["report"] = time.time()
    with open(os.path.join(report_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.barrier()  # no rank tears gloo down while another is still in a collective
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
