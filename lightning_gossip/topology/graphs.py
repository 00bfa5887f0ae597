"""The built-in topologies, :class:`MatrixTopology`, and :func:`build` / :func:`resolve`."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from lightning_gossip.topology.base import Peers, Topology, _peers_from_matrix
from lightning_gossip.topology.functions import (
    check_mixing_matrix,
    powers_of_two_below,
    random_ring_order,
    torus_shape,
)

__all__ = [
    "TOPOLOGIES",
    "CompleteTopology",
    "ExponentialTopology",
    "MatrixTopology",
    "OnePeerExponentialTopology",
    "RandomRingTopology",
    "RingTopology",
    "TorusTopology",
    "build",
    "check_name",
    "resolve",
]


class RingTopology(Topology):
    """Fixed ring: every rank averages with its two neighbours, weights 1/3 each.

    World size 2 gives weights 1/2; world size 1 the identity. The spectral gap is
    ``1 - (1/3 + 2/3 cos(2 pi / n))`` and shrinks like ``1/n^2``.
    """

    name = "ring"

    def mixing_matrix(self, step: int = 0) -> np.ndarray:
        return _ring_matrix(np.arange(self.world_size))


class RandomRingTopology(Topology):
    """RAND-PSGD: a ring over a fresh random order of the ranks at every step.

    The order at step ``t`` is :func:`random_ring_order` of ``(seed, t)``, so every rank draws
    the same ring without communicating. Each step costs what a ring costs (two peers), but the
    expected mixing has a gap near 2/3 for any world size.
    """

    name = "random_ring"
    is_time_varying = True

    def __init__(self, world_size: int, seed: int = 0) -> None:
        super().__init__(world_size, seed)
        if self.world_size <= 3:
            # With 1-3 ranks every ordering is the same ring: nothing varies.
            self.is_time_varying = False

    def order(self, step: int) -> np.ndarray:
        """The ring order at ``step`` (:func:`~lightning_gossip.topology.random_ring_order`)."""
        return random_ring_order(self.world_size, self.seed, step)

    def mixing_matrix(self, step: int = 0) -> np.ndarray:
        return _ring_matrix(self.order(step))

    def peers(self, rank: int, step: int = 0) -> Peers:
        # O(n) instead of building the dense matrix: this runs on the training hot path.
        self._check_rank(rank)
        n = self.world_size
        if n <= 2:
            return _peers_from_matrix(self.mixing_matrix(step), rank)
        order = self.order(step)
        pos = int(np.flatnonzero(order == rank)[0])
        left, right = int(order[pos - 1]), int(order[(pos + 1) % n])
        w = 1.0 / 3.0
        return Peers(rank, w, ((left, w), (right, w)), (left, right))

    def expected_gram(self) -> np.ndarray:
        # Exact: the distribution of orders is invariant under relabelling the ranks, so
        # E[W^T W] = c I + (1 - c)/n J, and its diagonal is sum_j W_ji^2 = 3 * (1/3)^2.
        n = self.world_size
        diag = 1.0 / 3.0
        c = (diag - 1.0 / n) / (1.0 - 1.0 / n)
        return c * np.eye(n) + (1.0 - c) / n * np.ones((n, n))


class ExponentialTopology(Topology):
    """Static exponential graph: rank ``i`` sends to ``i + 2^k`` for every ``2^k < n``.

    Receives from ``i - 2^k``; uniform weights ``1/(m + 1)`` with ``m = ceil(log2 n)`` peers.
    Directed, so ``W`` is doubly stochastic but not symmetric (except at small ``n``).
    """

    name = "exponential"

    def mixing_matrix(self, step: int = 0) -> np.ndarray:
        n = self.world_size
        hops = powers_of_two_below(n)
        w = np.zeros((n, n))
        weight = 1.0 / (len(hops) + 1)
        for i in range(n):
            w[i, i] = weight
            for h in hops:
                w[i, (i - h) % n] += weight
        return w


class OnePeerExponentialTopology(Topology):
    """Time-varying one-peer exponential graph: at step ``t`` rank ``i`` sends to ``i + 2^k``.

    ``k = t mod ceil(log2 n)``; rank ``i`` averages with the rank ``i - 2^k`` it receives from:
    ``W_t = (I + P_k) / 2``. For powers of two, ``log2 n`` consecutive steps average exactly.
    """

    name = "one_peer_exponential"
    is_time_varying = True

    def __init__(self, world_size: int, seed: int = 0) -> None:
        super().__init__(world_size, seed)
        self._hops = powers_of_two_below(self.world_size)
        if len(self._hops) <= 1:
            self.is_time_varying = False

    @property
    def period(self) -> int:
        """Steps after which the schedule repeats (``ceil(log2 n)``, at least 1)."""
        return max(len(self._hops), 1)

    def mixing_matrix(self, step: int = 0) -> np.ndarray:
        n = self.world_size
        if n == 1:
            return np.eye(1)
        h = self._hops[step % len(self._hops)]
        w = 0.5 * np.eye(n)
        for i in range(n):
            w[i, (i - h) % n] += 0.5
        return w

    def expected_gram(self) -> np.ndarray:
        # Exact: the schedule is periodic, so the expectation is the mean over one period.
        mats = [self.mixing_matrix(t) for t in range(self.period)]
        return sum(w.T @ w for w in mats) / len(mats)


class TorusTopology(Topology):
    """2-D torus ``rows x cols`` (the most square factorisation, both sides >= 2).

    Every rank mixes with its up/down/left/right neighbours (deduplicated when a side is 2)
    with uniform weights ``1/(degree + 1)``. Needs a world size with such a factorisation.
    """

    name = "torus"

    def __init__(self, world_size: int, seed: int = 0) -> None:
        super().__init__(world_size, seed)
        self.shape = torus_shape(self.world_size)

    def mixing_matrix(self, step: int = 0) -> np.ndarray:
        rows, cols = self.shape
        n = self.world_size
        adj = np.zeros((n, n), dtype=bool)
        for r in range(rows):
            for c in range(cols):
                i = r * cols + c
                for dr, dc in ((1, 0), (-1, 0), (0, 1), (0, -1)):
                    j = ((r + dr) % rows) * cols + (c + dc) % cols
                    adj[i, j] = True
        np.fill_diagonal(adj, False)
        degree = int(adj[0].sum())
        w = adj.astype(float) / (degree + 1)
        np.fill_diagonal(w, 1.0 / (degree + 1))
        return w


class CompleteTopology(Topology):
    """Everyone averages with everyone: ``W = J / n`` (what an all-reduce computes)."""

    name = "complete"

    def mixing_matrix(self, step: int = 0) -> np.ndarray:
        n = self.world_size
        return np.full((n, n), 1.0 / n)


class MatrixTopology(Topology):
    """A user-supplied static mixing matrix.

    The matrix must be square, non-negative, doubly stochastic and connected (see
    :func:`check_mixing_matrix`); otherwise ``ValueError`` says which property fails.

    Example::

        >>> import numpy as np
        >>> w = np.array([[0.5, 0.5, 0.0], [0.5, 0.25, 0.25], [0.0, 0.25, 0.75]])
        >>> MatrixTopology(w).peers(1).recv_from
        ((0, 0.5), (2, 0.25))
    """

    name = "custom"

    def __init__(self, matrix: np.ndarray | list, name: str = "custom") -> None:
        w = check_mixing_matrix(matrix)
        super().__init__(w.shape[0])
        self._matrix = w
        self.name = name

    def mixing_matrix(self, step: int = 0) -> np.ndarray:
        return self._matrix.copy()


TOPOLOGIES: dict[str, Callable[[int, int], Topology]] = {
    "ring": RingTopology,
    "random_ring": RandomRingTopology,
    "exponential": ExponentialTopology,
    "one_peer_exponential": OnePeerExponentialTopology,
    "torus": TorusTopology,
    "complete": CompleteTopology,
}
"""Built-in topologies by name: ``TOPOLOGIES[name](world_size, seed)`` builds one."""


def build(name: str, world_size: int, seed: int = 0) -> Topology:
    """Build a named topology.

    Args:
        name: one of :data:`TOPOLOGIES` (``ring``, ``random_ring``, ``exponential``,
            ``one_peer_exponential``, ``torus``, ``complete``).
        world_size: number of ranks, >= 1.
        seed: seeds the time-varying schedules (``random_ring``); all ranks must pass the same.

    Raises:
        ValueError: unknown name (the message lists the valid ones) or invalid world size.
    """
    check_name(name)
    return TOPOLOGIES[name](world_size, seed)


def check_name(name: object) -> None:
    """Raise ``ValueError`` listing the valid choices unless ``name`` is a built-in topology."""
    if not isinstance(name, str) or name not in TOPOLOGIES:
        raise ValueError(
            f"unknown topology {name!r}; valid choices: {', '.join(sorted(TOPOLOGIES))}"
            " (or pass a Topology or a doubly stochastic matrix)"
        )


def resolve(spec: str | Topology | np.ndarray | list, world_size: int, seed: int = 0) -> Topology:
    """Turn what a user passed as ``topology=`` (name, :class:`Topology` or matrix) into one.

    Raises:
        ValueError: the topology was built for another world size, or the spec is invalid.
    """
    if isinstance(spec, Topology):
        topo = spec
    elif isinstance(spec, str):
        topo = build(spec, world_size, seed)
    else:
        topo = MatrixTopology(np.asarray(spec, dtype=float))
    if topo.world_size != world_size:
        raise ValueError(
            f"topology {topo.name!r} is for {topo.world_size} ranks but the run has {world_size}"
        )
    return topo


def resolve_learners(spec: str | Topology | np.ndarray | list, num_nodes: int, devices: int,
                     seed: int = 0, hierarchical: bool = False) -> Topology:
    """:func:`resolve` for ``num_nodes`` nodes of ``devices`` processes: over the nodes with
    ``hierarchical`` (several processes per node: a node is one learner), else over all ranks.

    Raises ``ValueError`` (saying it is over nodes) when it does not fit, e.g. a matrix or a
    :class:`Topology` built for another size.

    >>> resolve_learners("ring", 2, 4, hierarchical=True).world_size
    2
    """
    if not (hierarchical and devices > 1):
        return resolve(spec, num_nodes * devices, seed)
    try:
        return resolve(spec, num_nodes, seed)
    except ValueError as e:
        raise ValueError(
            f"DPSGDStrategy(hierarchical=True) gossips between the {num_nodes} nodes (of "
            f"{devices} processes each), so the topology must be over {num_nodes} nodes: {e}"
        ) from e


def _ring_matrix(order: np.ndarray) -> np.ndarray:
    n = len(order)
    w = np.zeros((n, n))
    if n == 1:
        w[0, 0] = 1.0
        return w
    if n == 2:
        return np.full((2, 2), 0.5)
    third = 1.0 / 3.0
    for pos, i in enumerate(order):
        w[i, i] = third
        w[i, order[pos - 1]] += third
        w[i, order[(pos + 1) % n]] += third
    return w


