"""The tree keeps its import rules: tests share helpers only through tests/support/ and harness/,
tools and harness never import tests, and infx and protocol never import either."""

from __future__ import annotations

import ast
import configparser
import re
import sys
from pathlib import Path

from tests.support.tree import ROOT, modules



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
    """Imports of ``forbidden`` packages in ``folder``'s modules."""
    return [f"{path.relative_to(ROOT)}:{line}: {module}"
            for path in modules(folder)
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


def _setup_cfg() -> configparser.ConfigParser:
    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg")
    return setup


def _requirements(text: str) -> dict[str, str]:
    """``name -> whole line`` of a setup.cfg requirement list, comments left out."""
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    return {re.split(r"[\[<>=!~ ]", line, maxsplit=1)[0].lower(): line for line in lines}


#: The import names of the pure extra's distributions (the rest import under their own name).
IMPORT_NAMES = {"protobuf": "google.protobuf", "pytest-timeout": "pytest_timeout"}


def _pure_modules() -> set[str]:
    pure = _requirements(_setup_cfg()["options.extras_require"]["pure"])
    return {IMPORT_NAMES.get(name, name) for name in pure}


def _module_file(module: str) -> Path | None:
    """The checkout's file for a first-party module (``protocol``, ``tests``, ``tools``), else None."""
    base = ROOT.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def test_the_pure_tier_imports_only_the_standard_library_and_the_pure_extra():
    """tools/test --fast installs the pure extra alone: every module tests/protocol/ reaches,
    through tests/support/ and tools/ too, must import nothing else."""
    allowed = _pure_modules() | {"protocol"}
    todo = sorted((ROOT / "tests" / "protocol").rglob("*.py"))
    seen: set[Path] = set()
    offenders = []
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for line, module in _imports(path):
            top = module.split(".")[0]
            if top in sys.stdlib_module_names or top == "__future__" or any(
                    module == name or module.startswith(name + ".") for name in allowed):
                continue
            first_party = _module_file(module)
            if top in ("tests", "tools") and first_party is not None:
                todo.append(first_party)
            elif top in ("tests", "tools") and _module_file(module.rsplit(".", 1)[0]) is not None:
                continue  # a name imported from a first-party module already queued
            else:
                offenders.append(f"{path.relative_to(ROOT)}:{line}: {module}")
    assert offenders == []
    assert ROOT / "tests" / "support" / "processor.py" in seen  # the walk follows support modules


def test_the_pure_extra_asks_for_the_same_versions_as_the_install_and_the_test_extra():
    setup = _setup_cfg()
    everything = {**_requirements(setup["options"]["install_requires"]),
                  **_requirements(setup["options.extras_require"]["test"])}
    pure = _requirements(setup["options.extras_require"]["pure"])
    assert {name: everything.get(name) for name in pure} == pure


def test_setup_cfg_installs_every_package_of_infx_and_protocol_and_nothing_of_the_checkout_else():
    listed = set(_setup_cfg()["options"]["packages"].split())
    packages = {".".join(path.parent.relative_to(ROOT).parts)
                for top in ("infx", "protocol") for path in (ROOT / top).rglob("__init__.py")}
    assert listed == packages | {"twisted.plugins"}


def test_every_test_folder_is_a_package_with_a_tier():
    """A folder without ``__init__.py`` would put itself on sys.path (tests/protocol/openai/ would
    hide the openai library); a folder without a tier fails collection (tests/conftest.py)."""
    from tests.conftest import FOLDER_TIERS

    folders = {path.parent for path in (ROOT / "tests").rglob("test_*.py")}
    assert [str(f.relative_to(ROOT)) for f in sorted(folders) if not (f / "__init__.py").exists()] == []
    tops = {folder.relative_to(ROOT / "tests").parts[0] if folder != ROOT / "tests" else "" for folder in folders}
    assert tops <= set(FOLDER_TIERS)

