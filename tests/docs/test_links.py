"""The README and the pages under docs/: every relative link reaches a file of the repository, and every #anchor a
heading of its page, as GitHub renders them. The site build (`mkdocs build --strict`, run by .ci/run) checks the
same links again with MkDocs; these tests need no MkDocs and run in the suite.

Anchors are GitHub's: the heading's text (code, emphasis and link markup dropped) in lower case, every character
other than a letter, digit, mark, space, hyphen or underscore removed, each space a hyphen, a repeated anchor
suffixed -1, -2, … (github-slugger's rules). mkdocs.yml gives the site the same anchors (pymdownx.slugs).
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
PAGES = sorted([REPO / "README.md", *DOCS.rglob("*.md")])
README_LIMIT = 12_288  # bytes: the README is an entry over the docs site, not the docs

FENCE = re.compile(r"^[ \t]*(```|~~~).*?^[ \t]*\1[^\n]*$", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"(`+).*?\1", re.DOTALL)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(([^()\s]+)\)")


def _prose(text: str) -> str:
    """The Markdown outside fenced code blocks and inline code, where a link is a link."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def github_slug(heading: str) -> str:
    """GitHub's anchor of a heading's text: 'GCPO / Chunk-GRPO (xingzhejun/GCPO)' -> 'gcpo--chunk-grpo-xingzhejungcpo'.

    Raises nothing; an empty heading gives ''.
    """
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link counts by its text
    text = text.replace("`", "").replace("**", "").lower()
    kept = (c for c in text if c.isalnum() or c in "-_ " or unicodedata.category(c).startswith("M"))
    return "".join(kept).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every anchor a reader can link on a page: one per heading, repeats suffixed as GitHub does."""
    seen: dict[str, int] = {}
    found = set()
    for line in FENCE.sub("", page.read_text(encoding="utf-8")).splitlines():
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        slug = github_slug(match.group(1))
        found.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return found


def broken_links(page: Path, root: Path = REPO) -> list[str]:
    """The page's relative links whose file (in `root`), or whose #anchor in a Markdown file, does not exist."""
    broken = []
    for target in LINK.findall(_prose(page.read_text(encoding="utf-8"))):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.is_file() or not file.is_relative_to(root):
            broken.append(f"{target}: no such file in the repository")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: {file.relative_to(root)} has no heading with anchor #{anchor}")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page):
    assert not broken_links(page), broken_links(page)


def test_the_link_check_catches_a_missing_file_and_a_missing_anchor(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A page\n\n## Flow-GRPO (yifan123/flow_grpo)\n")
    page = tmp_path / "README.md"
    page.write_text("[ok](docs/a.md#flow-grpo-yifan123flow_grpo) [top](#title) `[code](not/a/link.md)`\n\n# Title\n"
                    "[gone](docs/b.md) [no anchor](docs/a.md#flow-grpo) ![img](docs/x.png) [site](https://x.org/y)\n"
                    "```\n[fenced](not/a/link.md)\n```\n")
    assert broken_links(page, tmp_path) == ["docs/b.md: no such file in the repository",
                                  "docs/a.md#flow-grpo: docs/a.md has no heading with anchor #flow-grpo",
                                  "docs/x.png: no such file in the repository"]


@pytest.mark.parametrize("heading, slug", [
    ("GCPO / Chunk-GRPO (xingzhejun/GCPO)", "gcpo--chunk-grpo-xingzhejungcpo"),
    ("Learning table (`bench/learning.py`)", "learning-table-benchlearningpy"),
    ("Checkpoints, resuming, the model card", "checkpoints-resuming-the-model-card"),
    ("The transition (σ = 1 is noise; `dt = σ_next − σ < 0`; float32 arithmetic)",
     "the-transition-σ--1-is-noise-dt--σ_next--σ--0-float32-arithmetic"),
])
def test_github_slug(heading, slug):
    assert github_slug(heading) == slug  # as github.com renders these headings' anchors


def test_the_site_uses_the_same_anchors_as_github():
    slugs = pytest.importorskip("pymdownx.slugs")
    assert "slugify: !!python/object/apply:pymdownx.slugs.slugify {kwds: {case: lower}}" in (
        REPO / "mkdocs.yml").read_text(encoding="utf-8")
    site_slug = slugs.slugify(case="lower")  # the slugify mkdocs.yml names
    for page in PAGES:
        for line in FENCE.sub("", page.read_text(encoding="utf-8")).splitlines():
            if re.match(r"#{1,6}\s", line):
                text = line.lstrip("#").strip()
                rendered = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text).replace("`", "").replace("**", "")
                assert site_slug(rendered, "-") == github_slug(text), (page.name, text)


def test_every_page_is_in_the_site_navigation():
    nav = (REPO / "mkdocs.yml").read_text(encoding="utf-8").split("\nnav:\n", 1)[1]
    listed = set(re.findall(r":\s*(\S+\.md)\s*$", nav, flags=re.MULTILINE))
    on_disk = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")} | {"index.md"}  # index.md: the README
    assert listed == on_disk, f"not in the nav: {on_disk - listed}; nav entries without a page: {listed - on_disk}"


def test_readme_stays_an_entry_over_the_docs():
    size = len((REPO / "README.md").read_bytes())
    assert size <= README_LIMIT, f"README.md is {size} bytes (at most {README_LIMIT}): move detail to docs/"


def test_ci_runs_the_readmes_test_command_verbatim():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    command = next(line for line in readme.splitlines() if line.endswith("python -m pytest -q"))
    assert command in (REPO / ".ci" / "run").read_text(encoding="utf-8").splitlines()


def test_readme_algorithm_table_links_each_release_to_its_fidelity_table():
    text = (REPO / "README.md").read_text(encoding="utf-8")
    table = text[text.index("| algorithm |"): text.index("\n\n", text.index("| algorithm |"))]
    links = re.findall(r"\]\(docs/fidelity\.md#([^)]+)\)", table)
    assert len(links) >= 7
    missing = [a for a in links if a not in anchors(DOCS / "fidelity.md")]
    assert not missing, missing
    fidelity = (DOCS / "fidelity.md").read_text(encoding="utf-8")
    for release in ("yifan123/flow_grpo", "XueZeyue/DanceGRPO", "xingzhejun/GCPO", "Tencent-Hunyuan/MixGRPO",
                    "shengjun-zhang/VisualGRPO", "NVlabs/GDPO"):
        assert f"({release})" in fidelity, release


def test_every_shipped_config_is_listed_in_the_configs_page():
    """docs/configs.md lists every shipped config by its file name (a fresh-eyes run found seven missing, two of
    them cited by the README); the digits variants count as listed through the ``configs/digits_*.yaml`` row."""
    root = Path(__file__).resolve().parents[2]
    page = (root / "docs" / "configs.md").read_text()
    missing = [p.name for p in sorted((root / "configs").glob("*.yaml"))
               if p.name not in page and not p.name.startswith("digits_")]
    assert not missing, f"configs not listed in docs/configs.md: {missing}"
