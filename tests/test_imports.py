"""The package's import graph: layers import only downward, the planner stays pure, no cycles.

Read from the import statements themselves (module level and inside functions alike, so a lazy
import that hides a cycle counts too; ``if TYPE_CHECKING:`` blocks, which never run, do not),
not from an interpreter: importing any submodule runs the package's ``__init__`` first, whose
fixed order would mask a cycle between two modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "lightning_autopipe"
PACKAGE = "lightning_autopipe"

#: The layers, lowest first: a module may import its own layer and the ones below it, never
#: one above. Names are module prefixes below the package (``planner`` holds every
#: ``lightning_autopipe.planner.*``). ``options`` validates schedule names and plans, so it
#: sits on the planner; ``checkpoint`` reads Lightning's checkpoint plugins, so it sits with the
#: integration's lowest part.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("core", ("errors", "extras", "profile", "hardware", "cluster")),
    ("graph", ("graph",)),
    ("planner", ("planner",)),
    ("options", ("options",)),
    ("runtime", ("runtime",)),
    ("checkpoint", ("checkpoint",)),
    ("lightning", ("lightning",)),
    ("zoo", ("zoo",)),
)
#: Entry points, above every layer: the package facade and the command lines.
ENTRY = ("", "__main__", "graph.cli", "planner.cli")
#: Third-party packages a layer may not import (what runs without them must not need them).
EXTERNAL_FORBIDDEN = {
    "core": ("torch", "lightning", "hydra", "omegaconf", "transformers", "torchvision"),
    "graph": ("lightning", "hydra", "omegaconf", "transformers", "torchvision"),
    "planner": ("torch", "lightning", "lightning_utilities", "hydra", "omegaconf",
                "transformers", "torchvision"),
    "options": ("torch", "lightning", "hydra", "omegaconf", "transformers", "torchvision"),
    "runtime": ("lightning", "hydra", "omegaconf", "transformers", "torchvision"),
    "checkpoint": ("hydra", "omegaconf", "transformers", "torchvision"),
    "lightning": ("hydra", "omegaconf", "transformers", "torchvision"),
    "zoo": (),
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES.get(name, Path()).name == "__init__.py"


def _imports(name: str) -> set[str]:
    """Every module ``name`` imports (``from a import b`` counts as ``a.b`` when that is one)."""
    tree = ast.parse(MODULES[name].read_text())
    for node in ast.walk(tree):  # drop the typing-only blocks
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            node.body = []
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = name.split(".")
                base = base[: len(base) - node.level + (1 if _is_package(name) else 0)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for alias in node.names:
                sub = f"{mod}.{alias.name}"
                out.add(sub if sub in MODULES else mod)
    return out


def _layer(name: str) -> int:
    """The index of ``name``'s layer in :data:`LAYERS`, ``len(LAYERS)`` for an entry point."""
    rel = name[len(PACKAGE) + 1:] if name != PACKAGE else ""
    if rel in ENTRY:
        return len(LAYERS)
    for i, (_, prefixes) in enumerate(LAYERS):
        if any(rel == p or rel.startswith(p + ".") for p in prefixes):
            return i
    raise AssertionError(f"module {name} belongs to no layer: add it to LAYERS in {__file__}")


def _upward_imports(modules: dict[str, set[str]]) -> dict[str, list[str]]:
    """For each module, what it imports from a layer above its own."""
    bad = {}
    for name, imports in modules.items():
        hits = sorted(m for m in imports
                      if m.startswith(PACKAGE + ".") and _layer(m) > _layer(name))
        if hits:
            bad[name] = hits
    return bad


def test_every_module_belongs_to_a_layer():
    for name in MODULES:
        _layer(name)


def test_no_module_imports_a_layer_above_its_own():
    bad = _upward_imports({n: _imports(n) for n in MODULES})
    assert not bad, f"upward imports (see LAYERS in tests/test_imports.py): {bad}"


def test_no_layer_imports_a_third_party_package_it_must_run_without():
    bad = {}
    for name in MODULES:
        layer = _layer(name)
        if layer == len(LAYERS):
            continue
        forbidden = EXTERNAL_FORBIDDEN[LAYERS[layer][0]]
        hits = sorted(m for m in _imports(name) if m.split(".")[0] in forbidden)
        if hits:
            bad[name] = hits
    assert not bad, f"layers importing what they must run without: {bad}"


def test_the_layer_checks_find_an_upward_import():
    imports = {f"{PACKAGE}.planner.search": {f"{PACKAGE}.runtime.executor"},
               f"{PACKAGE}.runtime.executor": {f"{PACKAGE}.planner.schedule"}}
    assert _upward_imports(imports) == {
        f"{PACKAGE}.planner.search": [f"{PACKAGE}.runtime.executor"]}


def test_the_profile_data_type_the_planner_reads_needs_no_torch():
    hits = sorted(m for m in _imports(f"{PACKAGE}.profile")
                  if m.split(".")[0] in ("torch", "lightning"))
    assert not hits


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_no_import_cycles_inside_the_package():
    graph = {n: {m for m in _imports(n) if m in MODULES and m != n} for n in MODULES}
    # A package's __init__ re-exporting its children is not a cycle with them: a child is
    # imported after its parent package by the import system itself.
    for n in graph:
        graph[n] = {m for m in graph[n] if not (_is_package(n) and m.startswith(n + "."))}
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


#: Lines past which a module says in its docstring why it is one module (the house style).
LONG_MODULE_LINES = 400


def _long_modules_without_a_reason(modules: dict[str, Path]) -> list[str]:
    """Modules over :data:`LONG_MODULE_LINES` lines whose docstring does not say why (by
    naming the ~400 lines it passes)."""
    bad = []
    for name, path in modules.items():
        text = path.read_text()
        if text.count("\n") <= LONG_MODULE_LINES:
            continue
        doc = ast.get_docstring(ast.parse(text)) or ""
        if "400 lines" not in " ".join(doc.split()):
            bad.append(f"{name} ({text.count(chr(10))} lines)")
    return bad


def test_a_module_over_400_lines_says_why_in_its_docstring():
    bad = _long_modules_without_a_reason(MODULES)
    assert not bad, (f"modules over {LONG_MODULE_LINES} lines with no reason in their "
                     f"docstring (split them, or say why they are one module): {bad}")


def test_the_length_check_finds_a_long_module_without_a_reason(tmp_path):
    short, said, unsaid = (tmp_path / f"{n}.py" for n in ("short", "said", "unsaid"))
    body = "x = 1\n" * (LONG_MODULE_LINES + 1)
    short.write_text('"""Short."""\nx = 1\n')
    said.write_text('"""Long, past ~400\nlines: one invariant."""\n' + body)
    unsaid.write_text('"""Long."""\n' + body)
    found = _long_modules_without_a_reason({"short": short, "said": said, "unsaid": unsaid})
    assert found == [f"unsaid ({LONG_MODULE_LINES + 2} lines)"]
