"""The repository's own Python modules, as the tests that read the tree walk them."""

from __future__ import annotations

from pathlib import Path

__all__ = ["ROOT", "modules"]

ROOT = Path(__file__).resolve().parents[2]


def modules(folder: str) -> list[Path]:
    """Every Python module under ``folder``, sorted; hidden folders (the benchmarks' ignored venvs of
    peers, thousands of third-party files) are not ours and are left out."""
    return sorted(path for path in (ROOT / folder).rglob("*.py")
                  if not any(part.startswith(".") for part in path.relative_to(ROOT).parts))
