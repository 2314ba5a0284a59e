"""Benchmark `reshard write` against `cp -r` on a generated per-expert BF16 checkpoint.

    python bench/write.py                 # 8 GB checkpoint, 3 runs each
    python bench/write.py --size-gb 2 --runs 5 --dir /mnt/fast
    python bench/write.py --size-gb 2 --fsdp 4 --mesh-to-mesh   # SRC: a reshard folder at fsdp 8 x ep 2

What it does:

1. Generates SRC: a `qwen3_moe` config (tensor shapes from transformers' own config and meta model) with enough
   layers to reach `--size-gb`, written as raw safetensors files (`model-0000i-of-0000n.safetensors` +
   `model.safetensors.index.json`) with per-expert keys, filled chunk by chunk with random bytes (no model is
   built in RAM). `reshard plan SRC --fsdp 8` must accept it before anything is timed. With `--mesh-to-mesh`, SRC
   is instead that checkpoint written by `reshard write --fsdp 8 --ep 2` (`--source-mesh`), unplanned: a reshard
   folder, whose manifest holds its layout and records the CRC-32 of each file, which the timed write checks.
2. Warms the page cache (reads SRC once), then alternates, `--runs` times each:
   (a) `python -m reshard write SRC OUT --fsdp 8 -q` then `sync`, after a `reshard plan` (layout cache warm: the
       documented plan-then-write workflow; one write with an empty cache is timed and reported on its own),
   (b) `cp -r SRC OUT2` then `sync`,
   timing each whole process (startup and imports included) plus its `sync`; outputs are removed (and synced)
   between runs, outside the timings.
3. Reports the median ratio write / cp (target < 1.5, aim 1.15), write throughput (whole process, and steady-state
   from the difference with a 4x smaller checkpoint of the same tensor sizes, which cancels the fixed start-up
   cost), and peak RSS of the write process (`/usr/bin/time -v`, else `getrusage(RUSAGE_CHILDREN)`) at both sizes
   (target: within 10%).

`--against DIR` also times the write of another checkout of reshard (e.g. `git worktree add ../before main`), its runs
alternating with this one's on the same SRC, so that a before/after pair is measured in the same conditions.
`--profile` adds one in-process write under cProfile and prints where the time goes.
Everything generated is deleted at the end unless `--keep`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GB = 10**9
CHUNK = 64 << 20  # bytes of random data generated at a time

# Tensor sizes: hidden 2048, 64 experts of FFN 768 (BF16: 3 MiB per expert matrix); layers scale the size.
BASE_CONFIG = dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=64,
                   num_experts_per_tok=8, num_attention_heads=16, num_key_value_heads=4, head_dim=128,
                   vocab_size=32000, tie_word_embeddings=False, max_position_embeddings=4096)


def qwen3_moe_config(layers: int):
    from transformers import AutoConfig

    config = AutoConfig.for_model("qwen3_moe", num_hidden_layers=layers, **BASE_CONFIG)
    config.architectures = ["Qwen3MoeForCausalLM"]
    config.dtype = "bfloat16"
    return config


def on_disk_tensors(config, *, block: str = "mlp", experts: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
                    ) -> list[tuple[str, tuple[int, ...]]]:
    """The per-expert on-disk keys and shapes (`save_pretrained`'s original format) of `config`'s model.

    `block`: the MoE block's on-disk name (Mixtral: `block_sparse_moe`); `experts`: the per-expert gate, up and down
    projection names (Mixtral: `w1`, `w3`, `w2`).
    """
    import torch
    from transformers import AutoModelForCausalLM

    gate, up, down = experts
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    out = []
    for name, tensor in model.state_dict().items():
        shape = tuple(tensor.shape)
        name = name.replace(".mlp.", f".{block}.")
        if name.endswith(f"{block}.experts.gate_up_proj"):  # [E, 2I, H]: gate rows, then up rows
            prefix, (n, two_i, hidden) = name[: -len("gate_up_proj")], shape
            for e in range(n):
                out.append((f"{prefix}{e}.{gate}.weight", (two_i // 2, hidden)))
                out.append((f"{prefix}{e}.{up}.weight", (two_i // 2, hidden)))
        elif name.endswith(f"{block}.experts.down_proj"):  # [E, H, I]
            prefix, (n, hidden, inter) = name[: -len("down_proj")], shape
            out.extend((f"{prefix}{e}.{down}.weight", (hidden, inter)) for e in range(n))
        else:
            out.append((name, shape))
    return out


def nbytes(shape) -> int:
    n = 2
    for d in shape:
        n *= d
    return n


def layers_for(size_bytes: int) -> tuple[int, int]:
    """Layers giving about `size_bytes`, and the bytes they give."""
    one, two = (sum(nbytes(s) for _, s in on_disk_tensors(qwen3_moe_config(n))) for n in (1, 2))
    per_layer, fixed = two - one, 2 * one - two
    layers = max(1, round((size_bytes - fixed) / per_layer))
    return layers, fixed + layers * per_layer


def write_safetensors(path: Path, tensors: list[tuple[str, tuple[int, ...]]], rng) -> None:
    header, cursor = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in tensors:
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [cursor, cursor + nbytes(shape)]}
        cursor += nbytes(shape)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for _, shape in tensors:
            left = nbytes(shape)
            while left:
                n = min(left, CHUNK)
                f.write(rng.integers(0, 2**63, size=(n + 7) // 8, dtype="uint64").tobytes()[:n])
                left -= n


def generate(root: Path, size_bytes: int, shard_bytes: int, seed: int = 0) -> tuple[Path, int]:
    """Write a per-expert BF16 qwen3_moe checkpoint of about `size_bytes` into `root`; return it and its bytes."""
    import numpy as np

    layers, total = layers_for(size_bytes)
    config = qwen3_moe_config(layers)
    tensors = on_disk_tensors(config)
    groups, current, size = [], [], 0
    for name, shape in tensors:
        if current and size + nbytes(shape) > shard_bytes:
            groups.append(current)
            current, size = [], 0
        current.append((name, shape))
        size += nbytes(shape)
    groups.append(current)
    root.mkdir(parents=True)
    config.save_pretrained(root)
    rng = np.random.default_rng(seed)
    weight_map = {}
    for i, group in enumerate(groups, 1):
        name = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        write_safetensors(root / name, group, rng)
        weight_map.update({key: name for key, _ in group})
    (root / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return root, total


def as_reshard_folder(src: Path, folder: Path, mesh: str) -> Path:
    """`src` written by `reshard write` at `mesh` (`FSDPxEP`) into `folder`; `src` is removed (mesh to mesh)."""
    fsdp, _, ep = mesh.partition("x")
    start = time.perf_counter()
    run_timed([sys.executable, "-m", "reshard", "write", str(src), str(folder), "--fsdp", fsdp, "--ep", ep or "1",
               "-q"], env=env())
    print(f"  SRC: a reshard folder at fsdp {fsdp} x ep {ep or 1}, written in {time.perf_counter() - start:.1f} s",
          flush=True)
    remove(src)
    return folder


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_timed(cmd: list[str], *, env=None, cwd: Path = REPO) -> tuple[float, int | None, str, float]:
    """Run `cmd` then `sync`; return wall seconds (both), peak RSS in KiB of `cmd`, its stderr and CPU seconds."""
    use_time = Path("/usr/bin/time").exists()
    full = ["/usr/bin/time", "-v", *cmd] if use_time else cmd
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    cpu_before = cpu_seconds()
    start = time.perf_counter()
    result = subprocess.run(full, capture_output=True, text=True, env=env, cwd=cwd)  # `-m` imports from cwd first
    cpu = cpu_seconds() - cpu_before
    subprocess.run(["sync"], check=True)
    wall = time.perf_counter() - start
    if result.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    rss = None
    if use_time:
        m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", result.stderr)
        rss = int(m.group(1)) if m else None
    else:  # RUSAGE_CHILDREN's maximum over all children so far: valid when this is the largest child
        after = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        rss = after if after > before else None
    return wall, rss, result.stderr, cpu


def remove(path: Path) -> None:
    if path.exists():
        shutil.rmtree(path)
        subprocess.run(["sync"], check=True)


def keep_or_remove(work: Path, keep: bool) -> None:
    """A bench's generated folder at its end: kept (`--keep`, and said) or removed."""
    if keep:
        print(f"kept {work}")
    else:
        remove(work)


def warm(path: Path) -> None:
    for p in sorted(path.iterdir()):
        with open(p, "rb", buffering=0) as f:
            while f.read(64 << 20):
                pass


CACHE_DIR: Path | None = None  # the layout cache the timed processes use (set in main, inside the work folder)


def env(repo: Path = REPO) -> dict:
    extra = {"RESHARD_CACHE_DIR": str(CACHE_DIR)} if CACHE_DIR else {}
    return {**os.environ, "PYTHONPATH": f"{repo}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", **extra}


def check_plan(src: Path, fsdp: int) -> float:
    """`reshard plan SRC` must accept the checkpoint; returns its wall time (imports + expert finding + plan,
    the fixed cost every `reshard write` also pays)."""
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "reshard", "plan", str(src), "--fsdp", str(fsdp), "--json"],
                            capture_output=True, text=True, env=env(), cwd=REPO)
    wall = time.perf_counter() - start
    if result.returncode:
        raise SystemExit(f"reshard plan refused the generated checkpoint:\n{result.stderr}")
    plan = json.loads(result.stdout)
    experts = sum(1 for f in plan.get("families", []) if f.get("role") == "expert")
    if not experts:
        raise SystemExit("reshard plan found no routed experts in the generated checkpoint")
    print(f"  reshard plan: ok in {wall:.2f} s (start-up + header reading + planning; {experts} expert families)",
          flush=True)
    return wall


def bench_write(src: Path, work: Path, fsdp: int, repo: Path = REPO) -> tuple[float, int | None, float]:
    out = work / "out"
    wall, rss, _, cpu = run_timed(
        [sys.executable, "-m", "reshard", "write", str(src), str(out), "--fsdp", str(fsdp), "-q"], env=env(repo),
        cwd=repo)
    if not (out / "reshard.json").exists():
        raise SystemExit("the write produced no manifest")
    remove(out)
    return wall, rss, cpu


def bench_cp(src: Path, work: Path) -> tuple[float, float]:
    out = work / "out2"
    wall, _, _, cpu = run_timed(["cp", "-r", str(src), str(out)])
    remove(out)
    return wall, cpu


def profile_write(src: Path, work: Path, fsdp: int) -> None:
    import cProfile
    import pstats

    sys.path.insert(0, str(REPO))
    from reshard.api import write_checkpoint
    from reshard.plan import MeshSpec

    out = work / "out-profile"
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    write_checkpoint(src, out, MeshSpec(fsdp=fsdp), progress=False)
    profiler.disable()
    print(f"\nprofile: in-process write_checkpoint {time.perf_counter() - start:.2f} s", flush=True)
    pstats.Stats(profiler).sort_stats("tottime").print_stats(12)
    remove(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gb", type=float, default=8.0, help="checkpoint size in GB (10^9 bytes)")
    parser.add_argument("--runs", type=int, default=3, help="timed runs of each of write and cp")
    parser.add_argument("--fsdp", type=int, default=8)
    parser.add_argument("--shard-gb", type=float, default=2.0, help="source file size (GB)")
    parser.add_argument("--dir", type=Path, default=None, help="where to generate (default: a temp folder)")
    parser.add_argument("--mesh-to-mesh", action="store_true",
                        help="SRC is a reshard folder (the generated checkpoint written at --source-mesh first)")
    parser.add_argument("--source-mesh", default="8x2", help="FSDPxEP of the reshard folder of --mesh-to-mesh")
    parser.add_argument("--against", type=lambda p: Path(p).resolve(), default=None,
                        help="another checkout of reshard whose write is timed too, alternating (before/after)")
    parser.add_argument("--no-small", action="store_true", help="skip the 4x smaller checkpoint")
    parser.add_argument("--profile", action="store_true", help="also profile one in-process write")
    parser.add_argument("--keep", action="store_true", help="keep the generated checkpoints")
    args = parser.parse_args()

    base = args.dir or Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    size = int(args.size_gb * GB)
    need = int(size * (1.25 if args.no_small else 1.5) * 2.1) + GB  # SRC (+ small SRC), OUT and OUT2 + margin
    free = shutil.disk_usage(base).free
    print(f"disk: {free / GB:.1f} GB free in {base}, need about {need / GB:.1f} GB", flush=True)
    if free < need:
        raise SystemExit(f"not enough free space in {base}: {free / GB:.1f} GB free, need {need / GB:.1f} GB")
    work = Path(tempfile.mkdtemp(prefix="reshard-bench-", dir=base))
    global CACHE_DIR
    CACHE_DIR = work / "layout-cache"
    try:
        results = {}
        sizes = [("full", size)] + ([] if args.no_small else [("quarter", size // 4)])
        for label, nbytes_wanted in sizes:
            t = time.perf_counter()
            src, total = generate(work / f"src-{label}", nbytes_wanted, int(args.shard_gb * GB))
            layers = json.loads((src / "config.json").read_text())["num_hidden_layers"]
            print(f"[{label}] generated {total / GB:.2f} GB ({layers} layers, "
                  f"{len(list(src.glob('*.safetensors')))} files) in {time.perf_counter() - t:.1f} s", flush=True)
            if args.mesh_to_mesh:
                src = as_reshard_folder(src, work / f"in-{label}", args.source_mesh)
            remove(CACHE_DIR)
            # cold: imports torch + transformers, fills the layout cache (a reshard folder's manifest holds its layout)
            plan_wall = 0.0 if args.mesh_to_mesh else check_plan(src, args.fsdp)
            warm(src)
            remove(CACHE_DIR)
            cold_write, _, _ = bench_write(src, work, args.fsdp)  # a write with no plan before it
            print(f"  write with an empty layout cache (no plan before it): {cold_write:.2f} s", flush=True)
            # the timed runs below follow the documented workflow: plan, then write (layout cache warm)
            writes, cps, rss, write_cpu, cp_cpu, against = [], [], [], [], [], []
            runs = args.runs if label == "full" else max(1, min(args.runs, 2))
            for i in range(runs):
                if args.against and label == "full" and i % 2 == 1:  # alternate which checkout goes first
                    against.append(bench_write(src, work, args.fsdp, args.against))
                w, r, c = bench_write(src, work, args.fsdp)
                if args.against and label == "full" and i % 2 == 0:
                    against.append(bench_write(src, work, args.fsdp, args.against))
                writes.append(w)
                rss.append(r)
                write_cpu.append(c)
                if label == "full":
                    wall, c2 = bench_cp(src, work)
                    cps.append(wall)
                    cp_cpu.append(c2)
                    print(f"  run {i + 1}: write {w:.2f} s ({c:.2f} CPU s), cp {wall:.2f} s ({c2:.2f} CPU s), "
                          f"ratio {w / wall:.2f}, write peak RSS {r / 1024 if r else float('nan'):.0f} MiB", flush=True)
                    if against:
                        a, _, ca = against[-1]
                        print(f"         {args.against}: write {a:.2f} s ({ca:.2f} CPU s), ratio {a / wall:.2f}",
                              flush=True)
                else:
                    print(f"  run {i + 1}: write {w:.2f} s ({c:.2f} CPU s), "
                          f"write peak RSS {r / 1024 if r else float('nan'):.0f} MiB", flush=True)
            results[label] = {"bytes": total, "writes": writes, "cps": cps, "rss": rss, "write_cpu": write_cpu,
                              "cp_cpu": cp_cpu, "plan": plan_wall, "cold_write": cold_write, "against": against}
            if args.profile and label == "full":
                profile_write(src, work, args.fsdp)
            if not args.keep:
                remove(src)

        full = results["full"]
        w, c = statistics.median(full["writes"]), statistics.median(full["cps"])
        pair = statistics.median(a / b for a, b in zip(full["writes"], full["cps"]))
        print("\nresults")
        source = f"a reshard folder at {args.source_mesh} (mesh to mesh)" if args.mesh_to_mesh else "HF layout"
        print(f"  checkpoint: {full['bytes'] / GB:.2f} GB, {source}, to fsdp {args.fsdp}, {args.runs} runs each, "
              "warm page cache")
        runs_of = lambda xs: ", ".join(f"{x:.2f}" for x in xs)  # noqa: E731
        print(f"  write (whole process + sync): median {w:.2f} s  (runs {runs_of(full['writes'])})")
        print(f"  cp -r (+ sync):               median {c:.2f} s  (runs {runs_of(full['cps'])})")
        print(f"  ratio write/cp: {w / c:.2f} (median of pairs {pair:.2f}); target < 1.5, aim 1.15")
        if full["against"]:
            walls = [a for a, _, _ in full["against"]]
            print(f"  {args.against}: write median {statistics.median(walls):.2f} s (runs {runs_of(walls)}), ratio "
                  f"write/cp {statistics.median(walls) / c:.2f} (median of pairs "
                  f"{statistics.median(a / b for a, b in zip(walls, full['cps'])):.2f}), CPU median "
                  f"{statistics.median(ca for _, _, ca in full['against']):.2f} s")
        print(f"  CPU seconds (user + sys): write median {statistics.median(full['write_cpu']):.2f}, "
              f"cp median {statistics.median(full['cp_cpu']):.2f}")
        if not args.mesh_to_mesh:  # a reshard folder's layout is in its manifest: no plan, no layout cache
            print(f"  `reshard plan` on the same source, empty layout cache: {full['plan']:.2f} s; one write with an "
                  f"empty layout cache: {full['cold_write']:.2f} s (ratio {full['cold_write'] / c:.2f}); the timed "
                  "writes above ran after the plan, layout cache warm")
        print(f"  write throughput, whole process: {full['bytes'] / w / GB:.2f} GB/s; "
              f"cp: {full['bytes'] / c / GB:.2f} GB/s")
        rss_full = max(r for r in full["rss"] if r) if any(full["rss"]) else None
        if "quarter" in results:
            q = results["quarter"]
            wq = statistics.median(q["writes"])
            if w > wq and full["bytes"] > q["bytes"]:
                print(f"  write throughput, steady state (from the {q['bytes'] / GB:.2f} GB run): "
                      f"{(full['bytes'] - q['bytes']) / (w - wq) / GB:.2f} GB/s; fixed cost about "
                      f"{w - (full['bytes'] / ((full['bytes'] - q['bytes']) / (w - wq))):.2f} s")
            rss_q = max(r for r in q["rss"] if r) if any(q["rss"]) else None
            if rss_full and rss_q:
                print(f"  write peak RSS: {rss_full / 1024:.0f} MiB at {full['bytes'] / GB:.2f} GB, "
                      f"{rss_q / 1024:.0f} MiB at {q['bytes'] / GB:.2f} GB: "
                      f"{100 * (rss_full - rss_q) / rss_q:+.1f}% (target within 10%)")
        elif rss_full:
            print(f"  write peak RSS: {rss_full / 1024:.0f} MiB")
    finally:
        keep_or_remove(work, args.keep)


if __name__ == "__main__":
    main()
