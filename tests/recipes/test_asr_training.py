"""In-process training: frame CE on a tiny alignment file, CTC learning, the CLI configs."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch

from recipes.asr.cli import ASRCLI
from recipes.asr.datamodule import KaldiDataModule
from recipes.asr.dataset import IGNORE_INDEX, UtteranceDataset
from recipes.asr.kaldi_data import DataDirError, load_data_dir
from recipes.asr.recognizer import SpeechRecognizer, subsample_frame_targets
from recipes.asr.vocabulary import CharacterVocabulary
from tests.recipes.asr_corpus import needs_espeak, tiny_corpus_dir

CONFIGS = Path(__file__).resolve().parents[2] / "recipes" / "asr" / "configs"


def quiet_trainer(**kwargs) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False,
                      use_distributed_sampler=False, **kwargs)


def energy_alignments(data_dir: Path, out: Path) -> Path:
    """Kaldi text alignments with 2 'senones': 1 where the frame is loud (speech), else 0."""
    utts, _ = load_data_dir(data_dir)
    ds = UtteranceDataset(utts, CharacterVocabulary())
    lines = []
    for i, u in enumerate(utts):
        loudness = ds.features(i).mean(dim=1)
        labels = (loudness > loudness.min() + 0.5 * (loudness.max() - loudness.min())).long()
        lines.append(f"{u.utt_id} {' '.join(map(str, labels.tolist()))}\n")
    out.write_text("".join(lines))
    return out


def test_subsample_frame_targets_takes_the_middle_frame() -> None:
    targets = torch.tensor([[0, 1, 2, 3, 4, 5, 6], [7, 8, 9, -100, -100, -100, -100]])
    assert subsample_frame_targets(targets, 3).tolist() == [[1, 4, IGNORE_INDEX],
                                                            [8, IGNORE_INDEX, IGNORE_INDEX]]
    assert subsample_frame_targets(targets, 1) is targets


@needs_espeak
def test_frame_ce_on_a_tiny_alignment_file(tmp_path_factory: pytest.TempPathFactory,
                                           tmp_path: Path) -> None:
    corpus = tiny_corpus_dir(tmp_path_factory)
    train_ali = energy_alignments(corpus / "train", tmp_path / "train.ali")
    test_ali = energy_alignments(corpus / "test", tmp_path / "test.ali")

    dm = KaldiDataModule(train_dir=str(corpus / "train"), test_dir=str(corpus / "test"),
                         target="frame_ce", train_alignments=str(train_ali),
                         test_alignments=str(test_ali), num_pdfs=2, batch_size=8,
                         cache_features=True)
    dm.setup("fit")
    example = dm.datasets["train"][0]
    assert example.target.shape == (example.features.shape[0],)
    batch = next(iter(dm.train_dataloader()))
    assert batch.targets.shape == batch.features.shape[:2]
    assert (batch.targets[1:][batch.features[1:].abs().sum(-1) == 0] == IGNORE_INDEX).all()

    torch.manual_seed(0)
    model = SpeechRecognizer(target="frame_ce", num_pdfs=2, num_layers=1, hidden_size=24,
                             frame_stacking=2, lr=0.01, spec_augment=False)
    trainer = quiet_trainer(max_epochs=6)
    trainer.fit(model, datamodule=dm)
    result = trainer.test(model, datamodule=dm, verbose=False)[0]
    test_labels = np.concatenate([np.array(line.split()[1:], dtype=int)
                                  for line in test_ali.read_text().splitlines()])
    majority = max(test_labels.mean(), 1 - test_labels.mean())
    assert result["test_frame_acc"] > max(0.9, majority + 0.05), (result, majority)

    # An alignment that is off by more than the tolerance names the utterance; pdf ids out of
    # range name the file.
    utt_id = example.utt_id
    lines = train_ali.read_text().splitlines()
    lines[0] = f"{utt_id} " + " ".join(["0"] * (example.features.shape[0] + 5))
    train_ali.write_text("\n".join(lines) + "\n")
    fresh = KaldiDataModule(train_dir=str(corpus / "train"), target="frame_ce",
                            train_alignments=str(train_ali), num_pdfs=2)
    fresh.setup("fit")
    with pytest.raises(DataDirError, match=f"alignment of {utt_id} has .* frames"):
        fresh.datasets["train"][0]
    with pytest.raises(DataDirError, match="pdf id 1 but num_pdfs is 1"):
        KaldiDataModule(train_dir=str(corpus / "train"), target="frame_ce",
                        train_alignments=str(test_ali), num_pdfs=1).setup("fit")


@needs_espeak
def test_ctc_training_reduces_dev_loss_and_takes_cmvn_from_training_data(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    corpus = tiny_corpus_dir(tmp_path_factory)
    dm = KaldiDataModule(train_dir=str(corpus / "train"), val_dir=str(corpus / "dev"),
                         batch_size=8, cache_features=True)
    torch.manual_seed(0)
    model = SpeechRecognizer(num_layers=1, hidden_size=32, lr=0.005)
    # (no inference mode: the same module object is fitted afterwards, and torchmetrics states
    # reset under inference mode could not be updated in place during fit)
    before = quiet_trainer(inference_mode=False).validate(model, datamodule=dm, verbose=False)[0]
    assert bool(model.model.cmvn.initialized)  # statistics came from data/train
    assert 0 <= before["val_wer"] and before["val_loss"] > 0
    trainer = quiet_trainer(max_epochs=4, num_sanity_val_steps=0)
    trainer.fit(model, datamodule=dm)
    after = trainer.callback_metrics
    assert float(after["val_loss"]) < 0.8 * before["val_loss"], (before, after)


def build_cli(config: Path, *overrides: str) -> ASRCLI:
    return ASRCLI(SpeechRecognizer, KaldiDataModule, run=False,
                  trainer_defaults={"use_distributed_sampler": False},
                  args=["--config", str(config), *overrides])


def test_demo_config_parses_and_builds(tmp_path: Path) -> None:
    cli = build_cli(CONFIGS / "synth.yaml", "--trainer.strategy=auto", "--trainer.devices=1",
                    f"--trainer.default_root_dir={tmp_path}",
                    f"--trainer.logger.init_args.save_dir={tmp_path}")
    model, data = cli.model, cli.datamodule
    assert model.hparams.target == data.hparams.target == "ctc"
    assert model.model.lstm.input_size == 40 * model.hparams.frame_stacking
    assert model.model.output[-1].out_features == 29
    assert cli.trainer.max_epochs >= 1 and not cli.trainer._accelerator_connector \
        .use_distributed_sampler


def test_swb2000_config_builds_the_papers_model(tmp_path: Path) -> None:
    # No GPUs and no Switchboard here: only the trainer's hardware is overridden.
    cli = build_cli(CONFIGS / "swb2000.yaml", "--trainer.accelerator=cpu",
                    "--trainer.strategy=auto", "--trainer.devices=1",
                    "--trainer.precision=32-true", f"--trainer.default_root_dir={tmp_path}",
                    f"--trainer.logger.init_args.save_dir={tmp_path}")
    lstm = cli.model.model.lstm
    assert (lstm.num_layers, lstm.hidden_size, lstm.bidirectional) == (6, 512, True)
    assert lstm.input_size == 120  # 40 log-mel + deltas + double deltas
    bottleneck, output = cli.model.model.output
    assert (bottleneck.out_features, output.out_features) == (256, 32000)
    assert cli.datamodule.hparams.allow_pipes and cli.datamodule.hparams.num_pdfs == 32000
    assert cli.config["trainer"]["strategy"] == "auto"
    assert cli.trainer.reload_dataloaders_every_n_epochs == 1
