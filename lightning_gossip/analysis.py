"""Topology analysis: spectral gaps (numerical and closed form), communication cost, and the
number of mixing steps needed to reach consensus, predicted and measured.

Everything here works on :mod:`lightning_gossip.topology` objects, the same ones the strategies
exchange with, and backs the ``lightning-gossip topologies`` command.

Two gaps are reported (see :meth:`~lightning_gossip.topology.Topology.spectral_gap`):

* ``gap``: the topology's own definition: ``1 - |lambda_2(W)|`` (second largest eigenvalue
  modulus) for a fixed ``W``, ``1 - lambda_2(E[W_t^T W_t])`` for a time-varying one;
* ``ms_gap``: ``1 - lambda_2(E[W_t^T W_t])`` for both, the per-step contraction of the expected
  squared consensus error; it puts fixed and time-varying graphs on one scale.

Example::

    >>> row = analyze("ring", 64, model_params=1_000_000, measure=False)
    >>> round(row.gap, 4), row.peers, row.bytes_per_step
    (0.0032, 2, 8000000)
    >>> round(closed_form_gaps("random_ring", 64)[0], 4)
    0.6772
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import numpy as np

from lightning_gossip import topology as _topology

__all__ = [
    "TopologyRow",
    "analyze",
    "analyze_all",
    "closed_form_gaps",
    "measure_consensus_steps",
    "predicted_consensus_steps",
]


# ---------------------------------------------------------------------------------------------
# Closed forms (from the spectra of circulant matrices)
# ---------------------------------------------------------------------------------------------


def _circulant_eigs(n: int, offsets: dict[int, float]) -> np.ndarray:
    """Eigenvalues of the circulant matrix with ``W[i, (i + k) % n] = offsets[k]``."""
    m = np.arange(n)
    return sum(w * np.exp(2j * np.pi * m * k / n) for k, w in offsets.items())


def _gaps_from_eigs(eigs: np.ndarray) -> tuple[float, float]:
    """(1 - second largest modulus, 1 - second largest squared modulus) of a normal matrix
    whose eigenvalue for the consensus direction is ``eigs[0] == 1``."""
    rest = np.abs(np.asarray(eigs).ravel()[1:])
    if rest.size == 0:
        return 1.0, 1.0
    top = float(rest.max())
    return 1.0 - top, 1.0 - top**2


def _torus_dim(size: int, m: np.ndarray) -> tuple[np.ndarray, int]:
    """Eigenvalue contribution and degree of one torus dimension (a side of 2 has 1 neighbour)."""
    if size == 2:
        return np.cos(np.pi * m), 1
    return 2.0 * np.cos(2.0 * np.pi * m / size), 2


def closed_form_gaps(name: str, world_size: int) -> tuple[float, float] | None:
    """``(gap, ms_gap)`` of a named topology from its analytic spectrum.

    Every built-in topology is a circulant (the torus a 2-D circulant), so its eigenvalues have
    closed forms; e.g. the ring's are ``(1 + 2 cos(2 pi m / n)) / 3``
    (:func:`~lightning_gossip.topology.ring_spectral_gap`). For the randomized ring,
    ``E[W^T W]`` is ``c I + (1 - c) J / n`` with ``c = (1/3 - 1/n) / (1 - 1/n)``, giving
    ``1 - (n - 3) / (3 (n - 1))`` (:func:`~lightning_gossip.topology.random_ring_spectral_gap`).
    Returns ``None`` for an unknown name; raises ``ValueError`` where the topology itself does
    (torus on a prime world size).
    """
    n = _topology.check_world_size(world_size)
    if n == 1:
        return 1.0, 1.0
    m = np.arange(n)
    if name == "complete":
        return 1.0, 1.0
    if name == "ring":
        # symmetric, and for n >= 3 its second largest eigenvalue modulus is lambda_2 itself
        g = _topology.ring_spectral_gap(n)
        return g, 1.0 - (1.0 - g) ** 2
    if name == "random_ring":
        if n <= 3:
            return closed_form_gaps("ring", n)
        g = _topology.random_ring_spectral_gap(n)
        return g, g
    if name == "exponential":
        hops = _topology.powers_of_two_below(n)
        w = 1.0 / (len(hops) + 1)
        return _gaps_from_eigs(_circulant_eigs(n, {0: w, **{-h: w for h in hops}}))
    if name == "one_peer_exponential":
        hops = _topology.powers_of_two_below(n)
        # W_k = (I + P^{h_k}) / 2 has eigenvalues (1 + w^{m h_k}) / 2, |.|^2 = (1 + cos) / 2.
        sq = np.mean([(1.0 + np.cos(2.0 * np.pi * m * h / n)) / 2.0 for h in hops], axis=0)
        ms = 1.0 - float(sq[1:].max())
        if len(hops) == 1:  # static
            return _gaps_from_eigs(0.5 * (1.0 + np.exp(2j * np.pi * m * hops[0] / n)))
        return ms, ms
    if name == "torus":
        rows, cols = _topology.torus_shape(n)
        fr, dr = _torus_dim(rows, np.arange(rows))
        fc, dc = _torus_dim(cols, np.arange(cols))
        eigs = (1.0 + fr[:, None] + fc[None, :]) / (dr + dc + 1)
        return _gaps_from_eigs(eigs.ravel())
    return None


# ---------------------------------------------------------------------------------------------
# Consensus speed
# ---------------------------------------------------------------------------------------------


def predicted_consensus_steps(ms_gap: float, tolerance: float = 1e-3) -> float:
    """Steps until the RMS consensus error shrinks by ``tolerance``, from the mean-square gap.

    The expected squared error contracts by ``1 - ms_gap`` per step, so
    ``t = 2 ln(1 / tolerance) / -ln(1 - ms_gap)``; ``inf`` for a gap of 0 (disconnected).
    For a fixed symmetric ``W`` this is the exact asymptotic rate of the slowest mode.
    """
    if not 0.0 < tolerance < 1.0:
        raise ValueError(f"tolerance must be in (0, 1), got {tolerance}")
    if ms_gap >= 1.0 - 1e-12:
        return 1.0
    if ms_gap <= 0.0:
        return math.inf
    return 2.0 * math.log(1.0 / tolerance) / -math.log1p(-ms_gap)


def measure_consensus_steps(
    topo: _topology.Topology,
    tolerance: float = 1e-3,
    max_steps: int = 100_000,
    vectors: int = 4,
    seed: int = 0,
) -> int | None:
    """Run ``x <- W_t x`` from random vectors; the first step where the consensus error
    ``||X - mean(X)||_F`` is at most ``tolerance`` times its start value (``None``: not reached
    within ``max_steps``).

    ``vectors`` random vectors are mixed at once, as the columns of an ``(n, vectors)`` matrix,
    so one run probes every mode. NumPy fp64 with sparse mixing (only the non-zero entries of
    ``W_t``), so the CLI's ``topologies`` command never imports torch.
    """
    x = np.random.default_rng(seed).standard_normal((topo.world_size, vectors))
    err0 = float(np.linalg.norm(x - x.mean(0)))
    if err0 == 0.0:
        return 0
    if topo.world_size == 1:
        return 0
    target = tolerance * err0
    plan = None
    for t in range(max_steps):
        if plan is None or topo.is_time_varying:
            w = topo.mixing_matrix(t)
            rows, cols = np.nonzero(w)
            starts = np.searchsorted(rows, np.arange(len(w)))
            plan = (rows, cols, w[rows, cols][:, None], starts)
        rows, cols, vals, starts = plan
        x = np.add.reduceat(vals * x[cols], starts, axis=0)
        if float(np.linalg.norm(x - x.mean(0))) <= target:
            return t + 1
    return None


# ---------------------------------------------------------------------------------------------
# One row of the report
# ---------------------------------------------------------------------------------------------


@dataclass
class TopologyRow:
    """What ``lightning-gossip topologies`` prints for one topology and world size."""

    topology: str
    world_size: int
    gap: float | None = None
    gap_closed_form: float | None = None
    ms_gap: float | None = None
    ms_gap_closed_form: float | None = None
    peers: int | None = None
    bytes_per_step: int | None = None
    steps_predicted: float | None = None
    steps_measured: int | None = None
    max_steps: int | None = None
    error: str | None = None

    def as_dict(self) -> dict:
        """The row as a JSON-ready dict (an infinite prediction becomes ``None``)."""
        d = asdict(self)
        if d["steps_predicted"] is not None and math.isinf(d["steps_predicted"]):
            d["steps_predicted"] = None
        return d


def analyze(
    name: str,
    world_size: int,
    model_params: int = 25_557_032,
    bytes_per_param: int = 4,
    tolerance: float = 1e-3,
    max_steps: int = 100_000,
    seed: int = 0,
    measure: bool = True,
) -> TopologyRow:
    """Analyze one topology at one world size (see :class:`TopologyRow`).

    ``bytes_per_step`` is what one rank sends per step: ``peers * model_params *
    bytes_per_param``, where ``peers`` is the most ranks any rank sends to in one step (for
    ``complete`` done point-to-point; an all-reduce reaches the same average sending about
    ``2 (n - 1) / n`` models per rank). A topology that does not exist for ``world_size``
    (a torus on a prime number) gives a row whose ``error`` says why.
    """
    row = TopologyRow(name, world_size, max_steps=max_steps)
    try:
        topo = _topology.build(name, world_size, seed)
    except ValueError as e:
        row.error = str(e).split(";")[0].split(". ")[0]
        return row
    row.gap = topo.spectral_gap()
    row.ms_gap = topo.mean_square_gap()
    closed = closed_form_gaps(name, world_size)
    if closed is not None:
        row.gap_closed_form, row.ms_gap_closed_form = closed
    row.peers = topo.degree(0)
    row.bytes_per_step = int(row.peers * model_params * bytes_per_param)
    row.steps_predicted = predicted_consensus_steps(max(row.ms_gap, 0.0), tolerance)
    if measure:
        row.steps_measured = measure_consensus_steps(topo, tolerance, max_steps, seed=seed)
    return row


def analyze_all(
    names: Iterable[str], world_sizes: Iterable[int], progress: bool = False, **kwargs
) -> list[TopologyRow]:
    """:func:`analyze` for every ``(name, world_size)``, with an optional tqdm progress bar."""
    from tqdm.auto import tqdm

    jobs = [(name, n) for name in names for n in world_sizes]
    rows = []
    with tqdm(jobs, desc="topologies", disable=not progress, leave=False) as bar:
        for name, n in bar:
            bar.set_postfix_str(f"{name} n={n}")
            rows.append(analyze(name, n, **kwargs))
    return rows
