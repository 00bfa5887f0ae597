"""Acoustic features: Kaldi-compatible log-mel filterbanks, global CMVN, SpecAugment, stacking."""

from __future__ import annotations

import torch
import torchaudio.functional as AF
from torch import Tensor, nn
from torchaudio.compliance import kaldi


def fbank_dim(num_mel_bins: int, deltas: bool) -> int:
    """Feature dimension produced by :func:`compute_fbank`."""
    return num_mel_bins * (3 if deltas else 1)


def compute_fbank(samples: Tensor, sample_rate: int = 16000, num_mel_bins: int = 40,
                  deltas: bool = False) -> Tensor:
    """Log-mel filterbank features of one waveform, as Kaldi's ``compute-fbank-feats`` makes them.

    Args:
        samples: 1-D float waveform in [-1, 1] (scaled to 16-bit range internally, as Kaldi
            reads integer PCM).
        num_mel_bins: 40 or 80 are the usual choices.
        deltas: append first and second order deltas (window 2, as ``add-deltas``).

    Returns:
        ``(frames, fbank_dim(num_mel_bins, deltas))`` float32, 25 ms windows every 10 ms.
    """
    if samples.dim() != 1:
        raise ValueError(f"expected a 1-D waveform, got shape {tuple(samples.shape)}")
    if samples.numel() < int(0.025 * sample_rate):
        raise ValueError(f"waveform of {samples.numel()} samples is shorter than one frame")
    feats = kaldi.fbank(samples.float().unsqueeze(0) * 32768.0, num_mel_bins=num_mel_bins,
                        sample_frequency=float(sample_rate), dither=0.0, energy_floor=1.0)
    if deltas:
        first = AF.compute_deltas(feats.T, win_length=5)
        second = AF.compute_deltas(first, win_length=5)
        feats = torch.cat([feats, first.T, second.T], dim=1)
    return feats


class GlobalCMVN(nn.Module):
    """Global cepstral mean and variance normalization with statistics from training data.

    The statistics are buffers, so they travel with the model in checkpoints and are the same
    on every rank.
    """

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(dim))
        self.register_buffer("inv_std", torch.ones(dim))
        self.register_buffer("initialized", torch.zeros((), dtype=torch.bool))

    @torch.no_grad()
    def set_stats(self, count: float, total: Tensor, total_sq: Tensor,
                  min_std: float = 1e-3) -> None:
        """Set the statistics from sums over ``count`` frames: ``sum x`` and ``sum x**2``."""
        if count <= 0:
            raise ValueError("CMVN statistics need at least one frame")
        mean = total.double() / count
        var = (total_sq.double() / count - mean**2).clamp_min(min_std**2)
        self.mean.copy_(mean.to(self.mean.dtype))
        self.inv_std.copy_(var.rsqrt().to(self.inv_std.dtype))
        self.initialized.fill_(True)

    def forward(self, feats: Tensor) -> Tensor:
        return (feats - self.mean) * self.inv_std


def accumulate_stats(feature_list: list[Tensor]) -> tuple[float, Tensor, Tensor]:
    """Frame count, ``sum x`` and ``sum x**2`` over a list of ``(frames, dim)`` features."""
    count = sum(f.shape[0] for f in feature_list)
    total = sum(f.double().sum(0) for f in feature_list)
    total_sq = sum((f.double() ** 2).sum(0) for f in feature_list)
    return float(count), total, total_sq


class SpecAugment(nn.Module):
    """SpecAugment masking (Park et al. 2019) of padded batches, applied in training only.

    Each utterance gets ``freq_masks`` bands of up to ``freq_width`` bins and ``time_masks``
    spans of up to ``time_width`` frames (at most ``max_time_ratio`` of its length) set to 0,
    which is the mean after CMVN.
    """

    def __init__(self, freq_masks: int = 2, freq_width: int = 8, time_masks: int = 2,
                 time_width: int = 20, max_time_ratio: float = 0.2) -> None:
        super().__init__()
        self.freq_masks, self.freq_width = freq_masks, freq_width
        self.time_masks, self.time_width = time_masks, time_width
        self.max_time_ratio = max_time_ratio

    def forward(self, feats: Tensor, lengths: Tensor) -> Tensor:
        if not self.training:
            return feats
        batch, frames, dim = feats.shape
        keep = torch.ones_like(feats, dtype=torch.bool)
        bins = torch.arange(dim, device=feats.device)
        steps = torch.arange(frames, device=feats.device)
        for b in range(batch):
            for _ in range(self.freq_masks):
                width = int(torch.randint(0, self.freq_width + 1, ()))
                start = int(torch.randint(0, max(1, dim - width), ()))
                keep[b, :, (bins >= start) & (bins < start + width)] = False
            limit = min(self.time_width, int(self.max_time_ratio * int(lengths[b])))
            for _ in range(self.time_masks):
                width = int(torch.randint(0, limit + 1, ()))
                start = int(torch.randint(0, max(1, int(lengths[b]) - width), ()))
                keep[b, (steps >= start) & (steps < start + width), :] = False
        return feats * keep


def stack_frames(feats: Tensor, lengths: Tensor, factor: int) -> tuple[Tensor, Tensor]:
    """Concatenate ``factor`` consecutive frames and keep every ``factor``-th: LFR features.

    ``(B, T, D)`` becomes ``(B, ceil(T/factor), factor*D)``; lengths become
    ``ceil(lengths/factor)``. The last group of a sequence is padded with zeros.
    """
    if factor == 1:
        return feats, lengths
    batch, frames, dim = feats.shape
    pad = (-frames) % factor
    if pad:
        feats = torch.cat([feats, feats.new_zeros(batch, pad, dim)], dim=1)
    stacked = feats.reshape(batch, (frames + pad) // factor, factor * dim)
    return stacked, torch.div(lengths + factor - 1, factor, rounding_mode="floor")
