"""The documentation: README length, links between pages, the README's set-up command."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").glob("*.md"))
TEST_COMMAND = (
    "python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && "
    "pip install -e '.[mpi,test]' && python -m pytest -q"
)

_FENCE = re.compile(r"^(`{3,}|~{3,}).*?^\1\s*$", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"(`+).+?\1", re.DOTALL)
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)


def _prose(path: Path) -> str:
    """Return a page's text without fenced code blocks."""
    return _FENCE.sub("", path.read_text(encoding="utf-8"))


def slug(heading: str) -> str:
    """Return GitHub's anchor for a heading: lowercase, punctuation dropped, spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Return the anchors of a page's headings, numbered as GitHub numbers repeats."""
    seen: dict[str, int] = {}
    found = set()
    for heading in _HEADING.findall(_prose(path)):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(path: Path) -> list[str]:
    """Return the targets of a page's Markdown links outside code."""
    return _LINK.findall(_CODE_SPAN.sub("", _prose(path)))


def test_readme_is_short() -> None:
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= 300, f"README.md has {lines} lines (at most 300)"


def test_links_resolve() -> None:
    broken = []
    for page in [README, *PAGES]:
        for target in links(page):
            if re.match(r"(https?|mailto):", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            where = f"{page.relative_to(ROOT)}: {target}"
            if not dest.exists():
                broken.append(f"{where} (no such file)")
            elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
                broken.append(f"{where} (no heading with that anchor)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_every_page_is_linked_from_readme() -> None:
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in links(README)}
    missing = [p.relative_to(ROOT).as_posix() for p in PAGES if p.resolve() not in linked]
    assert not missing, f"pages not linked from README.md: {missing}"


def test_readme_test_command_is_what_ci_runs() -> None:
    assert TEST_COMMAND in README.read_text(encoding="utf-8")
    # CI makes its own virtual environment and quiets pip; the rest must match.
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    ci = ci.replace("pip install -q ", "pip install ")
    assert TEST_COMMAND.split(" && ", 2)[2] in ci
