"""The code keeps the shape issue #23 gave it: no module of protocol/ or infx/ over ~600 lines
without the reason in its docstring, no private name imported across files, and no two classes
of one name in protocol/, infx/ and harness/ (one name per thing)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.support.tree import ROOT, modules

#: Past this many lines a module says why it is one module (``Size (over 600 lines): ...``).
MAX_LINES = 600
FIRST_PARTY = ("protocol", "infx", "harness", "tools", "tests")


def _modules(*folders: str) -> list[Path]:
    """Every Python module of ``folders`` (:func:`tests.support.tree.modules`), generated protobuf code left out."""
    return sorted(p for folder in folders for p in modules(folder) if "pb" not in p.relative_to(ROOT).parts)


def long_modules() -> dict[str, str]:
    """Modules of protocol/ and infx/ over MAX_LINES, with the reason their docstring gives ("" if none)."""
    found = {}
    for path in _modules("protocol", "infx"):
        if len(path.read_text().splitlines()) > MAX_LINES:
            doc = ast.get_docstring(ast.parse(path.read_text())) or ""
            match = re.search(r"^Size \(over 600 lines\): (.+?)(?:\n\n|\Z)", doc, re.M | re.S)
            found[path.relative_to(ROOT).as_posix()] = " ".join(match.group(1).split()) if match else ""
    return found


def test_a_module_over_600_lines_says_why_in_its_docstring():
    modules = long_modules()
    print("\n".join(f"{path}: {reason}" for path, reason in sorted(modules.items())))  # the list, with -s
    assert [path for path, reason in modules.items() if not reason] == []


def _is_module(dotted: str) -> bool:
    path = ROOT.joinpath(*dotted.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def private_imports(path: Path) -> list[str]:
    """Where ``path`` takes a private name (``_x``, not ``__x__``) of another first-party module:
    ``from m import _x``, or ``m._x`` on a module it imported."""
    tree = ast.parse(path.read_text())
    found: list[str] = []
    modules: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.split(".")[0] in FIRST_PARTY:
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(f"{node.lineno}: from {node.module} import {alias.name}")
                elif _is_module(f"{node.module}.{alias.name}"):
                    modules[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in FIRST_PARTY and alias.asname:
                    modules[alias.asname] = alias.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules \
                and node.attr.startswith("_") and not node.attr.startswith("__"):
            found.append(f"{node.lineno}: {modules[node.value.id]}.{node.attr}")
    return found


def test_no_private_name_is_imported_across_files():
    """What a file keeps private stays in it: a part that another file needs is public, and
    says so. Tests may still reach the private helpers of the module they test (tests/)."""
    offenders = {path.relative_to(ROOT).as_posix(): private_imports(path)
                 for path in _modules("protocol", "infx", "harness", "tools")}
    assert {path: found for path, found in offenders.items() if found} == {}


def test_the_checks_see_what_they_forbid(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("from protocol.processor.tasks import _RELEASED_REQUEST\n"
                      "from protocol.processor import tasks\nprint(tasks._RELEASED_REQUEST, tasks.__doc__)\n")
    assert private_imports(sample) == ["1: from protocol.processor.tasks import _RELEASED_REQUEST",
                                       "3: protocol.processor.tasks._RELEASED_REQUEST"]


def classes_by_name(*folders: str) -> dict[str, list[str]]:
    """Every class (nested ones too) of ``folders``, by name: where each is defined."""
    found: dict[str, list[str]] = {}
    for path in _modules(*folders):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                found.setdefault(node.name, []).append(f"{path.relative_to(ROOT).as_posix()}:{node.lineno}")
    return found


def test_no_two_classes_share_a_name():
    """A reader (and a log line, a traceback, a grep) can tell which class a name means. A class
    that plays the part of another (the simulation's gateway) says so in its name (``SimGateway``)."""
    classes = classes_by_name("protocol", "infx", "harness")
    assert len(classes) > 300  # the walk sees the tree
    assert {name: where for name, where in classes.items() if len(where) > 1} == {}
