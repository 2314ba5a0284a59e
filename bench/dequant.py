"""Benchmark `reshard write --dequantize bf16` on a generated FP8 checkpoint, against a plain bf16 write and `cp -r`.

    python bench/dequant.py                    # about 4 GB of bf16 output
    python bench/dequant.py --size-gb 1 --runs 1

What it does:

1. Generates FP8: the `qwen3_moe` config of `bench/write.py` (hidden 2048, 64 experts of FFN 768) with enough
   layers for `--size-gb` of bf16 output, per-expert keys, every decoder linear stored as F8_E4M3 (random codes,
   NaN codes excluded) beside F32 `weight_scale_inv` on 128x128 blocks, as DeepSeek-V3 ships them; and a quarter-
   size twin, so that the difference cancels the fixed start-up cost. Also BF16: the same model in bf16 (the output
   size of the dequantized write), for the plain write and `cp -r`.
2. Warms the page cache, then times, `--runs` times each, every whole process plus its `sync`:
   (a) `reshard write FP8 OUT --fsdp 8 --dequantize bf16 -q --workers 1`, and with `--workers` = the cores;
   (b) `reshard write BF16 OUT --fsdp 8 -q` (a byte copy of the same output size);
   (c) `cp -r BF16 OUT2`.
3. Reports GB/s of bf16 output per process and per core used (CPU seconds of the process and its workers), the
   steady-state per-core rate (from the two sizes), peak RSS of the single-process write at both sizes, and what
   the per-core rate means for DeepSeek-V3 (about 1.3 TB of bf16 output) on a 64-core node.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from write import (CHUNK, GB, generate, layers_for, nbytes, on_disk_tensors, qwen3_moe_config, remove,  # noqa: E402
                   run_timed, warm)

BLOCK = 128
DSV3_OUTPUT_BYTES = 1.3e12


def fp8_entries(name: str, shape: tuple[int, ...]) -> list[tuple[str, str, tuple[int, ...]]]:
    """(key, dtype, shape) stored for one bf16 tensor: decoder linears become FP8 plus a block-scale grid."""
    if ".layers." in name and name.endswith("proj.weight") and len(shape) == 2:
        grid = (-(-shape[0] // BLOCK), -(-shape[1] // BLOCK))
        return [(name, "F8_E4M3", shape), (f"{name}_scale_inv", "F32", grid)]
    return [(name, "BF16", shape)]


def size_of(dtype: str, shape) -> int:
    return nbytes(shape) // 2 * {"F8_E4M3": 1, "F32": 4, "BF16": 2}[dtype]


def write_fp8_file(path: Path, entries, rng) -> None:
    import numpy as np

    header, cursor = {"__metadata__": {"format": "pt"}}, 0
    for name, dtype, shape in entries:
        n = size_of(dtype, shape)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [cursor, cursor + n]}
        cursor += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for _, dtype, shape in entries:
            left = size_of(dtype, shape)
            while left:
                n = min(left, CHUNK)
                if dtype == "F32":  # positive scales around 1e-3, as trained weights have
                    data = (rng.random(n // 4, dtype=np.float32) * 2e-3 + 1e-4).tobytes()
                elif dtype == "F8_E4M3":
                    codes = rng.integers(0, 256, size=n, dtype=np.uint8)
                    codes[(codes & 0x7F) == 0x7F] = 0  # no NaN codes
                    data = codes.tobytes()
                else:
                    data = rng.integers(0, 2**63, size=(n + 7) // 8, dtype="uint64").tobytes()[:n]
                f.write(data)
                left -= n


def generate_fp8(root: Path, size_bytes: int, shard_bytes: int = 2 * GB, seed: int = 1) -> tuple[Path, int, int]:
    """An FP8 checkpoint whose bf16 output is about `size_bytes`; returns it, its bytes and the output bytes."""
    import numpy as np

    layers, output = layers_for(size_bytes)
    config = qwen3_moe_config(layers)
    entries = [e for name, shape in on_disk_tensors(config) for e in fp8_entries(name, shape)]
    groups, current, size = [], [], 0
    for entry in entries:
        n = size_of(entry[1], entry[2])
        if current and size + n > shard_bytes:
            groups.append(current)
            current, size = [], 0
        current.append(entry)
        size += n
    groups.append(current)
    root.mkdir(parents=True)
    config.save_pretrained(root)
    data = json.loads((root / "config.json").read_text())
    data["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                   "weight_block_size": [BLOCK, BLOCK]}
    (root / "config.json").write_text(json.dumps(data, indent=2))
    rng = np.random.default_rng(seed)
    weight_map, total = {}, 0
    for i, group in enumerate(groups, 1):
        name = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        write_fp8_file(root / name, group, rng)
        weight_map.update({key: name for key, _, _ in group})
        total += sum(size_of(d, s) for _, d, s in group)
    (root / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return root, total, output


def compute_only(src: str) -> None:
    """Compute every dequantized chunk of the fsdp-8 plan without writing; print the rate per CPU second."""
    import torch

    from reshard.read import open_source
    from reshard.runs import Dequantizer
    from reshard.plan import MeshSpec
    from reshard.plan import make_plan
    from reshard.plan import coordinate_chunks

    torch.set_num_threads(1)
    opened = open_source(src)
    index = opened.index
    plan = make_plan(opened.model_layout(), MeshSpec(fsdp=8), quantization=index.quantization)
    dequantizer, produced = Dequantizer(index), 0
    start = time.process_time()
    for coord in range(8):
        for _, tensor, box in coordinate_chunks(plan, coord):
            if dequantizer.computes(tensor):
                produced += sum(len(slab) for slab in dequantizer.chunk_slabs(tensor, box))
    cpu = time.process_time() - start
    sys.stderr.write(f"{produced / GB:.2f} GB of bf16 in {cpu:.2f} CPU s = {produced / cpu / GB:.2f} GB/s per core\n")


def main() -> None:
    if sys.argv[1:2] == ["--compute-only"]:
        return compute_only(sys.argv[2])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gb", type=float, default=4.0, help="bf16 output size of the FP8 checkpoint")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--dir", default=None, help="where to generate (default: a temporary folder)")
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    import write as write_bench

    cores = os.cpu_count() or 1
    work = Path(tempfile.mkdtemp(prefix="reshard-bench-dequant-", dir=args.dir))
    write_bench.CACHE_DIR = work / "layout-cache"
    env = write_bench.env()
    try:
        print(f"generating in {work} ...", flush=True)
        fp8, fp8_bytes, out_bytes = generate_fp8(work / "fp8", int(args.size_gb * GB))
        small, small_bytes, small_out = generate_fp8(work / "fp8-small", int(args.size_gb * GB / 4))
        if small_out >= out_bytes:  # both rounded to whole layers: no difference to take the steady state from
            raise SystemExit(f"--size-gb {args.size_gb:g} gives {out_bytes / GB:.2f} GB of output and a quarter twin "
                             f"of the same size (whole layers of {small_out / GB:.2f} GB); use at least "
                             f"{4 * small_out / GB:.1f}")
        bf16, bf16_bytes = generate(work / "bf16", out_bytes, 2 * GB)
        print(f"FP8 source {fp8_bytes / GB:.2f} GB -> bf16 output {out_bytes / GB:.2f} GB "
              f"(quarter twin {small_out / GB:.2f} GB); bf16 source {bf16_bytes / GB:.2f} GB; {cores} cores", flush=True)
        for src in (fp8, small, bf16):
            warm(src)
        write = [sys.executable, "-m", "reshard", "write"]
        for src in (fp8, small, bf16):  # warm the layout cache: the documented plan-then-write flow
            run_timed([sys.executable, "-m", "reshard", "plan", str(src), "--fsdp", "8"], env=env)
        compute = run_timed([sys.executable, __file__, "--compute-only", str(fp8)], env=env)[2]
        cases = {
            "dequantize, 1 process": (write + [str(fp8), str(work / "o"), "--fsdp", "8", "--dequantize", "bf16", "-q",
                                               "--workers", "1"], out_bytes),
            f"dequantize, --workers {cores}": (write + [str(fp8), str(work / "o"), "--fsdp", "8", "--dequantize",
                                                        "bf16", "-q", "--workers", str(cores)], out_bytes),
            "dequantize quarter size, 1 process": (write + [str(small), str(work / "o"), "--fsdp", "8", "--dequantize",
                                                            "bf16", "-q", "--workers", "1"], small_out),
            "plain bf16 write, 1 process": (write + [str(bf16), str(work / "o"), "--fsdp", "8", "-q", "--workers", "1"],
                                            bf16_bytes),
            "cp -r (bf16 source)": (["cp", "-r", str(bf16), str(work / "o")], bf16_bytes),
        }
        results = {name: [] for name in cases}
        for _ in range(args.runs):
            for name, (cmd, _) in cases.items():
                remove(work / "o")
                results[name].append(run_timed(cmd, env=env))
        remove(work / "o")
        print(f"\n{'case':38s} {'wall s':>8s} {'GB/s':>6s} {'cpu s':>7s} {'GB/s/core':>9s} {'peak RSS':>9s}")
        summary = {}
        for name, (_, size) in cases.items():
            wall = statistics.median(r[0] for r in results[name])
            cpu = statistics.median(r[3] for r in results[name])
            rss = max((r[1] or 0) for r in results[name])
            summary[name] = (wall, cpu, rss)
            print(f"{name:38s} {wall:8.2f} {size / wall / GB:6.2f} {cpu:7.2f} {size / cpu / GB:9.2f} "
                  f"{rss / 1024:7.0f} MiB")
        steady_cpu = summary["dequantize, 1 process"][1] - summary["dequantize quarter size, 1 process"][1]
        per_core = (out_bytes - small_out) / steady_cpu / GB
        one = summary["dequantize, 1 process"][0]
        plain = summary["plain bf16 write, 1 process"][0]
        cp = summary["cp -r (bf16 source)"][0]
        print(f"\nsteady state (difference of the two sizes): {per_core:.2f} GB/s of bf16 output per core")
        print(f"compute alone (every chunk of every rank file computed, nothing written, 1 thread): {compute.strip()}")
        print(f"dequantize / plain write = {one / plain:.2f}, dequantize / cp -r = {one / cp:.2f} (1 process); "
              f"with --workers {cores}: {summary[f'dequantize, --workers {cores}'][0] / cp:.2f} x cp -r")
        print(f"peak RSS, 1 process: {summary['dequantize, 1 process'][2] / 1024:.0f} MiB at "
              f"{out_bytes / GB:.1f} GB, {summary['dequantize quarter size, 1 process'][2] / 1024:.0f} MiB at "
              f"{small_out / GB:.1f} GB")
        hours = DSV3_OUTPUT_BYTES / (per_core * GB * 64) / 3600
        print(f"DeepSeek-V3 estimate: {DSV3_OUTPUT_BYTES / 1e12:.1f} TB of bf16 at {per_core:.2f} GB/s per core on 64 "
              f"cores = {per_core * 64:.0f} GB/s of compute, {hours * 60:.0f} min if the disks keep up (else the "
              "disk's write rate sets it: 1.3 TB at 2 GB/s is 11 min)")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
