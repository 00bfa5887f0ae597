"""The reference docs stay reference: the front pages keep their size, and the site's pages carry
no date stamps.

Runs, first tries, investigations and campaign narratives belong in
``benchmarks/results/LOG.md`` (and ``benchmarks/results/race/LOG.md``), next to their data; a
reference page states behaviour and settings, and a measurement there cites the record file
that holds its date. The caps are the sizes the pages were cut to (issue 49): a page that needs
more is a sign that a log crept back in. No process is launched.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CAPS = {"README.md": 80, "CHANGELOG.md": 80, "docs/benchmarks.md": 300, "docs/faults.md": 350}
"""Page -> the most lines it may have."""

_MONTH = (r"(?:Jan(?:uary)?|Feb(?:ruary)?|Mar(?:ch)?|Apr(?:il)?|May|June?|July?|Aug(?:ust)?"
          r"|Sep(?:t(?:ember)?)?|Oct(?:ober)?|Nov(?:ember)?|Dec(?:ember)?)\b")
DATE_STAMP = re.compile(
    rf"\b\d{{1,2}}(?:-\d{{1,2}})? {_MONTH}(?: \d{{4}})?"  # 5 Dec 2026, 4-5 Dec 2026, 30 Nov
    rf"|\b{_MONTH} \d{{1,2}}, \d{{4}}"                    # Dec 5, 2026
    rf"|\b{_MONTH} (?:19|20)\d{{2}}\b"                    # Dec 2026, December 2026
    r"|\b(?:19|20)\d{2}-\d{2}-\d{2}\b")                  # 2026-12-05
"""A calendar date in any of the forms the docs used."""

ALLOWED: dict[tuple[str, str], str] = {}
"""``(page, stamp) -> reason`` for a date that must stay on a site page (none today; the
changelog's release dates are in CHANGELOG.md, which is not a site page)."""


def site_pages() -> list[Path]:
    """Every Markdown page of the documentation site (docs/, generated pages included)."""
    return sorted((ROOT / "docs").rglob("*.md"))


def stamps(text: str) -> list[str]:
    """The date stamps in ``text``."""
    return [m.group(0) for m in DATE_STAMP.finditer(text)]


@pytest.mark.parametrize("page", sorted(CAPS))
def test_front_pages_keep_their_size(page: str) -> None:
    lines = (ROOT / page).read_text().count("\n")
    assert lines <= CAPS[page], (
        f"{page} has {lines} lines (cap {CAPS[page]}): move runs and narratives to "
        "benchmarks/results/LOG.md, keep behaviour and settings")


def test_the_site_pages_carry_no_date_stamps() -> None:
    found = []
    for path in site_pages():
        rel = str(path.relative_to(ROOT))
        for n, line in enumerate(path.read_text().splitlines(), 1):
            found += [f"{rel}:{n}: {s!r}" for s in stamps(line) if (rel, s) not in ALLOWED]
    assert found == [], ("date stamps in reference pages (state the behaviour, or cite the record "
                         "that holds the date; dated runs go to benchmarks/results/LOG.md):\n"
                         + "\n".join(found))


def test_every_allowed_stamp_is_still_there() -> None:
    """An allow-list entry whose stamp is gone is removed, so the list stays small and true."""
    for (page, stamp), reason in ALLOWED.items():
        assert reason, (page, stamp)
        assert stamp in stamps((ROOT / page).read_text()), (page, stamp)


@pytest.mark.parametrize("text", ["Tried by hand on 5 Dec 2026.", "(2026-12-05, 10:00 UTC)",
                                  "measured in Dec 2026", "runs of December 2026",
                                  "4-5 Dec 2026, 23:55", "on 30 Nov at load 10", "Dec 5, 2026"])
def test_the_pattern_catches_every_form_the_docs_used(text: str) -> None:
    assert stamps(text), text


@pytest.mark.parametrize("text", ["Decentralized training", "2 Markov chains", "torch 2.9.1",
                                  "lightning 2.6.6", "in 4 Octets", "step 12 of 2026 steps",
                                  "commit `13d986d`", "Sept. is a word here", "10 Decoders"])
def test_the_pattern_leaves_ordinary_text_alone(text: str) -> None:
    assert stamps(text) == [], text
