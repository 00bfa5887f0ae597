"""The :class:`Topology` interface and the :class:`Peers` of one rank at one step."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

from lightning_gossip.topology.functions import check_world_size, static_spectral_gap

__all__ = ["Peers", "Topology"]


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
        """The ranks of :attr:`recv_from`, without the weights."""
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


def _peers_from_matrix(w: np.ndarray, rank: int) -> Peers:
    n = w.shape[0]
    recv = tuple((int(j), float(w[rank, j])) for j in range(n) if j != rank and w[rank, j] > 0)
    send = tuple(int(r) for r in range(n) if r != rank and w[r, rank] > 0)
    return Peers(rank, float(w[rank, rank]), recv, send)




def _gram_gap(gram: np.ndarray) -> float:
    if gram.shape[0] == 1:
        return 1.0
    eig = np.sort(np.linalg.eigvalsh((gram + gram.T) / 2.0))[::-1]
    return float(1.0 - eig[1])


