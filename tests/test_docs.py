"""Docs parity: every command and option is in README.md, the set-up is two commands that CI runs, the API is
documented."""

from __future__ import annotations

import re
from pathlib import Path

import click
import pytest

import reshard
from reshard.cli import cli

ROOT = Path(__file__).parent.parent
README = (ROOT / "README.md").read_text()


def _commands():
    ctx = click.Context(cli)
    return {name: cli.get_command(ctx, name) for name in cli.list_commands(ctx)}


@pytest.mark.parametrize("name", sorted(_commands()))
def test_every_command_has_help_and_a_readme_section(name):
    command = _commands()[name]
    assert command.help and len(command.help) > 80
    assert f"### `reshard {name}" in README


@pytest.mark.parametrize("name, option", sorted(
    (name, opt) for name, command in _commands().items() for param in command.params
    if isinstance(param, click.Option) for opt in param.opts if opt.startswith("--")))
def test_every_option_is_in_the_readme(name, option):
    assert f"`{option}" in README or f"{option} " in README, f"reshard {name} {option} is not documented"


def test_global_options_are_in_the_readme():
    for param in cli.params:
        for opt in param.opts:
            if opt.startswith("--"):
                assert opt in README


def test_setup_is_two_commands_and_ci_runs_them():
    block = re.search(r"## Set-up: two commands.*?```bash\n(.*?)```", README, re.S).group(1)
    commands = [line for line in block.splitlines() if line.strip()]
    assert len(commands) == 2
    assert commands[0].endswith("reshard demo") and "pytest" in commands[1]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "torch==2.13.0" in ci and '-e ".[test]"' in ci
    assert "\nreshard demo\n" in ci
    assert "python3 -m pytest -q" in ci and '"$status" -eq 5' in ci


@pytest.mark.parametrize("name", reshard.__all__)
def test_every_public_name_has_a_docstring(name):
    obj = getattr(reshard, name)
    assert (obj.__doc__ or "").strip(), name


def test_every_troubleshooting_message_is_one_the_code_can_print():
    """Each message quoted in the troubleshooting table appears (as a fragment) in the package source."""
    source = "\n".join(p.read_text() for p in sorted((ROOT / "reshard").rglob("*.py")))
    source = re.sub(r'"\s*\n\s*(?:f|rf|fr)?"', "", source)  # join string literals split over lines
    table = README.split("## Troubleshooting", 1)[1].split("\n## ", 1)[0]
    fragments = re.findall(r"^\| `([^`]+)`", table, re.M)
    assert len(fragments) >= 15
    for fragment in fragments:
        # keep the literal words between the placeholders the table uses (N, M, 'x', ...)
        words = [w for w in re.split(r"<[^>]*>|\([a-z0-9]+\)|\.\.\.|\bN\b|\bM\b|\bOUT\b|'[^']*'|\{[^}]*\}|\(\d+\)|\d+", fragment) if len(w.strip()) > 6]
        assert words, fragment
        for word in words:
            assert word.strip() in source, f"{word.strip()!r} (from {fragment!r}) is not in the code"


def _section(title: str) -> str:
    return README.split(f"### `{title}", 1)[1].split("\n### ", 1)[0]


def test_readme_says_what_verify_against_proves():
    """verify --against proves the copying, not the key mapping; the README says so and names the independent test,
    which really compares with transformers' own load."""
    text = " ".join(_section("reshard verify").split())
    assert "What `--against` proves is the copying, not the key mapping" in text
    assert "a mapping mistake would be copied faithfully and pass" in text
    assert "`tests/test_write.py`" in text and "transformers' own `from_pretrained`" in text
    test_write = (ROOT / "tests" / "test_write.py").read_text()
    assert "AutoModelForCausalLM.from_pretrained(src)" in test_write and "def check_independently" in test_write
    assert "not the mapping itself" in " ".join(_commands()["verify"].help.split())


def test_readme_exit_codes_name_every_code_the_cli_uses():
    """The codes themselves are tested in tests/test_cli_misc.py and tests/test_write_faults.py."""
    sentence = " ".join(re.search(r"Exit codes: (.*?)\n\n", README, re.S).group(1).split())
    for part in ("0 success", "1 the operation failed", "2 a bad call", "impossible mesh",
                 "the model does (an `--ep` that does not divide its expert count", "130 interrupted by Ctrl-C",
                 "143 by SIGTERM"):
        assert part in sentence, part


@pytest.mark.parametrize("command, fields", [
    ("write", ["out", "files", "bytes", "tensors", "dequantized_tensors", "empty_markers", "layout", "mesh",
               "distributed_config"]),
    ("verify", ["ok", "folder", "against", "files", "tensors", "empty_markers", "bytes_compared",
                "dequantized_tensors", "problems"]),
])
def test_json_documents_are_described(command, fields):
    text = _section(f"reshard {command}")
    assert "[--json]" in text.splitlines()[0]
    described = text.split("`--json`", 1)[1].split("\n- ", 1)[0].split("\n\n", 1)[0]
    assert re.findall(r"`(\w+)`", described) == fields
