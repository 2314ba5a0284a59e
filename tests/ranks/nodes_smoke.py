"""Rank script: what a rank of a simulated node sees of its node's disk (tests/nodes.py).

usage: nodes_smoke.py MODE MOUNT_AT REPORT_DIR [VICTIM_NODE]
REPORT_DIR is a host folder every node sees; each rank writes REPORT_DIR/rank{r}.json with its rank, GROUP_RANK,
LOCAL_RANK, LOCAL_WORLD_SIZE and host pid (the host's /proc stays mounted in the node's PID namespace), and:
- `see`: writes MOUNT_AT/rank{r}, then all_gathers every rank's listing of MOUNT_AT into `seen` ({rank: names}).
- `write`: tries to write 1 MiB to MOUNT_AT/big-rank{r}; `written` is "ok" or the errno's name.
- `kill`: after a first barrier, VICTIM_NODE's ranks write MOUNT_AT/started-{local rank} and sleep (to be killed);
  the others enter a second barrier, which must fail once the victim is dead: `error` and `waited` (seconds in
  that barrier). They exit 3 on that error, without any further collective.
"""

import errno
import os
import sys
import time

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from rank_report import finish, record_failure, save  # noqa: E402


def main():
    mode, mount_at, report_dir = sys.argv[1:4]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    report = {"rank": rank, "world": dist.get_world_size(), "group_rank": int(os.environ["GROUP_RANK"]),
              "local_rank": int(os.environ["LOCAL_RANK"]), "local_world": int(os.environ["LOCAL_WORLD_SIZE"]),
              "pid": int(os.readlink("/proc/self"))}
    if mode == "see":
        with open(os.path.join(mount_at, f"rank{rank}"), "w") as f:
            f.write(f"rank{rank}")
        dist.barrier()  # every rank has written before any lists
        seen = [None] * report["world"]
        dist.all_gather_object(seen, sorted(os.listdir(mount_at)))
        report["seen"] = {str(r): names for r, names in enumerate(seen)}
    elif mode == "write":
        try:
            with open(os.path.join(mount_at, f"big-rank{rank}"), "wb") as f:
                f.write(b"\0" * (1 << 20))
            report["written"] = "ok"
        except OSError as e:
            report["written"] = errno.errorcode.get(e.errno, str(e.errno))
    elif mode == "kill":
        victim = int(sys.argv[4])
        dist.barrier()  # every rank is connected to every other before the victim stops answering
        save(report_dir, report)
        if report["group_rank"] == victim:
            with open(os.path.join(mount_at, f"started-{report['local_rank']}"), "w") as f:
                f.write("started")
            time.sleep(600)
        start = time.monotonic()
        try:
            dist.barrier()  # waits on the victim's ranks, which never come
        except Exception as e:  # noqa: BLE001 - gloo raises RuntimeError or DistBackendError by version
            report["waited"] = time.monotonic() - start
            record_failure(report, e)
            save(report_dir, report)
            sys.exit(3)
        report["waited"] = time.monotonic() - start
    finish(report_dir, report)


if __name__ == "__main__":
    main()
