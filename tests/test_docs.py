"""The README stays the entry point and the docs stay true to the tree: it opens with the two
commands, its folder map and architecture picture name what exists and every subpackage, its
tier table names every tier, and every relative link in README.md and docs/ leads to a file."""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import TIERS

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))


def _section(text: str, heading: str) -> str:
    """From ``heading`` (a whole line) to the next heading of its level or above."""
    start = text.index(f"\n{heading}\n")
    level = heading.split(" ", 1)[0]
    ends = [m.start() for m in re.finditer(r"\n(#+) ", text[start + 1:]) if len(m.group(1)) <= len(level)]
    return text[start:start + 1 + ends[0]] if ends else text[start:]


def _unfenced(text: str) -> str:
    """``text`` without its fenced code blocks (a link in a code block is not a link)."""
    return re.sub(r"^```.*?^```$", "", text, flags=re.M | re.S)


def test_the_readme_opens_with_the_two_commands():
    assert README.read_text().startswith("# infx\n\n```\ntools/run\ntools/test\n```\n")


def test_running_it_for_real_is_on_the_readmes_first_screen():
    lines = README.read_text().splitlines()
    heading = lines.index("## Running it for real")
    assert heading < 60
    assert "](docs/operations.md)" in "\n".join(lines[heading:heading + 5])


def _folder_map() -> list[tuple[str, str]]:
    """The Layout table's rows: (path, what)."""
    rows = re.findall(r"^\| `([^`]+)` \| (.*) \|$", _section(README.read_text(), "## Layout"), flags=re.M)
    assert len(rows) > 20
    return rows


def test_the_folder_map_names_every_subpackage_of_protocol_and_infx():
    listed = {path for path, _ in _folder_map()}
    packages = {path.parent.relative_to(ROOT).as_posix() + "/"
                for top in ("protocol", "infx") for path in (ROOT / top).rglob("__init__.py")}
    assert sorted(packages - {"protocol/pb/grpc_testing/"} - listed) == []
    assert {"harness/", "tests/", "tools/"} <= listed


def _missing(rows: list[tuple[str, str]]) -> list[str]:
    """A row's path, and each file (``x.py``) or folder (``x/``) its description names, that is
    found neither from the checkout's root nor from the row's own folder."""
    missing = []
    for path, what in rows:
        if not (ROOT / path).exists():
            missing.append(path)
        folder = ROOT / path if path.endswith("/") else (ROOT / path).parent
        for name in re.findall(r"`([\w./-]+(?:\.py|/))`", what):
            if not ((ROOT / name).exists() or (folder / name).exists()):
                missing.append(f"{path}: {name}")
    return missing


def test_every_path_the_folder_map_names_exists():
    assert _missing(_folder_map()) == []


def test_the_folder_map_check_sees_a_path_that_does_not_exist():
    rows = [("protocol/grpc/", "`connection.py`, `gone.py`"), ("protocol/nowhere/", "`errors.py`")]
    assert _missing(rows) == ["protocol/grpc/: gone.py", "protocol/nowhere/", "protocol/nowhere/: errors.py"]


def test_every_path_the_architecture_picture_names_exists():
    """Left of ``infx/`` in the picture is ``protocol/``, right of it ``infx/``."""
    picture = re.search(r"^```\n( protocol/ \(pure\).*?)^```$", README.read_text(), flags=re.M | re.S)
    assert picture
    lines = picture.group(1).splitlines()
    split = lines[0].index("infx/ (Twisted)")
    named = [(("protocol" if m.start() < split else "infx"), m.group())
             for line in lines[1:] for m in re.finditer(r"\b[a-z_]+(?:/[a-z_]+)*(?:/|\.py)", line)]
    assert len(named) > 20
    assert [f"{top}/{name}" for top, name in named if not (ROOT / top / name).exists()] == []


def test_the_readme_says_how_to_run_every_tier():
    table = _section(README.read_text(), "## How it is tested")
    assert "`tools/test --fast`" in table
    assert [tier for tier in (*TIERS, "slow") if f"| `{tier}` |" not in table] == []
    assert [tier for tier in TIERS[1:] if f"`tools/test -m {tier}`" not in table] == []


def _broken_links(page: Path, text: str) -> list[str]:
    """The relative link targets of ``text`` (read as ``page``) that lead to no file of the repository."""
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", _unfenced(text)):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = (page.parent / target.split("#", 1)[0]).resolve()
        if not (path.is_relative_to(ROOT) and path.exists()):
            broken.append(target)
    return broken


def test_every_relative_link_in_the_readme_and_docs_leads_to_a_file_of_the_repository():
    assert {page.name: _broken_links(page, page.read_text()) for page in (README, *DOCS)} == {
        page.name: [] for page in (README, *DOCS)}


def test_the_link_check_sees_a_broken_link():
    text = "[ops](operations.md#peers), [gone](gone.md), [up](../../outside.md), [web](https://x.org/a.md)\n```\n[code](not-a-link.md)\n```\n"
    assert _broken_links(ROOT / "docs" / "page.md", text) == ["gone.md", "../../outside.md"]


def test_the_readme_links_every_docs_page():
    readme = README.read_text()
    assert [page.name for page in DOCS if f"](docs/{page.name})" not in readme] == []
