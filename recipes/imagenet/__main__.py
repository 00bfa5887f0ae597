"""``python -m recipes.imagenet {fit,validate} --config recipes/imagenet/configs/<name>.yaml``.

Importing :mod:`lightning_gossip` registers the strategy names ``dpsgd`` and ``adpsgd`` with
Lightning, so ``--trainer.strategy=dpsgd`` works next to the built-in ``ddp``.
"""

import lightning_gossip  # noqa: F401  (registers the gossip strategy names)
from recipes.imagenet.cli import main

if __name__ == "__main__":
    main()
