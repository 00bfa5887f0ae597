"""Character vocabulary, CTC greedy decoding, WER (torchmetrics == jiwer), the jiwer report,
the learning-rate schedule and its gossip rule."""

from __future__ import annotations

import json
import math
from pathlib import Path

import jiwer
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from torchmetrics.text import WordErrorRate

from lightning_gossip import ADPSGDStrategy, DPSGDStrategy
from recipes.asr.schedule import gossip_learners, gossip_lr_multiplier, lr_factor
from recipes.asr.scoring import write_report
from recipes.asr.vocabulary import BLANK, SPACE, CharacterVocabulary


def test_vocabulary_normalizes_and_round_trips() -> None:
    v = CharacterVocabulary()
    assert len(v) == 29
    noisy = "  Hello,  [LAUGHTER] World! <unk> it's (noise) OK "
    assert v.normalize(noisy) == "hello world it's ok"
    ids = v.encode("it's ok")
    assert ids == [10, 21, 28, 20, SPACE, 16, 12]
    assert v.decode(ids) == "it's ok"
    with pytest.raises(ValueError, match="distinct"):
        CharacterVocabulary("aab")


def path_scores(path: list[int], units: int = 29) -> torch.Tensor:
    """Log-probabilities whose best path is ``path``."""
    scores = torch.full((len(path), units), -10.0)
    scores[torch.arange(len(path)), torch.tensor(path, dtype=torch.long)] = 0.0
    return scores.log_softmax(-1)


def test_ctc_greedy_decoding_merges_repeats_then_drops_blanks() -> None:
    v = CharacterVocabulary()
    a, b, o, f = (v.encode(c)[0] for c in "abof")
    _ = BLANK
    cases = [
        ([a, a, a, _, b, b], "ab"),
        ([a, _, a, b], "aab"),  # a blank separates a real double letter
        ([_, o, o, _, f, f, SPACE, SPACE, o, _, f, _, _, f], "of off"),
        ([_, _, _], ""),
        ([SPACE, a, SPACE, SPACE], "a"),  # no leading/trailing/double spaces
    ]
    width = max(len(p) for p, _ in cases)
    batch = torch.stack([torch.cat([path_scores(p), path_scores([a] * (width - len(p)))])
                         for p, _ in cases])
    lengths = torch.tensor([len(p) for p, _ in cases])
    assert v.greedy_decode(batch, lengths) == [text for _, text in cases]  # padding ignored


TRICKY = [
    (["the cat sat"], [""]),  # empty hypothesis: all deletions
    (["a b"], ["a x y b z"]),  # insertions only
    (["one two three", "four"], ["one three", "for four five"]),
    (["a a a"], ["a"]),
    (["turn on the light", "call anna"], ["turn the light on", "call anna"]),
]


@pytest.mark.parametrize("refs,hyps", TRICKY)
def test_wer_equals_jiwer(refs: list[str], hyps: list[str], tmp_path: Path) -> None:
    expected = jiwer.wer(refs, hyps)
    metric = WordErrorRate()
    for r, h in zip(refs, hyps):  # batch by batch, as in validation
        metric.update([h], [r])
    assert float(metric.compute()) == pytest.approx(expected, abs=1e-7)
    records = [(f"u{i}", r, h) for i, (r, h) in enumerate(zip(refs, hyps))]
    numbers = write_report(records, tmp_path)
    assert numbers["wer"] == pytest.approx(expected, abs=1e-12)
    assert json.loads((tmp_path / "wer.json").read_text())["wer"] == numbers["wer"]


@pytest.mark.filterwarnings("ignore:The ``compute`` method")
def test_wer_of_shards_merged_like_ranks_equals_jiwer_of_all() -> None:
    """Ranks sum error and word counts; averaging per-rank WERs would be wrong."""
    refs = ["a b c d e f g h", "x", "p q"]
    hyps = ["a b c d e f g h", "y", ""]
    shards = [WordErrorRate(), WordErrorRate()]
    shards[0].update(hyps[:1], refs[:1])
    shards[1].update(hyps[1:], refs[1:])
    mean_of_ranks = sum(float(s.compute()) for s in shards) / 2
    merged = WordErrorRate()
    for shard in shards:
        merged.merge_state(shard)
    assert float(merged.compute()) == pytest.approx(jiwer.wer(refs, hyps)) == pytest.approx(3 / 11)
    assert mean_of_ranks != pytest.approx(3 / 11)


def test_report_counts_and_alignments(tmp_path: Path) -> None:
    records = [("u2", "x y", ""), ("u1", "a b c", "a b c"), ("u3", "p q", "p z q r")]
    numbers = write_report(records, tmp_path, num_examples=1)
    assert numbers == {"wer": 4 / 7, "substitutions": 0, "deletions": 2, "insertions": 2,
                       "hits": 5, "reference_words": 7, "utterances": 3}
    text = (tmp_path / "wer_report.txt").read_text()
    assert "WER 57.14% (0 substitutions + 2 deletions + 2 insertions) / 7 reference words" in text
    assert "u2 (2 errors)" in text and "u3" not in text.split("most errors")[1]  # ties: by id
    assert "REF: x y" in text and "HYP: * *" in text
    assert (tmp_path / "hyp.txt").read_text() == "u1 a b c\nu2 \nu3 p z q r\n"


def test_lr_schedule_warmup_hold_anneal() -> None:
    kw = dict(warmup_steps=10, warmup_start=0.1, anneal_start_epoch=3, anneal_factor=0.5)
    assert lr_factor(0, 0, **kw) == pytest.approx(0.1)
    assert lr_factor(5, 0, **kw) == pytest.approx(0.55)
    assert [lr_factor(100, e, **kw) for e in range(6)] == [1, 1, 1, 0.5, 0.25, 0.125]
    assert lr_factor(3, 7) == 1.0


def test_gossip_lr_rule_scales_adam_by_the_root_of_the_learners_and_keeps_sgd() -> None:
    assert gossip_lr_multiplier("adam", 4) == 2.0
    assert gossip_lr_multiplier("adam", 2) == pytest.approx(math.sqrt(2))
    assert gossip_lr_multiplier("sgd", 4) == 1.0  # SGD's mean replica takes ddp's step
    assert gossip_lr_multiplier("adam", 4, rule="none") == 1.0
    assert gossip_lr_multiplier("adam", 1) == 1.0
    with pytest.raises(ValueError, match="gossip_lr_rule"):
        gossip_lr_multiplier("adam", 4, rule="linear")


def test_gossip_learners_counts_ranks_nodes_or_one() -> None:
    assert gossip_learners(DPSGDStrategy(), 4) == 4
    assert gossip_learners(ADPSGDStrategy(), 8) == 8
    hierarchical = ADPSGDStrategy(hierarchical=True)
    hierarchical.num_nodes = 2  # what the Trainer sets from num_nodes
    assert gossip_learners(hierarchical, 8) == 2  # a node is one learner
    assert gossip_learners(DDPStrategy(), 4) == 1
    assert gossip_learners(SingleDeviceStrategy("cpu"), 1) == 1
