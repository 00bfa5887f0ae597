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
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

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
    "ring_spectral_gap",
    "static_spectral_gap",
    "torus_shape",
]

_TOL = 1e-6


@dataclass(frozen=True)
class Peers:
    """The neighbours of one rank at one step.

    Attributes:
        rank: the rank these peers belong to.
        self_weight: ``W[rank, rank]``.
        recv_from: ``(j, W[rank, j])`` for every other rank ``j`` whose value this rank mixes in.
        send_to: every other rank ``r`` that mixes in this rank's value (``W[r, rank] > 0``).
    """

    rank: int
    self_weight: float
    recv_from: tuple[tuple[int, float], ...]
    send_to: tuple[int, ...]

    @property
    def recv_ranks(self) -> tuple[int, ...]:
        return tuple(j for j, _ in self.recv_from)


class Topology(ABC):
    """A (possibly time-varying) doubly stochastic mixing matrix over ``world_size`` ranks."""

    name: str = "topology"
    is_time_varying: bool = False

    def __init__(self, world_size: int, seed: int = 0) -> None:
        self.world_size = check_world_size(world_size)
        self.seed = int(seed)

    # -- what subclasses define -------------------------------------------------------------
    @abstractmethod
    def mixing_matrix(self, step: int = 0) -> np.ndarray:
        """The ``n x n`` doubly stochastic matrix applied at optimizer step ``step``."""

    # -- derived ------------------------------------------------------------------------------
    def peers(self, rank: int, step: int = 0) -> Peers:
        """Who ``rank`` receives from (with weights) and sends to at ``step``."""
        self._check_rank(rank)
        return _peers_from_matrix(self.mixing_matrix(step), rank)

    def spectral_gap(self) -> float:
        """How fast repeated mixing drives replicas to consensus (larger is faster).

        Static ``W``: ``1 - max(|lambda_2|, |lambda_n|)``, i.e. one minus the second largest
        eigenvalue modulus. Time-varying ``W_t``: ``1 - lambda_2(E[W^T W])``, the expected
        per-step contraction of the squared consensus error. Subclasses compute the expectation
        exactly where they can; otherwise :meth:`expected_gram` averages over
        ``monte_carlo_steps`` consecutive steps of the actual schedule.
        """
        if not self.is_time_varying:
            return static_spectral_gap(self.mixing_matrix(0))
        return _gram_gap(self.expected_gram())

    monte_carlo_steps: int = 2000

    def expected_gram(self) -> np.ndarray:
        """``E[W_t^T W_t]`` over steps; a Monte-Carlo mean over the schedule by default."""
        acc = np.zeros((self.world_size, self.world_size))
        for t in range(self.monte_carlo_steps):
            w = self.mixing_matrix(t)
            acc += w.T @ w
        return acc / self.monte_carlo_steps

    def mean_square_gap(self) -> float:
        """``1 - lambda_2(E[W^T W])`` for static and time-varying topologies alike.

        For a static symmetric ``W`` this is ``1 - lambda_2(W)^2``. Use it to compare a fixed
        topology with a time-varying one on the same scale (the analysis CLI does).
        """
        if not self.is_time_varying:
            w = self.mixing_matrix(0)
            return _gram_gap(w.T @ w)
        return _gram_gap(self.expected_gram())

    def degree(self, step: int = 0) -> int:
        """Largest number of ranks any rank sends to at ``step`` (messages per step)."""
        w = self.mixing_matrix(step)
        off = (w > 0) & ~np.eye(self.world_size, dtype=bool)
        return int(off.sum(axis=0).max()) if self.world_size > 1 else 0

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is out of range for world size {self.world_size}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(world_size={self.world_size}, seed={self.seed})"


# ---------------------------------------------------------------------------------------------
# Concrete topologies
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# Small pure functions
# ---------------------------------------------------------------------------------------------


def random_ring_order(world_size: int, seed: int, step: int) -> np.ndarray:
    """The ring order RAND-PSGD uses at ``step``: a permutation drawn from ``(seed, step)``."""
    return _cached_order(int(world_size), int(seed), int(step)).copy()


@lru_cache(maxsize=64)
def _cached_order(world_size: int, seed: int, step: int) -> np.ndarray:
    rng = np.random.default_rng(np.random.SeedSequence([seed & 0xFFFFFFFF, step & 0xFFFFFFFF]))
    return rng.permutation(world_size)


def torus_shape(world_size: int) -> tuple[int, int]:
    """``(rows, cols)`` with ``rows <= cols``, both >= 2, as square as possible."""
    n = check_world_size(world_size)
    for rows in range(math.isqrt(n), 1, -1):
        if n % rows == 0:
            return rows, n // rows
    valid = [k for k in range(4, 65) if any(k % r == 0 for r in range(2, math.isqrt(k) + 1))]
    raise ValueError(
        f"torus needs a world size that factors as rows x cols with both >= 2; {n} does not. "
        f"Valid world sizes include {', '.join(map(str, valid[:12]))}, ...; use 'ring' or "
        "'random_ring' for other sizes."
    )


def check_mixing_matrix(matrix: np.ndarray | list, atol: float = _TOL) -> np.ndarray:
    """Validate a mixing matrix and return it as a float64 array.

    Raises:
        ValueError: not a square 2-D matrix, non-finite or negative entries, rows or columns
            not summing to 1, or a disconnected communication graph.
    """
    w = np.asarray(matrix, dtype=float)
    if w.ndim != 2 or w.shape[0] != w.shape[1] or w.shape[0] == 0:
        raise ValueError(f"a mixing matrix must be square and non-empty, got shape {w.shape}")
    if not np.all(np.isfinite(w)):
        raise ValueError("the mixing matrix has non-finite entries")
    if np.any(w < -atol):
        i, j = np.argwhere(w < -atol)[0]
        raise ValueError(f"the mixing matrix has a negative entry W[{i}, {j}] = {w[i, j]}")
    rows, cols = w.sum(axis=1), w.sum(axis=0)
    if not np.allclose(rows, 1.0, atol=atol):
        i = int(np.argmax(np.abs(rows - 1.0)))
        raise ValueError(f"the mixing matrix is not doubly stochastic: row {i} sums to {rows[i]}")
    if not np.allclose(cols, 1.0, atol=atol):
        j = int(np.argmax(np.abs(cols - 1.0)))
        raise ValueError(
            f"the mixing matrix is not doubly stochastic: column {j} sums to {cols[j]}"
        )
    if not is_connected(w):
        raise ValueError(
            "the mixing matrix's graph is disconnected: some replicas would never mix "
            "(it must be strongly connected)"
        )
    return w


def is_connected(w: np.ndarray) -> bool:
    """Whether the directed graph ``W[i, j] > 0`` is strongly connected."""
    n = w.shape[0]
    adj = np.asarray(w) > _TOL
    for a in (adj, adj.T):
        seen = np.zeros(n, dtype=bool)
        seen[0] = True
        frontier = seen.copy()
        while frontier.any():
            nxt = a[frontier].any(axis=0) & ~seen
            seen |= nxt
            frontier = nxt
        if not seen.all():
            return False
    return True


def is_doubly_stochastic(w: np.ndarray, atol: float = _TOL) -> bool:
    w = np.asarray(w, dtype=float)
    return bool(
        w.ndim == 2
        and w.shape[0] == w.shape[1]
        and np.all(w >= -atol)
        and np.allclose(w.sum(axis=0), 1.0, atol=atol)
        and np.allclose(w.sum(axis=1), 1.0, atol=atol)
    )


def ring_spectral_gap(world_size: int) -> float:
    """Closed form for the fixed ring: ``1 - (1/3 + 2/3 cos(2 pi / n))`` (n >= 3)."""
    n = check_world_size(world_size)
    if n == 1:
        return 1.0
    if n == 2:
        return 1.0
    return 1.0 - (1.0 / 3.0 + 2.0 / 3.0 * math.cos(2.0 * math.pi / n))


def random_ring_spectral_gap(world_size: int) -> float:
    """Closed form for RAND-PSGD: ``1 - (n - 3) / (3 (n - 1))``, which tends to 2/3."""
    n = check_world_size(world_size)
    if n <= 3:
        return 1.0
    return 1.0 - (n - 3) / (3.0 * (n - 1))


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


def _peers_from_matrix(w: np.ndarray, rank: int) -> Peers:
    n = w.shape[0]
    recv = tuple((int(j), float(w[rank, j])) for j in range(n) if j != rank and w[rank, j] > 0)
    send = tuple(int(r) for r in range(n) if r != rank and w[r, rank] > 0)
    return Peers(rank, float(w[rank, rank]), recv, send)


def static_spectral_gap(w: np.ndarray) -> float:
    """``1 - |lambda_2(W)|`` of one matrix: one minus its second largest eigenvalue modulus.

    What :meth:`Topology.spectral_gap` reports for a static topology (1 for a single rank).

    Example::

        >>> static_spectral_gap(np.full((4, 4), 0.25))
        1.0
    """
    w = np.asarray(w, dtype=float)
    if w.shape[0] == 1:
        return 1.0
    moduli = np.sort(np.abs(np.linalg.eigvals(w)))[::-1]
    return float(1.0 - moduli[1])


def _gram_gap(gram: np.ndarray) -> float:
    if gram.shape[0] == 1:
        return 1.0
    eig = np.sort(np.linalg.eigvalsh((gram + gram.T) / 2.0))[::-1]
    return float(1.0 - eig[1])


def powers_of_two_below(n: int) -> list[int]:
    """The hops ``1, 2, 4, ...`` below ``n`` of the (one-peer) exponential graphs.

    Example::

        >>> powers_of_two_below(8), powers_of_two_below(9), powers_of_two_below(1)
        ([1, 2, 4], [1, 2, 4, 8], [])
    """
    hops, h = [], 1
    while h < n:
        hops.append(h)
        h *= 2
    return hops


def check_world_size(world_size: int, minimum: int = 1) -> int:
    """Return ``world_size`` as an ``int``; ``ValueError`` unless it is an integer >= ``minimum``.

    The one world-size check of the package (topologies, AD-PSGD pairings, the simulator).

    Example::

        >>> check_world_size(4)
        4
        >>> check_world_size(1, minimum=2)
        Traceback (most recent call last):
        ...
        ValueError: world_size must be an integer >= 2, got 1
    """
    if (
        isinstance(world_size, bool)
        or not isinstance(world_size, (int, np.integer))
        or world_size < minimum
    ):
        raise ValueError(f"world_size must be an integer >= {minimum}, got {world_size!r}")
    return int(world_size)
