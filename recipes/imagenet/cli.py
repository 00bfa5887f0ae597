"""LightningCLI of the ImageNet recipe: ``python -m recipes.imagenet fit --config ...``.

Importing :mod:`lightning_gossip` registers the strategy names ``dpsgd`` and ``adpsgd`` with
Lightning, so ``--trainer.strategy=dpsgd`` works next to the built-in ``ddp``.
"""

from __future__ import annotations

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

import lightning_gossip  # noqa: F401  (registers the strategy names "dpsgd" and "adpsgd")
from recipes.imagenet.classifier import ImageClassifier
from recipes.imagenet.datamodule import ImageFolderDataModule


class ImageNetCLI(LightningCLI):
    """LightningCLI for :class:`ImageClassifier` on :class:`ImageFolderDataModule`.

    ``data.num_classes`` and ``data.batch_size`` are the single source of the model's
    ``num_classes`` and ``batch_size_per_device`` (the latter feeds the linear scaling rule).
    """

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        """Link the data settings the model needs."""
        parser.link_arguments("data.num_classes", "model.num_classes")
        parser.link_arguments("data.batch_size", "model.batch_size_per_device")


def main(args: list[str] | None = None, run: bool = True) -> ImageNetCLI:
    """Build the CLI from ``args`` (``sys.argv`` if ``None``); if ``run``, run the subcommand."""
    return ImageNetCLI(
        ImageClassifier,
        ImageFolderDataModule,
        args=args,
        run=run,
        save_config_kwargs={"overwrite": True},
    )
