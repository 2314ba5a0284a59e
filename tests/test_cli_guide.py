"""What the CLI shows a newcomer: `reshard --help` in flow order with whole one-line summaries, short option help,
the next command after plan / write / merge (and that it works when pasted), the plan's per-rank bars, and
`reshard.write_checkpoint`, the API the messages name, writing what the CLI writes."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

import reshard
from reshard.cli import ReshardGroup, cli
from reshard.plan._report import BAR_WIDTH, MAX_BAR_GROUPS, expert_bars

FLOW = ["plan", "write", "verify", "files", "merge", "demo", "env"]


def run(*args, expect: int = 0):
    result = CliRunner().invoke(cli, [str(a) for a in args], terminal_width=80)  # help wraps as on an 80-col terminal
    assert result.exit_code == expect, (result.exit_code, result.output, result.exception)
    return result


def _commands_section(text: str) -> list[str]:
    return text.split("\nCommands:\n", 1)[1].splitlines()


# ---- reshard --help ---------------------------------------------------------------------------------------------

def test_help_lists_the_commands_in_flow_order():
    lines = _commands_section(run("--help").stdout)
    names = [line.split()[0] for line in lines if line.startswith("  ") and not line.startswith("   ")]
    assert names == FLOW
    assert ReshardGroup.FLOW == tuple(FLOW)


def test_every_command_summary_is_one_whole_line():
    lines = _commands_section(run("--help").stdout)
    ctx = click.Context(cli)
    for name in cli.list_commands(ctx):
        short = cli.get_command(ctx, name).short_help
        assert short and not short.endswith("..."), name
        assert re.search(rf"^  {name} +{re.escape(short)}$", "\n".join(lines), re.M), (name, lines)
    assert not any(line.rstrip().endswith("...") for line in lines)


def test_first_line_and_typical_flow_say_what_the_tool_does():
    text = run("--help").stdout
    first = text.split("\n\n", 2)[1].strip()
    assert "\n" not in first and all(verb in first.lower() for verb in ("plan", "write", "verify", "merge"))
    assert not first.startswith("Load")  # no command loads: the loader is Python (reshard.from_pretrained)
    flow = text.split("Typical flow:", 1)[1]
    for step in ("reshard demo", "reshard plan", "reshard write", "reshard verify", "from_pretrained",
                 "reshard merge"):
        assert step in flow, step


def _option_entries(name: str) -> list[list[str]]:
    """The `--help` option entries of one command at an 80-column terminal, each as its lines."""
    command = cli.get_command(click.Context(cli), name)
    ctx = click.Context(command, info_name=name, terminal_width=80, max_content_width=80)
    formatter = ctx.make_formatter()
    command.format_options(ctx, formatter)
    entries: list[list[str]] = []
    for line in formatter.getvalue().splitlines()[1:]:  # past "Options:"
        if re.match(r"^  -", line):
            entries.append([line])
        elif entries:
            entries[-1].append(line)
    return entries


@pytest.mark.parametrize("name", FLOW)
def test_every_option_help_is_at_most_three_lines(name):
    entries = _option_entries(name)
    assert entries
    for entry in entries:
        # a flag too long for the first column puts its help on the lines below it: those count, the flag does not
        help_lines = entry[1:] if len(entry[0].strip().split("  ")) == 1 else entry
        assert len(help_lines) <= 3, "\n".join(entry)


def test_metavars_name_what_to_pass():
    assert "--against SRC" in run("verify", "--help").stdout
    assert "--revision REV" in run("plan", "--help").stdout
    assert "Usage: cli write [OPTIONS] SRC OUT" in run("write", "--help").stdout
    assert "--keep DIR" in run("demo", "--help").stdout
    for name in FLOW:
        assert " TEXT " not in run(name, "--help").stdout, name


# ---- next steps -------------------------------------------------------------------------------------------------

def _next(output: str) -> list[str]:
    return [line.strip() for line in output.split("\nnext:", 1)[1].splitlines() if line.strip()]


def test_plan_prints_the_write_command_for_its_mesh_and_the_command_writes_that_mesh(tiny, tmp_path):
    src = tiny("glm4_moe")
    out = run("plan", src, "--fsdp", "8", "--ep", "2", "--layout", "stock").stdout
    (line,) = _next(out)
    assert line == f"reshard write {shlex.quote(str(src))} OUT --fsdp 8 --ep 2 --layout stock"
    words = shlex.split(line)
    words[words.index("OUT")] = str(tmp_path / "o")
    run(*words[1:], "-q")
    manifest = json.loads((tmp_path / "o" / "reshard.json").read_text())
    assert manifest["mesh"] == {"fsdp": 8, "ep": 2, "dp_replicate": 1, "tp": 1, "pp": 1}
    assert manifest["layout"] == "stock"
    # the default layout and mesh flags at 1 are left out; --json is unchanged: one document, no next step
    assert _next(run("plan", src, "--fsdp", "4", "--dp-replicate", "2").stdout) == [
        f"reshard write {shlex.quote(str(src))} OUT --fsdp 4 --dp-replicate 2"]
    doc = json.loads(run("plan", src, "--fsdp", "4", "--json").stdout)
    assert doc["reshard_plan_version"] == 1 and "next" not in doc


def test_write_then_merge_print_verify_lines_that_pass(tiny, tmp_path):
    src, out, merged = tiny("qwen3_moe"), tmp_path / "out", tmp_path / "merged"
    verify, load = _next(run("write", src, out, "--fsdp", "4", "-q").stdout)
    assert verify == f"reshard verify {shlex.quote(str(out))} --against {shlex.quote(str(src))}"
    assert load == f"load: reshard.from_pretrained({str(out)!r}) on every rank of the job " \
                   "(DistributedConfig(fsdp_size=4))"
    assert run(*shlex.split(verify)[1:], "-q").stdout.startswith(f"OK {out}:")

    verify_merged, _ = _next(run("merge", out, merged, "-q").stdout)
    assert verify_merged == f"reshard verify {shlex.quote(str(merged))} --against {shlex.quote(str(out))}"
    assert run(*shlex.split(verify_merged)[1:], "-q").stdout.startswith(f"OK {merged}:")

    # from mesh to mesh: a reshard folder is no --against source, so the line verifies the output alone
    again = tmp_path / "again"
    verify_again, _ = _next(run("write", out, again, "--fsdp", "2", "-q").stdout)
    assert verify_again == f"reshard verify {shlex.quote(str(again))}"
    assert run(*shlex.split(verify_again)[1:], "-q").exit_code == 0


# ---- the plan's bars --------------------------------------------------------------------------------------------

def _bar_rows(lines: list[str]) -> dict[str, tuple[str, str]]:
    """label -> (stock bar, planned bar), each the text between its word and its figure."""
    rows = {}
    for line in lines[1:]:
        m = re.match(r"^  (.+?)  stock (.{%d}) .+?   planned (.{%d}) " % (BAR_WIDTH, BAR_WIDTH), line)
        if m:
            rows[m[1].strip()] = (m[2].strip(), m[3].strip())
    return rows


def test_bars_group_equal_ranks_of_a_64_rank_mesh_and_mark_the_empty_ones():
    gib = 2**30
    # GLM-4.6 at fsdp 64, ep 8: 3 experts per stock rank on efsdp 0-5, 2 on 6, none on 7; planned 2.5 each
    stock = [12 * gib] * 48 + [8 * gib] * 8 + [0] * 8
    planned = [10 * gib] * 64
    lines = expert_bars(stock, planned)
    rows = _bar_rows(lines)
    assert list(rows) == ["48 ranks 0-47", "8 ranks 48-55", "8 ranks 56-63"]
    assert rows["48 ranks 0-47"] == ("#" * BAR_WIDTH, "#" * round(BAR_WIDTH * 10 / 12))
    assert rows["8 ranks 48-55"] == ("#" * round(BAR_WIDTH * 8 / 12), "#" * round(BAR_WIDTH * 10 / 12))
    assert rows["8 ranks 56-63"] == ("EMPTY", "#" * round(BAR_WIDTH * 10 / 12))
    assert sum("EMPTY" in line for line in lines) == 1 and "12.00 GiB" in lines[0]


def test_bars_group_equal_ranks_that_are_not_neighbours_and_cap_the_lines():
    rows = _bar_rows(expert_bars([2, 0, 2, 0, 1], [1, 1, 1, 1, 1]))
    assert rows == {"2 ranks 0,2": ("#" * BAR_WIDTH, "#" * (BAR_WIDTH // 2)),
                    "2 ranks 1,3": ("EMPTY", "#" * (BAR_WIDTH // 2)),
                    "rank 4": ("#" * (BAR_WIDTH // 2), "#" * (BAR_WIDTH // 2))}
    many = expert_bars(list(range(1, 41)), [20] * 40)  # 40 different ranks: the first groups, then a count
    assert len(many) == 1 + MAX_BAR_GROUPS + 1 and many[-1].strip() == "... 28 more ranks in 28 more groups"


def test_plan_shows_the_bars_of_a_64_rank_mesh_in_a_few_lines(tiny):
    out = run("plan", tiny("glm4_moe"), "--fsdp", "64", "--ep", "2").stdout
    bars = out.split("expert bytes per rank, stock vs planned", 1)[1].split("\n\n", 1)[0].splitlines()
    assert 2 <= len(bars) <= 1 + MAX_BAR_GROUPS and any("EMPTY" in line for line in bars)
    assert sum(int(m) if m else 1 for m in re.findall(r"^  (?:(\d+) ranks|rank) ", "\n".join(bars), re.M)) == 64


# ---- reshard.write_checkpoint -----------------------------------------------------------------------------------

def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_write_checkpoint_writes_the_bytes_the_cli_writes(tiny, tmp_path):
    src = tiny("qwen3_moe")
    run("write", src, tmp_path / "cli", "--fsdp", "4", "--ep", "2", "--max-shard-size", "40KB", "-q")
    result = reshard.write_checkpoint(src, tmp_path / "api", reshard.MeshSpec(fsdp=4, ep=2),
                                      max_shard_size=40_000, progress=False)
    cli_files, api_files = _files(tmp_path / "cli"), _files(tmp_path / "api")
    assert len([n for n in cli_files if n.endswith(".safetensors")]) > 4  # split: the option reached the writer
    assert sorted(cli_files) == sorted(api_files) and cli_files == api_files
    assert result.manifest.to_json().encode() == api_files["reshard.json"]


def test_write_checkpoint_refuses_workers_in_a_distributed_write(tiny, tmp_path):
    with pytest.raises(reshard.ReshardError, match="--workers 2 is for a write on one machine"):
        reshard.write_checkpoint(tiny("qwen3_moe"), tmp_path / "o", reshard.MeshSpec(fsdp=2), workers=2,
                                 distributed=True)
    assert not (tmp_path / "o").exists()
