"""The layer order of docs/architecture.md, checked against every import in vlforge/.

The layers are read from the document itself (its first code block: one layer per line, the
modules before the description), so the document and this test cannot drift apart.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "vlforge"
NO_SIBLING_IMPORTS = {"vlforge.recipes"}  # a recipe never imports another recipe


def read_layers(doc: Path = ROOT / "docs" / "architecture.md") -> list[list[str]]:
    """[[unit, ...] per layer, highest first]; a unit is a package ('vlforge.serve') or a module."""
    block = re.search(r"```\n(.*?)```", doc.read_text(), re.S).group(1)
    layers = []
    for line in block.splitlines():
        if not line or line[0].isspace():
            continue  # a description's continuation line
        names = re.split(r"\s{2,}", line, maxsplit=1)[0].split()
        layers.append(["vlforge." + n.removesuffix("/").removesuffix(".py").replace("/", ".") for n in names])
    return layers


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every vlforge module `path` imports, at module level or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("vlforge"):
            found.add(node.module)
            # `from vlforge.rl import core` imports a module too
            found |= {f"{node.module}.{a.name}" for a in node.names
                      if (PACKAGE.parent / f"{node.module}.{a.name}".replace(".", "/")).with_suffix(".py").exists()}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("vlforge")}
    return found


def unit_of(module: str, units: list[str]) -> str | None:
    matches = [u for u in units if module == u or module.startswith(u + ".")]
    return max(matches, key=len) if matches else None


def graph() -> dict[str, set[str]]:
    return {module_name(p): imports_of(p) for p in sorted(PACKAGE.rglob("*.py"))}


def violations(layers: list[list[str]], edges: dict[str, set[str]]) -> list[str]:
    level = {u: i for i, layer in enumerate(layers) for u in layer}
    units = list(level)
    problems = []
    for module, deps in edges.items():
        if module == "vlforge":
            continue
        unit = unit_of(module, units)
        if unit is None:
            problems.append(f"{module} is in no layer of docs/architecture.md")
            continue
        for dep in sorted(deps):
            dep_unit = unit_of(dep, units)
            if dep_unit is None or dep == "vlforge":
                continue  # reported as a module of its own
            if level[dep_unit] > level[unit]:
                continue  # downwards
            if level[dep_unit] < level[unit]:
                problems.append(f"{module} imports {dep}, a higher layer")
            elif dep_unit != unit:
                problems.append(f"{module} imports {dep}: {unit} and {dep_unit} share a layer and must not import "
                                "each other")
            elif unit in NO_SIBLING_IMPORTS and dep != unit:
                problems.append(f"{module} imports {dep}: recipes do not import each other (move shared code "
                                "below them, e.g. to train/)")
    return problems


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    found, state = [], {}  # state: 1 on the stack, 2 done

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for d in sorted(edges.get(m, ())):
            if d not in edges:
                continue
            if state.get(d) == 1:
                found.append(stack[stack.index(d):] + [d])
            elif d not in state:
                visit(d, stack + [d])
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m, [m])
    return found


def test_document_lists_every_package_once():
    layers = read_layers()
    units = [u for layer in layers for u in layer]
    assert len(units) == len(set(units))
    assert {"vlforge.cli", "vlforge.recipes", "vlforge.train", "vlforge.model", "vlforge.config"} <= set(units)
    for u in units:
        assert (PACKAGE.parent / u.replace(".", "/")).is_dir() or \
            (PACKAGE.parent / u.replace(".", "/")).with_suffix(".py").is_file(), f"{u} does not exist"


def test_imports_follow_the_layers():
    assert violations(read_layers(), graph()) == []


def test_no_import_cycles():
    assert cycles(graph()) == []


@pytest.mark.parametrize("edges, problem", [
    ({"vlforge.model.export": {"vlforge.infer.model"}}, "a higher layer"),
    ({"vlforge.recipes.grpo": {"vlforge.recipes.sft"}}, "recipes do not import each other"),
    ({"vlforge.serve.app": {"vlforge.rollout.groups"}}, "share a layer"),
    ({"vlforge.nowhere": set()}, "in no layer"),
])
def test_the_checker_catches(edges, problem):
    """The checks themselves: each kind of violation is reported (so a pass means something)."""
    found = violations(read_layers(), edges)
    assert len(found) == 1 and problem in found[0]


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
