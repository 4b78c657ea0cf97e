"""``examples/`` files are complete and are what the README shows (no processes here).

The README's "Use it from your own code" block is ``examples/lightning_module.py`` without its
comment header; ``tests/lightning/_run.py``'s ``readme`` case runs that block on two ranks
(``test_readme_contract_example_runs_on_two_ranks_and_learns``), so the example is run by the
suite as written.
"""

from __future__ import annotations

import ast
import builtins
from pathlib import Path

from tests.lightning._run import readme_example

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "lightning_module.py"


def _code(text: str) -> str:
    return "".join(ln for ln in text.splitlines(True) if not ln.startswith("#")).strip()


def test_the_readme_example_is_the_example_file():
    assert _code(readme_example()) == _code(EXAMPLE.read_text())


def test_the_example_defines_every_name_it_uses():
    """``net`` and ``loader`` were once left to the reader: every name read is bound."""
    tree = ast.parse(EXAMPLE.read_text())
    bound = set(dir(builtins))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.FunctionDef | ast.ClassDef):
            bound.add(node.name)
            if isinstance(node, ast.FunctionDef):
                bound |= {a.arg for a in node.args.args}
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            bound.add(node.id)
        elif isinstance(node, ast.Tuple) and isinstance(node.ctx, ast.Store):
            bound |= {e.id for e in node.elts if isinstance(e, ast.Name)}
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    assert used <= bound, used - bound
    assert {"net", "loader", "trainer"} <= bound
