"""The examples in the docs run, and print what the docs show.

Each listed page's ``>>>`` examples (inside its fenced code blocks) run as
one doctest session, so a page's later examples see its earlier names.
"""

from __future__ import annotations

import doctest
import pathlib
import re

import pytest

DOCS = pathlib.Path(__file__).parent.parent / "docs"
#: pages whose ``>>>`` examples are run
PAGES = ["checking.md", "compiled.md", "per-example.md"]
FENCE = re.compile(r"^```[a-z]*\n(.*?)^```", re.MULTILINE | re.DOTALL)


def _session(text: str) -> str:
    """The page's fenced blocks that hold ``>>>`` examples, one after another
    (a blank line ends each block's last output)."""
    blocks = [b for b in FENCE.findall(text) if b.lstrip().startswith(">>>")]
    return "\n\n".join(blocks)


@pytest.mark.parametrize("page", PAGES)
def test_the_examples_of_a_page_print_what_it_shows(page):
    text = _session((DOCS / page).read_text())
    assert ">>>" in text, f"docs/{page} has no >>> examples"
    parser = doctest.DocTestParser()
    test = parser.get_doctest(text, {}, page, str(DOCS / page), 0)
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    runner = doctest.DocTestRunner(optionflags=flags)
    found: list[str] = []
    runner.run(test, out=found.append)
    assert runner.failures == 0, "".join(found)


def test_the_ci_docs_build_counts_warnings():
    """``mkdocs build --quiet`` raises the log level above WARNING, so
    ``--strict`` then fails on none (14 griffe warnings went unseen)."""
    ci = (DOCS.parent / ".ci" / "run").read_text()
    builds = [line for line in ci.splitlines() if "mkdocs build" in line]
    assert builds, ".ci/run builds no docs"
    for line in builds:
        assert "--strict" in line and "--quiet" not in line and " -q" not in line, line
