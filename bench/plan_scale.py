"""How fast is `reshard plan` on a GLM-4.6-sized checkpoint, and does it read only headers?

Builds a GLM-4.6-shaped checkpoint (92 layers, 160 routed experts, about 44,189 tensors, about 700 GB apparent)
out of SPARSE files: each file is a real safetensors header followed by a hole made with `os.truncate`, so the
fixture uses a few MB of disk. Then measures:

- `python -m reshard plan DIR --fsdp 64 --ep 8 --json` end to end as a subprocess, `--repeat` times cold (each with
  a new, empty layout cache: it imports torch and transformers and builds the layout) and as many times warm (the
  cache the first cold run filled), best and median of each; next to it the import floor, a subprocess that only
  imports what a cold plan cannot do without (torch, transformers' GLM-4 MoE modeling module and its conversion
  mapping, garbage collector paused as in a plan); peak RSS (`RUSAGE_CHILDREN`), and bytes read (`rchar` of
  `/proc/self/io`, dumped by the child at exit; it counts every read() the process makes, Python imports included,
  so the same command on a 2-layer GLM fixture is run as the baseline and the difference is what the big checkpoint
  costs);
- under strace (when installed): the bytes read() from, and any mmap of, the fixture's files, the exact
  answer to "did it read tensor data";
- in-process phases (read_checkpoint, find_experts = build_meta_model + layout_from_model, make_plan, summarize,
  plan_to_dict) with their wall time and `rchar` delta; layout_from_model both ways: by template (what plan runs)
  and renaming every key with transformers (the reference).

Usage:
    python bench/plan_scale.py [--fsdp 64] [--ep 8] [--repeat 5] [--dir DIR] [--keep] [--profile]
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import resource
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# zai-org/GLM-4.6 config.json, the fields that set shapes (Glm4MoeConfig in transformers 5.23).
GLM46_CONFIG = {
    "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "attention_bias": True,
    "attention_dropout": 0.0, "pad_token_id": 151329, "eos_token_id": [151329, 151336, 151338], "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 5120, "partial_rotary_factor": 0.5, "initializer_range": 0.02,
    "intermediate_size": 12288, "max_position_embeddings": 202752, "moe_intermediate_size": 1536,
    "norm_topk_prob": True, "num_attention_heads": 96, "n_group": 1, "topk_group": 1, "n_routed_experts": 160,
    "n_shared_experts": 1, "routed_scaling_factor": 2.5, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
    "num_hidden_layers": 92, "num_key_value_heads": 8, "num_nextn_predict_layers": 1, "rms_norm_eps": 1e-05,
    "rope_theta": 1000000, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "use_qk_norm": True, "vocab_size": 151552,
}
# The same architecture, 2 layers (1 dense + 1 MoE) and small dims: the baseline for import-time reads.
SMALL_CONFIG = {**GLM46_CONFIG, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 24,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "n_routed_experts": 16,
                "first_k_dense_replace": 1, "num_hidden_layers": 2, "vocab_size": 512, "pad_token_id": 0,
                "eos_token_id": [1]}

DTYPE_BYTES = {"BF16": 2, "F32": 4}


def layer_tensors(cfg: dict, layer: int) -> list[tuple[str, str, tuple[int, ...]]]:
    """The on-disk (per-expert) keys of one decoder layer, as GLM-4.6's safetensors hold them."""
    h, heads, kv, hd = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    p = f"model.layers.{layer}"
    out = [
        (f"{p}.input_layernorm.weight", "BF16", (h,)),
        (f"{p}.post_attention_layernorm.weight", "BF16", (h,)),
        (f"{p}.self_attn.q_proj.weight", "BF16", (heads * hd, h)),
        (f"{p}.self_attn.q_proj.bias", "BF16", (heads * hd,)),
        (f"{p}.self_attn.k_proj.weight", "BF16", (kv * hd, h)),
        (f"{p}.self_attn.k_proj.bias", "BF16", (kv * hd,)),
        (f"{p}.self_attn.v_proj.weight", "BF16", (kv * hd, h)),
        (f"{p}.self_attn.v_proj.bias", "BF16", (kv * hd,)),
        (f"{p}.self_attn.o_proj.weight", "BF16", (h, heads * hd)),
    ]
    if cfg.get("use_qk_norm"):
        out += [(f"{p}.self_attn.q_norm.weight", "BF16", (hd,)), (f"{p}.self_attn.k_norm.weight", "BF16", (hd,))]
    if layer < cfg["first_k_dense_replace"]:
        i = cfg["intermediate_size"]
        return out + [(f"{p}.mlp.gate_proj.weight", "BF16", (i, h)), (f"{p}.mlp.up_proj.weight", "BF16", (i, h)),
                      (f"{p}.mlp.down_proj.weight", "BF16", (h, i))]
    i, e, shared = cfg["moe_intermediate_size"], cfg["n_routed_experts"], cfg["n_shared_experts"]
    out += [(f"{p}.mlp.gate.weight", "F32", (e, h)), (f"{p}.mlp.gate.e_score_correction_bias", "F32", (e,))]
    for x in range(e):
        out += [(f"{p}.mlp.experts.{x}.gate_proj.weight", "BF16", (i, h)),
                (f"{p}.mlp.experts.{x}.up_proj.weight", "BF16", (i, h)),
                (f"{p}.mlp.experts.{x}.down_proj.weight", "BF16", (h, i))]
    return out + [(f"{p}.mlp.shared_experts.gate_proj.weight", "BF16", (i * shared, h)),
                  (f"{p}.mlp.shared_experts.up_proj.weight", "BF16", (i * shared, h)),
                  (f"{p}.mlp.shared_experts.down_proj.weight", "BF16", (h, i * shared))]


def checkpoint_files(cfg: dict) -> list[list[tuple[str, str, tuple[int, ...]]]]:
    """One file per layer (the embeddings join layer 0), then one for the final norm and lm_head."""
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    files = [layer_tensors(cfg, layer) for layer in range(cfg["num_hidden_layers"])]
    files[0].insert(0, ("model.embed_tokens.weight", "BF16", (v, h)))
    files.append([("model.norm.weight", "BF16", (h,)), ("lm_head.weight", "BF16", (v, h))])
    return files


def write_sparse_checkpoint(folder: Path, cfg: dict) -> dict:
    """Write real safetensors headers; the data region of each file is a hole (`os.truncate`)."""
    folder.mkdir(parents=True, exist_ok=True)
    files = checkpoint_files(cfg)
    weight_map, total, header_bytes, header_ends = {}, 0, 0, {}
    for n, tensors in enumerate(files, 1):
        name = f"model-{n:05d}-of-{len(files):05d}.safetensors"
        header, cursor = {"__metadata__": {"format": "pt"}}, 0
        for key, dtype, shape in tensors:
            nbytes = DTYPE_BYTES[dtype]
            for d in shape:
                nbytes *= d
            header[key] = {"dtype": dtype, "shape": list(shape), "data_offsets": [cursor, cursor + nbytes]}
            cursor += nbytes
            weight_map[key] = name
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        with open(folder / name, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
        os.truncate(folder / name, 8 + len(raw) + cursor)
        total += cursor
        header_bytes += 8 + len(raw)
        header_ends[name] = 8 + len(raw)
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    return {"files": len(files), "tensors": len(weight_map), "data_bytes": total, "header_bytes": header_bytes,
            "header_ends": header_ends}


def disk_usage(folder: Path) -> tuple[int, int]:
    """(apparent bytes, bytes of allocated blocks), as `du --apparent-size` and `du` count them."""
    apparent = used = 0
    for path in folder.rglob("*"):
        if path.is_file():
            st = path.stat()
            apparent += st.st_size
            used += st.st_blocks * 512
    return apparent, used


# ---- measurements ------------------------------------------------------------------------------------------------

_CHILD = """
import atexit, os, runpy, sys
def _dump():
    with open(os.environ["PLAN_SCALE_IO"], "w") as f:
        f.write(open("/proc/self/io").read())
atexit.register(_dump)
sys.argv = ["reshard", *sys.argv[1:]]
runpy.run_module("reshard", run_name="__main__", alter_sys=True)
"""


def _proc_io(text: str) -> dict[str, int]:
    return {k: int(v) for k, v in (line.split(": ") for line in text.strip().splitlines())}


def run_plan(folder: Path, fsdp: int, ep: int, io_file: Path, *, cache: Path, prefix: list[str] = ()) -> dict:
    """`reshard plan FOLDER --json` in a fresh interpreter with the layout cache in `cache` (a new folder: cold):
    wall seconds, exit code, /proc/self/io at exit."""
    env = {**os.environ, "PLAN_SCALE_IO": str(io_file), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "RESHARD_CACHE_DIR": str(cache),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [*prefix, sys.executable, "-c", _CHILD, "plan", str(folder), "--fsdp", str(fsdp), "--ep", str(ep), "--json"]
    start = time.perf_counter()
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    wall = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"reshard plan failed ({result.returncode}):\n{result.stderr[-4000:]}")
    return {"wall_s": wall, "io": _proc_io(io_file.read_text()), "json": json.loads(result.stdout)}


_CALL = re.compile(r"^(openat|read|pread64|lseek|mmap)\((.*)\)\s+=\s+(-?\d+|0x[0-9a-f]+)(?:<([^>]*)>)?")
_FD = re.compile(r"^(\d+)<([^>]*)>")


def strace_reads(folder: Path, fsdp: int, ep: int, work: Path, header_ends: dict[str, int]) -> dict | None:
    """From an strace of the whole command: bytes read() from the fixture's files, how many of them lie past a
    safetensors header (in the tensor data), and any mmap of a fixture file. None when strace is unavailable."""
    strace = shutil.which("strace")
    if strace is None:
        return None
    logs = work / "strace"
    logs.mkdir()
    prefix = [strace, "-ff", "-y", "-s", "0", "-e", "trace=openat,read,pread64,lseek,mmap", "-o", str(logs / "t")]
    try:
        run_plan(folder, fsdp, ep, work / "io-strace.txt", cache=work / "cache-strace", prefix=prefix)
    except SystemExit as e:  # e.g. ptrace not permitted in this container
        print(f"(strace run failed, skipped: {str(e)[:200]})", file=sys.stderr)
        return None
    root = str(folder.resolve())
    out = {"bytes": 0, "data_bytes": 0, "calls": 0, "mmaps": 0, "files": set()}
    for log in logs.iterdir():  # one log per thread: no interleaved lines
        pos: dict[int, int] = {}
        for line in log.read_text(errors="replace").splitlines():
            m = _CALL.match(line)
            if not m:
                continue
            call, args, ret, opened = m.groups()
            if call == "openat":
                if opened and opened.startswith(root) and not ret.startswith("-"):
                    pos[int(ret)] = 0
                continue
            fd = _FD.match(args)
            if not fd or not fd.group(2).startswith(root):
                continue
            fdn, path = int(fd.group(1)), fd.group(2)
            out["files"].add(path)
            if call == "mmap" or call == "lseek":
                if call == "mmap":
                    out["mmaps"] += 1
                else:
                    pos[fdn] = int(ret)
                continue
            n = int(ret)
            if n <= 0:
                continue
            start = int(args.rsplit(",", 1)[1]) if call == "pread64" else pos.get(fdn, 0)
            if call == "read":
                pos[fdn] = start + n
            end_of_header = header_ends.get(Path(path).name)
            if end_of_header is not None:
                out["data_bytes"] += max(0, start + n - max(start, end_of_header))
            out["bytes"] += n
            out["calls"] += 1
    out["files"] = len(out["files"])
    return out


def in_process(folder: Path, fsdp: int, ep: int, profile: bool) -> tuple[list, list]:
    """Each phase's wall seconds and rchar delta, in this process; then, in a second (warm) pass, the time spent
    inside the functions that dominate read_checkpoint and layout_from_model."""
    phases = []

    def rchar() -> int:
        return _proc_io(Path("/proc/self/io").read_text())["rchar"]

    def timed(name, fn):
        r0, t0 = rchar(), time.perf_counter()
        value = fn()
        phases.append((name, time.perf_counter() - t0, rchar() - r0))
        return value

    def imports():
        for module in ("torch", "transformers", "reshard.plan._report", "reshard.read._experts"):
            importlib.import_module(module)

    timed("import torch, transformers", imports)
    from reshard.read._source import read_checkpoint
    from reshard.read._experts import _gc_paused, build_meta_model, layout_from_model
    from reshard.plan import MeshSpec
    from reshard.plan import make_plan, summarize
    from reshard.plan import plan_to_dict

    index = timed("read_checkpoint (headers)", lambda: read_checkpoint(folder))
    with _gc_paused(freeze=True):  # as find_experts runs them in a process that had not imported torch
        model = timed("find_experts: build_meta_model (cold)", lambda: build_meta_model(index.config))
        timed("find_experts: build_meta_model (warm)", lambda: build_meta_model(index.config))
        layout = timed("find_experts: layout_from_model (by template)", lambda: layout_from_model(model, index))
        timed("  the same, every key renamed by transformers",
              lambda: layout_from_model(model, index, by_template=False))
    plan = timed("make_plan", lambda: make_plan(layout, MeshSpec(fsdp=fsdp, ep=ep)))
    timed("summarize", lambda: summarize(plan))
    timed("plan_to_dict + json.dumps", lambda: json.dumps(plan_to_dict(plan, str(folder))))

    # where the time goes: accumulate the time spent inside a few functions (a warm second pass)
    import transformers.core_model_loading as cml

    from reshard.read import _checkpoint as checkpoint, _experts as experts

    targets = [(checkpoint, "_checked_file_names"), (checkpoint, "header_of"), (cml, "dot_natural_key"),
               (cml, "rename_source_key"), (experts, "compose_pieces"), (experts, "expert_param_names")]
    spent = {f"{mod.__name__}.{name}": [0.0, 0] for mod, name in targets if hasattr(mod, name)}
    originals = {}

    def wrap(key, fn):
        def timed_fn(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[key][0] += time.perf_counter() - t0
                spent[key][1] += 1
        return timed_fn

    for mod, name in targets:
        if hasattr(mod, name):
            originals[(mod, name)] = getattr(mod, name)
            setattr(mod, name, wrap(f"{mod.__name__}.{name}", getattr(mod, name)))
    try:
        t0 = time.perf_counter()
        index = read_checkpoint(folder)
        read_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        if profile:
            import cProfile
            import pstats

            prof = cProfile.Profile()
            prof.runcall(layout_from_model, model, index)
            print("\ncProfile of layout_from_model (top 15 by cumulative time):")
            pstats.Stats(prof).sort_stats("cumulative").print_stats(15)
        else:
            layout_from_model(model, index)
        layout_s = time.perf_counter() - t0
    finally:
        for (mod, name), fn in originals.items():
            setattr(mod, name, fn)
    hotspots = [("read_checkpoint (warm, instrumented)", read_s, 1),
                ("layout_from_model (warm, instrumented)", layout_s, 1)]
    hotspots += [(f"  in {key}", sec, calls) for key, (sec, calls) in spent.items()]
    return phases, hotspots


def import_floor() -> float:
    """Wall seconds of a fresh interpreter importing only what a cold plan of GLM-4.6 cannot do without, with the
    garbage collector paused and the result frozen, as `find_experts` does."""
    cmd = [sys.executable, "-c", "import gc; gc.disable(); import torch, transformers.conversion_mapping, "
           "transformers.models.glm4_moe.modeling_glm4_moe; gc.freeze()"]
    start = time.perf_counter()
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return time.perf_counter() - start


def spread(values: list[float]) -> str:
    ordered = sorted(values)
    return f"best {ordered[0]:.2f} s, median {ordered[len(ordered) // 2]:.2f} s of {len(ordered)}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fsdp", type=int, default=64)
    parser.add_argument("--ep", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=5,
                        help="cold runs, warm runs and import-floor runs of the subprocess (best and median shown)")
    parser.add_argument("--dir", type=Path, default=None, help="where to build the fixture (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the fixture")
    parser.add_argument("--profile", action="store_true", help="also print a cProfile of layout_from_model")
    args = parser.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="plan-scale-", dir=args.dir))
    os.environ["RESHARD_CACHE_DIR"] = str(work / "layout-cache")  # never the user's cache
    try:
        t0 = time.perf_counter()
        big = write_sparse_checkpoint(work / "glm46", GLM46_CONFIG)
        write_sparse_checkpoint(work / "glm-small", SMALL_CONFIG)  # the baseline run's fixture
        build_s = time.perf_counter() - t0
        apparent, used = disk_usage(work / "glm46")
        meta_bytes = big["header_bytes"] + sum((work / "glm46" / n).stat().st_size
                                               for n in ("model.safetensors.index.json", "config.json"))
        print(f"fixture: {big['files']} files, {big['tensors']} tensors, {apparent / 1e9:.1f} GB apparent, "
              f"{used / 1e6:.2f} MB on disk, headers {big['header_bytes'] / 1e6:.2f} MB (built in {build_s:.1f} s); "
              f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")

        def cpu_children() -> float:
            usage = resource.getrusage(resource.RUSAGE_CHILDREN)
            return usage.ru_utime + usage.ru_stime

        c0 = cpu_children()
        base = run_plan(work / "glm-small", args.fsdp, args.ep, work / "io-small.txt", cache=work / "cache-small")
        base_cpu = cpu_children() - c0
        # interleaved, so that a change in the machine's load hits all three alike
        cold, cold_cpu, warm, floor = [], [], [], []
        for i in range(args.repeat):
            c0 = cpu_children()
            cold.append(run_plan(work / "glm46", args.fsdp, args.ep, work / f"io-cold{i}.txt",
                                 cache=work / f"cache-cold{i}"))
            cold_cpu.append(cpu_children() - c0)
            warm.append(run_plan(work / "glm46", args.fsdp, args.ep, work / f"io-warm{i}.txt",
                                 cache=work / "cache-cold0"))
            floor.append(import_floor())
        rss_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # max over the children: a big one
        sub = cold[0]
        traced = strace_reads(work / "glm46", args.fsdp, args.ep, work, big["header_ends"])
        summary = sub["json"]["summary"]

        phases, hotspots = in_process(work / "glm46", args.fsdp, args.ep, args.profile)
        self_rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

        rows = [
            ("fixture tensors / files", f"{big['tensors']} / {big['files']}"),
            ("fixture apparent size", f"{apparent / 1e9:.1f} GB"),
            ("fixture disk blocks used (du)", f"{used / 1e6:.2f} MB"),
            ("fixture headers + index + config", f"{meta_bytes / 1e6:.2f} MB"),
            (f"`reshard plan --fsdp {args.fsdp} --ep {args.ep} --json`, cold (empty layout cache)",
             f"{spread([r['wall_s'] for r in cold])} wall; {spread(cold_cpu)} CPU"),
            ("  warm (layout cached: a second plan, or write after plan)", spread([r["wall_s"] for r in warm])),
            ("  import floor: torch + transformers' glm4_moe modeling + conversion_mapping, GC paused", spread(floor)),
            ("  same command on a 2-layer GLM, cold (startup baseline)",
             f"{base['wall_s']:.2f} s wall, {base_cpu:.2f} s CPU"),
            ("  peak RSS (RUSAGE_CHILDREN)", f"{rss_kib / 1024:.0f} MiB"),
            ("  rchar (all reads, imports included)", f"{sub['io']['rchar'] / 1e6:.1f} MB"),
            ("  rchar minus 2-layer baseline", f"{(sub['io']['rchar'] - base['io']['rchar']) / 1e6:.2f} MB"),
            ("  read_bytes (from the block device)", f"{sub['io']['read_bytes'] / 1e6:.2f} MB"),
        ]
        if traced is not None:
            rows += [("  strace: bytes read() from fixture files", f"{traced['bytes'] / 1e6:.2f} MB in "
                      f"{traced['calls']} calls over {traced['files']} files"),
                     ("  strace: of which past a header (tensor data)", f"{traced['data_bytes']} B"),
                     ("  strace: mmaps of fixture files", str(traced["mmaps"]))]
        rows += [("plan: tensors / expert tensors", f"{summary['tensors']} / {summary['expert_tensors']}"),
                 ("plan: expert max/mean stock -> planned", f"{summary['stock_expert_max_over_mean']:.3f} -> "
                  f"{summary['planned_expert_max_over_mean']:.3f}"),
                 ("plan: empty ranks stock -> planned", f"{len(summary['stock_empty_ranks'])} -> "
                  f"{len(summary['planned_empty_ranks'])} (tensors with an empty rank: "
                  f"{summary['stock_empty_tensors']} -> {summary['planned_empty_tensors']})")]
        for name, seconds, read in phases:
            rows.append((f"in-process: {name}", f"{seconds:.2f} s, rchar {read / 1e6:.2f} MB"))
        rows.append(("in-process peak RSS (this process)", f"{self_rss_kib / 1024:.0f} MiB"))
        for name, seconds, calls in hotspots:
            rows.append((name, f"{seconds:.2f} s" + (f" in {calls} calls" if calls > 1 else "")))
        width = max(len(k) for k, _ in rows)
        print()
        for key, value in rows:
            print(f"{key:<{width}}  {value}")
        fast = min(r["wall_s"] for r in cold) <= 2.0
        # "no tensor bytes": nothing read past any header except buffered read-ahead (< 8 KiB per file), no mmap
        data_free = traced is None or (traced["data_bytes"] < 8192 * big["files"] and traced["mmaps"] == 0)
        print(f"\ntarget: cold plan at most 2 s {'MET' if fast else 'MISSED'}; reads no tensor bytes "
              f"{'MET' if data_free else 'MISSED'}" + ("" if traced else " (no strace: judged by rchar only)"))
    finally:
        if args.keep:
            print(f"fixture kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
