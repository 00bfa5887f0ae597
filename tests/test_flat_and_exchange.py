"""Pure pieces of the data path: the flat replica buffer, the finite-value check, the mixing."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_gossip.errors import NonFiniteFromPeer
from lightning_gossip.exchange import NeighborExchange, check_finite
from lightning_gossip.flat import FlatState, mixed_tensors
from lightning_gossip.topology import Peers


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


def _received(send: torch.Tensor, recv: dict[int, torch.Tensor]) -> NeighborExchange:
    """A finished round of rank 0 as :meth:`NeighborExchange.wait` leaves it (the buffers
    filled), without a process group: the mixing and the check are local arithmetic."""
    ex = NeighborExchange.__new__(NeighborExchange)
    ex.send = send
    ex.peers = Peers(rank=0, self_weight=0.4,
                     recv_from=tuple((j, 0.6 / len(recv)) for j in recv),
                     send_to=tuple(recv))
    ex.recv = list(recv.items())
    return ex


def test_mixed_delta_is_the_mixing_minus_the_snapshot_in_as_many_passes():
    g = torch.Generator().manual_seed(0)
    x, a, b = (torch.randn(1000, generator=g) for _ in range(3))
    ex = _received(x, {1: a, 3: b})
    want = 0.4 * x.double() + 0.3 * a.double() + 0.3 * b.double()
    torch.testing.assert_close(ex.mixed().double(), want)
    out = torch.empty_like(x)
    assert ex.mixed(out=out, delta=True) is out
    torch.testing.assert_close(out.double(), want - x.double())
    ex.check_mixed(out)  # finite: no error


def test_check_of_the_mixed_result_names_the_peer_that_sent_nan_or_inf():
    for bad in (float("nan"), float("inf"), -float("inf")):
        x, a, b = torch.randn(100), torch.randn(100), torch.randn(100)
        b[7] = bad
        ex = _received(x, {1: a, 3: b})
        with pytest.raises(NonFiniteFromPeer, match="from rank 3") as err:
            ex.check_mixed(ex.mixed(delta=True))
        assert err.value.peer == 3
    x = torch.randn(100)
    x[0] = float("nan")  # this rank's own snapshot: not a peer's fault (as the check before)
    ex = _received(x, {1: torch.randn(100)})
    ex.check_mixed(ex.mixed(delta=True))
