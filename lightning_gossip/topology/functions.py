"""Small pure functions on world sizes, orders and mixing matrices (NumPy only).

The one world-size check (:func:`check_world_size`), mixing-matrix validation, spectral gaps of
one matrix and the closed forms of the ring and the randomized ring.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

__all__ = [
    "check_mixing_matrix",
    "check_world_size",
    "is_connected",
    "is_doubly_stochastic",
    "powers_of_two_below",
    "random_ring_order",
    "random_ring_spectral_gap",
    "ring_spectral_gap",
    "static_spectral_gap",
    "torus_shape",
]

_TOL = 1e-6


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
    """Whether ``w`` is square, non-negative and its rows and columns sum to 1 (within ``atol``)."""
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
