"""The house rules, measured from the source by scripts/house.py: imports run one way (base, plan, manifest, read,
runs, launch; write and load side by side; entry points on top), no circles, no private name imported across
modules, no private module imported from outside its package, no function over 80 lines, no module over 500."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "house.py"


def house():
    spec = importlib.util.spec_from_file_location("house", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_package_keeps_the_house_rules():
    result = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    figures = house().measure(REPO)
    assert figures["modules"] > 40 and figures["arrows"] > 100  # the whole package was read, lazy imports too
    layers = list(figures["drawing"])
    assert layers[0] == "entry" and layers[-1] == "base", layers


def test_the_checker_sees_each_broken_rule(tmp_path):
    """A planted package breaking every rule once: each is reported, and --check fails."""
    package = tmp_path / "reshard"
    for folder in ("plan", "read", "write", "load"):
        (package / folder).mkdir(parents=True)
        (package / folder / "__init__.py").write_text("")
    (package / "__init__.py").write_text("__version__ = '0'\n")
    (package / "errors.py").write_text("class ReshardError(Exception):\n    pass\n")
    (package / "plan" / "a.py").write_text("from ..read.b import thing\n")  # plan imports read: against the flow
    (package / "read" / "b.py").write_text("from ..plan.a import _hidden\nthing = 1\n")  # a circle, a private name
    (package / "write" / "w.py").write_text("def write():\n    from ..load import l\n")  # write imports load
    (package / "load" / "l.py").write_text("def long():\n" + "    x = 1\n" * 90)  # 91 lines
    (package / "read" / "big.py").write_text("x = 1\n" * 501)
    (package / "read" / "_inner.py").write_text("inner = 1\n")  # read's own module
    (package / "read" / "c.py").write_text("from ._inner import inner\n")  # from inside read: allowed
    (package / "load" / "m.py").write_text("from ..read._inner import inner\nfrom ..read import _inner\n")
    module = house()
    figures = module.measure(tmp_path)
    assert figures["circles"] == [["reshard.plan.a", "reshard.read.b"]]
    assert any("reshard.plan.a (plan) imports reshard.read.b (read)" in a for a in figures["against_the_flow"])
    assert any("reshard.write.w (write) imports reshard.load.l (load)" in a for a in figures["against_the_flow"])
    assert figures["private_imports"] == ["reshard/read/b.py:1: reshard.read.b imports _hidden from reshard.plan.a"]
    assert figures["functions_over_80"] == ["reshard/load/l.py:1 long (91)"]
    assert figures["modules_over_500"] == ["reshard/read/big.py (501)"]
    assert figures["private_modules"] == [
        "reshard/load/m.py:1: reshard.load.m imports reshard.read._inner; import from reshard.read",
        "reshard/load/m.py:2: reshard.load.m imports reshard.read._inner; import from reshard.read"]
    assert len(module.broken(figures)) == 8
    result = subprocess.run([sys.executable, str(SCRIPT), "--check", str(tmp_path)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 1 and "8 rule(s) broken" in result.stderr, result.stderr


def test_each_package_lists_what_it_exports():
    """A subpackage's interface is its `__init__`: `__all__` lists names that resolve (each imported from a private
    module, or on first use for `load`), and every module beside the `__init__` is private (`_name.py`)."""
    import importlib

    for package in ("load", "manifest", "plan", "read", "runs", "verification", "write"):
        folder = REPO / "reshard" / package
        assert [p.name for p in folder.glob("*.py") if not p.stem.startswith("_")] == [], package
        exported = importlib.import_module(f"reshard.{package}")
        assert exported.__all__ == sorted(exported.__all__), package
        assert all(getattr(exported, name, None) is not None for name in exported.__all__), package


def test_the_package_imports_only_through_the_interfaces():
    """No module reaches into another package's private module; a lazy package (`load`, `runs`) maps each name it
    exports to one module, and importing them imports neither torch nor numpy (nor does `write`, which uses runs)."""
    figures = house().measure(REPO)
    assert figures["private_modules"] == []
    code = ("import importlib, sys\n"
            "for name in ('load', 'runs'):\n"
            "    package = importlib.import_module('reshard.' + name)\n"
            "    assert sorted(package._EXPORTS) == package.__all__, name\n"
            "import reshard.write\n"
            "print('torch' in sys.modules, 'numpy' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.stdout.split() == ["False", "False"], result.stdout + result.stderr
