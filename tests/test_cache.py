"""The layout cache: a hit equals a fresh build, and any change to the inputs misses."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from reshard.read import _cache as cache
from reshard.read._source import read_checkpoint
from reshard.read._experts import build_meta_model, layout_from_model
from reshard.read import find_experts


def test_cached_layout_equals_a_fresh_build(tiny, monkeypatch, tmp_path):
    monkeypatch.setenv("RESHARD_CACHE_DIR", str(tmp_path))
    index = read_checkpoint(tiny("glm4_moe"))
    fresh = layout_from_model(build_meta_model(index.config), index)
    assert cache.load_layout(index) is None
    assert find_experts(index) == fresh  # builds and stores
    assert len(list(tmp_path.glob("*.json"))) == 1
    assert cache.load_layout(index) == fresh
    assert find_experts(index) == fresh  # from the cache


def test_a_changed_config_or_tensor_misses(tiny, monkeypatch, tmp_path):
    monkeypatch.setenv("RESHARD_CACHE_DIR", str(tmp_path))
    index = read_checkpoint(tiny("qwen3_moe"))
    find_experts(index)
    changed_config = index.__class__(**{**index.__dict__, "config": {**index.config, "rms_norm_eps": 1e-5}})
    assert cache.layout_key(changed_config) != cache.layout_key(index)
    name = next(iter(index.tensors))
    entry = index.tensors[name]
    changed_tensor = index.__class__(**{**index.__dict__, "tensors": {
        **index.tensors, name: entry.__class__(**{**entry.__dict__, "dtype": "F16"})}})
    assert cache.layout_key(changed_tensor) != cache.layout_key(index)
    assert cache.load_layout(changed_config) is None and cache.load_layout(changed_tensor) is None


def test_a_damaged_entry_is_rebuilt_and_an_empty_setting_disables(tiny, monkeypatch, tmp_path):
    monkeypatch.setenv("RESHARD_CACHE_DIR", str(tmp_path))
    index = read_checkpoint(tiny("qwen3_moe"))
    layout = find_experts(index)
    (tmp_path / f"{cache.layout_key(index)}.json").write_text("{not json")
    assert cache.load_layout(index) is None and find_experts(index) == layout
    monkeypatch.setenv("RESHARD_CACHE_DIR", "")
    assert cache.cache_dir() is None and cache.load_layout(index) is None


def test_plan_from_the_cache_imports_no_torch(tiny, tmp_path):
    src = tiny("mixtral")
    env_cache = str(tmp_path)
    code = ("import sys, json; import reshard.cli as c; sys.argv = ['reshard', 'plan', {src!r}, '--fsdp', '5', '--json'];"
            "\ntry:\n    c.main()\nexcept SystemExit:\n    pass\nprint('TORCH' if 'torch' in sys.modules else 'NO-TORCH')")
    runs = []
    for _ in range(2):
        result = subprocess.run([sys.executable, "-c", code.format(src=str(src))], capture_output=True, text=True,
                                timeout=120, env={**__import__("os").environ, "RESHARD_CACHE_DIR": env_cache})
        runs.append(result.stdout)
    assert runs[0].strip().endswith("TORCH") and not runs[0].strip().endswith("NO-TORCH")
    assert runs[1].strip().endswith("NO-TORCH")
    first, second = (json.loads(r[: r.rindex("}") + 1]) for r in runs)
    assert first == second


def test_an_entry_stored_by_other_code_is_not_served(tiny, monkeypatch, tmp_path):
    """Same config, tensors and version number, different planning code (an upgrade, a local edit): a miss."""
    import dataclasses

    monkeypatch.setenv("RESHARD_CACHE_DIR", str(tmp_path))
    index = read_checkpoint(tiny("qwen3_moe"))
    fresh = layout_from_model(build_meta_model(index.config), index)
    ours = cache.code_digest()
    assert ours is not None and len(ours) == 64
    stale = dataclasses.replace(fresh, architecture="BuiltByOtherCode", tensors=fresh.tensors[:1])
    monkeypatch.setattr(cache, "code_digest", lambda: "0" * 64)
    cache.save_layout(index, stale)
    assert cache.load_layout(index) == stale  # the other code's entry is there, under its own key
    monkeypatch.setattr(cache, "code_digest", lambda: ours)
    assert cache.load_layout(index) is None
    assert find_experts(index) == fresh
    assert len(list(tmp_path.glob("*.json"))) == 2


def test_unreadable_code_turns_the_cache_off(tiny, monkeypatch, tmp_path):
    monkeypatch.setenv("RESHARD_CACHE_DIR", str(tmp_path))
    index = read_checkpoint(tiny("qwen3_moe"))
    monkeypatch.setattr(cache, "code_digest", lambda: None)
    layout = find_experts(index)
    assert list(tmp_path.iterdir()) == [] and cache.load_layout(index) is None
    assert layout == layout_from_model(build_meta_model(index.config), index)


@pytest.mark.slow  # a planning module edited in a copy of the package, planned again in fresh processes
def test_an_edit_to_the_planning_code_misses_the_cache(tiny, tmp_path):
    """End to end: a copy of the package hits the cache the installed one filled (the key is the code, not its
    path) until one line of its _experts.py changes; then it builds the layout again (imports torch)."""
    import os
    import shutil
    from pathlib import Path

    src = tiny("mixtral")
    copy = tmp_path / "copy"
    package = Path(cache.__file__).parents[1]  # reshard/, above reshard/read/_cache.py
    shutil.copytree(package, copy / "reshard", ignore=shutil.ignore_patterns("__pycache__"))
    code = ("import sys, reshard, reshard.cli as c; sys.argv = ['reshard', 'plan', {src!r}, '--fsdp', '5', '--json']"
            "\ntry:\n    c.main()\nexcept SystemExit:\n    pass\n"
            "print(reshard.__file__, 'TORCH' if 'torch' in sys.modules else 'NO-TORCH')")

    def plan(pythonpath: str | None) -> tuple[str, str]:
        env = {**os.environ, "RESHARD_CACHE_DIR": str(tmp_path / "cache")}
        if pythonpath:
            env["PYTHONPATH"] = pythonpath
        result = subprocess.run([sys.executable, "-c", code.format(src=str(src))], capture_output=True, text=True,
                                timeout=120, env=env, cwd=tmp_path)
        module_file, torch_state = result.stdout.strip().splitlines()[-1].rsplit(" ", 1)
        return module_file, torch_state

    installed, state = plan(None)
    assert Path(installed).parent == package and state == "TORCH"
    copied, state = plan(str(copy))
    assert Path(copied).parent == copy / "reshard" and state == "NO-TORCH"
    edited = copy / "reshard" / "read" / "_experts.py"
    assert edited.is_file(), edited  # a planning module the layout cache keys on (renamed: edit the new name)
    with open(edited, "a") as f:
        f.write("\n# a later release\n")
    assert plan(str(copy)) == (copied, "TORCH")
    assert len(list((tmp_path / "cache").glob("*.json"))) == 2
