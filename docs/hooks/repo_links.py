"""MkDocs hook: README.md as the site's home page, and links to repository files outside ``docs/`` kept working.

The pages are written for GitHub, where a relative link reaches any file of the repository: README.md links
``docs/design.md``, a page links ``../configs/flux_grpo.yaml``. The site keeps both working without a second copy
of any text:

* README.md becomes the home page (``index.md``); its links into ``docs/`` lose the ``docs/`` prefix.
* A link (or image) to a repository file outside ``docs/`` is served as a verbatim copy of that file under
  ``repo/<path>`` in the site, and the link points there.
* A link whose target does not exist is left as written, so MkDocs reports it (an error under ``--strict``).

Only inline links ``[text](target)`` outside fenced code blocks are read; the target is a path relative to the
Markdown file, optionally followed by ``#anchor``. URLs with a scheme and bare ``#anchor`` links pass unchanged.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files, InclusionLevel
from mkdocs.structure.pages import Page

LINK = re.compile(r"(?<=\]\()([^)\s]+)(?=\))")
FENCE = re.compile(r"^[ \t]*(```|~~~).*?^[ \t]*\1", re.MULTILINE | re.DOTALL)
SITE_COPIES = "repo"  # the site folder that holds the copies of repository files
HOME = "index.md"


def _root(config: MkDocsConfig) -> Path:
    return Path(config.config_file_path).resolve().parent


def _source(page_uri: str, config: MkDocsConfig) -> Path:
    """The file a page is read from: README.md for the home page, the repository file for a copy."""
    if page_uri == HOME:
        return _root(config) / "README.md"
    if page_uri.startswith(f"{SITE_COPIES}/"):
        return _root(config) / page_uri.removeprefix(f"{SITE_COPIES}/")
    return Path(config.docs_dir).resolve() / page_uri


def _resolve(target: str, page_uri: str, config: MkDocsConfig) -> tuple[str, Path | None]:
    """(the link as the site needs it, the repository file to copy into the site or None) for one link target."""
    path, hash_, anchor = target.partition("#")
    if not path or "://" in path or path.startswith(("mailto:", "/")):
        return target, None
    docs, root = Path(config.docs_dir).resolve(), _root(config)
    real = (_source(page_uri, config).parent / path).resolve()
    if not real.exists():
        return target, None  # left for MkDocs to report
    page_dir = posixpath.dirname(page_uri)
    if real.is_relative_to(docs):
        site_uri = real.relative_to(docs).as_posix()
        copy = None
    elif real.is_file() and real.is_relative_to(root):
        site_uri = f"{SITE_COPIES}/{real.relative_to(root).as_posix()}"
        copy = real
    else:
        return target, None  # a folder, or outside the repository: MkDocs reports it
    return posixpath.relpath(site_uri, page_dir or ".") + hash_ + anchor, copy


def _rewrite(markdown: str, page_uri: str, config: MkDocsConfig) -> tuple[str, list[Path]]:
    """The page's Markdown with every link resolved for the site, and the repository files it links."""
    copies: list[Path] = []

    def one(match: re.Match) -> str:
        link, copy = _resolve(match.group(1), page_uri, config)
        if copy is not None:
            copies.append(copy)
        return link

    pieces, last = [], 0
    for fence in FENCE.finditer(markdown):  # code blocks are copied untouched
        pieces += [LINK.sub(one, markdown[last:fence.start()]), fence.group(0)]
        last = fence.end()
    pieces.append(LINK.sub(one, markdown[last:]))
    return "".join(pieces), copies


def on_files(files: Files, config: MkDocsConfig) -> Files:
    """Add README.md as the home page and a copy of every repository file a page (or a copied page) links.

    A copied Markdown file renders as a page outside the navigation; its own links are followed in turn.
    """
    if files.get_file_from_path(HOME) is not None:
        raise PluginError(f"docs/{HOME} exists, but the home page is README.md (docs/hooks/repo_links.py)")
    root = _root(config)
    files.append(File.generated(config, HOME, abs_src_path=str(root / "README.md")))
    todo = [file.src_uri for file in files.documentation_pages()]
    while todo:
        page_uri = todo.pop()
        _, copies = _rewrite(_source(page_uri, config).read_text(encoding="utf-8"), page_uri, config)
        for path in copies:
            uri = f"{SITE_COPIES}/{path.relative_to(root).as_posix()}"
            if files.get_file_from_path(uri) is None:
                inclusion = InclusionLevel.NOT_IN_NAV if path.suffix == ".md" else InclusionLevel.UNDEFINED
                files.append(File.generated(config, uri, abs_src_path=str(path), inclusion=inclusion))
                todo += [uri] if path.suffix == ".md" else []
    return files


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    return _rewrite(markdown, page.file.src_uri, config)[0]
