"""The planner's own modules import each other without a circle, counting every import
statement: module level, inside functions and under ``if TYPE_CHECKING:`` alike (the
package-wide rule in ``tests/test_imports.py`` leaves typing-only imports out)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from lightning_autopipe.planner import analytic_profile

ROOT = Path(__file__).resolve().parents[2] / "lightning_autopipe"
PLANNER = "lightning_autopipe.planner"


def _graph() -> dict[str, set[str]]:
    mods = {}
    for path in sorted((ROOT / "planner").rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    graph = {}
    for name, path in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                deps |= {f"{node.module}.{a.name}" for a in node.names} | {node.module}
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
        # the package itself is where the public names are gathered: importing a submodule
        # runs it first whatever the order, so it is no edge of a circle between modules
        graph[name] = {d for d in deps if d in mods and d not in (name, PLANNER)}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    state: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                found.append([*stack[stack.index(nxt):], nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


def test_no_planner_module_imports_its_way_in_a_circle():
    graph = _graph()
    assert len(graph) > 20  # the walk found the modules
    assert f"{PLANNER}.generators" in graph[f"{PLANNER}.compiled"]  # and their imports
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]


def test_planner_modules_stay_small():
    big = {p.name: n for p in (ROOT / "planner").rglob("*.py")
           if (n := len(p.read_text().splitlines())) > 400}
    assert not big, big


@pytest.mark.parametrize(("kwargs", "says"), [
    ({"kind": "lstm"}, "unknown analytic model kind"),
    ({"kind": "resnet", "layers": 34}, "resnet depth 34"),
    ({"kind": "gpt", "hidden": 100, "heads": 3}, "not divisible by heads"),
    ({"kind": "gpt", "micro_batch_size": 0}, "micro_batch_size >= 1"),
])
def test_bad_analytic_models_raise_the_planner_error(kwargs, says):
    from lightning_autopipe.errors import PlanError

    with pytest.raises(PlanError, match=says):
        analytic_profile(**kwargs)
