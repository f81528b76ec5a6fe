"""The first-party modules import one another without a cycle, counting the imports made inside functions (a
cycle hidden in a function is still one: whichever side loads first sees the other half-built) and those under
`if TYPE_CHECKING:` (a cycle of types is a cycle a reader follows). The layout rule: which package, and which
side of the engine, may import which (README, "Layout"), and the engine's client free of torch. And the
layering of the benchmarks and the tests: both may import testkit/, which imports neither.
Read from the source alone; nothing is imported.
"""

from __future__ import annotations

import ast
import fnmatch
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def module_files() -> dict[str, Path]:
    """Every module of the packages the wheel ships (pyproject's `packages.find`), by dotted name."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    patterns = setuptools["packages"]["find"]["include"]
    out = {}
    for package in sorted(
        p.name for p in ROOT.iterdir() if any(fnmatch.fnmatch(p.name, pat) for pat in patterns)
    ):
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The first-party modules `name` imports anywhere in its file (the deepest module each import names)."""

    def deepest(dotted: str) -> str | None:
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str | None] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {deepest(alias.name) for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            found |= {deepest(f"{base}.{alias.name}") for alias in node.names}
    return {m for m in found if m and m != name}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_a_cycle_through_a_function_level_import(tmp_path):
    (tmp_path / "a.py").write_text("import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from a import x\n")
    (tmp_path / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import a\n")
    (tmp_path / "d.py").write_text("import c\n")
    modules = {p.stem: p for p in tmp_path.glob("*.py")}
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
    assert graph["b"] == {"a"} and graph["c"] == {"a"}  # a type-only import counts
    assert cycles(graph) == [["a", "b"]]


def test_no_first_party_import_cycle():
    modules = module_files()
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
    print(f"{len(graph)} modules, {sum(map(len, graph.values()))} imports between them")
    found = cycles(graph)
    detail = [
        f"{component}: "
        + ", ".join(f"{a} -> {b}" for a in component for b in sorted(graph[a]) if b in component)
        for component in found
    ]
    assert not found, f"import cycles: {detail}"


# The README's layout rule: what each package, or each part of one, may import of ours besides itself (a
# dotted name allows that module and everything under it; the longest name a module falls under rules it).
ROOMS_SIDE = {"engine.api", "engine.client", "engine.sizing", "engine.text", "engine.process"}
MAY_IMPORT = {
    "engine": {"redaction"},
    # what a room's process imports to reach the engine: the contract, the configs and the text
    "engine.client": {"engine.api", "engine.sizing.stage_config", "engine.text"},
    "engine.api": {"engine.sizing.stage_config", "engine.text"},
    # either side's text, a process's tuning, the model and its kernels: each below the tick
    "engine.text": {"engine.api", "engine.sizing.stage_config"},
    "engine.process": set(),
    "engine.model": {"engine.kernels", "engine.sizing", "engine.text"},
    "engine.kernels": set(),
    "agent": ROOMS_SIDE | {"tools", "prompts", "envsettings", "redaction"},
    # the simulation hosts an engine in its own process (`make run`): it may reach the engine's side too
    "agent.sim": {"engine", "tools", "prompts", "envsettings", "redaction"},
    "tools": {"envsettings"},
    "ui": {"engine.api", "tools", "envsettings", "redaction"},
    "prompts": set(),
    "envsettings": set(),
    "redaction": set(),
}


# parts that import nothing of their package but what their rule names: the rooms' side of the engine, and
# what the tick stands on
SEALED = {"engine.client", "engine.api", "engine.text", "engine.process", "engine.model", "engine.kernels"}


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def rule_of(module: str) -> str:
    """The MAY_IMPORT entry that rules `module`: the longest one it falls under."""
    return max((k for k in MAY_IMPORT if _under(module, k)), key=len)


def layering_breaches(graph: dict[str, set[str]]) -> list[str]:
    """Every import that MAY_IMPORT does not allow, as "a -> b". A module may import its own package freely,
    but a sealed part (SEALED) only itself and what its rule names."""

    def allowed(src: str, dst: str) -> bool:
        rule = rule_of(src)
        if _under(dst, rule) or any(_under(dst, ok) for ok in MAY_IMPORT[rule]):
            return True
        return rule not in SEALED and dst.split(".")[0] == src.split(".")[0]

    return [f"{a} -> {b}" for a in sorted(graph) for b in sorted(graph[a]) if not allowed(a, b)]


def test_the_layering_check_finds_an_import_against_the_rule():
    graph = {
        "ui.page": {"engine.api", "engine.tick.slots"},
        "engine.tick.engine": {"agent.room", "engine.client.link"},
        "engine.client.remote": {"engine.api", "engine.text.tokens", "engine.tick.session"},
        "agent.call": {"agent.duplex", "engine.client.remote", "engine.tick.engine"},
        "agent.sim.run": {"engine.door.host", "engine.tick.engine"},
        "tools.db": {"tools.x"},
    }
    assert layering_breaches(graph) == [
        "agent.call -> engine.tick.engine",
        "engine.client.remote -> engine.tick.session",
        "engine.tick.engine -> agent.room",
        "ui.page -> engine.tick.slots",
    ]


def test_every_package_imports_only_what_the_layout_rule_allows():
    modules = module_files()
    assert {name.split(".")[0] for name in modules} <= set(MAY_IMPORT), "a package the rule does not name"
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
    breaches = layering_breaches(graph)
    assert not breaches, f"imports against the README's layout rule: {breaches}"


def third_party(path: Path) -> set[str]:
    """The top-level names of what a module imports that is not relative."""
    tree = ast.parse(path.read_text(), str(path))
    out = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    return out | {
        n.module.split(".")[0]
        for n in ast.walk(tree)
        if isinstance(n, ast.ImportFrom) and n.module and not n.level
    }


def test_a_rooms_process_reaches_the_engine_without_torch():
    """Nothing the engine's client imports, however deep, imports torch: a room's process stays small."""
    modules = module_files()
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
    seen, todo = set(), [m for m in modules if _under(m, "engine.client")]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo += graph[m]
    heavy = sorted(m for m in seen if "torch" in third_party(modules[m]))
    assert len(seen) > 5 and not heavy, f"the engine's client reaches torch through {heavy}"


def test_the_benchmarks_import_nothing_of_the_tests():
    """What the end-to-end tests and the benchmarks share is testkit: no module under benchmarks/ or testkit/
    imports a module of tests/ (or pytest), nor reaches one through sys.path; testkit/ imports nothing of
    benchmarks/."""
    of_tests = {p.stem for p in (ROOT / "tests").glob("*.py")} | {"tests", "pytest"}
    for path in sorted([*(ROOT / "benchmarks").rglob("*.py"), *(ROOT / "testkit").rglob("*.py")]):
        tree = ast.parse(path.read_text(), str(path))
        named = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        named |= {
            n.module.split(".")[0]
            for n in ast.walk(tree)
            if isinstance(n, ast.ImportFrom) and n.module and not n.level
        }
        assert not named & of_tests, f"{path.relative_to(ROOT)} imports {sorted(named & of_tests)}"
        in_kit = path.relative_to(ROOT).parts[0] == "testkit"
        assert not (in_kit and "benchmarks" in named), f"{path.relative_to(ROOT)} imports benchmarks"
        assert "sys.path" not in ast.unparse(tree), f"{path.relative_to(ROOT)} changes sys.path"
