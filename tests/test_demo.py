"""`reshard demo`, the README's first command: every rank reads its own file, and all of them read each byte once;
every command it prints runs where the user stands."""

from __future__ import annotations

import re
import shlex

import pytest
from click.testing import CliRunner

from reshard.cli import cli
from reshard.demo import run_demo
from reshard import read_manifest
from reshard.read._safetensors_header import read_header


@pytest.mark.multirank
def test_demo_ranks_read_their_own_files_and_its_commands_run_from_the_users_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    lines: list[str] = []
    summary = run_demo(ranks=4, keep="./demo", echo=lines.append)
    out = tmp_path / "demo" / "tiny-qwen3-moe-fsdp4"
    manifest = read_manifest(out)
    coords = {c.coord: list(c.files) for c in manifest.coords}
    for report in summary.ranks:
        assert report["files"] == coords[report["rank"]]  # fsdp only: rank r is coordinate r
        tensor_bytes = sum(e.nbytes for name in report["files"] for e in read_header(out / name).tensors)
        assert report["bytes"] == tensor_bytes > 0
    assert any("OK: 25 model tensors covered exactly once" in line for line in lines), lines
    assert any("1.00x an even 1/4 share" in line for line in summary.lines), summary.lines[-3:]
    assert "are in ./demo" in summary.summary()  # kept: the last lines say where, as the user named it
    # every command the demo printed (its steps, then the README's next commands) runs from here, as printed
    steps = [m.group(1) for line in lines for m in [re.match(r"\n?\d/5 (reshard .*)", line)] if m]
    after = list(summary.lines[summary.lines.index("next:") + 1:])
    commands = [c.strip() for line in steps + after for c in line.split("&&")]
    assert len(commands) == 5 and commands[-2].startswith("reshard merge ./demo/"), commands
    for command in commands:
        argv = shlex.split(command)
        assert argv[0] == "reshard" and all(not a.startswith("/") for a in argv), command
        result = CliRunner().invoke(cli, argv[1:])
        assert result.exit_code == 0, (command, result.output)
    assert (tmp_path / "demo" / "merged" / "config.json").is_file()
