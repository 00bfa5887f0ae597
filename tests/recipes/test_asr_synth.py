"""The espeak-ng corpus generator: determinism, unseen test voices, valid Kaldi data dirs."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest

from recipes.asr.kaldi_data import load_data_dir
from recipes.asr.synth import (
    CorpusConfig,
    generate_corpus,
    grammar_vocabulary,
    is_complete,
    random_sentence,
)
from recipes.asr.synth import main as synth_main
from tests.recipes.asr_corpus import TINY, needs_espeak, tiny_corpus_dir

SMALL = CorpusConfig(seed=3, num_train=4, num_dev=2, num_test=2)


def test_grammar_stays_in_its_vocabulary() -> None:
    rng = random.Random(0)
    vocab = set(grammar_vocabulary())
    sentences = [random_sentence(rng) for _ in range(500)]
    assert {w for s in sentences for w in s.split()} <= vocab
    assert 40 <= len(vocab) <= 100 and len(set(sentences)) > 200


@needs_espeak
def test_same_seed_same_corpus_other_seed_other_corpus(tmp_path: Path) -> None:
    synth_main(["--out", str(tmp_path / "a"), "--seed", "3", "--num-train", "4", "--num-dev",
                "2", "--num-test", "2", "--no-progress"])
    generate_corpus(tmp_path / "b", SMALL, progress=False, jobs=1)
    generate_corpus(tmp_path / "c", replace(SMALL, seed=4), progress=False)
    a_files = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*")
                     if p.is_file() and p.name != "wav.scp")
    assert len(a_files) == 8 + 3 * 3 + 1  # wavs, 3 tables per split (+ wav.scp), corpus.json
    for rel in a_files:
        assert (tmp_path / "a" / rel).read_bytes() == (tmp_path / "b" / rel).read_bytes(), rel
    assert (tmp_path / "a/train/text").read_text() != (tmp_path / "c/train/text").read_text()
    assert is_complete(tmp_path / "a", SMALL)
    assert not is_complete(tmp_path / "a", replace(SMALL, num_train=5))
    before = (tmp_path / "a/corpus.json").stat().st_mtime_ns
    generate_corpus(tmp_path / "a", SMALL, progress=False)  # cached: nothing rewritten
    assert (tmp_path / "a/corpus.json").stat().st_mtime_ns == before


@needs_espeak
def test_splits_are_kaldi_dirs_with_unseen_test_voices(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    root = tiny_corpus_dir(tmp_path_factory)
    splits = {name: load_data_dir(root / name)[0] for name in ("train", "dev", "test")}
    assert [len(splits[n]) for n in ("train", "dev", "test")] == [
        TINY.num_train, TINY.num_dev, TINY.num_test]
    speakers = {n: {u.speaker for u in utts} for n, utts in splits.items()}
    assert not speakers["test"] & speakers["train"] and not speakers["dev"] & speakers["train"]
    assert len(speakers["train"]) >= 10
    for utts in splits.values():
        for u in utts:
            seconds = u.num_samples / 16000
            assert 0.8 < seconds < 6.0, (u.utt_id, seconds)
            assert set(u.text.split()) <= set(grammar_vocabulary())
