"""Launch a rank script on NPROC processes with torch.multiprocessing spawn: no agent, as under srun or mpirun.

usage: spawn.py NPROC SUMMARY_JSON SCRIPT ARGS...
Each process gets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT, the way a launcher sets them, and runs
SCRIPT as __main__. Nothing here stops the other ranks when one fails: each must exit on its own. SUMMARY_JSON gets
every rank's exit code and seconds from launch to exit (null for one still running at the deadline, then killed).
"""

import json
import os
import pickle
import runpy
import socket
import sys
import time

import torch.multiprocessing as mp

DEADLINE = 300.0  # busy-machine imports take a minute; a rank waiting for a dead peer waits 600 s (gloo)


def _rank_main(rank, world, port, script, args):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")


def _show_escaped(rank: int, error_file: str) -> None:
    """spawn's wrapper pickles an exception that escaped the script into the rank's error file, and exits 1."""
    if error_file and os.path.exists(error_file) and os.path.getsize(error_file):
        with open(error_file, "rb") as f:
            sys.stderr.write(f"rank {rank} raised:\n{pickle.load(f)}\n")


def main():
    world, summary_path, script, *args = sys.argv[1:]
    world = int(world)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    context = mp.spawn(_rank_main, args=(world, port, script, args), nprocs=world, join=False)
    exits: dict[int, tuple] = {}
    while len(exits) < world and time.monotonic() - start < DEADLINE:
        for rank, process in enumerate(context.processes):
            if rank not in exits and not process.is_alive():
                exits[rank] = (process.exitcode, time.monotonic() - start)
                _show_escaped(rank, context.error_files[rank])
        time.sleep(0.05)
    for rank, process in enumerate(context.processes):
        if rank not in exits:
            process.kill()
            exits[rank] = (None, None)
    with open(summary_path, "w") as f:
        json.dump({str(r): {"exitcode": code, "seconds": t} for r, (code, t) in sorted(exits.items())}, f)
    sys.exit(0 if all(code == 0 for code, _ in exits.values()) else 1)


if __name__ == "__main__":
    main()
