"""The tree keeps its import rules: tests share helpers only through tests/support/ and harness/,
tools and harness never import tests, and infx and protocol never import either."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _imports(path: Path) -> list[tuple[int, str]]:
    """Every module ``path`` imports, absolute, with its line."""
    package = ".".join(path.relative_to(ROOT).parent.parts)
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(part for part in (base, node.module or "") if part)
            found.append((node.lineno, module))
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
    return found


def _offenders(folder: str, forbidden: tuple[str, ...]) -> list[str]:
    return [f"{path.relative_to(ROOT)}:{line}: {module}"
            for path in sorted((ROOT / folder).rglob("*.py"))
            for line, module in _imports(path)
            if module.split(".")[0] in forbidden]


def test_no_test_module_imports_another_test_module():
    offenders = [f"{path.relative_to(ROOT)}:{line}: {module}"
                 for path in sorted((ROOT / "tests").rglob("*.py"))
                 for line, module in _imports(path)
                 if module.startswith("tests.") and any(part.startswith("test_") for part in module.split("."))]
    assert offenders == []


def test_tools_and_harness_never_import_tests():
    assert _offenders("tools", ("tests",)) + _offenders("harness", ("tests",)) == []


def test_infx_and_protocol_never_import_tests_harness_or_tools():
    forbidden = ("tests", "harness", "tools")
    assert _offenders("infx", forbidden) + _offenders("protocol", forbidden) == []


def test_the_checks_see_an_import_of_a_test_module():
    assert any(module == "tests.support.processor" for _, module in _imports(ROOT / "tests" / "protocol" / "processor" / "test_processor.py"))
