"""One rank of bench/nodes_before_after.py: `reshard ARGV` as `python -m reshard` runs it, its exit code and output
saved to REPORT_DIR/rank{RANK}.json. usage: node_cli.py ARGV_JSON REPORT_DIR ("{ranks}" in ARGV: this node's ranks)."""

import contextlib
import io
import json
import os
import sys
from pathlib import Path


def main():
    argv, report_dir = json.loads(sys.argv[1]), Path(sys.argv[2])
    local = int(os.environ["LOCAL_WORLD_SIZE"])
    first = int(os.environ["GROUP_RANK"]) * local
    from reshard.cli import main as reshard_main

    sys.argv = ["reshard", *(a.replace("{ranks}", f"{first}-{first + local - 1}") for a in argv)]
    err, out = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            reshard_main()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except Exception as e:  # a traceback is a result here: report it
        code, err = "traceback", io.StringIO(err.getvalue() + f"{type(e).__name__}: {e}")
    (report_dir / f"rank{os.environ['RANK']}.json").write_text(
        json.dumps({"exit": code, "stderr": err.getvalue(), "stdout": out.getvalue()}))


if __name__ == "__main__":
    main()
