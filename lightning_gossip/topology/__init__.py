"""Communication graphs and their mixing matrices.

Pure NumPy: nothing here touches ``torch.distributed``. The strategies, the analysis CLI and the
simulator all use these objects, so what a strategy exchanges at step ``t`` is exactly what
:meth:`Topology.mixing_matrix` says for ``t``.

Conventions
-----------
* ``W = mixing_matrix(t)`` is ``n x n`` and doubly stochastic. Row ``i`` holds the weights rank
  ``i`` applies: ``x_i <- sum_j W[i, j] * x_j``.
* ``peers(i, t)`` lists who rank ``i`` receives from (``W[i, j] > 0``, ``j != i``, with the
  weight) and who it sends to (``W[r, i] > 0``, ``r != i``). For symmetric graphs the two sets
  coincide.
* Time-varying topologies are deterministic functions of ``(seed, step)``; every rank computes
  the same matrix without communicating.

Example::

    >>> from lightning_gossip import topology
    >>> ring = topology.build("ring", 8)
    >>> ring.peers(0, step=0).send_to
    (1, 7)
    >>> round(ring.spectral_gap(), 4)
    0.1953
    >>> topology.build("random_ring", 8, seed=1).mixing_matrix(step=5).sum(axis=0)
    array([1., 1., 1., 1., 1., 1., 1., 1.])

Modules: :mod:`~lightning_gossip.topology.base` (the :class:`Topology` interface),
:mod:`~lightning_gossip.topology.graphs` (the built-in graphs, :func:`build`, :func:`resolve`,
:func:`resolve_learners`),
:mod:`~lightning_gossip.topology.functions` (world-size check, matrix checks, closed forms);
everything is importable from ``lightning_gossip.topology``. A topology over some of the ranks
(an elastic fit's survivors) is :class:`~lightning_gossip.elastic.member_topology.MemberTopology`.
"""

from __future__ import annotations

from lightning_gossip.topology.base import Peers, Topology
from lightning_gossip.topology.functions import (
    check_mixing_matrix,
    check_world_size,
    is_connected,
    is_doubly_stochastic,
    powers_of_two_below,
    random_ring_order,
    random_ring_spectral_gap,
    ring_spectral_gap,
    static_spectral_gap,
    torus_shape,
)
from lightning_gossip.topology.graphs import (
    TOPOLOGIES,
    CompleteTopology,
    ExponentialTopology,
    MatrixTopology,
    OnePeerExponentialTopology,
    RandomRingTopology,
    RingTopology,
    TorusTopology,
    build,
    check_name,
    resolve,
    resolve_learners,
)

__all__ = [
    "TOPOLOGIES",
    "CompleteTopology",
    "ExponentialTopology",
    "MatrixTopology",
    "OnePeerExponentialTopology",
    "Peers",
    "RandomRingTopology",
    "RingTopology",
    "Topology",
    "TorusTopology",
    "build",
    "check_mixing_matrix",
    "check_name",
    "check_world_size",
    "is_connected",
    "is_doubly_stochastic",
    "powers_of_two_below",
    "random_ring_order",
    "random_ring_spectral_gap",
    "resolve",
    "resolve_learners",
    "ring_spectral_gap",
    "static_spectral_gap",
    "torus_shape",
]

