"""A `--layout stock` folder loads with STOCK transformers on a real multi-process gloo mesh, empty ranks included.

Each rank (tests/ranks/load_stock.py) loads the written folder with
`AutoModelForCausalLM.from_pretrained(out, distributed_config=DistributedConfig(...))` (transformers'
distributed-checkpoint path, no reshard patch), compares every local tensor bit-exactly with the slice the plan
gives it of a single-process load of the source, and records the files and bytes torch's reader took data from.
The run_ranks timeout turns a hang into a failure.
"""

from __future__ import annotations

import json

import math

import pytest

from conftest import file_chunks, rank_reports, run_ranks
from reshard.api import write_checkpoint
from reshard.plan import DTYPE_BITS
from reshard.plan import MeshSpec

pytestmark = pytest.mark.multirank


def chunk_bytes(manifest: dict, coord: int) -> int:
    """Bytes of every chunk stored in `coord`'s files."""
    dtypes = {name: t["dtype"] for name, t in manifest["tensors"].items()}
    return sum(math.prod(c.shape) * DTYPE_BITS[dtypes[c.name]] // 8
               for f in manifest["files"] if f["coord"] == coord for c in file_chunks(manifest, f))


def empty_names(manifest: dict, coord: int) -> list[str]:
    return sorted(c.name for f in manifest["files"] if f["coord"] == coord for c in file_chunks(manifest, f)
                  if c.is_empty)


@pytest.mark.parametrize("model_type, experts, fsdp, empty_ranks", [
    ("qwen3_moe", 2, 4, [2, 3]),
    ("mixtral", 8, 5, [4]),
], ids=["qwen3_moe-2experts-fsdp4", "mixtral-8experts-fsdp5"])
@pytest.mark.slow  # stock transformers on 4-5 ranks
def test_stock_layout_loads_with_stock_transformers(tiny, tmp_path, model_type, experts, fsdp, empty_ranks):
    src = tiny(model_type, experts=experts)
    out = tmp_path / "out"
    write_checkpoint(src, out, MeshSpec(fsdp=fsdp), mode="stock", progress=False)
    manifest = json.loads((out / "reshard.json").read_text())
    expert_names = {n for n, t in manifest["tensors"].items() if t["role"] == "expert"}
    # the case under test really has ranks without experts
    assert [c["coord"] for c in manifest["coords"] if expert_names <= set(empty_names(manifest, c["coord"]))] \
        == empty_ranks
    assert all(t["is_param"] for t in manifest["tensors"].values()), "buffers would be read from coordinate 0"

    reports_dir = tmp_path / "reports"
    run_ranks("load_stock.py", fsdp, src, out, fsdp, 1, reports_dir, timeout=300)
    reports = rank_reports(reports_dir, fsdp)

    for rank, report in enumerate(reports):
        coord = manifest["coords"][rank]
        assert report["rank"] == rank and report["coord"] == rank and report["world"] == fsdp
        assert report["problems"] == [], f"rank {rank}: {report['problems'][:5]}"
        assert report["checked"] == len(manifest["tensors"])
        assert report["uninitialized"] == []
        assert sorted(report["empty_locals"]) == empty_names(manifest, rank), f"rank {rank}"
        assert (rank in empty_ranks) == bool(report["empty_locals"])
        # reads: only this coordinate's files, exactly its chunks' bytes
        assert set(report["reads"]) == set(coord["files"]), f"rank {rank} read {sorted(report['reads'])}"
        assert sum(report["reads"].values()) == chunk_bytes(manifest, rank), f"rank {rank}"
        assert all(file in coord["files"] for _, file, _ in report["items"])
