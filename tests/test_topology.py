"""The topology library: exact spectra, double stochasticity, determinism, bad inputs."""

from __future__ import annotations

import math

import numpy as np
import pytest

from lightning_gossip import topology as T
from lightning_gossip.pairing import Pairing

NAMES = sorted(T.TOPOLOGIES)


def sizes_for(name: str) -> list[int]:
    return [4, 6, 8, 9, 16] if name == "torus" else [1, 2, 3, 4, 5, 7, 8, 16]


@pytest.mark.parametrize("n", [3, 4, 5, 8, 13, 64])
def test_ring_eigenvalues_are_the_closed_form(n):
    w = T.build("ring", n).mixing_matrix(0)
    got = np.sort(np.linalg.eigvalsh(w))
    want = np.sort([1 / 3 + 2 / 3 * math.cos(2 * math.pi * k / n) for k in range(n)])
    np.testing.assert_allclose(got, want, atol=1e-12)
    assert T.build("ring", n).spectral_gap() == pytest.approx(T.ring_spectral_gap(n), abs=1e-12)


def test_ring_weights_small_world_sizes():
    np.testing.assert_array_equal(T.build("ring", 1).mixing_matrix(), [[1.0]])
    np.testing.assert_array_equal(T.build("ring", 2).mixing_matrix(), [[0.5, 0.5], [0.5, 0.5]])
    w = T.build("ring", 5).mixing_matrix()
    assert set(np.unique(w)) == {0.0, 1 / 3}
    p = T.build("ring", 2).peers(0)
    assert p.recv_from == ((1, 0.5),) and p.send_to == (1,)


@pytest.mark.parametrize("name", NAMES)
def test_every_matrix_is_doubly_stochastic_and_peers_agree(name):
    for n in sizes_for(name):
        topo = T.build(name, n, seed=3)
        assert topo.name == name and topo.world_size == n
        for step in range(6):
            w = topo.mixing_matrix(step)
            assert w.shape == (n, n)
            assert T.is_doubly_stochastic(w), (name, n, step)
            assert T.is_connected(w) or topo.is_time_varying
            for rank in range(n):
                p = topo.peers(rank, step)
                assert p.self_weight == pytest.approx(w[rank, rank])
                row = {j: w[rank, j] for j in range(n) if j != rank and w[rank, j] > 0}
                assert dict(p.recv_from) == pytest.approx(row)
                assert set(p.send_to) == {r for r in range(n) if r != rank and w[r, rank] > 0}
                assert p.self_weight + sum(wt for _, wt in p.recv_from) == pytest.approx(1.0)


def test_random_ring_is_the_same_for_the_same_seed_and_step_and_varies():
    a, b = T.build("random_ring", 16, seed=7), T.build("random_ring", 16, seed=7)
    for step in range(20):
        np.testing.assert_array_equal(a.mixing_matrix(step), b.mixing_matrix(step))
        assert all(a.peers(r, step) == b.peers(r, step) for r in range(16))
    assert not np.array_equal(a.mixing_matrix(0), a.mixing_matrix(1))
    other_seed = T.build("random_ring", 16, seed=8)
    assert not np.array_equal(a.mixing_matrix(0), other_seed.mixing_matrix(0))
    # each step is a ring: every rank has exactly two distinct neighbours, weight 1/3
    for step in range(5):
        assert all(len(a.peers(r, step).send_to) == 2 for r in range(16))


def test_random_ring_expected_gram_matches_monte_carlo_and_closed_form():
    topo = T.build("random_ring", 12, seed=0)
    exact = topo.expected_gram()
    mc = T.Topology.expected_gram(topo)  # the generic Monte-Carlo mean over the schedule
    np.testing.assert_allclose(mc, exact, atol=0.02)
    for n in (4, 8, 64, 1024):
        assert T.build("random_ring", n).spectral_gap() == pytest.approx(
            T.random_ring_spectral_gap(n))
    assert T.random_ring_spectral_gap(1024) == pytest.approx(2 / 3, abs=1e-3)


def test_ring_gap_collapses_while_random_ring_stays_large():
    assert T.build("ring", 64).spectral_gap() == pytest.approx(0.0032, abs=1e-4)
    assert T.build("random_ring", 64).spectral_gap() > 0.66
    assert T.build("ring", 64).mean_square_gap() < 0.01


def test_one_peer_exponential_averages_exactly_in_log2_steps():
    n = 16
    topo = T.build("one_peer_exponential", n)
    assert topo.is_time_varying and all(len(topo.peers(0, t).send_to) == 1 for t in range(8))
    prod = np.eye(n)
    for t in range(4):
        prod = topo.mixing_matrix(t) @ prod
    np.testing.assert_allclose(prod, np.full((n, n), 1 / n), atol=1e-12)


def test_exponential_and_torus_and_complete():
    e = T.build("exponential", 8)
    assert e.peers(0).send_to == (1, 2, 4) and e.degree() == 3
    assert T.build("torus", 12).shape == (3, 4)
    t = T.build("torus", 16)
    assert all(len(t.peers(r).send_to) == 4 for r in range(16))
    assert T.build("complete", 5).spectral_gap() == pytest.approx(1.0)


def test_custom_matrix_accepted_and_validated():
    w = np.array([[0.5, 0.5, 0.0], [0.5, 0.25, 0.25], [0.0, 0.25, 0.75]])
    topo = T.resolve(w, 3)
    assert topo.name == "custom" and not topo.is_time_varying
    np.testing.assert_array_equal(topo.mixing_matrix(5), w)
    with pytest.raises(ValueError, match="square"):
        T.MatrixTopology(np.ones((2, 3)) / 3)
    with pytest.raises(ValueError, match="row 0 sums"):
        T.MatrixTopology([[0.6, 0.5], [0.4, 0.5]])
    with pytest.raises(ValueError, match="column"):
        T.MatrixTopology([[0.5, 0.5], [0.6, 0.4]])
    with pytest.raises(ValueError, match="disconnected"):
        T.MatrixTopology(np.eye(3))
    with pytest.raises(ValueError, match="negative"):
        T.MatrixTopology([[1.5, -0.5], [-0.5, 1.5]])
    with pytest.raises(ValueError, match="for 3 ranks but the run has 4"):
        T.resolve(w, 4)


@pytest.mark.parametrize("bad", ["rnig", "", None, 3])
def test_unknown_name_lists_the_choices(bad):
    with pytest.raises(ValueError, match="valid choices: complete, exponential"):
        T.build(bad, 4)


@pytest.mark.parametrize("n", [0, -1, 2.5, True, "4"])
def test_invalid_world_size(n):
    with pytest.raises(ValueError, match="world_size"):
        T.build("ring", n)


def test_torus_rejects_world_sizes_without_a_2d_factorisation():
    with pytest.raises(ValueError, match="Valid world sizes include 4, 6, 8"):
        T.build("torus", 7)


def test_pairing_is_bipartite_and_connected():
    for n in range(2, 12):
        for name in ("ring", "random"):
            p = Pairing(name, n, seed=1)
            assert set(p.actives) | set(p.passives) == set(range(n))
            edges = {(a, b) for a in p.actives for b in p.candidates(a)}
            assert all(b in p.passives for _, b in edges)
            seen, changed = {0}, True
            while changed:
                changed = False
                for a, b in edges:
                    if (a in seen) != (b in seen):
                        seen |= {a, b}
                        changed = True
            assert seen == set(range(n)), (name, n)
            for b in p.passives:
                assert all(b in p.candidates(a) for a in p.contacted_by(b))
            assert all(p.partner(a, k) in p.candidates(a) for a in p.actives for k in range(5))
    with pytest.raises(ValueError, match="valid choices: ring, random"):
        Pairing("torus", 4)
    with pytest.raises(ValueError, match="world_size must be an integer >= 2, got 1"):
        Pairing("ring", 1)


def test_one_world_size_check_and_wording():
    from lightning_gossip.topology import check_world_size

    assert check_world_size(3) == 3 and check_world_size(np.int64(2), minimum=2) == 2
    for bad, minimum in ((0, 1), (1, 2), (2.0, 1), (True, 1)):
        with pytest.raises(ValueError, match=f"world_size must be an integer >= {minimum}, got"):
            check_world_size(bad, minimum)
    with pytest.raises(ValueError, match="world_size must be an integer >= 1, got 0"):
        T.build("ring", 0)
    with pytest.raises(ValueError, match="world_size must be an integer >= 1, got 0"):
        T.torus_shape(0)
    with pytest.raises(ValueError, match="unknown AD-PSGD pairing 'torus'"):
        Pairing("torus", 4)
