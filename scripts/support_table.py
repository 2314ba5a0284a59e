"""Print the Markdown support table for the installed transformers, by running the breadth matrix (tests/breadth.py).

Every MoE model type transformers ships is generated tiny, in both on-disk layouts, then planned, written at two
meshes, verified against its source and loaded whole in one process (a minute or two on 2 cores). The table goes
to stdout, its first line naming the transformers version it was generated with; progress and timings go to
stderr. Which model types exist depends on the transformers release, so the docs carry one table per tested
version: paste stdout between `<!-- support-table:start -->` and `<!-- support-table:end -->` in
docs/compatibility.md, replacing the table of the same version (tests/test_breadth.py checks that the table for the
installed version matches).

usage: OMP_NUM_THREADS=1 python scripts/support_table.py [--keep DIR] [--check FILE ...]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import breadth  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", metavar="DIR", help="generate the tiny checkpoints under DIR and keep them")
    parser.add_argument("--check", metavar="FILE", nargs="+", help="exit 1 unless FILEs (README.md docs/*.md) hold "
                        "exactly one table for the installed transformers and it equals the generated one")
    args = parser.parse_args(argv)

    start = time.monotonic()
    candidates = breadth.discover()
    print(f"discovered {len(candidates)} MoE model types ({len(breadth.runnable())} runnable) in "
          f"{time.monotonic() - start:.1f}s", file=sys.stderr)

    def progress(result):
        print(f"  {result.model_type:22s} {result.layout:9s} {result.status:11s} {result.seconds:5.1f}s"
              + (f"  {result.reason[:120]}" if result.reason else ""), file=sys.stderr)

    with tempfile.TemporaryDirectory(prefix="reshard-breadth-") as tmp:
        matrix = breadth.Matrix(args.keep or tmp)
        results = matrix.run_all(progress)
        table = breadth.support_table(matrix)
    counts = {s: sum(r.status == s for r in results) for s in ("pass", "unsupported", "fail")}
    print(f"{len(results)} cases: {counts} in {time.monotonic() - start:.1f}s", file=sys.stderr)
    print(table)
    if args.check:
        import transformers

        if breadth.table_for_version(args.check, transformers.__version__) != table:
            print(f"{' '.join(args.check)}: no support table, several, or a stale one for this transformers "
                  "version", file=sys.stderr)
            return 1
    return 1 if counts["fail"] else 0


if __name__ == "__main__":
    sys.exit(main())
