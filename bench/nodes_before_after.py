"""The multi-node runs of the node-local issue, on this checkout and (`--against DIR`) another one, side by side.

    python bench/nodes_before_after.py --against ../before      # e.g. `git worktree add ../before e5a1fc2`

Two simulated nodes of 2 ranks each (tests/nodes.py: one torchrun agent per node, each in its own mount namespace
with its own folder bound at one path, static rendezvous on 127.0.0.1; root needed), a tiny qwen3_moe checkpoint at
fsdp 4 x ep 2. Each step is one 2-node job of `reshard ...` on every rank (bench/node_cli.py); for each it prints
every rank's exit code and the distinct last lines of their messages:

1. write to OUT on each node's own disk, as before (no flag), then with `--node-local`;
2. `verify` of a node's copy staged by hand (`reshard files --ranks`), then with `--ranks`;
3. merge of the node copies, as before, then with `--node-local`; a merged DEST is compared, byte for byte, with a
   one-machine merge of the whole folder.

A flag the checkout does not know is reported as Click reports it (exit 2).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from nodes import run_nodes  # noqa: E402  (the simulated nodes of the test suite)

MESH = ["--fsdp", "4", "--ep", "2"]
NODES, NPROC = 2, 2


def reshard(repo: Path, *args) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "reshard", *map(str, args)], capture_output=True, text=True,
                          env=env, cwd=repo, timeout=300)  # cwd: `-m` puts it first on sys.path


def on_nodes(repo: Path, work: Path, node_dirs: list[Path], mount_at: Path, argv: list[str]) -> list[dict]:
    """`reshard ARGV` on every rank of the 2-node job; each rank's exit code and messages."""
    reports = Path(tempfile.mkdtemp(dir=work))
    run_nodes(str(Path(__file__).with_name("node_cli.py")), json.dumps(argv), reports, nodes=NODES, nproc=NPROC,
              mount_at=mount_at, node_dirs=node_dirs, env={"PYTHONPATH": str(repo)}, timeout=300)
    found = [reports / f"rank{r}.json" for r in range(NODES * NPROC)]
    return [json.loads(p.read_text()) if p.exists() else {"exit": None, "stderr": "(no report)", "stdout": ""}
            for p in found]


def show(step: str, ranks: list[dict]) -> None:
    print(f"  {step}")
    print(f"    exit codes by rank: {[r['exit'] for r in ranks]}")
    lines = []
    for r in ranks:
        text = (r["stderr"].strip() or r["stdout"].strip()).splitlines()
        last = text[-1] if text else "(no output)"
        if last not in lines:
            lines.append(last)
    for line in lines:
        print(f"    | {line if len(line) <= 320 else line[:180] + ' [...] ' + line[-130:]}")


def stage_by_hand(repo: Path, whole: Path, node_dirs: list[Path], name: str) -> None:
    """Each node's files of `whole` copied into its disk, as `reshard files --ranks` lists them."""
    for node, folder in enumerate(node_dirs):
        first = node * NPROC
        listed = reshard(repo, "files", whole, "--ranks", f"{first}-{first + NPROC - 1}")
        (folder / name).mkdir()
        for file in listed.stdout.split():
            shutil.copy2(whole / file, folder / name / file)
        for extra in ("config.json", "generation_config.json"):
            if node == 0 and (whole / extra).exists():
                shutil.copy2(whole / extra, folder / name / extra)
        for extra in whole.glob("extra-*.safetensors"):
            if node == 0:
                shutil.copy2(extra, folder / name / extra.name)


def run(repo: Path, label: str, src: Path, root: Path) -> None:
    commit = subprocess.run(["git", "-C", str(repo), "log", "-1", "--format=%h %s"], capture_output=True,
                            text=True).stdout.strip()
    print(f"\n== {label}: {repo} ({commit[:90]})")
    work = root / label
    mount_at, node_dirs = work / "disk", [work / f"node{k}" for k in range(NODES)]
    for folder in (mount_at, *node_dirs):
        folder.mkdir(parents=True)

    show("write SRC /disk/out --fsdp 4 --ep 2 (each node's own disk)",
         on_nodes(repo, work, node_dirs, mount_at, ["write", str(src), str(mount_at / "out"), *MESH, "-q"]))
    show("write SRC /disk/out --fsdp 4 --ep 2 --node-local",
         on_nodes(repo, work, node_dirs, mount_at, ["write", str(src), str(mount_at / "out"), *MESH, "--node-local",
                                                    "-q"]))
    whole = work / "whole"
    written = reshard(repo, "write", src, whole, *MESH, "-q")
    assert written.returncode == 0, written.stderr
    stage_by_hand(repo, whole, node_dirs, "staged")
    show("verify /disk/staged (a copy staged with `reshard files --ranks`)",
         on_nodes(repo, work, node_dirs, mount_at, ["verify", str(mount_at / "staged")]))
    show("verify /disk/staged --ranks <the node's>",
         on_nodes(repo, work, node_dirs, mount_at, ["verify", str(mount_at / "staged"), "--ranks", "{ranks}"]))
    show("merge /disk/staged /disk/merged (the node copies)",
         on_nodes(repo, work, node_dirs, mount_at, ["merge", str(mount_at / "staged"), str(mount_at / "merged")]))
    ranks = on_nodes(repo, work, node_dirs, mount_at, ["merge", str(mount_at / "staged"), str(mount_at / "merged2"),
                                                       "--node-local"])
    show("merge /disk/staged /disk/merged2 --node-local", ranks)
    merged = node_dirs[0] / "merged2"
    if merged.is_dir():
        reference = work / "reference"
        assert reshard(repo, "merge", whole, reference, "-q").returncode == 0
        same = sorted(p.name for p in reference.iterdir()) == sorted(p.name for p in merged.iterdir()) and all(
            (reference / p.name).read_bytes() == p.read_bytes() for p in merged.iterdir())
        print(f"    DEST on node 0 byte-identical to a one-machine merge of the whole folder: {same}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", type=Path, help="another checkout of reshard, run first (before)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="reshard-nodes-"))
    try:
        src = root / "src"
        made = subprocess.run([sys.executable, "-c", "import sys; from reshard.tiny import make_tiny_checkpoint; "
                               "make_tiny_checkpoint('qwen3_moe', sys.argv[1], experts=4)", str(src)],
                              env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True)
        assert made.returncode == 0, made.stderr
        if args.against:
            run(args.against.resolve(), "before", src, root)
        run(REPO, "after", src, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
