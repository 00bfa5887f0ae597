"""docs/architecture.md's "Where is ..." table points at code that exists, where it says.

Every row names one behaviour and, in backticks, the ``lightning_gossip.module.symbol`` names
that implement it. Each name is imported (``importlib``, then ``getattr``) and must be defined
in the module it names: a class or function by its ``__module__``, a method in the class's own
body (not inherited), so a name that moved to another file fails here. No process is launched
(the strategies' modules import Lightning).
"""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"
HEADING = "## Where is ..."
NAME = re.compile(r"`(lightning_gossip(?:\.\w+)+)`")


def table_rows() -> list[tuple[str, list[str]]]:
    """``(behaviour, names)`` of every row of the table under :data:`HEADING`."""
    text = DOC.read_text()
    assert text.count(HEADING) == 1, f"{DOC} has no single {HEADING!r} section"
    section = text.split(HEADING, 1)[1].split("\n## ", 1)[0]
    lines = [ln.strip() for ln in section.splitlines() if ln.strip().startswith("|")]
    rows = []
    for line in lines[2:]:  # after the header and the |---| line
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert len(cells) == 2, line
        rows.append((cells[0], NAME.findall(cells[1])))
    return rows


ROWS = table_rows()
NAMES = sorted({name for _, names in ROWS for name in names})


def resolve(dotted: str) -> tuple[ModuleType, list[Any]]:
    """The longest importable module prefix of ``dotted`` and the chain of objects after it."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            module = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError as e:
            if not ".".join(parts[:cut]).startswith(e.name or "<none>"):
                raise  # a module that exists failed to import
            continue
        chain: list[Any] = [module]
        for attr in parts[cut:]:
            assert hasattr(chain[-1], attr), f"{dotted}: {chain[-1]!r} has no {attr!r}"
            chain.append(getattr(chain[-1], attr))
        return module, chain[1:]
    raise AssertionError(f"{dotted}: no importable module")


def test_the_table_has_rows_that_each_name_code():
    assert 20 <= len(ROWS) <= 40, len(ROWS)
    empty = [what for what, names in ROWS if not names]
    assert empty == [], f"rows that name no lightning_gossip.module.symbol: {empty}"


def test_the_table_covers_what_the_issue_asked_for():
    """Hierarchical AD-PSGD, liveness and the wire (issue 21), by the names that do them."""
    for name in ("lightning_gossip.pairing.ColumnPairing",
                 "lightning_gossip.liveness.heartbeat.Heartbeat.silent",
                 "lightning_gossip.liveness.waits.blame",
                 "lightning_gossip.compression.quantize",
                 "lightning_gossip.async_gossip.loops.GossipLoop.exchange"):
        assert name in NAMES, name


@pytest.mark.parametrize("dotted", NAMES)
def test_every_named_symbol_is_defined_where_the_table_says(dotted):
    module, chain = resolve(dotted)
    if not chain:
        return  # a module
    owner = chain[-2] if len(chain) > 1 else module
    obj = chain[-1]
    if inspect.isclass(owner):
        name = dotted.rsplit(".", 1)[1]
        assert name in vars(owner), f"{dotted}: inherited, not defined in {owner.__name__}"
        assert owner.__module__ == module.__name__, f"{dotted}: {owner} is in {owner.__module__}"
    elif inspect.isclass(obj) or inspect.isfunction(obj):
        assert obj.__module__ == module.__name__, f"{dotted}: defined in {obj.__module__}"
