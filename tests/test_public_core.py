"""The public core listed in docs/api/index.md is what the code offers, no more and no less.

The lists are read from the document, so that a new keyword, name or command that is not
declared there (or a declared one that is gone) fails here.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

import lightning_gossip

DOC = Path(__file__).resolve().parents[1] / "docs" / "api" / "index.md"
LIGHTNING_KEYWORDS = {"accelerator", "parallel_devices", "cluster_environment", "checkpoint_io",
                      "precision_plugin"}


def _section() -> str:
    text = DOC.read_text()
    start = text.index("## The public core")
    return text[start:text.index("\n## ", start + 1)]


def _item(label: str) -> set[str]:
    """The backquoted names of the bullet that starts with ``**label**``."""
    match = re.search(r"^\* \*\*" + re.escape(label) + r"\*\*(.*?)(?=^\* |\Z)", _section(),
                      re.S | re.M)
    assert match, f"docs/api/index.md's public core has no bullet {label!r}"
    return set(re.findall(r"`([^`]+)`", match.group(1)))


def _keywords(cls: type) -> set[str]:
    return set(list(inspect.signature(cls.__init__).parameters)[1:])


def test_top_level_names() -> None:
    assert _item("Top-level names") - {"from lightning_gossip import ..."} == set(
        lightning_gossip.__all__)


@pytest.mark.parametrize("name", ["DPSGDStrategy", "ADPSGDStrategy"])
def test_strategy_keywords(name: str) -> None:
    declared = _item(f"`{name}` keywords") - {"init_args"}
    assert declared | LIGHTNING_KEYWORDS == _keywords(getattr(lightning_gossip, name))


def test_strategy_names_are_registered() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    ours = {name for name, entry in StrategyRegistry.items()
            if entry["strategy"].__module__.startswith("lightning_gossip.")}
    assert _item("Strategy names") - {"import lightning_gossip"} == ours


def test_topology_and_pairing_names() -> None:
    from lightning_gossip.pairing import PAIRINGS
    from lightning_gossip.topology.graphs import TOPOLOGIES

    text = _section()
    topo = re.search(r"\*\*Topology names\*\* \(`topology=`, `build`\):(.*?)\*\*Pairing",
                     text, re.S)
    pairing = re.search(r"\*\*Pairing names\*\* \(`pairing=`\):(.*?)\n\* ", text, re.S)
    assert topo and pairing
    assert set(re.findall(r"`([^`]+)`", topo.group(1))) == set(TOPOLOGIES)
    assert set(re.findall(r"`([^`]+)`", pairing.group(1))) == set(PAIRINGS)


def test_commands() -> None:
    from lightning_gossip.cli import build_parser

    parser = build_parser()
    commands = set(parser._subparsers._group_actions[0].choices)  # argparse keeps them here
    declared = {c.split()[-1] for c in _item("Commands")}
    assert declared == commands
