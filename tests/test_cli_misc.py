"""The CLI around `write` and `verify`: exit codes (an impossible mesh exits 2, SIGTERM 143), `--json`, the verify
progress bar, and verify's check of replicated tensors (a whole copy in every coordinate, or coordinate 0 alone)."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import textwrap
import time
import zlib
from pathlib import Path

import pytest
from click.testing import CliRunner
from safetensors import safe_open

from reshard.api import verify, write_checkpoint
from reshard.cli import cli
from reshard.errors import MeshError, VerifyError
from reshard.manifest import dcp_metadata
from reshard.plan import MeshSpec
from reshard.read._safetensors_header import read_header

from conftest import file_chunks

REPO = Path(__file__).resolve().parents[1]
MESH = MeshSpec(fsdp=4)
ITEMSIZE = {"F32": 4, "BF16": 2, "F16": 2}


def run(*args, expect: int):
    result = CliRunner().invoke(cli, [str(a) for a in args], prog_name="reshard")
    assert result.exit_code == expect, (result.exit_code, result.output, result.exception)
    return result


@pytest.fixture
def glm(tiny, tmp_path) -> tuple[Path, Path]:
    """A GLM-like source (10 experts, an `e_score_correction_bias` buffer) written for --fsdp 4."""
    src = tiny("glm4_moe")
    out = tmp_path / "out"
    write_checkpoint(src, out, MESH, progress=False)
    return src, out


def chunk_bytes(manifest: dict) -> int:
    """Bytes of every chunk in every file, each copy of a replicated tensor included."""
    return sum(math.prod(c.shape) * ITEMSIZE[manifest["tensors"][c.name]["dtype"]]
               for entry in manifest["files"] for c in file_chunks(manifest, entry))


# ---- exit codes ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("command", ["plan", "write"])
def test_a_mesh_the_model_cannot_take_exits_2(tiny, tmp_path, command):
    """Found only once the model is known (10 experts, ep 3), it is still an impossible mesh: a bad call."""
    out = [tmp_path / "out"] if command == "write" else []
    result = run(command, tiny("glm4_moe"), *out, "--fsdp", "6", "--ep", "3", expect=2)
    usage, error = result.stderr.split("\nError: ")
    assert "num_experts (10) is not divisible by ep (3)" in error
    assert "Traceback" not in result.output and result.stdout == ""
    assert not (tmp_path / "out").exists()
    # printed as click prints a usage error of its own (here: a mesh the flags alone rule out)
    flags_only = run(command, tiny("glm4_moe"), *out, "--fsdp", "8", "--ep", "3", expect=2)
    assert flags_only.stderr.split("\nError: ")[0] == usage
    assert usage.startswith(f"Usage: reshard {command} [OPTIONS] SRC")


def test_every_mesh_error_exits_2(tmp_path, monkeypatch):
    def no_experts(*args, **kwargs):
        raise MeshError("--ep 2: toy_moe has no expert-parallel tensors; use --ep 1.")

    monkeypatch.setattr("reshard.api.plan_checkpoint", no_experts)
    result = run("plan", tmp_path, "--fsdp", "4", "--ep", "2", expect=2)
    assert result.stderr.startswith("Usage: reshard plan [OPTIONS] SRC\n")
    assert result.stderr.endswith("\nError: --ep 2: toy_moe has no expert-parallel tensors; use --ep 1.\n")


def test_a_bad_mesh_in_a_written_manifest_is_a_verify_failure_not_a_bad_call(glm):
    _, out = glm
    path = out / "reshard.json"
    manifest = json.loads(path.read_text())
    manifest["mesh"]["ep"] = 3  # does not divide fsdp 4
    path.write_text(json.dumps(manifest))
    result = run("verify", out, expect=1)
    fails = [line for line in result.stderr.splitlines() if line.startswith("FAIL ")]
    assert len(fails) == 1 and "reshard.json" in fails[0] and "is not divisible by ep (3)" in fails[0]
    assert "Usage:" not in result.stderr


SLOW_VERIFY = textwrap.dedent("""
    import runpy, signal, sys, time
    from pathlib import Path
    sys.path.insert(0, {repo!r})
    # a shell may start background jobs with SIGINT ignored; a terminal's Ctrl-C raises KeyboardInterrupt
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import reshard.read as read
    import reshard.read._checkpoint as checkpoint
    started = Path({marker!r})
    stock_header_of = checkpoint.header_of

    def slow_header_of(*args, **kwargs):  # verify reads each file's header after its CRC pass
        if not started.exists():
            started.write_text("verifying")
            time.sleep(120)  # the test signals it long before
        return stock_header_of(*args, **kwargs)

    checkpoint.header_of = read.header_of = slow_header_of  # verification takes it from the package
    sys.argv = ["reshard", "verify", {out!r}]  # stderr is a pipe: no progress bar
    runpy.run_module("reshard", run_name="__main__", alter_sys=True)  # what `python -m reshard` runs
""")


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"])
def test_interrupted_verify_exits_128_plus_the_signal(glm, tmp_path, sig, code):
    _, out = glm
    marker = tmp_path / "verifying"
    before = snapshot(tmp_path)
    script = SLOW_VERIFY.format(repo=str(REPO), marker=str(marker), out=str(out))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "verify did not reach its first header in time"
            time.sleep(0.05)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == code, err
    assert f"interrupted ({sig.name})" in err and "Traceback" not in err
    marker.unlink()
    assert snapshot(tmp_path) == before  # verify only reads: nothing added, nothing changed


# ---- --json ----------------------------------------------------------------------------------------------------

def test_write_json(tiny, tmp_path):
    src, out = tiny("qwen3_moe", experts=2), tmp_path / "out"
    doc = json.loads(run("write", src, out, "--fsdp", "4", "--layout", "stock", "-q", "--json", expect=0).stdout)
    manifest = json.loads((out / "reshard.json").read_text())
    assert doc == {"out": str(out), "files": 4, "bytes": sum(f["bytes"] for f in manifest["files"]),
                   "tensors": len(manifest["tensors"]), "dequantized_tensors": 0, "empty_markers": 12, "layout": "stock",
                   "source_crc32_checked": False,  # a Hugging Face checkpoint records no CRC-32 to check against
                   "extras": 0,  # tensors the model does not load, kept in extra-*.safetensors (issue 23)
                   "mesh": {"fsdp": 4, "ep": 1, "dp_replicate": 1, "tp": 1, "pp": 1},
                   "distributed_config": {"fsdp_size": 4}}
    assert [c["empty_markers"] for c in manifest["coords"]] == [0, 0, 6, 6]  # 6 tensors empty on 2 and 3


def test_verify_json_passes_and_fails(glm):
    src, out = glm
    doc = json.loads(run("verify", out, "--against", src, "--json", expect=0).stdout)
    manifest = json.loads((out / "reshard.json").read_text())
    assert doc == {"ok": True, "folder": str(out), "against": str(src), "files": len(manifest["files"]),
                   "tensors": len(manifest["tensors"]), "empty_markers": 0, "bytes_compared": chunk_bytes(manifest),
                   "dequantized_tensors": [], "problems": [], "write_id": manifest["write_id"]}
    shard = out / manifest["files"][1]["name"]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    result = run("verify", out, "--json", expect=1)
    doc = json.loads(result.stdout)  # still one JSON document on stdout
    assert doc["ok"] is False and doc["bytes_compared"] == 0
    assert doc["problems"] == [f"{shard.name}: CRC-32 differs from the manifest (the file is corrupt)"]
    assert f"FAIL {doc['problems'][0]}" in result.stderr and "1 problem." in result.stderr


# ---- the verify progress bar -----------------------------------------------------------------------------------

@pytest.fixture
def bars(monkeypatch):
    """Every tqdm bar created from now on, with the keyword arguments it was made with."""
    import tqdm.auto

    made = []

    class Recorded(tqdm.auto.tqdm):
        def __init__(self, *args, **kwargs):
            self.made_with = kwargs
            made.append(self)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(tqdm.auto, "tqdm", Recorded)
    return made


def test_verify_shows_a_byte_bar_over_the_crc_pass_and_the_comparison(glm, bars, capsys):
    from reshard.api import verify_folder

    src, out = glm
    summary = verify_folder(out, against=src, progress=True)
    assert summary.ok and len(bars) == 1
    bar = bars[0]
    file_bytes = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    assert bar.made_with["unit"] == "B" and bar.made_with["unit_scale"]
    assert bar.n == bar.total == file_bytes + summary.bytes_compared
    assert summary.bytes_compared > 0
    assert "reshard verify" in capsys.readouterr().err


@pytest.mark.parametrize("flags, disable", [([], None), (["-q"], True), (["--quiet"], True)])
def test_verify_bar_is_off_with_quiet_and_left_to_the_terminal_otherwise(glm, bars, flags, disable):
    _, out = glm
    run("verify", out, *flags, expect=0)
    assert [bar.made_with["disable"] for bar in bars] == [disable]  # None: tqdm shows it only on a terminal


# ---- replicated tensors ----------------------------------------------------------------------------------------

def rewrite(out: Path, name: str, edit) -> None:
    """Rewrite shard `name` of `out` after `edit(tensors, offsets)` changed its contents; keep the manifest's size
    and CRC-32 true, so only what verify checks beyond them can find a problem."""
    path, manifest_path = out / name, out / "reshard.json"
    with safe_open(path, framework="pt") as f:
        info = json.loads(f.metadata()["DCP_SHARDING_INFO"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    offsets = {k: list(info[k]["saved_offsets"]) for k in tensors}
    order = [t.name for t in read_header(path).tensors]  # the manifest's order: data offsets are checked against it
    edit(tensors, offsets)
    save_in_order(path, {k: tensors[k] for k in order if k in tensors}, dcp_metadata(offsets))
    manifest = json.loads(manifest_path.read_text())
    entry = next(e for e in manifest["files"] if e["name"] == name)
    entry.update(bytes=path.stat().st_size, crc32=f"{zlib.crc32(path.read_bytes()):08x}")
    manifest_path.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def save_in_order(path: Path, tensors: dict, metadata: dict) -> None:
    """A safetensors file holding `tensors` back to back in their order, as `reshard write` lays out a rank file
    (`save_file` orders them its own way)."""
    import struct

    import torch

    names = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64"}
    header, blobs, cursor = {"__metadata__": metadata}, [], 0
    for name, tensor in tensors.items():
        blob = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
        header[name] = {"dtype": names[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [cursor, cursor + len(blob)]}
        blobs.append(blob)
        cursor += len(blob)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))


def replicated_in(out: Path, coords: set[int]) -> dict[str, str]:
    """Keep every replicated tensor whole in the first file of exactly `coords` (dropping the copies `write` put in
    the others); return each coordinate's first file."""
    manifest = json.loads((out / "reshard.json").read_text())
    names = [n for n, t in manifest["tensors"].items() if t["placement"]["kind"] == "replicated"]
    assert names, "the fixture has no replicated tensor to test with"
    firsts = {c["coord"]: c["files"][0] for c in manifest["coords"]}

    def drop(tensors, offsets):
        for n in names:
            tensors.pop(n), offsets.pop(n)

    for coord, name in firsts.items():
        if coord not in coords:
            rewrite(out, name, drop)
    return firsts


def replicated_names(out: Path) -> list[str]:
    manifest = json.loads((out / "reshard.json").read_text())
    return [n for n, t in manifest["tensors"].items() if t["placement"]["kind"] == "replicated"]


def test_verify_compares_every_replicated_copy(glm):
    src, out = glm
    manifest = json.loads((out / "reshard.json").read_text())
    for name in replicated_names(out):  # a whole copy in every coordinate's first file
        assert sorted(e["coord"] for e in manifest["files"]
                      if name in {c.name for c in file_chunks(manifest, e)}) == [0, 1, 2, 3]
    summary = verify(out, against=src)
    assert summary.bytes_compared == chunk_bytes(manifest)  # every copy compared with the source


def test_verify_compares_every_replicated_copy_with_the_source(glm):
    src, out = glm
    firsts = replicated_in(out, {0, 1, 2, 3})
    name = replicated_names(out)[0]

    def change(tensors, offsets):
        tensors[name] = tensors[name] + 1

    rewrite(out, firsts[2], change)  # the copy in coordinate 2 only; sizes and CRC-32s stay true
    verify(out)  # the structure is sound: only the bytes differ
    with pytest.raises(VerifyError, match="differs from the source") as info:
        verify(out, against=src)
    assert info.value.problems == [f"{firsts[2]}: {name} differs from the source at chunk ((0, 10),)"]


def test_verify_rejects_a_replicated_tensor_in_some_coordinates_or_in_part(glm):
    src, out = glm
    firsts = replicated_in(out, {0, 1})
    name = replicated_names(out)[0]
    with pytest.raises(VerifyError, match="differently from the manifest") as info:
        verify(out)
    assert info.value.problems == [f"{firsts[c]}: header holds [{name!r}] differently from the manifest"
                                   for c in (2, 3)]

    def halve(tensors, offsets):
        tensors[name] = tensors[name][:5].clone()

    write_checkpoint(src, out, MESH, overwrite=True, progress=False)  # every copy back
    rewrite(out, firsts[3], halve)
    with pytest.raises(VerifyError, match="differ from the manifest") as info:
        verify(out)
    assert info.value.problems == [f"{firsts[3]}: {name} shape/offsets [5]/[0] differ from the manifest's [10]/[0]"]
