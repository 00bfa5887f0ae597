"""lightning-gossip: decentralized data-parallel training for PyTorch Lightning.

Importing the package registers its strategies with Lightning, so that

    import lightning_gossip
    trainer = Trainer(strategy="dpsgd", accelerator="cpu", devices=4)

works (Lightning does not discover external strategies by itself).
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_gossip import topology
from lightning_gossip.strategies import ADPSGDStrategy, DPSGDStrategy, GossipStrategy
from lightning_gossip.topology import Topology, build

__version__ = "0.1.0"

__all__ = ["ADPSGDStrategy", "DPSGDStrategy", "GossipStrategy", "Topology", "build", "topology", "__version__"]

StrategyRegistry.register(
    "dpsgd",
    DPSGDStrategy,
    description="Synchronous decentralized parallel SGD (D-PSGD) on a randomized ring",
    override=True,
)
StrategyRegistry.register(
    "adpsgd",
    ADPSGDStrategy,
    description="Asynchronous decentralized parallel SGD (AD-PSGD), ring peer choice",
    override=True,
)
StrategyRegistry.register(
    "adpsgd_random",
    ADPSGDStrategy,
    description="Asynchronous decentralized parallel SGD (AD-PSGD), random peer choice",
    override=True,
    topology="random",
)
