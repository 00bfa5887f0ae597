"""Lightning strategies for decentralized data-parallel training.

Importing this package registers the strategy names ``"dpsgd"``, ``"adpsgd"`` and
``"adpsgd_random"`` with Lightning's ``StrategyRegistry`` (see :func:`register_all`); the
top-level :mod:`lightning_gossip` arranges for that to happen as soon as ``lightning.pytorch``
is imported, without importing it itself.
"""

from __future__ import annotations

from typing import Any

from lightning_gossip.strategies.adpsgd import ADPSGDStrategy
from lightning_gossip.strategies.dpsgd import DPSGDStrategy
from lightning_gossip.strategies.gossip import GossipStrategy

__all__ = ["ADPSGDStrategy", "DPSGDStrategy", "GossipStrategy", "register_all"]


def register_all(strategy_registry: Any = None) -> None:
    """Register every strategy name of the package in ``strategy_registry`` (default:
    Lightning's ``StrategyRegistry``) through the classes' ``register_strategies``.
    Idempotent: registering again replaces the entries with the same ones. With the default
    registry, Fabric's names are registered too (:mod:`lightning_gossip.fabric`)."""
    if strategy_registry is None:
        import sys

        from lightning.pytorch.strategies import StrategyRegistry

        fabric = sys.modules.get("lightning_gossip.fabric")
        if fabric is None or not getattr(fabric.__spec__, "_initializing", False):
            # While lightning_gossip.fabric is itself being imported (its import of Lightning
            # fired the registering hook), it registers its names when it has finished.
            from lightning_gossip.fabric import register_fabric

            register_fabric()
        strategy_registry = StrategyRegistry
    for cls in (DPSGDStrategy, ADPSGDStrategy):
        cls.register_strategies(strategy_registry)


register_all()
