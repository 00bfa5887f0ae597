"""Stacked bidirectional LSTM acoustic model (the network of the paper's Switchboard system)."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from recipes.asr.features import GlobalCMVN, SpecAugment, stack_frames


class BLSTMAcousticModel(nn.Module):
    """CMVN -> SpecAugment (training) -> frame stacking -> BLSTM stack -> [bottleneck] -> output.

    Args:
        input_dim: feature dimension per 10 ms frame.
        num_targets: output units (CTC characters incl. blank, or senones).
        num_layers: BLSTM layers (the paper: 6).
        hidden_size: units per direction (the paper: 512).
        bottleneck_dim: optional linear layer between the LSTMs and the output (paper: 256).
        dropout: between LSTM layers and before the output.
        frame_stacking: concatenate this many frames and keep every n-th; the model then runs
            at ``10 * frame_stacking`` ms per step.
        spec_augment: masking applied in training; ``None`` disables it.
    """

    def __init__(self, input_dim: int, num_targets: int, *, num_layers: int = 4,
                 hidden_size: int = 256, bottleneck_dim: int | None = None, dropout: float = 0.1,
                 frame_stacking: int = 3, spec_augment: SpecAugment | None = None) -> None:
        super().__init__()
        if frame_stacking < 1:
            raise ValueError("frame_stacking must be >= 1")
        self.frame_stacking = frame_stacking
        self.cmvn = GlobalCMVN(input_dim)
        self.spec_augment = spec_augment
        self.lstm = nn.LSTM(input_dim * frame_stacking, hidden_size, num_layers=num_layers,
                            batch_first=True, bidirectional=True,
                            dropout=dropout if num_layers > 1 else 0.0)
        self.dropout = nn.Dropout(dropout)
        layers: list[nn.Module] = []
        width = 2 * hidden_size
        if bottleneck_dim:
            layers.append(nn.Linear(width, bottleneck_dim))
            width = bottleneck_dim
        layers.append(nn.Linear(width, num_targets))
        self.output = nn.Sequential(*layers)

    def output_lengths(self, lengths: Tensor) -> Tensor:
        """Number of output frames for inputs of ``lengths`` frames."""
        return (lengths + self.frame_stacking - 1) // self.frame_stacking

    def forward(self, feats: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
        """``(B, T, input_dim)`` features -> ``(B, T', num_targets)`` logits and their lengths."""
        frames = feats.shape[1]
        positions = torch.arange(frames, device=feats.device)
        valid = (positions < lengths.to(feats.device)[:, None]).unsqueeze(-1)
        x = self.cmvn(feats) * valid
        if self.spec_augment is not None:
            x = self.spec_augment(x, lengths)
        x, out_lengths = stack_frames(x, lengths, self.frame_stacking)
        packed = pack_padded_sequence(x, out_lengths.cpu(), batch_first=True,
                                      enforce_sorted=False)
        y, _ = self.lstm(packed)
        y, _ = pad_packed_sequence(y, batch_first=True, total_length=x.shape[1])
        return self.output(self.dropout(y)), out_lengths

