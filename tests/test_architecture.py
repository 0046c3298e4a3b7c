"""The layout's rules, read off the source: import direction, no cycles, small files and functions.

Every import counts, at module level or inside a function (a function-level import only hides a
cycle); imports under `if TYPE_CHECKING:` are annotations, not dependencies, and are skipped.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("core", "plugins", "servelab_kernels", "scenarios")
EXAMPLE = ROOT / "examples" / "servelab-plugin-example" / "servelab_plugin_example"
CORE_SUBPACKAGES = ("config", "engine", "model", "runner", "server", "bench")
MAX_FILE_LINES = 300
MAX_FUNCTION_LINES = 60


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def source_files() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


MODULES = source_files()


def _skip_type_checking(tree: ast.AST) -> list[ast.AST]:
    skipped = []
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped += list(ast.walk(node))
    return skipped


def imports_of(path: Path, package: str) -> set[str]:
    """Our modules that `path` imports (resolved to modules, not names inside them)."""
    tree = ast.parse(path.read_text())
    skip = {id(n) for n in _skip_type_checking(tree)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the importing module's package
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names}
    return {m for m in found if m.split(".")[0] in PACKAGES}


def graph() -> dict[str, set[str]]:
    g = {}
    for name, path in MODULES.items():
        pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        g[name] = {m for m in imports_of(path, pkg) if m != name}
    return g


def component(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "core" and len(parts) > 1 and parts[1] in CORE_SUBPACKAGES:
        return f"core.{parts[1]}"
    if parts[0] in ("core", "plugins") and len(parts) > 1:
        return ".".join(parts[:2])
    return parts[0]


def find_cycle(g: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(g.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (cycle := visit(m)):
                return cycle
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(g):
        if n not in state and (cycle := visit(n)):
            return cycle
    return None


def test_no_import_cycle_between_modules():
    assert find_cycle(graph()) is None


def test_no_import_cycle_between_components():
    g: dict[str, set[str]] = {}
    for mod, deps in graph().items():
        g.setdefault(component(mod), set()).update(component(d) for d in deps if component(d) != component(mod))
    assert find_cycle(g) is None


def test_the_engine_never_imports_the_server_or_the_bench():
    bad = [(m, d) for m, deps in graph().items() if m.startswith("core.engine") for d in deps
           if d.startswith(("core.server", "core.bench", "core.cli"))]
    assert bad == []


def test_no_installed_distribution_ships_a_top_level_package_of_ours():
    """Our top-level packages are importable names that no other installed distribution may also
    ship: transformers >= 5.25 imports Hugging Face's `kernels`, which a `kernels/` of ours shadowed
    from the source tree (and a wheel of ours would overwrite)."""
    import importlib.metadata

    owners = importlib.metadata.packages_distributions()
    tops = [p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file() and p.name not in ("tests", "benchmarks")]
    assert sorted(tops) == sorted((*PACKAGES, "conf"))
    assert {t: sorted(set(owners.get(t, [])) - {"servelab"}) for t in tops} == {t: [] for t in tops}


def test_kernels_import_nothing_of_ours_and_core_no_plugin():
    g = graph()
    assert [(m, d) for m, deps in g.items() if m.startswith("servelab_kernels") for d in deps if not d.startswith("servelab_kernels")] == []
    assert [(m, d) for m, deps in g.items() if m.startswith("core") for d in deps if d.startswith("plugins")] == []


def test_plugins_use_only_the_public_api_and_kernels():
    """In-repo plugins and the example package import core.api (never core's internals), kernels, and
    at most their own kind's modules (the triton attention backend reuses the torch one's row split)."""
    files = [(m, p) for m, p in MODULES.items() if m.startswith("plugins.")]
    files += [(f"servelab_plugin_example.{p.stem}", p) for p in sorted(EXAMPLE.glob("*.py"))]
    bad = []
    for mod, path in files:
        for dep in imports_of(path, mod.rsplit(".", 1)[0]):
            own_kind = dep.split(".")[:2] == mod.split(".")[:2]  # e.g. plugins.attention.* among themselves
            if dep.startswith("core") and dep != "core.api" or dep.startswith("scenarios") or \
                    dep.startswith("plugins") and not own_kind:
                bad.append((mod, dep))
    assert bad == []


@pytest.mark.parametrize("name", sorted(MODULES))
def test_files_and_functions_stay_small(name):
    path = MODULES[name]
    text = path.read_text()
    assert text.count("\n") < MAX_FILE_LINES, f"{path} has {text.count(chr(10))} lines"
    long = [(n.name, n.end_lineno - n.lineno + 1) for n in ast.walk(ast.parse(text))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > MAX_FUNCTION_LINES]
    assert long == [], f"{path}: functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
