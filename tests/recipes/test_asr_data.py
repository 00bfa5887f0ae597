"""Kaldi data directories: parsing, segments, every bad-input case, and length bucketing."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

from recipes.asr.bucketing import LengthBucketBatchSampler
from recipes.asr.dataset import UtteranceDataset, collate_examples
from recipes.asr.kaldi_data import DataDirError, load_data_dir, read_alignments
from recipes.asr.vocabulary import CharacterVocabulary

RATE = 16000


def tone(seconds: float, freq: float = 440.0, rate: int = RATE) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (0.3 * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def write_wav(path: Path, seconds: float, rate: int = RATE) -> Path:
    sf.write(path, tone(seconds, rate=rate), rate, subtype="PCM_16")
    return path


def make_dir(root: Path, wav_scp: str, text: str, **extra: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "wav.scp").write_text(wav_scp)
    (root / "text").write_text(text)
    for name, content in extra.items():
        (root / name).write_text(content)
    return root


@pytest.fixture
def wavs(tmp_path: Path) -> dict[str, Path]:
    return {"a": write_wav(tmp_path / "a.wav", 1.0), "b": write_wav(tmp_path / "b.wav", 2.5),
            "c": write_wav(tmp_path / "c.wav", 0.5)}


def test_plain_data_dir(tmp_path: Path, wavs: dict[str, Path]) -> None:
    d = make_dir(tmp_path / "d", f"b {wavs['b']}\na {wavs['a']}\n\n",
                 "a HELLO World\nb [noise] it's ok\n", utt2spk="a s1\nb s2\n")
    utts, report = load_data_dir(d)
    assert [u.utt_id for u in utts] == ["a", "b"]
    assert [u.speaker for u in utts] == ["s1", "s2"]
    assert [u.num_samples for u in utts] == [RATE, int(2.5 * RATE)]
    assert utts[0].text == "HELLO World" and report.num_skipped == 0
    ds = UtteranceDataset(utts, CharacterVocabulary())
    assert ds[1].text == "it's ok"  # bracketed noise token removed, lower-cased
    assert ds.num_frames() == [98, 248]
    assert ds[0].features.shape == (98, 40)


def test_segments_cut_recordings(tmp_path: Path, wavs: dict[str, Path]) -> None:
    d = make_dir(tmp_path / "d", f"rec {wavs['b']}\n", "u1 one\nu2 two\n",
                 segments="u1 rec 0.0 1.0\nu2 rec 1.5 2.25\n")
    utts, _ = load_data_dir(d)
    assert [(u.utt_id, u.start, u.end, u.num_samples) for u in utts] == [
        ("u1", 0.0, 1.0, RATE), ("u2", 1.5, 2.25, int(0.75 * RATE))]
    ds = UtteranceDataset(utts, CharacterVocabulary())
    full = sf.read(wavs["b"], dtype="float32")[0]
    assert torch.equal(ds.load_samples(1), torch.from_numpy(full[24000:36000]))
    assert [ds[i].features.shape[0] for i in range(2)] == ds.num_frames() == [98, 73]


def error_at(match_file: Path, line: int) -> str:
    return re.escape(f"{match_file}:{line}:")


def test_bad_inputs_raise_errors_naming_file_and_line(tmp_path: Path,
                                                      wavs: dict[str, Path]) -> None:
    a = wavs["a"]
    # missing wav.scp
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataDirError, match="wav.scp: missing"):
        load_data_dir(tmp_path / "empty")
    # missing audio file
    d = make_dir(tmp_path / "missing", f"a {a}\nb {tmp_path / 'nope.wav'}\n", "a x\nb y\n")
    with pytest.raises(DataDirError, match=error_at(d / "wav.scp", 2) + ".*not found"):
        load_data_dir(d)
    # transcript for an unknown utterance
    d = make_dir(tmp_path / "unknown", f"a {a}\n", "a x\nzz y\n")
    with pytest.raises(DataDirError, match=error_at(d / "text", 2) + ".*unknown utterance id 'zz'"):
        load_data_dir(d)
    # segment of an unknown recording
    d = make_dir(tmp_path / "seg", f"a {a}\n", "u x\n", segments="u nope 0 1\n")
    with pytest.raises(DataDirError, match=error_at(d / "segments", 1) + ".*unknown recording"):
        load_data_dir(d)
    # sample-rate mismatch
    write_wav(tmp_path / "8k.wav", 1.0, rate=8000)
    d = make_dir(tmp_path / "rate", f"a {a}\nb {tmp_path / '8k.wav'}\n", "a x\nb y\n")
    with pytest.raises(DataDirError,
                       match=error_at(d / "wav.scp", 2) + ".*8000 Hz, expected 16000"):
        load_data_dir(d)
    # pipe command without permission
    d = make_dir(tmp_path / "pipe", f"a cat {a} |\n", "a x\n")
    with pytest.raises(DataDirError, match=error_at(d / "wav.scp", 1) + ".*pipe command"):
        load_data_dir(d)
    # malformed line and duplicate key
    d = make_dir(tmp_path / "short", f"a {a}\nb\n", "a x\n")
    with pytest.raises(DataDirError, match=error_at(d / "wav.scp", 2) + ".*at least 2 fields"):
        load_data_dir(d)
    d = make_dir(tmp_path / "dup", f"a {a}\na {a}\n", "a x\n")
    with pytest.raises(DataDirError, match=error_at(d / "wav.scp", 2) + ".*duplicate key"):
        load_data_dir(d)


def test_per_utterance_problems_are_counted_skips(tmp_path: Path,
                                                  wavs: dict[str, Path]) -> None:
    (tmp_path / "junk.wav").write_bytes(b"this is not audio")
    d = make_dir(tmp_path / "d",
                 f"a {wavs['a']}\nb {wavs['b']}\nc {wavs['c']}\nj {tmp_path / 'junk.wav'}\n",
                 "a x\nb\nj z\n")
    with pytest.warns(UserWarning, match="skipped 3 utterance") as record:
        utts, report = load_data_dir(d)
    assert [u.utt_id for u in utts] == ["a"]
    assert report.skipped == {"empty transcript": 1, "no transcript": 1, "unreadable audio": 1}
    message = str(record[0].message)
    assert f"{d / 'text'}:2" in message and f"{d / 'wav.scp'}:4" in message


def test_pipe_commands_run_only_when_enabled(tmp_path: Path, wavs: dict[str, Path]) -> None:
    d = make_dir(tmp_path / "d", f"a cat {wavs['a']} |\nb false |\n", "a x\nb y\n",
                 utt2dur="a 1.0\nb 1.0\n")
    utts, _ = load_data_dir(d, allow_pipes=True)
    assert utts[0].is_pipe and utts[0].num_samples == RATE
    ds = UtteranceDataset(utts, CharacterVocabulary(), allow_pipes=True)
    assert ds[0].features.shape == (98, 40)
    with pytest.raises(DataDirError, match=error_at(d / "wav.scp", 2) + ".*cannot read audio of b"):
        ds[1]
    with pytest.raises(DataDirError, match="pipe command not enabled"):
        UtteranceDataset(utts, CharacterVocabulary(), allow_pipes=False)[0]


def test_audio_that_breaks_after_loading_names_its_line(tmp_path: Path,
                                                        wavs: dict[str, Path]) -> None:
    d = make_dir(tmp_path / "d", f"a {wavs['a']}\nb {wavs['b']}\n", "a x\nb y\n")
    utts, _ = load_data_dir(d)
    wavs["b"].write_bytes(b"corrupted later")
    with pytest.raises(DataDirError, match=error_at(d / "wav.scp", 2) + ".*cannot read audio"):
        UtteranceDataset(utts, CharacterVocabulary())[1]


def test_alignment_file_parsing_and_errors(tmp_path: Path) -> None:
    ali = tmp_path / "ali.txt"
    ali.write_text("u1 0 0 1 1 2\nu2 3\n")
    got = read_alignments(ali)
    assert got["u1"].tolist() == [0, 0, 1, 1, 2] and got["u2"].tolist() == [3]
    ali.write_text("u1 0 1\nu2 0 x 1\n")
    with pytest.raises(DataDirError, match=error_at(ali, 2) + ".*integers"):
        read_alignments(ali)
    with pytest.raises(DataDirError, match="alignment file not found"):
        read_alignments(tmp_path / "none.txt")


def test_collate_pads_features_and_concatenates_ctc_targets(tmp_path: Path,
                                                            wavs: dict[str, Path]) -> None:
    d = make_dir(tmp_path / "d", f"a {wavs['a']}\nc {wavs['c']}\n", "a ab\nc b a\n")
    ds = UtteranceDataset(load_data_dir(d)[0], CharacterVocabulary())
    batch = collate_examples([ds[0], ds[1]])
    assert batch.features.shape == (2, 98, 40) and batch.lengths.tolist() == [98, 48]
    assert batch.features[1, 48:].abs().sum() == 0
    assert batch.targets.tolist() == [2, 3, 3, 1, 2] and batch.target_lengths.tolist() == [2, 3]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_bucketing_equal_batch_counts_and_coverage(world: int) -> None:
    rng = np.random.default_rng(0)
    lengths = rng.integers(50, 500, size=103).tolist()
    for epoch in range(2):
        train = [LengthBucketBatchSampler(lengths, 8, num_replicas=world, rank=r, seed=3,
                                          pool_multiplier=4) for r in range(world)]
        for s in train:
            s.set_epoch(epoch)
        batches = [list(s) for s in train]
        assert len({len(b) for b in batches}) == 1  # same number of steps on every rank
        assert all(len(b) == len(s) for b, s in zip(batches, train))
        seen = [i for rank in batches for batch in rank for i in batch]
        assert set(seen) == set(range(103))
        assert len(seen) == -(-103 // world) * world  # padded by repetition only
    evals = [list(LengthBucketBatchSampler(lengths, 8, num_replicas=world, rank=r,
                                           shuffle=False)) for r in range(world)]
    assert len({len(b) for b in evals}) == 1
    seen = sorted(i for rank in evals for batch in rank for i in batch)
    assert seen == list(range(103))  # every utterance scored exactly once
    for rank in evals:  # batches are length-sorted
        for batch in rank:
            spans = [lengths[i] for i in batch]
            assert spans == sorted(spans)


def test_bucketing_reduces_padding_and_warms_up_batch_size() -> None:
    rng = np.random.default_rng(1)
    lengths = rng.integers(50, 1000, size=400)
    bucketed = LengthBucketBatchSampler(lengths.tolist(), 16, seed=0)
    random_order = rng.permutation(400).reshape(-1, 16)

    def padding(batches: list[list[int]]) -> int:
        return sum(int(lengths[b].max() * len(b) - lengths[b].sum()) for b in batches)

    assert padding(list(bucketed)) < 0.2 * padding(random_order.tolist())
    warm = LengthBucketBatchSampler(lengths.tolist(), 32, warmup_epochs=3, initial_batch_size=8)
    assert [warm.batch_size_at(e) for e in range(5)] == [8, 16, 24, 32, 32]
    assert len(warm) == len(list(warm)) == 50
    warm.set_epoch(3)
    assert len(warm) == len(list(warm)) == 13
