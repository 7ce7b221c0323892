"""The parts of the package (the folders pyproject.toml maps to mcorekit.<part>) import each other in one
direction only, as README.md's tour writes it ("config/    may import: mcorekit, models"): every module is parsed
with `ast`, each `mcorekit...` import (lazy ones inside functions and TYPE_CHECKING blocks too) becomes an edge
between parts, and an edge the README does not allow, or a cycle, fails here naming the file and line."""

from __future__ import annotations

import ast
import re
import tomllib
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CORE = "mcorekit"  # the core folder: the CLI, the error types, output folders
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]


def parts() -> dict[str, Path]:
    """Part name -> its folder, from pyproject's package-dir (`mcorekit.train` = `train` is the part `train`)."""
    found = {}
    for package, folder in PYPROJECT["package-dir"].items():
        name = package.split(".")
        assert name[0] == CORE and len(name) <= 2, package
        found[name[1] if len(name) == 2 else CORE] = REPO / folder
    return found


def allowed() -> dict[str, set[str]]:
    """README.md's lines `part/  may import: a, b` (or `nothing`)."""
    rules = {}
    for line in (REPO / "README.md").read_text().splitlines():
        if m := re.fullmatch(r"(\w+)/\s+may import: (.+)", line.strip()):
            targets = m.group(2).strip()
            rules[m.group(1)] = set() if targets == "nothing" else {t.strip() for t in targets.split(",")}
    return rules


def imported_parts(node: ast.Import | ast.ImportFrom, own: str, known: set[str]) -> set[str]:
    """The parts one import statement reaches: `mcorekit.X...` is part X, anything else under mcorekit the core."""
    if isinstance(node, ast.ImportFrom):
        if node.level:  # relative: inside its own part
            return {own}
        if node.module == CORE:  # from mcorekit import config, quiet
            return {a.name if a.name in known else CORE for a in node.names}
        names = [node.module or ""]
    else:
        names = [a.name for a in node.names]
    out = set()
    for name in names:
        top = name.split(".")
        if top[0] == CORE:
            out.add(top[1] if len(top) > 1 and top[1] in known else CORE)
    return out


def edges() -> dict[tuple[str, str], list[str]]:
    """(part, imported part) -> the places (file:line) that import it; a part's imports of itself left out."""
    folders = parts()
    known = set(folders) - {CORE}
    found: dict[tuple[str, str], list[str]] = defaultdict(list)
    for part, folder in folders.items():
        for path in sorted(folder.rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    for target in imported_parts(node, part, known) - {part}:
                        found[(part, target)].append(f"{path.relative_to(REPO)}:{node.lineno}")
    return found


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(path: list[str]) -> list[str] | None:  # depth first; path ends with the node visited
        state[path[-1]] = 1
        for nxt in sorted(graph.get(path[-1], ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(path + [nxt])):
                return found
        state[path[-1]] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit([start])):
            return found
    return None


def test_the_readme_names_every_part_once() -> None:
    rules = allowed()
    assert set(rules) == set(parts()), f"README.md's 'may import' lines {sorted(rules)} vs the parts {sorted(parts())}"
    for part, targets in rules.items():
        assert targets <= set(parts()) - {part}, f"{part}/ may import unknown parts {sorted(targets - set(parts()))}"


def test_the_readme_rules_have_no_cycle() -> None:
    assert cycle(allowed()) is None, f"README.md's rules allow a cycle: {' -> '.join(cycle(allowed()) or [])}"


def test_each_part_imports_only_what_the_readme_allows() -> None:
    rules = allowed()
    bad = [f"{part}/ imports {target}/ (allowed: {', '.join(sorted(rules[part])) or 'nothing'}) at {', '.join(where)}"
           for (part, target), where in sorted(edges().items()) if target not in rules[part]]
    assert not bad, "\n".join(bad)


def test_the_import_graph_has_no_cycle() -> None:
    graph: dict[str, set[str]] = defaultdict(set)
    for part, target in edges():
        graph[part].add(target)
    found = cycle(graph)
    assert found is None, f"import cycle between parts: {' -> '.join(found or [])}"


def test_cycles_are_found() -> None:
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set(), "c": {"a"}}) is None


def test_every_package_folder_is_in_the_wheel() -> None:
    """A folder with an __init__.py that pyproject's `packages` leaves out works in the editable checkout and is
    missing from an installed mcorekit."""
    listed = set(PYPROJECT["packages"])
    for part, folder in parts().items():
        for init in sorted(folder.rglob("__init__.py")):
            sub = init.parent.relative_to(folder).parts
            package = ".".join([CORE] + ([] if part == CORE else [part]) + list(sub))
            assert package in listed, f"{init.relative_to(REPO)}: {package} is not in pyproject.toml's packages"
