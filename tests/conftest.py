"""Test tiers: every test is one of ``pure``, ``loopback``, ``e2e`` or ``hostile``, and may also be ``slow``.

- ``pure``: tests/protocol/, the sans-IO machines; needs only setup.cfg's ``pure`` extra
  (h2, protobuf, hypothesis, pytest), which is what ``tools/test --fast`` installs and runs.
- ``loopback``: one process with the whole test venv: Twisted on loopback sockets, fakes in
  memory, and peers' libraries in process (the openai and kubernetes clients, grpcio on threads).
- ``e2e``: real child processes: ``twistd infx``, ``twistd infx-engine``, runtimes, the tools.
- ``hostile``: tests/hostile/, attacks, fuzzing and hostile peers.
- ``slow``: beside its tier, a test that takes long (``-m "not slow"`` leaves it out).

The folder gives the tier (``FOLDER_TIERS``); where a folder holds more than one kind, a module's
``pytestmark`` or a test's own mark says it (one tier mark per test at most: ``-m`` matches every
mark a test carries). A folder in ``ONE_TIER`` holds its tier only.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import settings

# No test is timed (speed belongs in tools/bench/): hypothesis's per-example deadline failed a pure
# test whose first example took 1.5 s on a loaded machine and 0.5 ms when replayed.
settings.register_profile("infx", deadline=None)
settings.load_profile("infx")

TIERS = ("pure", "loopback", "e2e", "hostile")
TESTS = Path(__file__).resolve().parent

#: Each top folder's tier, for a test that names none itself ("" is tests/ itself).
FOLDER_TIERS = {
    "protocol": "pure",
    "infx": "loopback",
    "e2e": "e2e",
    "interop": "loopback",
    "hostile": "hostile",
    "sim": "loopback",
    "bench": "loopback",
    "packaging": "loopback",
    "harness": "loopback",
    "": "loopback",
}
#: Folders whose every test is the folder's tier: tools/test --fast collects tests/protocol/ alone.
ONE_TIER = frozenset({"protocol", "e2e", "hostile"})


def tier_of(item: pytest.Item) -> str:
    """The test's own tier mark (its module's or its own), else its folder's tier."""
    parts = Path(item.path).resolve().relative_to(TESTS).parts
    folder = parts[0] if len(parts) > 1 else ""
    if folder not in FOLDER_TIERS:
        raise pytest.UsageError(f"{item.nodeid}: tests/{folder}/ has no tier in tests/conftest.py FOLDER_TIERS")
    own = {mark.name for mark in item.iter_markers() if mark.name in TIERS}
    if len(own) > 1:
        raise pytest.UsageError(f"{item.nodeid}: marked with more than one tier ({', '.join(sorted(own))})")
    tier = own.pop() if own else FOLDER_TIERS[folder]
    if folder in ONE_TIER and tier != FOLDER_TIERS[folder]:
        raise pytest.UsageError(f"{item.nodeid}: marked {tier}, but tests/{folder}/ holds {FOLDER_TIERS[folder]} tests only")
    return tier


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        tier = tier_of(item)
        if not any(mark.name == tier for mark in item.iter_markers()):
            item.add_marker(tier)
