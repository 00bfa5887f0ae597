"""Moved to :mod:`lightning_gossip.elastic.nodes`; kept only because
``benchmarks/perf/elastic_accuracy.py`` imports :class:`NodeUnits` from here (remove it once that
import names :mod:`lightning_gossip.elastic.nodes`)."""

from __future__ import annotations

from lightning_gossip.elastic.nodes import RANKS, NodeUnits

__all__ = ["RANKS", "NodeUnits"]
