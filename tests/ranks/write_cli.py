"""Run `reshard write` and `reshard merge` commands the way `python -m reshard` does, in order, in this process, with faults injected.

usage: write_cli.py CASES_JSON REPORT_DIR
CASES_JSON: a list of {"argv": [...], "fault": "..."}: the arguments after `reshard`, where `{rank}` becomes this
process's RANK (one SRC per node), and an optional fault. Each command's exit code and stderr go to
REPORT_DIR/case{i}-rank{r}.json; the script goes on with the next command after a failure (a distributed write that
fails, fails on every rank together, so the ranks stay in step) and exits 0 once all ran, but exits at once with the
code of a command interrupted by a signal (130, 143), or of a failed one whose case has "exit": true (as a lone
`torchrun -m reshard` would: torchrun's agent then stops at once instead of waiting for the other nodes at its exit
barrier).

Faults hit the process writing coordinate C, when it starts that coordinate's first file (for a merge: the process
writing its output file C + 1, `model-0000{C+1}-of-...`, and only enospc):
  enospc:C             raise OSError(ENOSPC), as a full disk does
  kill:C[:MARKER]      SIGKILL itself (after writing the time to MARKER)
  sleep:C:MARKER       write the file, create MARKER, then sleep 120 s (the test stops the write meanwhile)
  serve-sleep:MARKER   a merge across nodes: the first request a rank off node 0 answers creates MARKER, then that
                       rank sleeps 120 s (the test kills its node meanwhile)
  serve-drop           a merge across nodes: the ranks off node 0 drop every request unanswered and go on serving, as
                       a rank that stopped serving too early does (a deadlock no death explains)

RESHARD_TEST_STALE_S: seconds without a heartbeat after which a rank counts as gone (reshard.write._ranks.STALE_S).
RESHARD_TEST_REPLY_S: seconds a writer waits for a serving rank's reply (reshard.write._peers.REPLY_S).

The patch is made at import, outside the main guard: `--workers` processes are spawned and import this script as
`__mp_main__`, so they get it too (the fault is passed to them in RESHARD_TEST_FAULT).
"""

import contextlib
import errno
import io
import json
import os
import signal
import sys
import time
from pathlib import Path

import reshard.write._distributed
import reshard.write._ranks
import reshard.write._merge
import reshard.write._peers
import reshard.write._shards

_stock_write_file = reshard.write._shards.write_rank_file
_stock_merge_file = reshard.write._merge.write_safetensors
_stock_progress_bar = reshard.write._distributed.progress_bar
_stock_answer = reshard.write._peers.Peers._answer
bars = []


def _fault_for(path) -> tuple[str, str]:
    """(kind, marker) of the fault RESHARD_TEST_FAULT puts on the file `path`, or ("", "")."""
    fault = os.environ.get("RESHARD_TEST_FAULT", "")
    name = Path(path).name  # shard-{coord+1:05d}-model-{part+1:05d}-of-... or a merge's model-{part+1:05d}-of-...
    if name.startswith("shard-"):
        unit, part = int(name.split("-")[1]) - 1, int(name.split("-")[3]) - 1
    else:
        unit, part = int(name.split("-")[1]) - 1, 0
    kind, _, rest = fault.partition(":")
    target, _, marker = rest.partition(":")
    if kind not in ("enospc", "kill", "sleep") or part != 0 or unit != int(target):
        return "", ""
    return kind, marker


def _faulty_merge_file(path, *args, **kwargs):
    kind, _ = _fault_for(path)
    if kind == "enospc":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    return _stock_merge_file(path, *args, **kwargs)


def _faulty_write_file(path, *args):
    kind, marker = _fault_for(path)
    if not kind:
        return _stock_write_file(path, *args)
    if kind == "enospc":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    if kind == "kill":
        if marker:
            Path(marker).write_text(str(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    entry = _stock_write_file(path, *args)
    if kind == "sleep":
        Path(marker).write_text(str(path))
        time.sleep(120)
    return entry


def _slow_answer(self, *args):
    kind, _, marker = os.environ.get("RESHARD_TEST_FAULT", "").partition(":")
    if kind == "serve-sleep":
        Path(marker).write_text(str(time.time()))
        time.sleep(120)
    if kind == "serve-drop":
        return None
    return _stock_answer(self, *args)


def _counted_progress_bar(total, progress, command):
    bars.append(total)
    return _stock_progress_bar(total, progress, command)


reshard.write._shards.write_rank_file = _faulty_write_file
reshard.write._merge.write_safetensors = _faulty_merge_file
reshard.write._distributed.progress_bar = _counted_progress_bar
reshard.write._peers.Peers._answer = _slow_answer
if os.environ.get("RESHARD_TEST_STALE_S"):  # notice a vanished rank sooner than in production
    reshard.write._ranks.STALE_S = float(os.environ["RESHARD_TEST_STALE_S"])
if os.environ.get("RESHARD_TEST_REPLY_S"):
    reshard.write._peers.REPLY_S = float(os.environ["RESHARD_TEST_REPLY_S"])


def main():
    if os.environ.get("RESHARD_TEST_DUMP_S"):  # debugging a hang: every thread's stack after that many seconds
        import faulthandler

        faulthandler.dump_traceback_later(float(os.environ["RESHARD_TEST_DUMP_S"]), exit=False)
    # a shell may start background jobs with SIGINT ignored; a terminal's Ctrl-C raises KeyboardInterrupt
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from reshard.cli import main as reshard_main

    cases = json.loads(Path(sys.argv[1]).read_text())
    report_dir = Path(sys.argv[2])
    report_dir.mkdir(parents=True, exist_ok=True)
    rank = os.environ.get("RANK", "0")
    for i, case in enumerate(cases):
        os.environ["RESHARD_TEST_FAULT"] = case.get("fault", "")
        sys.argv = ["reshard", *(arg.replace("{rank}", rank) for arg in case["argv"])]
        bars.clear()
        err, out = io.StringIO(), io.StringIO()
        start = time.monotonic()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
                reshard_main()
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        sys.stderr.write(err.getvalue())
        sys.stdout.write(out.getvalue())
        (report_dir / f"case{i}-rank{rank}.json").write_text(json.dumps(
            {"exit": code, "stderr": err.getvalue(), "stdout": out.getvalue(), "bars": list(bars),
             "seconds": time.monotonic() - start}))
        if code > 128 or (code and case.get("exit")):  # a signal, or a case marked "exit": stop as the process would
            sys.exit(code)


if __name__ == "__main__":
    main()
