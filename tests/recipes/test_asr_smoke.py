"""2-rank fits of the ASR recipe through its CLI under ddp, dpsgd and adpsgd (real processes)."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import jiwer
import pytest

from recipes.asr.vocabulary import CharacterVocabulary
from testbed.launch import check, run_lightning
from tests.recipes.asr_corpus import needs_espeak, tiny_corpus_dir

ROOT = Path(__file__).resolve().parents[2]
CLI = ROOT / "recipes" / "asr" / "__main__.py"


def read_table(path: Path) -> dict[str, str]:
    rows = [line.split(maxsplit=1) for line in path.read_text().splitlines() if line.strip()]
    return {r[0]: r[1] if len(r) > 1 else "" for r in rows}


@needs_espeak
@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", [pytest.param("ddp", marks=pytest.mark.slow),
                                      "dpsgd", "adpsgd"])
def test_two_rank_fit_validates_tests_and_reports(
        strategy: str, tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    corpus = tiny_corpus_dir(tmp_path_factory)
    out = tmp_path / "run"
    # Under adpsgd the two ranks share the batches (each takes about half of them), so smaller
    # batches keep rank 0, which writes the log, at 8 or more steps over the two epochs.
    batch_size = 3 if strategy == "adpsgd" else 6
    result = run_lightning(
        CLI, "fit", "--config", str(ROOT / "recipes/asr/configs/synth.yaml"),
        f"--trainer.strategy={strategy}", "--trainer.devices=2", "--trainer.max_epochs=2",
        "--trainer.enable_progress_bar=false", "--trainer.log_every_n_steps=1",
        f"--trainer.default_root_dir={out}",
        "--trainer.logger=lightning.pytorch.loggers.CSVLogger",
        f"--trainer.logger.init_args.save_dir={out}",
        f"--data.train_dir={corpus / 'train'}", f"--data.val_dir={corpus / 'dev'}",
        f"--data.test_dir={corpus / 'test'}", f"--data.batch_size={batch_size}",
        "--model.num_layers=1", "--model.hidden_size=32", "--model.lr=0.01",
        "--model.warmup_steps=0", f"--model.report_dir={out / 'report'}",
        "--test_after_fit=true", timeout=900)
    log = check(result)
    assert "test WER" in log

    # Every test utterance was scored exactly once across the two ranks ...
    refs = read_table(out / "report" / "ref.txt")
    hyps = read_table(out / "report" / "hyp.txt")
    vocab = CharacterVocabulary()
    expected_refs = {u: vocab.normalize(t) for u, t in read_table(corpus / "test/text").items()}
    assert refs == expected_refs and hyps.keys() == refs.keys()
    # ... and the torchmetrics WER reduced over the ranks equals jiwer over all of them.
    ids = sorted(refs)
    reference_wer = jiwer.wer([refs[u] for u in ids], [hyps[u] for u in ids])
    report = json.loads((out / "report" / "wer.json").read_text())
    assert report["wer"] == pytest.approx(reference_wer, abs=1e-9)
    # Training batches per rank in the last epoch (what the demo prints next to the WER):
    # shared between the ranks under adpsgd (every utterance once), equal shards otherwise.
    batches = report["train_batches_last_epoch"]
    num_train = len(read_table(corpus / "train/text"))
    assert len(batches) == 2 and min(batches) >= 1
    if strategy == "adpsgd":
        assert sum(batches) == math.ceil(num_train / batch_size)
        assert "does not list its batches" not in log
    else:
        assert batches[0] == batches[1] == math.ceil(math.ceil(num_train / 2) / batch_size)
    metrics = list(csv.DictReader(open(next(out.rglob("metrics.csv")))))
    test_wer = [float(r["test_wer"]) for r in metrics if r.get("test_wer")]
    assert test_wer == [pytest.approx(reference_wer, abs=1e-6)]
    val = [(float(r["val_wer"]), float(r["val_loss"])) for r in metrics if r.get("val_wer")]
    assert len(val) == 2  # one validation per epoch
    train_loss = [float(r["train_loss"]) for r in metrics if r.get("train_loss")]
    assert len(train_loss) >= 8 and min(train_loss[-3:]) < train_loss[0]
    assert list(out.rglob("last.ckpt"))
    # The gossip learning-rate rule (model.gossip_lr_rule "auto", Adam): the optimizer ran at
    # lr * sqrt(2) on the two gossip learners, at lr itself under ddp (no warmup, no annealing
    # within 2 epochs here), as LearningRateMonitor logged it at every step.
    lrs = [float(r["lr-AdamW"]) for r in metrics if r.get("lr-AdamW")]
    expected = 0.01 * (math.sqrt(2) if strategy != "ddp" else 1.0)
    assert len(lrs) >= 8 and all(lr == pytest.approx(expected, rel=1e-9) for lr in lrs), lrs
