"""The import structure of the `reshard` package, measured from its source: layers, arrows, and the house rules.

Imports run one way (lowest first): the base (errors, signals), plan, the manifest, read, runs, the launcher; write and
load side by side above them (neither imports the other); entry points on top. This script reads every module's
imports (lazy ones inside functions too) and reports:

- circles (modules that import each other, directly or around a loop);
- arrows against the flow (a module importing one on a higher layer, or write and load importing each other);
- private names imported across modules (`from .x import _name`);
- private modules imported from outside their package (`reshard.P._mod` is P's own: others import from `reshard.P`);
- functions over 50 lines (over 80 breaks the rule), modules over 500 lines;
- a drawing: each layer with its modules and the layers it imports.

usage: python scripts/house.py [--check] [--json] [ROOT]

  --check   exit 1 when a rule is broken (no circle, no arrow against the flow, no private import across modules,
            no private module imported from outside its package, no function over 80 lines, no module over 500
            lines)
  --json    the figures as JSON instead of text
  ROOT      the repository (default: the one holding this script)
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

MAX_FUNCTION_LINES = 80
LONG_FUNCTION_LINES = 50
MAX_MODULE_LINES = 500

# (layer name, module prefixes), lowest first; a module takes the first layer whose prefix matches
LAYERS = [
    ("base", ("reshard.errors", "reshard.exports", "reshard.signals", "reshard.syscalls", "reshard.words")),
    ("plan", ("reshard.plan",)),
    ("manifest", ("reshard.manifest",)),
    ("read", ("reshard.read",)),
    ("runs", ("reshard.runs",)),
    ("launch", ("reshard.launch",)),
    ("write", ("reshard.write",)),
    ("load", ("reshard.load",)),
    ("entry", ("reshard.tiny", "reshard.results", "reshard.api", "reshard.verification", "reshard.env",
               "reshard.demo", "reshard._demo_rank", "reshard.cli", "reshard.cli_help", "reshard.params",
               "reshard.__main__")),
]
SIDE_BY_SIDE = {("write", "load"), ("load", "write")}  # one layer each, but neither may import the other
PACKAGE = "reshard"  # its __init__ is the lazy public facade: `__version__` and re-exports, not an arrow


def layer_of(module: str) -> tuple[int, str]:
    for rank, (name, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return rank, name
    raise SystemExit(f"house.py: {module} is on no layer; add it to LAYERS")


def modules_of(root: Path) -> dict[str, Path]:
    found = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _resolve(importer: str, is_package: bool, level: int, module: str | None) -> str:
    if level == 0:
        return module or ""
    base = importer.split(".")
    base = base if is_package else base[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def imports_of(name: str, path: Path, known: dict[str, Path]) -> list[tuple[str, str, int]]:
    """(imported module, imported name or '', line) for every import of the package in `path`."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, "", node.lineno) for a in node.names if a.name.split(".")[0] == PACKAGE]
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(name, is_package, node.level, node.module)
            if target.split(".")[0] != PACKAGE:
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.append((sub, "", node.lineno) if sub in known else (target, alias.name, node.lineno))
    return found


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def is_private_module(module: str) -> bool:
    last = module.rsplit(".", 1)[-1]
    return last.startswith("_") and not last.startswith("__")


def outside_its_package(importer: str, target: str) -> bool:
    """Whether `importer` reaches into the private module `target` of a package it is not part of."""
    package = target.rsplit(".", 1)[0]
    return is_private_module(target) and importer != package and not importer.startswith(package + ".")


def function_lengths(path: Path) -> list[tuple[str, int, int]]:
    """(qualified name, lines, first line) of every function, decorators excluded."""
    tree = ast.parse(path.read_text(), str(path))
    out = []

    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.append((prefix + child.name, child.end_lineno - child.lineno + 1, child.lineno))
                walk(child, prefix + child.name + ".")
            elif isinstance(child, ast.ClassDef):
                walk(child, prefix + child.name + ".")

    walk(tree, "")
    return out


def measure(root: Path) -> dict:
    known = modules_of(root)
    graph: dict[str, set[str]] = {m: set() for m in known if m != PACKAGE}
    against, private, private_modules = [], [], []
    for name, path in known.items():
        if name == PACKAGE:
            continue
        rank, layer = layer_of(name)
        for target, imported, line in imports_of(name, path, known):
            if target == PACKAGE or target == name:
                continue  # `from .. import __version__`: the facade
            graph[name].add(target)
            target_rank, target_layer = layer_of(target)
            where = f"{path.relative_to(root)}:{line}"
            if target_rank > rank or (layer, target_layer) in SIDE_BY_SIDE:
                against.append(f"{where}: {name} ({layer}) imports {target} ({target_layer})")
            if imported.startswith("_") and not imported.startswith("__"):
                private.append(f"{where}: {name} imports {imported} from {target}")
            if outside_its_package(name, target):
                private_modules.append(f"{where}: {name} imports {target}; import from "
                                       f"{target.rsplit('.', 1)[0]}")
    functions = sorted(((f"{known[m].relative_to(root)}:{line} {fn}", n) for m in known
                        for fn, n, line in function_lengths(known[m])), key=lambda x: -x[1])
    sizes = sorted(((str(p.relative_to(root)), len(p.read_text().splitlines())) for p in known.values()),
                   key=lambda x: -x[1])
    drawing = {}
    for name, targets in graph.items():
        layer = layer_of(name)[1]
        entry = drawing.setdefault(layer, {"modules": [], "imports": set()})
        entry["modules"].append(name)
        entry["imports"] |= {layer_of(t)[1] for t in targets} - {layer}
    return {
        "modules": len(graph),
        "arrows": sum(len(t) for t in graph.values()),
        "circles": circles(graph),
        "against_the_flow": against,
        "private_imports": private,
        "private_modules": private_modules,
        "functions_over_50": [f"{where} ({n})" for where, n in functions if n > LONG_FUNCTION_LINES],
        "functions_over_80": [f"{where} ({n})" for where, n in functions if n > MAX_FUNCTION_LINES],
        "longest_functions": [f"{where} ({n})" for where, n in functions[:5]],
        "modules_over_500": [f"{path} ({n})" for path, n in sizes if n > MAX_MODULE_LINES],
        "largest_modules": [f"{path} ({n})" for path, n in sizes[:5]],
        "drawing": {layer: {"modules": sorted(v["modules"]), "imports": sorted(v["imports"],
                                                                               key=lambda l: layer_of_name(l))}
                    for layer, v in sorted(drawing.items(), key=lambda kv: -layer_of_name(kv[0]))},
    }


def layer_of_name(layer: str) -> int:
    return [name for name, _ in LAYERS].index(layer)


def broken(figures: dict) -> list[str]:
    rules = [("circles", "circle"), ("against_the_flow", "arrow against the flow"),
             ("private_imports", "private import across modules"),
             ("private_modules", "private module imported from outside its package"),
             ("functions_over_80", "function over 80 lines"),
             ("modules_over_500", "module over 500 lines")]
    return [f"{what}: {item}" for key, what in rules for item in figures[key]]


def render(figures: dict) -> str:
    lines = ["The house, top layer first (a layer: its modules; -> the layers it imports):", ""]
    for layer, entry in figures["drawing"].items():
        short = ", ".join(m.removeprefix("reshard.") for m in entry["modules"])
        lines.append(f"  {layer:<9} {short}")
        lines.append(f"  {'':<9} -> {', '.join(entry['imports']) or '(nothing of the package)'}")
    lines.append("")
    lines.append(f"modules {figures['modules']}, arrows {figures['arrows']}, circles {len(figures['circles'])}, "
                 f"against the flow {len(figures['against_the_flow'])}, private imports "
                 f"{len(figures['private_imports'])}, private modules imported from outside "
                 f"{len(figures['private_modules'])}, functions over 50 lines {len(figures['functions_over_50'])} "
                 f"(over 80: {len(figures['functions_over_80'])}), modules over 500 lines "
                 f"{len(figures['modules_over_500'])}")
    for key in ("circles", "against_the_flow", "private_imports", "private_modules", "functions_over_50",
                "modules_over_500"):
        if figures[key]:
            lines.append(f"{key.replace('_', ' ')}:")
            lines += [f"  {' <-> '.join(item) if isinstance(item, list) else item}" for item in figures[key]]
    lines.append("longest functions: " + "; ".join(figures["longest_functions"]))
    lines.append("largest modules: " + "; ".join(figures["largest_modules"]))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    check = "--check" in argv
    as_json = "--json" in argv
    rest = [a for a in argv if a not in ("--check", "--json")]
    if any(a.startswith("-") for a in rest) or len(rest) > 1:
        print(__doc__.split("usage:")[1].strip(), file=sys.stderr)
        return 2
    root = Path(rest[0]) if rest else Path(__file__).resolve().parent.parent
    figures = measure(root)
    print(json.dumps(figures, indent=2) if as_json else render(figures))
    problems = broken(figures)
    if check and problems:
        print(f"\n{len(problems)} rule(s) broken:\n" + "\n".join(f"  {p}" for p in problems), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
