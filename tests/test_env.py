"""`reshard env`: the versions pip sees, the loader-patch hooks, the tested matrix and the launcher variables."""

from __future__ import annotations

import importlib.metadata
import json

from click.testing import CliRunner

from reshard.cli import cli


def _env(*args, env=None):
    result = CliRunner().invoke(cli, ["env", *args], env=env)
    assert result.exit_code == 0, result.output
    return result.output


def test_env_json_reports_installed_distributions_hooks_and_launcher(monkeypatch):
    from reshard.load._hooks import HOOKS

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    report = json.loads(_env("--json", env={"RANK": "3", "WORLD_SIZE": "8", "MASTER_ADDR": "node-7"}))
    for name in ("torch", "transformers", "safetensors", "huggingface-hub", "accelerate"):
        # the distribution's version (what pip resolves against), not a module's __version__
        assert report["versions"][name] == importlib.metadata.version(name)
    assert report["launcher"]["RANK"] == "3" and report["launcher"]["WORLD_SIZE"] == "8"
    assert report["launcher"]["MASTER_ADDR"] == "node-7" and report["launcher"]["LOCAL_RANK"] is None
    assert [h["name"] for h in report["hooks"]] == [h.qualified for h in HOOKS]
    assert report["hooks_ok"] is True and all(h["ok"] and h["problem"] is None for h in report["hooks"])
    assert report["tested"] == {"torch": True, "transformers": True, "torch_range": "2.13, 2.14, 2.15",
                                "transformers_range": "transformers>=5.23,<5.26"}
    import torch

    assert report["torch"]["version"] == torch.__version__ and report["torch"]["cuda_build"] == torch.version.cuda


def test_env_text_names_a_broken_hook_and_an_untested_version(monkeypatch):
    import transformers
    import transformers.modeling_utils as mu

    from reshard.load._hooks import HOOKS

    monkeypatch.delattr(mu, "get_device")
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda name, real=importlib.metadata.version: "5.31.0" if name == "transformers" else real(name))
    monkeypatch.setattr(transformers, "__version__", "5.31.0")
    text = _env()
    assert "- transformers: 5.31.0" in text
    assert "- tested matrix: OUTSIDE" in text and "transformers>=5.23,<5.26: no" in text
    assert f"- loader-patch hooks: {len(HOOKS) - 1} of {len(HOOKS)} present and as expected" in text
    assert "    transformers.modeling_utils.get_device (called): it is missing" in text


def test_env_prints_the_versions_before_importing_torch_and_transformers():
    """The text report's first lines need no import of torch or transformers (seconds): they come at once, and the
    torch build and the hooks follow."""
    import subprocess
    import sys

    probe = ("import sys; from reshard.env import report_lines; lines = report_lines(); "
             "first = [next(lines) for _ in range(12)]; print(first[-1]); "
             "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules)); "
             "print(next(lines)); print('torch' in sys.modules); print(next(lines))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120).stdout
    lines = out.splitlines()
    assert lines[0] == "- launcher variables: none set" or lines[0].startswith("- launcher variables: ")
    assert lines[1] == "[]", out  # twelve lines printed, nothing heavy imported
    assert lines[2].startswith("- torch build: torch.__version__ ") and lines[3] == "True", out
    assert lines[4].startswith("- loader-patch hooks: "), out


def test_a_terminal_is_told_what_env_waits_for_and_a_pipe_gets_the_lines_alone(monkeypatch):
    """Between the versions and the torch build a terminal sees one note on stderr, erased once the next line comes;
    the report itself (stdout) is the same either way."""
    import reshard.cli

    calls = []

    def quick_then_slow(waiting=None):
        yield "- reshard: 9"
        if waiting is not None:
            waiting()
        calls.append("slow")
        yield "- torch build: torch.__version__ 9"

    monkeypatch.setattr("reshard.api.environment_lines", quick_then_slow)
    for terminal in (True, False):
        monkeypatch.setattr(reshard.cli, "_stderr_is_terminal", lambda: terminal)
        result = CliRunner().invoke(cli, ["env"])
        assert result.exit_code == 0, result.output
        assert result.stdout == "- reshard: 9\n- torch build: torch.__version__ 9\n", result.stdout
        note = "importing torch and transformers"
        if terminal:
            assert result.stderr.startswith(note) and result.stderr.endswith("\r"), repr(result.stderr)
            assert result.stderr.count("\r") == 2  # written, then blanked out
        else:
            assert result.stderr == ""
