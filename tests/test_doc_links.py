"""Every relative link in the READMEs, changelogs and docs/ pages resolves.

A link `[text](path)` or image `![alt](path)` must name an existing file or folder
(relative to the page), and a `#fragment` must name a heading of the target page as
GitHub spells its anchors. External links (http, mailto) are not followed. Reads
text only: well under a second.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted(
    [ROOT / "README.md"]
    + list(ROOT.glob("packages/*/README.md"))
    + list(ROOT.glob("packages/*/CHANGELOG.md"))
    + list(ROOT.glob("docs/*.md"))
)

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
HEADING = re.compile(r"^#{1,6} +(.+?) *#*$", re.M)


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lowercase, punctuation dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading anchor of a markdown page (a repeated heading gets -1, -2, ...)."""
    seen: dict[str, int] = {}
    for heading in HEADING.findall(FENCE.sub("", page.read_text())):
        anchor = github_anchor(heading)
        count = seen.get(anchor, 0)
        seen[anchor] = count + 1
        if count:
            anchor = f"{anchor}-{count}"
        seen.setdefault(anchor, 1)
    return set(seen)


def broken_links(page: Path) -> list[str]:
    """The page's relative links whose file, or heading, does not exist."""
    broken = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, fragment = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        relative = resolved.relative_to(ROOT).as_posix() if resolved.is_relative_to(ROOT) else ""
        if not resolved.exists():
            broken.append(f"{target} (no such file)")
        elif fragment and resolved.suffix == ".md" and fragment not in anchors(resolved):
            broken.append(f"{target} (no heading #{fragment} in {relative or resolved.name})")
    return broken


def test_github_anchor_spelling():
    assert github_anchor("Architecture options (DeepSeek-V2 / V3)") == (
        "architecture-options-deepseek-v2--v3"
    )
    assert github_anchor("The `hlo-report` CLI") == "the-hlo-report-cli"


def test_a_missing_file_and_a_missing_heading_are_reported(tmp_path):
    (tmp_path / "other.md").write_text("# Other\n\n## A heading\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](other.md#a-heading) [gone](nope.md) [bad](other.md#no-such) [web](https://x.y)\n"
        "```\n[in a code block](nope.md)\n```\n"
    )
    assert broken_links(page) == [
        "nope.md (no such file)",
        "other.md#no-such (no heading #no-such in other.md)",
    ]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page):
    assert not broken_links(page), f"{page.relative_to(ROOT)}: {broken_links(page)}"
