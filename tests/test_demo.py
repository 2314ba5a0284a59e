"""`reshard demo`, the README's first command: every rank reads its own file, and all of them read each byte once."""

from __future__ import annotations

import pytest

from reshard.read.safetensors_header import read_header
from reshard.demo import run_demo
from reshard.manifest import read_manifest


@pytest.mark.multirank
def test_demo_ranks_read_their_own_files_and_nothing_else(tmp_path):
    lines: list[str] = []
    summary = run_demo(ranks=4, keep=tmp_path, echo=lines.append)
    out = tmp_path / "tiny-qwen3-moe-fsdp4"
    manifest = read_manifest(out)
    coords = {c.coord: list(c.files) for c in manifest.coords}
    for report in summary.ranks:
        assert report["files"] == coords[report["rank"]]  # fsdp only: rank r is coordinate r
        tensor_bytes = sum(e.nbytes for name in report["files"] for e in read_header(out / name).tensors)
        assert report["bytes"] == tensor_bytes > 0
    assert any("OK: 25 model tensors covered exactly once" in line for line in lines), lines
    assert any("1.00x an even 1/4 share" in line for line in summary.lines), summary.lines[-3:]
    assert f"are in {tmp_path}" in summary.summary()  # kept: the last line says where
