"""SHA-256 of every file reshard writes for a fixed corpus: the proof that a refactor changed no output byte.

Run `write` once on the tree before a change and once on the tree after it, then `compare` the two JSON files. The
tree under test is the `reshard` package found on `sys.path` (set PYTHONPATH to its checkout; this script never adds
its own), and the test generators come from the `tests/` folder beside that package, so both runs use their own.

The corpus, written under a scratch folder with relative paths (the manifests name their source as given, so the
digests do not depend on where the scratch folder is):

- `breadth/<type>-<layout>`: every runnable MoE model type of `tests/breadth.py`, in each on-disk layout it has,
  written as `tests/breadth.py`'s `check_case` writes it (the uneven mesh in the balanced and stock layouts, the even
  mesh balanced), merged back (`original` with small files, `original` of the stock folder, `fused`), and from mesh
  to mesh (the uneven balanced folder written again at the even mesh, merged in both layouts). Two dtype variants
  of `tests/test_breadth.py` (bf16 with fp32 tensors kept, tied embeddings) go the same way.
- `quantized/<name>`: `tests/test_quantized.py`'s FP8-block and MXFP4 tiny checkpoints, written with `--dequantize
  bf16` at its empty-rank mesh (balanced, stock) and even mesh, merged in both layouts, and from mesh to mesh.
- `workers/<case>-w1|w2`: one copying and one dequantizing write by one process and by two worker processes; the
  two must be byte-identical (checked here, and by `compare` across trees). Where `merge_checkpoint` takes
  `workers`, `workers/merge-w1|w3`: a merge of the first by one process and by three workers, byte-identical too
  (entries a tree without it lacks are listed by `compare` as new, not counted as differing).

A refused step is recorded as `<case>/<step>/ERROR` with its message, so messages are compared too. The JSON holds
`files` ({case/step/relative_file: sha256 or the error}), the `tool` string of every manifest and merge index (one
value), the imported `reshard` file and the versions of Python, torch and transformers.

usage:
    OMP_NUM_THREADS=1 PYTHONPATH=TREE python scripts/output_digests.py write OUT.json [--scratch DIR]
    python scripts/output_digests.py compare BEFORE.json AFTER.json
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import math
import os
import shutil
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

# tests/test_quantized.py MODELS, fixed here so both trees write the same corpus:
# name -> (tiny model type, experts, fused on disk, method, FP8 block); 6 experts leave stock rank 3 of fsdp 4 empty
QUANTIZED = {
    "deepseek_v3-fp8": ("deepseek_v3", 6, False, "fp8", (16, 16)),  # 24-row experts: partial 16-row blocks
    "qwen3_moe-fp8": ("qwen3_moe", 6, False, "fp8", (32, 32)),
    "qwen3_moe-fp8-fused": ("qwen3_moe", 6, True, "fp8", (32, 32)),
    "gpt_oss-mxfp4": ("gpt_oss", 6, True, "mxfp4", None),
}
# tests/test_breadth.py VARIANTS: name -> (model type, dtype, tied embeddings)
VARIANTS = {"deepseek_v3-bf16": ("deepseek_v3", "bfloat16", False), "qwen3_moe-tied": ("qwen3_moe", "float32", True)}
SMALL_SHARD = 100_000  # bytes: several files per rank and per merge
MARK = ".output-digests"  # marks a scratch folder this script may empty


@dataclass
class Digests:
    """What one `write` run found: file digests (or errors) per case, and the tool strings the outputs carry."""

    scratch: Path
    files: dict[str, str] = field(default_factory=dict)
    tools: set[str] = field(default_factory=set)

    def folder(self, case: str, folder: Path) -> None:
        for path in sorted(p for p in Path(folder).rglob("*") if p.is_file()):
            self.files[f"{case}/{path.relative_to(folder).as_posix()}"] = _sha256(path)
            if path.name in ("reshard.json", "model.safetensors.index.json"):
                doc = json.loads(path.read_text())
                tool = doc.get("tool") or doc.get("metadata", {}).get("tool")
                if tool:
                    self.tools.add(tool)

    def step(self, case: str, make) -> Path | None:
        """Run `make(out)` for the folder `case` names; digest what it wrote, or record why it refused."""
        out = Path(case)
        try:
            make(out)
        except Exception as e:  # noqa: BLE001 - a refusal (or a crash) is part of the behaviour compared
            message = str(e).replace(str(self.scratch), "<scratch>")
            self.files[f"{case}/ERROR"] = f"error: {type(e).__name__}: {message}"
            if not isinstance(e, _reshard_error()):
                print(f"  {case}: unexpected {type(e).__name__}\n{traceback.format_exc(limit=-4)}", file=sys.stderr)
            if out.exists():  # nothing partial may be left: any leftover is recorded too
                self.folder(f"{case}/LEFT", out)
            return None
        self.folder(case, out)
        return out


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _reshard_error():
    from reshard.errors import ReshardError

    return ReshardError


def _tree_under_test() -> Path:
    """The `tests/` folder beside the imported `reshard` package, put on `sys.path`: both from the tree under test."""
    try:
        import reshard
    except ImportError:
        sys.exit("reshard is not importable: set PYTHONPATH to the checkout to measure.")
    tests = Path(reshard.__file__).resolve().parent.parent / "tests"
    print(f"reshard: {reshard.__file__}\ntests:   {tests}", file=sys.stderr)
    if not (tests / "breadth.py").is_file():
        sys.exit(f"{tests}: no breadth.py; this script needs a source checkout of reshard, with its tests.")
    sys.path.insert(0, str(tests))
    return Path(reshard.__file__)


# ---- the corpus -------------------------------------------------------------------------------------------------

def write_and_merge(d: Digests, case: str, src: Path, meshes: dict, **write_args) -> None:
    """The writes, merges and mesh-to-mesh write of one source (`meshes`: `uneven` and `even`)."""
    import reshard

    uneven, even = meshes["uneven"], meshes["even"]
    for name, mesh, mode in (("uneven-balanced", uneven, "balanced"), ("uneven-stock", uneven, "stock"),
                             ("even-balanced", even, "balanced")):
        d.step(f"{case}/{name}", lambda out, mesh=mesh, mode=mode: reshard.write_checkpoint(
            src, out, mesh, mode=mode, progress=False, **write_args))
    balanced, stock = Path(f"{case}/uneven-balanced"), Path(f"{case}/uneven-stock")
    d.step(f"{case}/merge-original-small", lambda out: reshard.merge_checkpoint(
        balanced, out, max_shard_size=SMALL_SHARD, progress=False))
    d.step(f"{case}/merge-stock-original", lambda out: reshard.merge_checkpoint(stock, out, progress=False))
    d.step(f"{case}/merge-fused", lambda out: reshard.merge_checkpoint(balanced, out, layout="fused", progress=False))
    second = d.step(f"{case}/mesh-to-mesh", lambda out: reshard.write_checkpoint(balanced, out, even, progress=False))
    if second is not None:
        for layout in ("original", "fused"):
            d.step(f"{case}/mesh-to-mesh-merge-{layout}", lambda out, layout=layout: reshard.merge_checkpoint(
                second, out, layout=layout, progress=False))


def breadth_meshes(breadth, plan) -> dict:
    """The two meshes `breadth.check_case` writes at: with EP `breadth.meshes`, FSDP only by the expert sizes."""
    from reshard import MeshSpec

    experts = plan.layout.experts
    if plan.layout.expert_parallel:
        return breadth.meshes(experts[0].shape[0])
    sizes = {t.shape[0] for t in experts}
    return {"uneven": MeshSpec(fsdp=max(sizes) + 1), "even": MeshSpec(fsdp=math.gcd(*sizes))}


def breadth_case(d: Digests, breadth, case: str, src: Path) -> None:
    """One breadth source: planned at fsdp 2 as `check_case` does (a refusal is recorded), then written and merged."""
    import reshard

    d.folder(f"{case}/source", src)
    plans = []
    if d.step(f"{case}/plan", lambda out: plans.append(reshard.plan_checkpoint(src, reshard.MeshSpec(fsdp=2)))) \
            is None:
        return
    plans[0] = getattr(plans[0], "plan", plans[0])  # a typed result holds the plan; a tree before it returned it
    if plans[0] is None:  # no routed experts: the write's refusal is what there is to compare
        d.step(f"{case}/refused", lambda out: reshard.write_checkpoint(src, out, reshard.MeshSpec(fsdp=2),
                                                                       progress=False))
        return
    write_and_merge(d, case, src, breadth_meshes(breadth, plans[0]))


def breadth_corpus(d: Digests, breadth) -> None:
    matrix = breadth.Matrix(Path("sources/breadth"))
    for cand in breadth.runnable():
        for layout in breadth.LAYOUTS:
            case = f"breadth/{cand.model_type}-{layout}"
            sources = []
            if d.step(f"{case}/generate", lambda out: sources.append(matrix.source(cand.model_type, layout))) \
                    is not None and sources[0] is not None:  # None: the fused layout is the original one
                breadth_case(d, breadth, case, sources[0])
        print(f"  {cand.model_type:22s} {len(d.files):6d} files so far", file=sys.stderr)
    for name, (model_type, dtype, tied) in VARIANTS.items():
        breadth_case(d, breadth, f"breadth/{name}", variant_source(breadth, model_type, dtype, tied, name))


def variant_source(breadth, model_type: str, dtype: str, tied: bool, name: str) -> Path:
    """`tests/test_breadth.py`'s variant source: generated in float32, re-saved by transformers in `dtype`."""
    import torch
    from transformers import AutoModelForCausalLM

    src = breadth.generate(model_type, Path(f"sources/variants/{name}-f32"), fused=False, tie_word_embeddings=tied)
    if dtype == "float32":
        return src
    out = Path(f"sources/variants/{name}")
    AutoModelForCausalLM.from_pretrained(src, dtype=getattr(torch, dtype), use_kernels=False).save_pretrained(out,
                                                                                           save_original_format=True)
    return out


def quantized_corpus(d: Digests) -> None:
    from reshard import MeshSpec
    from reshard.tiny import make_tiny_checkpoint, quantize_checkpoint

    meshes = {"uneven": MeshSpec(fsdp=4), "even": MeshSpec(fsdp=2)}  # test_quantized's EMPTY_MESH and EVEN_MESH
    for name, (model_type, experts, fused, method, block) in QUANTIZED.items():
        bf16 = make_tiny_checkpoint(model_type, Path(f"sources/quantized/{name}-bf16"), experts=experts, fused=fused,
                                    dtype="bfloat16")
        src = quantize_checkpoint(bf16, Path(f"sources/quantized/{name}"), method=method, block=block or (128, 128))
        d.folder(f"quantized/{name}/source", src)
        write_and_merge(d, f"quantized/{name}", src, meshes, dequantize="bf16")
        print(f"  {name:22s} {len(d.files):6d} files so far", file=sys.stderr)


def workers_corpus(d: Digests) -> list[str]:
    """One process and two worker processes on the same write; returns the cases whose files differ."""
    import reshard

    cases = {"deepseek_v3-original": (Path("sources/breadth/deepseek_v3/original"), reshard.MeshSpec(fsdp=6, ep=2),
                                      {"max_shard_size": SMALL_SHARD}),
             "qwen3_moe-fp8": (Path("sources/quantized/qwen3_moe-fp8"), reshard.MeshSpec(fsdp=4),
                               {"dequantize": "bf16"})}
    differ = []
    for name, (src, mesh, args) in cases.items():
        for workers in (1, 2):
            d.step(f"workers/{name}-w{workers}", lambda out, workers=workers: reshard.write_checkpoint(
                src, out, mesh, progress=False, workers=workers, **args))
        one, two = ({k.split("/", 2)[2]: v for k, v in d.files.items() if k.startswith(f"workers/{name}-w{w}/")}
                    for w in (1, 2))
        if not one or one != two:
            differ.append(name)
    if "workers" in inspect.signature(reshard.merge_checkpoint).parameters:  # a tree whose merge has --workers
        folder = Path("workers/deepseek_v3-original-w1")
        for workers in (1, 3):
            d.step(f"workers/merge-w{workers}", lambda out, workers=workers: reshard.merge_checkpoint(
                folder, out, progress=False, max_shard_size=SMALL_SHARD, workers=workers))
        one, three = ({k.split("/", 2)[2]: v for k, v in d.files.items() if k.startswith(f"workers/merge-w{w}/")}
                      for w in (1, 3))
        if not one or one != three:
            differ.append("merge")
    return differ


# ---- the commands -----------------------------------------------------------------------------------------------

def _scratch(folder: str | None) -> tuple[Path, bool]:
    """The scratch folder (emptied if a previous run marked it) and whether to remove it afterwards."""
    if folder is None:
        return Path(tempfile.mkdtemp(prefix="output-digests-")).resolve(), True
    path = Path(folder).resolve()
    if path.exists() and any(path.iterdir()):
        if not (path / MARK).exists():
            sys.exit(f"{path}: not empty and not a scratch folder of this script; choose an empty or new folder.")
        shutil.rmtree(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / MARK).touch()
    return path, False


def write(out_json: str, scratch_arg: str | None) -> int:
    import platform

    reshard_file = _tree_under_test()
    import breadth
    import torch
    import transformers

    os.environ["RESHARD_CACHE_DIR"] = ""  # no layout cache: nothing read from or written to the home folder
    out_json = os.path.abspath(out_json)
    scratch, remove = _scratch(scratch_arg)
    start, here = time.monotonic(), os.getcwd()
    d = Digests(scratch)
    os.chdir(scratch)
    try:
        breadth_corpus(d, breadth)
        quantized_corpus(d)
        differ = workers_corpus(d)
    finally:
        os.chdir(here)
        if remove:
            shutil.rmtree(scratch, ignore_errors=True)
    seconds = time.monotonic() - start
    doc = {"reshard": str(reshard_file), "tool": sorted(d.tools), "python": platform.python_version(),
           "torch": torch.__version__, "transformers": transformers.__version__, "seconds": round(seconds, 1),
           "workers_differ": differ, "files": dict(sorted(d.files.items()))}
    Path(out_json).write_text(json.dumps(doc, indent=1) + "\n")
    cases = {k.rsplit("/", 1)[0] for k in d.files}
    errors = sum(k.endswith("/ERROR") for k in d.files)
    same = f"no, {differ}" if differ else "yes"
    print(f"{out_json}: {len(d.files)} entries ({errors} refusals) in {len(cases)} folders, {seconds:.0f}s; "
          f"tool {', '.join(sorted(d.tools))}; workers=2 equal to workers=1: {same}")
    return 1 if differ or len(d.tools) != 1 else 0


def compare(before_json: str, after_json: str) -> int:
    before, after = (json.loads(Path(p).read_text()) for p in (before_json, after_json))
    print(f"before: {before['reshard']}\nafter:  {after['reshard']}")
    bad = 0
    for key in ("tool", "python", "torch", "transformers", "workers_differ"):
        if before.get(key) != after.get(key):
            print(f"{key}: {before.get(key)} -> {after.get(key)}")
            bad += key in ("tool", "workers_differ")
    old, new = before["files"], after["files"]
    equal = sum(old[k] == new.get(k) for k in old)
    for key in sorted(old.keys() | new.keys()):
        if key not in new:
            print(f"missing after: {key}")
        elif key not in old:
            print(f"new after:     {key}")
        elif old[key] != new[key]:
            print(f"differs:       {key}\n    before {old[key]}\n    after  {new[key]}")
    differing, added = len(old) - equal, len(new.keys() - old.keys())
    print(f"{equal} equal, {differing} differing or missing, {added} new (cases the before tree cannot run, such "
          f"as a merge with workers) (before {len(old)}, after {len(new)} entries)")
    return 1 if differing or bad else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    w = commands.add_parser("write", help="write the corpus and the JSON of its digests")
    w.add_argument("out", metavar="OUT.json")
    w.add_argument("--scratch", metavar="DIR", help="write the corpus under DIR and keep it (default: a temporary "
                   "folder, removed afterwards)")
    c = commands.add_parser("compare",
                            help="compare two JSON files; exit 1 if any entry of BEFORE differs or is missing")
    c.add_argument("before", metavar="BEFORE.json")
    c.add_argument("after", metavar="AFTER.json")
    args = parser.parse_args(argv)
    if args.command == "write":
        return write(args.out, args.scratch)
    return compare(args.before, args.after)


if __name__ == "__main__":  # the worker processes of `workers=2` are spawned: they import this file, run nothing
    sys.exit(main())
