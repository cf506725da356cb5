"""protocol/ stays pure: no reactor, sockets, threads, clock reads or OS randomness, and strictly typed.

The check parses every module with :mod:`ast` (a regex passed ``from time
import monotonic``, ``os.urandom``, ``random.random()`` and ``from infx ...``):
every import must be on an allow-list of pure modules, and a few names of
otherwise allowed modules are forbidden where they read the clock, the OS's
entropy or do I/O. A ``random.Random`` that the caller passes in is fine;
the module-level ``random.*`` functions and an unseeded ``random.Random()``
(seeded from the OS) are not.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: Pure standard-library modules, allowed by exact name.
PURE_STDLIB = frozenset({
    "__future__", "abc", "base64", "binascii", "bisect", "codecs", "collections", "collections.abc",
    "contextlib", "copy", "dataclasses", "datetime", "decimal", "enum", "fractions", "functools",
    "hashlib", "heapq", "hmac", "http", "ipaddress", "itertools", "json", "math", "numbers",
    "operator", "random", "re", "string", "struct", "textwrap", "types", "typing", "typing_extensions",
    "unicodedata", "urllib.parse", "zlib",
})
#: Packages allowed with all their submodules: the sans-IO h2 stack, protobuf messages, this package.
PURE_PACKAGES = ("h2", "hpack", "hyperframe", "google.protobuf", "protocol")

#: Uses (call or reference) of allowed modules' names that read the clock or the OS.
FORBIDDEN_NAMES = frozenset({
    "datetime.datetime.now", "datetime.datetime.utcnow", "datetime.datetime.today", "datetime.date.today",
})
#: Builtins that do I/O or run code from strings.
FORBIDDEN_BUILTINS = frozenset({"open", "print", "input", "exec", "eval", "__import__", "breakpoint"})

def _module_allowed(module: str) -> bool:
    if module in PURE_STDLIB:
        return True
    return any(module == package or module.startswith(package + ".") for package in PURE_PACKAGES)


def _dotted(node: ast.expr, aliases: dict[str, str]) -> str | None:
    """``a.b.c`` with ``a`` resolved through the module's imports, or None if not rooted in one."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name) or node.id not in aliases:
        return None
    return ".".join([aliases[node.id], *reversed(parts)])


def violations(source: str, filename: str = "<source>") -> list[str]:
    """Every impure import or use in ``source``, as ``file:line: what``."""
    tree = ast.parse(source, filename)
    found: list[str] = []
    aliases: dict[str, str] = {}

    def offend(node: ast.AST, what: str) -> None:
        found.append(f"{filename}:{getattr(node, 'lineno', 0)}: {what}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if not _module_allowed(alias.name):
                    offend(node, f"import {alias.name} (not a pure module)")
                if alias.asname:
                    aliases[alias.asname] = alias.name
                else:
                    top = alias.name.split(".")[0]
                    aliases[top] = top
        elif isinstance(node, ast.ImportFrom):
            module = "protocol" if node.level else (node.module or "")
            if not _module_allowed(module):
                offend(node, f"from {module} import ... (not a pure module)")
            for alias in node.names:
                aliases[alias.asname or alias.name] = f"{module}.{alias.name}"
    # Uses are checked against the whole module's imports (an import may follow its use in a function).
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id not in aliases:
            if node.func.id in FORBIDDEN_BUILTINS:
                offend(node, f"{node.func.id}() does I/O or runs code")
        if isinstance(node, ast.Call):
            name = _dotted(node.func, aliases)
            if name == "random.Random" and not node.args and not node.keywords:
                offend(node, "random.Random() without a seed reads the OS's entropy")
        if isinstance(node, (ast.Attribute, ast.Name)) and isinstance(node.ctx, ast.Load):
            name = _dotted(node, aliases)
            if name is None:
                continue
            if name in FORBIDDEN_NAMES:
                offend(node, f"{name} reads the clock")
            elif name.startswith("random.") and name.split(".")[1] != "Random":
                offend(node, f"{name} uses the module's shared, OS-seeded generator")
    return found


def _protocol_sources() -> list[Path]:
    return sorted(
        path for path in (ROOT / "protocol").rglob("*.py")
        if "pb" not in path.relative_to(ROOT / "protocol").parts
    )


def test_protocol_package_imports_only_pure_modules_and_uses_no_clock_or_os_randomness():
    offenders = [found for path in _protocol_sources()
                 for found in violations(path.read_text(), str(path.relative_to(ROOT)))]
    assert offenders == []


def test_the_check_reads_every_protocol_module():
    names = {path.relative_to(ROOT / "protocol").as_posix() for path in _protocol_sources()}
    assert {"grpc/connection.py", "processor/core.py", "agent/core.py", "openai/sse.py"} <= names
    assert not any("pb" in path.parts[-2:-1] for path in _protocol_sources())


def test_the_check_walks_every_subpackage_of_protocol_but_the_generated_messages():
    packages = {path.parent for path in (ROOT / "protocol").rglob("__init__.py")}
    walked = {path.parent for path in _protocol_sources()}
    assert packages - walked == {ROOT / "protocol" / "pb", ROOT / "protocol" / "pb" / "grpc_testing"}
    assert ROOT / "protocol" / "grpc" in walked


@pytest.mark.parametrize("source", [
    "import time",
    "from time import monotonic",
    "import time as t\nt.monotonic()",
    "import os",
    "import os\nos.urandom(8)",
    "from os import urandom",
    "import os.path",
    "import socket",
    "import threading",
    "import asyncio",
    "import uuid\nuuid.uuid4()",
    "from uuid import uuid4",
    "import sys",
    "import select",
    "import subprocess",
    "import importlib",
    "import http.client",
    "import twisted",
    "from twisted.internet import reactor",
    "import twisted.internet.task",
    "import infx",
    "from infx.http.api import Gateway",
    "import infx.transport as transport",
    "import datetime\ndatetime.datetime.now()",
    "from datetime import datetime\ndatetime.now()",
    "from datetime import datetime as clock\nclock.utcnow()",
    "import datetime as dt\ndt.date.today()",
    "import random\nrandom.random()",
    "import random\nrandom.choice([1, 2])",
    "import random as r\nr.shuffle([])",
    "from random import choice\nchoice([1])",
    "from random import random\nx = random()",
    "import random\nrandom.Random()",
    "from random import Random\nRandom()",
    "import random\npick = random.randrange",
    "import random\nrandom.SystemRandom(7)",
    "open('x')",
    "print('x')",
    "def f():\n    return time.time()\nimport time",
])
def test_the_check_refuses_each_forbidden_form(source):
    assert violations(source) != [], source


@pytest.mark.parametrize("source", [
    "import random\ndef jitter(rng: random.Random) -> float:\n    return rng.random()",
    "from random import Random\nrng = Random(7)",
    "import random\nrng = random.Random(seed)",
    "import datetime as _dt\n_dt.datetime.fromtimestamp(0, _dt.timezone.utc)",
    "from datetime import datetime\ndatetime.fromisoformat('2026-01-01')",
    "from h2.connection import H2Connection\nfrom hpack.table import HeaderTable\nimport hyperframe.frame",
    "from google.protobuf import descriptor",
    "from protocol.pb import worker_pb2\nfrom . import sse\nfrom .openai_errors import OpenAIError",
    "import json, math, heapq, struct, re, hashlib, base64, binascii, bisect, zlib",
    "from collections.abc import Mapping\nfrom dataclasses import dataclass\nfrom enum import Enum",
    "from http import HTTPStatus\nfrom urllib.parse import urlsplit",
    "def f(now: float) -> float:\n    return now + 1.0",
])
def test_the_check_allows_pure_code(source):
    assert violations(source) == []


def test_protocol_package_passes_mypy_strict():
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "setup.cfg"), "-p", "protocol"],
        cwd=ROOT, capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
