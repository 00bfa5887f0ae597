"""Features: fbank shapes, deltas, global CMVN, SpecAugment, frame stacking, the BLSTM model."""

from __future__ import annotations

import pytest
import torch

from recipes.asr.dataset import expected_frames
from recipes.asr.features import (
    GlobalCMVN,
    SpecAugment,
    accumulate_stats,
    compute_fbank,
    fbank_dim,
    stack_frames,
)
from recipes.asr.model import BLSTMAcousticModel


def noise(seconds: float, seed: int = 0, scale: float = 0.1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return scale * torch.randn(int(16000 * seconds), generator=g)


@pytest.mark.parametrize("bins,deltas", [(40, False), (80, False), (40, True), (80, True)])
def test_fbank_shapes(bins: int, deltas: bool) -> None:
    for seconds in (0.025, 0.5, 1.234):
        feats = compute_fbank(noise(seconds), num_mel_bins=bins, deltas=deltas)
        assert feats.shape == (expected_frames(int(16000 * seconds)), fbank_dim(bins, deltas))
        assert torch.isfinite(feats).all()
    with pytest.raises(ValueError, match="shorter than one frame"):
        compute_fbank(noise(0.01))


def test_fbank_is_log_energy_like_and_deltas_of_constant_signal_vanish() -> None:
    quiet, loud = compute_fbank(noise(0.5, scale=0.01)), compute_fbank(noise(0.5, scale=0.1))
    # 20 dB more signal adds log(100) to every mel band's log energy
    assert torch.allclose((loud - quiet).mean(), torch.tensor(4.6052), atol=0.05)
    t = torch.arange(8000) / 16000
    steady = compute_fbank(0.3 * torch.sin(2 * torch.pi * 500 * t), deltas=True)
    band = slice(6, 11)  # the mel bands around 500 Hz, where the tone's energy is
    assert steady[5:-5, band].min() > steady[5:-5, 30:40].max() + 5
    assert steady[5:-5, 40:][:, band].abs().max() < 0.01  # first-order deltas
    assert steady[5:-5, 80:][:, band].abs().max() < 0.01  # second-order deltas


def test_global_cmvn_normalizes_training_statistics() -> None:
    feats = [compute_fbank(noise(s, seed=i, scale=0.05 * (i + 1)))
             for i, s in enumerate((0.4, 0.7, 1.1))]
    cmvn = GlobalCMVN(40)
    assert not bool(cmvn.initialized)
    cmvn.set_stats(*accumulate_stats(feats))
    normed = cmvn(torch.cat(feats))
    assert bool(cmvn.initialized)
    assert torch.allclose(normed.mean(0), torch.zeros(40), atol=1e-4)
    assert torch.allclose(normed.std(0, unbiased=False), torch.ones(40), atol=1e-3)
    restored = GlobalCMVN(40)
    restored.load_state_dict(cmvn.state_dict())  # statistics travel in checkpoints
    assert torch.equal(restored(feats[0]), cmvn(feats[0]))


def test_spec_augment_masks_only_in_training() -> None:
    torch.manual_seed(0)
    aug = SpecAugment(freq_masks=2, freq_width=5, time_masks=2, time_width=10)
    x = torch.ones(3, 50, 40)
    lengths = torch.tensor([50, 30, 10])
    aug.eval()
    assert torch.equal(aug(x, lengths), x)
    aug.train()
    y = aug(x, lengths)
    assert set(y.unique().tolist()) <= {0.0, 1.0} and (y == 0).any()
    zero_rows = (y == 0).all(dim=2)  # time masks: whole frames
    zero_cols = (y == 0).all(dim=1)  # frequency masks: whole bands
    assert zero_cols.sum(1).max() <= 10 and zero_rows.sum(1).max() <= 20
    assert zero_rows[2].sum() <= 2 * 2  # time masks stay within 20% of a 10-frame utterance


def test_stack_frames() -> None:
    x = torch.arange(2 * 7 * 2, dtype=torch.float).reshape(2, 7, 2)
    y, lengths = stack_frames(x, torch.tensor([7, 4]), 3)
    assert y.shape == (2, 3, 6) and lengths.tolist() == [3, 2]
    assert torch.equal(y[0, 0], x[0, :3].flatten())
    assert torch.equal(y[0, 2], torch.cat([x[0, 6], torch.zeros(4)]))
    same, same_len = stack_frames(x, torch.tensor([7, 4]), 1)
    assert same is x and same_len.tolist() == [7, 4]


def test_blstm_output_is_independent_of_padding() -> None:
    torch.manual_seed(0)
    model = BLSTMAcousticModel(40, 29, num_layers=2, hidden_size=16, bottleneck_dim=8,
                               frame_stacking=3).eval()
    a, b = torch.randn(31, 40), torch.randn(17, 40)
    batch = torch.zeros(2, 31, 40)
    batch[0], batch[1, :17] = a, b
    out, lengths = model(batch, torch.tensor([31, 17]))
    alone, alone_len = model(b[None], torch.tensor([17]))
    assert out.shape == (2, 11, 29) and lengths.tolist() == [11, 6] == [11, *alone_len.tolist()]
    # the backward direction starts at each utterance's own end, not at the padding
    assert torch.allclose(out[1, :6], alone[0], atol=1e-5)
    assert isinstance(model.output[0], torch.nn.Linear) and model.output[0].out_features == 8
