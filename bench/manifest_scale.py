"""Does planning, chunk-list building, the manifest and its checks grow linearly with the mesh?

On the GLM-4.6-shaped headers of `bench/plan_scale.py` (92 layers, 160 experts, 44,189 on-disk tensors; sparse
files, a few MB of disk), with `--ep 8` at fsdp 64, 256, 1024 and 4096, measures in one process:

- plan: `make_plan` on the layout (the layout itself is built once: it does not depend on the mesh);
- chunk lists: `coordinate_chunks` of every coordinate, as the writers build them (one coordinate at a time, each
  when its file is written); before the first byte, a write needs only every coordinate's size
  (`coordinate_sizes`, by tensor kind) and the first coordinate's list;
- manifest: the manifest for one file per coordinate, built from the typed entries (`build_manifest`) and serialized
  (`Manifest.to_json`), its size;
- load: what one rank does, parsing the manifest and deriving its own coordinate's chunks;
- checks: `coverage_problems`, the structural part of `verify` and of the whole-model load;
- before: the per-coordinate chunk lists as they were built before (every coordinate's boxes of every tensor, for
  each coordinate), timed on 2 coordinates and scaled to all of them.

Usage:
    python bench/manifest_scale.py [--fsdp 64 256 1024 4096] [--ep 8]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def timed(fn):
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fsdp", type=int, nargs="+", default=[64, 256, 1024, 4096])
    parser.add_argument("--ep", type=int, default=8)
    args = parser.parse_args()

    from plan_scale import GLM46_CONFIG, write_sparse_checkpoint

    from reshard.read import open_source
    from reshard.manifest import FileEntry, Manifest, build_manifest, coverage_problems
    from reshard.plan import MeshSpec
    from reshard.plan import local_box, make_plan
    from reshard.plan import coordinate_chunks, coordinate_sizes

    with tempfile.TemporaryDirectory() as tmp:
        os.environ["RESHARD_CACHE_DIR"] = ""  # no layout cache: the layout is built here, once
        fixture = write_sparse_checkpoint(Path(tmp) / "glm46", GLM46_CONFIG)
        opened = open_source(Path(tmp) / "glm46")
        index = opened.index
        layout, layout_s = timed(opened.model_layout)
        print(f"GLM-4.6-shaped headers: {fixture['tensors']} on-disk tensors in {fixture['files']} files; "
              f"{len(layout.tensors)} in-memory tensors; layout built once in {layout_s:.2f} s\n")
        rows = []
        for fsdp in args.fsdp:
            mesh = MeshSpec(fsdp=fsdp, ep=args.ep)
            local_box.cache_clear()
            plan, plan_s = timed(lambda: make_plan(layout, mesh))
            first_s = timed(lambda: coordinate_chunks(plan, 0))[1]
            sizes, sizes_s = timed(lambda: coordinate_sizes(plan))  # the write's other step before its first byte
            local_box.cache_clear()
            files = []

            def chunk_lists():
                for coord in range(mesh.num_coords):
                    chunks = coordinate_chunks(plan, coord)
                    files.append(FileEntry(f"shard-{coord + 1:05d}-model-00001-of-00001.safetensors", coord, 0,
                                           len(chunks), sizes[coord], "00000000",
                                           sum(0 in spec.shape for spec, _, _ in chunks)))

            chunks_s = timed(chunk_lists)[1]
            text, manifest_s = timed(lambda: build_manifest(plan, index, files, where=tmp).to_json())

            def load():
                data = json.loads(text)
                manifest = Manifest.from_document(data, tmp)
                return manifest.chunks(manifest.file_entry(manifest.files_of_rank(fsdp - 1)[0]))

            own, load_s = timed(load)
            assert len(own) == len(plan.tensors)
            problems, check_s = timed(lambda: coverage_problems(Manifest.from_document(json.loads(text), tmp)))
            assert problems == [], problems[:3]
            raw = local_box.__wrapped__  # the uncached box, as every coordinate's list was built before

            def before(coords=2):
                for coord in range(coords):
                    [tuple(raw(tp.tensor.shape, tp.planned, mesh, c) for c in range(mesh.num_coords))[coord]
                     for tp in plan.tensors]

            before_s = timed(before)[1] / 2 * mesh.num_coords
            rows.append((fsdp, plan_s, first_s + sizes_s, chunks_s, manifest_s, len(text), load_s, check_s, before_s))
        print("| fsdp (ep 8) | plan s | before the first byte (sizes + first chunk list) s | all chunk lists s | manifest build + "
              "dump s | manifest MB | one rank's load of it s | coverage check s | before: all chunk lists s |")
        print("|---|---|---|---|---|---|---|---|---|")
        previous = None
        for row in rows:
            fsdp, plan_s, first_s, chunks_s, manifest_s, size, load_s, check_s, before_s = row
            step = ""
            if previous:
                step = (f" ({chunks_s / previous[3]:.1f}x)", f" ({size / previous[5]:.2f}x)",
                        f" ({check_s / previous[7]:.1f}x)", f" ({before_s / previous[8]:.0f}x)")
            s = step or ("", "", "", "")
            print(f"| {fsdp} | {plan_s:.2f} | {first_s:.3f} | {chunks_s:.1f}{s[0]} | {manifest_s:.2f} | "
                  f"{size / 1e6:.1f}{s[1]} | {load_s:.2f} | {check_s:.2f}{s[2]} | {before_s:.0f}{s[3]} |", flush=True)
            previous = row
        print("\n(x): the ratio to the previous row, a 4x larger mesh; linear growth is 4x, constant is 1x.")


if __name__ == "__main__":
    main()
