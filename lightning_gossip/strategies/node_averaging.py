"""The averaging inside a node of hierarchical gossip lives in
:mod:`lightning_gossip.node_averaging` (no Lightning: the Fabric strategies and ``attach()`` use
it too); its names stay importable from here for the modules that still import them from
``strategies/``."""

from __future__ import annotations

from lightning_gossip.node_averaging import NodeAverager, check_node_layout

__all__ = ["NodeAverager", "check_node_layout"]
