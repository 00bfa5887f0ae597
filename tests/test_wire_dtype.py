"""Compressed wire dtypes without processes: the mean-preserving mixing step on stacked replicas.

The multi-process checks (mean conserved and consensus reached on 4 gloo ranks, flat and
hierarchical) are in ``tests/test_hierarchical.py``.
"""

from __future__ import annotations

import pytest
import torch

from lightning_gossip.compression import (
    WIRE_DTYPES,
    check_wire_dtype,
    pairwise_delta,
    quantize,
    wire_bytes,
)
from lightning_gossip.topology import build


def _mix(x: torch.Tensor, topo_name: str, steps: int, dtype: torch.dtype) -> list[float]:
    """Run ``steps`` rounds the way every rank does it; return the mean drift per step."""
    n = x.shape[0]
    topo = build(topo_name, n, seed=5)
    mean0 = x.double().mean(0)
    drift = []
    for t in range(steps):
        q = [quantize(x[i], dtype) for i in range(n)]
        deltas = []
        for i in range(n):
            peers = topo.peers(i, t)
            theirs = [(q[j], w) for j, w in peers.recv_from]
            deltas.append(pairwise_delta(q[i], theirs, out=torch.empty(x.shape[1])))
        x += torch.stack(deltas)
        drift.append(float((x.double().mean(0) - mean0).abs().max()))
    return drift


@pytest.mark.parametrize("name", ["ring", "random_ring"])
@pytest.mark.parametrize("wire", ["bf16", "fp16"])
def test_mean_is_kept_and_consensus_reached(name, wire):
    g = torch.Generator().manual_seed(0)
    x = 0.3 * torch.randn(1, 500, generator=g) + torch.randn(4, 500, generator=g)
    mean = x.mean(0)
    d0 = float(((x - mean) ** 2).sum(1).mean() / (mean**2).sum())
    drift = _mix(x, name, 60, check_wire_dtype(wire))
    assert max(drift) < 1e-5  # fp32 rounding of 60 steps, not bf16's 4e-3
    mean = x.mean(0)
    d = float(((x - mean) ** 2).sum(1).mean() / (mean**2).sum())
    assert d < 1e-4 * d0, (d0, d)


def test_wire_bytes_are_halved():
    assert wire_bytes(1000, WIRE_DTYPES["bf16"]) * 2 == wire_bytes(1000, WIRE_DTYPES["fp32"])
    assert wire_bytes(1000, WIRE_DTYPES["fp16"]) == 2000
    assert quantize(torch.ones(3), torch.bfloat16).element_size() == 2


def test_unknown_wire_dtype():
    with pytest.raises(ValueError, match="wire_dtype must be one of"):
        check_wire_dtype("fp8")
