"""The recipe's length buckets under the shared cursor: every utterance once per epoch, a slow rank.

The bucketing tests run in-process; the fits run once, on 3 real gloo ranks
(``tests/scripts/shared_batches_ranks.py``): adpsgd with a slow rank, the batch-size warm-up,
validation and checkpoints every epoch, a resume, and dpsgd for comparison.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from lightning_gossip.cursor.batches import SharedBatches
from recipes.asr.bucketing import LengthBucketBatchSampler
from recipes.asr.kaldi_data import load_data_dir
from testbed.launch import check, run_torchrun
from tests.recipes.asr_corpus import needs_espeak, tiny_corpus_dir

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "scripts" / "shared_batches_ranks.py"
WORLD = 3
SLOW_RANK = 1


def test_shared_buckets_cover_every_utterance_once_the_same_on_every_rank() -> None:
    lengths = np.random.default_rng(0).integers(50, 1000, size=103).tolist()
    ranks = [LengthBucketBatchSampler(lengths, 8, num_replicas=4, rank=r, seed=3,
                                      pool_multiplier=4, warmup_epochs=2, initial_batch_size=2)
             for r in range(4)]
    assert isinstance(ranks[0], SharedBatches)
    for epoch, size in [(0, 2), (1, 5), (2, 8), (3, 8)]:
        batches = ranks[0].shared_batches(epoch)
        assert all(r.shared_batches(epoch) == batches for r in ranks[1:])
        assert sorted(i for b in batches for i in b) == list(range(103))  # once, no padding
        assert max(len(b) for b in batches) == size
        full, rest = divmod(103, size * 4)  # pools of 4 batches, the last one shorter
        assert len(batches) == full * 4 + -(-rest // size)
        for b in batches:  # cut from length-sorted pools
            assert [lengths[i] for i in b] == sorted(lengths[i] for i in b)
    assert ranks[0].shared_batches(2) != ranks[0].shared_batches(3)  # reshuffled every epoch
    evaluation = LengthBucketBatchSampler(lengths, 8, shuffle=False).shared_batches(0)
    assert sorted(i for b in evaluation for i in b) == list(range(103))


def test_lightning_sets_the_epoch_of_the_bucket_sampler() -> None:
    # Lightning calls set_epoch on loader.sampler and loader.batch_sampler.sampler only.
    from lightning.fabric.utilities.data import _set_sampler_epoch
    from torch.utils.data import DataLoader

    sampler = LengthBucketBatchSampler([5, 6, 7, 8], 2, seed=1)
    loader = DataLoader(list(range(4)), batch_sampler=sampler)
    _set_sampler_epoch(loader, 5)
    assert sampler.epoch == 5


def test_the_demo_prints_batches_per_rank_next_to_the_wer(tmp_path: Path) -> None:
    from recipes.asr.demo import summary

    numbers = {"wer": 0.0723, "substitutions": 120, "deletions": 7, "insertions": 1,
               "reference_words": 1806, "utterances": 300,
               "train_batches_last_epoch": [81, 52, 84, 83]}
    lines = summary(numbers, tmp_path / "report", tmp_path / "logs", tmp_path, 6.0).splitlines()
    wer = next(i for i, line in enumerate(lines) if line.startswith("test WER"))
    assert "7.23%" in lines[wer]
    assert lines[wer + 1] == ("batches in the last training epoch: rank 0: 81, rank 1: 52, "
                              "rank 2: 84, rank 3: 83 (300)")
    del numbers["train_batches_last_epoch"]  # e.g. a report written by an older version
    assert not any("training epoch" in line for line in
                   summary(numbers, tmp_path, tmp_path, tmp_path, 1.0).splitlines())


@pytest.fixture(scope="module")
def fits(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], list[str]]:
    corpus = tiny_corpus_dir(tmp_path_factory)
    out = tmp_path_factory.mktemp("shared_batches")
    check(run_torchrun(SCRIPT, str(out), str(corpus), nprocs=WORLD, timeout=900))
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    utterances, _ = load_data_dir(corpus / "train")
    return results, sorted(u.utt_id for u in utterances)


def epoch_ids(results: list[dict], fit: str, epoch: int) -> list[str]:
    return sorted(u for r in results for b in r[fit]["epochs"].get(str(epoch), []) for u in b)


@needs_espeak
@pytest.mark.multiprocess
def test_adpsgd_shares_the_buckets_every_utterance_once_and_the_slow_rank_takes_fewer(
        fits: tuple[list[dict], list[str]]) -> None:
    results, train_ids = fits
    for epoch, size in [(0, 2), (1, 3), (2, 4)]:  # the warm-up reached every rank
        assert epoch_ids(results, "adpsgd", epoch) == train_ids, epoch
        sizes = Counter(len(b) for r in results for b in r["adpsgd"]["epochs"][str(epoch)])
        assert max(sizes) == size, (epoch, sizes)
    totals = {r["rank"]: sum(len(b) for b in r["adpsgd"]["epochs"].values()) for r in results}
    assert all(totals[SLOW_RANK] < totals[k] for k in totals if k != SLOW_RANK), totals
    for r in results:
        last = r["adpsgd"]["epochs"]["2"]
        assert r["adpsgd"]["last_epoch_batches"] == len(last)
        assert [v["epoch"] for v in r["adpsgd"]["validations"]] == [0, 1, 2]
        assert not [w for w in r["adpsgd"]["warnings"] if "batch sampler" in w], r["adpsgd"]
    # every rank validated the same way (the sharded evaluation buckets are untouched)
    assert len({json.dumps(r["adpsgd"]["validations"]) for r in results}) == 1


@needs_espeak
@pytest.mark.multiprocess
def test_resume_continues_with_the_next_epoch_and_every_utterance_once(
        fits: tuple[list[dict], list[str]]) -> None:
    results, train_ids = fits
    assert all(list(r["resume"]["epochs"]) == ["3"] for r in results)
    assert epoch_ids(results, "resume", 3) == train_ids
    # Rank 0 writes the checkpoint, so every rank resumes from rank 0's step count.
    steps = [r["resume"]["global_step"] - results[0]["adpsgd"]["global_step"] for r in results]
    assert steps == [len(r["resume"]["epochs"]["3"]) for r in results]
    assert all([v["epoch"] for v in r["resume"]["validations"]] == [3] for r in results)


@needs_espeak
@pytest.mark.multiprocess
def test_dpsgd_keeps_the_sharded_buckets_and_reshuffles_every_epoch(
        fits: tuple[list[dict], list[str]]) -> None:
    results, train_ids = fits
    for epoch in (0, 1):
        counts = {len(r["dpsgd"]["epochs"][str(epoch)]) for r in results}
        assert len(counts) == 1  # the same number of batches on every rank
        ids = epoch_ids(results, "dpsgd", epoch)
        assert set(ids) == set(train_ids) and len(ids) == -(-len(train_ids) // WORLD) * WORLD
    # set_epoch reached the sampler without reloading: warm-up size, new shards
    first = results[0]["dpsgd"]["epochs"]
    assert [max(len(b) for b in first[e]) for e in ("0", "1")] == [2, 3]
    assert sorted(u for b in first["0"] for u in b) != sorted(u for b in first["1"] for u in b)
