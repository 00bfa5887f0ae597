"""lightning-gossip: decentralized data-parallel training for PyTorch Lightning.

Importing the package registers its strategies with Lightning, so that

    import lightning_gossip
    trainer = Trainer(strategy="dpsgd", accelerator="cpu", devices=4)

works (Lightning does not discover external strategies by itself). The names are
``"dpsgd"``, ``"adpsgd"`` and ``"adpsgd_random"``; each class registers its own in its
``register_strategies`` classmethod, Lightning's pattern.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_gossip import topology
from lightning_gossip.strategies import ADPSGDStrategy, DPSGDStrategy, GossipStrategy
from lightning_gossip.topology import Topology, build

__version__ = "0.1.0"

__all__ = [
    "ADPSGDStrategy",
    "DPSGDStrategy",
    "GossipStrategy",
    "Topology",
    "build",
    "topology",
    "__version__",
]

for _cls in (DPSGDStrategy, ADPSGDStrategy):
    _cls.register_strategies(StrategyRegistry)
del _cls
