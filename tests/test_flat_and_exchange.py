"""Pure pieces of the data path: the flat replica buffer and the finite-value check."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_gossip.exchange import NonFiniteFromPeer, check_finite
from lightning_gossip.flat import FlatState, mixed_tensors


def test_flat_state_covers_parameters_and_float_buffers_once():
    lin = nn.Linear(3, 3)
    model = nn.Sequential(lin, nn.BatchNorm1d(3), nn.Linear(3, 3))
    model[2].weight = lin.weight  # tied weights appear once
    names = [n for n, _ in mixed_tensors(model)]
    assert "1.num_batches_tracked" not in names  # integer buffer: not mixed
    assert "1.running_mean" in names and "1.running_var" in names
    assert names.count("0.weight") == 1 and "2.weight" not in names
    state = FlatState(model)
    assert state.numel == sum(t.numel() for _, t in mixed_tensors(model))


def test_pack_copy_add_round_trip_including_low_precision():
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)).to(torch.bfloat16)
    state = FlatState(model)
    x = state.pack()
    assert x.dtype == torch.float32
    state.add_(torch.ones_like(x))
    torch.testing.assert_close(state.pack(), (x + 1).to(torch.bfloat16).float())
    state.copy_(torch.zeros_like(x))
    assert all(float(p.detach().abs().sum()) == 0 for p in model.parameters())


def test_finite_check_finds_nan_and_inf_and_tolerates_sum_overflow():
    check_finite(torch.randn(1000), peer=1, rank=0)
    check_finite(torch.full((10,), 3e38), peer=1, rank=0)  # finite values, overflowing sum
    for bad in (float("nan"), float("inf"), -float("inf")):
        t = torch.randn(1000)
        t[500] = bad
        with pytest.raises(NonFiniteFromPeer, match="from rank 3") as err:
            check_finite(t, peer=3, rank=0)
        assert err.value.peer == 3
