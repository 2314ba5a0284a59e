"""How many bytes does each node hold (and read) when a GLM-4.6-sized checkpoint is written for 8 nodes x 8 GPUs?

Builds the GLM-4.6-shaped sparse fixture of `bench/plan_scale.py` (real headers, data regions as holes: a few MB
of disk) and, from the plan alone (no tensor byte is read or written), prints for `--fsdp 64 --ep 8` on 8 nodes of
8 ranks: each node's copy under `write --node-local` (the bytes of its ranks' files, the extras and the copied
metadata on node 0) against the whole folder a shared write makes. A node's copy is also what that node reads from
SRC: the engine reads exactly the byte ranges its files hold (bf16 to bf16).

Usage:
    python bench/node_bytes.py [--nodes 8] [--per-node 8] [--ep 8] [--dir DIR]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def main(argv: list[str] | None = None) -> None:
    from plan_scale import GLM46_CONFIG, write_sparse_checkpoint

    from reshard import MeshSpec
    from reshard.plan import make_plan
    from reshard.plan import RankSpans
    from reshard.read import open_source
    from reshard.write import WriteJob

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--per-node", type=int, default=8)
    parser.add_argument("--ep", type=int, default=8)
    parser.add_argument("--dir", type=Path, default=None, help="where to build the fixture (default: a temp dir)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.dir or Path(tmp) / "glm46"
        if not (folder / "config.json").exists():
            write_sparse_checkpoint(folder, GLM46_CONFIG)
        opened = open_source(str(folder))
        world = args.nodes * args.per_node
        plan = make_plan(opened.model_layout(), MeshSpec(fsdp=world, ep=args.ep))
        whole = WriteJob(plan, opened.index)
        total = whole.needed_bytes()
        source = sum(f.size for f in opened.index.files)
        print(f"GLM-4.6 shape, {source / 2**30:,.1f} GiB of safetensors; --fsdp {world} --ep {args.ep} on "
              f"{args.nodes} nodes x {args.per_node}: a shared write is {total / 2**30:,.1f} GiB")
        print(f"{'node':>4}  {'ranks':>7}  {'GiB':>8}  {'of shared':>9}")
        for node in range(args.nodes):
            first = node * args.per_node
            spans = RankSpans.parse(f"{first}-{first + args.per_node - 1}")
            mine = whole.for_ranks(spans).needed_bytes()
            print(f"{node:>4}  {str(spans):>7}  {mine / 2**30:>8,.2f}  {mine / total:>9.1%}")


if __name__ == "__main__":
    main()
