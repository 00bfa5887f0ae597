"""Lightning strategies for decentralized data-parallel training."""

from lightning_gossip.strategies.adpsgd import ADPSGDStrategy
from lightning_gossip.strategies.dpsgd import DPSGDStrategy
from lightning_gossip.strategies.gossip import GossipStrategy

__all__ = ["ADPSGDStrategy", "DPSGDStrategy", "GossipStrategy"]
