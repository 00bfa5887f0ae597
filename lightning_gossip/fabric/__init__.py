"""Lightning Fabric strategies over the gossip engines: ``Fabric(strategy="dpsgd")``,
``"adpsgd"`` and ``"adpsgd_random"`` (registered on ``import lightning_gossip``, like the
Trainer's names), and the classes :class:`FabricDPSGDStrategy` and
:class:`FabricADPSGDStrategy` with their options. See ``docs/fabric.md``.
"""

from __future__ import annotations

import sys
from typing import Any

from lightning_gossip.fabric.strategies import (
    FabricADPSGDStrategy,
    FabricDPSGDStrategy,
    FabricGossipStrategy,
)

__all__ = ["FabricADPSGDStrategy", "FabricDPSGDStrategy", "FabricGossipStrategy",
           "register_fabric"]


def register_fabric(strategy_registry: Any = None) -> None:
    """Register the Fabric strategy names in ``strategy_registry`` (default: Fabric's
    ``STRATEGY_REGISTRY``). Idempotent."""
    if strategy_registry is None:
        from lightning.fabric.strategies import STRATEGY_REGISTRY

        strategy_registry = STRATEGY_REGISTRY
    for cls in (FabricDPSGDStrategy, FabricADPSGDStrategy):
        cls.register_strategies(strategy_registry)


if "lightning.pytorch" in sys.modules:
    # The Trainer's names are registered once lightning.pytorch is imported; Fabric's follow
    # them here when this package was the one importing Lightning (see strategies.register_all).
    register_fabric()
