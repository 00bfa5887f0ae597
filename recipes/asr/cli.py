"""LightningCLI of the ASR recipe: ``python -m recipes.asr {fit,validate,test,predict}``."""

from __future__ import annotations

from collections.abc import Sequence

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities import rank_zero_info

import lightning_gossip  # noqa: F401  (registers the "dpsgd"/"adpsgd" strategy names)
from recipes.asr.datamodule import KaldiDataModule
from recipes.asr.features import fbank_dim
from recipes.asr.recognizer import SpeechRecognizer


class ASRCLI(LightningCLI):
    """Links data settings into the model and optionally tests right after fitting.

    ``model.input_dim``, ``model.characters``, ``model.target`` and ``model.num_pdfs`` follow
    the ``data.*`` settings. ``fit --test_after_fit true`` evaluates the best checkpoint (the
    last one if none is monitored) on ``data.test_dir`` in the same run.
    """

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments(("data.num_mel_bins", "data.deltas"), "model.input_dim",
                              compute_fn=fbank_dim)
        parser.link_arguments("data.characters", "model.characters")
        parser.link_arguments("data.target", "model.target")
        parser.link_arguments("data.num_pdfs", "model.num_pdfs")
        parser.add_argument("--test_after_fit", type=bool, default=False,
                            help="fit only: run the test set with the best checkpoint afterwards")

    def after_fit(self) -> None:
        if not self.config_init[self.subcommand].get("test_after_fit"):
            return
        callback = self.trainer.checkpoint_callback
        ckpt = None
        if callback is not None:
            ckpt = callback.best_model_path or callback.last_model_path or None
        rank_zero_info(f"testing checkpoint {ckpt or '(final weights)'}")
        self.trainer.test(self.model, datamodule=self.datamodule, ckpt_path=ckpt)


def main(args: Sequence[str] | None = None) -> ASRCLI:
    """Run the CLI (``args`` defaults to ``sys.argv``)."""
    return ASRCLI(SpeechRecognizer, KaldiDataModule,
                  trainer_defaults={"use_distributed_sampler": False},
                  save_config_kwargs={"overwrite": True},
                  args=list(args) if args is not None else None)
