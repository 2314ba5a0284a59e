"""Benchmark the multi-rank load: stock transformers on the original checkpoint vs `reshard.from_pretrained`.

    python bench/load.py                      # Mixtral-shaped, 16 experts, ~0.56 GB, fsdp 4, 3 runs per mode
    python bench/load.py --fsdp 8 --runs 5    # 8 gloo ranks
    python bench/load.py --profile            # also: one profiled rank per mode (cProfile) and phase timelines

What it does:

1. Generates SRC: a `mixtral` config (real transformers config; tensor shapes from its meta model) written as raw
   per-expert BF16 safetensors files (`model-0000i-of-0000n.safetensors` + index; keys as `save_pretrained`
   writes them: `block_sparse_moe.experts.E.w1/w2/w3.weight`, checked against a tiny `save_pretrained`), filled
   with random bytes, no model in RAM. `reshard plan SRC --fsdp F --json` must accept it (`find_experts`), and
   the stock layout must leave no rank empty (so stock transformers can load it).
2. `reshard write SRC OUT --fsdp F -q` (timed once, for information).
3. Warms the page cache (reads SRC and OUT), then one untimed verification run per distinct read path
   (BENCH_VERIFY=1: every rank hashes each local shard; each loader must give the same placement, offset, shape and
   SHA-1 as stock on every rank, and leave no parameter uninitialized).
4. Alternates, `--runs` times (rotating the order): (a) stock
   `AutoModelForCausalLM.from_pretrained(SRC, distributed_config=DistributedConfig(fsdp_size=F))`, (b)
   `reshard.from_pretrained(OUT)` (`dcp.load` with `reshard.StorageReader`: own-file reads with the CRC-32 computed
   as bytes pass, the default), (c) the same with `check_checksums=False`, (d) `reshard-dcp`: transformers' own
   `dcp.load` path with torch's `HuggingFaceStorageReader` (no CRC);
   each a fresh `torchrun --standalone --nproc-per-node F bench/load_rank.py ...` job.
5. Reports per rank: bytes of tensor data read (stock and dcp.load: every safetensors slice / get_tensor counted;
   reshard's own-file reads: every tensor read into a local shard), files that data came from, files opened at all (and how many opens), /proc/self/io rchar and read_bytes around
   from_pretrained, own share (bytes of its local tensors), peak RSS; per mode the
   medians of the slowest rank's `from_pretrained` time and of the whole torchrun job, and where the time goes
   (process start-up, imports, process group, from_pretrained phases, tear-down).

Targets (issue): each rank reads no more than its own share + 5%; reshard's from_pretrained time at most 0.5x stock's.
Everything generated is deleted at the end unless `--keep`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RANK_SCRIPT = Path(__file__).resolve().parent / "load_rank.py"
MB = 10**6
MODES = ("stock", "reshard", "reshard-nocrc", "reshard-dcp")
DEFAULT_MODES = MODES


def _bench_write():
    """bench/write.py's helpers (safetensors writer, page-cache warmer), imported by path."""
    spec = importlib.util.spec_from_file_location("bench_write", Path(__file__).resolve().parent / "write.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bw = _bench_write()


# ---- the checkpoint ------------------------------------------------------------------------------------------

def mixtral_config(args, layers=None, *, tiny=False):
    from transformers import AutoConfig

    if tiny:
        dims = dict(hidden_size=64, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    vocab_size=128)
    else:
        dims = dict(hidden_size=args.hidden, intermediate_size=args.ffn, num_attention_heads=args.hidden // 128,
                    num_key_value_heads=max(1, args.hidden // 512), head_dim=128, vocab_size=args.vocab)
    config = AutoConfig.for_model("mixtral", num_local_experts=args.experts, num_experts_per_tok=2,
                                  num_hidden_layers=layers or args.layers, tie_word_embeddings=False,
                                  max_position_embeddings=4096, **dims)
    config.architectures = ["MixtralForCausalLM"]
    config.dtype = "bfloat16"
    return config


def on_disk_tensors(config) -> list[tuple[str, tuple[int, ...]]]:
    """Mixtral's on-disk keys and shapes (what `save_pretrained` writes: per-expert w1/w2/w3, `block_sparse_moe`)."""
    return bw.on_disk_tensors(config, block="block_sparse_moe", experts=("w1", "w3", "w2"))


def check_key_names(args, work: Path) -> None:
    """The generator's keys and shapes must be exactly what `save_pretrained` writes for the same architecture."""
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    config = mixtral_config(args, layers=2, tiny=True)
    folder = work / "tiny-save-pretrained"
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    saved = {}
    for path in folder.glob("*.safetensors"):
        with safe_open(path, "pt") as f:
            saved.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})
    ours = dict(on_disk_tensors(config))
    if saved != ours:
        raise SystemExit(f"generated keys differ from save_pretrained's: only ours "
                         f"{sorted(set(ours) - set(saved))[:5]}, "
                         f"only saved {sorted(set(saved) - set(ours))[:5]}, shapes "
                         f"{[k for k in ours if k in saved and ours[k] != saved[k]][:5]}")
    shutil.rmtree(folder)


def generate(args, root: Path, seed: int = 0) -> int:
    """Write the per-expert BF16 Mixtral checkpoint into `root`; return its tensor bytes."""
    import numpy as np

    config = mixtral_config(args)
    tensors = on_disk_tensors(config)
    groups, current, size = [], [], 0
    for name, shape in tensors:
        if current and size + bw.nbytes(shape) > args.shard_mb * MB:
            groups.append(current)
            current, size = [], 0
        current.append((name, shape))
        size += bw.nbytes(shape)
    groups.append(current)
    root.mkdir(parents=True)
    config.save_pretrained(root)
    rng = np.random.default_rng(seed)
    weight_map, total = {}, 0
    for i, group in enumerate(groups, 1):
        name = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        bw.write_safetensors(root / name, group, rng)
        weight_map.update({key: name for key, _ in group})
        total += sum(bw.nbytes(s) for _, s in group)
    (root / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return total


def env() -> dict:
    return {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error",
            "TOKENIZERS_PARALLELISM": "false"}


def check_plan(src: Path, fsdp: int) -> None:
    cmd = [sys.executable, "-m", "reshard", "plan", str(src), "--fsdp", str(fsdp), "--json"]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env(), cwd=REPO)
    if result.returncode:
        raise SystemExit(f"reshard plan refused the generated checkpoint:\n{result.stderr}")
    plan = json.loads(result.stdout)
    summary = plan["summary"]
    if not summary["expert_tensors"] or summary["stock_empty_ranks"]:
        raise SystemExit(f"want routed experts and no empty rank under stock at fsdp {fsdp}: {summary}")
    print(f"  reshard plan --fsdp {fsdp}: ok ({plan['architecture']}, {summary['expert_tensors']} expert tensors "
          f"found by find_experts, no empty rank under stock)", flush=True)
    return plan


# ---- running ranks -------------------------------------------------------------------------------------------

def run_job(mode: str, folder: Path, fsdp: int, work: Path, *, extra_env=None, timeout=900) -> dict:
    reports = Path(tempfile.mkdtemp(prefix=f"{mode}-", dir=work))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={fsdp}",
           str(RANK_SCRIPT), mode, str(folder), str(fsdp), str(reports)]
    load_before = os.getloadavg()[0]
    start = time.time()
    result = subprocess.run(cmd, capture_output=True, text=True, env={**env(), **(extra_env or {})}, cwd=REPO,
                            timeout=timeout)
    wall = time.time() - start
    if result.returncode:
        raise SystemExit(f"{mode} job failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}")
    ranks = [json.loads((reports / f"rank{r}.json").read_text()) for r in range(fsdp)]
    job = {"mode": mode, "wall": wall, "start": start, "ranks": ranks, "loadavg": (load_before, os.getloadavg()[0]),
           "reports": reports}
    job["load_max"] = max(r["load_s"] for r in ranks)
    return job


def rank_row(r: dict) -> dict:
    reads = r["reads"]
    data_files = [f for f, n in reads["data"].items() if n]
    return {"rank": r["rank"], "bytes": sum(reads["data"].values()), "share": r["share"],
            "data_files": len(data_files), "opened": len(reads["opens"]), "opens": sum(reads["opens"].values()),
            "rchar": r["io"].get("rchar", 0),
            "read_bytes": r["io"].get("read_bytes", 0), "rss_mib": r["maxrss_kib"] / 1024, "load_s": r["load_s"]}


def phase_durations(r: dict) -> dict[str, float]:
    out: dict[str, float] = {}
    for label, start, end, _depth in r["phases"]:
        out[label] = out.get(label, 0.0) + end - start
    return out


def stages(job: dict) -> dict[str, float]:
    """Seconds of each stage of the job, for its slowest rank (the one leaving from_pretrained last)."""
    r = max(job["ranks"], key=lambda x: x["times"]["load_end"])
    t = r["times"]
    return {
        "torchrun launch -> rank process start": t["process_start"] - job["start"],
        "interpreter start-up": t["script_start"] - t["process_start"],
        "import torch": t["torch_imported"] - t["script_start"],
        "init_process_group": t["process_group"] - t["torch_imported"],
        "import transformers (+reshard), config": t["imports"] - t["process_group"],
        "wait at barrier (slowest importer sets it)": t["load_start"] - t["imports"],
        "from_pretrained": t["load_end"] - t["load_start"],
        "after load -> report written (share, verify)": t["report"] - t["load_end"],
        "report -> torchrun exit (pg destroy, exit, agent)": job["start"] + job["wall"] - t["report"],
    }


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def print_profile(path: Path, top: int) -> None:
    import io
    import pstats

    for key in ("cumulative", "tottime"):
        buf = io.StringIO()
        pstats.Stats(str(path), stream=buf).sort_stats(key).print_stats(top)
        lines = buf.getvalue().splitlines()
        start = next((i for i, line in enumerate(lines) if "ncalls" in line), 0)
        print(f"    -- sorted by {key} --")
        for line in lines[start:start + top + 1]:
            print("    " + line[:170])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fsdp", type=int, default=4, help="ranks (gloo, CPU); the mesh is fsdp only")
    parser.add_argument("--runs", type=int, default=3, help="timed runs per loader")
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=1024, help="expert intermediate size")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--shard-mb", type=int, default=150, help="source file size (MB)")
    parser.add_argument("--modes", default=",".join(DEFAULT_MODES), help=f"comma-separated, of {','.join(MODES)}")
    parser.add_argument("--no-verify", action="store_true", help="skip the bit-exactness run")
    parser.add_argument("--profile", action="store_true", help="one cProfile'd rank per loader, phase timelines")
    parser.add_argument("--profile-rank", type=int, default=0)
    parser.add_argument("--dir", type=Path, default=None, help="where to generate (default: a temp folder)")
    parser.add_argument("--src", type=Path, default=None,
                        help="reuse a SRC a --keep'd run generated (and its out-fsdpF next to it)")
    parser.add_argument("--keep", action="store_true", help="keep the generated checkpoints")
    args = parser.parse_args()
    modes = [m for m in args.modes.split(",") if m]

    base = args.dir or Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="reshard-load-bench-", dir=base))
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()}", flush=True)
    try:
        if args.src:
            src = args.src
            total = sum(p.stat().st_size for p in src.glob("*.safetensors"))
            out = src.parent / f"out-fsdp{args.fsdp}"  # as a --keep'd run left it (written if missing)
        else:
            check_key_names(args, work)
            src, out = work / "src", work / f"out-fsdp{args.fsdp}"
            t = time.perf_counter()
            total = generate(args, src)
            print(f"generated {src}: {total / MB:.0f} MB of tensors, {len(list(src.glob('*.safetensors')))} files, "
                  f"{args.layers} layers x {args.experts} experts, in {time.perf_counter() - t:.1f} s", flush=True)
        check_plan(src, args.fsdp)
        if not out.exists():
            t = time.perf_counter()
            cmd = [sys.executable, "-m", "reshard", "write", str(src), str(out), "--fsdp", str(args.fsdp), "-q"]
            result = subprocess.run(cmd, capture_output=True, text=True, env=env(), cwd=REPO)
            if result.returncode:
                raise SystemExit(f"reshard write failed:\n{result.stderr}")
            print(f"reshard write: {time.perf_counter() - t:.1f} s: {result.stdout.strip()}", flush=True)
        manifest = json.loads((out / "reshard.json").read_text())
        placements = {i["placement"]["kind"] + f" Shard({i['placement']['shard_dim']})"
                      for i in manifest["tensors"].values()}
        print(f"  OUT: {len(manifest['files'])} files, placements {sorted(placements)}", flush=True)
        folder = {m: (src if m == "stock" else out) for m in MODES}
        bw.warm(src)
        bw.warm(out)

        verify_jobs: dict[str, dict] = {}
        if not args.no_verify:
            hashes = {}
            same_reads = {"reshard-nocrc": "reshard"}  # one run per distinct read path
            for mode in dict.fromkeys(same_reads.get(m, m) for m in modes):
                job = run_job(mode, folder[mode], args.fsdp, work, extra_env={"BENCH_VERIFY": "1"})
                verify_jobs[mode] = job
                hashes[mode] = {(r["rank"], name): h for r in job["ranks"] for name, h in r["sha1"].items()}
                bad = [n for r in job["ranks"] for n in r["uninitialized"]]
                print(f"verify {mode}: {len(hashes[mode])} local shards hashed, {len(bad)} uninitialized params, "
                      f"job {job['wall']:.1f} s", flush=True)
                if bad:
                    raise SystemExit(f"{mode}: uninitialized parameters {bad[:5]}")
            for mode in [m for m in hashes if m != "stock"] if "stock" in hashes else []:
                a, b = hashes["stock"], hashes[mode]
                diff = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
                print(f"verify: stock and {mode} loads {'bit-identical' if not diff else 'DIFFER on ' + str(diff[:5])} "
                      f"(every rank's local shard of {len(a) // args.fsdp} tensors: same placement, offset, shape and "
                      f"SHA-1)", flush=True)
                if diff:
                    raise SystemExit(f"stock and {mode} loads differ")

        jobs: dict[str, list] = {m: [] for m in modes}
        for i in range(args.runs):
            order = modes[i % len(modes):] + modes[:i % len(modes)]
            for mode in order:
                job = run_job(mode, folder[mode], args.fsdp, work)
                jobs[mode].append(job)
                print(f"run {i + 1} {mode:20s} from_pretrained slowest rank {job['load_max']:.2f} s, "
                      f"job {job['wall']:.2f} s  (load avg {job['loadavg'][0]:.2f} -> {job['loadavg'][1]:.2f})",
                      flush=True)

        print(f"\nresults: {total / MB:.0f} MB Mixtral-shaped checkpoint ({args.experts} experts), fsdp {args.fsdp} "
              f"({args.fsdp} gloo ranks), warm page cache, {args.runs} runs per loader, medians")
        print(f"{'loader':20s} {'from_pretrained slowest (s)':>28s} {'CPU s (max rank)':>17s} {'torchrun job (s)':>17s}"
              f"   runs (slowest rank)")
        for mode in modes:
            loads = [j["load_max"] for j in jobs[mode]]
            cpus = [max(r["load_cpu_s"] for r in j["ranks"]) for j in jobs[mode]]
            walls = [j["wall"] for j in jobs[mode]]
            print(f"{mode:20s} {median(loads):28.2f} {median(cpus):17.2f} {median(walls):17.2f}   "
                  f"{', '.join(f'{x:.2f}' for x in loads)}")
        if "stock" in modes:
            s = median([j["load_max"] for j in jobs["stock"]])
            sw = median([j["wall"] for j in jobs["stock"]])
            sc = median([max(r["load_cpu_s"] for r in j["ranks"]) for j in jobs["stock"]])
            for mode in modes:
                if mode != "stock":
                    m = median([j["load_max"] for j in jobs[mode]])
                    mc = median([max(r["load_cpu_s"] for r in j["ranks"]) for j in jobs[mode]])
                    mw = median([j["wall"] for j in jobs[mode]])
                    print(f"  {mode} / stock: from_pretrained {m / s:.2f}x (target <= 0.5x), CPU {mc / sc:.2f}x, "
                          f"job {mw / sw:.2f}x")

        print("\nper rank (last timed run of each loader; bytes in MB = 10^6; 'tensor data read' = bytes of every "
              "slice / get_tensor taken from safetensors (reshard's own-file reads: bytes read into local shards); "
              "rchar/read_bytes = "
              "/proc/self/io deltas over from_pretrained):")
        print(f"{'loader':20s} {'rank':>4s} {'tensor data read':>16s} {'own share':>10s} {'read/share':>10s} "
              f"{'data files':>10s} {'files opened':>12s} {'rchar':>8s} {'read_bytes':>10s} "
              f"{'peak RSS MiB':>12s} {'load s':>7s}")
        for mode in modes:
            for r in sorted(jobs[mode][-1]["ranks"], key=lambda x: x["rank"]):
                row = rank_row(r)
                print(f"{mode:20s} {row['rank']:4d} {row['bytes'] / MB:16.1f} {row['share'] / MB:10.1f} "
                      f"{row['bytes'] / row['share']:10.3f} {row['data_files']:10d} "
                      f"{row['opened']:5d} ({row['opens']:3d}x) {row['rchar'] / MB:8.1f} "
                      f"{row['read_bytes'] / MB:10.1f} {row['rss_mib']:12.0f} {row['load_s']:7.2f}")

        print("\nwhere the time goes (slowest rank of each job; medians over runs, seconds):")
        labels = list(stages(jobs[modes[0]][0]))
        print(f"{'stage':48s} " + " ".join(f"{m:>21s}" for m in modes))
        for label in labels:
            print(f"{label:48s} " + " ".join(f"{median([stages(j)[label] for j in jobs[m]]):21.2f}" for m in modes))
        print("\nfrom_pretrained phases (max over ranks, medians over runs, seconds; nested phases are included in "
              "their parents):")
        first: dict[str, float] = {}
        depth: dict[str, int] = {}
        for m in modes:
            for j in jobs[m]:
                for r in j["ranks"]:
                    for label, begin, _end, d in r["phases"]:
                        first[label] = min(first.get(label, 1e18), begin - r["times"]["load_start"])
                        depth.setdefault(label, d)
        print(f"{'phase':60s} " + " ".join(f"{m:>21s}" for m in modes))
        for label in sorted(first, key=first.get):
            cells = []
            for m in modes:
                vals = [max(phase_durations(r).get(label, 0.0) for r in j["ranks"]) for j in jobs[m]]
                cells.append(f"{median(vals):21.3f}" if any(vals) else f"{'-':>21s}")
            print(f"{'  ' * depth.get(label, 0) + label:60s} " + " ".join(cells))

        if args.profile:
            for mode in modes:
                job = run_job(mode, folder[mode], args.fsdp, work, extra_env={"BENCH_PROFILE": str(args.profile_rank)})
                r = next(x for x in job["ranks"] if x["rank"] == args.profile_rank)
                print(f"\nprofile {mode}: rank {args.profile_rank} from_pretrained {r['load_s']:.2f} s under cProfile "
                      f"(slowest rank {job['load_max']:.2f} s); timeline (s from from_pretrained start):")
                t0 = r["times"]["load_start"]
                for label, start, end, d in sorted(r["phases"], key=lambda p: p[1]):
                    print(f"    {start - t0:7.3f} {end - start:7.3f}  {'  ' * d}{label}")
                print_profile(job["reports"] / "profile.pstats", 25)
        print(f"\nmachine load average at the end: {os.getloadavg()}")
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
