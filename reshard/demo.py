"""`reshard demo`: the whole job on a tiny generated checkpoint whose stock layout leaves ranks empty."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from .errors import ReshardError
from .words import plural


def run_demo(*, ranks: int = 4, keep: str | os.PathLike | None = None, echo=print, timeout: float = 300):
    """Generate a tiny MoE checkpoint, plan it, write it, load it on `ranks` gloo processes, verify it.

    Args:
        ranks: processes of the CPU load (the mesh is `--fsdp ranks`).
        keep: keep the checkpoint and the output in this folder (default: a temporary folder, removed at the end,
            which the last line says, with how to keep it).
        echo: where the progress lines go.
        timeout: seconds before the multi-rank load counts as hung.

    Returns:
        A `reshard.results.DemoResult`: each rank's report, the folder, whether it was kept, the report lines.

    Raises:
        ReshardError: any step failed (the message says which and why).
    """
    from .results import DemoResult

    if ranks < 2:
        raise ReshardError("--ranks must be at least 2 for a multi-rank load.")
    started = time.monotonic()
    root = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="reshard-demo-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        plan, manifest, per_rank = _steps(root, ranks, echo, timeout)
        lines = _report(plan, manifest, per_rank, ranks, time.monotonic() - started)
        lines += _next_lines(root, ranks, keep)
        return DemoResult(str(root), bool(keep), per_rank, tuple(lines))
    finally:
        if not keep:
            shutil.rmtree(root, ignore_errors=True)


def _steps(root: Path, ranks: int, echo, timeout: float):
    """The demo's five steps in `root`, each announced: (the plan, the manifest written, each rank's report)."""
    from .api import plan_checkpoint, verify, write_checkpoint
    from .plan import MeshSpec
    from .tiny import make_tiny_checkpoint

    src, out, reports = root / "tiny-qwen3-moe", root / f"tiny-qwen3-moe-fsdp{ranks}", root / "reports"
    experts, mesh = max(1, ranks // 2), MeshSpec(fsdp=ranks)
    echo(f"1/5 generating a tiny Qwen3-MoE checkpoint ({experts} experts, 2 layers) in {_shown(src)}")
    if not src.exists():
        make_tiny_checkpoint("qwen3_moe", src, experts=experts)
    echo(f"\n2/5 reshard plan {_shown(src)} --fsdp {ranks}\n")
    planned = plan_checkpoint(_where(src), mesh)
    echo(planned.summary().rsplit("\n\nnext:", 1)[0])
    echo(f"\n3/5 reshard write {_shown(src)} {_shown(out)} --fsdp {ranks} --overwrite")
    written = write_checkpoint(src, out, mesh, overwrite=True, progress=False)
    markers = plural(written.manifest.empty_markers, "explicit empty marker")
    echo(f"    {plural(len(written.manifest.files), 'file')}, {markers} (one per empty tensor in each rank's file)")
    echo(f"\n4/5 loading on {ranks} CPU processes (gloo) with reshard.from_pretrained")
    shutil.rmtree(reports, ignore_errors=True)
    reports.mkdir()
    _launch(ranks, out, src, reports, timeout, echo)
    per_rank = tuple(json.loads((reports / f"rank{r}.json").read_text()) for r in range(ranks))
    echo(f"\n5/5 reshard verify {_shown(out)} --against {_shown(src)}")
    checked = verify(out, against=src)
    echo(f"    OK: {checked.tensors} model tensors covered exactly once, {checked.bytes_compared} bytes of tensor "
         "data equal to the source")
    return planned.plan, written.manifest, per_rank


def _where(path: Path) -> str:
    """`path` as a command pasted where the user stands takes it: `./`-relative inside the working folder (a kept
    `./demo`), else absolute (the temporary folder)."""
    absolute = Path(path).resolve()
    try:
        return f"./{absolute.relative_to(Path.cwd().resolve())}"
    except ValueError:
        return str(absolute)


def _shown(path: Path) -> str:
    """`_where(path)`, quoted for a shell."""
    return shlex.quote(_where(path))


def _next_lines(root: Path, ranks: int, keep) -> list[str]:
    """The demo's last lines: where its folders are, and the README's next commands, runnable from here."""
    out = root / f"tiny-qwen3-moe-fsdp{ranks}"
    if not keep:
        return [f"  the generated checkpoint and its output were in {_shown(root)} and are removed now; to keep them "
                "and try the next commands on them: reshard demo --keep ./demo"]
    merged = root / "merged"
    return [f"  the checkpoint, the output and the rank reports are in {_shown(root)}", "next:",
            f"  reshard merge {_shown(out)} {_shown(merged)} --overwrite && reshard verify {_shown(merged)}"]


def _launch(ranks: int, out: Path, src: Path, reports: Path, timeout: float, echo) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
           "--monitor-interval=0.5", "-m", "reshard._demo_rank", _where(out), str(src), str(reports)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error", "PYTHONUNBUFFERED": "1"}
    with subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env) as proc:
        kept: list[str] = []
        reader = threading.Thread(target=_pass_progress, args=(proc.stderr, kept, echo), daemon=True)
        reader.start()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired as e:
            proc.kill()
            reader.join(5)
            raise ReshardError(f"the {ranks}-rank load did not finish in {timeout:.0f} s: a hang. Output:\n"
                               f"{''.join(kept)[-2000:]}") from e
        reader.join(30)
    stderr = "".join(kept)
    errors = []
    for r in range(ranks):
        path = reports / f"rank{r}.json"
        report = json.loads(path.read_text()) if path.exists() else {"error": "no report"}
        if report.get("error") or report.get("mismatched") or report.get("uninitialized"):
            errors.append(f"rank {r}: {report.get('error') or report}")
        elif not report.get("bytes"):
            errors.append(f"rank {r}: no tensor data read was counted (the demo's read counter missed the loader)")
    if proc.returncode != 0 or errors:
        raise ReshardError("the multi-rank load failed:\n" + "\n".join(errors) + "\n" + stderr[-2000:])


def _pass_progress(stream, kept: list[str], echo) -> None:
    """Echo the load's phase lines (rank 0's `reshard load ...`, `reshard demo: ...`) as they come; keep every line
    for an error message."""
    for line in stream:
        kept.append(line)
        if line.startswith(("reshard load ", "reshard demo: ")):
            echo("    " + line.rstrip("\n"))


def _report(plan, manifest, per_rank, ranks, elapsed) -> list[str]:
    from .plan import summarize

    _, stats = summarize(plan)
    empty = stats["stock_empty_ranks"]
    lines = ["", "report"]
    if empty:
        lines.append(f"  stock transformers on this mesh: {'rank' if len(empty) == 1 else 'ranks'} "
                     f"{', '.join(map(str, empty))} get no expert rows; loading the original checkpoint there fails "
                     "in weight conversion (torch.stack of nothing) on CPU, and on CUDA the empty ranks run weight "
                     "init alone and hang in DTensor's RNG broadcast.")
    else:
        lines.append("  stock transformers on this mesh: no empty ranks.")
    for report in per_rank:
        shapes = sorted({tuple(s) for s in report["experts"].values()})
        lines.append(f"  rank {report['rank']}: read {report['bytes']:>7} bytes of tensor data from "
                     f"{', '.join(report['files']) or '-'}; expert shards of shape "
                     f"{', '.join(str(list(s)) for s in shapes)}; {report['tensors']} model tensors equal to the "
                     "single-process load")
    share = sum(r["bytes"] for r in per_rank) / ranks
    lines.append(f"  the rank files hold {manifest.bytes} bytes (tensor data and headers); the largest rank read "
                 f"{max(r['bytes'] for r in per_rank)} bytes of tensor data, "
                 f"{max(r['bytes'] for r in per_rank) / share:.2f}x an even 1/{ranks} share")
    lines.append(f"  every tensor matched bit for bit on every rank; no empty rank, no hang. ({elapsed:.0f} s)")
    return lines
