"""Docs parity: every command and option is in README.md or docs/, the set-up is two commands whose steps CI runs, the
API is documented, and every `reshard.NAME(` a user is shown exists."""

from __future__ import annotations

import json
import re
from pathlib import Path

import click
import pytest

import reshard
from reshard.cli import cli

ROOT = Path(__file__).parent.parent
README = (ROOT / "README.md").read_text()
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DOCS = "\n".join(p.read_text() for p in DOC_FILES)  # what a user can read: the README and docs/
COMMANDS = (ROOT / "docs" / "commands.md").read_text()
FAULTS = (ROOT / "docs" / "faults.md").read_text()


def _commands():
    ctx = click.Context(cli)
    return {name: cli.get_command(ctx, name) for name in cli.list_commands(ctx)}


@pytest.mark.parametrize("name", sorted(_commands()))
def test_every_command_has_help_and_a_section_in_docs_commands(name):
    command = _commands()[name]
    assert command.help and len(command.help) > 80
    assert f"\n## `reshard {name}" in COMMANDS


@pytest.mark.parametrize("name, option", sorted(
    (name, opt) for name, command in _commands().items() for param in command.params
    if isinstance(param, click.Option) for opt in param.opts if opt.startswith("--")))
def test_every_option_is_documented(name, option):
    assert f"`{option}" in DOCS or f"{option} " in DOCS, f"reshard {name} {option} is not documented"


def test_global_options_are_documented():
    for param in cli.params:
        for opt in param.opts:
            if opt.startswith("--"):
                assert opt in COMMANDS


def test_setup_is_two_commands_and_ci_runs_them():
    block = re.search(r"## Set-up: two commands.*?```bash\n(.*?)```", README, re.S).group(1)
    commands = [line for line in block.splitlines() if line.strip()]
    assert len(commands) == 2
    # 1: what running reshard needs (the CPU torch build, no test extra), then the demo
    assert commands[0].endswith("&& pip install -e . && reshard demo"), commands[0]
    assert "torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in commands[0]
    # 2: the test extra, then the default selection; the slow tests are named for the whole suite
    assert '-e ".[test]"' in commands[1] and commands[1].endswith("python -m pytest -q"), commands[1]
    assert 'addopts = -m "not slow"' in (ROOT / "setup.cfg").read_text()
    assert 'python -m pytest -q -m "slow or not slow"' in README
    ci = (ROOT / ".ci" / "run").read_text()
    assert "torch==2.13.0" in ci and '-e ".[test]"' in ci
    assert "\nreshard demo\n" in ci
    assert "python3 -m pytest -q" in ci and '"$status" -eq 5' in ci
    assert "\nrun_tests\n" in ci and "\nrun_tests -m slow\n" in ci  # the default selection, then the rest


@pytest.mark.parametrize("name", reshard.__all__)
def test_every_public_name_has_a_docstring(name):
    obj = getattr(reshard, name)
    assert (obj.__doc__ or "").strip(), name


def test_every_troubleshooting_message_is_one_the_code_can_print():
    """Each message quoted in the troubleshooting table appears (as a fragment) in the package source."""
    source = "\n".join(p.read_text() for p in sorted((ROOT / "reshard").rglob("*.py")))
    source = re.sub(r'"\s*\n\s*(?:f|rf|fr)?"', "", source)  # join string literals split over lines
    table = FAULTS.split("\n## Troubleshooting", 1)[1].split("\n## ", 1)[0]
    fragments = re.findall(r"^\| `([^`]+)`", table, re.M)
    assert len(fragments) >= 15
    for fragment in fragments:
        # keep the literal words between the placeholders the table uses (N, M, 'x', ...)
        words = [w for w in re.split(r"<[^>]*>|\([a-z0-9]+\)|\.\.\.|\bN\b|\bM\b|\bOUT\b|'[^']*'|\{[^}]*\}|\(\d+\)|\d+", fragment) if len(w.strip()) > 6]
        assert words, fragment
        for word in words:
            assert word.strip() in source, f"{word.strip()!r} (from {fragment!r}) is not in the code"


def _section(title: str) -> str:
    return COMMANDS.split(f"\n## `{title}", 1)[1].split("\n## ", 1)[0]


def test_docs_say_what_verify_against_proves():
    """verify --against proves the copying, not the key mapping; docs/commands.md says so and names the independent test,
    which really compares with transformers' own load."""
    text = " ".join(_section("reshard verify").split())
    assert "What `--against` proves is the copying, not the key mapping" in text
    assert "a mapping mistake would be copied faithfully and pass" in text
    assert "`tests/test_write.py`" in text and "transformers' own `from_pretrained`" in text
    test_write = (ROOT / "tests" / "test_write.py").read_text()
    assert "AutoModelForCausalLM.from_pretrained(src)" in test_write and "def check_independently" in test_write
    assert "not the mapping itself" in " ".join(_commands()["verify"].help.split())


def test_docs_exit_codes_name_every_code_the_cli_uses():
    """The codes themselves are tested in tests/test_cli_misc.py and tests/test_write_faults.py."""
    sentence = " ".join(re.search(r"Exit codes: (.*?)\n\n", COMMANDS, re.S).group(1).split())
    for part in ("0 success", "1 the operation failed", "2 a bad call", "impossible mesh",
                 "the model does (an `--ep` that does not divide its expert count", "130 interrupted by Ctrl-C",
                 "143 by SIGTERM"):
        assert part in sentence, part


@pytest.fixture(scope="module")
def json_documents(tiny, tmp_path_factory) -> dict[str, list[str]]:
    """The fields, in order, that `write`, `verify` and `merge` print with --json, from real runs."""
    from click.testing import CliRunner

    def run(*args):
        result = CliRunner().invoke(cli, [str(a) for a in args])
        assert result.exit_code == 0, result.output
        return list(json.loads(result.stdout))

    src, tmp = tiny("qwen3_moe"), tmp_path_factory.mktemp("json")
    return {"write": run("write", src, tmp / "out", "--fsdp", "2", "-q", "--json"),
            "verify": run("verify", tmp / "out", "--against", src, "-q", "--json"),
            "merge": run("merge", tmp / "out", tmp / "merged", "-q", "--json")}


@pytest.mark.parametrize("command", ["write", "verify", "merge"])
def test_json_documents_are_described(command, json_documents):
    """Every field the command prints, in its order, is named in the `--json` item of its docs/commands.md section."""
    text = _section(f"reshard {command}")
    assert "[--json]" in text.splitlines()[0]
    described = text.split("- `--json`", 1)[1].split("\n- ", 1)[0].split("\n\n", 1)[0]
    # the field names only: `word` right after the list's start, a comma or "document:", not the words inside (...)
    named = re.findall(r"`(\w+)`", re.sub(r"\([^()]*\)", "", described))
    assert named == json_documents[command]


def test_readme_fits_a_few_screens_and_its_links_lead_somewhere():
    """The README stays short (the rest is in docs/), and every relative link of the README and docs/ names a file
    that exists."""
    assert len(README.splitlines()) <= 250
    assert all(len(line) <= 120 for line in README.splitlines())
    for path in DOC_FILES:
        for target in re.findall(r"\]\(([^)#:]+\.md)(?:#[^)]*)?\)", path.read_text()):
            assert (path.parent / target).is_file(), f"{path.relative_to(ROOT)} links to {target}, which is missing"
    linked = set(re.findall(r"\]\(docs/([^)#]+\.md)\)", README))
    assert {p.name for p in DOC_FILES[1:]} <= linked, "a docs/ file the README does not link"

# ---- every `reshard.NAME(` a user is shown exists ---------------------------------------------------------------

_CALL = re.compile(r"(?<![\w.])reshard\.([A-Za-z_]\w*)\(")


def _package_sources() -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text() for p in sorted((ROOT / "reshard").rglob("*.py"))}


def test_the_api_name_scan_finds_the_calls_it_must_check():
    """The scan itself: a call is found in prose, code and messages; a module path or a file name is not."""
    text = "call `reshard.write_checkpoint(..., dequantize='bf16')`; reshard.json; reshard.plan._placement.local_box(x)"
    assert _CALL.findall(text) == ["write_checkpoint"]
    assert _CALL.findall("(reshard.from_pretrained(OUT) and xreshard.nope()") == ["from_pretrained"]


@pytest.mark.parametrize("where", ["README.md and docs/", "the package's messages and docstrings"])
def test_every_reshard_call_shown_to_a_user_exists(where):
    """`reshard.NAME(` in the README, docs/ and every string of the package names an attribute of `reshard`: a
    message that tells the user to call something that is not there (AttributeError) fails here."""
    texts = {str(p.relative_to(ROOT)): p.read_text() for p in DOC_FILES} if where.startswith("README") \
        else _package_sources()
    found = {(path, name) for path, text in texts.items() for name in _CALL.findall(text)}
    assert len({name for _, name in found}) >= (8 if where.startswith("README") else 3)
    missing = sorted((path, name) for path, name in found if not hasattr(reshard, name))
    assert not missing, f"named but not in the reshard package: {missing}"
    assert all(name in reshard.__all__ for _, name in found)
