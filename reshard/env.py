"""`reshard env`: the facts a bug report needs, as `transformers env` and `hf env` give them.

Versions come from the installed distributions (`importlib.metadata`), which is also what pip resolves against: a
CUDA build of torch reports `2.14.1+cu130` as `torch.__version__` but is installed as `2.14.1`.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import sys

from .words import plural

# The torch releases the suite has run against on the CPU (docs/compatibility.md): CPU and CUDA builds alike.
_TESTED_TORCH = ((2, 13), (2, 14), (2, 15))
_LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_DISTRIBUTIONS = ("reshard", "torch", "transformers", "safetensors", "huggingface-hub", "accelerate", "click",
                 "tqdm", "numpy")


def _distribution_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _torch_facts() -> dict:
    try:
        import torch
    except ImportError as e:
        return {"error": str(e)}
    cuda = torch.cuda.is_available()
    return {"version": torch.__version__, "cuda_build": torch.version.cuda, "cuda_available": cuda,
            "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else [],
            "distributed": torch.distributed.is_available(),
            "nccl": torch.distributed.is_available() and torch.distributed.is_nccl_available()}


def _hook_facts() -> list[dict] | dict:
    from .load import check_hooks

    try:
        return [{"name": s.hook.qualified, "use": s.hook.use, "ok": s.ok, "problem": s.problem}
                for s in check_hooks()]
    except ImportError as e:
        return {"error": f"transformers cannot be imported ({e})"}


def _quick_facts() -> dict:
    """What needs no import of torch or transformers: versions, the tested matrix, the launcher variables."""
    from .load import TESTED_RANGE, in_tested_range, minor_of

    versions = {name: _distribution_version(name) for name in _DISTRIBUTIONS}
    torch_tested = minor_of(versions["torch"]) in _TESTED_TORCH
    transformers_tested = versions["transformers"] is not None and in_tested_range(versions["transformers"])
    return {
        "reshard_env_version": 1,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "versions": versions,
        "tested": {"torch": torch_tested, "transformers": transformers_tested,
                   "torch_range": ", ".join(f"{a}.{b}" for a, b in _TESTED_TORCH), "transformers_range": TESTED_RANGE},
        "launcher": {name: os.environ.get(name) for name in _LAUNCHER_VARIABLES},
    }


def environment_report() -> dict:
    """Everything `reshard env` prints, as one JSON-ready document."""
    hooks = _hook_facts()
    return {**_quick_facts(), "torch": _torch_facts(), "hooks": hooks,
            "hooks_ok": isinstance(hooks, list) and all(h["ok"] for h in hooks)}


def report_lines(waiting=None):
    """The report's lines, each as soon as it is known: the versions at once, then what takes importing torch and
    transformers (seconds: the hooks are checked in transformers' own modules). `waiting()`, when given, is called
    between the two, so that a terminal can say what it waits for."""
    yield from _quick_lines(_quick_facts())
    if waiting is not None:
        waiting()
    yield _torch_line(_torch_facts())
    yield from _hook_lines(_hook_facts())


def format_report(report: dict) -> str:
    """The report as the lines a user pastes into an issue."""
    return "\n".join([*_quick_lines(report), _torch_line(report["torch"]), *_hook_lines(report["hooks"])])


def _quick_lines(report: dict) -> list[str]:
    v, tested = report["versions"], report["tested"]
    lines = [f"- reshard: {v['reshard']}", f"- Python: {report['python']} ({report['platform']})"]
    lines += [f"- {name}: {v[name] or 'not installed'}" for name in _DISTRIBUTIONS[1:]]
    inside = "inside" if tested["torch"] and tested["transformers"] else "OUTSIDE"
    lines.append(f"- tested matrix: {inside} (torch {tested['torch_range']}: {'yes' if tested['torch'] else 'no'}; "
                 f"{tested['transformers_range']}: {'yes' if tested['transformers'] else 'no'})")
    seen = {k: val for k, val in report["launcher"].items() if val is not None}
    lines.append("- launcher variables: " + (", ".join(f"{k}={val}" for k, val in seen.items()) or "none set"))
    return lines


def _torch_line(t: dict) -> str:
    if "error" in t:
        return f"- torch build: cannot be imported ({t['error']})"
    cuda = "no CUDA build" if not t.get("cuda_build") else (
        f"CUDA {t['cuda_build']}, {plural(len(t['devices']), 'device')} visible"
        + (f": {', '.join(t['devices'])}" if t["devices"] else ""))
    return f"- torch build: torch.__version__ {t.get('version')}; {cuda}; NCCL {'yes' if t.get('nccl') else 'no'}"


def _hook_lines(hooks) -> list[str]:
    if isinstance(hooks, dict):
        return [f"- loader-patch hooks: unknown, {hooks['error']}"]
    broken = [h for h in hooks if not h["ok"]]
    return [f"- loader-patch hooks: {len(hooks) - len(broken)} of {len(hooks)} present and as expected",
            *(f"    {h['name']} ({h['use']}): {h['problem']}" for h in broken)]
