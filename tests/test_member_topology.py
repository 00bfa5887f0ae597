"""The survivors' topology of an elastic ``dpsgd`` fit (:class:`MemberTopology`): its matrices
over the whole world, and the agreed stop's arithmetic over its members only."""

from __future__ import annotations

import numpy as np
import pytest

from lightning_gossip.elastic import MemberTopology
from lightning_gossip.hierarchy import NodeLayout
from lightning_gossip.sync_gossip import StopAgreement
from lightning_gossip.topology import build, is_doubly_stochastic


@pytest.mark.parametrize("name", ["ring", "random_ring", "exponential", "complete"])
def test_members_mix_as_the_base_numbered_from_their_first_step(name: str) -> None:
    members, first = (0, 2, 3, 5), 17
    base = build(name, len(members), seed=3)
    topo = MemberTopology(base, members, world_size=6, first_step=first)
    for t in range(first, first + 5):
        w = topo.mixing_matrix(t)
        assert is_doubly_stochastic(w)
        np.testing.assert_array_equal(w[np.ix_(members, members)], base.mixing_matrix(t - first))
        for outside in (1, 4):  # kept as they are, no messages
            assert w[outside, outside] == 1.0 and w[outside].sum() == 1.0
            assert topo.peers(outside, t).send_to == () == topo.peers(outside, t).recv_from


def test_bad_members_are_refused() -> None:
    with pytest.raises(ValueError, match="3 members but the topology is over 4"):
        MemberTopology(build("ring", 4), (0, 1, 2), world_size=5)
    with pytest.raises(ValueError, match="increasing order"):
        MemberTopology(build("ring", 3), (2, 0, 1), world_size=5)
    with pytest.raises(ValueError, match="below 5"):
        MemberTopology(build("ring", 3), (0, 1, 5), world_size=5)


def test_an_agreed_stop_needs_to_reach_the_members_only() -> None:
    """Rank 1 was lost: a stop proposed by a survivor reaches the survivors in a few rounds;
    counted over every rank (as before the members were known) it never reaches rank 1."""
    topo = MemberTopology(build("random_ring", 3, 0), (0, 2, 3), world_size=4, first_step=10)
    agreement = StopAgreement(topo, NodeLayout(4, 1, 0, 0))
    assert agreement.ranks == (0, 2, 3)
    assert 10 < agreement.stop_step_for(2, 10) <= 14
    agreement.ranks = (0, 1, 2, 3)
    with pytest.raises(RuntimeError, match=r"does not reach ranks \[1\]"):
        agreement.stop_step_for(2, 10)
