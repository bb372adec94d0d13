"""The suite's own rules (docs/testing.md), where a tool can check them."""

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_every_property_states_its_example_count():
    """Every ``@given`` runs a stated number of examples (``@settings(max_examples=N)``): what a
    property costs is read beside it, and a profile's default cannot change it."""
    unstated = []
    for path in sorted(TESTS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                decorators = [ast.unparse(d) for d in node.decorator_list]
                if any(d.startswith("given(") for d in decorators) and not any(
                        d.startswith("settings(") and "max_examples=" in d for d in decorators):
                    unstated.append(f"{path.relative_to(TESTS)}:{node.lineno} {node.name}")
    assert not unstated, f"@given without @settings(max_examples=N): {unstated}"
