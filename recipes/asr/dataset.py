"""Map-style dataset of utterances: audio -> filterbank features plus CTC or frame targets."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from recipes.asr.features import compute_fbank
from recipes.asr.kaldi_data import DataDirError, Utterance, read_audio
from recipes.asr.vocabulary import CharacterVocabulary

IGNORE_INDEX = -100
"""Frame-target value of padding frames (ignored by the loss and the frame accuracy)."""


def expected_frames(num_samples: int, sample_rate: int = 16000) -> int:
    """Number of 25 ms / 10 ms frames Kaldi makes from ``num_samples`` (``snip-edges=true``)."""
    window, shift = int(0.025 * sample_rate), int(0.010 * sample_rate)
    return 0 if num_samples < window else 1 + (num_samples - window) // shift


@dataclass
class Example:
    """One utterance ready for batching."""

    utt_id: str
    features: Tensor  # (frames, dim)
    text: str  # normalized transcript ("" when unknown)
    target: Tensor  # CTC: character ids; frame CE: one pdf id per frame


class UtteranceDataset(Dataset):
    """Reads audio, computes features and targets for a list of :class:`Utterance`.

    Args:
        utterances: from :func:`~recipes.asr.kaldi_data.load_data_dir`.
        vocabulary: for CTC targets and normalized reference texts.
        alignments: for frame cross-entropy targets (``utt-id -> pdf per frame``); the
            alignment may differ from the feature length by at most ``frame_tolerance``
            frames (it is then trimmed or padded with its last pdf).
        cache: keep computed features in memory (useful with ``num_workers=0``).
    """

    def __init__(self, utterances: Sequence[Utterance], vocabulary: CharacterVocabulary, *,
                 sample_rate: int = 16000, num_mel_bins: int = 40, deltas: bool = False,
                 allow_pipes: bool = False, alignments: Mapping[str, np.ndarray] | None = None,
                 frame_tolerance: int = 2, cache: bool = False) -> None:
        self.utterances = list(utterances)
        self.vocabulary = vocabulary
        self.sample_rate, self.num_mel_bins, self.deltas = sample_rate, num_mel_bins, deltas
        self.allow_pipes = allow_pipes
        self.alignments = alignments
        self.frame_tolerance = frame_tolerance
        self._cache: dict[int, Tensor] | None = {} if cache else None

    def __len__(self) -> int:
        return len(self.utterances)

    def num_frames(self) -> list[int]:
        """Approximate feature lengths (for bucketing) without reading audio when possible."""
        return [expected_frames(u.num_samples, self.sample_rate) if u.num_samples is not None
                else 0 for u in self.utterances]

    def load_samples(self, index: int) -> Tensor:
        """The waveform of utterance ``index`` (its segment, if it has one)."""
        utt = self.utterances[index]
        try:
            samples, rate = read_audio(utt.recording, allow_pipes=self.allow_pipes)
        except DataDirError as e:
            raise DataDirError(f"{utt.recording_location}: {e}") from None
        except Exception as e:  # soundfile/OS errors: say which line of which file
            raise DataDirError(f"{utt.recording_location}: cannot read audio of {utt.utt_id}: "
                               f"{e}") from e
        if rate != self.sample_rate:
            raise DataDirError(f"{utt.recording_location}: {utt.recording} has sample rate "
                               f"{rate} Hz, expected {self.sample_rate} Hz")
        first = int(round(utt.start * rate))
        last = len(samples) if utt.end is None else int(round(utt.end * rate))
        return torch.from_numpy(np.ascontiguousarray(samples[first:last]))

    def features(self, index: int) -> Tensor:
        """Filterbank features of utterance ``index`` (before CMVN)."""
        if self._cache is not None and index in self._cache:
            return self._cache[index]
        samples = self.load_samples(index)
        try:
            feats = compute_fbank(samples, self.sample_rate, self.num_mel_bins, self.deltas)
        except ValueError as e:
            utt = self.utterances[index]
            raise DataDirError(f"{utt.recording_location}: {utt.utt_id}: {e}") from None
        if self._cache is not None:
            self._cache[index] = feats
        return feats

    def __getitem__(self, index: int) -> Example:
        utt = self.utterances[index]
        feats = self.features(index)
        text = self.vocabulary.normalize(utt.text)
        if self.alignments is not None:
            target = self._frame_targets(utt, feats.shape[0])
        else:
            target = torch.tensor(self.vocabulary.encode(text), dtype=torch.long)
        return Example(utt.utt_id, feats, text, target)

    def _frame_targets(self, utt: Utterance, frames: int) -> Tensor:
        assert self.alignments is not None
        if utt.utt_id not in self.alignments:
            raise DataDirError(f"no alignment for utterance {utt.utt_id} "
                               f"({utt.recording_location})")
        pdfs = torch.from_numpy(self.alignments[utt.utt_id])
        if abs(len(pdfs) - frames) > self.frame_tolerance:
            raise DataDirError(f"alignment of {utt.utt_id} has {len(pdfs)} frames, features "
                               f"have {frames} ({utt.recording_location})")
        if len(pdfs) < frames:
            pdfs = torch.cat([pdfs, pdfs[-1:].expand(frames - len(pdfs))])
        return pdfs[:frames].long()


@dataclass
class Batch:
    """A padded batch. ``targets`` are concatenated (CTC) or padded with ``IGNORE_INDEX``."""

    utt_ids: list[str]
    features: Tensor  # (B, T, D)
    lengths: Tensor  # (B,)
    texts: list[str]
    targets: Tensor
    target_lengths: Tensor  # (B,)

    def __len__(self) -> int:
        return len(self.utt_ids)


def collate_examples(examples: list[Example], *, frame_targets: bool = False) -> Batch:
    """Pad features (and frame targets) to the longest utterance of the batch."""
    lengths = torch.tensor([e.features.shape[0] for e in examples], dtype=torch.long)
    target_lengths = torch.tensor([len(e.target) for e in examples], dtype=torch.long)
    dim = examples[0].features.shape[1] if examples else 0
    feats = torch.zeros(len(examples), int(lengths.max()) if examples else 0, dim)
    for i, e in enumerate(examples):
        feats[i, : e.features.shape[0]] = e.features
    if frame_targets:
        targets = torch.full(feats.shape[:2], IGNORE_INDEX, dtype=torch.long)
        for i, e in enumerate(examples):
            targets[i, : len(e.target)] = e.target
    else:
        targets = (torch.cat([e.target for e in examples]) if examples
                   else torch.zeros(0, dtype=torch.long))
    return Batch([e.utt_id for e in examples], feats, lengths, [e.text for e in examples],
                 targets, target_lengths)
