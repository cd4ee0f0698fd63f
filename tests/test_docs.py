"""The docs say what is true now, in lines a reader can follow: no line over 160 characters, and no work-log
(dates, issue or session numbers) outside the journal, in the docs, the README or the comments of ``src/``.
History belongs in ``docs/JOURNAL.md``."""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
JOURNAL = ROOT / "docs" / "JOURNAL.md"
MAX_LINE = 160
# A date, an issue or session number, a trust-work version: the marks of a work log.
WORK_LOG = re.compile(r"(?<!\d)20\d\d-\d\d-\d\d(?!\d)|\b[Ii]ssues? #?\d+|\b[Ss]ession \d+|\b[Tt]rust v\d\b")


# Pages another change rewrites in the present tense; checked once that lands.
PENDING: set[str] = set()  # docs still being rewritten, skipped by the checks below


def docs() -> list[Path]:
    """Every Markdown page a reader is sent to: the README, docs/, and the benchmarks' and experiments' pages."""
    pages = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name not in PENDING)]
    pages += [p for p in (ROOT / "benchmarks" / "RESULTS.md", ROOT / "experiments" / "README.md") if p.exists()]
    return pages


def table_row(line: str) -> bool:
    return line.lstrip().startswith("|")


@pytest.mark.parametrize("page", docs(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_doc_line_is_over_160_characters(page):
    long = [(n, len(line)) for n, line in enumerate(page.read_text().splitlines(), 1) if len(line) > MAX_LINE]
    # The journal keeps its tables and headings as they were written; every other page, and the journal's prose, wraps.
    if page == JOURNAL:
        lines = page.read_text().splitlines()
        long = [(n, width) for n, width in long if not (table_row(lines[n - 1]) or lines[n - 1].startswith("#"))]
    assert not long, f"{page.relative_to(ROOT)}: lines over {MAX_LINE} characters (line, length): {long[:20]}"


@pytest.mark.parametrize("page", [p for p in docs() if p != JOURNAL], ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_carry_no_work_log(page):
    found = [(n, m.group(0)) for n, line in enumerate(page.read_text().splitlines(), 1) for m in WORK_LOG.finditer(line)]
    assert not found, f"{page.relative_to(ROOT)}: work-log marks belong in docs/JOURNAL.md (line, text): {found[:20]}"


def comments_and_docstrings(path: Path) -> list[tuple[int, str]]:
    """The comments and docstrings of a Python file, with their first line numbers."""
    text = path.read_text()
    out = []
    previous = None
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.COMMENT:
            out.append((token.start[0], token.string))
        elif token.type == tokenize.STRING and previous in (None, tokenize.INDENT, tokenize.NEWLINE, tokenize.DEDENT):
            out.append((token.start[0], token.string))  # a string standing alone: a docstring
        if token.type not in (tokenize.NL, tokenize.COMMENT):
            previous = token.type
    return out


def test_src_comments_carry_no_work_log():
    found = []
    for path in sorted((ROOT / "src").rglob("*.py")):
        for line, text in comments_and_docstrings(path):
            found += [f"{path.relative_to(ROOT)}:{line}: {m.group(0)}" for m in WORK_LOG.finditer(text)]
    assert not found, "comments say why in the present tense; history goes to docs/JOURNAL.md:\n" + "\n".join(found)


def test_every_doc_is_in_the_readme_index():
    readme = (ROOT / "README.md").read_text()
    missing = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if f"docs/{p.name}" not in readme]
    assert not missing, f"README's 'Where next' does not link {missing}"


def test_doc_links_point_inside_the_repository():
    link = re.compile(r"\]\(([^)#\s]+)")
    broken = []
    for page in docs():
        for target in link.findall(page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            resolved = (page.parent / target).resolve()
            if not resolved.is_relative_to(ROOT) or not resolved.exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, broken
